"""The spec's own part of `flowrec calibrate`: its dense ops, its per-step framework cost, its
compute scale, its managed tables' own work, its staging rate and what an epoch's start costs it,
measured on its plan once the machine's constants are known.

Each measurement needs the ones before it in the profile: the dense ops are timed as whole
operator modules (`flowrec.measure.step.op_seconds`) at a few batch sizes (the cost
model interpolates between them); the framework cost is what real training steps at tiny batch sizes
(where the work terms nearly vanish) take beyond the prediction of the profile so far; the compute
scale is what real steps at the spec's batch size take beyond that fixed cost, over the work the
profile prices op by op (in a step the ops share caches, the allocator and the autograd engine); the staging rate is the values the trainer's batch
pipeline stages per CPU second (CPU only: there the data threads share the trainer's cores, so
their CPU time is taken from its steps; a GPU's host stages beside the device); an epoch's start is
what epochs run as the trainer runs them (a new batch pipeline each) take beyond as many steady
steps of one long epoch, of several batches and of one (CPU only, short steps only:
`_epoch_start_us`), and what those epochs' first steps, slowed beside the pipeline's start, move
their typical step by, by the epoch's length (`epoch_lean_us`, from the same epochs' steps).

One timing rule for every measurement (`flowrec.measure.robust.estimate`: the median of the
rounds other processes did not delay, else the median round less its wait), the rule
`tools/bench_costmodel.py` estimates a run's measured step by: a step measurement pools the
rounds of all its blocks into one estimate rather than keeping its fastest block. The fastest of
several medians is a lower bound (it keeps the quietest spell of a shared host, whose
neighbours' memory traffic slows a round without any run-queue wait), while the run it predicts
is measured at its median; calibrating by the fastest priced every step below its median.

Example:
    >>> measured, details = spec_constants(spec, torch.device("cpu"), measured, 0.5)  # doctest: +SKIP
"""
from __future__ import annotations

import json
import math
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from flowrec.graph.kinds import OP_KINDS
from flowrec.planner.calibration import profile_document
from flowrec.planner.cost import dense_seconds, dense_update_seconds, device_profile
from flowrec.planner.manager import make_plan
from flowrec.planner.op_work import op_signature
from flowrec.planner.targets import target_for_device
from flowrec.measure import robust
from flowrec.measure.calibrate import interleaved_seconds
from flowrec.measure.step import (dense_step_seconds, epoch_seconds, live_step_seconds, managed_step_seconds,
                                  op_seconds, staging_cpu_seconds, step_seconds, with_batch)
from flowrec.spec.model import ModelSpec
from operators.device import device_name

TINY_BATCHES = (16, 32, 64, 128)  # batch sizes of the framework-cost steps
TINY_STEPS = 12  # timed steps at each
TINY_REPEATS = 2  # times each batch size is measured (interleaved: a burst of load hits one, not all; round 28:
# 6 rounds within 3 s were no steadier over five A/B runs of 8 calibrations, sd ratio 0.54-1.53, geometric mean
# 0.95: the fixed cost's spread is the host's spells between the dense ops' timing and the tiny steps, not the count)
OP_BATCH_SHARES = (0, 4, 1)  # the dense ops' batch sizes: the smallest tiny batch, batch / 4, batch
FULL_STEPS = 8  # timed full-batch steps of the compute scale's first block ...
FULL_BLOCK_STEP_SECONDS = 0.4  # ... a further block's: about this many seconds of the first's steps ...
FULL_MAX_STEPS = 100  # ... in at most this many steps
FULL_BLOCKS = 5  # measurements of a dense part for the compute scale (their rounds pooled) ...
FULL_BLOCK_SECONDS = 3.0  # ... a further one while this many seconds have not passed
LIVE_STEPS = 10  # at least this many timed steps in a block fed live by the batch pipeline, and in one of
# staged batches (CPU: the staging rate) ...
STAGING_BLOCK_SECONDS = 0.4  # ... a block of about this many seconds of steps ...
STAGING_MAX_STEPS = 100  # ... in at most this many steps ...
STAGING_BLOCKS = 6  # ... and this many blocks of each kind, alternating (round 28, tools/bench_calibration_noise.py,
# 8 measurements of each, interleaved, six short specs: the sd of the added staging time with 3 blocks, then 6,
# 0.21-0.86 ms, then 0.16-0.82 ms, lower in 4, equal in 1, higher in 1; the range narrower in all 6) ...
STAGING_SECONDS = 6.0  # ... where their steps take up to this many seconds, fewer blocks for longer steps
STAGING_CPU_REPEATS = 3  # the pipeline's CPU seconds run alone, the least of up to this many runs ...
STAGING_CPU_SECONDS = 2.0  # ... started within this many seconds
STAGING_ADDED_MAX_CPU = 2.0  # what the data threads add to a step: at most this many times their CPU
# seconds per batch (a single slowed block made wide_deep's 62 ms against 9.3 ms of CPU, round 17)
EPOCH_BATCHES = 8  # batches of the epochs an epoch's start is measured on (CPU) ...
EPOCH_ROUNDS = (6, 10)  # ... and how many such epochs, and one-batch epochs
EPOCH_MAX_STEP_MS = 40.0  # measured only for live steps up to this long: the epochs take about 2 x 6 x 8
# of its steps (4 s at 40 ms, a calibration's budget), and the start's few ms are a few % of a longer step
COMPUTE_SCALE_RANGE = (0.1, 1000.0)  # a sanity bound: on a busy shared CPU every parallel region of a
# real step can wait for a time slice, and steps of a small model then take 100x their ops' fastest
# rounds (measured: a 1 ms step taking 130 ms under a load of 5 on 2 cores)


def spec_constants(spec: ModelSpec, device: torch.device, measured: dict[str, tuple[Any, str]],
                   seconds: float) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
    """({field: (value, how)}, details) of the spec's dense ops (`dense_ops`), framework cost
    (`step_us`), compute scale (`compute_scale`), managed tables' work (`managed_ns_per_id`, a spec
    with managed tables) and, on the CPU, staging rate (`staging_values_per_s`), on top of `measured` (the
    machine's constants), `seconds` per timed op point."""
    out: dict[str, tuple[Any, str]] = {}
    with tempfile.TemporaryDirectory(prefix="flowrec-profile-") as tmp:
        profile = Path(tmp) / "profile.json"

        def plan_for(batch: int) -> Any:
            _write(profile, device, {**measured, **out})
            return make_plan(with_batch(spec, batch), target=str(profile))

        ops, op_details = _dense_ops(spec, device, plan_for(spec.training.batch_size), seconds)
        if ops:
            out["dense_ops"] = (ops, f"each dense op's operator module and the loss on the inputs the runtime gives them, "
                                     f"forward and forward + backward (minus forward) at batch sizes "
                                     f"{_op_batches(spec)}, interleaved rounds (timing rule), none above a larger "
                                     f"batch's; linear between them")
        step_us, step_details = _framework_us(spec, device, plan_for)
        out["step_us"] = (step_us, f"median over {TINY_REPEATS} x {len(TINY_BATCHES)} measurements (batch sizes "
                                   f"{TINY_BATCHES}, interleaved) of real training steps (staged beforehand; "
                                   f"{TINY_STEPS} steps each, timing rule) minus the profile's prediction of "
                                   f"their compute: a robust fit of the fixed cost (spread in details)")
        scale, scale_details = _compute_scale(spec, device, plan_for, profile)
        out["compute_scale"] = (scale, f"dense part (forward, loss, backward to the lookups, dense update) of "
                                       f"real training steps at the spec's batch size (timing rule over the rounds of "
                                       f"up to {FULL_BLOCKS} measurements) less its fixed cost (the same at batch "
                                       f"{TINY_BATCHES[0]} beyond its priced ops: in step_us), over the profile's "
                                       f"prediction of it (the first block {FULL_STEPS} steps, a further one about "
                                       f"{FULL_BLOCK_STEP_SECONDS:g} s of them, blocks while {FULL_BLOCK_SECONDS:g} s "
                                       f"have not passed)")
        details: dict[str, Any] = {"dense_op_signatures": op_details, "framework_us_by_batch": step_details,
                                   "compute_scale": scale_details}
        managed = _managed_ns_per_id(spec, device, plan_for(spec.training.batch_size),
                                     scale_details.get("measured_dense_ms"))
        if managed is not None:
            out["managed_ns_per_id"] = (managed[0], "what the trainer's managed-table work (row resets, and the replay "
                                                    "of the data stage's map steps on the model's maps on its replay "
                                                    "thread, beside the following steps) adds to real training steps "
                                                    "at the spec's batch size: steps with it minus the same steps "
                                                    "without (timing rule over alternating blocks of each, sized as "
                                                    "the staging rate's), per managed lookup; at least 0")
            details["managed"] = managed[1]
        if device.type == "cpu":
            rate, staging_details = _staging_rate(spec, device, plan_for(spec.training.batch_size),
                                                  scale_details.get("measured_dense_ms"))
            out["staging_values_per_s"] = (rate, "ids and dense values staged per second the trainer's batch "
                                                 "pipeline (Parquet read, checks, packing, casting index, in its "
                                                 "threads beside the steps) adds to real training steps at the "
                                                 "spec's batch size: live steps minus the same steps on batches "
                                                 "staged beforehand (timing rule over alternating blocks of each, "
                                                 f"up to {STAGING_BLOCKS} of up to {STAGING_MAX_STEPS} steps), per "
                                                 "batch; at least a tenth of the pipeline's CPU seconds per batch "
                                                 f"(the least of up to {STAGING_CPU_REPEATS} runs)")
            details["staging"] = staging_details
            starts, start_details = _epoch_start_us(spec, device, plan_for(spec.training.batch_size),
                                                    staging_details["live_step_ms"])
            how = (f"what an epoch of {{}} as the trainer runs it (its batch pipeline opened, the wait for its first "
                   f"batch, its steps beside the pipeline's start, the pipeline closed) takes beyond as many steady "
                   f"live steps of one long epoch, interleaved; timing rule over {{}} epochs and over the steady "
                   f"steps; at least 0; measured for live steps up to {EPOCH_MAX_STEP_MS:g} ms (else 0: not priced)")
            out["epoch_start_us"] = (starts[0], how.format(f"{EPOCH_BATCHES} batches", EPOCH_ROUNDS[0]))
            out["epoch_single_us"] = (starts[1], how.format("one batch", EPOCH_ROUNDS[1]))
            out["epoch_lean_us"] = (start_details.get("lean_us", [0.0] * EPOCH_BATCHES), (
                f"for an epoch of n = 1 .. {EPOCH_BATCHES} batches as the trainer runs it, the timing rule over the "
                f"steps at its positions 0 .. n-1 (of {EPOCH_ROUNDS[0]} epochs of {EPOCH_BATCHES} batches; n = 1: "
                f"of {EPOCH_ROUNDS[1]} one-batch epochs) less that over the steps of the second half of the "
                f"{EPOCH_BATCHES}-batch epochs (mid-epoch steps); at least 0; what an epoch's start moves the "
                f"typical step of such epochs by; measured for live steps up to {EPOCH_MAX_STEP_MS:g} ms (else 0)"))
            details["epoch_start"] = start_details
    return out, details


def _write(path: Path, device: torch.device, measured: dict[str, tuple[Any, str]]) -> None:
    doc = profile_document(target_for_device(device.type, device_name(device)), measured, "calibrating", "now")
    path.write_text(json.dumps(doc), encoding="utf-8")


def _op_batches(spec: ModelSpec) -> list[int]:
    batch = spec.training.batch_size
    sizes = [TINY_BATCHES[0] if share == 0 else max(1, batch // share) for share in OP_BATCH_SHARES]
    return sorted(set(sizes))


def _dense_ops(spec: ModelSpec, device: torch.device, plan: Any, seconds: float
               ) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """{op signature: [batch, forward us, backward us] at each of `_op_batches`}, {node: signature}:
    every dense op and the loss (a retrieval head's softmax over the batch is most of a step)."""
    signatures: dict[str, str] = {}
    for node, signature in dense_signatures(plan.graph, spec.training.precision):
        if signature not in signatures.values():
            signatures[node] = signature
    nodes = list(signatures)
    if not nodes:
        return {}, {}

    def measure(runs):
        return interleaved_seconds(runs, device, seconds * len(runs))

    timings = op_seconds(plan, spec, device, nodes, _op_batches(spec), measure)
    ops = {signatures[node]: [x for b, f, bw in monotone(points) for x in (float(b), f * 1e6, bw * 1e6)]
           for node, points in timings.items()}
    return ops, signatures


def dense_signatures(graph: Any, precision: str) -> list[tuple[str, str]]:
    """(node, op signature) of every dense op and the loss of `graph`, in graph order: what the
    profile's `dense_ops` table is keyed by (`op_signature`)."""
    out = []
    for node in graph:
        op = graph.nodes[node]["op"]
        if OP_KINDS[op.kind].role in ("dense", "loss"):
            out.append((node, op_signature(op, graph.in_degree(node), precision)))
    return out


def monotone(points: list[tuple[int, float, float]]) -> list[tuple[int, float, float]]:
    """(batch, forward, backward) points with no time above a larger batch's: an op does not get
    slower on fewer samples, so such a point was slowed by other load (on a shared CPU a parallel
    region waits for its threads' time slices whatever its size) and takes the larger batch's time.

    Example:
        >>> monotone([(16, 5.0, 1.0), (1024, 2.0, 4.0), (4096, 8.0, 9.0)])
        [(16, 2.0, 1.0), (1024, 2.0, 4.0), (4096, 8.0, 9.0)]
    """
    out, fwd, bwd = [], float("inf"), float("inf")
    for batch, f, b in sorted(points, reverse=True):
        fwd, bwd = min(f, fwd), min(b, bwd)
        out.append((batch, fwd, bwd))
    return out[::-1]


def _framework_us(spec: ModelSpec, device: torch.device, plan_for, rounds: int = TINY_REPEATS
                  ) -> tuple[float, dict[str, Any]]:
    """The per-step fixed cost (us, at least 0) fitted over `rounds` rounds of TINY_BATCHES
    (`robust.fit_offset`: the median of the steps' leftovers beyond their predicted compute;
    each step timed by the timing rule), and the raw points with the fit's spread."""
    rounds = max(1, int(rounds))
    plans = {batch: plan_for(batch) for batch in TINY_BATCHES}
    measured, predicted, points = [], [], []
    for _ in range(rounds):
        for batch, plan in plans.items():
            stages = dict(plan.cost.stage_ms)
            predicted_ms = plan.cost.step_ms_serial - stages["staging"] - stages["transfer"]
            isolated = robust.LOG.add(robust.estimate(step_seconds(plan, with_batch(spec, batch), device,
                                                                   TINY_STEPS)))
            measured_ms = isolated.seconds * 1e3  # the machine's, not its neighbours' load
            measured.append(measured_ms * 1e3)
            predicted.append(predicted_ms * 1e3)
            points.append({"batch": batch, "measured_ms": measured_ms, "predicted_ms": predicted_ms,
                           "leftover_us": (measured_ms - predicted_ms) * 1e3, "clean_steps": isolated.clean,
                           "method": isolated.method})
    fit = robust.fit_offset(measured, predicted)
    return max(0.0, fit.value), {"points": points, "rounds": rounds,
                                 "fit": {"step_us": fit.value, "spread_us": fit.spread, "low_us": fit.low,
                                         "high_us": fit.high, "points": fit.points, "outliers": fit.outliers}}


def _compute_scale(spec: ModelSpec, device: torch.device, plan_for, profile: Path
                   ) -> tuple[float, dict[str, Any]]:
    """The dense part of the spec's real full-batch steps, less its own fixed cost, over the
    profile's prediction of it (dense forward and backward op by op, the dense update), within
    COMPUTE_SCALE_RANGE; raw. Only the dense side: it runs the same whatever the placements, so
    the scale holds for a plan with another device budget (the sparse side's cost depends on them
    and is priced as such). The fixed cost is what the dense part of steps at the smallest tiny
    batch takes beyond its priced ops: the framework cost (`step_us`, fitted on whole tiny steps)
    holds it already, and a scale over it would count it twice (a 1.8 ms step priced 2.8 ms).
    Each dense part is the timing rule over the rounds of up to FULL_BLOCKS measurements, the two
    batch sizes' measurements interleaved (`_dense_ms_pair`): the scale rests on their difference,
    and a spell of load schedstat does not show (a neighbour's memory traffic) that slowed only
    the tiny batch's measurements moved it by a third (two_tower_ctr_movielens's scale 1.05, then
    0.69: batch 16's dense part 1.00, then 1.60 ms, for 1.94 and 1.95 ms at its batch of 1,024).

    The scale is the steps over the table as measured, with no correction for the host's drift
    between the two (round 19). An earlier round timed the measured ops again just before and after
    the steps and divided their ratio to the table out of the scale (wide_1000, rounds 11-13: its
    scale moved 0.995 .. 1.183 over four calibrations). Over 60 calibrate-then-run pairs of rounds
    14-18 the same calibrations priced their run better without that division in 41 pairs and
    worse in 19 (mean |error| 0.090 against 0.108; of the 17 pairs whose probes moved more than 5 %,
    13 better, mean 0.097 against 0.139): this host's speed moves within a second (30-step blocks
    of one step, back to back, 13.4 .. 20.3 ms), so probes a few seconds from the steps measured
    another spell, not the steps' own. The time the probes took goes to longer step blocks
    (`_dense_ms_pair`), which average the fast moves out."""
    plan = plan_for(spec.training.batch_size)  # writes `profile` as measured so far
    priced = device_profile(str(profile))
    work_ms = _dense_work_ms(plan, spec, priced)
    tiny = with_batch(spec, TINY_BATCHES[0])
    tiny_plan = plan_for(TINY_BATCHES[0])
    tiny_work_ms = _dense_work_ms(tiny_plan, tiny, priced)
    (timed, measured_ms), (tiny_timed, tiny_ms) = _dense_ms_pair((plan, spec), (tiny_plan, tiny), device)
    fixed_ms = max(0.0, tiny_ms - tiny_work_ms)
    low, high = COMPUTE_SCALE_RANGE
    scale = min(high, max(low, (measured_ms - fixed_ms) / work_ms)) if work_ms > 0 else 1.0
    return scale, {"measured_dense_ms": measured_ms, "predicted_dense_ms": work_ms,
                   "clean_steps": timed.clean, "rounds": timed.rounds, "method": timed.method,
                   "tiny_batch": TINY_BATCHES[0], "tiny_measured_dense_ms": tiny_ms,
                   "tiny_predicted_dense_ms": tiny_work_ms, "fixed_ms": fixed_ms,
                   "tiny_method": tiny_timed.method}


def _dense_work_ms(plan: Any, spec: ModelSpec, priced: Any) -> float:
    """The profile's prediction (ms) of the dense part of a step of `plan`: the dense ops forward
    and backward on each micro-batch, and the dense update."""
    graph, batch, micro = plan.graph, spec.training.batch_size, max(1, int(plan.meta.micro_batches))
    forward, backward = dense_seconds(graph, priced, -(-batch // micro), spec.training.precision == "bf16",
                                      spec.training.precision)
    return ((forward + backward) * micro + dense_update_seconds(graph, spec, priced)) * 1e3


def _dense_ms_pair(first: tuple[Any, ModelSpec], second: tuple[Any, ModelSpec], device: torch.device
                   ) -> tuple[tuple[robust.Estimate, float], tuple[robust.Estimate, float]]:
    """(estimate, ms) of the dense part of real steps (`dense_step_seconds`) of two (plan, spec)
    pairs, each by the timing rule over the rounds of up to FULL_BLOCKS measurements pooled, the
    two measured in turn (first, second, first, ...; a further pair while FULL_BLOCK_SECONDS have
    not passed): the blocks spread the rounds over time, so that a burst of load schedstat does
    not show (a neighbour's memory traffic on a shared host) slows a minority of them and falls on
    both batch sizes alike, and each median is taken as the benchmark takes a run's (the module
    docstring: the fastest block would be a lower bound). The first block is of FULL_STEPS steps;
    a further one of about FULL_BLOCK_STEP_SECONDS of the first's median step (`block_steps`), so
    that a short step is measured on as many seconds as the benchmark's run of it, not on a
    quarter of one: this host's speed moves by a fifth within a second (round 19)."""
    started, rounds = time.perf_counter(), ([], [])
    steps = FULL_STEPS
    for block in range(FULL_BLOCKS):
        for (plan, spec), out in zip((first, second), rounds):
            out += dense_step_seconds(plan, spec, device, steps)
        if time.perf_counter() - started > FULL_BLOCK_SECONDS:
            break
        if block == 0:  # the further blocks sized by the first's steps
            steps = block_steps(statistics.median(r.wall for r in rounds[0]))
    ests = [robust.LOG.add(robust.estimate(r)) for r in rounds]
    return (ests[0], ests[0].seconds * 1e3), (ests[1], ests[1].seconds * 1e3)


def block_steps(step_seconds: float) -> int:
    """Steps of a further compute-scale block for a step of about `step_seconds`: about
    FULL_BLOCK_STEP_SECONDS of them, FULL_STEPS to FULL_MAX_STEPS.

    Example:
        >>> block_steps(0.02), block_steps(0.001), block_steps(1.4), block_steps(0.0)
        (20, 100, 8, 100)
    """
    if not step_seconds > 0:
        return FULL_MAX_STEPS
    return min(FULL_MAX_STEPS, max(FULL_STEPS, math.ceil(FULL_BLOCK_STEP_SECONDS / step_seconds)))


def _managed_ns_per_id(spec: ModelSpec, device: torch.device, plan: Any, step_ms: float | None = None
                       ) -> tuple[float, dict[str, Any]] | None:
    """(ns per managed lookup, raw) of what a batch's managed tables add to the trainer's step
    beyond `train_step` (`managed_step_seconds`: steps with the row resets and the map replay as
    the trainer runs them minus the same steps without, in alternating blocks sized for a step of
    about `step_ms` as the staging rate's are, `staging_plan`; by the timing rule; at least 0), or
    None for a spec without managed tables. Every other step measurement runs `train_step` alone,
    so without this term the plan of a spec with managed tables priced none of it
    (managed_movielens: 0.34 ms of replay a batch of 2,048 managed lookups, its step
    under-predicted by 0.12-0.17). The replay run alone is not what it adds: the trainer queues it
    on a thread of its own that runs beside the next steps (round 19: 1.8 ms a batch alone,
    priced so, over-predicted managed_movielens's step in all five pairs, +0.11 .. +0.38)."""
    if not any(t.managed is not None for t in spec.tables):
        return None
    blocks, steps = staging_plan(step_ms)
    with_, without, lookups = managed_step_seconds(plan, spec, device, steps, blocks)
    if not with_ or lookups <= 0:
        return None
    est, base = robust.LOG.add(robust.estimate(with_)), robust.LOG.add(robust.estimate(without))
    added = max(0.0, est.seconds - base.seconds)
    return added / lookups * 1e9, {"ms_per_batch": added * 1e3, "with_ms": est.seconds * 1e3,
                                   "without_ms": base.seconds * 1e3, "lookups_per_batch": lookups,
                                   "blocks": blocks, "steps_per_block": steps, "clean_steps": est.clean,
                                   "method": est.method, "without_method": base.method}


def staging_plan(step_ms: float | None, most_blocks: int = STAGING_BLOCKS) -> tuple[int, int]:
    """(blocks, steps per block) of the live and staged steps the staging rate is measured on
    (`live_step_seconds`), for a step of about `step_ms` (None: not known): a block of about
    STAGING_BLOCK_SECONDS of steps (LIVE_STEPS to STAGING_MAX_STEPS of them), `most_blocks`
    blocks of each kind where they fit in STAGING_SECONDS, fewer for long steps (at least one).
    The added time is a tenth of a short step or less: a short step needs hundreds of steps of
    each kind for its difference to stand above the noise, a long step's share is small anyway.

    Example:
        >>> staging_plan(4.0), staging_plan(70.0), staging_plan(1700.0), staging_plan(None)
        ((6, 100), (4, 10), (1, 10), (1, 10))
    """
    if step_ms is None or not step_ms > 0:
        return 1, LIVE_STEPS
    steps = min(STAGING_MAX_STEPS, max(LIVE_STEPS, math.ceil(STAGING_BLOCK_SECONDS * 1e3 / step_ms)))
    blocks = min(most_blocks, max(1, int(STAGING_SECONDS * 1e3 // (2 * steps * step_ms))))
    return blocks, steps


def _staging_rate(spec: ModelSpec, device: torch.device, plan: Any, step_ms: float | None = None,
                  most_blocks: int = STAGING_BLOCKS) -> tuple[float, dict[str, Any]]:
    """Values staged per second the data threads add to a real step (live steps minus staged
    ones, in alternating blocks sized by the step's `step_ms`: `staging_plan`, `live_step_seconds`;
    at least a tenth of the pipeline's CPU seconds per batch run alone, the least of up to
    STAGING_CPU_REPEATS runs within STAGING_CPU_SECONDS, over one dataset: a sanity bound on a difference of two
    timings, which one slowed run made 10x a short step's, measured; and at most
    STAGING_ADDED_MAX_CPU times those CPU seconds), raw. The data threads share the trainer's cores
    and its interpreter lock: what they cost a step is measured, not assumed to be their CPU time.
    But they cannot cost it much more than the time they hold a core or the lock: a long step's
    one live and one staged block (`staging_plan`) on a noisy host differed by 62 ms of a 400 ms
    wide_deep step against 9.3 ms of the pipeline's CPU a batch (AVX2 VM, round 17; 2.1-6.7x over
    five specs there, at most 1.7x over 19 specs on a quieter host in round 15), and priced the
    step 25% high."""
    cpu_runs = staging_cpu_seconds(spec, plan, runs=STAGING_CPU_REPEATS, within_s=STAGING_CPU_SECONDS)
    cpu_s, values = min(cpu_runs)
    blocks, steps = staging_plan(step_ms, most_blocks)
    live, staged = (robust.LOG.add(robust.estimate(r))
                    for r in live_step_seconds(plan, spec, device, steps, blocks=blocks))
    added = min(max(live.seconds - staged.seconds, cpu_s / 10, 1e-6), STAGING_ADDED_MAX_CPU * cpu_s)
    return values / added, {"cpu_ms_per_batch": cpu_s * 1e3, "values_per_batch": values,
                            "cpu_ms_per_batch_runs": [c * 1e3 for c, _ in cpu_runs],
                            "blocks": blocks, "steps_per_block": steps,
                            "live_step_ms": live.seconds * 1e3, "staged_step_ms": staged.seconds * 1e3,
                            "added_ms_per_batch": added * 1e3, "live_method": live.method,
                            "staged_method": staged.method}


def _epoch_start_us(spec: ModelSpec, device: torch.device, plan: Any, live_ms: float
                    ) -> tuple[tuple[float, float], dict[str, Any]]:
    """((us an epoch of EPOCH_BATCHES batches costs beyond its steady steps, the same of a
    one-batch epoch), raw), measured on the trainer's own epoch path (`epoch_seconds`); (0, 0)
    where the live step is above EPOCH_MAX_STEP_MS. The trainer opens a new batch pipeline for
    every epoch: it waits for the first batch (nothing staged it ahead), the pipeline's start (its
    readers, shuffle, the next batches' packing) takes the cores, the interpreter lock and the
    caches from the epoch's first steps, and closing it joins its threads. Measured here
    (movielens, one compute thread on 2 cores, 40 epochs of 8 batches against one long epoch,
    interleaved): the first step +1.8 ms, the second +0.4, the third +0.2 of 3.6 ms steps, and
    5.8 ms waited for the first batch; the steady steps no slower than the long epoch's.
    A one-batch epoch stages its batch while the step waits, with nothing left to stage beside
    it: it is measured apart, not as a share of a longer epoch's start."""
    if live_ms > EPOCH_MAX_STEP_MS:
        return (0.0, 0.0), {"not_measured": f"live step {live_ms:.1f} ms > {EPOCH_MAX_STEP_MS:g} ms"}
    values, details, positions = [], {}, []
    for batches, rounds in zip((EPOCH_BATCHES, 1), EPOCH_ROUNDS):
        whole, steady, by_position = epoch_seconds(plan, spec, device, batches, rounds)
        positions.append(by_position)
        epoch, step = (robust.LOG.add(robust.estimate(r)) for r in (whole, steady))
        extra = max(0.0, epoch.seconds - batches * step.seconds)
        values.append(extra * 1e6)
        details[f"batches_{batches}"] = {
            "epoch_ms": epoch.seconds * 1e3, "steady_step_ms": step.seconds * 1e3, "extra_ms": extra * 1e3,
            "step_ms_by_position": [robust.estimate(r).seconds * 1e3 for r in by_position],
            "epochs": len(whole), "methods": [epoch.method, step.method]}
    details["lean_us"] = epoch_lean_us(positions[0], positions[1][0])
    return (values[0], values[1]), details


def epoch_lean_us(by_position: list[list[robust.Round]], single: list[robust.Round]) -> list[float]:
    """For an epoch of n = 1 .. len(by_position) batches, us its start moves the typical step of
    such epochs by: the timing rule over the rounds of positions 0 .. n-1 of the epochs measured
    by position (`epoch_seconds`; n = 1: the `single` rounds of one-batch epochs, measured apart)
    less the timing rule over the rounds of their second half (mid-epoch steps, which the step's
    other constants price); at least 0 (a faster start is noise, not a saving).

    The trainer opens a new batch pipeline for every epoch, and its first steps run beside the
    pipeline's start (its readers, shuffle and packing on the data threads, which take the cores
    and the interpreter lock: measured on custom_module's 1.4 ms step, 5-7 voluntary context
    switches in each of an epoch's first two steps against under 0.5 mid-epoch); a run's typical
    step, the timing rule's median over all its steps, then sits above the mid-epoch step by an
    amount that depends on the slowed steps' share of an epoch, measured here for each length.

    Args:
        by_position: per position of an epoch, that position's rounds over the epochs measured.
        single: the rounds of one-batch epochs' steps.

    Returns:
        len(by_position) values, us (the n-th: an epoch of n batches).

    Example:
        >>> r = lambda *ms: [robust.Round(m * 1e-3) for m in ms]
        >>> epoch_lean_us([r(3, 3), r(2, 2), r(1, 1), r(1, 1)], r(4, 4))
        [3000.0, 1500.0, 1000.0, 500.0]
    """
    mid = robust.estimate([r for p in by_position[len(by_position) // 2:] for r in p]).seconds
    out = [max(0.0, robust.estimate(list(single)).seconds - mid) * 1e6]
    for n in range(2, len(by_position) + 1):
        out.append(max(0.0, robust.estimate([r for p in by_position[:n] for r in p]).seconds - mid) * 1e6)
    return out
