"""Cache placements train exactly like device-resident tables: lookahead, LRU, static_hot, host.

float64 tables: bitwise equal tables and optimizer state after many steps with a small cache that
forces evictions; float32: allclose (in practice equal). Lookahead's train-time hit rate is 1.0.
"""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrec.runtime.caches import (CacheCapacityError, HostEmbedding, LookaheadEmbedding, StaticHotEmbedding,
                                    hottest_rows)
from flowrec.testing.caches import (CPU, assert_same, cache_spec, groups_of, head_weights, loss_of, staged,
                                    train_cached, train_reference, window_rows)
from flowrec.testing.lru import LRUEmbedding
from operators.embedding import PackedEmbeddingBag

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


@pytest.mark.parametrize("seed", range(4))
def test_local_ids_from_the_casting_equal_the_binary_search(seed):
    """`local_ids` (static_hot's cold batches): each id's place among the batch's unique rows from
    the casting's runs where every bag holds one id, the binary search otherwise; the same integers
    on skewed random batches, also where as many ids as bags sit in bags of 0 and 2 ids."""
    from flowrec.runtime.caches.slots import local_ids
    from operators.casting import compute_casting

    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(1, 3000, (1,), generator=gen))
    ids = (torch.rand(n, generator=gen) ** 3 * 5000).long()  # skewed: many repeats of the small ids
    single = torch.arange(n + 1)
    lengths = torch.ones(n, dtype=torch.int64)
    if n >= 2:
        lengths[0], lengths[1] = 0, 2  # as many ids as bags, but not one id per bag
    uneven = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    for offsets in (single, uneven):
        c = compute_casting(ids, offsets)
        got = local_ids(ids, c.unique_ids, c, offsets)
        assert torch.equal(got, torch.searchsorted(c.unique_ids, ids))
        assert torch.equal(c.unique_ids[got], ids)

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
