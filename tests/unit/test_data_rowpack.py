"""A batch cut from the kept row matrix in one pass (`flowrec.data.rowpack`): bitwise the numpy
gather of each part (dense values and labels as stored, ids widened from int32 or joined from
int64 word pairs, offsets 0 .. B*F), over random row layouts, row maps and stored bits (NaN
payloads, negative and beyond-int32 ids), whatever the output arrays held before."""
from __future__ import annotations

import numpy as np
import pytest

from flowrec.data.rowcache import RowLayout
from flowrec.data.rowpack import RowPacker, pack_rows


def reference(layout: RowLayout, matrix: np.ndarray, sel: np.ndarray, first: int, mapping):
    """The numpy path: map the rows, gather each part, widen the ids; offsets an arange."""
    rows = np.take(mapping, sel) if mapping is not None else first + sel
    dense, labels, ids = layout.parts(matrix)
    flat = [np.take(part, rows, axis=0).astype(np.int64).reshape(-1) for part in ids]
    return (np.take(dense, rows, axis=0), np.take(labels, rows, axis=0), flat,
            [np.arange(len(f) + 1, dtype=np.int64) for f in flat])


def garbage(rng: np.random.Generator, shape, dtype) -> np.ndarray:
    """An output array holding random bits (what a reused array or a consumer's writes leave)."""
    return rng.integers(0, 256, int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8).view(dtype).reshape(shape)


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


@pytest.mark.parametrize("seed", range(16))
def test_pack_rows_equals_the_numpy_gather(seed):
    """Random layouts (0-5 dense, 1-3 labels, 0-3 groups of 1-40 fields, int32 or int64 ids),
    random stored bits, batches by offset or by row map, of 0 to 300 rows."""
    rng = np.random.default_rng(seed)
    groups = int(rng.integers(0, 4))
    fields = [int(f) for f in rng.integers(1, 41, groups)]
    table_rows = [int(rng.choice([100, 1 << 31, (1 << 31) + 1, 1 << 40])) for _ in range(groups)]
    layout = RowLayout.of(int(rng.integers(0, 6)), int(rng.integers(1, 4)), fields, table_rows)
    n = int(rng.integers(300, 2000))
    matrix = layout.matrix(n)
    matrix[:] = rng.integers(0, 1 << 32, matrix.shape, dtype=np.uint32)  # every bit pattern: NaNs, negatives
    packer = RowPacker(layout, matrix)
    for _ in range(4):
        size = int(rng.choice([0, 1, int(rng.integers(2, 300))]))
        chunk = int(rng.integers(size, n + 1))
        sel = rng.permutation(chunk)[:size].astype(np.int64)
        mapped = bool(rng.integers(0, 2))
        mapping = rng.permutation(n)[:chunk].astype(np.int64) if mapped else None
        first = 0 if mapped else int(rng.integers(0, n - chunk + 1))
        want = reference(layout, matrix, sel, first, mapping)
        dense = garbage(rng, (size, layout.dense), np.float32)
        labels = garbage(rng, (size, layout.labels), np.float32)
        ids = [garbage(rng, (size * f,), np.int64) for f in fields]
        offsets = [garbage(rng, (size * f + 1,), np.int64) for f in fields]
        pack_rows(packer, sel, first, mapping, dense, labels, ids, offsets)
        assert same_bits(dense, want[0]) and same_bits(labels, want[1])
        assert all(same_bits(a, b) for a, b in zip(ids, want[2]))
        assert all(same_bits(a, b) for a, b in zip(offsets, want[3]))


def test_wide_ids_and_payloads_are_kept_exactly():
    """int64 ids above 2**32 and below zero, float32 NaN payloads and -0.0: the bits stored."""
    layout = RowLayout.of(2, 1, [3, 2], [1 << 40, 100])
    matrix = layout.matrix(4)
    dense, labels, (wide, narrow) = layout.parts(matrix)
    wide[:] = np.array([[1 << 33, -5, (1 << 40) - 1]] * 4) + np.arange(4)[:, None]
    narrow[:] = [[7, -1]] * 4
    dense.view(np.uint32)[:] = [0x7FC00001, 0x80000000]  # a NaN with a payload, -0.0
    labels[:] = 1.0
    out = [np.empty((2, 2), np.float32), np.empty((2, 1), np.float32), np.empty(6, np.int64), np.empty(4, np.int64)]
    offsets = [np.full(7, -3, np.int64), np.full(5, 9, np.int64)]
    pack_rows(RowPacker(layout, matrix), np.array([3, 1]), 0, None, out[0], out[1], [out[2], out[3]], offsets)
    assert out[2].tolist() == [(1 << 33) + 3, -2, (1 << 40) + 2, (1 << 33) + 1, -4, 1 << 40]
    assert out[3].tolist() == [7, -1, 7, -1]
    assert out[0].view(np.uint32).tolist() == [[0x7FC00001, 0x80000000]] * 2
    assert [o.tolist() for o in offsets] == [list(range(7)), list(range(5))]


def test_a_layout_without_groups_packs_dense_and_labels():
    layout = RowLayout.of(3, 2, [], [])
    matrix = layout.matrix(10)
    matrix[:] = np.arange(matrix.size, dtype=np.uint32).reshape(matrix.shape)
    dense, labels = np.zeros((3, 3), np.float32), np.zeros((3, 2), np.float32)
    pack_rows(RowPacker(layout, matrix), np.array([4, 0, 9]), 0, None, dense, labels, [], [])
    assert dense.view(np.uint32).tolist() == matrix[[4, 0, 9], 0:3].tolist()
    assert labels.view(np.uint32).tolist() == matrix[[4, 0, 9], 3:5].tolist()
