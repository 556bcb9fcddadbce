"""Cache placements train exactly like device-resident tables: lookahead, LRU, static_hot, host.

float64 tables: bitwise equal tables and optimizer state after many steps with a small cache that
forces evictions; float32: allclose (in practice equal). Lookahead's train-time hit rate is 1.0.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.packing import group_layout
from flowrec.runtime.caches import (CacheCapacityError, HostEmbedding, LookaheadEmbedding, LRUEmbedding,
                                    StaticHotEmbedding, hottest_rows)
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


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
@pytest.mark.parametrize("interleave", [True, False])
@pytest.mark.parametrize("optimizer", ["adagrad", "adam"])
def test_lookahead_equals_device(dtype, interleave, optimizer):
    spec = cache_spec(optimizer)
    batches = staged(spec, window=3)
    for group in groups_of(spec, dtype):
        need = window_rows(batches, group.name)
        assert need < group.rows  # the cache is smaller than the table: evictions happen
        module = LookaheadEmbedding(replace(group, cache_rows=need), seed=3, device=CPU,
                                    interleave=interleave, record=True)
        got = train_cached(module, group, batches)
        assert_same(got, train_reference(group, batches), dtype)
        snap = module.counters.snapshot()
        assert snap["hit_rate"] == 1.0 and snap["rows_written_back"] > 0
        assert sum(len(e.evicted) for e in module.pad.log) > 0
        module.close()


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
def test_lru_equals_device(dtype):
    spec = cache_spec()
    batches = staged(spec, window=1)
    for group in groups_of(spec, dtype):
        cap = max(b.groups[group.name].unique.numel() for b in batches)
        module = LRUEmbedding(group, seed=3, device=CPU, capacity=cap)
        assert_same(train_cached(module, group, batches), train_reference(group, batches), dtype)
        assert module.counters.snapshot()["hit_rate"] < 1.0


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
def test_host_equals_device(dtype):
    spec = cache_spec()
    batches = staged(spec, window=0)
    for group in groups_of(spec, dtype):
        module = HostEmbedding(group, seed=3, device=CPU)
        w = head_weights(group)
        for batch in batches:
            g = batch.groups[group.name]
            loss_of(module(g.ids, g.offsets, g.casting), w).backward()
        assert_same((module.weight, module.state), train_reference(group, batches), dtype)
        assert module.counters.snapshot()["h2d_bytes"] > 0


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
@pytest.mark.parametrize("hot_share", [0.1, 0.5])
def test_static_hot_equals_device(dtype, hot_share):
    spec = cache_spec("rowwise_adagrad")
    batches = staged(spec, window=1)
    for group in groups_of(spec, dtype):
        counts = torch.bincount(torch.cat([b.groups[group.name].ids for b in batches]), minlength=group.rows)
        cap = int(group.rows * hot_share)
        module = StaticHotEmbedding(replace(group, cache_rows=cap), seed=3, device=CPU)
        module.set_hot_rows(hottest_rows(counts, cap))
        assert_same(train_cached(module, group, batches), train_reference(group, batches), dtype)


def test_lookahead_window_larger_than_cache_is_an_error():
    spec = cache_spec()
    batches = staged(spec, rows=96, window=3)
    group = groups_of(spec, "fp32")[0]
    module = LookaheadEmbedding(replace(group, cache_rows=4), seed=3, device=CPU)
    with pytest.raises(CacheCapacityError, match="slots"):
        module.forward_group(batches[0].groups[group.name])


def test_eval_lookup_reads_current_rows():
    spec = cache_spec()
    batches = staged(spec, window=2)
    group = groups_of(spec, "fp64")[0]
    module = LookaheadEmbedding(replace(group, cache_rows=window_rows(batches, group.name)), seed=3, device=CPU)
    train_cached(module, group, batches[:6])
    ref = PackedEmbeddingBag(group, seed=3)
    ref.weight.copy_(module.full_tables()[0])
    g = batches[7].groups[group.name]
    with torch.no_grad():
        assert torch.equal(module.forward_group(g), ref(g.ids, g.offsets))
