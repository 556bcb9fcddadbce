"""The checkpoints of a distributed run: full sharded ones and, with `full_every = K > 1`, deltas.

A full checkpoint (`flowrec.runtime.checkpoint.shards`): every rank writes the rows it owns of
each row-wise group to its shard file; when all have written, rank 0 writes `checkpoint.pt`
naming them (dense part, replicated tables, position, RNG; under owner ranks of managed tables
each shard also holds its rank's map shards), then removes the older shards and
deltas. With `full_every = K > 1` it is followed by K-1 deltas: each rank marks the packed rows
of its batches (`DirtyRows`); at a delta the ranks exchange their marks (one all-gather of the
touched row numbers), so each knows every row any step changed. Each rank writes the touched rows
it owns, with their optimizer state, to its delta shard file; when all have written, rank 0
writes the delta manifest `checkpoint.delta-<N>.pt` (the dense part, the touched rows of the
replicated groups, position, RNG, and the delta shards with their digests). A kill before the
manifest is in place leaves the previous checkpoint (base and earlier deltas) whole; the orphan
delta shards are removed with the next full checkpoint's older files.

Every write here is inline (training waits): the ranks agree that each one is on disk before
rank 0 names it, with collectives on the training thread. A delta's writes are the touched rows
only, so their cost follows the rows touched, not the tables. The first checkpoint of a process
is a full one; a best-evaluation checkpoint is always full and leaves the chain alone.

Example:
    >>> ckpt = RankCheckpointer(Path("runs/x/checkpoint.pt"), 3, {"g0": 1000}, model, world)  # doctest: +SKIP
    >>> ckpt.mark(batch); train_step(batch); ckpt.save(trainer.state, Path("runs/x"), step)  # doctest: +SKIP
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
from flowrec.runtime.checkpoint.incremental import EMBEDDINGS_PREFIX, DirtyRows, delta_tables
from flowrec.runtime.nonfinite import TrainingStopped, first_non_finite

CHECKPOINT_NAME = "checkpoint.pt"
NONCE_BYTES = 8  # random id of a full checkpoint, so deltas never apply to another run's base
DELTA_STATE_KEYS = ("spec", "plan", "rng", "position", "skipped_batches", "dense_optimizer")
StateOf = Callable[[dict[str, torch.Tensor]], dict[str, Any]]  # the trainer's state(model)


class RankCheckpointer:
    """Writes the checkpoints of one rank of a distributed run (see the module docstring).

    Args:
        path: the run's full checkpoint file (`<run>/checkpoint.pt`).
        full_every: a full checkpoint every K checkpoints (1: all full).
        rows_of_group: packed rows of each group (the size of its dirty mask).
        model: the lowered distributed model (`distributed.model`).
        world: this rank's `World`.
    """

    def __init__(self, path: Path, full_every: int, rows_of_group: dict[str, int], model: Any,
                 world: Any) -> None:
        self.path = Path(path)
        self.full_every = max(1, int(full_every))
        self.rows_of_group = dict(rows_of_group)
        self.model, self.world = model, world
        self.step: int | None = None  # step of the newest checkpoint on disk
        self.seconds = {"full": [], "delta": []}  # per checkpoint: seconds training waited
        self._dirty = DirtyRows()
        self._base_digest: str | None = None  # digest of the full checkpoint on disk (rank 0)
        self._chained = False  # a full checkpoint is on disk, so deltas may follow
        self._written = 0  # deltas written on the current full checkpoint
        self._lead_error: str | None = None  # rank 0: why its manifest write failed

    @property
    def incremental(self) -> bool:
        return self.full_every > 1

    def mark(self, batch: Any) -> None:
        """Before a training step on `batch` (this rank's slice): record the rows it touches."""
        if self.incremental:
            self._dirty.mark(batch, self.rows_of_group)

    def restart_chain(self, step: int | None) -> None:
        """After loading a checkpoint: the next checkpoint is a full one."""
        self._chained, self._written, self.step = False, 0, step

    def save(self, state_of: StateOf, folder: Path, step: int, best: bool = False) -> None:
        """Checkpoint the run into `folder`: a full one or a delta on the last one (every rank
        calls it at the same step).

        Args:
            state_of: the trainer's `state(model)`: the run's state around a model state.
            folder: the run folder, or its `best/` folder (`best`: always full, chain untouched).
            step: the training step the run is at.

        Raises:
            TrainingStopped: a non-finite parameter on any rank (nothing is written).
            CheckpointError: a rank could not write its part (the previous checkpoint is intact).
        """
        t0 = time.perf_counter()
        if best:
            self._save_full(state_of, folder, step)
            return
        if self.incremental and self._chained and self._written + 1 < self.full_every:
            self._save_delta(state_of, folder, step)
            self.seconds["delta"].append(time.perf_counter() - t0)
        else:
            self._dirty.take()
            self._chained = False  # a failed full write leaves no base to chain on
            self._base_digest = self._save_full(state_of, folder, step)
            self._chained, self._written = True, 0
            self.seconds["full"].append(time.perf_counter() - t0)
        self.step = step

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
        table_keys = {f"{EMBEDDINGS_PREFIX}{name}.{part}" for name in replicated for part in ("weight", "state")}
        dense = {k: v.detach().clone().cpu() for k, v in common.items() if k not in table_keys}
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
        """Nothing to wait for: every write of a distributed run is inline."""

    def drain(self) -> None:
        """Nothing to wait for: every write of a distributed run is inline."""

    def note(self) -> str:
        """What is on disk after a failure: the newest checkpoint's step, or that there is none."""
        if self.step is None:
            return "no checkpoint was written"
        return f"the checkpoint of step {self.step} is kept"
