"""Shared helpers of the cache tests and benchmarks: a small multi-group spec, its staged batches
with lookahead, and training a packed group against the device-resident reference.

Example:
    >>> spec = cache_spec()
    >>> [g.name for g in groups_of(spec, "fp64")]
    ['g0_d4', 'g1_d8']
"""
from __future__ import annotations

from dataclasses import replace

import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.packing import group_layout
from flowrec.spec import spec_from_dict
from operators.embedding import PackedEmbeddingBag

CPU = torch.device("cpu")


def cache_spec(optimizer: str = "adagrad"):
    return spec_from_dict({
        "name": "cache",
        "features": [
            {"name": "d", "type": "dense", "transform": "log1p"},
            {"name": "a", "type": "categorical", "hash_buckets": 300, "dim": 8},
            {"name": "b", "type": "categorical", "vocab": 120, "dim": 8},
            {"name": "s", "type": "sequence", "vocab": 200, "dim": 8, "max_len": 3, "pooling": "mean"},
            {"name": "c", "type": "categorical", "hash_buckets": 500, "dim": 4},
        ],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "training": {"batch_size": 32, "seed": 3},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": optimizer, "lr": 0.05}},
    })


def staged(spec, rows: int = 640, window: int = 3, seed: int = 11):
    table = synth_table(spec, rows, SynthConfig(seed=seed, alpha=1.2))
    src = MemorySource(split_table(table, 3))
    opts = StagingOptions(batch_size=spec.training.batch_size, shuffle_buffer=128, workers=1, lookahead=window)
    with iterate_batches(spec, src, opts) as it:
        return list(it)


def groups_of(spec, dtype: str):
    return [replace(g, dtype=dtype) for g in group_layout(spec)]


def head_weights(group, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(group.bags_per_sample, group.dim, generator=gen)  # (S, D)


def loss_of(out: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.tanh(out * w.to(out.dtype)).sum()


def train_reference(group, batches, seed: int = 3):
    ref = PackedEmbeddingBag(group, seed=seed)
    w = head_weights(group)
    for batch in batches:
        g = batch.groups[group.name]
        loss_of(ref(g.ids, g.offsets, g.casting), w).backward()
    return ref.weight, ref.state


def train_cached(module, group, batches):
    w = head_weights(group)
    for batch in batches:
        loss_of(module.forward_group(batch.groups[group.name]), w).backward()
    return module.full_tables()


def assert_same(a, b, dtype):
    for x, y in zip(a, b):
        if dtype == "fp64":
            assert torch.equal(x, y)
        else:
            torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def window_rows(batches, name):
    return max(b.groups[name].window_unique.numel() for b in batches)
