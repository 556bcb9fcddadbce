"""Decoded rows kept across epochs: the staged matrices of a whole dataset, filled once.

An epoch of staging reads every part file again: Parquet decoding is most of a warm epoch's CPU
time (0.21 of 0.45-0.57 CPU s per 1.5M DLRM rows on the 2-core VM, `docs/data.md`), and then the
reader copies each chunk's rows into row-major matrices (`flowrec.data.batches._ChunkMatrices`)
before the batches gather their rows from them. A `RowCache` keeps those matrices for the whole
dataset instead: dense (N, n_dense) float32, labels (N, n_labels) float32 and per packed group
(N, F) int64 ids with their tables' row offsets added, one row per dataset row in the source's
own order (partition by partition, row group by row group). The first epoch fills a row group
when it first reads it (after the data checks passed it); later epochs read nothing: a chunk of
the shuffled stream maps to dataset rows, and a batch is one row gather of each matrix, bitwise
the batch the streaming path gives (same values, same order, same dtypes: the same fill code).

What it costs: memory, `decoded_bytes` (4 bytes per dense value and label, 8 per id: 396 MiB
for 1.5M Criteo rows of 13 dense and 26 sparse fields), held for the life of the source (freed
by its `close`). `StagingOptions.cache_data` decides (`flowrec train --cache-data`):

- ``auto`` (default): cache a dataset read from files (Parquet) when its decoded rows fit the
  budget, `StagingOptions.cache_budget` bytes or else half the memory this process can still
  take (`flowrec.data.hostmemory`) when the cache is first allocated (none where the platform
  does not say); otherwise stream as before.
  Rows already in memory (`MemorySource`) are not cached again.
- ``on``: cache any local source (Parquet or memory), whatever its size.
- ``off``: stream every epoch.

Only the gathered layout is cached (every packed group one id per field, no managed table
remapping ids: DLRM, DCN, W&D); sequences, managed tables and Dask sources stream as before.

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
    >>> cache.open(owner, key="k", group_rows=[[2, 1]], widths=(1, 1, (2,)), marks=["f"], budget=None)
    []
    >>> cache.nbytes, cache.filled(0, 1), cache.start(0, 1)
    (72, False, 2)
"""
from __future__ import annotations

import threading
import weakref
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa

from flowrec.spec.units import parse_bytes

CACHE_MODES = ("auto", "on", "off")
AUTO_SHARE = 0.5  # auto: the cache may take this share of the memory still available


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


def decoded_bytes(rows: int, widths: tuple[int, int, Sequence[int]]) -> int:
    """Bytes of the matrices of `rows` rows: (dense columns, label columns, ids per group)."""
    dense, labels, groups = widths
    return rows * (4 * dense + 4 * labels + 8 * sum(groups))


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
        ids: per packed group, the (n, F) int64 destination.
        dense_names, label_names: the columns of `dense` and `labels`, in order.
        groups: per packed group, (column, row offset) of each field in field order.
    """
    for matrix, names in ((dense, dense_names), (labels, label_names)):
        for j, name in enumerate(names):
            for lo, values in pieces(table, name, a, b, start):
                matrix[lo:lo + len(values), j] = values
    for out, fields in zip(ids, groups):
        for j, (name, offset) in enumerate(fields):
            for lo, values in pieces(table, name, a, b, start):
                np.add(values.astype(np.int64, copy=False), offset, out=out[lo:lo + len(values), j])


class RowCache:
    """The staged matrices of one source's rows, kept across epochs (see the module docstring).

    Attributes (valid while an owner holds it):
        dense, labels: (N, n_dense), (N, n_labels) float32.
        ids: per packed group (N, F) int64.
        nbytes: bytes of the matrices (0: nothing allocated).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: Callable[[], Any] | None = None  # weak reference to the iterator using it
        self.lock = threading.Lock()  # guards `outputs`
        self.outputs: Any = None  # the arrays batches are gathered into (`flowrec.data.batches`), kept as well
        self._clear()

    def _clear(self) -> None:
        self.key: Any = None
        self.layout: tuple[tuple[int, ...], ...] | None = None
        self.dense = self.labels = np.empty((0, 0), np.float32)
        self.ids: list[np.ndarray] = []
        self._starts: list[np.ndarray] = []  # per partition: dataset row of each row group
        self._filled: list[np.ndarray] = []  # per partition: row groups filled (bool)
        self._marks: list[str] = []  # per partition: fingerprint its rows were read under
        self.nbytes = 0

    def open(self, owner: Any, key: Any, group_rows: Sequence[Sequence[int]], widths: tuple[int, int, Sequence[int]],
             marks: Sequence[str], budget: int | Callable[[], int | None] | None) -> list[int] | None:
        """Reserve the cache for `owner` (an iterator, or a weak reference to one) for this epoch.

        Allocates the matrices when the key (columns, packing, checks) or the row groups differ
        from what it holds and they fit `budget`; drops the rows of every partition whose mark
        (fingerprint) changed or is empty.

        Args:
            owner: the iterator that will fill and read it until `release`.
            key: what the matrices hold (columns, packed layout, rules of the checks).
            group_rows: rows of each row group of each partition, in source order.
            widths: (dense columns, label columns, fields per packed group).
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
            layout = tuple(tuple(int(n) for n in groups) for groups in group_rows)
            if key != self.key or layout != self.layout:
                self._clear()
                size = decoded_bytes(sum(map(sum, layout)), widths)
                limit = budget() if callable(budget) else budget
                if limit is not None and size > limit:
                    return None
                self._allocate(key, layout, widths, marks)
            dropped = []
            for p, mark in enumerate(marks):
                if mark != self._marks[p] or not mark:
                    if self._filled[p].any():
                        dropped.append(p)
                    self._filled[p][:] = False
                    self._marks[p] = mark
            self._owner = ref
            return dropped

    def _allocate(self, key: Any, layout: tuple[tuple[int, ...], ...], widths: tuple[int, int, Sequence[int]],
                  marks: Sequence[str]) -> None:
        dense, labels, groups = widths
        rows = sum(map(sum, layout))
        self.dense, self.labels = np.empty((rows, dense), np.float32), np.empty((rows, labels), np.float32)
        self.ids = [np.empty((rows, f), np.int64) for f in groups]
        start = 0
        for groups_rows in layout:
            self._starts.append(start + np.concatenate([[0], np.cumsum(groups_rows)[:-1]]).astype(np.int64))
            self._filled.append(np.zeros(len(groups_rows), bool))
            start += sum(groups_rows)
        self._marks = list(marks)
        self.key, self.layout, self.nbytes = key, layout, decoded_bytes(rows, widths)

    def release(self, owner: Any) -> None:
        """`owner` is done with the cache (its threads are joined); the rows stay for the next epoch."""
        with self._lock:
            holder = self._owner() if self._owner is not None else None
            if holder is None or holder is owner:
                self._owner = None

    def clear(self) -> None:
        """Free the matrices and the batch arrays (the source closes); an owner still holding them
        keeps its references."""
        with self._lock:
            self._clear()
        with self.lock:
            self.outputs = None

    def filled(self, partition: int, group: int) -> bool:
        """Whether row group `group` of `partition` holds its rows."""
        return bool(self._filled[partition][group])

    def start(self, partition: int, group: int) -> int:
        """The dataset row (matrix row) of the first row of row group `group` of `partition`."""
        return int(self._starts[partition][group])

    def fill(self, partition: int, group: int, table: pa.Table, a: int, b: int, dense_names: Sequence[str],
             label_names: Sequence[str], groups: Sequence[Sequence[tuple[str, int]]]) -> None:
        """Copy rows [a, b) of `table` (the whole row group, checked) into the matrices."""
        fill_matrices(table, a, b, self.start(partition, group), self.dense, self.labels, self.ids,
                      dense_names, label_names, groups)
        self._filled[partition][group] = True
