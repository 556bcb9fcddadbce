"""Packing encoded columns of a batch into the packed-group layout the operators consume.

For one `PackedGroup`: ``ids`` (nnz,) int64 packed rows (table-local row + the table's row offset)
and ``offsets`` (B*S + 1,) int64 bag boundaries, bag index b*S + s (sample-major), bags in the
order of ``group.fields``; a pooled field is one bag (its ids, possibly empty); an unpooled
sequence of max_len L is L single-id bags (padding positions are empty bags).

Example:
    >>> cols = {"a": np.array([1, 2]), "b": np.array([0, 3])}
    >>> ids, offsets = pack_group(group_ab, cols, 2)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Union

import numpy as np
import pyarrow as pa

from flowrec.graph.types import PackedGroup

Column = Union[np.ndarray, tuple[np.ndarray, np.ndarray]]  # one-hot ids, or (values, offsets)


def column_arrays(col: pa.Array | pa.ChunkedArray) -> Column:
    """An encoded column as numpy: int64 ids (B,), or (values (nnz,), offsets (B+1,)) for lists."""
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        offsets = col.offsets.to_numpy().astype(np.int64)
        values = col.values.to_numpy(zero_copy_only=False)[offsets[0]:offsets[-1]]
        return values.astype(np.int64, copy=False), offsets - offsets[0]
    return col.to_numpy(zero_copy_only=False).astype(np.int64, copy=False)


def pack_group(group: PackedGroup, cols: dict[str, Column], size: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed ids (nnz,) and bag offsets (size*S + 1,) of one group for one batch."""
    row_offset = group.row_offsets
    if all(not isinstance(cols[f.feature], tuple) for f in group.fields):
        ids = np.empty((size, len(group.fields)), np.int64)  # (B, F)
        for j, f in enumerate(group.fields):
            np.add(cols[f.feature], row_offset[f.table], out=ids[:, j])
        return ids.reshape(-1), np.arange(size * len(group.fields) + 1, dtype=np.int64)
    spans = group.field_bags()
    width = group.bags_per_sample
    lengths = np.zeros((size, width), np.int64)  # (B, S)
    for f in group.fields:
        col, s = cols[f.feature], spans[f.feature]
        if not isinstance(col, tuple):
            lengths[:, s.start] = 1
        elif f.pooling == "none":
            n = np.minimum(np.diff(col[1]), f.max_len)
            lengths[:, s] = np.arange(f.max_len)[None, :] < n[:, None]
        else:
            lengths[:, s.start] = np.diff(col[1])
    offsets = np.zeros(size * width + 1, np.int64)
    np.cumsum(lengths.reshape(-1), out=offsets[1:])
    starts = offsets[:-1].reshape(size, width)  # (B, S)
    ids = np.empty(offsets[-1], np.int64)
    for f in group.fields:
        col, s = cols[f.feature], spans[f.feature]
        if not isinstance(col, tuple):
            ids[starts[:, s.start]] = col + row_offset[f.table]
            continue
        values, voff = col
        counts = np.diff(voff)
        keep = np.arange(len(values)) - np.repeat(voff[:-1], counts)  # (nnz_f,) position in sample
        sel = keep < (f.max_len if f.pooling == "none" else np.iinfo(np.int64).max)
        dest = np.repeat(starts[:, s.start], counts) + keep
        ids[dest[sel]] = values[sel] + row_offset[f.table]
    return ids, offsets
