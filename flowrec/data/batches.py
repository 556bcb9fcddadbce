"""The batch iterator: shuffled, prefetched, resumable batches in the operators' packed layout.

One epoch is a stream of rows: the partitions in an order seeded by (seed, epoch), cut into
chunks of `chunk_rows` rows (the shuffle buffer, a multiple of the batch size); the rows of each
chunk are shuffled into batches by a generator seeded by (seed, epoch, chunk), stratified so that
a rank's slice of every batch comes from about 1/W of the chunk (`flowrec.data.strata`). Every
row is in exactly one chunk and one batch, whatever the partition, row-group, worker and rank
counts, the global batches are the same for every world size, and batch k of an epoch can be
produced without the batches before it (`start_batch` resumes exactly). Unshuffled epochs (eval)
keep the stream order.

A reader thread reads the row groups this rank's rows are in (the next chunk's ahead), checks
each one before using any of its rows (`flowrec.data.checks`: a bad id, value or label is a DataError naming the partition,
column and row, never a row of another table; a partition that passed is not checked again,
`flowrec.data.checked`), permutes chunks and submits one
packing task per batch to a pool of `workers` threads; the futures wait in a bounded queue
(`prefetch`). Where every group holds one id per field and no map remaps ids, a chunk is first
filled into row-major matrices (`_ChunkMatrices`, buffers reused chunk to chunk) and a batch is
one row gather of each; otherwise the chunk's rows are taken as a table and packed per batch
(`pack_group`): the same batches either way. With `cache_data` (`flowrec.data.rowcache`) the
rows are kept for the whole dataset across epochs, in one line-aligned row matrix (every value of
a row side by side, ids as int32 where they fit): the first epoch fills each row group as it
reads it, later ones read and decode nothing and a batch is one gather of its rows from that
matrix (a chunk's stream rows mapped to dataset rows) straight into the batch's arrays, one
numba pass that releases the GIL (`flowrec.data.rowpack`, `_pack_cached`), again the same batches. With `lookahead` W > 0 every batch also carries, per group, its unique rows, its
casting index and the unique rows of the window of the next W batches (`flowrec.data.lookahead`),
computed by a lookahead thread. Closing the iterator (or an exception, or KeyboardInterrupt in
the consumer) stops and joins every thread.

Example:
    >>> with iterate_batches(spec, MemorySource([table]), StagingOptions(batch_size=4)) as it:
    ...     for batch in it:  # doctest: +SKIP
    ...         batch.groups["g0_d16"].ids
"""
from __future__ import annotations

import queue
import sys
import threading
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Iterator, Sequence

import numpy as np
import pyarrow as pa
import torch

from flowrec.data.priority import enabled as priority_enabled, enter_data_thread, wait_for, waiting
from flowrec.data.checked import rules_key
from flowrec.data.checks import ColumnRule, check_partition, partition_rules
from flowrec.data.dataset import PartitionSource, partition_name, take_rows, token
from flowrec.data.layout import batch_label_columns
from flowrec.data.lookahead import LookaheadWindow, batch_extras
from flowrec.data.managed_stage import Remapper, cut_columns, drop_defaults
from flowrec.data.negatives import NegativeSampler
from flowrec.data.packed_ids import column_arrays, pack_group
from flowrec.data.rowcache import CACHE_MODES, NotKept, RowCache, RowLayout, auto_budget, fill_matrices
from flowrec.data.strata import STRATA, chunk_layout, needed_range
from flowrec.graph.types import PackedGroup
from flowrec.graph.packing import group_layout
from flowrec.spec.model import ModelSpec

POLL_S = 0.05  # seconds between stop-flag checks of blocked threads
JOIN_S = 10.0  # seconds to wait for a thread at close


@dataclass(frozen=True)
class GroupIds:
    """Ids of one packed group for one batch.

    Args:
        ids: packed row ids.  # (nnz,) int64
        offsets: bag boundaries, bag = b*S + s.  # (B*S + 1,) int64
        casting: tensor-casting index (lookahead only), else None.
        unique: sorted unique rows of this batch (lookahead only).  # (U,) int64
        window_unique: sorted unique rows of this batch and the next W-1 (lookahead only).
        horizon_rows: sorted unique rows of the H batches after the window (lookahead with a
            horizon only).  # (K,) int64
        horizon_next: batches from this one to each horizon row's first use there (W..W+H-1).  # (K,) int64
    """

    ids: torch.Tensor
    offsets: torch.Tensor
    casting: Any = None
    unique: torch.Tensor | None = None
    window_unique: torch.Tensor | None = None
    horizon_rows: torch.Tensor | None = None
    horizon_next: torch.Tensor | None = None


@dataclass(frozen=True)
class Batch:
    """One staged batch.

    Args:
        dense: dense features in spec order.  # (B, n_dense) float32
        labels: one column per head, in head order.  # (B, n_heads) float32
        groups: packed group name -> GroupIds.
        epoch: epoch number.
        index: batch number within the epoch.
        size: B, samples in this batch (the last batch may be smaller unless drop_last).
        global_size: samples in the global batch this one is a rank's slice of (None: B, one
            process); the loss of a slice is its share of the global batch's mean.
        managed: what the managed tables' maps did for this batch (None: no managed tables).
        negatives: a retrieval head's sampled items (table rows) of this step, appended to its
            item group as N extra samples (`flowrec.data.negatives`; None: none).  # (N,) int64
    """

    dense: torch.Tensor
    labels: torch.Tensor
    groups: dict[str, GroupIds]
    epoch: int
    index: int
    size: int
    global_size: int | None = None
    managed: Any = None  # `flowrec.data.managed_stage.ManagedBatch` of a spec with managed tables
    negatives: torch.Tensor | None = None

    @property
    def samples_in_step(self) -> int:
        """Samples of the whole (global) batch of this step."""
        return self.size if self.global_size is None else self.global_size


@dataclass(frozen=True)
class StagingOptions:
    """Settings of the batch iterator.

    Args:
        batch_size: rows per batch (None: the spec's training.batch_size).
        shuffle: shuffle partitions and rows.
        seed: shuffle seed (None: the spec's training.seed).
        shuffle_buffer: rows permuted together (rounded up to a multiple of the batch size).
        drop_last: drop the last, smaller batch of an epoch.
        workers: packing threads.
        prefetch: batches staged ahead (bounded queue).
        lookahead: window W in batches for lookahead extraction (0: off).
        horizon: H, batches after the window whose rows are also attached, with their next use
            (`GroupIds.horizon_rows`), for the lookahead cache's choice of victims (0: none;
            lookahead only). The data stage then holds W + H batches.
        casting: attach the casting index when lookahead is on.
        check: check every partition before batching it (`flowrec.data.checks`: ids inside their
            tables, finite dense values and labels, binary labels 0 or 1); off only to measure
            what the checks cost.
        world_size: ranks training together (W); each batch is then this rank's slice of the
            global batch (`rank_slice`): the global batches are the same for every W, and a rank
            reads only the row groups its slices are in (about 1/W of a shuffled epoch).
        rank: this rank (0 .. W-1).
        cache_data: keep the dataset's staged rows in memory across epochs (`flowrec.data.rowcache`):
            "auto" (a Parquet dataset whose decoded rows fit `cache_budget`, else half the memory
            still available), "on" (any local source, any size) or "off" (read every epoch).
        cache_budget: bytes the kept rows may take under "auto" (None: half the available memory).
    """

    batch_size: int | None = None
    shuffle: bool = True
    seed: int | None = None
    shuffle_buffer: int = 1 << 17
    drop_last: bool = False
    workers: int = 2
    prefetch: int = 4
    lookahead: int = 0
    horizon: int = 0
    casting: bool = True
    check: bool = True
    world_size: int = 1
    rank: int = 0
    cache_data: str = "auto"
    cache_budget: int | None = None


def batches_per_epoch(rows: int, batch_size: int, drop_last: bool) -> int:
    return rows // batch_size if drop_last else -(-rows // batch_size)


def rank_slice(size: int, world_size: int, rank: int) -> tuple[int, int]:
    """Samples [lo, hi) of a global batch of `size` that `rank` of `world_size` trains.

    Contiguous, as even as possible (sizes differ by at most one; a rank may get none of a
    final batch smaller than W), and together they cover the batch once.

    Example:
        >>> [rank_slice(5, 2, r) for r in range(2)]
        [(0, 2), (2, 5)]
    """
    return rank * size // world_size, (rank + 1) * size // world_size


@dataclass(frozen=True)
class EpochPlan:
    """The row order of one epoch: partition order and chunking."""

    order: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]  # rows per row group of each partition, in `order`
    chunk_rows: int
    seed: int
    epoch: int
    shuffle: bool

    @cached_property
    def total(self) -> int:
        return sum(sum(g) for g in self.groups)

    def chunk_batches(self, chunk: int, batch_size: int) -> list[np.ndarray]:
        """Chunk-local row indices of each global batch of `chunk` (`flowrec.data.strata`)."""
        rows = min(self.chunk_rows, self.total - chunk * self.chunk_rows)
        if not self.shuffle:
            return [np.arange(k, min(k + batch_size, rows)) for k in range(0, rows, batch_size)]
        rng = np.random.default_rng([self.seed, self.epoch, chunk])
        return chunk_layout(rows, batch_size, STRATA, rng)


def epoch_plan(group_rows: Sequence[Sequence[int]], batch_size: int, opts: StagingOptions, seed: int,
               epoch: int) -> EpochPlan:
    """The epoch's plan from the rows of each row group of each partition (`source.row_groups`)."""
    n = len(group_rows)
    order = np.random.default_rng([seed, epoch]).permutation(n) if opts.shuffle else np.arange(n)
    chunk = -(-max(opts.shuffle_buffer, 1) // batch_size) * batch_size if opts.shuffle else 8 * batch_size
    return EpochPlan(tuple(int(i) for i in order), tuple(tuple(int(r) for r in group_rows[i]) for i in order),
                     chunk, seed, epoch, opts.shuffle)


@dataclass(frozen=True)
class _Chunk:
    """What a rank takes from one chunk: the stream rows it reads and, per batch, its rows of them."""

    read_lo: int  # stream rows [read_lo, read_hi) to read
    read_hi: int
    batches: tuple[tuple[int, np.ndarray, int | None], ...]  # (batch index, rows from read_lo, global size)


class BatchIterator:
    """Iterator over the batches of one epoch; a context manager that stops its threads on exit."""

    gather_chunks = True  # False: every chunk taken as a table (the reference the tests compare with)

    def __init__(self, spec: ModelSpec, source: PartitionSource, opts: StagingOptions, epoch: int,
                 start_batch: int, groups: tuple[PackedGroup, ...], remap: Remapper | None = None,
                 negatives: NegativeSampler | None = None):
        self.spec, self.source, self.opts, self.groups, self.remap = spec, source, opts, groups, remap
        self.negatives = negatives
        self.batch_size = opts.batch_size or spec.training.batch_size
        seed = spec.training.seed if opts.seed is None else opts.seed
        parts = range(len(source.partition_rows()))
        self.plan = epoch_plan([source.row_groups(i) for i in parts], self.batch_size, opts, seed, epoch)
        self.epoch, self.start_batch = epoch, start_batch
        self.num_batches = batches_per_epoch(self.plan.total, self.batch_size, opts.drop_last)
        self.columns = _columns(spec)
        self._dense_names = [f.name for f in spec.dense_features]
        self._label_names = list(batch_label_columns(spec))
        self._group_fields = [[(f.feature, int(g.row_offsets[f.table])) for f in g.fields] for g in groups]
        self._sparse_names = sorted({name for fields in self._group_fields for name, _ in fields})
        # chunks gathered as matrices (`_ChunkMatrices`) where every group is one id per field and
        # no map remaps the ids; else (sequences, managed tables) taken as a table, packed per batch
        self._gathered = remap is None and self.gather_chunks
        self._matrices = _MatrixPool(self.plan.chunk_rows)
        self._outputs = _output_pool(source, opts.prefetch + opts.workers + opts.lookahead + opts.horizon + 4)
        self._rules = partition_rules(self.spec, self.columns) if opts.check else ()  # checks of each partition read
        self._cache = self._open_cache()
        priority_enabled()  # a bad FLOWREC_DATA_PRIORITY is an error here, before any thread starts
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(max(opts.workers, 1), thread_name_prefix="flowrec-pack",
                                        initializer=enter_data_thread)
        self._futures: queue.Queue = queue.Queue(maxsize=max(opts.prefetch, 1))
        self._threads = [threading.Thread(target=self._read, name="flowrec-reader", daemon=True)]
        if self._cache is not None and not self._cache.complete():  # the kernels load while the first reads decode
            self._threads.append(threading.Thread(target=_load_rowpack, name="flowrec-rowpack", daemon=True))
        self._out = self._futures
        if opts.lookahead > 0:
            self._out = queue.Queue(maxsize=max(opts.prefetch, 1))
            self._threads.append(threading.Thread(target=self._lookahead, name="flowrec-lookahead",
                                                  daemon=True))
        self._closed = False
        for t in self._threads:
            t.start()

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        try:
            # a consumer that waits raises the data threads to normal priority meanwhile
            item = wait_for(lambda: self._get(self._out), ready=not self._out.empty())
            if item is None:
                self.close()
                raise StopIteration
            batch = wait_for(item.result, ready=item.done()) if isinstance(item, Future) else item
            if isinstance(batch, BaseException):
                raise batch
            return batch
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "BatchIterator":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        self.close()

    def close(self) -> None:
        """Stop the threads, drop staged batches, join (idempotent)."""
        if getattr(self, "_closed", True):
            return
        self._closed = True
        self._stop.set()
        for q in {id(self._futures): self._futures, id(self._out): self._out}.values():
            _drain(q)
        with waiting():  # threads that see the stop flag are not kept off the cores
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join(JOIN_S)
            self._pool.shutdown(wait=True, cancel_futures=True)
        if self._cache is not None and not any(t.is_alive() for t in self._threads):
            self._cache.release(self)  # (a reader still running keeps it: later epochs stream)

    def _open_cache(self) -> RowCache | None:
        """The source's row cache reserved for this epoch, or None: stream (`opts.cache_data` off,
        or "auto" and rows already in memory or not fitting the budget, rows not in the gathered
        layout, a Dask source, a source without a cache, or another iterator using it)."""
        opts, source = self.opts, self.source
        if opts.cache_data not in CACHE_MODES:
            raise ValueError(f"StagingOptions.cache_data must be one of {', '.join(CACHE_MODES)}, "
                             f"not {opts.cache_data!r}")
        cache, marks = getattr(source, "row_cache", None), getattr(source, "fingerprints", None)
        flat = all(f.max_len == 1 for g in self.groups for f in g.fields)  # lists: checked at the fill
        if (opts.cache_data == "off" or cache is None or marks is None or not self._gathered or not flat
                or getattr(source, "stage", None) is not None
                or (opts.cache_data == "auto" and getattr(source, "files", None) is None)):
            return None
        key = (tuple(self.columns), tuple(self._dense_names), tuple(self._label_names),
               tuple(tuple(fields) for fields in self._group_fields), rules_key(self._rules))
        layout = RowLayout.of(len(self._dense_names), len(self._label_names),
                              [len(f) for f in self._group_fields], [g.rows for g in self.groups])
        budget = None if opts.cache_data == "on" else (opts.cache_budget if opts.cache_budget is not None
                                                       else auto_budget)
        parts = range(len(source.partition_rows()))
        dropped = cache.open(weakref.ref(self), key, [source.row_groups(i) for i in parts], layout, marks(), budget)
        if dropped is None:
            return None
        for index in dropped:  # a changed file: its rows are read and checked again
            source.forget_passed(index)
        return cache

    def _get(self, q: queue.Queue) -> Any:
        while True:
            try:
                return q.get(timeout=POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return None

    def _put(self, q: queue.Queue, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                q.put(item, timeout=POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _read(self) -> None:
        enter_data_thread()
        try:
            for turn, (index, table, global_size) in enumerate(self._raw_batches()):
                fut = self._pool.submit(self._pack, table, index, global_size, turn)
                if not self._put(self._futures, fut):
                    return
            self._put(self._futures, None)
        except BaseException as exc:  # surfaced to the consumer
            self._put(self._futures, _failed(exc))

    def _chunks(self) -> Iterator[_Chunk]:
        """This rank's part of each chunk from start_batch on, in epoch order."""
        plan, bsz, opts = self.plan, self.batch_size, self.opts
        for chunk in range(self.start_batch * bsz // plan.chunk_rows, -(-plan.total // plan.chunk_rows)):
            lo = chunk * plan.chunk_rows
            layout = plan.chunk_batches(chunk, bsz)
            kept = [(lo // bsz + k, rows) for k, rows in enumerate(layout)
                    if self.start_batch <= lo // bsz + k < self.num_batches]
            if not kept:
                continue
            slices = [self._read_slice(len(rows)) for _, rows in kept]
            if len(kept) == len(layout) and all(a == 0 and b == len(rows) for (a, b), (_, rows) in zip(slices, kept)):
                read_lo, read_hi = 0, sum(len(rows) for _, rows in kept)  # whole batches, every row of the chunk
            else:
                read_lo, read_hi = needed_range([rows for _, rows in kept], slices)
            read_hi = max(read_hi, read_lo + 1)  # a rank with no rows here still gets the schema
            yield _Chunk(lo + read_lo, lo + read_hi, tuple(
                (index, rows[a:b] - read_lo if read_lo else rows[a:b], len(rows) if opts.world_size > 1 else None)
                for (index, rows), (a, b) in zip(kept, slices)))

    def _read_slice(self, size: int) -> tuple[int, int]:
        """Samples of a global batch this rank reads: its slice, or with managed tables on several
        ranks whose maps are replicated the whole batch (every rank steps its replica of the maps
        on the global batch's ids, then keeps its slice: `_pack`; owner ranks read their slice)."""
        if self.remap is not None and self.opts.world_size > 1 and getattr(self.remap, "replicated", True):
            return 0, size
        return rank_slice(size, self.opts.world_size, self.opts.rank)

    def _raw_batches(self) -> Iterator[tuple[int, Any, int | None]]:
        """(batch index, this rank's rows: a table, or a `_Staged` batch of a Dask source, global
        batch size or None) in epoch order. A chunk's rows for this rank are taken once, in batch
        order, and cut into batches without copies."""
        remote = getattr(self.source, "stage", None) is not None
        reader = _RowReader(self.source, self.plan, self.columns, self._rules, remote, self._cache)
        run = token(getattr(self.source, "token", ""), self.columns, self.plan, self.batch_size,
                    self.opts.world_size)
        chunks = self._chunks()
        if reader.cache is not None and reader.cache.complete():  # a warm epoch: nothing to read ahead,
            for current in chunks:  # so the first chunk's batches go out before the next one is laid out
                yield from self._cached_batches(reader, current)
            return
        current = next(chunks, None)
        while current is not None:
            upcoming = next(chunks, None)
            if upcoming is not None:
                reader.prefetch(upcoming.read_lo, upcoming.read_hi)
            if reader.cache is not None:
                try:
                    cached = self._cached_batches(reader, current)
                except NotKept:  # lists after all, or an id beyond int32: stream (the pending reads stay)
                    self._drop_cache(reader)
                else:
                    yield from cached
                    current = upcoming
                    continue
            order = np.concatenate([rows for _, rows, _ in current.batches])
            if not self.plan.shuffle and self.opts.world_size == 1:
                order = None  # the stream order: the rows as read
            if remote:
                parts = reader.parts(current.read_lo, current.read_hi)
                first = current.batches[0][0]
                taken = self.source.stage_rows((f"flowrec-rows-{run}", self.epoch, first, self.opts.rank),
                                               [p[:3] for p in parts], order)
                pieces = [i for p in parts for i in p[3]]
            else:
                tables = reader.tables(current.read_lo, current.read_hi)
                if self._gathered and _flat(tables[0][0], self._sparse_names):
                    chunk = _ChunkMatrices(tables, self._dense_names, self._label_names, self._group_fields,
                                           self._matrices, len(current.batches))
                    for index, rows, global_size in current.batches:
                        yield index, _Rows(chunk, rows), global_size
                    current = upcoming
                    continue
                taken = take_rows(tables, order)
            start = 0
            for index, rows, global_size in current.batches:
                if remote:
                    key = (f"flowrec-batch-{run}", self.epoch, index, self.opts.rank)
                    batch = _Staged(self.source.stage(key, taken, start, len(rows)), reader, pieces)
                else:
                    batch = taken.slice(start, len(rows))
                yield index, batch, global_size
                start += len(rows)
            current = upcoming

    def _cached_batches(self, reader: "_RowReader", chunk: "_Chunk") -> list[tuple[int, "_Rows", int | None]]:
        """(batch index, rows, global batch size) of a chunk from the row cache (its row groups not
        held yet read and filled first), mapped to dataset rows by the packer.

        Raises:
            NotKept: a row group cannot be kept (lists, an id beyond int32): nothing was yielded.
        """
        assert reader.cache is not None
        first, rows_of = reader.cached_rows(chunk.read_lo, chunk.read_hi, self._fill)
        view = _CacheView(reader.cache)
        return [(index, _Rows(view, rows, rows_of, first), global_size) for index, rows, global_size in chunk.batches]

    def _fill(self, table: pa.Table, partition: int, group: int, a: int, b: int) -> None:
        """Fill row group `group` of `partition` (rows [a, b) of a read, checked block) into the cache."""
        if not _flat(table, self._sparse_names):
            raise NotKept("list columns: not the gathered layout")
        assert self._cache is not None
        self._cache.fill(partition, group, table, a, b, self._dense_names, self._label_names, self._group_fields)

    def _drop_cache(self, reader: "_RowReader") -> None:
        """Stream from here on: the rows are not in the gathered layout (the cache is emptied)."""
        cache, self._cache, reader.cache = self._cache, None, None
        if cache is not None:
            cache.clear()
            cache.release(self)

    def _pack(self, rows: Any, index: int, global_size: int | None, turn: int = 0) -> Batch:
        if isinstance(rows, _Rows):
            return self._pack_rows(rows, index, global_size)
        table = rows.result() if isinstance(rows, _Staged) else rows
        cols = {f.name: column_arrays(table.column(f.name)) for f in self.spec.sparse_features}
        managed = None
        if self.remap is not None:  # raw ids -> rows, one batch at a time in epoch order
            remap = self.remap
            done = remap.in_turn(turn, self._stop.is_set, lambda: remap.remap(cols))
            if done is None:
                raise RuntimeError("the batch iterator was closed")
            cols, managed = done
            if self.opts.world_size > 1 and getattr(remap, "replicated", True):  # the whole global batch was
                # read and remapped by this rank's replica of the maps: keep this rank's slice
                lo, hi = rank_slice(table.num_rows, self.opts.world_size, self.opts.rank)
                table, cols = table.slice(lo, hi - lo), cut_columns(cols, lo, hi)
        size = table.num_rows
        dense = _stack(table, [f.name for f in self.spec.dense_features], size)
        labels = _stack(table, list(batch_label_columns(self.spec)), size)
        packed = []
        for g in self.groups:
            ids, offsets = pack_group(g, cols, size)
            if managed is not None and g.name in self.remap.groups:
                ids, offsets = drop_defaults(ids, offsets)
            packed.append((ids, offsets))
        return self._batch(dense, labels, packed, index, size, global_size, managed)

    def _pack_rows(self, rows: "_Rows", index: int, global_size: int | None) -> Batch:
        """A batch of a gathered chunk: one row gather of each matrix (`_ChunkMatrices`)."""
        if isinstance(rows.chunk, _CacheView):
            return self._pack_cached(rows, index, global_size)
        chunk, sel = rows.chunk, rows.rows
        size = len(sel)
        out = self._gather_outputs(size, chunk.dense.shape[1], chunk.labels.shape[1], [ids.shape[1] for ids in chunk.ids])
        # mode="clip" (the rows are in range by construction): "raise" would gather into a temporary
        np.take(chunk.dense, sel, axis=0, out=out[0], mode="clip")
        np.take(chunk.labels, sel, axis=0, out=out[1], mode="clip")
        for k, ids in enumerate(chunk.ids):
            np.take(ids, sel, axis=0, out=out[2 + 2 * k].reshape(size, ids.shape[1]), mode="clip")
        for offsets in out[3::2]:  # one id per field: bag k is id k
            np.copyto(offsets, self._outputs.arange(len(offsets)))
        chunk.release()
        return self._gathered_batch(out, index, size, global_size)

    def _pack_cached(self, rows: "_Rows", index: int, global_size: int | None) -> Batch:
        """A batch of the row cache: its rows gathered from the row matrix straight into the
        batch's arrays, ids widened from int32 where the layout narrowed them, offsets written in
        the same pass (`flowrec.data.rowpack`): the values `_pack_rows` gathers from a chunk."""
        view = rows.chunk
        layout = view.packer.layout
        size = len(rows.rows)
        out = self._gather_outputs(size, layout.dense, layout.labels, layout.fields)
        view.pack(rows.rows, rows.first, rows.mapping, out)
        return self._gathered_batch(out, index, size, global_size)

    def _gather_outputs(self, size: int, dense: int, labels: int, fields: Sequence[int]) -> list[np.ndarray]:
        """The pooled arrays a gathered batch of `size` rows is written into: dense (size, dense)
        and labels (size, labels) float32, then per packed group of F fields its flat ids
        (size * F,) and offsets (size * F + 1,) int64 (the layout `pack_group` gives flat fields)."""
        shapes = [((size, dense), np.float32), ((size, labels), np.float32)]
        for f in fields:
            shapes += [((size * f,), np.int64), ((size * f + 1,), np.int64)]
        return self._outputs.get(shapes)

    def _gathered_batch(self, out: list[np.ndarray], index: int, size: int, global_size: int | None) -> Batch:
        """The batch of `_gather_outputs` arrays, every one written, then `_batch`; the arrays go
        back to the pool, reused once the batch's tensors are freed."""
        packed = list(zip(out[2::2], out[3::2]))
        batch = self._batch(torch.from_numpy(out[0]), torch.from_numpy(out[1]), packed, index, size, global_size, None)
        self._outputs.put(out)
        return batch

    def _batch(self, dense: torch.Tensor, labels: torch.Tensor, packed: list[tuple[np.ndarray, np.ndarray]],
               index: int, size: int, global_size: int | None, managed: Any) -> Batch:
        """The batch from its packed (ids, offsets) per group: negatives, lookahead extras."""
        groups = {}
        sampler = self.negatives
        items = None if sampler is None else sampler.draw(self.epoch, index)  # the same on every rank
        for g, (ids, offsets) in zip(self.groups, packed):
            ids_t, off_t = torch.from_numpy(ids), torch.from_numpy(offsets)
            if items is not None and g.name == sampler.group:  # before the casting and the window
                ids_t, off_t = sampler.append(ids_t, off_t, items)
            if self.opts.lookahead > 0:
                groups[g.name] = GroupIds(ids_t, off_t, *batch_extras(g, ids_t, off_t, self.opts.casting))
            else:
                groups[g.name] = GroupIds(ids_t, off_t)
        return Batch(dense, labels, groups, self.epoch, index, size, global_size, managed, items)

    def _lookahead(self) -> None:
        enter_data_thread()
        window = LookaheadWindow(self.opts.lookahead, self.opts.horizon)
        try:
            while True:
                item = self._get(self._futures)
                if item is None or self._stop.is_set():
                    break
                batch = item.result()
                if isinstance(batch, BaseException):
                    raise batch
                for ready in window.push(batch):
                    if not self._put(self._out, ready):
                        return
            for ready in window.flush():
                if not self._put(self._out, ready):
                    return
            self._put(self._out, None)
        except BaseException as exc:
            self._put(self._out, _failed(exc))


@dataclass
class _Block:
    """Consecutive row groups of one partition, read together (one read per partition and range)."""

    future: Any  # of the rows of `pieces`
    pieces: list[int]
    first_row: int  # the partition row of its first row
    checked: bool = False


class _RowReader:
    """Rows [lo, hi) of the epoch stream, reading only the row groups they touch.

    The row groups a range needs that are not read yet are read in blocks (consecutive groups of
    one partition, one read each); a block still needed by the next range is kept; `prefetch`
    starts reading a later range ahead. Every block is checked before any of its rows is used
    (here, or with `remote` by the Dask task that reads it); a partition whose row groups all
    passed in this epoch is recorded as passed.
    """

    def __init__(self, source: PartitionSource, plan: EpochPlan, columns: list[str],
                 rules: tuple[ColumnRule, ...], remote: bool = False, cache: RowCache | None = None):
        self.source, self.plan, self.columns, self.rules = source, plan, columns, rules
        self.remote, self.cache = remote, cache
        self.pieces: list[tuple[int, int, int]] = []  # (partition position, row group, rows)
        starts = [0]
        for pos, groups in enumerate(plan.groups):
            for g, n in enumerate(groups):
                if n:
                    self.pieces.append((pos, g, n))
                    starts.append(starts[-1] + n)
        self.starts = np.asarray(starts, np.int64)
        self.pending: dict[int, tuple[_Block, int]] = {}  # piece -> (its block, its first row in it)
        self.checked: dict[int, set[int]] = {}  # partition position -> row groups that passed
        self.key = rules_key(rules)
        self._lock = threading.Lock()

    def _span(self, lo: int, hi: int) -> range:
        return range(int(np.searchsorted(self.starts, lo, side="right")) - 1,
                     int(np.searchsorted(self.starts, hi, side="left")))

    def _unchecked(self, pos: int) -> bool:
        return bool(self.rules) and not self.source.passed(self.plan.order[pos], self.key)

    def prefetch(self, lo: int, hi: int) -> None:
        """Start reading the row groups of stream rows [lo, hi) not read yet, in blocks."""
        todo = [i for i in self._span(lo, hi) if i not in self.pending and not self._held(i)]
        while todo:
            pos = self.pieces[todo[0]][0]
            run = [todo[0]]
            while len(run) < len(todo) and todo[len(run)] == run[-1] + 1 and self.pieces[todo[len(run)]][0] == pos:
                run.append(todo[len(run)])
            todo = todo[len(run):]
            groups = [self.pieces[i][1] for i in run]
            index = self.plan.order[pos]
            if self.remote:
                rules = self.rules if self._unchecked(pos) else ()
                future = self.source.submit(index, self.columns, groups, rules)
            else:
                future = self.source.submit(index, self.columns, groups)
            block = _Block(future, run, sum(self.plan.groups[pos][:groups[0]]))
            offset = 0
            for i in run:
                self.pending[i] = (block, offset)
                offset += self.pieces[i][2]

    def _held(self, piece: int) -> bool:
        """Whether the cache holds the rows of `piece` (nothing to read)."""
        pos, group, _ = self.pieces[piece]
        return self.cache is not None and self.cache.filled(self.plan.order[pos], group)

    def cached_rows(self, lo: int, hi: int, fill: Any) -> tuple[int, np.ndarray | None]:
        """The cache's rows of stream rows [lo, hi), in stream order: (first, None) where they are
        the consecutive dataset rows first.. (row groups in source order, the common case), else
        (0, dataset row of each); row groups it does not hold yet are read, checked and passed to
        `fill(table, partition, group, a, b)` first."""
        cache = self.cache
        assert cache is not None
        spans = []
        for i, a, b in self._overlaps(lo, hi):
            pos, group, n = self.pieces[i]
            partition = self.plan.order[pos]
            if not cache.filled(partition, group):
                block, offset = self.pending[i]
                fill(self._table(block), partition, group, offset, offset + n)
            start = cache.start(partition, group)
            spans.append((start + a, start + b))
        if all(prev[1] == nxt[0] for prev, nxt in zip(spans, spans[1:])):
            return spans[0][0], None
        return 0, np.concatenate([np.arange(a, b, dtype=np.int64) for a, b in spans])

    def passed(self, pieces: Sequence[int]) -> None:
        """Record that row groups `pieces` passed the checks."""
        for i in pieces:
            pos, group, _ = self.pieces[i]
            with self._lock:
                done = self.checked.setdefault(pos, set())
                complete = group not in done and len(done) + 1 == sum(1 for n in self.plan.groups[pos] if n)
                done.add(group)
            if complete and self.rules:
                self.source.add_passed(self.plan.order[pos], self.key)

    def _table(self, block: _Block) -> pa.Table:
        table = block.future.result()
        pos = self.pieces[block.pieces[0]][0]
        if not block.checked and self._unchecked(pos):
            check_partition(table, self.rules, partition_name(self.source, self.plan.order[pos]), block.first_row)
            self.passed(block.pieces)
        block.checked = True
        return table

    def _overlaps(self, lo: int, hi: int) -> Iterator[tuple[int, int, int]]:
        """(piece, a, b): rows [a, b) of each piece that [lo, hi) touches; drops pieces before lo."""
        self.prefetch(lo, hi)
        for i in [i for i in self.pending if self.starts[i + 1] <= lo]:
            del self.pending[i]
        for i in self._span(lo, hi):
            start, end = int(self.starts[i]), int(self.starts[i + 1])
            yield i, max(lo, start) - start, min(hi, end) - start

    def _merged(self, lo: int, hi: int) -> list[tuple[_Block, int, int, list[int]]]:
        """[lo, hi) as (block, a, b, pieces): rows [a, b) of each block it touches."""
        out: list[tuple[_Block, int, int, list[int]]] = []
        for i, a, b in self._overlaps(lo, hi):
            block, offset = self.pending[i]
            if out and out[-1][0] is block and out[-1][2] == offset + a:
                out[-1] = (block, out[-1][1], offset + b, out[-1][3] + [i])
            else:
                out.append((block, offset + a, offset + b, [i]))
        return out

    def parts(self, lo: int, hi: int) -> list[tuple[Any, int, int, list[int]]]:
        """(future, a, b, pieces) per block of stream rows [lo, hi), unresolved (Dask)."""
        return [(block.future, a, b, pieces) for block, a, b, pieces in self._merged(lo, hi)]

    def tables(self, lo: int, hi: int) -> list[tuple[pa.Table, int, int]]:
        """(table, a, b) per block of stream rows [lo, hi), read and checked (`take_rows` parts)."""
        return [(self._table(block), a, b) for block, a, b, _ in self._merged(lo, hi)]


class _ChunkMatrices:
    """The rows a rank reads of one chunk as row-major matrices, built once per chunk.

    `dense` (n, n_dense) float32 and `labels` (n, n_labels) float32 as `_stack` fills them, and per
    packed group `ids` (n, F) int64: field j's ids plus its table's row offset, the (B, F) layout
    `pack_group` gives a batch of one-hot fields. A batch is then one row gather of each matrix
    (`np.take(m, rows, axis=0)`, contiguous rows), instead of a `take` of every column of the chunk
    followed by a strided copy per field and batch: the same values, one pass over them fewer.

    Args:
        tables: (table, a, b) per block of the chunk's stream rows (`_RowReader.tables`).
        dense: dense feature columns, in spec order.
        labels: label columns, in head order.
        groups: per packed group, (column, row offset) of each field in field order.
    """

    def __init__(self, tables: Sequence[tuple[pa.Table, int, int]], dense: list[str], labels: list[str],
                 groups: list[list[tuple[str, int]]], pool: "_MatrixPool", batches: int):
        rows = sum(b - a for _, a, b in tables)
        self._pool, self._buffers, self._pending = pool, pool.get(rows, len(dense), len(labels), groups), batches
        self._lock = threading.Lock()
        self.dense, self.labels, *self.ids = [m[:rows] for m in self._buffers]
        start = 0
        for table, a, b in tables:
            fill_matrices(table, a, b, start, self.dense, self.labels, self.ids, dense, labels, groups)
            start += b - a

    def release(self) -> None:
        """One batch of the chunk was gathered; after the last one the buffers are reused."""
        with self._lock:
            self._pending -= 1
            last = self._pending == 0
        if last:
            self._pool.put(self._buffers)


class _MatrixPool:
    """Buffers of `_ChunkMatrices` kept for the next chunks: fresh memory costs page faults on
    every chunk (tens of ms per chunk where the host backs guest memory lazily); reused, none.

    Args:
        capacity: rows of a buffer (a chunk's rows; a larger chunk gets its own buffers).
    """

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._free: list[list[np.ndarray]] = []
        self._lock = threading.Lock()

    def get(self, rows: int, dense: int, labels: int, groups: list[list[tuple[str, int]]]) -> list[np.ndarray]:
        """[dense (n, n_dense) float32, labels (n, n_labels) float32, ids (n, F) int64 per group], n >= rows."""
        with self._lock:
            if self._free and self._free[-1][0].shape[0] >= rows:
                return self._free.pop()
        n = max(rows, self.capacity)
        return [np.empty((n, dense), np.float32), np.empty((n, labels), np.float32),
                *[np.empty((n, len(fields)), np.int64) for fields in groups]]

    def put(self, buffers: list[np.ndarray]) -> None:
        with self._lock:
            self._free.append(buffers)


class _OutputPool:
    """Arrays gathered batches are written into, reused once no batch holds them any more.

    A gathered batch is a few fresh arrays (about 2 MiB for 4096 DLRM rows). Allocated anew per
    batch in the packing threads, their memory goes back to the OS when freed and comes back as
    page faults: 60,000-95,000 per epoch of 1.5M rows, costing as much CPU as the gathers where
    the host backs guest memory lazily. So a batch's arrays come from here (`get` takes a set out
    of the pool, `put` returns it once the batch's tensors wrap them), and a set is handed out
    again only when nothing but the pool references its arrays: `torch.from_numpy` keeps a
    reference to its array for the life of the tensor and of every view of it, so a batch (or any
    tensor of it) a consumer still holds is never overwritten. Sets beyond `limit` are dropped.

    Args:
        limit: sets kept (batches in flight: prefetch, packing threads, lookahead window, a few more).
    """

    def __init__(self, limit: int):
        self.limit = limit
        self._free: list[list[np.ndarray]] = []
        self._ranges: dict[int, np.ndarray] = {}
        self._lock = threading.Lock()
        self._idle = self._refs([np.empty(1)])[0]  # references to an array only a set holds

    @staticmethod
    def _refs(arrays: list[np.ndarray]) -> list[int]:
        return [sys.getrefcount(a) for a in arrays]

    def get(self, shapes: list[tuple[tuple[int, ...], Any]]) -> list[np.ndarray]:
        """A set of arrays of these (shape, dtype), nobody else's: a reused one, else new ones."""
        with self._lock:
            for i, arrays in enumerate(self._free):
                if (all(a.shape == shape and a.dtype == dtype for a, (shape, dtype) in zip(arrays, shapes))
                        and len(arrays) == len(shapes) and all(r == self._idle for r in self._refs(arrays))):
                    return self._free.pop(i)
        return [np.empty(shape, dtype) for shape, dtype in shapes]

    def put(self, arrays: list[np.ndarray]) -> None:
        """Keep a set handed out by `get` (reused once its batch is freed)."""
        with self._lock:
            if len(self._free) < self.limit:
                self._free.append(arrays)

    def arange(self, n: int) -> np.ndarray:
        """0 .. n-1 as int64 (a batch's offsets), computed once per length."""
        with self._lock:
            values = self._ranges.get(n)
            if values is None:
                values = self._ranges[n] = np.arange(n, dtype=np.int64)
            return values


def _output_pool(source: PartitionSource, limit: int) -> "_OutputPool":
    """The pool of batch arrays: the source's (kept with its row cache, so later epochs reuse the
    arrays of earlier ones instead of faulting fresh memory in), else one of this iterator."""
    holder = getattr(source, "row_cache", None)
    if holder is None:
        return _OutputPool(limit)
    with holder.lock:
        if holder.outputs is None or holder.outputs.limit < limit:
            holder.outputs = _OutputPool(limit)
        return holder.outputs


class _Rows:
    """One batch of a `_ChunkMatrices` or a `_CacheView`: its chunk-local rows (int64, in batch
    order) and, for a cache, where chunk rows are in the dataset (`_RowReader.cached_rows`):
    dataset row `first` + chunk row, or `mapping[chunk row]` where `mapping` is not None."""

    def __init__(self, chunk: Any, rows: np.ndarray, mapping: np.ndarray | None = None, first: int = 0):
        self.chunk, self.rows, self.mapping, self.first = chunk, rows, mapping, first


class _CacheView:
    """A `RowCache`'s row matrix as a batch gathers it (`_Rows.chunk`, `BatchIterator._pack_cached`)."""

    def __init__(self, cache: RowCache):
        from flowrec.data.rowpack import RowPacker, pack_rows  # numba: imported where rows are kept

        assert cache.row_layout is not None
        self.packer, self._pack_rows = RowPacker(cache.row_layout, cache.rows), pack_rows

    def pack(self, sel: np.ndarray, first: int, mapping: np.ndarray | None, out: list[np.ndarray]) -> None:
        """Write rows `sel` into a batch's `_gather_outputs` arrays (`flowrec.data.rowpack.pack_rows`)."""
        self._pack_rows(self.packer, sel, first, mapping, out[0], out[1], out[2::2], out[3::2])


def _load_rowpack() -> None:
    """Import and load the rowpack kernels (`flowrec.data.rowpack.warm_up`): numba's import and
    first call, about 0.6 s, on a thread beside a filling epoch's first Parquet reads."""
    from flowrec.data.rowpack import warm_up

    enter_data_thread()
    warm_up()


def _flat(table: pa.Table, names: list[str]) -> bool:
    """Whether columns `names` of `table` hold one id per row (no list columns)."""
    return not any(pa.types.is_list(t) or pa.types.is_large_list(t)
                   for t in (table.schema.field(n).type for n in names))


class _Staged:
    """A batch cut by a Dask task; its result marks the row groups it used as checked."""

    def __init__(self, future: Any, reader: _RowReader, pieces: list[int]):
        self.future, self.reader, self.pieces = future, reader, pieces

    def result(self) -> pa.Table:
        table = self.future.result()
        self.reader.passed(self.pieces)
        return table


def _columns(spec: ModelSpec) -> list[str]:
    names = [f.name for f in spec.features]
    return names + [c for c in dict.fromkeys(batch_label_columns(spec)) if c not in names]


def _stack(table: pa.Table, names: list[str], size: int) -> torch.Tensor:
    out = np.empty((size, len(names)), np.float32)  # (B, n)
    for j, name in enumerate(names):
        col = table.column(name)
        out[:, j] = col.chunk(0).to_numpy(zero_copy_only=False) if col.num_chunks == 1 else col.to_numpy()
    return torch.from_numpy(out)


def _failed(exc: BaseException) -> Future:
    fut: Future = Future()
    fut.set_result(exc)
    return fut


def _drain(q: queue.Queue) -> None:
    while True:
        try:
            q.get_nowait()
        except queue.Empty:
            return


def iterate_batches(spec: ModelSpec, source: PartitionSource, opts: StagingOptions = StagingOptions(),
                    epoch: int = 0, start_batch: int = 0,
                    groups: tuple[PackedGroup, ...] | None = None, remap: Remapper | None = None,
                    negatives: NegativeSampler | None = None) -> BatchIterator:
    """Batches of one epoch, from batch `start_batch` on (same order as an uninterrupted run).

    Args:
        spec: the model spec (features, heads, batch size and seed defaults).
        source: partitions of encoded rows (ParquetSource, DaskSource, MemorySource).
        opts: staging settings.
        epoch: epoch number (seeds the order).
        start_batch: first batch index to yield (resume).
        groups: packed layout (default: `group_layout(spec)`, the plan's layout).
        remap: the maps of the spec's managed tables (`flowrec.data.managed_stage`); a spec with
            managed tables needs one (their columns hold raw ids, not rows).
        negatives: a retrieval head's sampler: each batch's drawn items join its item group's
            lookups (`flowrec.data.negatives`; training batches only).
    """
    if remap is None and any(t.managed is not None for t in spec.tables):
        raise ValueError(f"spec {spec.name!r} has managed tables: batches need their maps (remap=)")
    return BatchIterator(spec, source, opts, epoch, start_batch,
                         groups if groups is not None else group_layout(spec), remap, negatives)
