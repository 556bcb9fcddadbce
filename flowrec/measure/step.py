"""Measure a spec's own model on this machine: its dense operators one by one, its whole training
steps, and what staging its batches costs a step (what `flowrec calibrate` prices a spec's dense
ops, its per-step framework cost and its staging rate from).

`op_seconds` times each dense operator module of the lowered plan (`lowering.lower`) on the very
inputs the runtime gives it (captured from a real dense forward at each batch size), forward and
forward + backward, as `flowrec.measure.calibrate.interleaved_seconds` times kernels.
`step_seconds` times real training steps (`step.train_step`, guarded as the trainer guards it,
the spec's dense optimizer, micro-batches as planned) on batches of synthetic rows staged
beforehand as the trainer stages them (the casting index included): the step's compute alone.
`managed_step_seconds` times training steps with what managed tables add to the trainer's step
beyond `train_step` (row resets, the replay of the data stage's map steps on the model's maps, on
the trainer's replay thread) and without, in alternating blocks.
`epoch_seconds` times whole epochs as the trainer runs them (a new batch pipeline each, the
trainer's staging options: `trainer_options`) beside the steps of one long epoch.
`staging_cpu_seconds` runs the trainer's batch pipeline alone
(`flowrec.data.batches.iterate_batches` over an encoded Parquet dataset: read, check, pack and
the casting index, in its threads) and returns its process CPU seconds per batch.

Example:
    >>> seconds = step_seconds(plan, spec, torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import statistics
import tempfile
import time
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, ParquetSource
from flowrec.data.synth import synth_dataset, synth_table
from flowrec.graph.kinds import HORIZON_WINDOWS, PLACEMENTS
from flowrec.measure import robust
from flowrec.runtime.hostmem import tune_host_allocator
from flowrec.runtime.lowering import LoweredModel, lower
from flowrec.runtime.managed_state import fresh_remapper
from flowrec.runtime.nonfinite import LossGuard
from flowrec.runtime.retrieval import batch_items, candidates, embed_step, item_labels
from flowrec.runtime.step import DEFAULT_LOOKAHEAD, autocast_context, make_dense_optimizer, train_step
from flowrec.runtime.trainer import TrainConfig
from flowrec.spec.model import ModelSpec
from operators.device import runtime_for

WARMUP_STEPS = 3  # first calls (allocations, lazy init) not timed
STEPS = 8  # timed steps per measurement; batches whose staging is timed
MORE_ROUNDS = 4  # a step measurement with too few clean rounds goes on up to this many times its steps
MORE_SECONDS = 1.0  # ... within this many seconds of timing

Measure = Callable[[Sequence[Callable[[], Any]]], list[float]]  # seconds per call of each


def with_batch(spec: ModelSpec, batch: int) -> ModelSpec:
    """`spec` with another training batch size."""
    return replace(spec, training=replace(spec.training, batch_size=batch))


def _options(spec: ModelSpec, plan: Any) -> StagingOptions:
    """The trainer's staging of training batches: its default workers and prefetch, and its
    lookahead (the casting index is computed in the data stage; the plan's window for lookahead
    placements)."""
    placements = {g.placement for g in plan.meta.groups}
    lookahead = max(DEFAULT_LOOKAHEAD, spec.plan.window if "lookahead" in placements else 0)
    return StagingOptions(batch_size=spec.training.batch_size, shuffle=True, seed=spec.training.seed,
                          drop_last=True, lookahead=lookahead)


def _staged(spec: ModelSpec, plan: Any, count: int) -> list[Any]:
    """`count` batches of synthetic rows at the spec's batch size in the plan's layout, staged now."""
    source = MemorySource([synth_table(spec, spec.training.batch_size * count)])
    with iterate_batches(spec, source, _options(spec, plan), 0, 0, tuple(plan.meta.groups),
                         remap=fresh_remapper(spec, tuple(plan.meta.groups))) as staged:
        return list(staged)


def _item_counts(model: LoweredModel, batches: Sequence[Any]) -> None:
    """A retrieval head's item frequencies from `batches`, as the trainer sets them from its data
    (the logQ correction and sampled negatives need them); nothing for other models."""
    binding = getattr(model, "retrieval", None)
    if binding is not None and binding.probs is None and batches:
        items = torch.cat([batch_items(binding, batch) for batch in batches])
        binding.set_counts(torch.bincount(items, minlength=binding.vocab + 1).numpy(), model.device)


def timed_steps(step: Callable[[Any], robust.Round], batches: Sequence[Any], steps: int,
                replay: bool) -> list[robust.Round]:
    """Rounds of `step` (one timed call on a batch) on `batches`: the first WARMUP_STEPS calls
    untimed (first-call set-up), then `steps` rounds; while fewer than `robust.MIN_CLEAN` of them
    are clean (a busy machine: the rounds other processes left alone are the measure), more,
    up to MORE_ROUNDS x `steps` rounds within MORE_SECONDS, the batches replayed in turn where
    `replay` allows it (`replayable`), else as far as they go."""
    for batch in batches[:WARMUP_STEPS]:
        step(batch)
    timed, out = batches[WARMUP_STEPS:], []
    started = time.perf_counter()
    while timed and (len(out) < steps or (sum(r.waited <= robust.CLEAN_SHARE * r.wall for r in out) < robust.MIN_CLEAN
                                          and len(out) < MORE_ROUNDS * steps
                                          and time.perf_counter() - started < MORE_SECONDS)):
        if len(out) >= len(timed) and not replay:
            break
        out.append(step(timed[len(out) % len(timed)]))
    return out


def replayable(plan: Any) -> bool:
    """Whether a staged batch may be stepped again: no group keeps a cache (a staged batch's cache
    plan follows the batches before it)."""
    return not any(PLACEMENTS[g.placement].cached for g in plan.meta.groups)


def _step_times(model: LoweredModel, spec: ModelSpec, plan: Any, batches: Sequence[Any],
                steps: int) -> list[robust.Round]:
    """Timed rounds (`timed_steps`) of a training step on `batches` (a fresh dense optimizer)."""
    opt = spec.dense_optimizer
    optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
    guarded, micro = LossGuard(model), int(plan.meta.micro_batches)

    def step(batch: Any) -> robust.Round:
        started = robust.CLOCK.start()
        train_step(guarded, optimizer, batch, micro, spec.training.precision, spec.training.clip_grad_norm)
        runtime_for(model.device).synchronize()
        return robust.CLOCK.stop(started)

    return timed_steps(step, batches, steps, replayable(plan))


def step_seconds(plan: Any, spec: ModelSpec, device: torch.device, steps: int = STEPS) -> list[robust.Round]:
    """Timed rounds (wall seconds, foreign run-queue wait: `flowrec.measure.robust`) of at least
    `steps` training steps of `plan` (after WARMUP_STEPS; more on a busy machine: `timed_steps`)
    on batches staged beforehand as the trainer stages them (the step's compute alone)."""
    tune_host_allocator()  # as the trainer does: the allocator's thresholds decide page faults
    model = lower(plan, spec, device)
    try:
        batches = _staged(spec, plan, WARMUP_STEPS + steps)
        _item_counts(model, batches)
        return _step_times(model, spec, plan, batches, steps)
    finally:
        model.close()


def dense_step_seconds(plan: Any, spec: ModelSpec, device: torch.device, steps: int = STEPS) -> list[robust.Round]:
    """Timed rounds (`flowrec.measure.robust`) of the dense part of at least `steps` training steps of `plan`
    (after WARMUP_STEPS; more on a busy machine: `timed_steps`):
    the dense forward, the loss, its backward down to the lookups (taken as leaves, looked up
    before the clock starts: the sparse side is not timed) and the dense optimizer step, with
    micro-batches as planned, on batches staged beforehand. A retrieval head's loss gets what
    `train_step` gives it: the items as labels, logQ and any sampled items' vectors."""
    tune_host_allocator()
    model = lower(plan, spec, device)
    try:
        opt = spec.dense_optimizer
        optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
        binding = getattr(model, "retrieval", None)
        micro = 1 if binding is not None else max(1, int(plan.meta.micro_batches))  # as `train_step`
        batches = _staged(spec, plan, WARMUP_STEPS + steps)
        _item_counts(model, batches)

        def step(batch: Any) -> robust.Round:
            # on the model's device as `train_step` moves them (the transfer is priced apart, not timed here)
            labels = item_labels(binding, batch, batch.labels).to(model.device)  # a retrieval head's loss: as `train_step`'s
            dense = batch.dense.to(model.device)
            with torch.no_grad():  # the lookups (and a sampled head's negatives' rows): not timed
                _, looked, negatives, neg_rows = embed_step(model, binding, batch)  # as `train_step`
            if neg_rows is not None:
                neg_rows = neg_rows.detach().requires_grad_(True)
            emb = {g: e.detach().requires_grad_(True) for g, e in looked.items()}
            masks = model.sequence_masks(batch)
            started = robust.CLOCK.start()
            optimizer.zero_grad(set_to_none=True)
            bounds = torch.linspace(0, dense.shape[0], micro + 1).round().long().tolist()
            for lo, hi in zip(bounds, bounds[1:]):
                with autocast_context(model.device, spec.training.precision):
                    logits = model.dense_forward(dense[lo:hi], {g: e[lo:hi] for g, e in emb.items()},
                                                 {k: m[lo:hi] for k, m in masks.items()})
                    cands = candidates(model, binding, negatives, neg_rows)  # logQ, sampled items' vectors
                model.loss(logits, labels[lo:hi], cands).backward()
            optimizer.step()
            runtime_for(model.device).synchronize()
            return robust.CLOCK.stop(started)

        return timed_steps(step, batches, steps, replayable(plan))
    finally:
        model.close()


def managed_step_seconds(plan: Any, spec: ModelSpec, device: torch.device, steps: int = STEPS, blocks: int = 1
                         ) -> tuple[list[robust.Round], list[robust.Round], float]:
    """(rounds with the managed tables' work, rounds without, managed lookups per batch) of
    `blocks` x `steps` training steps of `plan` (after WARMUP_STEPS) on batches staged beforehand
    in order: with, each step as the trainer's `Trainer._step` runs it (the reset of the rows the
    batch's eviction pass freed, `ManagedState.before_step`; `train_step`; the replay of the
    batch's map steps queued on the trainer's replay thread, `ManagedState.after_step`, which runs
    beside the following steps as in training); without, `train_step` alone on the same batches.
    The blocks alternate (without, with, without, with ...: a spell of the host's load falls on
    both kinds, not on one); the replay queue is emptied after each block with, outside its rounds,
    so that no replay runs into a block without. The difference is what managed tables add to the
    trainer's step on this machine: on the CPU the replay thread shares the cores and the
    interpreter lock with the step, as the data threads do, and a core it finds free hides its
    work (managed_movielens: a replay of 1.8 ms a batch run alone, steps with it no slower than
    without, round 19). ([], [], 0.0) without managed tables."""
    tune_host_allocator()
    model = lower(plan, spec, device)
    try:
        managed = getattr(model, "managed", None)
        if managed is None:
            return [], [], 0.0
        blocks = max(1, int(blocks))
        batches = _staged(spec, plan, WARMUP_STEPS + blocks * steps)
        _item_counts(model, batches)
        lookups = [float(b.managed.lookups) for b in batches[WARMUP_STEPS:] if b.managed is not None]
        opt = spec.dense_optimizer
        optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
        guarded, micro = LossGuard(model), int(plan.meta.micro_batches)
        clock = robust.SchedClock(exclude=robust.python_side_threads)  # the replay thread is the process's own

        def train(batch: Any) -> None:
            train_step(guarded, optimizer, batch, micro, spec.training.precision, spec.training.clip_grad_norm)

        def clocked(work: Callable[[], None]) -> robust.Round:
            started = clock.start()
            work()
            runtime_for(model.device).synchronize()
            return clock.stop(started)

        def plain(batch: Any) -> robust.Round:
            return clocked(lambda: train(batch))

        def with_managed(batch: Any) -> robust.Round:  # as `Trainer._step`
            return clocked(lambda: (managed.before_step(model.embeddings, batch), train(batch), managed.after_step(batch)))

        for batch in batches[:WARMUP_STEPS]:  # first-call set-up, the map's first batches in order
            plain(batch)
            with_managed(batch)
        managed.sync()
        timed, without, with_ = batches[WARMUP_STEPS:], [], []
        for block in range(blocks):
            chunk = timed[block * steps:(block + 1) * steps]
            without += [plain(batch) for batch in chunk]
            with_ += [with_managed(batch) for batch in chunk]
            managed.sync()
        return with_, without, statistics.mean(lookups) if lookups else 0.0
    finally:
        model.close()


def staging_cpu_seconds(spec: ModelSpec, plan: Any, batches: int = STEPS, runs: int = 1,
                        within_s: float = 0.0) -> list[tuple[float, float]]:
    """Per run: (process CPU seconds, ids and dense values) per batch of the trainer's batch
    pipeline run alone over `batches` + 1 batches of synthetic rows written once as an encoded
    Parquet dataset (the first batch, the epoch's start, not counted); a further run while fewer
    than `runs` were made and `within_s` seconds have not passed since the first started: on a
    machine whose cores the data threads share with the trainer, the compute time they take from
    its steps."""
    out: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory(prefix="flowrec-calibrate-") as tmp:
        data = Path(tmp) / "data"
        synth_dataset(spec, data, spec.training.batch_size * (batches + 1))
        source = ParquetSource(data)
        try:
            started = time.perf_counter()
            while not out or (len(out) < runs and time.perf_counter() - started < within_s):
                with iterate_batches(spec, source, _options(spec, plan), 0, 0, tuple(plan.meta.groups),
                                     remap=fresh_remapper(spec, tuple(plan.meta.groups))) as live:
                    first = next(iter(live))
                    cpu0, values = time.process_time(), [_values(first)]
                    values += [_values(b) for b in live]
                    cpu = time.process_time() - cpu0
                out.append((cpu / max(len(values) - 1, 1), statistics.mean(values)))
        finally:
            source.close()
    return out


def live_step_seconds(plan: Any, spec: ModelSpec, device: torch.device, steps: int = STEPS,
                      ready: Callable[[], None] | None = None, between: Callable[[], None] | None = None,
                      blocks: int = 1) -> tuple[list[robust.Round], list[robust.Round]]:
    """Timed rounds (`flowrec.measure.robust`) of `blocks` x `steps` training steps of `plan`
    (after WARMUP_STEPS) fed live by the trainer's batch pipeline over an encoded Parquet dataset
    of synthetic rows, its data threads running beside the steps as in training (their CPU time is
    the process's own: `robust.python_side_threads`), and as many on batches staged beforehand:
    (live, staged). The difference is what the data threads cost the steps on this machine: cores
    and the interpreter lock shared. The same model and optimizer step both kinds, in blocks of
    `steps` that alternate (staged, live, staged, live ...: a spell of the host's load falls on
    both kinds, not on one; the difference is a tenth of a short step, and a 10-step block of
    each moved it by more than itself, measured: managed_movielens's added time 0.14-0.44 ms in
    six calibrations back to back). The staged steps' warm-up runs before the pipeline opens; a
    later staged block starts with one untimed step, while the paused pipeline's threads finish
    filling its queue. `ready`, when given, is called before every block, everything set up, and
    `between` after every step, outside its round (`flowrec.measure.concurrent`: processes
    stepping at once meet in a barrier, then a collective after each step)."""
    tune_host_allocator()
    blocks = max(1, int(blocks))
    settle = 1  # untimed staged steps opening a block after the first
    quiet_count = WARMUP_STEPS + blocks * steps + (blocks - 1) * settle
    live_count = WARMUP_STEPS + blocks * steps
    with tempfile.TemporaryDirectory(prefix="flowrec-calibrate-") as tmp:
        data = Path(tmp) / "data"
        synth_dataset(spec, data, spec.training.batch_size * (live_count + 1))
        source = ParquetSource(data)
        model = lower(plan, spec, device)
        try:
            opt = spec.dense_optimizer
            optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
            guarded, micro = LossGuard(model), int(plan.meta.micro_batches)
            clock = robust.SchedClock(exclude=robust.python_side_threads)

            def timed(batch: Any) -> robust.Round:
                started = clock.start()
                train_step(guarded, optimizer, batch, micro, spec.training.precision, spec.training.clip_grad_norm)
                runtime_for(model.device).synchronize()
                done = clock.stop(started)
                if between is not None:
                    between()
                return done

            quiet_batches = _staged(spec, plan, quiet_count)
            _item_counts(model, quiet_batches)
            if ready is not None:
                ready()
            first = WARMUP_STEPS + steps
            quiet = [timed(batch) for batch in quiet_batches[:first]][WARMUP_STEPS:]
            live: list[robust.Round] = []
            with iterate_batches(spec, source, _options(spec, plan), 0, 0, tuple(plan.meta.groups),
                                 remap=fresh_remapper(spec, tuple(plan.meta.groups))) as pipeline:
                feed = iter(pipeline)
                for block in range(blocks):
                    if block:
                        if ready is not None:
                            ready()
                        for _ in range(settle):
                            timed(quiet_batches[first])
                            first += 1
                        quiet += [timed(batch) for batch in quiet_batches[first:first + steps]]
                        first += steps
                    if ready is not None:
                        ready()
                    rounds = [timed(next(feed)) for _ in range(steps + (WARMUP_STEPS if block == 0 else 0))]
                    live += rounds[WARMUP_STEPS:] if block == 0 else rounds
        finally:
            model.close()
            source.close()
    return live, quiet


def trainer_options(spec: ModelSpec, plan: Any) -> StagingOptions:
    """The staging of training batches as the trainer configures it by default (`Trainer.staging`
    with `TrainConfig`'s defaults): its packing workers (sized to the usable cores), the plan's
    prefetch depth (at least 2), the lookahead of `_options`, the last batch of an epoch kept, and
    a lookahead cache's horizon (`flowrec.graph.kinds.HORIZON_WINDOWS` windows)."""
    placements, config = {g.placement for g in plan.meta.groups}, TrainConfig()
    base = _options(spec, plan)
    return replace(base, workers=config.workers, drop_last=config.drop_last, prefetch=max(int(plan.meta.prefetch), 2),
                   horizon=HORIZON_WINDOWS * base.lookahead if "lookahead" in placements else 0)


def epoch_seconds(plan: Any, spec: ModelSpec, device: torch.device, batches: int, epochs: int
                  ) -> tuple[list[robust.Round], list[robust.Round], list[list[robust.Round]]]:
    """Timed rounds (`flowrec.measure.robust`) of whole epochs of `batches` batches as the trainer
    runs them, and of the same steps in the middle of one long epoch, interleaved: (epochs,
    steady steps, steps by position in their epoch).

    Each of the `epochs` epochs is one round from the moment the trainer opens its batch
    pipeline (`iterate_batches` at epoch e, batch 0, the trainer's staging options:
    `trainer_options`) to its last step done and the pipeline closed (joined), over an encoded
    Parquet dataset of `batches` batches of synthetic rows: the wait for its first batch, the
    steps beside the pipeline's start (its readers, shuffle and the next batches' packing on the
    data threads, which share the cores, the interpreter lock and the caches with the step), and
    the close. After each, `batches` steps of one pipeline over a dataset of `epochs` x `batches`
    batches opened beforehand (its start not timed), each step a round: the steady live step the
    staging rate is priced on (`live_step_seconds`). The same model and optimizer take every
    step, WARMUP_STEPS untimed steps on staged batches first."""
    tune_host_allocator()
    with tempfile.TemporaryDirectory(prefix="flowrec-calibrate-") as tmp:
        short, long = Path(tmp) / "epoch", Path(tmp) / "long"
        synth_dataset(spec, short, spec.training.batch_size * batches)
        synth_dataset(spec, long, spec.training.batch_size * batches * (epochs + 1))
        sources = ParquetSource(short), ParquetSource(long)
        model = lower(plan, spec, device)
        groups, options = tuple(plan.meta.groups), trainer_options(spec, plan)
        try:
            opt = spec.dense_optimizer
            optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
            guarded, micro = LossGuard(model), int(plan.meta.micro_batches)
            clock = robust.SchedClock(exclude=robust.python_side_threads)
            warm = _staged(spec, plan, WARMUP_STEPS)
            _item_counts(model, warm)

            def step(batch: Any) -> None:
                train_step(guarded, optimizer, batch, micro, spec.training.precision, spec.training.clip_grad_norm)
                runtime_for(model.device).synchronize()

            for batch in warm:
                step(batch)

            def timed(batch: Any) -> robust.Round:
                started = clock.start()
                step(batch)
                return clock.stop(started)

            whole, steady, by_position = [], [], [[] for _ in range(batches)]
            with iterate_batches(spec, sources[1], options, 0, 0, groups,
                                 remap=fresh_remapper(spec, groups)) as running:
                middle = iter(running)
                for epoch in range(epochs):
                    started = clock.start()
                    with iterate_batches(spec, sources[0], options, epoch, 0, groups,
                                         remap=fresh_remapper(spec, groups)) as pipeline:
                        for position, batch in enumerate(pipeline):
                            by_position[position].append(timed(batch))
                    whole.append(clock.stop(started))
                    steady += [timed(next(middle)) for _ in range(batches)]
        finally:
            model.close()
            for source in sources:
                source.close()
    return whole, steady, by_position


def _values(batch: Any) -> float:
    """Ids and dense values a batch carries."""
    return float(sum(g.ids.numel() for g in batch.groups.values()) + batch.dense.numel())


def op_seconds(plan: Any, spec: ModelSpec, device: torch.device, nodes: Sequence[str], batches: Sequence[int],
               measure: Measure) -> dict[str, list[tuple[int, float, float]]]:
    """Per dense node of `nodes` (and the loss node, when named): (batch, forward seconds,
    backward seconds) at each of `batches`, its operator module timed on the inputs the runtime
    gives it (the loss: the step's logits, labels and a retrieval head's candidates; the backward:
    forward + backward through autograd, minus the forward), under the spec's precision; every
    node and batch size in one interleaved measurement, so that a burst of other load slows one
    round of each rather than every round of one batch size."""
    tune_host_allocator()  # as the trainer does: the allocator's thresholds decide page faults
    model = lower(plan, spec, device)
    loss = next((n for n in nodes if plan.graph.nodes[n]["op"].kind == "loss"), None)
    try:
        points, runs = [], []
        for size in batches:
            sized = with_batch(spec, size)
            batch = _staged(sized, plan, 1)[0]
            _item_counts(model, [batch])
            captured = _captured_inputs(model, sized, batch, [n for n in nodes if n != loss])
            if loss is not None:
                captured[loss] = _loss_inputs(model, sized, batch)
            for name in nodes:
                module, args = model.loss if name == loss else model.ops[name], captured[name]
                points.append((name, size))
                runs += [partial(_forward, module, args, spec.training.precision, device),
                         partial(_forward_backward, module, args, spec.training.precision, device)]
        times = measure(runs)
    finally:
        model.close()
    out: dict[str, list[tuple[int, float, float]]] = {n: [] for n in nodes}
    for (name, size), fwd, both in zip(points, times[0::2], times[1::2]):
        out[name].append((size, fwd, max(both - fwd, fwd / 10)))  # a noisy difference
    return out


def _loss_inputs(model: LoweredModel, spec: ModelSpec, batch: Any) -> tuple:
    """The loss's inputs in a training step on `batch`, as `train_step` gives them: the dense
    forward's logits (a new leaf), the labels (a retrieval head's item ids in its column) and a
    retrieval head's candidates (logQ; sampled items' vectors, a new leaf: the step's backward
    computes their gradient, which goes on through the item tower, priced apart)."""
    binding = getattr(model, "retrieval", None)
    labels = item_labels(binding, batch, batch.labels).to(model.device)
    with torch.no_grad(), autocast_context(model.device, spec.training.precision):
        batch, emb, negatives, neg_rows = embed_step(model, binding, batch)
        logits = model.dense_forward(batch.dense.to(model.device), emb, model.sequence_masks(batch))
        cands = candidates(model, binding, negatives, neg_rows)
    if cands is not None and cands.vectors is not None:  # the step's backward reaches the sampled items' vectors
        cands = replace(cands, vectors=cands.vectors.detach().requires_grad_(True))
    return logits.detach().requires_grad_(True), labels, cands


def _captured_inputs(model: LoweredModel, spec: ModelSpec, batch: Any, nodes: Sequence[str]) -> dict[str, tuple]:
    """The positional inputs of each node's module in a real dense forward of `batch`, detached
    (those that needed a gradient as new leaves that do). Every module is called as such: an MLP
    that takes its gather's sources (`LoweredModel.source_mlps`) takes the gathered input here."""
    captured: dict[str, tuple] = {}

    def keep(name: str, module: torch.nn.Module, args: tuple) -> None:
        captured[name] = tuple(_leaf(a) for a in args)

    hooks = [model.ops[n].register_forward_pre_hook(partial(keep, n)) for n in nodes]
    model.fuse_sources = False
    try:
        dense = batch.dense.to(model.device)
        with autocast_context(model.device, spec.training.precision):
            model.dense_forward(dense, model.embed(batch), model.sequence_masks(batch))
    finally:
        model.fuse_sources = True
        for hook in hooks:
            hook.remove()
    return captured


def _leaf(value: Any) -> Any:
    if not isinstance(value, torch.Tensor):
        return value
    return value.detach().requires_grad_(True) if value.requires_grad else value.detach()


def _forward(module: torch.nn.Module, args: tuple, precision: str, device: torch.device) -> Any:
    with autocast_context(device, precision):
        return module(*args)


def _forward_backward(module: torch.nn.Module, args: tuple, precision: str, device: torch.device) -> Any:
    out = _forward(module, args, precision, device)
    leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad] + list(module.parameters())
    return torch.autograd.grad(out, leaves, torch.ones_like(out), allow_unused=True)
