"""When and how a run checkpoints: full checkpoints, incremental deltas, written in the background.

With `full_every = 1` every checkpoint is a full one; with `full_every = K > 1` a full checkpoint is
followed by K-1 deltas (`flowrec.runtime.checkpoint.delta`) holding only the rows touched since the
previous checkpoint. With `full_every = AUTO` (0, the default of `flowrec train`) a checkpoint is a
full one unless the previous full one is still being written, or was written less than
`AUTO_REST` times its own write time ago: then it is a delta on it, queued behind it, instead of
training waiting for that write (at most `AUTO_MAX_DELTAS` in a row, which bounds the chain and the
memory of the queued deltas' rows; the next full one then waits). The rest keeps full writes to
at most 1 / (1 + AUTO_REST) of the run's time, so the writer thread takes little CPU from training
and the end of a run rarely waits for a full write just begun. Where checkpoints are more than
1 + AUTO_REST full writes apart (small tables: a write of milliseconds) every checkpoint is full,
as with K = 1; tables whose full write outlasts the steps between checkpoints get deltas in
between, as with a K that fits them, without the user sizing K. Both kinds
are written on a background thread from a consistent snapshot, for every K. A delta's snapshot is taken on the training
thread (touched rows, dense part, optimizer states, RNG and position are copied; then training
continues). A full one copies only the dense part there; the packed tables are streamed into the
file by the writer thread while training goes on (`flowrec.runtime.checkpoint.stream.save_streamed`), copy-on-write
by chunks (`TableSnapshot`: `mark`, called before each step, saves the rows the step will change
that are not written yet), so a multi-GiB table costs training a few small gathers instead of a
copy, and the writer holds one chunk of rows, the saved rows and two 1 MiB staging buffers (the
tables' bytes go to the disk around the page cache: `flowrec.runtime.checkpoint.direct`), never a
copy of the tables. The tables' finiteness is checked chunk by chunk as they are written (a
non-finite value stops the write). A failed write (disk full, no permission, a non-finite value) reaches training as its
one-line error at the next checkpoint or at the end of the run; the checkpoint before it is
kept whole. The first checkpoint of
a process (a new run, or a resumed one) is always a full one. Writes are queued in order on one
writer thread; a full snapshot waits for the writes before it; the end of the run and every
failure wait for all of them. `stalls` lists the seconds training waited on each checkpoint.

`background=False` (the comparison switch `FLOWREC_CHECKPOINT_WRITES=inline`, read by the trainer)
writes every checkpoint on the training thread instead, whole (`save_checkpoint`) or as a delta,
its error raised at once: the behaviour before background writes, kept for comparison
(`tools/bench_checkpoint.py`).

Example:
    >>> ckpt = Checkpointer(Path("runs/x/checkpoint.pt"), full_every=10, rows_of_group={"g0": 1000})  # doctest: +SKIP
    >>> ckpt.mark(batch); train_step(batch); ckpt.save(trainer.state(), model.embeddings)  # doctest: +SKIP
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

from torch import nn

from flowrec.runtime.checkpoint.store import save_checkpoint
from flowrec.runtime.checkpoint.delta import DELTA_FORMAT, DELTA_VERSION, TABLE_KEYS, delta_path, remove_deltas
from flowrec.runtime.checkpoint.shards import remove_stale_shards
from flowrec.runtime.checkpoint.stream import save_streamed
from flowrec.runtime.checkpoint.incremental import (
    EMBEDDINGS_PREFIX,
    BackgroundWriter,
    DirtyRows,
    TableSnapshot,
    cloned,
    delta_tables,
    reset_rows_of,
    table_keys,
)
from flowrec.runtime.nonfinite import TrainingStopped, all_finite_here, first_non_finite

NONCE_BYTES = 8  # random id of a full checkpoint, so deltas never apply to another run's base
AUTO = 0  # full_every: a full checkpoint whenever the previous full one is on disk, else a delta
AUTO_MAX_DELTAS = 16  # AUTO: deltas in a row before a full checkpoint waits for the one in flight
AUTO_REST = 4.0  # AUTO: after a full write of T seconds, deltas for the next AUTO_REST * T seconds


class AutoPace:
    """AUTO's clock (one process and ranks alike): whether a full write is in flight or rested
    after (AUTO_REST times its own write time), so that the next checkpoint is a delta."""

    def __init__(self) -> None:
        self.rest_until = 0.0  # monotonic time before which the next checkpoint is a delta

    def wrote_full(self, seconds: float) -> None:
        """A full write of `seconds` just ended (its writer thread)."""
        self.rest_until = time.monotonic() + AUTO_REST * seconds

    def busy(self, writing: bool) -> bool:
        """`writing` (a full write's snapshot is alive), or within the rest after the last one."""
        return writing or time.monotonic() < self.rest_until


def next_is_delta(full_every: int, chained: bool, deltas: int, full_in_flight: bool) -> bool:
    """Whether the next checkpoint is a delta (one process and ranks decide alike).

    Args:
        full_every: K (1: every checkpoint full) or AUTO.
        chained: a full checkpoint is on disk or queued, so a delta has a base.
        deltas: deltas written or queued on that full checkpoint.
        full_in_flight: the full checkpoint's tables are still being written, or were written
            less than AUTO_REST times their write time ago (AUTO: on any rank).
    """
    if not chained:
        return False
    if full_every == AUTO:
        return full_in_flight and deltas < AUTO_MAX_DELTAS
    return deltas + 1 < full_every


class Checkpointer:
    """Writes the checkpoints of one run (see the module docstring).

    Args:
        path: the full checkpoint file (`<run>/checkpoint.pt`).
        full_every: a full checkpoint every K checkpoints (1: all full), or AUTO (0; module
            docstring).
        rows_of_group: packed rows of each group (the size of its dirty mask).
        background: write on the writer thread (default); False: on the training thread, for
            comparison (module docstring; AUTO then writes every checkpoint full).
    """

    def __init__(self, path: Path, full_every: int, rows_of_group: dict[str, int], background: bool = True) -> None:
        self.path = Path(path)
        self.full_every = max(AUTO, int(full_every))
        self.background = bool(background)
        self.rows_of_group = dict(rows_of_group)
        self.step: int | None = None  # step of the newest checkpoint on disk
        self.seconds = {"full": [], "delta": []}  # per checkpoint: snapshot copy + write seconds
        self.extra_bytes: list[int] = []  # per streamed full checkpoint: most host bytes it held
        self._dirty = DirtyRows()
        self._writer = BackgroundWriter()
        self._base_digest: str | None = None  # digest of the full checkpoint on disk (writer thread)
        self._chained = False  # a full checkpoint was queued, so deltas may follow (training thread)
        self._queued = 0  # deltas queued on the current full checkpoint (training thread)
        self._snapshot: TableSnapshot | None = None  # tables of a full checkpoint being copied
        self.pace = AutoPace()

    @property
    def incremental(self) -> bool:
        """Deltas may be written, so every step's touched rows are marked (AUTO: only in the
        background, where a full write can be in flight at a checkpoint)."""
        return self.full_every > 1 or (self.full_every == AUTO and self.background)

    def mark(self, batch: Any) -> None:
        """Before a training step on `batch`: save the rows it will change that a full checkpoint's
        table copy still needs, and (when writing deltas) record the rows it will touch."""
        snapshot = self._snapshot
        if snapshot is not None:
            for name, gids in batch.groups.items():
                snapshot.before_write(name, gids.ids)
            for name, rows in reset_rows_of(batch).items():
                snapshot.before_write(name, rows)
        if self.incremental:
            self._dirty.mark(batch, self.rows_of_group)

    def restart_chain(self, step: int | None) -> None:
        """After loading a checkpoint: the next checkpoint is a full one."""
        self._chained, self._queued, self.step = False, 0, step

    def save(self, state: dict[str, Any], embeddings: nn.ModuleDict) -> None:
        """Checkpoint `state` (the trainer's `state()`): a full one or a delta, in the background
        (or inline: `background=False`).

        Raises:
            TrainingStopped: a non-finite parameter (nothing is written), found here or, in the
                background, in an earlier full checkpoint's tables as they were written.
            CheckpointError: an earlier background write failed (or, inline, this one).
        """
        step = state["position"]["step"]
        # inline writes never leave one in flight (and mark no rows): every checkpoint is full
        busy = self.background and self.pace.busy(self._snapshot is not None)
        if next_is_delta(self.full_every, self._chained, self._queued, busy):
            self._save_delta(state, embeddings, step)
        else:
            self._writer.wait()  # at most one full snapshot in memory
            self._save_full(state, embeddings, step)

    def _save_full(self, state: dict[str, Any], embeddings: nn.ModuleDict, step: int) -> None:
        self._dirty.take()
        self._chained, self._queued = True, 0
        state = {**state, "chain": os.urandom(NONCE_BYTES).hex()}
        if not self.background:  # the whole state serialized on the training thread
            _check_finite(state["model"], step, self.note)
            self._write_full(state, step, 0.0)
            return
        t0 = time.perf_counter()
        model = state["model"]
        keys = {name: tuple(f"{EMBEDDINGS_PREFIX}{name}.{part}" for part in TABLE_KEYS) for name in embeddings}
        keys = {name: pair for name, pair in keys.items() if all(k in model for k in pair)}  # others: cloned
        streams = {key: (name, index) for name, pair in keys.items() for index, key in enumerate(pair)}
        dense = dense_state_from(model, set(streams))
        _check_finite(dense, step, self.note)
        tables = TableSnapshot({name: tuple(model[k] for k in pair) for name, pair in keys.items()})
        head = {**state, "model": {key: model[key] if key in streams else dense[key] for key in model},
                "dense_optimizer": cloned(state["dense_optimizer"])}
        self._snapshot = tables
        copy_s = time.perf_counter() - t0
        self._writer.submit(lambda: self._write_snapshot(head, tables, streams, step, copy_s))

    def _run(self, write: Callable[[], None]) -> None:
        """Queue `write` on the writer thread, or (inline) run it now."""
        if self.background:
            self._writer.submit(write)
        else:
            write()

    def _write_snapshot(self, head: dict[str, Any], tables: TableSnapshot, streams: dict[str, tuple[str, int]],
                        step: int, copy_s: float) -> None:
        """Write a full checkpoint, its tables streamed from the snapshot (see `save_streamed`)."""
        note = self._on_disk()  # the writes before this one are done (one writer, in order)

        def finite(key: str, rows: Any) -> None:
            if rows.is_floating_point() and not all_finite_here(rows):
                raise TrainingStopped(f"parameter {key} is not finite at step {step}; not checkpointed, {note}")

        try:
            self._write_full(head, step, copy_s,
                             lambda path, state: save_streamed(path, state, streams, tables, finite))
        finally:
            tables.close()
            self._snapshot = None
            self.extra_bytes.append(tables.peak_extra_bytes)

    def _write_full(self, state: dict[str, Any], step: int, copy_s: float,
                    save: Callable[[Path, dict[str, Any]], str] = save_checkpoint) -> None:
        t0 = time.perf_counter()
        self._base_digest = None  # a failed write leaves no base to chain on
        try:
            digest = save(self.path, state)
        except BaseException:
            self._chained = False
            raise
        remove_deltas(self.path)
        remove_stale_shards(self.path.parent, [])  # a distributed run's, when it was resumed here
        self._base_digest, self.step = digest, step
        took = time.perf_counter() - t0
        self.pace.wrote_full(took)
        self.seconds["full"].append(copy_s + took)

    def _save_delta(self, state: dict[str, Any], embeddings: nn.ModuleDict, step: int) -> None:
        t0 = time.perf_counter()
        dense = dense_state_from(state["model"], table_keys(embeddings))
        tables = delta_tables(embeddings, self._dirty.take())
        _check_finite({**dense, **{k + ".weight": v["weight"] for k, v in tables.items()}}, step, self.note)
        self._queued += 1
        delta = {key: state[key] for key in ("spec", "plan", "rng", "position", "skipped_batches")}
        delta.update(format=DELTA_FORMAT, version=DELTA_VERSION, sequence=self._queued, model=dense,
                     tables=tables, dense_optimizer=cloned(state["dense_optimizer"]))
        copy_s = time.perf_counter() - t0
        self._run(lambda: self._write_delta(delta, step, copy_s))

    def _write_delta(self, delta: dict[str, Any], step: int, copy_s: float) -> None:
        t0 = time.perf_counter()
        try:
            save_checkpoint(delta_path(self.path, delta["sequence"]), {**delta, "base": self._base_digest})
        except BaseException:
            self._chained = False  # the chain has a hole: the next checkpoint is a full one
            raise
        self.step = step
        self.seconds["delta"].append(copy_s + time.perf_counter() - t0)

    def wait(self) -> None:
        """Block until the write in flight is on disk (raises its error)."""
        self._writer.wait()

    def drain(self) -> None:
        """Wait for the write in flight, dropping its error (another error is on its way)."""
        try:
            self._writer.wait()
        except Exception:
            pass

    def note(self) -> str:
        """What is on disk after a failure: the newest checkpoint's step, or that there is none
        (training thread: once the writes in flight are over, their errors kept for `wait`)."""
        self._writer.join()
        return self._on_disk()

    def _on_disk(self) -> str:
        if self.step is None:
            return "no checkpoint was written"
        return f"the checkpoint of step {self.step} is kept"


def dense_state_from(model_state: dict[str, Any], tables: set[str]) -> dict[str, Any]:
    """Copies of a state dict's tensors other than the packed tables."""
    return {k: v.detach().clone().cpu() for k, v in model_state.items() if k not in tables}


def _check_finite(tensors: dict[str, Any], step: int, note: Callable[[], str]) -> None:
    """Raise TrainingStopped naming the first non-finite tensor (`note()`: what is on disk)."""
    bad = first_non_finite(tensors)
    if bad is not None:
        raise TrainingStopped(f"parameter {bad} is not finite at step {step}; not checkpointed, {note()}")
