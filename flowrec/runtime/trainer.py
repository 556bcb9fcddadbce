"""The trainer: epochs of staged batches through the plan's step, metrics, evaluation, checkpoints.

Pipeline per epoch: data staging (`iterate_batches`: reader + packing workers + lookahead thread,
bounded queue) -> transfer stage (`TransferStage`, bounded queue of the plan's prefetch depth) ->
compute (`train_step`, micro-batched as planned). Every `eval_every` steps and at the end the
evaluation set is scored exactly. Checkpoints are complete (packed tables with optimizer state,
dense parameters and optimizer, RNG, data position, plan, spec) and atomic; a run resumed from
one ends with the same parameters as an uninterrupted run, because batch k of an epoch is a
function of (seed, epoch, k) alone.

Example:
    >>> trainer = Trainer(spec, plan, model, TrainConfig(epochs=1))  # doctest: +SKIP
    >>> result = trainer.fit(train_source, eval_source)  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from flowrec.data.batches import StagingOptions, batches_per_epoch, iterate_batches
from flowrec.data.lookahead import windowed
from flowrec.data.rowcache import parse_cache_data
from flowrec.data.cores import thread_budget
from flowrec.data.encoder_record import record_of_dataset
from flowrec.graph.kinds import HORIZON_WINDOWS
from flowrec.runtime.caches.counters import collect_counters
from flowrec.runtime.caches.fae_batches import COLD_RUN, HOT_RUN, HotColdBatcher
from flowrec.runtime.caches.static_hot import assign_hot_rows
from flowrec.runtime.checkpoint.store import (
    CHECKPOINT_FORMAT,
    CHECKPOINT_NAME,
    CHECKPOINT_VERSION,
    CheckpointError,
    check_tensors,
    load_checkpoint,
    save_checkpoint,
)
from flowrec.runtime.checkpoint.checkpointer import Checkpointer
from flowrec.runtime.evaluation.early_stop import EarlyStopper
from flowrec.runtime.evaluation.evaluate import Metrics, evaluate
from flowrec.runtime.hostmem import tune_host_allocator
from flowrec.runtime.lowering import LoweredModel
from flowrec.runtime.messages import first_line
from flowrec.runtime.run_log import MetricsLog
from flowrec.data.interrupts import handlers_installed, stop_signals
from flowrec.runtime.nonfinite import LossGuard, NonFiniteLoss, TrainingStopped, first_non_finite
from flowrec.runtime.pipeline import TransferStage
from flowrec.runtime.placement import HOST_SIDE
from flowrec.runtime.progress import TrainProgress
from flowrec.runtime.rundir import BEST_DIR, METRICS_FILE, write_text
from flowrec.runtime.lr_schedule import LRController, LRSchedule, sparse_optimizers
from flowrec.runtime.evaluation.retrieval import SeenItems
from flowrec.runtime.retrieval import read_items, sampler as negative_sampler
from flowrec.runtime.step import DEFAULT_LOOKAHEAD, gives_one_row, make_dense_optimizer, one_row_skip, train_step
from flowrec.spec.load import to_dict
from flowrec.spec.model import ModelSpec
from operators.custom_code import UserCodeRefused
from operators.device import forked_generators
from operators.onednn import gemm_library

INTERRUPT_FLAG, STOP_FLAG = 0, 1  # the flags the ranks agree on each step (`DenseParallel`), in this order
# "inline": every checkpoint is written on the training thread (the behaviour before background
# writes, for comparison: tools/bench_checkpoint.py); default ("background"): on a writer thread.
# One switch for one process and for ranks; the older name, for ranks only once, is still read.
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # a regression label whose squared error passes it: inf loss
CHECKPOINT_WRITES_ENV = "FLOWREC_CHECKPOINT_WRITES"
RANK_CHECKPOINTS_ENV = "FLOWREC_RANK_CHECKPOINTS"


CHECKPOINT_WRITES = ("background", "inline")


def background_checkpoints() -> bool:
    """Whether checkpoints are written in the background: True unless `FLOWREC_CHECKPOINT_WRITES`
    (or, when it is unset, the older `FLOWREC_RANK_CHECKPOINTS`) is "inline".

    Raises:
        ValueError: another value (a typo such as `inlne` silently wrote in the background, so a
            comparison of the two timed one mode twice).
    """
    name = CHECKPOINT_WRITES_ENV if os.environ.get(CHECKPOINT_WRITES_ENV) else RANK_CHECKPOINTS_ENV
    value = os.environ.get(name) or "background"
    if value not in CHECKPOINT_WRITES:
        raise ValueError(f"{name}={value!r}: use background or inline (or leave it unset: background)")
    return value != "inline"


@dataclass(frozen=True)
class TrainConfig:
    """Run settings (the spec holds the model and its training hyper-parameters).

    Args:
        epochs: epochs to train (None: the spec's training.epochs).
        out_dir: run folder for metrics.jsonl, checkpoint.pt, plan.json (None: nothing written).
        eval_every: evaluate every N steps (None: the spec's training.eval_every; 0: only at the end).
        max_steps: stop after this many steps in total (None: no limit).
        checkpoint_every: also checkpoint every N steps (0: only at the end and on interrupt).
        checkpoint_full_every: a full checkpoint every K checkpoints and incremental deltas (the
            rows touched since the previous one) in between; 1: every checkpoint is full; 0 (AUTO,
            the default): a full one unless the previous full one is still being written. Every
            checkpoint is written in the background (`flowrec.runtime.checkpoint.checkpointer`;
            ranks: `flowrec.runtime.checkpoint.ranks`) unless `FLOWREC_CHECKPOINT_WRITES=inline`.
        progress: show the progress bar.
        workers: data packing threads.
        lookahead: staging lookahead window (>= 1 computes the casting index in the data stage).
        shuffle: shuffle rows each epoch.
        tensorboard: also log to TensorBoard when installed.
        drop_last: drop the last partial batch of each epoch.
        interleave: overlap work as planned (micro-batches, cache exchanges on a side thread /
            stream); False gives the sequential schedule for comparison (same parameters).
        compile_dense: compile the training dense stage (`LoweredModel.compile_dense`: torch.compile
            through the device runtime, eager where compiling fails). Opt-in: the first step pays
            a compile of tens of seconds, which short runs do not earn back.
        hot_run: FAE interleaving rate, hot batches in a row (static_hot placements).
        cold_run: cold batches in a row.
        nan_policy: on a non-finite loss, "stop" (raise TrainingStopped; nothing of the batch is
            applied and no checkpoint is written) or "skip-batch" (skip its update, count it).
        eval_group_by: one-id categorical feature for gAUC (None: the spec's training.eval_group_by).
        cache_data: keep the training and evaluation data's staged rows in memory across epochs
            (`flowrec.data.rowcache`): auto, on, off, or a byte size (auto with that budget).
    """

    epochs: int | None = None
    out_dir: Path | None = None
    eval_every: int | None = None
    max_steps: int | None = None
    checkpoint_every: int = 0
    checkpoint_full_every: int = 0  # AUTO
    progress: bool = True
    workers: int = field(default_factory=lambda: thread_budget().workers)  # <= the usable cores
    lookahead: int = DEFAULT_LOOKAHEAD
    shuffle: bool = True
    tensorboard: bool = True
    drop_last: bool = False
    interleave: bool = True
    compile_dense: bool = False
    hot_run: int = HOT_RUN
    cold_run: int = COLD_RUN
    nan_policy: str = "stop"
    eval_group_by: str | None = None
    cache_data: str = "auto"


@dataclass(frozen=True)
class EvalEvent:
    """One evaluation: its step, metrics per head, and whether it is the final one of the run.

    `best` is True when early stopping took it as a new best (and saved RUN/best/); `stop` when
    early stopping ends the run after it.
    """

    step: int
    metrics: Metrics
    final: bool
    best: bool = False
    stop: bool = False


@dataclass(frozen=True)
class Hooks:
    """Callbacks of a run; each may call `Trainer.request_stop()` to end the run after this step.

    Args:
        on_step: after every step, with the position and the loss (None for a skipped batch).
        on_eval: after every evaluation (every `eval_every` steps and the final one).
        on_checkpoint: after every checkpoint written, with its step and path.
    """

    on_step: Callable[[Position, float | None], None] | None = None
    on_eval: Callable[[EvalEvent], None] | None = None
    on_checkpoint: Callable[[int, Path], None] | None = None


@dataclass
class Position:
    """Where training is: the next batch to run is (epoch, batch); `step` steps are done."""

    epoch: int = 0
    batch: int = 0
    step: int = 0
    samples: int = 0


@dataclass
class TrainResult:
    steps: int
    samples: int
    seconds: float
    samples_per_s: float
    final_loss: float | None
    eval: dict[str, dict[str, float]] = field(default_factory=dict)
    interrupted: bool = False
    stage_seconds: dict[str, float] = field(default_factory=dict)
    counters: dict[str, dict[str, Any]] = field(default_factory=dict)
    skipped_batches: int = 0
    skipped_rows: int = 0  # rows of batches skipped for a custom module that cannot train on one row
    one_row_refusers: list[str] = field(default_factory=list)  # those modules: "'NAME' (CLASS) cannot ... (why)"
    stopped_early: bool = False
    stop_requested: bool = False
    best_step: int | None = None
    managed: dict[str, Any] | None = None  # managed tables: occupancy, admitted, evicted, default lookups
    transfer_bytes: int = 0  # bytes the transfer stage copied to the device for the steps trained (0 on a CPU)


class Trainer:
    """Runs a lowered model over staged batches.

    Args:
        spec: the model spec.
        plan: its plan (micro-batches, prefetch depth, groups).
        model: `lower(plan, spec, device)`.
        config: run settings.
        plan_document: the plan as JSON text, stored in checkpoints.
    """

    def __init__(self, spec: ModelSpec, plan: Any, model: LoweredModel, config: TrainConfig,
                 plan_document: str = "") -> None:
        self.spec = spec
        self.plan = plan
        self.model = model
        self.config = config
        tune_host_allocator()
        gemm_library()  # $FLOWREC_CPU_GEMM refused before the first step, not in its forward
        background_checkpoints()  # $FLOWREC_CHECKPOINT_WRITES likewise, not at the first checkpoint
        self.plan_document = plan_document
        opt = spec.dense_optimizer
        self.optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
        training = spec.training
        self.horizon_steps: int | None = None  # decay length of the schedule, fixed at the run's start
        # base rates taken now, before a checkpoint's optimizer state (with scheduled rates) is loaded
        self.lr = LRController(LRSchedule(training.schedule, 0), self.optimizer,
                               sparse_optimizers(model.embeddings), opt.lr, spec.sparse_optimizer.lr)
        self.clip_grad_norm = training.clip_grad_norm
        self.eval_group_by = config.eval_group_by or training.eval_group_by
        self.seen = None  # a retrieval head's training items per user, set at fit when it excludes them
        self.stopper = (EarlyStopper.of(training.early_stopping, spec.heads[0].name)
                        if training.early_stopping is not None else None)
        self.hooks = Hooks()
        self._stop_requested = False
        self._last_eval: EvalEvent | None = None
        self.position = Position()
        self.epochs = config.epochs if config.epochs is not None else spec.training.epochs
        self.eval_every = config.eval_every if config.eval_every is not None else spec.training.eval_every
        self.precision = spec.training.precision
        self.micro_batches = int(plan.meta.micro_batches) if config.interleave else 1
        self.prefetch = int(plan.meta.prefetch)
        self.host_groups = frozenset(g.name for g in model.groups if g.placement in HOST_SIDE)
        placements = {g.placement for g in model.groups}
        self.lookahead = max(config.lookahead, spec.plan.window if "lookahead" in placements else 0)
        self.horizon = HORIZON_WINDOWS * self.lookahead if "lookahead" in placements else 0
        self.lookahead_groups = frozenset(g.name for g in model.groups if g.placement == "lookahead")
        model.set_interleave(config.interleave)
        if config.compile_dense:
            model.compile_dense()
        self.hot_flags: dict[str, torch.Tensor] | None = None if "static_hot" in placements else {}
        self.log: MetricsLog | None = None
        self.stage_seconds = {"staging_wait": 0.0, "compute": 0.0, "eval": 0.0, "checkpoint": 0.0}
        self.transfer_bytes = 0  # copied by the transfer stage for the batches trained
        self.checkpoint_stalls: list[dict[str, Any]] = []  # per checkpoint: step, seconds training waited
        self._training = False  # in the loop of steps (checkpoints there get a metrics record each)
        self._per_epoch = 0
        self.skipped_batches = 0
        self.skipped_rows = 0  # this session's rows of one-row batches a custom module cannot train (`one_row_skip`)
        self.world = getattr(model, "world", None)  # the ranks of a distributed run (None: one process)
        self._interrupt = GracefulInterrupt(say=self.lead)  # rank 0's line is the launch's
        self.checkpointer = self._make_checkpointer()
        # a checkpoint taken while training runs (--checkpoint-every) reads the rows marked before each
        # step (a delta's touched rows, a full write's rows still to copy); without one, the only
        # checkpoint is the whole one at the end (or on Ctrl-C), and marking would cost a step its
        # ids' scattered writes into a mask of every row for nothing (DLRM: 1.5 ms a step)
        self._marks_rows = self.config.out_dir is not None and self.config.checkpoint_every > 0
        self._saved_step: int | None = None  # the on-disk checkpoint's step last given a `saved` record
        self._checkpointed: Position | None = None  # the position the last RUN/checkpoint.pt taken records
        self._process_rng: torch.Tensor | None = None  # a loaded checkpoint's torch generator state
        self.parallel = None
        if self.world is not None:
            from flowrec.runtime.distributed.data_parallel import DenseParallel

            self.parallel = DenseParallel(model, self.world,
                                          lambda: (self._interrupt.requested, self._stop_requested))

    def _make_checkpointer(self) -> Any:
        """The run's checkpoint writer: `Checkpointer` (one process) or `RankCheckpointer` (ranks)."""
        # absolute: the writes run on a thread of their own, beside a custom module's forward that may move
        # the working folder for the while of its call (put back after it)
        path = Path(os.path.abspath(self.config.out_dir or ".")) / CHECKPOINT_NAME
        rows = {g.name: g.rows for g in self.model.groups}
        background = background_checkpoints()
        if self.world is None:
            return Checkpointer(path, self.config.checkpoint_full_every, rows, background)
        from flowrec.runtime.checkpoint.ranks import RankCheckpointer

        return RankCheckpointer(path, self.config.checkpoint_full_every, rows, self.model, self.world, background)

    @property
    def lead(self) -> bool:
        """This process writes the run's shared files and reports (one process, or rank 0)."""
        return self.world is None or self.world.lead

    # ---------------------------------------------------------------- data
    def staging(self, shuffle: bool | None = None, lookahead: int | None = None,
                sliced: bool = True) -> StagingOptions:
        """Staging of training batches (`sliced`: this rank's slice of each global batch) or, with
        `sliced=False`, of whole batches (evaluation: every rank scores every sample)."""
        ranks = {"world_size": self.world.size, "rank": self.world.rank} if self.world and sliced else {}
        cache_data, cache_budget = parse_cache_data(self.config.cache_data)
        return StagingOptions(
            batch_size=self.spec.training.batch_size,
            shuffle=self.config.shuffle if shuffle is None else shuffle,
            seed=self.spec.training.seed,
            drop_last=self.config.drop_last,
            workers=self.config.workers,
            prefetch=max(self.prefetch, 2),
            lookahead=self.lookahead if lookahead is None else lookahead,
            horizon=self.horizon,
            cache_data=cache_data,
            cache_budget=cache_budget,
            **ranks,
        )

    def eval_batches(self, source: Any):
        return iterate_batches(self.spec, source, self.staging(shuffle=False, lookahead=0, sliced=False), 0, 0,
                               self.model.groups, remap=self._remapper(train=False))

    def _remapper(self, train: bool) -> Any:
        """The data stage's maps of managed tables: copies of the model's (None without any)."""
        managed = getattr(self.model, "managed", None)
        return managed.remapper(train) if managed is not None else None

    # ---------------------------------------------------------------- loop
    def total_steps(self, train_source: Any) -> int | None:
        """Steps of the whole run (None when unknown in advance: FAE hot/cold batches)."""
        cfg = self.config
        per_epoch = batches_per_epoch(sum(train_source.partition_rows()), self.spec.training.batch_size,
                                      cfg.drop_last)
        self._per_epoch = per_epoch
        total = per_epoch * self.epochs
        if cfg.max_steps is not None:
            total = min(total, cfg.max_steps)
        return total

    def finished(self, train_source: Any) -> bool:
        """The run is at its end already (all epochs, or max_steps, done)."""
        total = self.total_steps(train_source)
        if self.hot_flags is None or self.hot_flags:  # FAE: epochs end when their batches do
            total = self.config.max_steps
        return self.position.epoch >= self.epochs or self._done(total) or self.stopped_early

    def request_stop(self) -> None:
        """End the run after the current step (from a callback): evaluate, checkpoint, return."""
        self._stop_requested = True

    def fit(self, train_source: Any, eval_source: Any | None = None,
            on_step: Callable[[Position, float], None] | None = None, hooks: Hooks | None = None) -> TrainResult:
        """Train from the current position to the end (or max_steps, or an early stop); evaluate;
        checkpoint.

        A KeyboardInterrupt saves a resumable checkpoint at the last completed step and returns
        a result with `interrupted=True`. A non-finite loss under `nan_policy="stop"` (or non-finite
        parameters at a checkpoint) raises TrainingStopped and keeps the last checkpoint; so does a
        model whose every batch would be skipped (`_check_full_batches`), before anything is written.
        """
        self._check_full_batches()
        cfg = self.config
        hooks = hooks or Hooks()
        self.hooks = hooks if on_step is None else Hooks(on_step, hooks.on_eval, hooks.on_checkpoint)
        total = self.total_steps(train_source)
        self._start_schedule()
        retrieval = self.model.retrieval
        if retrieval is not None:  # evaluation ranks the items the data's encoder holds, as serving
            path = getattr(train_source, "path", None)
            retrieval.set_items(record_of_dataset(Path(path), train_source.meta) if path is not None else None)
        seen = retrieval is not None and retrieval.attrs.get("exclude_seen") and self.eval_group_by
        if retrieval is not None and (retrieval.needs_counts or seen):  # one pass over the item column
            counts, pairs = read_items(train_source, retrieval.item_feature, self.eval_group_by if seen else None)
            if retrieval.needs_counts:  # logQ / unigram: the items' training frequency
                retrieval.set_counts(counts, self.model.device)
            if pairs is not None:
                self.seen = SeenItems.from_pairs(pairs)
        if cfg.out_dir is not None and self.lead:
            self._write_run_files(Path(cfg.out_dir))
            self.log = MetricsLog(Path(cfg.out_dir) / METRICS_FILE, cfg.tensorboard,
                                  keep_through_step=self.position.step)
        try:
            with self._own_generator():
                self._start_generator()
                return self._fit(train_source, eval_source, total)
        except TrainingStopped as exc:
            self.checkpointer.drain()
            if self.log is not None:
                self.log.write({"event": "stopped", "step": self.position.step, "reason": str(exc)})
            raise
        finally:
            self.checkpointer.drain()
            self.model.close()
            if self.log is not None:
                self.log.close()

    def _own_generator(self) -> Any:
        """Training owns torch's process generators: it seeds them as a run starts and, for a model
        with custom modules, at every step (`LoweredModel.seed_custom`); the caller's (`flowrec.train`
        in a user's process) are given back as they were."""
        return forked_generators(self.model.device)

    def _start_generator(self) -> None:
        """The process generator as training starts: the checkpoint's (`load_state`), else seeded
        from the run's seed (`LoweredModel.seed_process`). It was left as the process started, at a
        random seed, so the generator state a checkpoint records differed between a resumed run and
        an uninterrupted one though nothing of flowrec's drew from it."""
        if self._process_rng is not None:
            torch.set_rng_state(self._process_rng)
        else:
            self.model.seed_process(self.position.step, 0 if self.world is None else self.world.rank)

    def _start_schedule(self) -> None:
        """Fix the schedule's horizon (kept from the checkpoint on resume)."""
        if self.horizon_steps is None:  # the spec's epochs; --max-steps only cuts the run short
            self.horizon_steps = self._per_epoch * self.epochs
        self.lr.schedule = LRSchedule(self.spec.training.schedule, self.horizon_steps)

    def _fit(self, train_source: Any, eval_source: Any | None, total: int | None) -> TrainResult:
        cfg = self.config
        if self.hot_flags is None:  # FAE: profile a sample, load the hottest rows onto the device
            self.hot_flags = assign_hot_rows(self.model, self.spec, train_source, seed=self.spec.training.seed)
        if self.hot_flags:  # hot/cold batches: the step count of an epoch is known only at its end
            total = cfg.max_steps
        bar = TrainProgress(total, cfg.progress and self.lead, initial=self.position.step)
        started = time.perf_counter()
        start_samples = self.position.samples
        loss = None
        interrupted = False
        try:
            self._training = True
            with self._interrupt.stopping_after("the current step"):
                while self.position.epoch < self.epochs and not self._done(total):
                    loss = self._epoch(train_source, eval_source, bar, total) or loss
        except KeyboardInterrupt:
            interrupted = True
        finally:
            self._training = False
            bar.close()
        seconds = time.perf_counter() - started
        samples = self.position.samples - start_samples
        result = TrainResult(self.position.step, samples, seconds, samples / max(seconds, 1e-9), loss,
                             interrupted=interrupted, skipped_batches=self.skipped_batches,
                             skipped_rows=self.skipped_rows,
                             one_row_refusers=[f"{m.label!r} ({m.path}) cannot train on one row ({m.one_row})"
                                               for m in getattr(self.model, "one_row_refusers", ())],
                             stopped_early=self.stopped_early, stop_requested=self._stop_requested)
        if not interrupted and eval_source is not None:
            try:  # no step to stop after: Ctrl-C or SIGTERM ends the evaluation, the checkpoint is still taken
                with self._interrupt.at_once():
                    result.eval = self._final_eval(eval_source)
            except KeyboardInterrupt:
                interrupted = result.interrupted = True
        # the run's last checkpoint is what a first Ctrl-C or SIGTERM would take anyway: it is finished
        # (a second signal stops at once); raised at once here, it stopped one rank between the others'
        # collectives, and each rank said a line of its own without what was kept
        with self._interrupt.stopping_after("the run's last checkpoint"):
            if self._checkpointed != self._saved_position():  # not taken at this step already (--checkpoint-every)
                self._checkpoint()
            self._wait_checkpoints()  # no `saved` record after this: the end record is the proof
        if self._interrupt.requested:
            interrupted = result.interrupted = True
        if self.stopper is not None:
            result.best_step = self.stopper.state.best_step
        result.stage_seconds = dict(self.stage_seconds)
        result.transfer_bytes = self.transfer_bytes
        placement = {g.name: g.placement for g in self.model.groups}
        result.counters = {name: {"placement": placement[name], **snap}
                           for name, snap in collect_counters(self.model).items()}
        managed = getattr(self.model, "managed", None)
        result.managed = managed.report() if managed is not None else None
        if self.log is not None:
            self.log.write({"event": "end", "step": self.position.step, "samples": samples,
                            "seconds": seconds, "samples_per_s": result.samples_per_s,
                            "interrupted": interrupted, "stage_seconds": result.stage_seconds,
                            "counters": result.counters, "skipped_batches": self.skipped_batches,
                            "skipped_rows": self.skipped_rows,
                            "stopped_early": self.stopped_early, "best_step": result.best_step,
                            "checkpoint_writes_s": self.checkpointer.seconds,
                            "checkpoint_stalls": self.checkpoint_stalls,
                            "checkpoint_extra_bytes": getattr(self.checkpointer, "extra_bytes", []),
                            **({"managed": result.managed} if result.managed else {})})
        return result

    def _check_full_batches(self) -> None:
        """Refuse a run whose every batch would be skipped (`one_row_skip`): a custom module that
        cannot train on one row, and a batch size that gives it one row (training.batch_size 1,
        or one row a rank under --nproc), where it trained nothing and said so at its end only."""
        size = self.spec.training.batch_size
        ranks = 1 if self.world is None else self.world.size
        if not gives_one_row(self.model, size, size if ranks == 1 else size // ranks, self.parallel):
            return
        named = "; ".join(f"{m.label!r} ({m.path}) cannot train on one row ({m.one_row})"
                          for m in self.model.one_row_refusers)
        share = f" ({size} rows over {ranks} ranks)" if ranks > 1 else ""
        raise TrainingStopped(f"custom module {named}, and every batch gives it one row{share}: nothing would train; "
                              f"make training.batch_size at least {2 * ranks}; nothing was trained")

    @property
    def stopped_early(self) -> bool:
        return self.stopper is not None and self.stopper.state.stopped

    def _done(self, total: int | None) -> bool:
        return (total is not None and self.position.step >= total) or self.stopped_early or self._stopping()

    def _stopping(self) -> bool:
        """A stop was requested (by a callback); with several ranks, as agreed at the last step."""
        return self._agreed(STOP_FLAG, self._stop_requested)

    def _interrupted(self) -> bool:
        """Ctrl-C asked to stop after this step; with several ranks, as agreed at the last step."""
        return self._agreed(INTERRUPT_FLAG, self._interrupt.requested)

    def _agreed(self, flag: int, local: bool) -> bool:
        """`local` in one process; with several ranks, flag `flag` OR-ed over the ranks at the last step."""
        if self.parallel is None:
            return local
        flags = self.parallel.last.flags
        return len(flags) > flag and flags[flag]

    def _epoch(self, train_source: Any, eval_source: Any, bar: TrainProgress, total: int) -> float | None:
        pos = self.position
        last = None
        exhausted = False
        staged = self._staged(train_source)
        with TransferStage(staged, self.model.device, self.prefetch, self.host_groups,
                           background=bool(self.hot_flags)) as batches:
            for batch in batches:
                self._check_next(batch)
                t0 = time.perf_counter()
                lr_dense, lr_sparse = self.lr.apply(pos.step)
                if self._marks_rows:  # before the step: a full checkpoint may still be copying rows
                    self.checkpointer.mark(batch)
                skipped_rows = one_row_skip(self.model, batch, self.parallel)
                loss, skipped_head = self._step(batch, train=not skipped_rows)
                last = last if skipped_rows else loss  # the epoch's last loss is of a batch it did not skip
                self.skipped_rows += skipped_rows
                self.stage_seconds["compute"] += time.perf_counter() - t0
                pos.batch, pos.step = batch.index + 1, pos.step + 1
                pos.samples += batch.samples_in_step
                bar.update(batch.samples_in_step, loss)
                if self.log is not None:
                    record = {"event": "train", "step": pos.step, "epoch": pos.epoch, "loss": loss,
                              "lr_dense": lr_dense, "lr_sparse": lr_sparse}
                    if skipped_head is not None:
                        record.update(skipped=True, head=skipped_head)
                    if skipped_rows:
                        record.update(skipped=True, skipped_rows=skipped_rows)
                    self.log.write(record)
                    self.log.scalars(pos.step, {"throughput/samples_per_s": bar.samples_per_s()})
                if self.hooks.on_step is not None:
                    self.hooks.on_step(pos, loss)
                if self.eval_every and eval_source is not None and pos.step % self.eval_every == 0:
                    self._periodic_eval(eval_source)
                if self.config.checkpoint_every and pos.step % self.config.checkpoint_every == 0:
                    self._checkpoint()
                if self.checkpointer.step != self._saved_step:
                    self._note_saved()
                if self._done(total) or self._interrupted():
                    break
            else:
                exhausted = True
            self.stage_seconds["staging_wait"] += batches.wait_s
            self.transfer_bytes += batches.delivered_bytes
        if exhausted or (not self.hot_flags and pos.batch >= self._per_epoch):
            pos.epoch, pos.batch = pos.epoch + 1, 0
        if self._interrupted():
            raise KeyboardInterrupt
        return last

    def _check_next(self, batch: Any) -> None:
        """Exactly once: a batch is trained only as the next one of the epoch (with several ranks,
        every rank trains its slice of global batch k at step k, so a repeated or skipped batch from
        the staging, e.g. a recomputed Dask task, can never pair different batches across ranks)."""
        if self.hot_flags or batch.index == self.position.batch:
            return
        from flowrec.data.layout import DataError

        raise DataError(f"the data staging delivered batch {batch.index} of epoch {self.position.epoch} where "
                        f"batch {self.position.batch} was expected; nothing of it was trained")

    def _step(self, batch: Any, train: bool = True) -> tuple[float | None, str | None]:
        """One guarded step: (loss, None), or (None, head) for a skipped non-finite batch; (None,
        None) without `train` (a batch skipped as `one_row_skip` says), the managed maps moved on."""
        managed = getattr(self.model, "managed", None)
        if managed is not None:
            managed.before_step(self.model.embeddings, batch)
        try:
            model = LossGuard(self.model) if self.parallel is None else self.model  # ranks agree on it
            self.model.seed_custom(self.position.step, 0 if self.world is None else self.world.rank)
            result = train_step(model, self.optimizer, batch, self.micro_batches, self.precision,
                                self.clip_grad_norm, self.parallel) if train else None, None
        except NonFiniteLoss as bad:
            step = self.position.step + 1
            # a parameter already non-finite (an update overflowed it): skipping would skip every later
            # batch, evaluated on NaN scores, so skip-batch is no advice. Ranks hold other shards: each
            # says what it holds and every rank takes the same decision (every rank is here: the loss
            # agreement raised NonFiniteLoss on all), naming the first such parameter, the loss of the
            # first rank whose loss was not finite, so one alone never stops while the others wait
            broken = first_non_finite(self.model.state_dict())
            if self.world is not None:
                seen = self.world.gather((broken, bad.head, bad.value))
                broken = next((name for name, _, _ in seen if name is not None), None)
                bad = next((NonFiniteLoss(head, value) for _, head, value in seen if not math.isfinite(value)), bad)
            if broken is not None:
                skipping = ", so skipping batches cannot go on" if self.config.nan_policy == "skip-batch" else ""
                raise TrainingStopped(f"non-finite loss ({bad.value}) at step {step} in head {bad.head}: parameter "
                                      f"{broken} is not finite (an earlier update made it so: lower the learning "
                                      f"rate){skipping}; training stopped, {self.checkpoint_note()}") from None
            if self.config.nan_policy != "skip-batch":
                raise TrainingStopped(f"non-finite loss ({bad.value}) at step {step} in head {bad.head}"
                                      f"{self._label_note(bad.head, batch)}{self._custom_note()}; training stopped, "
                                      f"{self.checkpoint_note()} (--nan-policy skip-batch skips such batches)") from None
            self.skipped_batches += 1
            result = None, bad.head
        if managed is not None:  # the map moves on with the data stage, trained or skipped
            managed.after_step(batch)
        return result

    def _custom_note(self) -> str:
        """Which custom module returned the non-finite values of this step, where one did (its last
        output: `operators.custom.non_finite_outputs`)."""
        from operators.custom import non_finite_outputs

        named = non_finite_outputs(self.model) if getattr(self.model, "custom", False) else None
        return f" ({named})" if named else ""

    def _label_note(self, head: str, batch: Any) -> str:
        """Why a regression head's loss overflowed, when its batch's labels say: squared errors of
        labels as large as 1e30 are beyond float32 whatever the model (the line named the head
        alone, as if the learning rate had diverged)."""
        index = next((i for i, h in enumerate(self.spec.heads) if h.name == head and h.task == "regression"), None)
        labels = getattr(batch, "labels", None)
        if index is None or not isinstance(labels, torch.Tensor) or labels.ndim != 2 or not labels.shape[0]:
            return ""
        largest = float(labels[:, index].abs().max())
        if largest * largest * labels.shape[0] <= FLOAT32_MAX:
            return ""
        return (f" (its labels in this batch reach {largest:.3g}, whose squared errors are beyond float32: "
                f"scale the label column, e.g. divide it, or take its log)")

    @property
    def checkpoint_step(self) -> int | None:
        """Step of the newest checkpoint on disk (None: none yet)."""
        return self.checkpointer.step

    def checkpoint_note(self) -> str:
        """What is on disk after a failure: the newest checkpoint's step, or that there is none."""
        return self.checkpointer.note()

    def custom_failure_line(self, exc: BaseException) -> str | None:
        """The line of a run that `exc`, raised by a custom module's own code (its forward, the
        model's backward, its state code), stopped: the step, the module and its class, what is on
        disk; None for an error of no custom module (`flowrec train` says it as its one line,
        `flowrec.train` as a note on the error)."""
        from operators.custom import backward_failure, custom_failure, state_failure

        named = custom_failure(exc) or backward_failure(exc, self.model) or state_failure(exc, self.model)
        return None if named is None else f"at step {self.position.step + 1}: {named}; {self.checkpoint_note()}"

    def _staged(self, train_source: Any) -> Any:
        """This epoch's batches from the current position (hot/cold batches under FAE)."""
        pos = self.position
        negatives = self._negatives()
        if not self.hot_flags:
            return iterate_batches(self.spec, train_source, self.staging(), pos.epoch, pos.batch,
                                   self.model.groups, remap=self._remapper(train=True), negatives=negatives)
        # the hot/cold batches change the order: staged windows would be of batches never trained
        # together, so they are not staged; the lookahead groups' windows and horizons are taken
        # of the batches as formed (`windowed`). The batches are formed on the transfer stage's
        # thread (`background` in `_epoch`), beside the steps: on the step's thread, on the CPU,
        # forming them took 11 ms of deepfm_criteo's 156 ms step (batch 4,096, 64 MiB, one compute
        # thread, AMD EPYC; profiled as tools/profile_step.py --cache static_hot), 145 ms beside them
        # (resident 147 ms)
        staging = replace(self.staging(lookahead=min(self.lookahead, 1)), horizon=0)
        staged = iterate_batches(self.spec, train_source, staging, pos.epoch, 0, self.model.groups)
        batcher = HotColdBatcher(staged, self.hot_flags, self.model.groups, self.spec.training.batch_size,
                                 self.config.hot_run, self.config.cold_run)
        formed: Iterator[Any] = (b for b in batcher if b.index >= pos.batch)
        if negatives is not None:  # drawn for the hot and cold batches as formed (their own indices)
            item_group = self.model.group_map[negatives.group]
            formed = (negatives.attach(b, item_group) for b in formed)
        if self.lookahead_groups:  # after the negatives: a window holds the rows they add
            formed = windowed(formed, self.lookahead, self.horizon, self.lookahead_groups)
        return _Skipping(staged, formed)

    def _negatives(self) -> Any:
        """The data stage's sampler of a retrieval head's sampled negatives (None without one)."""
        binding = self.model.retrieval
        if binding is None or not binding.sampled:
            return None
        return negative_sampler(binding, self.model.noise_seed)

    def _evaluate(self, source: Any) -> Metrics:
        t0 = time.perf_counter()
        with self.eval_batches(source) as batches:
            metrics = evaluate(self.model, batches, self.precision, self.eval_group_by, self.seen)
        self.stage_seconds["eval"] += time.perf_counter() - t0
        return metrics

    def _periodic_eval(self, source: Any) -> None:
        """An evaluation every eval_every steps: the one early stopping watches (best/ on a new best)."""
        step = self.position.step
        metrics = self._evaluate(source)
        verdict = self.stopper.observe(metrics, step) if self.stopper is not None else None
        event = EvalEvent(step, metrics, final=False, best=bool(verdict and verdict.improved),
                          stop=bool(verdict and verdict.stop))
        self._record_eval(event)
        if event.best:
            self._checkpoint(best=True)

    def _final_eval(self, source: Any) -> Metrics:
        """The evaluation at the end (the periodic one of this step when there was one)."""
        last = self._last_eval
        if last is not None and last.step == self.position.step:
            self._record_eval(EvalEvent(last.step, last.metrics, final=True))
            return last.metrics
        metrics = self._evaluate(source)
        self._record_eval(EvalEvent(self.position.step, metrics, final=True))
        return metrics

    def _record_eval(self, event: EvalEvent) -> None:
        self._last_eval = event
        if self.log is not None:
            record = {"event": "eval", "step": event.step, "final": event.final, "metrics": event.metrics}
            if self.stopper is not None and not event.final:
                record.update(best=event.best, stop=event.stop, watched=self.stopper.watched)
            self.log.write(record)
        if self.hooks.on_eval is not None:
            self.hooks.on_eval(event)

    # ---------------------------------------------------------------- state
    def state(self, model: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """The complete, `weights_only`-loadable state of the run (`model`: its model state,
        when already taken)."""
        return {
            "format": CHECKPOINT_FORMAT,
            "version": CHECKPOINT_VERSION,
            "spec": json.dumps(to_dict(self.spec), sort_keys=True),
            "plan": self.plan_document,
            "model": self._model_state() if model is None else model,
            "dense_optimizer": self.optimizer.state_dict(),
            "rng": {"torch": torch.get_rng_state()},
            "position": asdict(self._saved_position()),
            "skipped_batches": self.skipped_batches,
            "schedule": {"horizon_steps": self.horizon_steps},
            "early_stopping": self.stopper.state_dict() if self.stopper is not None else None,
        }

    def _saved_position(self) -> Position:
        """The position a checkpoint records: after an epoch's last batch, the next epoch's start,
        as the epoch loop leaves it once the epoch ends. A checkpoint taken at that step inside the
        loop (`--checkpoint-every`) then equals the one taken after it, so a run killed between
        the two and resumed ends on the same position as an uninterrupted one."""
        pos = self.position
        if not self.hot_flags and self._per_epoch and pos.batch >= self._per_epoch:
            return replace(pos, epoch=pos.epoch + 1, batch=0)
        return pos

    def _model_state(self) -> dict[str, torch.Tensor]:
        """The model's state for a checkpoint; with several ranks, all but the row-wise groups'
        rows (each rank writes its own shard of those: `flowrec.runtime.checkpoint.ranks`)."""
        if self.world is None:
            return self.model.state_dict()
        from flowrec.runtime.checkpoint.layout import common_state

        return common_state(self.model)

    def model_state_like(self, initial_states: bool = False) -> dict[str, torch.Tensor]:
        """Tensors shaped like the model's state in the single-process layout (whole tables),
        the layout every checkpoint loads in; `initial_states`: with the groups' initial sparse
        optimizer states as values (one process: the model's own state as it is)."""
        if self.world is None:
            return self.model.state_dict()
        from flowrec.runtime.checkpoint.layout import initial_whole_states, whole_state_like

        like = whole_state_like(self.model)
        return {**like, **initial_whole_states(self.model)} if initial_states else like

    def load_state(self, state: dict[str, Any], source: Path | str = "checkpoint") -> None:
        """Restore a checkpoint's parameters, optimizer state, RNG and data position.

        The checkpoint must fit this model: the same parameter names, shapes and dtypes, and a dense
        optimizer state for the same parameters (else CheckpointError, one line naming `source`).
        """
        if state.get("format") != CHECKPOINT_FORMAT:
            raise CheckpointError(f"{source} is not a flowrec checkpoint")
        check_tensors(Path(source), "model", self.model_state_like(), state.get("model"))
        check_optimizer_state(Path(source), self.optimizer, state.get("dense_optimizer"))
        try:
            self._load_model_state(state["model"])
            self.optimizer.load_state_dict(state["dense_optimizer"])
        except UserCodeRefused as exc:  # a custom module's load code tried to end the process
            raise CheckpointError(f"cannot load {source}: {exc}") from None
        except (RuntimeError, ValueError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{source} does not fit the spec's model "
                                  f"({first_line(exc)})") from None
        self._process_rng = state["rng"]["torch"].clone()  # set as training starts (`_start_generator`)
        self.position = Position(**state["position"])
        self.skipped_batches = int(state.get("skipped_batches", 0))
        self.checkpointer.restart_chain(self.position.step)
        self._saved_step = self.position.step  # on disk already, recorded by the run that wrote it
        self._load_loop_state(Path(source), state)

    def _load_model_state(self, model_state: dict[str, torch.Tensor]) -> None:
        """Load whole-table model state (each rank keeps its rows of row-wise groups)."""
        if self.world is None:
            self.model.load_state_dict(model_state)
            return
        from flowrec.runtime.checkpoint.layout import load_whole_state

        load_whole_state(self.model, model_state)

    def _load_loop_state(self, source: Path, state: dict[str, Any]) -> None:
        """The schedule's horizon and early stopping's state (absent in checkpoints of older runs)."""
        self.horizon_steps = checked_horizon(source, state)
        stopping = state.get("early_stopping")
        if self.stopper is not None and isinstance(stopping, dict):
            try:
                self.stopper.load_state_dict(stopping)
            except TypeError:
                raise CheckpointError(f"{source} is damaged: early_stopping state is not one") from None

    def _checkpoint(self, best: bool = False) -> None:
        """Save the run's state to RUN/checkpoint.pt, or (best) to RUN/best/checkpoint.pt."""
        if self.config.out_dir is None:
            return
        t0 = time.perf_counter()
        folder = Path(self.config.out_dir) / BEST_DIR if best else Path(self.config.out_dir)
        if self.world is not None:  # every rank its shard (or delta shard), rank 0 the manifest
            self.checkpointer.save(self.state, folder, self.position.step, best=best)
        elif best:  # the best evaluation's checkpoint: always whole, written inline
            state = self.state()
            bad = first_non_finite(state["model"])
            if bad is not None:
                raise TrainingStopped(f"parameter {bad} is not finite at step {self.position.step}; "
                                      f"not checkpointed, {self.checkpoint_note()}")
            folder.mkdir(exist_ok=True)
            save_checkpoint(folder / CHECKPOINT_NAME, state)
        else:  # a full checkpoint or a delta on the last one (`Checkpointer`)
            self.checkpointer.save(self.state(), self.model.embeddings)
        if not best:
            self._checkpointed = replace(self._saved_position())
        self._stalled(time.perf_counter() - t0, best=best)
        if self.hooks.on_checkpoint is not None:
            self.hooks.on_checkpoint(self.position.step, folder / CHECKPOINT_NAME)

    def _wait_checkpoints(self) -> None:
        """Wait for the background write in flight (the time training waits counts as checkpointing)."""
        t0 = time.perf_counter()
        self.checkpointer.wait()
        self._stalled(time.perf_counter() - t0, wait=True)

    def _note_saved(self) -> None:
        """A `saved` record (the checkpoint's step) once training sees that the writer thread has
        renamed a checkpoint into place: the proof `rundir.lost_checkpoint` reads when checkpoint.pt
        is gone later. The `checkpoint` record is written when the snapshot is taken, before the
        file lands. Its step is the checkpoint's, so a resume from it keeps it (`trim_metrics`)."""
        step = self.checkpointer.step
        if step is None or step == self._saved_step:
            return
        self._saved_step = step
        if self.log is not None:
            self.log.write({"event": "saved", "step": step})

    def _stalled(self, seconds: float, **kind: bool) -> None:
        """Count `seconds` training waited on a checkpoint (or, `wait`, on the writes in flight at
        the end). Each is listed in the end record; those taken while training runs also get a
        `checkpoint` record when they happen."""
        self.stage_seconds["checkpoint"] += seconds
        stall = {"step": self.position.step, "stall_s": seconds, **{k: v for k, v in kind.items() if v}}
        self.checkpoint_stalls.append(stall)
        if self.log is not None and self._training:
            self.log.write({"event": "checkpoint", **stall})

    def _write_run_files(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        write_text(out / "spec.json", json.dumps(to_dict(self.spec), indent=2, sort_keys=True) + "\n")
        if self.plan_document:
            write_text(out / "plan.json", self.plan_document)


def checked_horizon(source: Path, state: dict[str, Any]) -> int | None:
    """A checkpoint's schedule horizon (None in checkpoints of older runs); CheckpointError where
    it is not a step count (or the schedule's record is not a dict: a traceback before)."""
    schedule = state.get("schedule")
    if schedule is not None and not isinstance(schedule, dict):
        raise CheckpointError(f"{source} is damaged: schedule is a {type(schedule).__name__}, not the schedule's record")
    horizon = (schedule or {}).get("horizon_steps")
    if horizon is not None and (isinstance(horizon, bool) or not isinstance(horizon, int) or horizon < 0):
        raise CheckpointError(f"{source} is damaged: schedule horizon {horizon!r} is not a step count")
    return horizon


def check_optimizer_state(source: Path, optimizer: torch.optim.Optimizer, saved: Any) -> None:
    """A saved torch.optim state for the same parameters (count, and shapes of per-parameter tensors)."""
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) \
            or not isinstance(saved.get("param_groups"), list):
        raise CheckpointError(f"{source} is damaged: dense_optimizer is not an optimizer state")
    params = [p for group in optimizer.param_groups for p in group["params"]]
    ids = [i for group in saved["param_groups"] if isinstance(group, dict) for i in group.get("params", [])]
    if len(ids) != len(params):
        raise CheckpointError(f"{source} does not fit the spec's model: the dense optimizer holds "
                              f"{len(ids)} parameters, the model has {len(params)}")
    shapes = dict(zip(ids, (p.shape for p in params)))
    for index, entry in saved["state"].items():
        if index not in shapes or not isinstance(entry, dict):
            raise CheckpointError(f"{source} is damaged: dense optimizer state {index!r} has no parameter")
        for name, value in entry.items():
            if isinstance(value, torch.Tensor) and value.dim() and value.shape != shapes[index]:
                raise CheckpointError(f"{source} does not fit the spec's model: dense optimizer {name} "
                                      f"of parameter {index} is {tuple(value.shape)}, expected "
                                      f"{tuple(shapes[index])}")


class _Skipping:
    """Hot/cold batches from a position on; closing it closes the staging iterator."""

    def __init__(self, staged: Any, batches: Any) -> None:
        self._staged, self._batches = staged, batches

    def __iter__(self) -> Any:
        return self._batches

    def close(self) -> None:
        self._staged.close()


class GracefulInterrupt:
    """Within `with`: the first Ctrl-C, SIGTERM (what `kill`, `timeout` and schedulers send, and
    what torch's launcher forwards to every rank) or SIGHUP (a closed terminal; not where ignored,
    as under `nohup`) asks the loop to stop after the current step (so the checkpoint is
    consistent); a second one interrupts at once. Only in the main thread.

    Args:
        say: the first signal is also one line on stderr at once (one process, or rank 0 of a
            launch): `stop requested (SIGTERM): stopping after the current step; a second signal
            stops at once` (`finishing` names what is let finish).
        finishing: what the block lets finish before it stops (`stopping_after` changes it).
    """

    def __init__(self, say: bool = False, finishing: str = "the current step") -> None:
        self.requested = False
        self.say = say
        self.finishing = finishing
        self._previous: dict[int, Any] = {}
        self._signals: tuple[int, ...] = ()

    def stopping_after(self, finishing: str) -> "GracefulInterrupt":
        """This handler, its line naming `finishing` as what a first signal lets finish."""
        self.finishing = finishing
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        if self.say:
            say_stop_requested(signum, self.finishing)

    def __enter__(self) -> "GracefulInterrupt":
        self.requested = False
        self._signals = (signal.SIGINT, *stop_signals())  # read before this block's own handlers
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self._signals}
        return self

    def __exit__(self, *exc: Any) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous = {}

    @contextlib.contextmanager
    def at_once(self) -> Iterator[None]:
        """Within: Ctrl-C, SIGTERM or SIGHUP interrupts at once (a KeyboardInterrupt), for work after
        the last step (the final evaluation), which the run's last checkpoint follows; SIGTERM had
        ended the process there without it. Only in the main thread."""
        signals = self._signals or (signal.SIGINT, *stop_signals())
        with handlers_installed({sig: signal.default_int_handler for sig in signals}):
            yield


def say_stop_requested(signum: int, finishing: str) -> None:
    """The line a first stop signal gets at once, before the step (or what else `finishing` names)
    ends: `stop requested (Ctrl-C): stopping after the current step; a second signal stops at once`.
    Written from the signal handler: where the signal came inside a write to stderr (a reentrant
    write raises), straight to file descriptor 2."""
    name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
    line = f"stop requested ({name}): stopping after {finishing}; a second signal stops at once\n"
    try:
        sys.stderr.write(line)
        sys.stderr.flush()
    except (RuntimeError, OSError, ValueError, AttributeError):  # reentrant, closed or no sys.stderr
        with contextlib.suppress(OSError):
            os.write(2, line.encode())


def resume_state(run_dir: Path) -> dict[str, Any]:
    """Load and check the checkpoint of a run folder (`weights_only=True`)."""
    return load_checkpoint(Path(run_dir))
