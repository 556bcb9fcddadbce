"""Cache simulations against brute-force simulations; Belady bounds every policy."""
from __future__ import annotations

from functools import lru_cache

import numpy as np
import pytest

from flowrec.data.cachesim import (
    batch_trace, belady_hits, hit_rate_curves, lfu_hits, lookahead_hits, lru_hits, static_hits,
)


def zipf_batches(seed: int, batches: int = 12, size: int = 10, rows: int = 30) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    perm = rng.permutation(rows) + 1
    return [perm[np.minimum(rng.zipf(1.3, size) - 1, rows - 1)] for _ in range(batches)]


def naive_lru(trace, cap):
    cache, hits = [], 0
    for x in trace.tolist():
        if x in cache:
            hits += 1
            cache.remove(x)
        elif len(cache) >= cap:
            cache.pop(0)
        cache.append(x)
    return hits


def naive_lfu(trace, cap):
    cache, count, last, hits = set(), {}, {}, 0
    for t, x in enumerate(trace.tolist()):
        count[x] = count.get(x, 0) + 1
        if x in cache:
            hits += 1
        elif len(cache) >= cap:
            cache.remove(min(cache, key=lambda r: (count[r], last[r])))
        cache.add(x)
        last[x] = t
    return hits


def naive_lookahead(trace, batch_of, cap, window):
    cache, hits = [], 0
    for b in range(batch_of.max() + 1):
        protected = set(trace[(batch_of >= b) & (batch_of < b + window)].tolist())
        for x in trace[batch_of == b].tolist():
            if x in cache:
                hits += 1
                cache.remove(x)
                cache.append(x)
                continue
            if len(cache) >= cap:
                victims = [r for r in cache if r not in protected]
                if not victims:
                    continue
                cache.remove(victims[0])
            cache.append(x)
    return hits


def exhaustive_opt(trace, cap):
    """Fewest misses of any demand-fetch cache (insert or bypass, any victim): search over states."""
    seq = tuple(trace.tolist())

    @lru_cache(maxsize=None)
    def best(t, cache):
        if t == len(seq):
            return 0
        x = seq[t]
        if x in cache:
            return 1 + best(t + 1, cache)
        options = [best(t + 1, cache)]  # bypass
        if len(cache) < cap:
            options.append(best(t + 1, cache | {x}))
        else:
            options += [best(t + 1, (cache - {v}) | {x}) for v in cache]
        return max(options)

    return best(0, frozenset())


@pytest.mark.parametrize("seed", range(6))
def test_policies_equal_brute_force(seed):
    trace, which = batch_trace(zipf_batches(seed))
    caps = [1, 2, 3, 5, 8, 13, 40]
    assert lru_hits(trace, caps).tolist() == [naive_lru(trace, c) for c in caps]
    for c in caps:
        assert lfu_hits(trace, c) == naive_lfu(trace, c)
        for w in (1, 2, 4, 20):
            assert lookahead_hits(trace, which, c, w) == naive_lookahead(trace, which, c, w)


@pytest.mark.parametrize("seed", range(4))
def test_belady_is_optimal_on_tiny_traces(seed):
    trace, _ = batch_trace(zipf_batches(seed, batches=4, size=5, rows=8))
    for cap in (1, 2, 3):
        assert belady_hits(trace, cap) == exhaustive_opt(trace, cap)


@pytest.mark.parametrize("seed", range(4))
def test_belady_bounds_every_policy(seed):
    trace, which = batch_trace(zipf_batches(seed, batches=40, size=40, rows=300))
    curves = hit_rate_curves(trace, which, window=4)
    assert curves["capacity_rows"][-1] == len(np.unique(trace))
    for name, rates in curves.items():
        if name in ("capacity_rows", "belady"):
            continue
        assert all(r <= b + 1e-12 for r, b in zip(rates, curves["belady"])), name
    assert curves["belady"][-1] == pytest.approx(1 - len(np.unique(trace)) / len(trace))
    assert all(np.diff(curves["belady"]) >= 0) and all(np.diff(curves["lru"]) >= 0)


def test_static_hot_set_counts_hottest_rows_after_first_access():
    trace = np.array([5, 5, 5, 7, 7, 9])
    assert [static_hits(trace, c) for c in (0, 1, 2, 3)] == [0, 2, 3, 3]
