"""A spec's steps on N processes stepping at once: what ranks sharing this host's cores cost each other.

`flowrec train --nproc N` on a machine whose host is the device (the CPU) runs N processes, each
with compute threads sized to its share of the cores (`flowrec.data.cores.thread_budget`): together
they fill the cores. What one process measures alone then misses two things: the ranks' compute
shares memory bandwidth and caches (a rank's step at half the batch measured 0.65-0.8 of one
process's full-batch step on this 2-core machine, not half), and their data threads find no free
core (one process with one compute thread on two cores leaves them one).

`flowrec calibrate SPEC --nproc N` measures both on the spec's own model: N local processes (gloo
only for a start barrier and to gather the results, no collective in the timed steps) each plan
the spec at its per-rank batch B / N against the profile measured so far, then run
`flowrec.measure.step.live_step_seconds` at the same moment (a barrier before the staged steps and
again before the live ones): steps on batches staged beforehand, then steps fed live by the
trainer's batch pipeline with its data threads. Each phase is estimated by the timing rule
(`flowrec.measure.robust`); the slowest rank's estimate counts (the ranks of a run meet in every
step's collectives). Then

    rank_compute_scale        = slowest staged step / the profile's price of that step alone
    rank_staging_values_per_s = values a batch stages / (slowest live step - slowest staged step)
    rank_collective_us        = the slowest process's median small all_reduce after each step,
                                the second of two back to back (the first is where they meet)
    rank_skew_us              = the slowest process of each live step (timing rule over those
                                steps) less the slowest process's own live estimate

After each step (outside its timing) the processes meet in a small all_reduce, as a run's ranks
meet in their step's first collective, and then call a second: idle processes (the collective
calibration's) answer a call in about 0.1-0.2 ms, processes whose compute and data threads fill
the cores only when the scheduler runs the peer's communication thread. The first call's time is
mostly the wait for the slower rank to end its step (the ranks' skew: 1.5-4.1 ms per call on this
2-core host in round 9); priced per call, it was counted once for every collective of a step
(movielens: 20 ms of calls against a whole measured step of 10.7 ms), while a run's ranks wait
for each other once a step, in its first collective, and its slowest rank's step (the staged
estimate the compute scale takes) already holds that. The second call is the cost of each call
of ranks that are together (`meet_us`, the first, is kept in the details). What the slowest
rank's typical step leaves out is that a step lasts as long as the slowest rank *of that step*:
each rank records its live steps (`live_steps_ms`) and the meeting calls (`live_meets_us`), rank 0
gathers them, and `rank_skew_ms` prices the difference, once per step (the details also keep
`last_meet_us`: per step the meeting call of the rank that came last, which waited for no one).
The cost model multiplies a rank's compute by the first, prices its staging by the second, each
collective call by the third (`flowrec.planner.cost.shared_cores`) and adds the fourth once per
step (`flowrec.planner.cost.rank_skew_seconds`).

A pair of idle calls after a step does not price a call inside one (round 11: 0.45 ms in some
calibrations, 1.4-3.8 ms in others, while the runs' steps left 1.0-3.2 ms per call): there a call
costs what the scheduler gives the peer's communication thread while both ranks' compute and
data threads are busy. So the processes then step the spec's world-size plan itself, as a run's
ranks do (`sharded_steps`: its tables sharded, DDP over the dense part, the loss agreement; each
rank's slice of every global batch fed live by the batch pipeline), timed as the benchmark times
a run's step, and

    rank_step_call_us         = (slowest process of each sharded step - slowest process of each
                                 one-process live step above - the exchange's bytes at the
                                 measured link) / the plan's collective calls per step
                                (`in_step_call`; at least the idle call, `collective_us`)

which the cost model prices each call by instead of the third (`flowrec.planner.cost.step_call_us`).

That price is fitted at the world-size plan's own call count; a plan of the spec with other calls
(another device budget: a small group replicated, one call a step, instead of row-wise, four) was
priced by proportion, unchecked. So where another budget shards the spec with a different call
count (`other_layout`: the default budget where one was given, else a small one), the processes
step that plan too, and the two sharded steps give two measurements of the same two unknowns:

    sharded step - one-process step - exchange bytes = rank_step_fixed_us + calls x rank_step_per_call_us

(`call_fit`), which the cost model prices a plan's exchange by (`flowrec.planner.cost.step_call_fit`)
in place of the lumped price, where the fit is exact (`fitted_constants`: two plans whose steps
differ by more than their calls explain keep the lumped price).

Example:
    >>> ranks = [{"staged_ms": 6.0, "live_ms": 7.0, "call_us": 900.0}, {"staged_ms": 5.0, "live_ms": 5.5, "call_us": 300.0}]
    >>> rank_constants(ranks, 4.0, 1000.0)[:3]
    (1.5, 1000000.0, 900.0)
"""
from __future__ import annotations

import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

SCALE_RANGE = (0.1, 1000.0)  # a sanity bound, as calibration's compute scale
MIN_ADDED_S = 1e-6  # staging that adds nothing measurable to a step: this many seconds a batch
PHASE_SECONDS = 1.0  # timed seconds of each phase (staged, live), about ...
STEPS_RANGE = (10, 40)  # ... within these many steps
GROUP_TIMEOUT_S = 300  # the start barriers wait for every process's set-up (synthetic data, lowering)
TIMEOUT_S = 900  # the whole measurement
OTHER_BUDGETS = (None, "16MiB")  # budgets tried, in order, for a second layout (None: the default budget)
ALTERNATIONS = 2  # blocks of each layout's sharded steps, in turn (A, B, A, B), where a second layout is stepped
MORE_BLOCKS = 4  # blocks of sharded steps at most, while their slowest rank of each step has too few clean rounds
SHARDED_SECONDS = 2.0  # timed seconds of a layout's sharded steps at least, each time it is stepped (the slowest
SHARDED_BLOCKS = 16  # rank of each step, summed): more blocks while fewer, up to these many (`sharded_limit`)
CALL_BYTES = 2**14  # bytes per rank of the collective timed after each step (the calibration's smallest)
JOB_FILE = "flowrec-concurrent-{port}.json"  # in the temporary folder: what the processes run


class ConcurrentError(RuntimeError):
    """The concurrent measurement could not run (one line naming the rank and why)."""


def rank_skew_ms(ranks: list[list[list[float]]]) -> tuple[float, dict[str, float]]:
    """(skew, details) of the ranks' live steps, each rank's `[wall ms, foreign wait ms]` per step
    (steps of the same index start together: the ranks meet after each): the timing rule's
    estimate (`flowrec.measure.robust`) over the slowest rank's round of each step, less the
    slowest of the ranks' own estimates, at least 0. A run's ranks meet in every step's
    collectives, so its step is the slowest rank's each step (how `tools/bench_costmodel.py`
    measures it), while the compute and staging constants take the slowest rank's own typical
    step: the skew is what a step costs beyond that, once per step whatever its calls. Steps one
    rank lacks (the ranks stopped apart) are left out.

    Raises:
        ValueError: fewer than two ranks, or no step every rank has.

    Example:
        >>> rank_skew_ms([[[4.0, 0.0], [3.0, 0.0], [3.0, 0.0]], [[3.0, 0.0], [4.0, 0.0], [3.0, 0.0]]])[0]
        1.0
    """
    from flowrec.measure import robust

    steps = min((len(r) for r in ranks), default=0)
    if len(ranks) < 2 or steps == 0:
        raise ValueError(f"need the steps of two ranks or more (got {len(ranks)} ranks, {steps} common steps)")
    own = [robust.estimate(robust.Round(wall, waited) for wall, waited in r[:steps]) for r in ranks]
    slowest = robust.estimate(robust.Round(*max((r[i] for r in ranks), key=lambda wq: wq[0]))
                              for i in range(steps))
    each = max(e.seconds for e in own)
    return max(0.0, slowest.seconds - each), {"slowest_per_step_ms": slowest.seconds, "slowest_rank_ms": each,
                                              "steps": steps, "slowest_per_step_clean": slowest.clean}


def rank_constants(results: list[dict[str, Any]], priced_ms: float, values: float
                   ) -> tuple[float, float, float, dict[str, Any]]:
    """(rank_compute_scale, rank_staging_values_per_s, rank_collective_us, details) of the ranks'
    `results` (each {"staged_ms", "live_ms", "call_us"}: its estimates, its median collective
    call; with "live_steps_ms", every live step's [wall ms, wait ms], the details hold the ranks'
    skew, `rank_skew_ms`, as "skew_ms"), the profile's price of one such step alone
    (`priced_ms`, its compute) and the values one batch stages (see the module docstring).

    Raises:
        ValueError: no results, or no price to scale.
    """
    if not results or priced_ms <= 0:
        raise ValueError(f"need rank results and a positive price (got {len(results)} results, {priced_ms} ms)")
    staged = max(r["staged_ms"] for r in results)
    live = max(r["live_ms"] for r in results)
    low, high = SCALE_RANGE
    scale = min(high, max(low, staged / priced_ms))
    added_s = max((live - staged) * 1e-3, MIN_ADDED_S)
    call_us = max(r["call_us"] for r in results)
    details = {"staged_ms": staged, "live_ms": live, "priced_ms": priced_ms, "call_us": call_us,
               "added_ms_per_batch": added_s * 1e3, "values_per_batch": values, "ranks": results}
    if len(results) > 1 and all(r.get("live_steps_ms") for r in results):
        details["skew_ms"], details["skew"] = rank_skew_ms([r["live_steps_ms"] for r in results])
    if len(results) > 1 and all(r.get("live_meets_us") for r in results):
        meets = list(zip(*(r["live_meets_us"] for r in results)))
        details["last_meet_us"] = statistics.median(min(m) for m in meets)  # the call of the rank that came last
    return scale, values / added_s, call_us, details


def slowest_per_step_ms(ranks: list[list[list[float]]]) -> tuple[float, int]:
    """(ms, clean rounds) of the timing rule's estimate (`flowrec.measure.robust`) over the slowest
    rank's round of each step, each rank's `[wall ms, foreign wait ms]` per step (steps one rank
    lacks are left out): how `tools/bench_costmodel.py` measures a run's step.

    Raises:
        ValueError: no step every rank has.

    Example:
        >>> slowest_per_step_ms([[[4.0, 0.0], [3.0, 0.0], [3.0, 0.0]], [[3.0, 0.0], [5.0, 0.0], [3.0, 0.0]]])
        (4.0, 3)
    """
    from flowrec.measure import robust

    steps = min((len(r) for r in ranks), default=0)
    if steps == 0:
        raise ValueError(f"need steps of every rank (got {len(ranks)} ranks, {steps} common steps)")
    slowest = robust.estimate(robust.Round(*max((r[i] for r in ranks), key=lambda wq: wq[0])) for i in range(steps))
    return slowest.seconds, slowest.clean


def step_call_us(sharded_ms: float, unsharded_ms: float, bytes_ms: float, calls: int, floor_us: float = 0.0) -> float:
    """Microseconds a collective call costs inside the ranks' own steps: what the world-size plan's
    sharded step (`sharded_ms`, its real collectives: the exchange, the dense gradients'
    all-reduce, the loss agreement) takes beyond the same ranks' one-process step at their batch
    (`unsharded_ms`, both the slowest rank of each step by the timing rule) and beyond its
    exchange's bytes at the measured link (`bytes_ms`), per call of the plan (`calls`); at least
    `floor_us` (the idle processes' call, `collective_us`: a call never costs less).

    Raises:
        ValueError: no calls to divide by.

    Example:
        >>> step_call_us(20.0, 10.0, 1.0, 6), step_call_us(9.0, 10.0, 1.0, 6, floor_us=120.0)
        (1500.0, 120.0)
    """
    if calls <= 0:
        raise ValueError(f"a sharded step without collective calls (got {calls})")
    return max(floor_us, (sharded_ms - unsharded_ms - bytes_ms) * 1e3 / calls)


def in_step_call(results: list[dict[str, Any]], details: dict[str, Any], calls: int, bytes_ms: float,
                 floor_us: float = 0.0) -> dict[str, Any] | None:
    """What a collective call costs inside the ranks' steps (`step_call_us`, as "call_us") and what
    it comes from, of the ranks' `results` (each with "sharded_steps_ms": its steps of the
    world-size plan, `sharded_steps`) beside `details` of `rank_constants` (the one-process step
    of each step, "skew"'s "slowest_per_step_ms", else the slowest rank's "live_ms"); the plan's
    `calls` and `bytes_ms` (`sharded_plan_collectives`) and the idle call `floor_us`. None where
    the ranks did not step the sharded plan (one rank, or a spec with managed tables).

    Example:
        >>> ranks = [{"sharded_steps_ms": [[9.0, 0.0]] * 3}, {"sharded_steps_ms": [[10.0, 0.0]] * 3}]
        >>> in_step_call(ranks, {"live_ms": 4.0}, 4, 2.0)["call_us"]
        1000.0
    """
    if len(results) < 2 or not all(r.get("sharded_steps_ms") for r in results):
        return None
    in_step_ms, clean = slowest_per_step_ms([r["sharded_steps_ms"] for r in results])
    unsharded_ms = details["skew"]["slowest_per_step_ms"] if "skew" in details else details["live_ms"]
    return {"call_us": step_call_us(in_step_ms, unsharded_ms, bytes_ms, calls, floor_us),
            "sharded_step_ms": in_step_ms, "sharded_clean": clean, "unsharded_step_ms": unsharded_ms,
            "bytes_ms": bytes_ms, "calls": calls, "floor_us": floor_us}


def call_fit(first: dict[str, Any], second: dict[str, Any], floor_us: float = 0.0) -> dict[str, Any]:
    """The sharded step's part per step and per call ("fixed_us", "per_call_us") fitted on two
    plans of one spec with different call counts, each an `in_step_call` result (what its sharded
    step takes beyond the one-process step and its exchange's bytes, "sharded_step_ms" -
    "unsharded_step_ms" - "bytes_ms", over its "calls"): two measurements, two unknowns, so the
    first plan's step is reproduced and the second's too. A call never costs less than the idle
    call `floor_us`, nor a step's fixed part less than nothing: a fit beyond those keeps the call
    at `floor_us` and the fixed part the two plans' mean rest, or (a negative fixed part) fits
    the calls alone through zero (least squares); "how" says which.

    Raises:
        ValueError: plans of the same call count (nothing to split).

    Example:
        >>> a = {"sharded_step_ms": 20.0, "unsharded_step_ms": 10.0, "bytes_ms": 1.0, "calls": 6}
        >>> b = {"sharded_step_ms": 16.0, "unsharded_step_ms": 10.0, "bytes_ms": 1.5, "calls": 3}
        >>> fit = call_fit(a, b)
        >>> round(fit["fixed_us"], 6), round(fit["per_call_us"], 6), fit["how"]
        (0.0, 1500.0, 'exact')
    """
    c1, c2 = first["calls"], second["calls"]
    if c1 == c2:
        raise ValueError(f"two plans of {c1} calls each: no per-call part to fit")
    rest = [(p["sharded_step_ms"] - p["unsharded_step_ms"] - p["bytes_ms"]) * 1e3 for p in (first, second)]
    per_call = (rest[0] - rest[1]) / (c1 - c2)
    fixed = rest[0] - c1 * per_call
    how = "exact"
    if per_call < floor_us:
        per_call, how = floor_us, "per call at the idle call"
        fixed = max(0.0, (rest[0] - c1 * per_call + rest[1] - c2 * per_call) / 2)
    elif fixed < 0:
        per_call = max(floor_us, (rest[0] * c1 + rest[1] * c2) / (c1 * c1 + c2 * c2))
        fixed, how = 0.0, "calls alone (the fixed part came out negative)"
    return {"fixed_us": fixed, "per_call_us": per_call, "how": how, "rest_us": rest, "calls": [c1, c2],
            "floor_us": floor_us}


def other_layout(spec: Any, profile: str, world_size: int, device_budget: str | None, calls: int
                 ) -> tuple[str | None, int, float] | None:
    """(budget, calls, bytes ms) of a second plan of `spec` for `world_size` ranks whose call count
    differs from the calibrated plan's (`calls`, under `device_budget`): the first of OTHER_BUDGETS
    (the default budget, where small groups are replicated, then a small one, where every group is
    row-wise) other than `device_budget` that shards it otherwise (`sharded_plan_collectives`);
    None where every one shards it with the same calls (a spec whose groups are too large to
    replicate: every plan of it at this world size has those calls)."""
    for budget in OTHER_BUDGETS:
        if budget == device_budget:
            continue
        other_calls, bytes_ms = sharded_plan_collectives(spec, profile, world_size, budget)
        if other_calls != calls:
            return budget, other_calls, bytes_ms
    return None


def sharded_limit(steps: int, live_ms: float) -> int:
    """Sharded steps one layout's block may take at most, in blocks of `steps`: MORE_BLOCKS blocks,
    or, for a spec whose one-process step (`live_ms`, the ranks' live phase) is short, as many as
    SHARDED_SECONDS of such steps, up to SHARDED_BLOCKS blocks. A sharded step is no shorter than
    the one-process step, so that many are always enough to reach SHARDED_SECONDS.

    Example:
        >>> sharded_limit(20, 3.4), sharded_limit(20, 10.0), sharded_limit(20, 60.0)
        (320, 200, 80)
    """
    wanted = -(-math.ceil(SHARDED_SECONDS * 1e3 / max(live_ms, 1e-3)) // steps) * steps
    return max(MORE_BLOCKS * steps, min(SHARDED_BLOCKS * steps, wanted))


def more_sharded_steps(ranks: list[list[list[float]]], steps: int, limit: int | None = None) -> bool:
    """Whether the ranks step another block of `steps` sharded steps, given every rank's rounds so
    far (`[wall ms, foreign wait ms]` each), up to `limit` steps (default MORE_BLOCKS blocks):
    while the slowest rank of each step has fewer than `robust.MIN_CLEAN` clean rounds (a busy
    machine: the timing rule would otherwise take each round less its wait, which for ranks that
    wait for each other in every call is not what a run's step shows), as calibration's other
    step timings go on (`flowrec.measure.step.timed_steps`), and while they have taken less than
    SHARDED_SECONDS. A short step's sharded steps spread by half their median from one step to
    the next (movielens with 2 ranks: 5-22 ms around 10): 40 steps a layout, 13 of them clean,
    priced its exchange 0.12-0.15 above the runs' steps (Round 59). Every rank decides on the
    same gathered rounds.

    Example:
        >>> busy, quiet = [[[10.0, 5.0]] * 8] * 2, [[[300.0, 0.0]] * 8] * 2
        >>> more_sharded_steps(busy, 8), more_sharded_steps(quiet, 8), more_sharded_steps([[[10.0, 5.0]] * 32] * 2, 8)
        (True, False, False)
        >>> short, timed = [[[10.0, 0.0]] * 8] * 2, [[[10.0, 0.0]] * 200] * 2
        >>> more_sharded_steps(short, 8), more_sharded_steps(short, 8, 8), more_sharded_steps(timed, 8, 400)
        (True, False, False)
    """
    from flowrec.measure import robust

    limit = MORE_BLOCKS * steps if limit is None else limit
    done = min(len(r) for r in ranks)
    if done >= limit:
        return False
    if slowest_per_step_ms(ranks)[1] < robust.MIN_CLEAN:
        return True
    timed_ms = sum(max(r[i][0] for r in ranks) for i in range(done))
    return timed_ms < SHARDED_SECONDS * 1e3


def sharded_steps(spec: Any, profile: str, world_size: int, rank: int, steps: int,
                  ready: Callable[[], None], device_budget: str | None = None,
                  limit: int | None = None) -> list[list[float]]:
    """This rank's `[wall ms, foreign wait ms]` of `steps` steps of the world-size plan of `spec`
    (at its global batch, planned against `profile` under `device_budget` for `world_size` ranks,
    as the runs plan it: sharded tables, DDP
    over the dense part, the per-step loss agreement) after WARMUP_STEPS, each as a run's rank
    steps (`train_step` with its `DenseParallel`) on its slice of the global batches fed live by
    the trainer's batch pipeline over synthetic rows, timed as `tools/bench_costmodel.py` times a
    run's step (`robust.SchedClock`, the data threads the run's own), more blocks of `steps` while
    too few rounds are clean or too few seconds timed, up to `limit` steps (`more_sharded_steps`;
    default MORE_BLOCKS blocks). The process group is initialized (gloo);
    `ready` is called once everything is set up (the ranks meet there).

    Raises:
        ConcurrentError: a spec with managed tables (their maps are stepped by the data stage's own
            groups, which this measurement does not set up).
    """
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from flowrec.data.batches import iterate_batches
    from flowrec.data.dataset import ParquetSource
    from flowrec.data.synth import synth_dataset
    from flowrec.measure import robust
    from flowrec.measure.step import WARMUP_STEPS, _item_counts, _options
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.distributed.data_parallel import DenseParallel
    from flowrec.runtime.distributed.groups import embedding_group
    from flowrec.runtime.distributed.world import World
    from flowrec.runtime.hostmem import tune_host_allocator
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.step import make_dense_optimizer, train_step
    from operators.device import runtime_for

    if any(t.managed is not None for t in spec.tables):
        raise ConcurrentError(f"rank {rank}: the sharded steps of a spec with managed tables are not measured")
    tune_host_allocator()
    device = torch.device("cpu")
    plan = make_plan(spec, target=profile, world_size=world_size, device_budget=device_budget)
    world = World(world_size, rank, embedding_group(GROUP_TIMEOUT_S), GROUP_TIMEOUT_S, device)
    limit = MORE_BLOCKS * steps if limit is None else limit
    total = WARMUP_STEPS + limit
    with tempfile.TemporaryDirectory(prefix="flowrec-concurrent-") as tmp:
        data = Path(tmp) / "data"
        synth_dataset(spec, data, spec.training.batch_size * (total + 1))
        source = ParquetSource(data)
        model = lower(plan, spec, device, world=world)
        try:
            opt = spec.dense_optimizer
            optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
            parallel = DenseParallel(model, world)
            micro = int(plan.meta.micro_batches)
            clock = robust.SchedClock(exclude=robust.python_side_threads)
            options = replace(_options(spec, plan), world_size=world_size, rank=rank)
            out: list[list[float]] = []
            with iterate_batches(spec, source, options, 0, 0, tuple(plan.meta.groups)) as pipeline:
                batches = iter(pipeline)
                first = [next(batches) for _ in range(WARMUP_STEPS)]
                _item_counts(model, first)

                def step(batch: Any) -> list[float]:
                    started = clock.start()
                    train_step(model, optimizer, batch, micro, spec.training.precision,
                               spec.training.clip_grad_norm, parallel)
                    runtime_for(device).synchronize()
                    done = clock.stop(started)
                    return [done.wall * 1e3, done.waited * 1e3]

                ready()
                for batch in first:
                    step(batch)
                while True:
                    out += [step(next(batches)) for _ in range(steps)]
                    gathered: list[Any] = [None] * world_size
                    dist.all_gather_object(gathered, out)  # outside the timing: every rank decides alike
                    if not more_sharded_steps(gathered, steps, limit):
                        break
        finally:
            model.close()
            source.close()
    return out


def meet_then_call(collective: Callable[[], Any], clock: Callable[[], float] = time.perf_counter
                   ) -> tuple[float, float]:
    """(seconds of the first, of the second) of two `collective` calls back to back: in the first
    the ranks meet (it waits for the slowest to end its step: their skew), the second is a call of
    ranks already together, what each further collective of a step costs (`rank_collective_us`).

    Example:
        >>> ticks = iter([0.0, 5.0, 6.0])
        >>> meet_then_call(lambda: None, lambda: next(ticks))
        (5.0, 1.0)
    """
    started = clock()
    collective()
    met = clock()
    collective()
    return met - started, clock() - met


def phase_steps(priced_ms: float) -> int:
    """Timed steps of each phase: about PHASE_SECONDS of the priced step, within STEPS_RANGE."""
    low, high = STEPS_RANGE
    return int(min(high, max(low, math.ceil(PHASE_SECONDS * 1e3 / max(priced_ms, 1e-3)))))


def measure_ranks(spec_path: Path, profile: Path, world_size: int, batch: int, steps: int,
                  timeout_s: float = TIMEOUT_S, device_budget: str | None = None,
                  other: dict[str, Any] | None = None) -> list[dict[str, float]]:
    """Start `world_size` processes that step the spec at `batch` samples each at once (see the
    module docstring), planned against `profile`; each rank's estimates. `other` ({"device_budget":
    B}): the ranks also step the world-size plan under budget B (`other_sharded_steps_ms`).

    Raises:
        ConcurrentError: a process failed or they did not finish within `timeout_s`.
    """
    from flowrec.runtime.distributed.launch import free_port, run_local_ranks

    port = free_port()
    job = Path(tempfile.gettempdir()) / JOB_FILE.format(port=port)
    job.write_text(json.dumps({"spec": str(spec_path), "profile": str(profile), "batch": batch, "steps": steps,
                               "device_budget": device_budget, "other": other}))
    try:
        outputs = run_local_ranks("flowrec.measure.concurrent", "gloo", world_size, port, timeout_s)
    except subprocess.TimeoutExpired:
        raise ConcurrentError(f"steps of {world_size} processes at once: no result within {timeout_s:g} s") from None
    finally:
        job.unlink(missing_ok=True)
    for rank, (code, _, err) in enumerate(outputs):
        if code != 0:
            last = err.splitlines()[-1] if err else f"exit {code}"
            raise ConcurrentError(f"steps of {world_size} processes at once, rank {rank} failed: {last}")
    return json.loads(outputs[0][1].splitlines()[-1])


def shared_core_constants(spec_path: Path, spec: Any, world_size: int, measured: dict[str, tuple[Any, str]],
                          device_budget: str | None = None) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
    """({field: (value, how)}, details) of `rank_compute_scale`, `rank_staging_values_per_s`,
    `rank_collective_us`, `rank_skew_us` and `rank_step_call_us`: `world_size` processes step the
    spec (loaded from `spec_path`) at B / `world_size` samples each at once, priced by the profile
    `measured` so far (the machine's constants and the spec's own), then the spec's world-size plan
    (under `device_budget`, as the runs plan it) with its collectives (`in_step_call`; not for a
    spec with managed tables).

    Raises:
        ConcurrentError: the processes failed (see `measure_ranks`).
    """
    import torch

    from flowrec.measure.spec import _write
    from flowrec.measure.step import with_batch
    from flowrec.planner.manager import make_plan

    batch = -(-spec.training.batch_size // world_size)
    with tempfile.TemporaryDirectory(prefix="flowrec-profile-") as tmp:
        profile = Path(tmp) / "profile.json"
        _write(profile, torch.device("cpu"), measured)
        cost = make_plan(with_batch(spec, batch), target=str(profile)).cost
        stages = dict(cost.stage_ms)
        priced_ms = cost.step_ms_serial - stages["staging"] - stages["transfer"]
        sharded = sharded_plan_collectives(spec, str(profile), world_size, device_budget)
        other = (other_layout(spec, str(profile), world_size, device_budget, sharded[0])
                 if not any(t.managed is not None for t in spec.tables) else None)
        results = measure_ranks(spec_path, profile, world_size, batch, phase_steps(priced_ms), device_budget=device_budget,
                                other={"device_budget": other[0]} if other is not None else None)
    scale, rate, call_us, details = rank_constants(results, priced_ms, statistics.median(r["values_per_batch"] for r in results))
    how = (f"{world_size} processes at once on this host, each the spec's training steps at batch {batch} "
           f"(B / {world_size}, its compute threads as `flowrec train --nproc {world_size}` sizes them), staged "
           f"then fed live by the batch pipeline (timing rule, slowest process)")
    constants = {
        "rank_compute_scale": (scale, how + ": its staged step over the profile's price of it alone"),
        "rank_staging_values_per_s": (rate, how + ": values a batch stages per second the live steps take beyond "
                                                  "the staged ones"),
        "rank_collective_us": (call_us, how + f": the median all_reduce of {CALL_BYTES >> 10} KiB right after the "
                                              f"one in which the ranks meet after each step (the meeting's wait is "
                                              f"their skew, which `rank_skew_us` prices), slowest process"),
        "rank_skew_us": (details.get("skew_ms", 0.0) * 1e3,
                         how + ": the timing rule over the slowest process's live step of each step (the ranks "
                               "meet after each) less the slowest process's own estimate: what a run's step costs "
                               "beyond its slowest rank's typical step, once per step")}
    step_call = in_step_call(results, details, *sharded, float(measured.get("collective_us", (0.0, ""))[0] or 0.0))
    if step_call is not None:
        details["step_call"] = step_call
        constants["rank_step_call_us"] = (
            step_call["call_us"],
            f"{world_size} processes at once on this host, each a rank of the world-size plan's real step (the "
            f"spec at batch {spec.training.batch_size}, its tables sharded, DDP over the dense part, the loss "
            f"agreement: {step_call['calls']} collective calls a step), its slice of each global batch fed live "
            f"by the batch pipeline; the slowest process of each step (timing rule) less the same processes' "
            f"one-process step at batch {batch} (its slowest of each step) less the exchange's bytes at the "
            f"measured link, per call (at least collective_us)")
    fitted = two_plan_fit(results, details, step_call, other, float(measured.get("collective_us", (0.0, ""))[0] or 0.0))
    if fitted is not None:
        details["step_call_other"], details["call_fit"] = fitted
        both = (f"{world_size} processes at once on this host, each a rank of two plans of the spec for "
                f"{world_size} ranks (budget {device_budget or 'default'}: {fitted[1]['calls'][0]} collective calls "
                f"a step; budget {other[0] or 'default'}: {fitted[1]['calls'][1]}), their real sharded steps fed "
                f"live; per plan the slowest process of each step (timing rule) less the one-process step at batch "
                f"{batch} less the exchange's bytes at the measured link; two plans, two unknowns")
        constants.update(fitted_constants(fitted[1], both))
    return constants, details


def fitted_constants(fit: dict[str, Any], how: str) -> dict[str, tuple[float, str]]:
    """The profile constants of a two-plan `call_fit` (`rank_step_fixed_us`, `rank_step_per_call_us`,
    each with `how`), only where the fit is exact: two plans whose steps differ by more than their
    calls can explain (the plan with fewer calls no cheaper by at least an idle call a call, or a
    negative fixed part) differ by more than their calls (round 13: two_tower_movielens's replicated
    plan, 3 calls fewer, stepped 2.9 ms slower in one calibration and 0.8 ms faster in another), and
    a split of them would misprice the calibrated plan itself; the lumped price per call
    (`rank_step_call_us`) then prices the spec's plans, the fit stays in the details.

    Example:
        >>> exact = {"fixed_us": 2900.0, "per_call_us": 880.0, "how": "exact"}
        >>> sorted(fitted_constants(exact, "two plans")), fitted_constants({**exact, "how": "per call at the idle call"}, "")
        (['rank_step_fixed_us', 'rank_step_per_call_us'], {})
    """
    if fit["how"] != "exact":
        return {}
    return {"rank_step_fixed_us": (fit["fixed_us"], how + ": the part per step"),
            "rank_step_per_call_us": (fit["per_call_us"], how + ": the part per call (at least collective_us)")}


def two_plan_fit(results: list[dict[str, Any]], details: dict[str, Any], first: dict[str, Any] | None,
                 other: tuple[str | None, int, float] | None, floor_us: float
                 ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """(the second plan's `in_step_call`, `call_fit` of both) of the ranks' `results` (each with
    "other_sharded_steps_ms": their steps of the `other` plan, (budget, calls, bytes ms) from
    `other_layout`) beside the calibrated plan's `first`; None where either plan was not stepped.

    Example:
        >>> ranks = [{"sharded_steps_ms": [[12.0, 0.0]] * 3, "other_sharded_steps_ms": [[9.0, 0.0]] * 3}] * 2
        >>> first = in_step_call(ranks, {"live_ms": 4.0}, 6, 1.0)
        >>> second, fit = two_plan_fit(ranks, {"live_ms": 4.0}, first, (None, 3, 1.0), 0.0)
        >>> round(fit["per_call_us"], 6), round(fit["fixed_us"], 6), second["calls"]
        (1000.0, 1000.0, 3)
    """
    if first is None or other is None or not all(r.get("other_sharded_steps_ms") for r in results):
        return None
    moved = [{"sharded_steps_ms": r["other_sharded_steps_ms"]} for r in results]
    second = in_step_call(moved, details, other[1], other[2], floor_us)
    if second is None:
        return None
    second["device_budget"] = other[0]
    return second, call_fit(first, second, floor_us)


def alternated(first: Callable[[], list], second: Callable[[], list], blocks: int = ALTERNATIONS
               ) -> tuple[list, list]:
    """(rounds of `first`, rounds of `second`), each measured in `blocks` blocks taken in turn
    (first, second, first, ...) and pooled. The two layouts' difference is what `call_fit` splits
    into a part per step and a part per call: measured one after the other, a shared host's drift
    between them moved the split from one calibration to the next (two_tower_movielens: 8.73 ms a
    step + 0.34 a call, then a plan with fewer calls slower, then 5.50 + 0.94); in turn, a drift
    falls on both.

    Example:
        >>> seen = []
        >>> alternated(lambda: seen.append("a") or [1], lambda: seen.append("b") or [2], 2), seen
        (([1, 1], [2, 2]), ['a', 'b', 'a', 'b'])
    """
    a: list = []
    b: list = []
    for _ in range(blocks):
        a += first()
        b += second()
    return a, b


def sharded_plan_collectives(spec: Any, profile: str, world_size: int, device_budget: str | None = None
                             ) -> tuple[int, float]:
    """(collective calls a step, ms of its exchange's bytes at the measured link) of the world-size
    plan of `spec` (under `device_budget`, as the runs plan it) priced against `profile`
    (`flowrec.planner.cost.step_collectives`)."""
    from flowrec.planner.cost import device_link, device_profile, step_collectives
    from flowrec.planner.manager import make_plan

    plan = make_plan(spec, target=profile, world_size=world_size, device_budget=device_budget)
    calls, sent = step_collectives(plan.graph, spec)
    link = device_link(device_profile(profile), world_size)
    return calls, sent / (link.gbps * 1e9) * 1e3


def worker(rank: int, world_size: int, port: int) -> list[dict[str, float]] | None:
    """One process: the spec's staged then live steps at its batch, at the same moment as the
    others (gloo barriers); every rank's estimates on rank 0, None on the others."""
    job = json.loads((Path(tempfile.gettempdir()) / JOB_FILE.format(port=port)).read_text())
    os.environ["LOCAL_WORLD_SIZE"] = str(world_size)  # the data threads size themselves as in a launch
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from flowrec.data.cores import thread_budget
    from flowrec.measure import robust
    from flowrec.measure.step import WARMUP_STEPS, _staged, _values, live_step_seconds, with_batch
    from flowrec.planner.manager import make_plan
    from flowrec.spec import load_spec

    if "OMP_NUM_THREADS" not in os.environ:  # as `flowrec train --nproc` sizes a rank's compute threads
        torch.set_num_threads(thread_budget(ranks=world_size).compute)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        full = load_spec(Path(job["spec"]))  # the world-size plan's real step runs at its global batch
        spec = with_batch(full, int(job["batch"]))
        plan = make_plan(spec, target=job["profile"])
        device = torch.device("cpu")
        calls: list[float] = []
        meets: list[float] = []
        payload = torch.rand(CALL_BYTES // 4)

        def call() -> None:  # after each step: where the ranks meet, then a call of ranks together
            meet_s, call_s = meet_then_call(lambda: dist.all_reduce(payload))
            meets.append(meet_s)
            calls.append(call_s)

        phases: list[int] = []

        def ready() -> None:  # the phases start together; the live phase's calls are a run's
            phases.append(len(calls))
            dist.barrier()

        rounds = live_step_seconds(plan, spec, device, int(job["steps"]), ready=ready, between=call)
        live, staged = (robust.estimate(r) for r in rounds)
        warm = WARMUP_STEPS
        staged_calls, live_calls = calls[phases[0] + warm:phases[1]], calls[phases[1] + warm:]
        live_rounds, _ = rounds
        mine = {"staged_ms": staged.seconds * 1e3, "live_ms": live.seconds * 1e3,
                "live_steps_ms": [[r.wall * 1e3, r.waited * 1e3] for r in live_rounds],
                "live_meets_us": [m * 1e6 for m in meets[phases[1] + warm:]],
                "call_us": statistics.median(live_calls) * 1e6,
                "meet_us": statistics.median(meets[phases[1] + warm:]) * 1e6,
                "staged_call_us": statistics.median(staged_calls) * 1e6, "staged_clean": staged.clean,
                "live_clean": live.clean, "staged_method": staged.method, "live_method": live.method,
                "values_per_batch": _values(_staged(spec, plan, 1)[0])}
        if not any(t.managed is not None for t in full.tables):
            def layout(budget: str | None, steps: int) -> Callable[[], list[list[float]]]:
                return lambda: sharded_steps(full, job["profile"], world_size, rank, steps, dist.barrier, budget,
                                             sharded_limit(steps, mine["live_ms"]))

            if job.get("other"):  # a second layout of other call counts (`other_layout`), in turn with the first
                steps = max(1, -(-int(job["steps"]) // ALTERNATIONS))  # as many steps in all
                mine["sharded_steps_ms"], mine["other_sharded_steps_ms"] = alternated(
                    layout(job.get("device_budget"), steps), layout(job["other"]["device_budget"], steps))
            else:
                mine["sharded_steps_ms"] = layout(job.get("device_budget"), int(job["steps"]))()
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, mine)
        return gathered if rank == 0 else None
    finally:
        dist.destroy_process_group()


def _main(argv: list[str]) -> None:
    """Run `worker` and end without the interpreter's teardown (as a finished training rank does:
    a gloo group's or a data thread's native thread torn down at exit aborts the process)."""
    _, rank, world_size, port = argv
    try:
        result = worker(int(rank), int(world_size), int(port))
    except BaseException:
        traceback.print_exc()
        sys.stderr.flush()
        os._exit(1)
    if result is not None:
        print(json.dumps(result), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    _main(sys.argv[1:])
