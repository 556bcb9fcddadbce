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

    Args:
        rows: rows of the chunk.
        batch: global batch size (the chunk holds ceil(rows / batch) batches, the last may be short).
        strata: strata of the chunk.
        rng: the chunk's generator; it draws one permutation per stratum, in stratum order.

    Returns:
        One int64 array per batch; together they hold every row of the chunk once.
    """
    full, last = divmod(rows, batch)
    per_batch, per_last = widths(batch, strata), widths(last, strata)
    sizes = full * per_batch + per_last
    starts = np.concatenate([[0], np.cumsum(sizes)])
    perms = [starts[s] + rng.permutation(int(sizes[s])) for s in range(strata)]
    out: list[np.ndarray] = []
    if full:
        cols = [p[:full * per_batch[s]].reshape(full, per_batch[s]) for s, p in enumerate(perms)]
        out.extend(np.concatenate(cols, axis=1))
    if last:
        out.append(np.concatenate([p[full * per_batch[s]:] for s, p in enumerate(perms)]))
    return out


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
