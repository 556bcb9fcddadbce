"""The checkpoints of a distributed run: full sharded ones and, with `full_every = K > 1` (or AUTO), deltas.

A full checkpoint (`flowrec.runtime.checkpoint.shards`): every rank writes the rows it owns of
each row-wise group to its shard file; when all have written, rank 0 writes `checkpoint.pt`
naming them (dense part, replicated tables, position, RNG; under owner ranks of managed tables
each shard also holds its rank's map shards), then removes the older shards and
deltas. With `full_every = AUTO` (the default) a checkpoint is a delta when any rank is still
writing the previous full one's shard or rests after it (`AUTO_REST` times its write time; one
all-reduce of that flag, so all ranks take the same kind;
`flowrec.runtime.checkpoint.checkpointer.next_is_delta`), else a full one. With
`full_every = K > 1` a full checkpoint is followed by K-1 deltas: each rank marks the packed rows
of its batches (`DirtyRows`); at a delta the ranks exchange their marks (one all-gather of the
touched row numbers), so each knows every row any step changed. Each rank writes the touched rows
it owns, with their optimizer state, to its delta shard file; when all have written, rank 0
writes the delta manifest `checkpoint.delta-<N>.pt` (the dense part, the touched rows of the
replicated groups, position, RNG, and the delta shards with their digests). A kill before the
manifest is in place leaves the previous checkpoint (base and earlier deltas) whole; the orphan
delta shards are removed with the next full checkpoint's older files. The first checkpoint of a
process is a full one; a best-evaluation checkpoint is always full, written inline after the
writes in flight, and leaves the chain alone.

Background writes (the default, when the world has a `checkpoint_group`): training waits only
for a consistent snapshot, as in one process (`flowrec.runtime.checkpoint.checkpointer`):

* at the checkpoint step, on the training thread: the ranks agree (one all-reduce, as before)
  that no earlier write failed and that the dense part is finite; rank 0 copies the common state
  (dense part, replicated tables, dense optimizer, position, RNG); every rank copies the managed
  map shards it owns and starts a copy-on-write `TableSnapshot` of its own rows of each row-wise
  group. Rows are not copied: an owner's rows change by every rank's batches, and only the owner
  knows which of its rows a step writes once the ids were exchanged, so the snapshot is fed by
  `ShardedPackedEmbedding.before_write`, called with the local rows right before the step's
  sparse update (and before a managed table's resets) writes them: the rows not yet written are
  saved first, exactly those, once. The same call marks those rows for the next delta, so a
  delta needs no exchange of the batches' marks (only the replicated groups' marks are
  all-gathered, when there are any, for rank 0); a delta copies its touched rows there, as in one
  process (they are few).
* on this rank's writer thread, in checkpoint order: the shard file, streamed chunk by chunk from
  the snapshot (`save_streamed`: one chunk buffer, the saved rows and two direct-write staging
  buffers, never a copy of the tables), its weights checked finite chunk by chunk; then the commit, on the dedicated gloo
  group `World.checkpoint_group` (created once by every rank with the run's --dist-timeout and
  used only by the writer threads, so its collectives never interleave with training's, which
  run on the other groups): an all-gather of every rank's (file, digest) or error; if all wrote,
  rank 0 writes the manifest (atomically) and removes the older files; a broadcast of rank 0's
  outcome. Every rank's writer runs the same jobs in the same order (checkpoints are at the same
  steps on every rank, and a job never skips its collectives: a failed write sends its error),
  so the commits pair up. A shard is named by a manifest only after every rank's is on disk.

Failures: a write failing on any rank (disk full, unwritable folder, a non-finite chunk) reaches
every rank through the commit's all-gather, so all mark it in the same job; jobs queued after a
failed one are dropped on every rank until training has taken the error. Training learns it at
its next checkpoint (the agreement above: every rank raises the first rank's error, a
`CheckpointError` or `TrainingStopped`, one line) or at the end (`wait`, then the same
agreement); the previous checkpoint stays whole, since no manifest names the failed write's
files. A rank that dies leaves the others' commit collective waiting at most --dist-timeout
(then its error is one line naming the checkpoint's step), beside training's own collectives,
which fail within the same timeout; a kill -9 of any rank at any moment leaves the last
committed checkpoint whole (its files are removed only after a newer manifest is in place).
A full snapshot waits for the writes before it (at most one snapshot of the tables alive); the
end of the run and every failure path (`wait`, `drain`) wait for all of them. Inline writes
(`background=False`, or no checkpoint group) do all of it on the training thread, with the
collectives on the default group (the behaviour before background writes; for comparison).

Example:
    >>> ckpt = RankCheckpointer(Path("runs/x/checkpoint.pt"), 3, {"g0": 1000}, model, world)  # doctest: +SKIP
    >>> ckpt.mark(batch); train_step(batch); ckpt.save(trainer.state, Path("runs/x"), step)  # doctest: +SKIP
    >>> ckpt.wait()  # (the end of the run: every write committed, or its error)  # doctest: +SKIP
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from flowrec.runtime.checkpoint.store import save_checkpoint
from flowrec.runtime.checkpoint.delta import DELTA_FORMAT, RANKS_DELTA_VERSION, delta_path, remove_deltas
from flowrec.runtime.checkpoint.format import CheckpointError
from flowrec.runtime.checkpoint.shards import manifest, remove_stale_shards, write_shard
from flowrec.runtime.checkpoint.layout import (common_state, owned_maps, rank_delta_shards, rank_shards,
                                               replicated_embeddings)
from flowrec.runtime.checkpoint.checkpointer import AUTO, AutoPace, dense_state_from, next_is_delta
from flowrec.runtime.checkpoint.incremental import (EMBEDDINGS_PREFIX, BackgroundWriter, DirtyRows, TableSnapshot,
                                                    cloned, delta_tables, table_keys)
from flowrec.runtime.checkpoint.stream import save_streamed
from flowrec.runtime.distributed.sharded import ShardedPackedEmbedding
from flowrec.runtime.messages import first_line
from flowrec.runtime.nonfinite import TrainingStopped, all_finite_here, first_non_finite

CHECKPOINT_NAME = "checkpoint.pt"
NONCE_BYTES = 8  # random id of a full checkpoint, so deltas never apply to another run's base
DELTA_STATE_KEYS = ("spec", "plan", "rng", "position", "skipped_batches", "dense_optimizer")
StateOf = Callable[[dict[str, torch.Tensor]], dict[str, Any]]  # the trainer's state(model)
Outcome = tuple[str, Any]  # ("ok", value) or (error kind: "stopped" | "error", one-line message)
ERRORS = {"stopped": TrainingStopped, "error": CheckpointError}


class RankCheckpointer:
    """Writes the checkpoints of one rank of a distributed run (see the module docstring).

    Args:
        path: the run's full checkpoint file (`<run>/checkpoint.pt`).
        full_every: a full checkpoint every K checkpoints (1: all full), or AUTO (0; module docstring).
        rows_of_group: packed rows of each group (the size of its dirty mask).
        model: the lowered distributed model (`distributed.model`).
        world: this rank's `World`.
        background: write on a writer thread, committed on `world.checkpoint_group` (inline
            when False or when the world has no such group).
    """

    def __init__(self, path: Path, full_every: int, rows_of_group: dict[str, int], model: Any,
                 world: Any, background: bool = True) -> None:
        self.path = Path(path)
        self.full_every = max(AUTO, int(full_every))
        self.rows_of_group = dict(rows_of_group)
        self.model, self.world = model, world
        self.step: int | None = None  # step of the newest checkpoint on disk (committed)
        self._unsure: int | None = None  # step of a commit rank 0 stopped in (this rank cannot tell the outcome)
        self.seconds = {"full": [], "delta": []}  # per checkpoint: snapshot copy + write + commit seconds
        self.extra_bytes: list[int] = []  # per streamed full checkpoint: most host bytes its writer held
        self._dirty = DirtyRows()
        self._base_digest: str | None = None  # digest of the full checkpoint on disk (rank 0)
        self._chained = False  # a full checkpoint is on disk (or queued), so deltas may follow
        self._written = 0  # deltas written (or queued) on the current full checkpoint
        self._lead_error: str | None = None  # rank 0: why its manifest write failed (inline)
        group = getattr(world, "checkpoint_group", None)
        self._writer = _CommitWriter(group) if background and group is not None else None
        self._snapshot: TableSnapshot | None = None  # this rank's rows of a full checkpoint being written
        self.pace = AutoPace()  # AUTO: this rank's full write in flight or rested after
        # background: the local rows of its row-wise groups this rank's updates wrote since the last
        # checkpoint, marked by the updates themselves (no exchange of the batches' marks)
        self._owned = DirtyRows()
        self._local_rows: dict[str, int] = {}
        if self._writer is not None:
            for name, module in model.embeddings.items():
                if isinstance(module, ShardedPackedEmbedding):
                    module.before_write = self._saver(name)
                    self._local_rows[name] = int(module.weight.shape[0])

    @property
    def incremental(self) -> bool:
        """Deltas may be written, so every step's touched rows are marked (AUTO: only in the
        background, where a full write can be in flight at a checkpoint)."""
        return self.full_every > 1 or (self.full_every == AUTO and self._writer is not None)

    @property
    def background(self) -> bool:
        """Writes run on a writer thread (committed on the checkpoint group)."""
        return self._writer is not None

    def mark(self, batch: Any) -> None:
        """Before a training step on `batch` (this rank's slice): record the rows it touches (a
        full snapshot's rows are saved by the owners' updates themselves: `before_write`)."""
        if self.incremental:  # background: the row-wise groups' rows are marked by their owners
            self._dirty.mark(batch, self.rows_of_group, skip=self._local_rows)

    def _saver(self, name: str) -> Callable[[torch.Tensor], None]:
        """The `before_write` of group `name`'s module: mark its local rows for the next delta and
        save them for the snapshot of a full checkpoint being written."""
        def before_write(rows: torch.Tensor) -> None:
            if self.incremental:
                self._owned.mark_rows(name, rows, self._local_rows)
            snapshot = self._snapshot
            if snapshot is not None:
                snapshot.before_write(name, rows)
        return before_write

    def restart_chain(self, step: int | None) -> None:
        """After loading a checkpoint: the next checkpoint is a full one."""
        self._chained, self._written, self.step = False, 0, step

    def save(self, state_of: StateOf, folder: Path, step: int, best: bool = False) -> None:
        """Checkpoint the run into `folder`: a full one or a delta on the last one (every rank
        calls it at the same step); in the background, only its snapshot is taken here.

        Args:
            state_of: the trainer's `state(model)`: the run's state around a model state.
            folder: the run folder, or its `best/` folder (`best`: always full, chain untouched).
            step: the training step the run is at.

        Raises:
            TrainingStopped: a non-finite parameter on any rank (nothing is written), here or
                (background) in an earlier checkpoint's shard, found as it was written.
            CheckpointError: a rank could not write its part, here or (background) in an earlier
                checkpoint's write (the previous checkpoint is intact).
            RankLost: (background) a rank did not answer an earlier checkpoint's commit within
                the run's timeout.
        """
        t0 = time.perf_counter()
        if best:
            if self._writer is not None:
                self._agree(self._writer.finish())  # the writes before it, committed
            self._save_full(state_of, folder, step)
            return
        in_flight = False
        if self.full_every == AUTO and self._chained and self._writer is not None:
            in_flight = self.world.any(self.pace.busy(self._snapshot is not None))  # every rank: the same kind
        delta = next_is_delta(self.full_every, self._chained, self._written, in_flight)
        if self._writer is not None:
            self._queue(state_of, folder, step, delta)
        elif delta:
            self._save_delta(state_of, folder, step)
            self.seconds["delta"].append(time.perf_counter() - t0)
            self.step = step
        else:
            self._dirty.take()
            self._chained = False  # a failed full write leaves no base to chain on
            self._base_digest = self._save_full(state_of, folder, step)
            self._chained, self._written = True, 0
            self.seconds["full"].append(time.perf_counter() - t0)
            self.step = step

    # ------------------------------------------------------------ background
    def _queue(self, state_of: StateOf, folder: Path, step: int, delta: bool) -> None:
        """Take the snapshot of a full checkpoint or a delta and queue its write and commit."""
        assert self._writer is not None
        t0 = time.perf_counter()
        if not delta:
            self._agree(self._writer.finish())  # at most one snapshot of the tables alive
            self._dirty.take()
            self._owned.take()
        failure = self._writer.failure()
        folder.mkdir(parents=True, exist_ok=True)
        common = common_state(self.model)
        if delta:
            replicated = replicated_embeddings(self.model)
            rows = self._all_touched_rows() if replicated else {}  # every rank's, for rank 0
            tables = delta_tables(replicated, rows) if self.world.lead else {}
            # the same on every rank: rank 0 writes and checks it
            dense = dense_state_from(common, table_keys(replicated)) if self.world.lead else {}
            shards = self._owned_delta_shards()
            checked = {**dense, **{k + ".weight": v["weight"] for k, v in tables.items()},
                       **{f"{EMBEDDINGS_PREFIX}{g}.weight": part["weight"] for g, part in shards.items()}}
        else:
            dense = dense_state_from(common, set()) if self.world.lead else {}
            checked = dense  # the rows of the shards: chunk by chunk as they are written
        bad = first_non_finite(checked)
        self._agree(failure, bad, step)
        maps = {k: v.clone() for k, v in owned_maps(self.model).items()}
        head = None
        if self.world.lead:
            state = state_of(dense if not delta else common)
            head = {k: cloned(v) for k, v in state.items() if k != "model"}
            head["model"] = dense if not delta else None
        if delta:
            sequence = self._written + 1
            self._written = sequence
            lead_state = None
            if head is not None:
                lead_state = {key: head[key] for key in DELTA_STATE_KEYS}
                lead_state.update(format=DELTA_FORMAT, version=RANKS_DELTA_VERSION, sequence=sequence,
                                  model=dense, tables=tables)
            copy_s = time.perf_counter() - t0
            self._writer.submit(lambda: self._write_delta(folder, step, sequence, shards, maps,
                                                                lead_state, copy_s))
            return
        snapshot = TableSnapshot({name: (m.weight, m.state) for name, m in self.model.embeddings.items()
                                  if isinstance(m, ShardedPackedEmbedding)})
        self._snapshot = snapshot
        self._chained, self._written = True, 0
        if head is not None:
            head["chain"] = os.urandom(NONCE_BYTES).hex()
        copy_s = time.perf_counter() - t0
        self._writer.submit(lambda: self._write_full(folder, step, snapshot, maps, head, copy_s))

    def _owned_delta_shards(self) -> dict[str, dict[str, torch.Tensor]]:
        """This rank's delta shard (`rank_delta_shards`): per row-wise group, the rows its updates
        wrote since the last checkpoint, and the marks cleared."""
        written = self._owned.take()
        packed = {}
        for name, local in written.items():  # marked by the row-wise groups' updates only
            module = self.model.embeddings[name]
            packed[name] = local * module.world_size + module.rank
        return rank_delta_shards(self.model, packed)

    def _write_full(self, folder: Path, step: int, snapshot: TableSnapshot, maps: dict[str, torch.Tensor],
                    head: dict[str, Any] | None, copy_s: float) -> None:
        """Writer thread: this rank's shard streamed from `snapshot`, then the commit."""
        t0 = time.perf_counter()
        note = self.note()
        try:
            mine = _attempt(lambda: self._stream_shard(folder, step, snapshot, maps, note))
        finally:
            self._snapshot = None
            snapshot.close()
            self.extra_bytes.append(snapshot.peak_extra_bytes)

        def commit(files: list[tuple[str, str]]) -> str:
            target = folder / CHECKPOINT_NAME
            state = {**head, "shards": manifest(step, self.world.size, files)}
            digest = save_checkpoint(target, state)
            remove_deltas(target)
            remove_stale_shards(folder, [name for name, _ in files])
            return digest

        digest = self._commit(step, mine, commit)
        self._base_digest = digest if self.world.lead else None
        self.step = step
        took = time.perf_counter() - t0
        self.pace.wrote_full(took)
        self.seconds["full"].append(copy_s + took)

    def _stream_shard(self, folder: Path, step: int, snapshot: TableSnapshot, maps: dict[str, torch.Tensor],
                      note: str) -> tuple[str, str]:
        """This rank's full shard, each group's weight and state streamed from `snapshot`."""
        groups, streams = {}, {}
        for name, module in self.model.embeddings.items():
            if isinstance(module, ShardedPackedEmbedding):
                groups[name] = {"rows": module.packed_rows, "weight": module.weight, "state": module.state}
                streams[("groups", name, "weight")] = (name, 0)
                streams[("groups", name, "state")] = (name, 1)

        def finite(key: str, rows: torch.Tensor) -> None:
            if key.endswith(".weight") and rows.is_floating_point() and not all_finite_here(rows):
                group = key.split(".")[1]
                raise TrainingStopped(f"parameter {EMBEDDINGS_PREFIX}{group}.weight is not finite at step {step} "
                                      f"(rank {self.world.rank}); not checkpointed, {note}")

        return write_shard(folder, step, self.world.rank, self.world.size, groups,
                           lambda path, doc: save_streamed(path, doc, streams, snapshot, finite), managed=maps)

    def _write_delta(self, folder: Path, step: int, sequence: int, shards: dict[str, dict[str, torch.Tensor]],
                     maps: dict[str, torch.Tensor], lead_state: dict[str, Any] | None, copy_s: float) -> None:
        """Writer thread: this rank's delta shard, then the commit."""
        t0 = time.perf_counter()
        mine = _attempt(lambda: write_shard(folder, step, self.world.rank, self.world.size, shards,
                                            save_checkpoint, sequence, managed=maps))

        def commit(files: list[tuple[str, str]]) -> str:
            state = {**lead_state, "base": self._base_digest, "shards": manifest(step, self.world.size, files)}
            return save_checkpoint(delta_path(folder / CHECKPOINT_NAME, sequence), state)

        self._commit(step, mine, commit)
        self.step = step
        self.seconds["delta"].append(copy_s + time.perf_counter() - t0)

    def _commit(self, step: int, mine: Outcome, lead_write: Callable[[list[tuple[str, str]]], str]) -> str | None:
        """Writer thread, every rank: gather every rank's shard outcome on the checkpoint group;
        if all wrote, rank 0 writes the manifest naming them (`lead_write`); its outcome is
        broadcast. Returns the manifest's digest (rank 0; None elsewhere).

        Raises:
            TrainingStopped / CheckpointError: a rank's write or rank 0's manifest failed (the
                same error on every rank).
            RankLost: a rank did not answer within the run's timeout (it died or hangs).
        """
        assert self._writer is not None
        group = self._writer.group
        outcomes: list[Any] = [None] * self.world.size
        try:
            dist.all_gather_object(outcomes, mine, group=group)
        except RuntimeError as exc:
            raise RankLost(f"the checkpoint of step {step} was not committed: another rank did not "
                           f"answer ({first_line(exc)})") from None
        failed = next((r for r, o in enumerate(outcomes) if o[0] != "ok"), None)
        if failed is not None:
            raise _failure_of(outcomes[failed], failed)
        files = [tuple(o[1]) for o in outcomes]
        lead: list[Any] = [_attempt(lambda: lead_write(files)) if self.world.lead else None]
        if self.world.lead and lead[0][0] == "ok":
            self.step = step  # its manifest is on disk: what a restart resumes from, whatever comes next
        try:
            dist.broadcast_object_list(lead, src=0, group=group)
        except RuntimeError as exc:
            if not self.world.lead:  # rank 0 stopped before or after its manifest: this rank cannot tell
                self._unsure = step
            raise RankLost(f"the checkpoint of step {step} was not committed: rank 0 did not "
                           f"answer ({first_line(exc)})") from None
        kind, value = lead[0]
        if kind != "ok":
            raise _failure_of(lead[0], 0)
        return value if self.world.lead else None

    def _agree(self, failure: BaseException | None, bad: str | None = None, step: int | None = None) -> None:
        """Training thread, every rank: raise on all ranks when any knows of a failed write or of
        a non-finite dense parameter (one all-reduce; the messages are gathered only then). A
        rank lost in a commit is raised here at once: the others lost it too (or are gone)."""
        if isinstance(failure, RankLost):
            raise failure
        if not self.world.any(failure is not None or bad is not None):
            return
        # each with the rank whose error it is (a commit's failure came from the rank that failed to write)
        rank = self.world.rank
        if failure is not None:
            mine: Any = ("stopped" if isinstance(failure, TrainingStopped) else "error", str(failure),
                         getattr(failure, "failed_rank", rank))
        elif bad is not None:
            mine = ("stopped", f"parameter {bad} is not finite at step {step}; not checkpointed, {self.note()}", rank)
        else:
            mine = ("ok", None, rank)
        every: list[Any] = [None] * self.world.size
        dist.all_gather_object(every, mine)
        kind, message, failed = next(o for o in every if o[0] != "ok")
        self._chained = False  # the chain may have a hole: the next checkpoint is a full one
        if self._writer is not None:  # this rank's writer fails in the same job: wait for it, take it
            self._writer.finish()
            self._writer.accept_after_failure()
        raise _failure_of((kind, message), failed)

    # ---------------------------------------------------------------- inline
    def _save_full(self, state_of: StateOf, folder: Path, step: int) -> str | None:
        """Every rank its shard, then rank 0 checkpoint.pt naming them; returns its digest (rank 0)."""
        common, shards = common_state(self.model), rank_shards(self.model)
        self._agree_finite(common, shards, step)
        folder.mkdir(parents=True, exist_ok=True)
        maps = owned_maps(self.model)
        files = self._write_shards(lambda: write_shard(folder, step, self.world.rank, self.world.size,
                                                       shards, save_checkpoint, managed=maps))
        digest = None
        if self.world.lead:
            state = {**state_of(common), "chain": os.urandom(NONCE_BYTES).hex()}
            state["shards"] = manifest(step, self.world.size, files)
            digest = self._lead_write(lambda: save_checkpoint(folder / CHECKPOINT_NAME, state))
            if digest is not None:
                self.step = step  # on disk, whatever the other ranks' answer (`_commit`)
                remove_deltas(folder / CHECKPOINT_NAME)
                remove_stale_shards(folder, [name for name, _ in files])
        self._raise_if_lead_failed(digest, folder / CHECKPOINT_NAME)
        return digest

    def _save_delta(self, state_of: StateOf, folder: Path, step: int) -> None:
        """Every rank the touched rows it owns, then rank 0 the delta manifest naming them."""
        rows = self._all_touched_rows()
        common = common_state(self.model)
        replicated = replicated_embeddings(self.model)
        tables = delta_tables(replicated, rows) if self.world.lead else {}
        dense = dense_state_from(common, table_keys(replicated))
        shards = rank_delta_shards(self.model, rows)
        self._agree_finite({**dense, **{k + ".weight": v["weight"] for k, v in tables.items()}}, shards, step)
        sequence = self._written + 1
        maps = owned_maps(self.model)
        files = self._write_shards(lambda: write_shard(folder, step, self.world.rank, self.world.size,
                                                       shards, save_checkpoint, sequence, managed=maps))
        digest = None
        if self.world.lead:
            state = state_of(common)
            delta = {key: state[key] for key in DELTA_STATE_KEYS}
            delta.update(format=DELTA_FORMAT, version=RANKS_DELTA_VERSION, base=self._base_digest,
                         sequence=sequence, model=dense, tables=tables,
                         shards=manifest(step, self.world.size, files))
            target = delta_path(folder / CHECKPOINT_NAME, sequence)
            digest = self._lead_write(lambda: save_checkpoint(target, delta))
            if digest is not None:
                self.step = step  # on disk, whatever the other ranks' answer (`_commit`)
        self._raise_if_lead_failed(digest, delta_path(folder / CHECKPOINT_NAME, sequence))
        self._written = sequence

    def _all_touched_rows(self) -> dict[str, torch.Tensor]:
        """Every rank's touched rows since the last checkpoint, per group (sorted, unique), and
        this rank's marks cleared: an owner's rows change by any rank's steps."""
        mine = self._dirty.take()
        gathered: list[Any] = [None] * self.world.size
        dist.all_gather_object(gathered, mine)
        names = sorted({name for rows in gathered for name in rows})
        return {name: torch.unique(torch.cat([rows[name] for rows in gathered if name in rows]))
                for name in names}

    def _agree_finite(self, dense: dict[str, Any], shards: dict[str, dict[str, torch.Tensor]], step: int) -> None:
        """Every rank learns whether any parameter of this checkpoint is not finite (then none writes)."""
        bad = first_non_finite(dense) or first_non_finite(
            {f"{EMBEDDINGS_PREFIX}{g}.weight": part["weight"] for g, part in shards.items()})
        if self.world.any(bad is not None):
            raise TrainingStopped(f"parameter {bad or '(on another rank)'} is not finite at step "
                                  f"{step}; not checkpointed, {self.note()}")

    def _write_shards(self, write: Callable[[], tuple[str, str]]) -> list[tuple[str, str]]:
        """Run this rank's shard write; every rank's (file, digest), or the first failure on all."""
        try:
            mine: Any = write()
        except CheckpointError as exc:
            mine = str(exc)
        files: list[Any] = [None] * self.world.size
        dist.all_gather_object(files, mine)
        failed = [f for f in files if isinstance(f, str)]
        if failed:
            self._chained = False  # the chain has a hole: the next checkpoint is a full one
            raise CheckpointError(failed[0])
        return [tuple(f) for f in files]

    def _lead_write(self, write: Callable[[], str]) -> str | None:
        """Rank 0's manifest write; its digest, or None when it failed (the error kept for all)."""
        try:
            return write()
        except CheckpointError as exc:
            self._lead_error = str(exc)
            return None

    def _raise_if_lead_failed(self, digest: str | None, target: Path) -> None:
        """Every rank learns whether rank 0's manifest is on disk; if not, all raise its error."""
        if self.world.any(self.world.lead and digest is None):
            self._chained = False
            message, self._lead_error = self._lead_error or f"rank 0 could not write {target}", None
            raise CheckpointError(message)

    def wait(self) -> None:
        """Block until every queued write is committed on every rank (the end of a run).

        Raises:
            TrainingStopped / CheckpointError: a write failed on any rank (every rank raises it).
        """
        if self._writer is not None:
            self._agree(self._writer.finish())

    def drain(self) -> None:
        """On a failure path: wait for the writes in flight (each done, failed, or timed out
        within the run's timeout), dropping their errors (another error is on its way)."""
        if self._writer is not None:
            self._writer.finish()

    def note(self) -> str:
        """What is on disk after a failure: the newest checkpoint's step, or that there is none
        (both candidates where rank 0 stopped in the commit of a newer one, before or after
        writing its manifest: a restart resumes from whichever is on disk)."""
        kept = "no checkpoint was written" if self.step is None else f"the checkpoint of step {self.step} is kept"
        if self._unsure is None:
            return kept
        before = "none" if self.step is None else f"that of step {self.step}"
        return (f"the checkpoint of step {self._unsure} is kept if rank 0 wrote it before it stopped, "
                f"else {before}")


def _failure_of(outcome: Outcome, failed: int) -> Exception:
    """The error rank `failed` reported (`outcome`), raised on every rank with `failed_rank`: whose
    error it is (on the others the command's line follows that rank's: `fail(follows=...)`)."""
    kind, message = outcome
    error = ERRORS[kind](message)
    error.failed_rank = failed
    return error


class RankLost(RuntimeError):
    """A rank did not answer a checkpoint's commit within the run's timeout (a RuntimeError, as
    the failures of training's collectives: the command reports it as another rank failing)."""


def _attempt(write: Callable[[], Any]) -> Outcome:
    """("ok", what `write` returned), or the error it raised as (kind, one line)."""
    try:
        return "ok", write()
    except TrainingStopped as exc:
        return "stopped", str(exc)
    except Exception as exc:  # disk full, unwritable folder, a bug: every rank must learn it
        return "error", str(exc) if isinstance(exc, CheckpointError) else first_line(exc)


class _CommitWriter(BackgroundWriter):
    """The writer thread of one rank: jobs run one after another, in submission order
    (`BackgroundWriter`'s queue and thread).

    A job that raises is this rank's failure; since every job's commit is collective, every rank
    fails in the same job. Jobs queued after a failure are dropped on every rank until training
    has taken it (`finish`, then `accept_after_failure`: the queue is empty by then), so the
    ranks keep running the same jobs. Unlike the one-process writer, `submit` never raises: the
    ranks agree on a failure at their next checkpoint (`failure`, `finish`).

    Args:
        group: the gloo group the jobs' commits use (`World.checkpoint_group`).
    """

    def __init__(self, group: Any) -> None:
        super().__init__(thread_name="flowrec-rank-checkpoint")
        self.group = group

    def submit(self, job: Callable[[], None]) -> None:
        """Queue `job` behind the others."""
        self._enqueue(job)

    def failure(self) -> BaseException | None:
        """The failure of a job done so far, if any (without waiting)."""
        return self._error

    def finish(self) -> BaseException | None:
        """Wait for every queued job; the failure, if one failed."""
        self.join()
        return self._error

    def accept_after_failure(self) -> None:
        """Training has taken the failure (after `finish`): run the jobs submitted from now on."""
        self._error = None
