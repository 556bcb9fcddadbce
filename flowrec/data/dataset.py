"""Partition sources the batch iterator reads: Parquet directly, Parquet through Dask, memory.

A source is a list of partitions with known row counts, each made of row groups (Parquet's);
`submit(i, columns, row_groups)` starts reading those row groups of partition i (all by default)
and returns a future (`.result()` gives a pyarrow Table of those columns), so the reader can
overlap reading ahead with cutting what it has; `bytes_read` counts the stored bytes of the
column chunks asked for (how `tools/bench_dist.py` measures what each rank reads). Opening a Parquet
dataset checks that its part files hold the row count ``_flowrec.json`` records and that there is
at least one row; what the rows hold is checked as they are read (`flowrec.data.checks`), once
per partition: `passed` / `add_passed` remember the partitions that passed (for Parquet also in
the folder's ``_flowrec_checked.json``, by file fingerprint: `flowrec.data.checked`). A local
source also holds a `row_cache` (`flowrec.data.rowcache`): its rows as staged, kept across epochs
when `StagingOptions.cache_data` says so, dropped per partition when `fingerprints` changes.

Example:
    >>> src = ParquetSource("data/criteo")  # doctest: +SKIP
    >>> sum(src.partition_rows()), src.meta.spec  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq

from flowrec.data.priority import enter_data_thread
from flowrec.data.checked import CheckRecord, fingerprint, rules_key
from flowrec.data.checks import ColumnRule, check_partition
from flowrec.data.layout import META_FILE, DataError, DatasetMeta, read_meta
from flowrec.data.names import check_folder_links
from flowrec.data.rowcache import RowCache
from flowrec.data.readers import hold_for_reading, release

IGNORED_PREFIXES = [".", "_"]  # metadata, vocabularies and hidden files are not data


class PartitionSource(Protocol):
    """Partitions with row counts, read asynchronously."""

    bytes_read: int

    def partition_rows(self) -> list[int]: ...

    def row_groups(self, index: int) -> list[int]: ...

    def submit(self, index: int, columns: Sequence[str], row_groups: Sequence[int] | None = None) -> Any: ...

    def close(self) -> None: ...

    def passed(self, index: int, key: str) -> bool: ...

    def add_passed(self, index: int, key: str) -> None: ...


def partition_name(source: PartitionSource, index: int) -> str:
    """How messages name partition `index` of a source: its file, else "partition i"."""
    files = getattr(source, "files", None)
    return str(files[index]) if files is not None else f"partition {index}"


def parquet_files(path: str | Path) -> list[str]:
    """Data files of a Parquet dataset directory (recursive, hive partitions allowed), sorted. Only
    listed: the parts are read file by file, by column name, so no schema is discovered (pyarrow's
    merge of a part's columns with the partition keys of its folders refused a part under `user=1/`
    holding a column `user`: "Unable to merge: Field user has incompatible types", a traceback)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"dataset not found: {path}")
    check_folder_links(path)  # pyarrow follows a link loop without end
    try:
        files = pds.dataset(str(path), format="parquet", partitioning="hive", schema=pa.schema([]),
                            ignore_prefixes=IGNORED_PREFIXES).files
    except (pa.ArrowInvalid, OSError) as exc:
        raise DataError(f"{path}: not a Parquet dataset ({exc})") from None
    if not files:
        raise DataError(f"{path}: no Parquet files")
    return sorted(files)


def _read(file: str, columns: Sequence[str], row_groups: Sequence[int] | None = None) -> pa.Table:
    try:
        if row_groups is None:
            return pq.read_table(file, columns=list(columns), use_threads=False)
        with pq.ParquetFile(file) as pf:
            return pf.read_row_groups(list(row_groups), columns=list(columns), use_threads=False)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(_read_error(file, columns, exc)) from None


def _read_error(file: str, columns: Sequence[str], exc: Exception) -> str:
    """Why a part file could not be read: missing columns, else pyarrow's first line."""
    try:
        names = pq.read_schema(file).names
    except (pa.ArrowException, OSError):
        names = None
    missing = [c for c in columns if names is not None and c not in names]
    if missing:
        return f"{file}: columns {missing} missing (has {names[:12]})"
    return f"{file}: unreadable Parquet part ({str(exc).splitlines()[0]})"


class PartLayout:
    """Row groups of a Parquet part file: rows and stored bytes of each column chunk."""

    def __init__(self, metadata: pq.FileMetaData):
        self.rows = metadata.num_rows
        self.group_rows = [metadata.row_group(g).num_rows for g in range(metadata.num_row_groups)]
        self._bytes: list[dict[str, int]] = []
        for g in range(metadata.num_row_groups):
            group = metadata.row_group(g)
            sizes: dict[str, int] = {}
            for c in range(group.num_columns):
                chunk = group.column(c)
                name = chunk.path_in_schema.split(".")[0]
                sizes[name] = sizes.get(name, 0) + chunk.total_compressed_size
            self._bytes.append(sizes)

    def bytes_of(self, columns: Sequence[str], row_groups: Sequence[int] | None) -> int:
        """Stored bytes of `columns` in `row_groups` (all by default)."""
        groups = range(len(self.group_rows)) if row_groups is None else row_groups
        return sum(self._bytes[g].get(c, 0) for g in groups for c in columns)


def dataset_layout(path: Path, meta: DatasetMeta, files: Sequence[str]) -> list[PartLayout]:
    """The row groups of each part file, their rows checked against ``_flowrec.json``.

    Raises:
        DataError: a part file is unreadable, the files hold another row count than the metadata
            records (stale or foreign part files), or the dataset has 0 rows.
    """
    layouts = []
    for f in files:
        try:
            layouts.append(PartLayout(pq.ParquetFile(f).metadata))
        except (pa.ArrowException, OSError) as exc:
            raise DataError(f"{f}: not a readable Parquet file ({str(exc).splitlines()[0]})") from None
    rows = [part.rows for part in layouts]
    if sum(rows) != meta.rows:
        raise DataError(f"dataset {path}: its part files hold {sum(rows):,} rows but {META_FILE} records "
                        f"{meta.rows:,}: stale or foreign part files; convert it again with --overwrite")
    if not sum(rows):
        raise DataError(f"dataset {path} has 0 rows")
    return layouts


class _ParquetParts:
    """What both Parquet sources share: the part files, their row groups (checked against
    ``_flowrec.json``), the record of partitions that passed the checks and the bytes asked for."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._reading = hold_for_reading(self.path)  # a conversion replacing the folder waits for close()
        try:
            self.meta: DatasetMeta = read_meta(self.path)
            self.files = parquet_files(self.path)
            self._parts = dataset_layout(self.path, self.meta, self.files)
        except BaseException:
            self.stop_reading()
            raise
        self._record = CheckRecord(self.path, self.files)
        self.bytes_read = 0
        self.row_cache = RowCache()

    def stop_reading(self) -> None:
        """Drop the lock that keeps a conversion from replacing the folder while it is read."""
        release(self._reading)
        self._reading = None

    def fingerprints(self) -> list[str]:
        """Each part file's fingerprint now (`flowrec.data.checked.fingerprint`; "" unreadable)."""
        return [fingerprint(f) for f in self.files]

    def forget_passed(self, index: int) -> None:
        """Partition `index` changed: check it again before its rows are used."""
        self._record.forget(index)

    def partition_rows(self) -> list[int]:
        return [part.rows for part in self._parts]

    def row_groups(self, index: int) -> list[int]:
        return list(self._parts[index].group_rows)

    def passed(self, index: int, key: str) -> bool:
        return self._record.passed(index, key)

    def add_passed(self, index: int, key: str) -> None:
        self._record.add(index, key)

    def _count(self, index: int, columns: Sequence[str], row_groups: Sequence[int] | None) -> tuple[int, ...] | None:
        """Count the stored bytes a read of `row_groups` (None: all) asks for; the groups as a tuple."""
        self.bytes_read += self._parts[index].bytes_of(columns, row_groups)
        return None if row_groups is None else tuple(row_groups)


class ParquetSource(_ParquetParts):
    """An encoded Parquet dataset read directly with pyarrow, one partition per file.

    Args:
        path: dataset directory (with ``_flowrec.json``).
        threads: reader threads (partitions read concurrently).
    """

    def __init__(self, path: str | Path, threads: int = 2):
        super().__init__(path)
        self._pool = ThreadPoolExecutor(max(threads, 1), thread_name_prefix="flowrec-read",
                                        initializer=enter_data_thread)

    def submit(self, index: int, columns: Sequence[str], row_groups: Sequence[int] | None = None) -> Future:
        groups = self._count(index, columns, row_groups)
        return self._pool.submit(_read, self.files[index], tuple(columns), groups)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        self._record.save()
        self.row_cache.clear()
        self.stop_reading()


def token(*parts: Any) -> str:
    """A short hash of `parts` (their repr): names Dask tasks by what they compute."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:20]


def _read_checked(file: str, columns: Sequence[str], row_groups: Sequence[int] | None,
                  rules: Sequence[ColumnRule], first_row: int) -> pa.Table:
    """A Dask task: read row groups of a part file and check them (when `rules` are given);
    `first_row` is the file row of the first one (messages name rows within the file)."""
    table = _read(file, columns, row_groups)
    if rules:
        check_partition(table, tuple(rules), file, first_row)
    return table


def take_rows(parts: Sequence[tuple[pa.Table, int, int]], order: Any) -> pa.Table:
    """Rows `order` (None: all, in order) of the concatenated slices [a, b) of `parts`; columns
    may stay in several chunks (pyarrow's take reads them in place)."""
    tables = [t.slice(a, b - a) for t, a, b in parts]
    table = pa.concat_tables(tables) if len(tables) > 1 else tables[0]
    return table if order is None else table.take(pa.array(order))


def _batch(table: pa.Table, start: int, rows: int) -> pa.Table:
    return table.slice(start, rows)


def dask_address_problem(address: str) -> str | None:
    """Why `address` (`--dask`) names no Dask scheduler, or None: 'local' or a scheduler address
    with a port (tcp://host:8786, host:8786, tls://...). Checked before a run starts: 'bogus'
    failed after the data was encoded, in distributed's words, then held the exit 60 s.

    >>> dask_address_problem("tcp://10.0.0.5:8786") is None, dask_address_problem("local") is None
    (True, True)
    >>> dask_address_problem("bogus")
    "'bogus' is not a scheduler address: give local, or tcp://HOST:PORT (e.g. tcp://10.0.0.5:8786)"
    """
    if address == "local":
        return None
    from distributed.comm.addressing import parse_address, parse_host_port

    try:
        scheme, location = parse_address(address)
        if scheme in ("tcp", "tls"):
            parse_host_port(location)
    except ValueError:
        scheme = None
    if scheme is None or not location:
        return f"{address!r} is not a scheduler address: give local, or tcp://HOST:PORT (e.g. tcp://10.0.0.5:8786)"
    try:
        from distributed.comm.registry import get_backend

        get_backend(scheme)
    except ValueError:
        return f"{address!r}: no Dask transport {scheme}://; give local, or tcp://HOST:PORT (e.g. tcp://10.0.0.5:8786)"
    return None


class DaskSource(_ParquetParts):
    """An encoded Parquet dataset whose row groups are read, checked and cut into batches by Dask.

    Every task has a key that names what it computes, so a recomputed task gives the same result
    and runs on one cluster never mix: row-group reads are keyed by the part file's fingerprint,
    its row group, columns and checks; `stage_rows` takes a rank's rows of a shuffle chunk and
    `stage` cuts a batch of them, under the keys their caller gives (`flowrec.data.batches`: run
    token, epoch, chunk or batch, rank).

    Args:
        path: dataset directory.
        address: scheduler address of an existing cluster; None starts a local one.
        workers: worker processes of the local cluster.
    """

    def __init__(self, path: str | Path, address: str | None = None, workers: int = 2):
        from distributed import Client, LocalCluster

        super().__init__(path)
        self.token = token(self.files, [fingerprint(f) for f in self.files])
        self._cluster = None
        if address is None:
            self._cluster = LocalCluster(n_workers=workers, threads_per_worker=1, processes=True,
                                         dashboard_address=":0")  # a free port: never "8787 in use"
            address = self._cluster.scheduler_address
        try:
            self._client = Client(address, set_as_default=False)
        except OSError as exc:  # no scheduler there: distributed's traceback after its connect timeout
            raise DataError(f"--dask {address}: cannot reach a Dask scheduler there ({exc}); start one "
                            f"(dask scheduler) or give --dask local") from None

    def submit(self, index: int, columns: Sequence[str], row_groups: Sequence[int] | None = None,
               rules: Sequence[ColumnRule] = ()) -> Any:
        """Read (and check, with `rules`) row groups of partition `index` on the cluster."""
        groups = self._count(index, columns, row_groups)
        key = (f"flowrec-read-{token(self.token, tuple(columns), rules_key(rules))}", index,
               "all" if groups is None else ",".join(map(str, groups)))
        first_row = sum(self._parts[index].group_rows[:groups[0]]) if groups else 0
        return self._client.submit(_read_checked, self.files[index], tuple(columns), groups, tuple(rules),
                                   first_row, key=key)

    def stage_rows(self, key: Any, parts: Sequence[tuple[Any, int, int]], order: Any) -> Any:
        """On the cluster, under `key`: rows `order` of the slices [a, b) of read futures (`take_rows`)."""
        return self._client.submit(take_rows, list(parts), order, key=key)

    def stage(self, key: Any, rows: Any, start: int, count: int) -> Any:
        """On the cluster, under `key`: one batch, rows [start, start + count) of a `stage_rows` future."""
        return self._client.submit(_batch, rows, start, count, key=key)

    def close(self) -> None:
        self._record.save()  # into the folder read: before a conversion waiting on it may replace it
        self.stop_reading()
        self._client.close()
        if self._cluster is not None:
            # its INFO lines about retiring workers and closing comms are not for users
            names = [n for n in list(logging.root.manager.loggerDict) if n.split(".")[0] == "distributed"]
            levels = {n: logging.getLogger(n).level for n in names}
            for n in names:
                logging.getLogger(n).setLevel(logging.ERROR)
            try:
                self._cluster.close()
            finally:
                for n, level in levels.items():
                    logging.getLogger(n).setLevel(level)


class _Done:
    """A completed future."""

    def __init__(self, value: pa.Table):
        self._value = value

    def result(self) -> pa.Table:
        return self._value


class MemorySource:
    """Partitions held in memory (tests, the default synthetic job).

    Args:
        tables: encoded tables, one per partition.
        group_rows: rows per row group (None: one row group per partition).

    Example:
        >>> src = MemorySource([pa.table({"x": [1, 2]}), pa.table({"x": [3]})])
        >>> src.partition_rows()
        [2, 1]
    """

    def __init__(self, tables: Sequence[pa.Table], group_rows: int | None = None):
        self.tables = list(tables)
        self.group_rows = group_rows
        self.bytes_read = 0
        self._passed: set[tuple[int, str]] = set()
        self.row_cache = RowCache()

    def fingerprints(self) -> list[str]:
        """What each partition is: its table object (replacing `tables[i]` drops its cached rows)."""
        return [f"table:{id(t)}:{t.num_rows}" for t in self.tables]

    def forget_passed(self, index: int) -> None:
        """Partition `index` was replaced: check it again before its rows are used."""
        self._passed = {(i, key) for i, key in self._passed if i != index}

    def partition_rows(self) -> list[int]:
        return [t.num_rows for t in self.tables]

    def row_groups(self, index: int) -> list[int]:
        n = self.tables[index].num_rows
        step = self.group_rows or max(n, 1)
        return [min(step, n - lo) for lo in range(0, n, step)] or [0]

    def submit(self, index: int, columns: Sequence[str], row_groups: Sequence[int] | None = None) -> _Done:
        table = self.tables[index].select(list(columns))
        if row_groups is not None:
            starts = np.concatenate([[0], np.cumsum(self.row_groups(index))])
            table = pa.concat_tables([table.slice(int(starts[g]), int(starts[g + 1] - starts[g]))
                                      for g in row_groups])
        self.bytes_read += table.nbytes
        return _Done(table)

    def passed(self, index: int, key: str) -> bool:
        return (index, key) in self._passed

    def add_passed(self, index: int, key: str) -> None:
        self._passed.add((index, key))

    def close(self) -> None:
        self.row_cache.clear()


def split_table(table: pa.Table, partitions: int) -> list[pa.Table]:
    """Cut a table into `partitions` nearly equal partitions (for a MemorySource)."""
    n = table.num_rows
    bounds = [n * i // partitions for i in range(partitions + 1)]
    return [table.slice(a, b - a) for a, b in zip(bounds[:-1], bounds[1:])]
