"""Cache simulations over an access trace: LRU, LFU, static hot set, lookahead(W), Belady.

The trace is what a cache sees: per batch, the unique rows of the batch (a batch fetches each
distinct row once), concatenated in batch order. Every policy starts empty and counts the first
access of a row as a miss, so all are demand-fetch policies and Belady's OPT (evict the row used
furthest in the future, or bypass the incoming row if it is used later than all cached ones)
bounds them all. Costs: LRU for every capacity at once from stack distances (Fenwick tree,
O(n log n)); Belady and LFU with lazy heaps (O(n log C)); static hot set from counts; lookahead
evicts the least recently used row not used by the next W batches.

Example:
    >>> trace = np.array([1, 2, 1, 3, 1, 2])
    >>> lru_hits(trace, [1, 2, 3]).tolist()
    [0, 2, 3]
"""
from __future__ import annotations

import heapq
from collections import OrderedDict
from typing import Sequence

import numpy as np

NEVER = np.iinfo(np.int64).max  # next use of a row that is not used again


def batch_trace(batches: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """(trace, batch index of each access): the sorted unique rows of each batch, concatenated."""
    uniques = [np.unique(b) for b in batches]
    trace = np.concatenate(uniques) if uniques else np.zeros(0, np.int64)
    which = np.repeat(np.arange(len(uniques)), [len(u) for u in uniques])
    return trace.astype(np.int64), which


def next_use(trace: np.ndarray) -> np.ndarray:
    """Position of the next access of the same row (NEVER if none)."""
    n = len(trace)
    order = np.lexsort((np.arange(n), trace))
    nxt = np.full(n, NEVER, np.int64)
    same = trace[order[1:]] == trace[order[:-1]]
    nxt[order[:-1][same]] = order[1:][same]
    return nxt


def stack_distances(trace: np.ndarray) -> np.ndarray:
    """LRU stack distance of each access: distinct rows touched since its previous access (-1: first)."""
    n = len(trace)
    tree = np.zeros(n + 1, np.int64)  # Fenwick tree over positions: 1 at each row's latest access
    last: dict[int, int] = {}
    out = np.full(n, -1, np.int64)
    for t, x in enumerate(trace.tolist()):
        p = last.get(x)
        if p is not None:
            i, s = t, 0  # count of markers in (p, t) = prefix(t) - prefix(p + 1)
            while i > 0:
                s += tree[i]
                i -= i & -i
            i = p + 1
            while i > 0:
                s -= tree[i]
                i -= i & -i
            out[t] = s
            i = p + 1
            while i <= n:
                tree[i] -= 1
                i += i & -i
        i = t + 1
        while i <= n:
            tree[i] += 1
            i += i & -i
        last[x] = t
    return out


def lru_hits(trace: np.ndarray, capacities: Sequence[int]) -> np.ndarray:
    """LRU hits for each capacity (an access hits iff its stack distance < capacity)."""
    d = stack_distances(trace)
    d = np.sort(d[d >= 0])
    return np.searchsorted(d, np.asarray(capacities), side="left")


def static_hits(trace: np.ndarray, capacity: int) -> int:
    """Static hot set: the `capacity` most accessed rows, pinned after their first access."""
    _, counts = np.unique(trace, return_counts=True)
    top = np.sort(counts)[::-1][:capacity]
    return int((top - 1).sum())


def lfu_hits(trace: np.ndarray, capacity: int) -> int:
    """LFU (frequencies over the whole past, ties: least recent), always inserting."""
    if capacity <= 0:
        return 0
    count: dict[int, int] = {}
    cached: dict[int, tuple[int, int]] = {}
    heap: list[tuple[int, int, int]] = []
    hits = 0
    for t, x in enumerate(trace.tolist()):
        c = count.get(x, 0) + 1
        count[x] = c
        if x in cached:
            hits += 1
        elif len(cached) >= capacity:
            while True:
                cnt, last, victim = heapq.heappop(heap)
                if cached.get(victim) == (cnt, last):
                    del cached[victim]
                    break
        cached[x] = (c, t)
        heapq.heappush(heap, (c, t, x))
    return hits


def belady_hits(trace: np.ndarray, capacity: int) -> int:
    """Belady's OPT with bypass: the most hits any demand-fetch cache of this capacity gets."""
    if capacity <= 0:
        return 0
    nxt = next_use(trace)
    cached: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    for x, nu in zip(trace.tolist(), nxt.tolist()):
        if x in cached:
            hits += 1
        elif len(cached) >= capacity:
            while -heap[0][0] != cached.get(heap[0][1]):
                heapq.heappop(heap)
            far, victim = -heap[0][0], heap[0][1]
            if far <= nu:
                continue  # bypass: the incoming row is needed later than every cached one
            heapq.heappop(heap)
            del cached[victim]
        cached[x] = nu
        heapq.heappush(heap, (-nu, x))
    return hits


def lookahead_hits(trace: np.ndarray, batch_of: np.ndarray, capacity: int, window: int) -> int:
    """Lookahead cache: a miss evicts the least recently used row that no batch of the window
    (this batch and the next window-1) uses; with no such row the fetched row bypasses the cache.

    Cached rows are split into `pinned` (used in the current window) and `evictable` (LRU order):
    a row moves to the MRU end of `evictable` when it leaves the window, so O(n) in all.
    """
    if capacity <= 0 or not len(trace):
        return 0
    bounds = np.concatenate([[0], np.cumsum(np.bincount(batch_of))])
    batches = [trace[bounds[b]:bounds[b + 1]].tolist() for b in range(len(bounds) - 1)]
    in_window: dict[int, int] = {}
    pinned: set[int] = set()
    evictable: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for b in range(min(window - 1, len(batches))):
        for x in batches[b]:
            in_window[x] = in_window.get(x, 0) + 1
    for b, rows in enumerate(batches):
        if b + window - 1 < len(batches):
            for x in batches[b + window - 1]:
                in_window[x] = in_window.get(x, 0) + 1
                if x in evictable:
                    del evictable[x]
                    pinned.add(x)
        for x in rows:
            if x in pinned:
                hits += 1
            elif len(pinned) + len(evictable) < capacity:
                pinned.add(x)
            elif evictable:
                evictable.popitem(last=False)
                pinned.add(x)
        for x in rows:
            in_window[x] -= 1
            if not in_window[x]:
                del in_window[x]
                if x in pinned:
                    pinned.remove(x)
                    evictable[x] = None
    return hits


def capacities_for(distinct: int, points: int = 12) -> list[int]:
    """Log-spaced cache capacities from 1 row up to every distinct row."""
    if distinct <= 0:
        return []
    return sorted({int(round(c)) for c in np.geomspace(1, distinct, points)})


def hit_rate_curves(trace: np.ndarray, batch_of: np.ndarray, window: int,
                    capacities: Sequence[int] | None = None) -> dict[str, list[float]]:
    """Hit rates per capacity for lru, lfu, static_hot, lookahead, belady (+ the capacities)."""
    n = max(len(trace), 1)
    caps = list(capacities) if capacities is not None else capacities_for(len(np.unique(trace)))
    return {
        "capacity_rows": caps,
        "lru": (lru_hits(trace, caps) / n).tolist(),
        "lfu": [lfu_hits(trace, c) / n for c in caps],
        "static_hot": [static_hits(trace, c) / n for c in caps],
        f"lookahead_w{window}": [lookahead_hits(trace, batch_of, c, window) / n for c in caps],
        "belady": [belady_hits(trace, c) / n for c in caps],
    }
