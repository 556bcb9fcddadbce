"""Dirty-row tracking, consistent snapshots and the background checkpoint writer.

`DirtyRows` marks the packed rows each training step touches (the batch's packed ids: the fused
sparse update changes exactly the unique rows of a batch, under every placement). At a delta
checkpoint the trainer copies those rows with their optimizer state, and the whole dense part, into
a snapshot (`delta_snapshot`), clears the marks and lets training continue while a
`BackgroundWriter` serializes, digests and atomically writes the snapshot.

Example:
    >>> dirty = DirtyRows(); dirty.mark(batch)  # doctest: +SKIP
    >>> rows = dirty.take()  # {group: sorted unique rows (n,) int64}  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import copy
import queue
import threading
import time
from typing import Any, Callable, Container, Iterator

import numpy as np
import torch
from torch import nn

EMBEDDINGS_PREFIX = "embeddings."


MASK_WORD = 8  # mask bytes read as one int64 word when looking for marks


class DirtyRows:
    """Packed rows of each group touched since the last `take` (a bool mask per group).

    `take` reads each mask as int64 words, so it scans an eighth of the elements, expands only
    the words holding a mark and clears only those: its cost follows the rows touched more than
    the table's size (a 34 M-row table: ~25 ms instead of ~85 ms).
    """

    def __init__(self) -> None:
        self._masks: dict[str, torch.Tensor] = {}

    def mark(self, batch: Any, rows_of_group: dict[str, int], skip: Container[str] = ()) -> None:
        """Mark every packed id of `batch` and the rows its managed tables reset (ids stay on
        their device: no sync), except in the groups of `skip`."""
        for name, gids in batch.groups.items():
            if name not in skip:
                self._mark(name, gids.ids, rows_of_group)
        for name, rows in reset_rows_of(batch).items():
            if name not in skip:
                self._mark(name, rows, rows_of_group)

    def mark_rows(self, name: str, rows: torch.Tensor, rows_of_group: dict[str, int]) -> None:
        """Mark `rows` of group `name` (a mask of `rows_of_group[name]` rows)."""
        self._mark(name, rows, rows_of_group)

    def _mark(self, name: str, ids: torch.Tensor, rows_of_group: dict[str, int]) -> None:
        mask = self._masks.get(name)
        if mask is None:
            words = -(-rows_of_group[name] // MASK_WORD)
            mask = torch.zeros(words * MASK_WORD, dtype=torch.bool, device=ids.device)
            self._masks[name] = mask
        mask[ids.to(mask.device, non_blocking=True)] = True

    def take(self) -> dict[str, torch.Tensor]:
        """Sorted touched rows per group (on the CPU), and clear the marks.  # {group: (n,) int64}"""
        return {name: _take_marks(mask).cpu() for name, mask in self._masks.items()}


def reset_rows_of(batch: Any) -> dict[str, torch.Tensor]:
    """Packed rows a batch's managed-table eviction resets before it trains (group -> rows)."""
    managed = getattr(batch, "managed", None)
    return managed.resets if managed is not None else {}


def _take_marks(mask: torch.Tensor) -> torch.Tensor:
    """The positions marked in a bool mask (length a multiple of MASK_WORD), sorted; then unmarked."""
    words = mask.view(torch.int64)
    marked = words.nonzero().flatten()  # (k,) words holding a mark
    hits = mask.view(-1, MASK_WORD)[marked].nonzero()  # (n, 2): word index in `marked`, byte
    rows = marked[hits[:, 0]] * MASK_WORD + hits[:, 1]
    words[marked] = 0
    return rows


def packed_tables(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """The complete packed weight and optimizer state of an embedding module (any placement)."""
    if hasattr(module, "full_tables"):
        return module.full_tables()
    return module.weight, module.state


def delta_tables(embeddings: nn.ModuleDict, rows: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Copies of the `rows` of every packed group (groups without marks: no rows).

    Returns:
        {"embeddings.<group>": {"rows": (n,) int64, "weight": (n, D), "state": (n, k)}}
    """
    out = {}
    for name, module in embeddings.items():
        weight, state = packed_tables(module)
        picked = rows.get(name, torch.zeros(0, dtype=torch.int64))
        index = picked.to(weight.device)
        out[f"{EMBEDDINGS_PREFIX}{name}"] = {"rows": picked.clone(), "weight": weight.index_select(0, index).cpu(),
                                             "state": state.index_select(0, index.to(state.device)).cpu()}
    return out


SNAPSHOT_CHUNK_BYTES = 1 << 20  # bytes of one chunk of a streamed table (the writer's one buffer)


class _TensorStream:
    """One live tensor of a `TableSnapshot`: how far it is written and the rows saved for it.

    Rows saved by a step arrive as a sorted batch in `pending`; the writer merges the batches into
    one sorted `held` array (at most once per step) and, chunk by chunk, takes the rows of the chunk
    from its front, so each chunk costs one binary search however many steps saved rows.
    `held_bytes` is kept as they change, and so is the snapshot's total of them (`total`, shared by
    its streams): no step recounts them.
    """

    def __init__(self, source: torch.Tensor, chunk_rows: int | None, total: list[int]) -> None:
        self.source = source
        self.total = total  # [the host bytes every stream of the snapshot holds]
        self.held_bytes = 0  # host bytes of the saved rows (below)
        self.rows = source.shape[0]
        row_bytes = max(1, source[:1].numel() * source.element_size())
        self.chunk = max(1, int(chunk_rows or SNAPSHOT_CHUNK_BYTES // row_bytes))
        self.done = 0  # rows [0, done) are written; later writes to them need no saving
        self.saved: torch.Tensor | None = None  # (rows,) bool: saved before a write
        self.pending: list[tuple[torch.Tensor, torch.Tensor]] = []  # per step: (sorted rows (n,), values)
        self.held_rows = torch.zeros(0, dtype=torch.int64)  # (m,) sorted, all >= done: merged saves
        self.held_values = torch.zeros((0, *source.shape[1:]), dtype=source.dtype)

    def save(self, rows: torch.Tensor, values: torch.Tensor) -> None:
        """Hold the rows a step saved (sorted, none held yet) with their values."""
        self.pending.append((rows, values))
        self._held(self.held_bytes + values.numel() * values.element_size() + rows.numel() * 8)

    def merge(self) -> None:
        """Fold the pending batches into the sorted held rows (rows are saved once: no repeats)."""
        if not self.pending:
            return
        rows = torch.cat([self.held_rows, *(r for r, _ in self.pending)])
        values = torch.cat([self.held_values, *(v for _, v in self.pending)])
        order = torch.argsort(rows)
        self.held_rows, self.held_values, self.pending = rows[order], values[order], []
        self._held(self._storage_bytes())

    def finish(self) -> None:
        """Written (or given up): nothing more to save or hold."""
        self.done, self.pending, self.saved = self.rows, [], None
        self.held_rows, self.held_values = self.held_rows[:0], self.held_values[:0]
        self._held(self._storage_bytes())

    def take(self, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The held rows below `end` with their values, dropped from what is held."""
        self.merge()
        cut = int(torch.searchsorted(self.held_rows, torch.tensor([end]))[0])
        taken = self.held_rows[:cut], self.held_values[:cut]
        self.held_rows, self.held_values = self.held_rows[cut:], self.held_values[cut:]
        return taken

    def held(self) -> torch.Tensor:
        """Every saved row not written yet."""
        return torch.cat([self.held_rows, *(r for r, _ in self.pending)])

    def _storage_bytes(self) -> int:
        """What the held arrays' storages hold (written rows included until the next merge drops
        them); the pending batches are merged in or dropped when this is asked."""
        return self.held_rows.untyped_storage().nbytes() + self.held_values.untyped_storage().nbytes()

    def _held(self, held_bytes: int) -> None:
        self.total[0] += held_bytes - self.held_bytes
        self.held_bytes = held_bytes


WRITER_TURN_S = 0.0002  # how long a step sleeps at a time while the writer waits for the lock

class TableSnapshot:
    """A consistent image of the packed tables, streamed off the training thread (copy-on-write).

    Taken between two steps (`TableSnapshot(tables)`), it hands the writer thread each tensor in
    chunks of rows (`chunks`), copied into one reused host buffer, while training goes on. Before
    a step changes rows, the training thread calls `before_write(group, ids)`: the rows not written
    yet are saved with their current values, each once, and put over what the chunk copy caught, so
    every chunk holds the rows as they were when the snapshot was taken. Training pays one small
    gather per step while the write runs; the extra memory is the buffer of the tensor in hand plus the
    saved rows not written yet (a row's saved value is dropped when its chunk is written).
    `peak_extra_bytes` records the most it held.

    Args:
        tables: {group: (weight, state)}, the live packed tensors (rows first, equal row counts).
        chunk_rows: rows per chunk (default: `SNAPSHOT_CHUNK_BYTES` of rows).

    Example:
        >>> snap = TableSnapshot({"g0": (weight, state)})   # doctest: +SKIP
        >>> snap.before_write("g0", batch_ids)              # training thread, before the step  # doctest: +SKIP
        >>> for start, rows in snap.chunks("g0", 0): ...    # writer thread: rows start.. as taken  # doctest: +SKIP
    """

    def __init__(self, tables: dict[str, tuple[torch.Tensor, ...]], chunk_rows: int | None = None) -> None:
        self._held = [0]  # host bytes of the rows every stream holds: a running total
        self._parts = {name: tuple(_TensorStream(t, chunk_rows, self._held) for t in tensors)
                       for name, tensors in tables.items()}
        self._lock = threading.Lock()
        # The writer asks for the lock once per chunk; the training thread takes it at every step.
        # A plain lock is not fair: a thread that takes it again right after releasing it can keep
        # a woken writer out for ever on busy cores (seen: a tight loop of tiny steps starved the
        # writer for 10 minutes). So the writer says it is waiting, and a step hands it the lock
        # first (`_yield_to_writer`).
        self._writer_waiting = False
        self.writer_bytes = 0  # host bytes the writer holds besides the chunk (its staging buffers)
        self.peak_extra_bytes = 0  # most host bytes held at once: chunk buffers + saved rows + writer_bytes

    def before_write(self, group: str, ids: torch.Tensor) -> None:
        """Save the rows among `ids` (packed ids, repeats allowed) that a step is about to change
        and that are not written yet (training thread, before the step)."""
        streams = self._parts.get(group, ())
        self._yield_to_writer()
        with self._lock:
            open_ = [s for s in streams if s.done < s.rows]
            if not open_:
                return
            ids = torch.unique(ids.to(open_[0].source.device))
            for stream in open_:
                rows = ids[ids >= stream.done]
                if stream.saved is None:
                    stream.saved = torch.zeros(stream.rows, dtype=torch.bool, device=ids.device)
                rows = rows[~stream.saved[rows]]
                if rows.numel():
                    stream.saved[rows] = True
                    stream.save(rows.cpu(), stream.source.index_select(0, rows).cpu())
            self._note_extra()

    def chunks(self, group: str, index: int) -> Iterator[tuple[int, torch.Tensor]]:
        """(first row, rows as taken) of tensor `index` of `group`, chunk by chunk (writer thread).

        Each chunk is a view of one buffer that the next chunk overwrites: use it before asking
        for the next.
        """
        stream = self._parts[group][index]
        source = stream.source
        buffer = torch.empty((min(stream.chunk, stream.rows), *source.shape[1:]), dtype=source.dtype)
        for start in range(0, stream.rows, stream.chunk):
            end = min(stream.rows, start + stream.chunk)
            view = buffer[: end - start]
            copy_rows(view, source[start:end])  # rows a step changes meanwhile were saved first
            with self._writer_lock():
                self.peak_extra_bytes = max(self.peak_extra_bytes, self._held[0] + self.writer_bytes
                                            + buffer.numel() * buffer.element_size())
                rows, values = stream.take(end)
                if rows.numel():
                    view.index_copy_(0, rows - start, values)
                stream.done = end
            yield start, view
        with self._writer_lock():
            stream.finish()

    @contextlib.contextmanager
    def _writer_lock(self) -> Iterator[None]:
        """The lock, taken by the writer thread: waiting, it makes the next step wait for it."""
        self._writer_waiting = True
        try:
            with self._lock:
                self._writer_waiting = False
                yield
        finally:
            self._writer_waiting = False

    def _yield_to_writer(self) -> None:
        """Training thread: while the writer waits for the lock, let it take the lock first."""
        while self._writer_waiting:
            time.sleep(WRITER_TURN_S)

    def close(self) -> None:
        """Stop saving rows (the write is over, done or failed); drop what was saved."""
        with self._lock:
            for streams in self._parts.values():
                for stream in streams:
                    stream.finish()

    def copy(self) -> dict[str, tuple[torch.Tensor, ...]]:
        """Whole copies of every table as taken: {group: copies of its tensors} (tests, small tables)."""
        out = {}
        for name, streams in self._parts.items():
            copies = tuple(torch.empty(s.source.shape, dtype=s.source.dtype) for s in streams)
            for index, copy_ in enumerate(copies):
                for start, rows in self.chunks(name, index):
                    copy_[start:start + rows.shape[0]] = rows
            out[name] = copies
        return out

    def _note_extra(self) -> None:
        self.peak_extra_bytes = max(self.peak_extra_bytes, self._held[0])


def copy_rows(dst: torch.Tensor, src: torch.Tensor) -> None:
    """`dst.copy_(src)`; between contiguous host tensors one plain memcpy (numpy), because torch's
    parallel copy is many times slower on a loaded machine (a 2-core box under load: 1 MiB chunks
    of a 0.5 GiB table in 4-5 s instead of 0.05-0.2 s) and the writer thread must stay cheap."""
    if src.device.type != "cpu" or not (src.is_contiguous() and dst.is_contiguous()) or not src.numel():
        dst.copy_(src)
        return
    np.copyto(dst.reshape(-1).view(torch.uint8).numpy(), src.detach().reshape(-1).view(torch.uint8).numpy())


def table_keys(embeddings: nn.ModuleDict) -> set[str]:
    """State-dict keys of the packed tables: embeddings.<group>.weight / .state."""
    return {f"{EMBEDDINGS_PREFIX}{name}.{part}" for name in embeddings for part in ("weight", "state")}


def cloned(value: Any) -> Any:
    """A deep copy of a checkpoint value whose tensors training may change in place."""
    return copy.deepcopy(value)


class BackgroundWriter:
    """Runs writes one after another, in order, on a worker thread.

    `submit` queues a write and returns at once; `wait` blocks until every queued write is done
    and re-raises the first error. After an error the writes still queued are dropped (a delta
    must never follow a write that failed); the error surfaces at the next `submit` or `wait`.
    """

    def __init__(self, thread_name: str = "flowrec-checkpoint") -> None:
        self._queue: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._thread_name = thread_name
        self._error: BaseException | None = None

    def submit(self, write: Callable[[], None]) -> None:
        """Queue `write` (raises the error of an earlier write instead, if there was one)."""
        self._raise_error()
        self._enqueue(write)

    def _enqueue(self, write: Callable[[], None]) -> None:
        """Queue `write` behind the others, starting the worker thread on the first."""
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name=self._thread_name, daemon=True)
            self._thread.start()
        self._queue.put(write)

    def _work(self) -> None:
        while True:
            write = self._queue.get()
            try:
                if write is not None and self._error is None:
                    write()
            except BaseException as exc:  # handed to the training thread at its next submit / wait
                self._error = exc
            finally:
                self._queue.task_done()

    @property
    def pending(self) -> int:
        """Writes queued or running."""
        return self._queue.unfinished_tasks

    def wait(self) -> None:
        """Block until every queued write is on disk; raise the first error, if any."""
        self._queue.join()
        self._raise_error()

    def join(self) -> None:
        """Block until every queued write is over, keeping an error for the next `submit` / `wait`
        (never from a write itself: it would wait for itself)."""
        self._queue.join()

    def _raise_error(self) -> None:
        error, self._error = self._error, None
        if error is not None:
            raise error
