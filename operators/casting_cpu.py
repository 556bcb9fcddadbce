"""The casted index on the CPU in one numba pass: a stable radix sort of the ids, then the runs.

Torch's operators (`operators.casting.torch_casting`) sort the ids with `torch.sort(stable=True)`
(a comparison sort), spread the bag indices with `repeat_interleave`, gather them and find the
runs: on a DLRM batch (106,496 ids of 26 Criteo fields, one thread) 2.77-4.21 ms, most of it the
sort (1.8-4.1 ms). The data
stage computes a casting for every batch beside the training steps, so on a small CPU those
milliseconds are taken from the steps' cores; and torch's operators called from a data thread
open a parallel region of their own there, which the compute threads then wait on.

`cast_index` does the same work in one single-threaded kernel that releases the GIL:

- a least-significant-digit radix sort of (id, position) pairs, 13 bits a pass (8 beyond 2^18
  ids), as many passes as the largest id has digits (a pass whose digit is the same for every
  id is skipped). Each
  pass keeps the order of equal digits, so the result is the stable order, the one permutation
  `torch.sort(stable=True)` also gives: the outputs are equal, element for element;
- the bag of each sorted position read from the offsets (bag b holds positions
  offsets[b] .. offsets[b + 1] - 1), or the permutation itself where every bag holds one id
  (DLRM's fields: position k is bag k);
- the unique ids, their run lengths and the run boundaries in one pass over the sorted ids.

Ids must be non-negative and the offsets a valid partition of them (offsets[0] == 0, offsets
non-decreasing, offsets[-1] == len(ids)); `cast_index` returns None otherwise, and the caller
takes torch's path, which raises its own error where the input is invalid. Compiled once and
cached on disk by numba (`cache=True`; `NUMBA_CACHE_DIR` overrides where).

Example:
    >>> import numpy as np
    >>> unique, counts, bounds, bags = cast_index(np.array([5, 2, 5, 7]), np.array([0, 2, 2, 4]))
    >>> unique.tolist(), counts.tolist(), bounds.tolist(), bags.tolist()
    ([2, 5, 7], [1, 2, 1], [0, 1, 3, 4], [0, 0, 2, 2])
"""
from __future__ import annotations

import numpy as np
from numba import njit

WIDE_DIGIT_BITS = 13  # 8,192 buckets a pass (two passes for ids below 2^26), up to WIDE_DIGIT_IDS ids ...
WIDE_DIGIT_IDS = 1 << 18
NARROW_DIGIT_BITS = 8  # ... and 256 a pass beyond: a pass's writes go to as many places as it has
# buckets, and once the arrays outgrow the caches 8,192 of them miss on every write (one thread,
# 1,024,000 ids below 1.5e8: 21-26 ms with 13 bits, 12.2-12.7 ms with 8; 106,496 ids below
# 3.4e7: 0.58 ms with 13 bits, 1.02 ms with 8)


@njit(cache=True, nogil=True)
def _check(ids, offsets):
    """0 where `offsets` do not partition `ids` into bags or an id is negative; else 2 where every
    bag holds one id (bag k is position k), 1 otherwise."""
    n = ids.shape[0]
    if offsets.shape[0] < 1 or offsets[0] != 0 or offsets[offsets.shape[0] - 1] != n:
        return 0
    unit = offsets.shape[0] - 1 == n
    for b in range(offsets.shape[0] - 1):
        length = offsets[b + 1] - offsets[b]
        if length < 0:
            return 0
        if length != 1:
            unit = False
    for i in range(n):
        if ids[i] < 0:
            return 0
    return 2 if unit else 1


@njit(cache=True, nogil=True)
def _stable_order(ids, bits):
    """(sorted ids, the stable sorting permutation) by LSD radix sort, `bits` a digit.
    # (n,), (n,) int64"""
    n = ids.shape[0]
    radix = 1 << bits
    top = 0
    for i in range(n):
        if ids[i] > top:
            top = ids[i]
    keys, order = ids.copy(), np.arange(n, dtype=np.int64)
    keys_out, order_out = np.empty(n, np.int64), np.empty(n, np.int64)
    counts = np.empty(radix, np.int64)
    shift = 0
    while shift == 0 or (top >> shift) > 0:
        counts[:] = 0
        for i in range(n):
            counts[(keys[i] >> shift) & (radix - 1)] += 1
        if n > 0 and counts[(keys[0] >> shift) & (radix - 1)] != n:  # else one digit for every id: order kept
            total = 0
            for d in range(radix):
                c = counts[d]
                counts[d] = total
                total += c
            for i in range(n):
                d = (keys[i] >> shift) & (radix - 1)
                at = counts[d]
                counts[d] = at + 1
                keys_out[at] = keys[i]
                order_out[at] = order[i]
            keys, keys_out = keys_out, keys
            order, order_out = order_out, order
        shift += bits
        if shift >= 63:
            break
    return keys, order


@njit(cache=True, nogil=True)
def _cast(ids, offsets, unit):
    """(unique ids, counts, run boundaries, bag of each sorted position) of valid input (`unit`:
    one id per bag, so position k is bag k and the permutation is the sorted bags)."""
    n = ids.shape[0]
    keys, order = _stable_order(ids, WIDE_DIGIT_BITS if n <= WIDE_DIGIT_IDS else NARROW_DIGIT_BITS)
    if unit:
        sorted_bags = order
    else:
        bags = np.empty(n, np.int64)
        for b in range(offsets.shape[0] - 1):
            for p in range(offsets[b], offsets[b + 1]):
                bags[p] = b
        sorted_bags = np.empty(n, np.int64)
        for i in range(n):
            sorted_bags[i] = bags[order[i]]
    runs = 0
    for i in range(n):
        if i == 0 or keys[i] != keys[i - 1]:
            runs += 1
    unique = np.empty(runs, np.int64)
    counts = np.empty(runs, np.int64)
    bounds = np.empty(runs + 1, np.int64)
    u = -1
    for i in range(n):
        if i == 0 or keys[i] != keys[i - 1]:
            u += 1
            unique[u] = keys[i]
            bounds[u] = i
            counts[u] = 0
        counts[u] += 1
    bounds[runs] = n
    return unique, counts, bounds, sorted_bags


def cast_index(ids: np.ndarray, offsets: np.ndarray
               ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """(unique ids, counts, unique offsets, sorted bags) of `ids` (int64, non-negative) in bags
    `offsets` (int64), equal to `operators.casting.compute_casting`'s; None where the input is
    not a valid partition of non-negative ids (the caller's own path reports it).
    # (U,), (U,), (U + 1,), (nnz,) int64"""
    ids = np.ascontiguousarray(ids, dtype=np.int64)
    offsets = np.ascontiguousarray(offsets, dtype=np.int64)
    kind = _check(ids, offsets)
    if kind == 0:
        return None
    return _cast(ids, offsets, kind == 2)
