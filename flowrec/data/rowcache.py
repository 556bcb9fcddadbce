"""Decoded rows kept across epochs: the staged rows of a whole dataset, filled once.

An epoch of staging reads every part file again: Parquet decoding is most of a warm epoch's CPU
time (0.21 of 0.45-0.57 CPU s per 1.5M DLRM rows on the 2-core VM, `docs/data.md`), and then the
reader copies each chunk's rows into row-major matrices (`flowrec.data.batches._ChunkMatrices`)
before the batches gather their rows from them. A `RowCache` keeps the rows of the whole dataset
instead, one row per dataset row in the source's own order (partition by partition, row group by
row group). The first epoch fills a row group when it first reads it (after the data checks
passed it); later epochs read nothing: a chunk of the shuffled stream maps to dataset rows, and a
batch is one row gather, bitwise the batch the streaming path gives (same values, same order,
same dtypes: the same fill code).

The row matrix (decision: one interleaved row per dataset row, not one matrix per kind). A warm
epoch is the batches' row gathers, random rows of a matrix far larger than the caches, so what
it costs is the cache lines a row touches. Separate matrices (dense (N, 13) float32, labels
(N, 1) float32, ids (N, 26) int64 for Criteo) touch about 7 lines per row (a 52-byte dense row
straddles two lines 4 times in 5); one uint32 matrix holding every value of a row, its start
aligned to a cache line and its stride chosen so that no row straddles more lines than it must
(`RowLayout`), touches ceil(bytes / 64): 3 for Criteo, where a group's ids are stored as int32
(its packed table has at most 2**31 rows) and widened back to int64 when a batch is cut. A batch is
cut in one numba pass (`flowrec.data.rowpack`): each row's values go straight into the batch's
arrays, the rows ahead prefetched: 0.036 against 0.060-0.070 CPU s per epoch of 1.5M Criteo rows
for numpy's gather into a scratch matrix and copies out of it (0.085 with a matrix per kind).

What it costs: memory, `RowLayout.nbytes` (160 bytes per Criteo row of 13 dense, 1 label and 26
int32 ids: 229 MiB for 1.5M rows), held for the life of the source (freed by its `close`).
`StagingOptions.cache_data` decides (`flowrec train --cache-data`):

- ``auto`` (default): cache a dataset read from files (Parquet) when its decoded rows fit the
  budget, `StagingOptions.cache_budget` bytes or else half the memory this process can still
  take (`flowrec.data.hostmemory`) when the cache is first allocated (none where the platform
  does not say); otherwise stream as before.
  Rows already in memory (`MemorySource`) are not cached again.
- ``on``: cache any local source (Parquet or memory), whatever its size.
- ``off``: stream every epoch.

Only the gathered layout is cached (every packed group one id per field, no managed table
remapping ids: DLRM, DCN, W&D); sequences, managed tables and Dask sources stream as before. An
id that does not fit its int32 column (only unchecked rows can hold one: the checks keep ids
inside their tables) is not kept either: the fill raises `NotKept` and the epoch streams.

Files that change: each part file is known by its fingerprint (`flowrec.data.checked`:
size, mtime in ns, SHA-256 of its footer), taken when an epoch starts; rows of a file whose
fingerprint differs from the one taken when they were read (or that cannot be read) are dropped
and read again, and checked again (the source forgets that the partition passed). A file
rewritten during an epoch is caught at the next epoch's start. The rules key of the checks is
part of the cache's key: rows filled unchecked (`check=False`) never serve a checked epoch.

One iterator uses a cache at a time (`RowCache.open` / `release`); a second iterator over the
same source while the first runs streams without it, so rows are never refilled under a reader.

Example:
    >>> cache, owner = RowCache(), type("Epoch", (), {})()
    >>> layout = RowLayout.of(dense=1, labels=1, fields=(2,), table_rows=(100,))
    >>> cache.open(owner, key="k", group_rows=[[2, 1]], layout=layout, marks=["f"], budget=None)
    []
    >>> layout.stride, cache.nbytes, cache.filled(0, 1), cache.start(0, 1)
    (16, 48, False, 2)
"""
from __future__ import annotations

import math
import threading
import weakref
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from flowrec.spec.units import parse_bytes

CACHE_MODES = ("auto", "on", "off")
AUTO_SHARE = 0.5  # auto: the cache may take this share of the memory still available
LINE = 64  # bytes of a cache line: the matrix starts on one, and strides are chosen by it
WORD = 4  # bytes of one column of the row matrix (uint32)
INT32 = np.iinfo(np.int32)


class NotKept(Exception):
    """Rows the cache cannot hold as they are (a list column, an id beyond its int32 column): the
    epoch streams instead (`flowrec.data.batches`)."""


def parse_cache_data(text: str) -> tuple[str, int | None]:
    """(mode, budget bytes or None) of a `--cache-data` value: auto, on, off or a byte size (auto
    with that budget).

    Raises:
        ValueError: neither a mode nor a byte size (one line naming the option).
    """
    value = str(text).strip().lower()
    if value in CACHE_MODES:
        return value, None
    try:
        return "auto", parse_bytes(value)
    except ValueError:
        raise ValueError(f"--cache-data must be auto, on, off or a byte size such as 2GiB, not {text!r}") from None


@dataclass(frozen=True)
class RowLayout:
    """Where the values of one row live in the row matrix: one uint32 word per 4 bytes.

    Per packed group its ids (int32, one word each, where the group's packed table has at most
    2**31 rows; else int64, two words, at an even word), then the dense values and the labels
    (float32, one word each). The stride is the fewest bytes with which no row touches more
    cache lines than its bytes need (`stride`).

    Args:
        dense: dense columns.
        labels: label columns.
        fields: ids per row of each packed group.
        narrow: per group, whether its ids are stored as int32.
    """

    dense: int
    labels: int
    fields: tuple[int, ...]
    narrow: tuple[bool, ...]

    @classmethod
    def of(cls, dense: int, labels: int, fields: Sequence[int], table_rows: Sequence[int]) -> "RowLayout":
        """The layout of rows of `dense` and `labels` columns and `fields` ids per group, whose
        packed tables hold `table_rows` rows (valid ids: 0 .. rows - 1)."""
        return cls(int(dense), int(labels), tuple(int(f) for f in fields),
                   tuple(int(r) - 1 <= INT32.max for r in table_rows))

    @cached_property
    def ids_at(self) -> tuple[int, ...]:
        """The first word of each group's ids."""
        return self._words[0]

    @cached_property
    def dense_at(self) -> int:
        """The first word of the dense values (the labels follow them)."""
        return self._words[1]

    @cached_property
    def _words(self) -> tuple[tuple[int, ...], int]:
        at, word = [], 0
        for f, narrow in zip(self.fields, self.narrow):
            word += 0 if narrow else word % 2
            at.append(word)
            word += f if narrow else 2 * f
        return tuple(at), word

    @cached_property
    def stride(self) -> int:
        """Bytes of one row of the matrix: the fewest, at least the row's bytes (a multiple of 8
        with int64 ids), with which no row touches more cache lines than its bytes need.

        Rows of the (line-aligned) matrix start at multiples of gcd(stride, 64) within a line, so a
        row of `size` bytes touches at most ceil((64 - gcd + size) / 64) lines."""
        size = max(WORD * (self.dense_at + self.dense + self.labels), WORD)
        step = WORD if all(self.narrow) else 2 * WORD
        need = -(-size // LINE)
        stride = -(-size // step) * step
        while -(-(LINE - math.gcd(stride, LINE) + size) // LINE) > need:
            stride += step
        return stride

    @property
    def words(self) -> int:
        """Columns (uint32) of the row matrix."""
        return self.stride // WORD

    def nbytes(self, rows: int) -> int:
        """Bytes of the matrix of `rows` rows."""
        return rows * self.stride

    def matrix(self, rows: int) -> np.ndarray:
        """A new (rows, words) uint32 matrix, its first row aligned to a cache line."""
        raw = np.empty(self.nbytes(rows) + LINE, np.uint8)
        skip = -raw.ctypes.data % LINE
        return raw[skip:skip + self.nbytes(rows)].view(np.uint32).reshape(rows, self.words)

    def parts(self, matrix: np.ndarray) -> tuple[np.ndarray, np.ndarray, list[np.ndarray]]:
        """(dense, labels, ids per group) views of a (n, words) matrix: (n, dense) and (n, labels)
        float32, (n, F) int32 or int64 (views share the matrix's memory)."""
        d = self.dense_at
        dense = matrix[:, d:d + self.dense].view(np.float32)
        labels = matrix[:, d + self.dense:d + self.dense + self.labels].view(np.float32)
        ids = [matrix[:, a:a + f].view(np.int32) if narrow else matrix[:, a:a + 2 * f].view(np.int64)
               for a, f, narrow in zip(self.ids_at, self.fields, self.narrow)]
        return dense, labels, ids


def auto_budget() -> int:
    """The `auto` budget: half the memory this process can still take (0 where the platform does
    not say: nothing is kept)."""
    from flowrec.data.hostmemory import available_memory_bytes

    room = available_memory_bytes()
    return 0 if room is None else int(room * AUTO_SHARE)


def pieces(table: pa.Table, name: str, a: int, b: int, start: int) -> Iterator[tuple[int, np.ndarray]]:
    """(destination row, values) of each array chunk of rows [a, b) of column `name`, numpy
    (zero-copy where arrow allows), the first going to row `start`."""
    for piece in table.column(name).slice(a, b - a).chunks:
        if len(piece):
            yield start, piece.to_numpy(zero_copy_only=False)
            start += len(piece)


def fill_matrices(table: pa.Table, a: int, b: int, start: int, dense: np.ndarray, labels: np.ndarray,
                  ids: Sequence[np.ndarray], dense_names: Sequence[str], label_names: Sequence[str],
                  groups: Sequence[Sequence[tuple[str, int]]]) -> None:
    """Copy rows [a, b) of `table` to rows start.. of the matrices (values cast as assigned:
    float32 dense and labels; ids as int64 plus their table's row offset).

    Args:
        table: decoded rows of one block of a partition.
        a, b: its rows to copy.
        start: the destination row of row `a`.
        dense, labels: (n, n_dense) and (n, n_labels) float32 destinations.
        ids: per packed group, the (n, F) int64 destination (or int32: `RowCache`).
        dense_names, label_names: the columns of `dense` and `labels`, in order.
        groups: per packed group, (column, row offset) of each field in field order.

    Raises:
        NotKept: an id (plus its offset) does not fit an int32 destination.
    """
    for matrix, names in ((dense, dense_names), (labels, label_names)):
        for j, name in enumerate(names):
            for lo, values in pieces(table, name, a, b, start):
                matrix[lo:lo + len(values), j] = values
    for out, fields in zip(ids, groups):
        for j, (name, offset) in enumerate(fields):
            for lo, values in pieces(table, name, a, b, start):
                target = out[lo:lo + len(values), j]
                if out.dtype == np.int64:
                    np.add(values.astype(np.int64, copy=False), offset, out=target)
                    continue
                wide = np.add(values.astype(np.int64, copy=False), offset)
                if len(wide) and (wide.min() < INT32.min or wide.max() > INT32.max):
                    raise NotKept(f"column {name!r}: an id beyond the int32 rows of the cache")
                target[...] = wide


class RowCache:
    """The staged matrices of one source's rows, kept across epochs (see the module docstring).

    Attributes (valid while an owner holds it):
        rows: (N, words) uint32, every value of a dataset row (`row_layout`).
        row_layout: where each value lives in a row.
        dense, labels: (N, n_dense), (N, n_labels) float32 views of `rows`.
        ids: per packed group (N, F) int32 or int64 views of `rows`.
        nbytes: bytes of the matrix (0: nothing allocated).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: Callable[[], Any] | None = None  # weak reference to the iterator using it
        self.lock = threading.Lock()  # guards `outputs`
        self.outputs: Any = None  # the arrays batches are gathered into (`flowrec.data.batches`), kept as well
        self._clear()

    def _clear(self) -> None:
        self.key: Any = None
        self.group_rows: tuple[tuple[int, ...], ...] | None = None
        self.row_layout: RowLayout | None = None
        self.rows = np.empty((0, 0), np.uint32)
        self.dense = self.labels = np.empty((0, 0), np.float32)
        self.ids: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []  # per partition: dataset row of each row group
        self._filled: list[np.ndarray] = []  # per partition: row groups filled (bool)
        self._marks: list[str] = []  # per partition: fingerprint its rows were read under
        self.nbytes = 0

    def open(self, owner: Any, key: Any, group_rows: Sequence[Sequence[int]], layout: RowLayout,
             marks: Sequence[str], budget: int | Callable[[], int | None] | None) -> list[int] | None:
        """Reserve the cache for `owner` (an iterator, or a weak reference to one) for this epoch.

        Allocates the matrix when the key (columns, packing, checks), the layout or the row groups differ
        from what it holds and they fit `budget`; drops the rows of every partition whose mark
        (fingerprint) changed or is empty.

        Args:
            owner: the iterator that will fill and read it until `release`.
            key: what the matrices hold (columns, packed layout, rules of the checks).
            group_rows: rows of each row group of each partition, in source order.
            layout: where each value of a row lives (`RowLayout`).
            marks: per partition, the fingerprint of what a read gives now ("": unknown, never kept).
            budget: bytes the matrices may take (None: any), or a function giving it, called only
                when they must be allocated (the auto budget depends on the memory free then).

        Returns:
            The partitions whose rows were dropped (their files changed: read and check them
            again), or None when another living owner holds the cache or the rows do not fit
            the budget (then stream).
        """
        ref = owner if isinstance(owner, weakref.ref) else weakref.ref(owner)
        with self._lock:
            holder = self._owner() if self._owner is not None else None
            if holder is not None and holder is not ref():
                return None
            rows_of = tuple(tuple(int(n) for n in groups) for groups in group_rows)
            if key != self.key or rows_of != self.group_rows or layout != self.row_layout:
                self._clear()
                size = layout.nbytes(sum(map(sum, rows_of)))
                limit = budget() if callable(budget) else budget
                if limit is not None and size > limit:
                    return None
                self._allocate(key, rows_of, layout, marks)
            dropped = []
            for p, mark in enumerate(marks):
                if mark != self._marks[p] or not mark:
                    if self._filled[p].any():
                        dropped.append(p)
                    self._filled[p][:] = False
                    self._marks[p] = mark
            self._owner = ref
            return dropped

    def _allocate(self, key: Any, group_rows: tuple[tuple[int, ...], ...], layout: RowLayout,
                  marks: Sequence[str]) -> None:
        rows = sum(map(sum, group_rows))
        self.rows = layout.matrix(rows)
        self.dense, self.labels, self.ids = layout.parts(self.rows)
        start = 0
        for groups_rows in group_rows:
            self._starts.append(start + np.concatenate([[0], np.cumsum(groups_rows)[:-1]]).astype(np.int64))
            self._filled.append(np.zeros(len(groups_rows), bool))
            start += sum(groups_rows)
        self._marks = list(marks)
        self.key, self.group_rows, self.row_layout, self.nbytes = key, group_rows, layout, layout.nbytes(rows)

    def release(self, owner: Any) -> None:
        """`owner` is done with the cache (its threads are joined); the rows stay for the next epoch."""
        with self._lock:
            holder = self._owner() if self._owner is not None else None
            if holder is None or holder is owner:
                self._owner = None

    def clear(self) -> None:
        """Free the matrix and the batch arrays (the source closes); an owner still holding them
        keeps its references."""
        with self._lock:
            self._clear()
        with self.lock:
            self.outputs = None

    def complete(self) -> bool:
        """Whether every row group of every partition holds its rows (an epoch reads nothing)."""
        return bool(self._filled) and all(bool(f.all()) for f in self._filled)

    def filled(self, partition: int, group: int) -> bool:
        """Whether row group `group` of `partition` holds its rows."""
        return bool(self._filled[partition][group])

    def start(self, partition: int, group: int) -> int:
        """The dataset row (matrix row) of the first row of row group `group` of `partition`."""
        return int(self._starts[partition][group])

    def fill(self, partition: int, group: int, table: pa.Table, a: int, b: int, dense_names: Sequence[str],
             label_names: Sequence[str], groups: Sequence[Sequence[tuple[str, int]]]) -> None:
        """Copy rows [a, b) of `table` (the whole row group, checked) into the matrix.

        Raises:
            NotKept: an id does not fit its int32 column (nothing is marked filled).
        """
        fill_matrices(table, a, b, self.start(partition, group), self.dense, self.labels, self.ids,
                      dense_names, label_names, groups)
        self._filled[partition][group] = True
