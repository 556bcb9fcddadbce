"""Cache simulations over an access trace: LRU, LFU, static hot set, lookahead(W), Belady.

The trace is what a cache sees: per batch, the unique rows of the batch (a batch fetches each
distinct row once), concatenated in batch order. Every policy starts empty and counts the first
access of a row as a miss, so all are demand-fetch policies and Belady's OPT (evict the row used
furthest in the future, or bypass the incoming row if it is used later than all cached ones)
bounds them all. Costs: LRU for every capacity at once from stack distances (Fenwick tree,
O(n log n)); Belady and LFU with lazy heaps (O(n log C)); static hot set from counts; lookahead
evicts the least recently used row not used by the next W batches. The simulations run as numba
loops over the trace's rows renumbered 0..D-1 (`_dense`), with arrays where a row's state was a
dict entry: `flowrec data profile` simulates five policies at twelve sizes per group, which took
2-2.5 s a group of 100,000 accesses in Python.

Example:
    >>> trace = np.array([1, 2, 1, 3, 1, 2])
    >>> lru_hits(trace, [1, 2, 3]).tolist()
    [0, 2, 3]
"""
from __future__ import annotations

import heapq
from typing import Sequence

import numpy as np
from numba import njit

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


def _dense(trace: np.ndarray) -> tuple[np.ndarray, int]:
    """The trace's rows renumbered 0..D-1 (D distinct rows): (renumbered trace, D)."""
    rows, dense = np.unique(trace, return_inverse=True)
    return dense.reshape(-1).astype(np.int64), len(rows)


def stack_distances(trace: np.ndarray) -> np.ndarray:
    """LRU stack distance of each access: distinct rows touched since its previous access (-1: first)."""
    dense, distinct = _dense(np.asarray(trace))
    return _stack_distances(dense, distinct)


@njit(nogil=True, cache=True)
def _stack_distances(trace, distinct):
    n = trace.shape[0]
    tree = np.zeros(n + 1, np.int64)  # Fenwick tree over positions: 1 at each row's latest access
    last = np.full(distinct, -1, np.int64)
    out = np.full(n, -1, np.int64)
    for t in range(n):
        x = trace[t]
        p = last[x]
        if p >= 0:
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
    return _lru_from(stack_distances(trace), capacities)


def _lru_from(distances: np.ndarray, capacities: Sequence[int]) -> np.ndarray:
    d = np.sort(distances[distances >= 0])
    return np.searchsorted(d, np.asarray(capacities), side="left")


def static_hits(trace: np.ndarray, capacity: int) -> int:
    """Static hot set: the `capacity` most accessed rows, pinned after their first access."""
    _, counts = np.unique(trace, return_counts=True)
    return _static_from(np.sort(counts)[::-1], capacity)


def _static_from(hottest_first: np.ndarray, capacity: int) -> int:
    """`static_hits` from the rows' access counts, largest first."""
    return int((hottest_first[:capacity] - 1).sum())


def lfu_hits(trace: np.ndarray, capacity: int) -> int:
    """LFU (frequencies over the whole past, ties: least recent), always inserting."""
    if capacity <= 0 or not len(trace):
        return 0
    dense, distinct = _dense(np.asarray(trace))
    return int(_lfu_hits(dense, distinct, capacity))


@njit(nogil=True, cache=True)
def _lfu_hits(trace, distinct, capacity):
    count = np.zeros(distinct, np.int64)
    cached = np.zeros(distinct, np.bool_)
    key_count = np.zeros(distinct, np.int64)  # a cached row's heap key: (count, time) when inserted
    key_time = np.zeros(distinct, np.int64)
    heap = [(np.int64(0), np.int64(0), np.int64(0))]  # (count, time, row), stale entries skipped
    heap.pop()
    size = 0
    hits = 0
    for t in range(trace.shape[0]):
        x = trace[t]
        count[x] += 1
        c = count[x]
        if cached[x]:
            hits += 1
        elif size >= capacity:
            while True:
                cnt, last, victim = heapq.heappop(heap)
                if cached[victim] and key_count[victim] == cnt and key_time[victim] == last:
                    cached[victim] = False
                    size -= 1
                    break
        if not cached[x]:
            cached[x] = True
            size += 1
        key_count[x] = c
        key_time[x] = t
        heapq.heappush(heap, (c, np.int64(t), x))
    return hits


def belady_hits(trace: np.ndarray, capacity: int) -> int:
    """Belady's OPT with bypass: the most hits any demand-fetch cache of this capacity gets."""
    if capacity <= 0 or not len(trace):
        return 0
    dense, distinct = _dense(np.asarray(trace))
    return int(_belady_hits(dense, next_use(dense), distinct, capacity))


@njit(nogil=True, cache=True)
def _belady_hits(trace, nxt, distinct, capacity):
    cached = np.zeros(distinct, np.bool_)
    cached_next = np.zeros(distinct, np.int64)  # a cached row's next use, its heap key
    heap = [(np.int64(0), np.int64(0))]  # (-next use, row), stale entries skipped
    heap.pop()
    size = 0
    hits = 0
    for t in range(trace.shape[0]):
        x, nu = trace[t], nxt[t]
        if cached[x]:
            hits += 1
        elif size >= capacity:
            while not (cached[heap[0][1]] and cached_next[heap[0][1]] == -heap[0][0]):
                heapq.heappop(heap)
            far, victim = -heap[0][0], heap[0][1]
            if far <= nu:
                continue  # bypass: the incoming row is needed later than every cached one
            heapq.heappop(heap)
            cached[victim] = False
            size -= 1
        if not cached[x]:
            cached[x] = True
            size += 1
        cached_next[x] = nu
        heapq.heappush(heap, (-nu, x))
    return hits


def lookahead_hits(trace: np.ndarray, batch_of: np.ndarray, capacity: int, window: int) -> int:
    """Lookahead cache: a miss evicts the least recently used row that no batch of the window
    (this batch and the next window-1) uses; with no such row the fetched row bypasses the cache.

    Cached rows are split into `pinned` (used in the current window) and `evictable` (LRU order,
    a linked list over the rows): a row moves to the MRU end of `evictable` when it leaves the
    window, so O(n) in all.
    """
    if capacity <= 0 or not len(trace):
        return 0
    dense, distinct = _dense(np.asarray(trace))
    return int(_lookahead_hits(dense, _bounds(batch_of), distinct, capacity, window))


def _bounds(batch_of: np.ndarray) -> np.ndarray:
    """Where each batch's accesses start in the trace, and the end (batches in order)."""
    return np.concatenate([[0], np.cumsum(np.bincount(batch_of))]).astype(np.int64)


@njit(nogil=True, cache=True, inline="always")
def _unlink(x, before, after, head, tail):
    """Take row x out of the linked list (before, after); the list's new (head, tail)."""
    if before[x] >= 0:
        after[before[x]] = after[x]
    else:
        head = after[x]
    if after[x] >= 0:
        before[after[x]] = before[x]
    else:
        tail = before[x]
    before[x] = after[x] = -1
    return head, tail


@njit(nogil=True, cache=True)
def _lookahead_hits(trace, bounds, distinct, capacity, window):
    batches = bounds.shape[0] - 1
    in_window = np.zeros(distinct, np.int64)
    pinned = np.zeros(distinct, np.bool_)
    evictable = np.zeros(distinct, np.bool_)
    before = np.full(distinct, -1, np.int64)  # the evictable list, least recently used first
    after = np.full(distinct, -1, np.int64)
    head, tail = -1, -1  # head < 0: no cached row is evictable
    cached, hits = 0, 0
    for b in range(min(window - 1, batches)):
        for k in range(bounds[b], bounds[b + 1]):
            in_window[trace[k]] += 1
    for b in range(batches):
        if b + window - 1 < batches:
            for k in range(bounds[b + window - 1], bounds[b + window]):
                x = trace[k]
                in_window[x] += 1
                if evictable[x]:  # used again inside the window: pinned
                    head, tail = _unlink(x, before, after, head, tail)
                    evictable[x], pinned[x] = False, True
        for k in range(bounds[b], bounds[b + 1]):
            x = trace[k]
            if pinned[x]:
                hits += 1
            elif cached < capacity:
                pinned[x] = True
                cached += 1
            elif head >= 0:
                v = head  # the least recently used row outside the window
                head, tail = _unlink(v, before, after, head, tail)
                evictable[v], pinned[x] = False, True
        for k in range(bounds[b], bounds[b + 1]):
            x = trace[k]
            in_window[x] -= 1
            if in_window[x] == 0 and pinned[x]:  # leaves the window: most recently used evictable
                pinned[x], evictable[x] = False, True
                before[x], after[x] = tail, -1
                if tail >= 0:
                    after[tail] = x
                else:
                    head = x
                tail = x
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
    dense, distinct = _dense(np.asarray(trace))  # once for every policy and size
    caps = list(capacities) if capacities is not None else capacities_for(distinct)
    nxt, bounds = next_use(dense), _bounds(batch_of)
    distances = _stack_distances(dense, distinct)
    hottest_first = np.sort(np.bincount(dense, minlength=distinct))[::-1]  # every renumbered row is accessed

    def rates(hits) -> list[float]:  # hits(capacity) of a capacity above 0; none at 0 or below
        return [(int(hits(c)) if c > 0 and len(dense) else 0) / n for c in caps]

    return {
        "capacity_rows": caps,
        "lru": (_lru_from(distances, caps) / n).tolist(),
        "lfu": rates(lambda c: _lfu_hits(dense, distinct, c)),
        "static_hot": [_static_from(hottest_first, c) / n for c in caps],
        f"lookahead_w{window}": rates(lambda c: _lookahead_hits(dense, bounds, distinct, c, window)),
        "belady": rates(lambda c: _belady_hits(dense, nxt, distinct, c)),
    }
