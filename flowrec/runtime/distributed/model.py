"""A lowered model's packed groups across ranks, as its plan shards them.

A `row_wise` group becomes a `ShardedPackedEmbedding` (this rank's rows only), a `replicated`
group a `ReplicatedPackedEmbedding` (the whole table on every rank). The lookups of all groups
of a step run together (`schedule.lookup_groups`: one autograd node, so every rank issues the same
collectives in the same order, forward and backward; K-interleaving overlaps one group's exchange
with another's gather or pooling).

The checkpoint layout of such a model lives in `flowrec.runtime.checkpoint.layout`: distributed
code knows nothing of checkpoints.

Example:
    >>> modules = sharded_embeddings(plan.meta.groups, seed, device, world)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import PackedGroup
from flowrec.runtime.distributed.replicated import ReplicatedPackedEmbedding
from flowrec.runtime.distributed.schedule import lookup_groups
from flowrec.runtime.distributed.sharded import ShardedPackedEmbedding
from flowrec.runtime.distributed.world import World


class ShardingError(ValueError):
    """A group whose placement or sharding this distributed runtime cannot run."""


def sharded_embeddings(groups: tuple[PackedGroup, ...], seed: int, device: torch.device,
                       world: World) -> dict[str, nn.Module]:
    """One module per group for its sharding (this rank's rows of a row-wise group)."""
    out: dict[str, nn.Module] = {}
    for g in groups:
        if PLACEMENTS[g.placement].cached:
            raise ShardingError(f"group {g.name}: cache placement {g.placement} is not yet supported for "
                                f"sharded groups")
        if g.sharding == "replicated":
            out[g.name] = ReplicatedPackedEmbedding(g, world.embedding_group, seed, device)
        else:
            out[g.name] = ShardedPackedEmbedding(g, world.size, world.rank, world.embedding_group, seed, device)
    return out


def embed_all(model: Any, batch: Any, interleave: bool) -> dict[str, torch.Tensor]:
    """Pooled lookups of every group for this rank's samples, in the plan's group order.
    # {group: (B_r, S, D)}"""
    names = list(model.group_order)
    inputs = []
    for name in names:
        ids = batch.groups[name]
        inputs.append((ids.ids.to(model.device, non_blocking=True),
                       ids.offsets.to(model.device, non_blocking=True), ids.casting))
    outs = lookup_groups([model.embeddings[n] for n in names], inputs, interleave)
    return dict(zip(names, outs))
