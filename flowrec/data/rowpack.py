"""A batch cut from the kept row matrix in one pass: gather, widen, split and offsets together.

A warm epoch of `flowrec.data.rowcache` is one batch after another gathered from the row matrix
(every value of a dataset row side by side, `RowLayout`). Done with numpy (`np.take` of the rows
into a scratch matrix, then one `np.copyto` per part into the batch's arrays, then the offsets
copied from an arange) every value crosses the caches three times, and each random row's cache
misses are taken a few at a time. `pack_rows` is one numba loop over the batch's rows instead:

- each row's values go straight from the matrix into the batch's arrays (dense values, labels,
  per packed group its ids widened to int64: int32 words sign-extended, int64 pairs of words
  joined), no scratch matrix;
- the rows `PREFETCH_ROWS` ahead are prefetched (every line of the row): the gathers are random
  rows of a matrix far larger than the caches, and the hint overlaps their misses (alone in one
  thread, 1.5M Criteo rows of 160 bytes: 0.226 CPU s without it, 0.061 with it, 0.066-0.072 for
  the numpy path);
- the offsets of a group of one id per field (an arange: bag k is id k) are written in the same
  call, into the batch's own array (the consumer owns every array it gets, so nothing is shared).

Values are copied as 32-bit words (float32 dense values and labels included): the batch holds the
bits the matrix holds, NaN payloads and signed zeros too. The kernel releases the GIL
(`nogil`), so the packing threads gather on every core they get, and is compiled once and cached
on disk by numba (`cache=True`; `NUMBA_CACHE_DIR` overrides where).

Example:
    >>> from flowrec.data.rowcache import RowLayout
    >>> layout = RowLayout.of(dense=1, labels=1, fields=(2,), table_rows=(100,))
    >>> m = layout.matrix(3); m[:] = np.arange(m.size, dtype=np.uint32).reshape(m.shape)
    >>> dense, labels = np.empty((2, 1), np.float32), np.empty((2, 1), np.float32)
    >>> ids, offsets = np.empty(4, np.int64), np.empty(5, np.int64)
    >>> pack_rows(RowPacker(layout, m), np.array([2, 0]), 0, None, dense, labels, [ids], [offsets])
    >>> ids.tolist(), offsets.tolist()
    ([8, 9, 0, 1], [0, 1, 2, 3, 4])
"""
from __future__ import annotations

from typing import Sequence

import numpy as np
from llvmlite import ir
from numba import njit, types
from numba.core import cgutils
from numba.extending import intrinsic

from flowrec.data.rowcache import LINE, RowLayout

PREFETCH_ROWS = 16  # rows ahead whose lines are prefetched (8: 0.064, 16: 0.061, 32: 0.061 CPU s/epoch)
NO_IDS = np.empty(0, np.int64)  # the ids and offsets of the one kernel call of a batch without groups


@intrinsic
def _prefetch(typingctx, matrix, row, byte):
    """Hint the CPU to bring byte `byte` of row `row` of the 2-D array `matrix` into cache (read)."""
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, array.strides, 2)[0]
        byte_ptr = ir.IntType(8).as_pointer()
        offset = builder.add(builder.mul(builder.sext(args[1], stride.type), stride),
                             builder.sext(args[2], stride.type))
        address = builder.gep(builder.bitcast(array.data, byte_ptr), [offset])
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr] + [ir.IntType(32)] * 3)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr], fnty)
        read, locality, data_cache = (ir.Constant(ir.IntType(32), v) for v in (0, 3, 1))
        builder.call(fn, [address, read, locality, data_cache])
        return context.get_dummy_value()
    return types.void(matrix, row, byte), codegen


@njit(inline="always", cache=True)
def _fetch(words, row, stride, line):
    """Prefetch every line of row `row` of `words` (rows need not start on a line)."""
    for b in range(0, stride - 1, line):
        _prefetch(words, row, b)
    _prefetch(words, row, stride - 1)


@njit(inline="always", cache=True)
def _values(row, dense_at, dense_i, labels_i):
    """Copy a row's dense values and labels (words) into its output rows."""
    for j in range(dense_i.shape[0]):
        dense_i[j] = row[dense_at + j]
    for j in range(labels_i.shape[0]):
        labels_i[j] = row[dense_at + dense_i.shape[0] + j]


@njit(nogil=True, cache=True)
def _pack_narrow(words, sel, first, dense_at, dense, labels, at, fields, ids, ahead, line):
    """Rows with int32 ids (one word each), widened to int64 (sign-extended)."""
    n, stride = sel.shape[0], words.strides[0]
    for i in range(n):
        if i + ahead < n:
            _fetch(words, first + sel[i + ahead], stride, line)
        row = words[first + sel[i]]  # contiguous slices: the copies vectorize
        _values(row, dense_at, dense[i], labels[i])
        out, narrow = ids[i * fields:(i + 1) * fields], row[at:at + fields]
        for j in range(fields):
            out[j] = narrow[j]


@njit(nogil=True, cache=True)
def _pack_wide(words, sel, first, dense_at, dense, labels, at, fields, ids, ahead, line):
    """Rows with int64 ids (pairs of words, low word first: little-endian)."""
    n, stride = sel.shape[0], words.strides[0]
    for i in range(n):
        if i + ahead < n:
            _fetch(words, first + sel[i + ahead], stride, line)
        row = words[first + sel[i]]
        _values(row, dense_at, dense[i], labels[i])
        out, pairs = ids[i * fields:(i + 1) * fields], row[at:at + 2 * fields]
        for j in range(fields):
            out[j] = (np.int64(pairs[2 * j + 1]) << 32) | (np.int64(pairs[2 * j]) & 0xFFFFFFFF)


@njit(nogil=True, cache=True)
def _arange(offsets):
    """offsets[k] = k (a group of one id per field: bag k is id k)."""
    for k in range(offsets.shape[0]):
        offsets[k] = k


class RowPacker:
    """A row matrix as `pack_rows` reads it: its int32 view and where each part of a row lives.

    Args:
        layout: where the values of a row live (`RowLayout`).
        matrix: the (N, layout.words) uint32 row matrix.
    """

    def __init__(self, layout: RowLayout, matrix: np.ndarray):
        self.layout = layout
        self.words = matrix.view(np.int32)  # (N, words)
        # per group (first word, fields, wide); a group of no fields where there is none (dense only)
        self.groups = [(at, f, not narrow) for at, f, narrow in zip(layout.ids_at, layout.fields, layout.narrow)]


def pack_rows(packer: RowPacker, sel: np.ndarray, first: int, mapping: np.ndarray | None, dense: np.ndarray,
              labels: np.ndarray, ids: Sequence[np.ndarray], offsets: Sequence[np.ndarray]) -> None:
    """Write batch rows `sel` of the row matrix into the batch's arrays, in order.

    One kernel call per packed group (the first also writes the dense values and the labels; a
    later one finds the rows in the caches).

    Args:
        packer: the row matrix (`RowPacker`).
        sel: the batch's rows, chunk-local (int64).  # (B,)
        first: matrix row of chunk row 0 where `mapping` is None.
        mapping: matrix row of each chunk row (None: `first` + chunk row).
        dense, labels: (B, n_dense), (B, n_labels) float32 outputs (C-contiguous).
        ids: per packed group its flat (B * F,) int64 output.
        offsets: per packed group its (B * F + 1,) int64 output (written 0 .. B * F).
    """
    layout = packer.layout
    if mapping is not None:
        sel, first = np.take(mapping, sel), 0
    sel = np.ascontiguousarray(sel, np.int64)
    dense, labels = dense.view(np.int32), labels.view(np.int32)
    groups = packer.groups or [(0, 0, False)]
    outputs = list(zip(ids, offsets)) or [(NO_IDS, NO_IDS)]
    for k, ((at, fields, wide), (out, off)) in enumerate(zip(groups, outputs)):
        kernel = _pack_wide if wide else _pack_narrow  # the branch inside the row loop costs 60%
        if k == 1:  # written by the first call; (n, 0) C arrays keep one compiled kernel per kind
            dense = labels = np.empty((len(sel), 0), np.int32)
        kernel(packer.words, sel, int(first), layout.dense_at, dense, labels, at, fields, out, PREFETCH_ROWS, LINE)
        _arange(off)


def warm_up() -> None:
    """Load (or compile) the kernels of every id kind, as a batch of an epoch that fills the row
    cache would: numba's first call of a process costs about 0.3 s (its compiler and the cached
    code loading), which a thread started beside the first Parquet reads hides."""
    layout = RowLayout.of(1, 1, (1, 1), (2, 1 << 40))  # an int32 group, then an int64 one
    ids = [np.empty(1, np.int64), np.empty(1, np.int64)]
    pack_rows(RowPacker(layout, layout.matrix(1)), np.zeros(1, np.int64), 0, None, np.empty((1, 1), np.float32),
              np.empty((1, 1), np.float32), ids, [np.empty(2, np.int64), np.empty(2, np.int64)])
