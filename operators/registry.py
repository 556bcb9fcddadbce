"""Operator registry: op kind -> operator class (one per kind the planner emits).

Example:
    >>> op = create("dot", {}, [(26, 16)])
    >>> type(op).__name__
    'Dot'
"""
from __future__ import annotations

from typing import Any, Sequence

from torch import nn

from operators.dense import MLP, Concat, Cross, Head, Linear, PackedMLP
from operators.embedding import PackedEmbeddingBag
from operators.interaction import FM, Dot, TargetAttention
from operators.losses import Loss
from operators.custom import CustomModule
from operators.attention import SelfAttention
from operators.similarity import Similarity
from operators.moe import MMoE, PLE
from operators.staging import (DenseInput, EmbeddingLookup, LabelInput, Pooling,
                               SparseInput)

OPERATORS: dict[str, type[nn.Module]] = {
    "dense_input": DenseInput,
    "sparse_input": SparseInput,
    "label_input": LabelInput,
    "embedding_lookup": EmbeddingLookup,
    "pooling": Pooling,
    "packed_embedding": PackedEmbeddingBag,
    "mlp": MLP,
    "packed_mlp": PackedMLP,
    "dot": Dot,
    "fm": FM,
    "cross": Cross,
    "target_attention": TargetAttention,
    "self_attention": SelfAttention,
    "similarity": Similarity,
    "linear": Linear,
    "concat": Concat,
    "head": Head,
    "loss": Loss,
    "moe": MMoE,
    "ple": PLE,
    "custom": CustomModule,
}


def known() -> list[str]:
    """Every registered op kind, sorted."""
    return sorted(OPERATORS)


def get(kind: str) -> type[nn.Module]:
    """The operator class of `kind`; an unknown kind raises KeyError listing the known ones."""
    if kind not in OPERATORS:
        raise KeyError(f"unknown operator kind {kind!r}; known: {', '.join(known())}")
    return OPERATORS[kind]


def create(kind: str, config: dict[str, Any], input_shapes: Sequence[tuple[int, ...]]) -> nn.Module:
    """Build the operator of `kind` from its node config and input shapes (without batch dim).

    Args:
        kind: an op kind.
        config: the node's kind-specific settings (e.g. {"layers": [512, 256]} for mlp;
            {"group": a packed layout, "seed": 0} for packed_embedding).
        input_shapes: shapes of the inputs without the batch dimension.
    """
    return get(kind).from_config(dict(config), list(input_shapes))
