"""Stratified shuffling: which rows of a chunk make each global batch, and which rows a rank needs.

A shuffled epoch is cut into chunks of `chunk_rows` consecutive rows of the epoch stream (the
shuffle buffer). A chunk is split into STRATA consecutive strata; each stratum is permuted on its
own, and global batch k of the chunk takes, from every stratum s in turn, its next `b_s` permuted
rows, where the `b_s` split the batch size as evenly as possible (`widths`). So every batch mixes
rows from the whole chunk, as a permutation of the chunk would, and the layout is a pure function
of (seed, epoch, chunk, the chunk's row count, the batch size): the same for every world size.

What this buys: rank r of W trains the contiguous slice r of every global batch
(`batches.rank_slice`), and that slice draws on a contiguous run of about STRATA/W strata: one
contiguous range of about 1/W of the chunk. A rank reads only that range's row groups.

Example:
    >>> rng = np.random.default_rng(0)
    >>> lay = chunk_layout(10, 4, strata=2, rng=rng)
    >>> [len(b) for b in lay], sorted(np.concatenate(lay).tolist()) == list(range(10))
    ([4, 4, 2], True)
"""
from __future__ import annotations

from functools import lru_cache

import numpy as np

STRATA = 64  # strata per chunk: a rank of W <= STRATA reads about 1/W of the chunk


def widths(total: int, parts: int) -> np.ndarray:
    """Sizes of `parts` contiguous, nearly equal pieces of `total` (as `rank_slice` cuts them)."""
    edges = np.arange(parts + 1, dtype=np.int64) * total // parts
    return np.diff(edges)


def stratum_rows(rows: int, batch: int, strata: int = STRATA) -> np.ndarray:
    """Rows of each stratum of a chunk of `rows` rows cut into batches of `batch`."""
    full, last = divmod(rows, batch)
    return full * widths(batch, strata) + widths(last, strata)


def chunk_layout(rows: int, batch: int, strata: int, rng: np.random.Generator) -> list[np.ndarray]:
    """Chunk-local row indices of each global batch of a shuffled chunk, in batch order.

    Each stratum's rows are shuffled in place in one array of the chunk's rows (the generator's
    stream of `rng.permutation` per stratum, in stratum order), then one gather lays every batch
    out (`_positions`: batch k takes positions k * b_s .. (k + 1) * b_s of stratum s, for s in
    order; the last, shorter batch the rest of each stratum).

    Args:
        rows: rows of the chunk.
        batch: global batch size (the chunk holds ceil(rows / batch) batches, the last may be short).
        strata: strata of the chunk.
        rng: the chunk's generator; it draws one permutation per stratum, in stratum order.

    Returns:
        One int64 array per batch; together they hold every row of the chunk once.
    """
    starts, index = _positions(rows, batch, strata)
    order = np.arange(rows, dtype=np.int64)  # stratum s: rows starts[s] .. starts[s + 1] - 1
    for s in range(strata):
        if starts[s + 1] - starts[s] > 1:  # (a permutation of 0 or 1 rows draws nothing)
            rng.shuffle(order[starts[s]:starts[s + 1]])
    laid = order[index]  # (batches, batch) where every batch is full, else (rows,)
    if laid.ndim == 2:
        return list(laid)
    cuts = np.arange(batch, rows, batch)
    return np.split(laid, cuts)


@lru_cache(maxsize=16)
def _positions(rows: int, batch: int, strata: int) -> tuple[tuple[int, ...], np.ndarray]:
    """(stratum starts, where each batch's rows sit in the shuffled row array) of a chunk's
    layout: every chunk of a shape shares it (computed once; read-only).

    Returns:
        The strata's first rows (and the end), and the positions: (batches, batch) where every
        batch is full, else one (rows,) array of the batches end to end.
    """
    full, last = divmod(rows, batch)
    per_batch, per_last = widths(batch, strata), widths(last, strata)
    sizes = full * per_batch + per_last
    starts = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    # batch k's j-th row: its stratum's start, k * b_s, then its place in the stratum's run
    column = np.arange(batch, dtype=np.int64) - np.repeat(np.cumsum(per_batch) - per_batch, per_batch)
    column += np.repeat(starts[:-1], per_batch)
    index = column[None, :] + np.arange(full, dtype=np.int64)[:, None] * np.repeat(per_batch, per_batch)[None, :]
    if last:
        tail = np.arange(last, dtype=np.int64) - np.repeat(np.cumsum(per_last) - per_last, per_last)
        index = np.concatenate([index.reshape(-1), tail + np.repeat(starts[:-1] + full * per_batch, per_last)])
    index.flags.writeable = False
    return tuple(int(v) for v in starts), index


def needed_range(batches: list[np.ndarray], lo_hi: list[tuple[int, int]]) -> tuple[int, int]:
    """The smallest contiguous chunk-local range [lo, hi) holding rows `b[lo:hi]` of every batch b.

    Args:
        batches: chunk-local row indices per batch (`chunk_layout`).
        lo_hi: per batch, the slice of it this rank trains.
    """
    parts = [b[lo:hi] for b, (lo, hi) in zip(batches, lo_hi) if hi > lo]
    if not parts:
        return 0, 0
    rows = np.concatenate(parts)
    return int(rows.min()), int(rows.max()) + 1
