"""Host-noise floor of the cost-model benchmark: how close a *perfect* cost model could come to
the measured steps on this machine, given how the machine's own speed moves.

`tools/bench_costmodel.py --interleave` judges each prediction against a run about a minute after
the calibration it came from. On a shared host the same code runs at different speeds from one
spell to the next (this 2-core VM: a fixed 384^3 GEMM plus a 4 MB add moved 0.78-1.33x of its
median between half-second windows, with CPU time tracking wall time, so no steal or run-queue
wait explains it away). A model that prices the calibration's spell exactly still misses the
run's spell by that drift.

This tool measures the drift with one spec's real training step (staged batches, the trainer's
`train_step`, one process, `--threads` compute threads) for `--minutes`, each step's start and
wall time kept, then replays the benchmark's method on that trace with a perfect model:

- a pair: the "prediction" is the median step of a calibration window (`--cal-seconds`, the
  seconds of steps calibration times for the compute scale and live steps), the "measurement" the
  median step of a run window (`--run-seconds`) `--lag` seconds later; its error is their ratio - 1;
- a spec's error is the median of `--pairs` pairs at random times; the round's worst error is the
  largest |error| of `--specs` specs.

It draws `--trials` rounds (window starts uniform over the trace; windows of different pairs may
overlap, so the trace should be several times the longest lag plus windows) and reports the worst
error's median and 10th/90th percentiles, the share of rounds whose worst error is within
`--goal`, and the median count of specs within it; also the trace's windowed spread (relative
standard deviation of window medians, 1-30 s) and the |ratio - 1| of windows `--lag` apart. The
same simulation runs for the method variants in VARIANTS (longer runs, more pairs, a shorter lag)
so the table shows what a method change could buy. JSON to `--json`.

The floor is the host's, not the model's: a worst error in a bench_costmodel round near this
floor is what a model without error would also get on this host. On a quiet machine the floor is
near 0 and the benchmark measures the model alone.

Usage:
    python tools/bench_host_noise.py [--spec specs/movielens.yaml] [--minutes 10] [--threads 1]
        [--cal-seconds 3] [--run-seconds 1] [--lag 50] [--pairs 5] [--specs 19] [--goal 0.10]
        [--trials 2000] [--json bench/results/host_noise_cpu.json]
    python tools/bench_host_noise.py --trace FILE.json ...   (simulate a saved trace; runs nothing)
"""
from __future__ import annotations

import argparse
import bisect
import json
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.testing.benchargs import add_spec_step_arguments, device_budget, use_threads  # noqa: E402

WINDOWS_S = (1.0, 3.0, 10.0, 30.0)  # windowed spread reported for these window lengths
MIN_WINDOW_STEPS = 3  # a window with fewer steps is not drawn (its median would be one spell's step)
STAGED_BATCHES = 16  # distinct staged batches stepped in turn
GAP_KEPT_MS = 0.5  # a stored trace keeps the gaps between steps longer than this (`compact`)


@dataclass(frozen=True)
class Method:
    """How the benchmark pairs a calibration with a run (all seconds)."""
    cal_s: float
    run_s: float
    lag_s: float
    pairs: int
    specs: int
    lead_s: float = 0.0  # > 0: bracketed (`bench_costmodel --bracket`): also a run window this long before the
    # calibration window's start, the measurement the mean of the two runs' medians


VARIANTS = {  # method changes the table compares with the given method (`--cal-seconds` ...)
    "runs of 3 s": {"run_s": 3.0},
    "9 pairs": {"pairs": 9},
    "15 pairs": {"pairs": 15},
    "lag 10 s": {"lag_s": 10.0},
    "9 pairs, runs of 3 s, lag 10 s": {"pairs": 9, "run_s": 3.0, "lag_s": 10.0},
    "7 pairs": {"pairs": 7},
    # run, calibrate, run (`bench_costmodel --bracket`): the two runs one calibration (~55 s) apart, the
    # calibration's spec windows nearer its end
    "7 pairs, bracketed": {"pairs": 7, "lead_s": 20.0, "lag_s": 35.0},
}


class Trace:
    """Step start times (s from the first) and step seconds, sorted by start."""

    def __init__(self, starts: Sequence[float], seconds: Sequence[float]) -> None:
        if len(starts) != len(seconds) or not starts:
            raise ValueError(f"a trace needs as many starts as step times, at least one (got {len(starts)} "
                             f"and {len(seconds)})")
        if any(s <= 0 for s in seconds):
            raise ValueError("a trace's step times must be positive")
        order = sorted(range(len(starts)), key=lambda i: starts[i])
        first = starts[order[0]]
        self.starts = [starts[i] - first for i in order]
        self.seconds = [seconds[i] for i in order]

    @property
    def span(self) -> float:
        return self.starts[-1] + self.seconds[-1]

    def window(self, begin: float, length: float) -> float | None:
        """Median step of the steps starting in [begin, begin + length), None under MIN_WINDOW_STEPS."""
        i, j = bisect.bisect_left(self.starts, begin), bisect.bisect_left(self.starts, begin + length)
        return statistics.median(self.seconds[i:j]) if j - i >= MIN_WINDOW_STEPS else None


def compact(trace: Trace) -> dict[str, Any]:
    """The trace as stored: step ms to 0.01 ms, and the gaps between one step's end and the next's
    start (the loop's own microseconds) only where one exceeds GAP_KEPT_MS, as [index, ms]; the
    starts are rebuilt from them (`load_trace`). A 10-minute trace of a 7 ms step is ~80,000 steps:
    ~0.4 MB this way, 1.6 MB with every start."""
    gaps = [trace.starts[i + 1] - trace.starts[i] - trace.seconds[i] for i in range(len(trace.starts) - 1)]
    small = [g for g in gaps if g * 1e3 <= GAP_KEPT_MS]
    return {"step_ms": [round(s * 1e3, 2) for s in trace.seconds],
            "gap_ms": round(statistics.median(small) * 1e3, 4) if small else 0.0,
            "long_gaps": [[i, round(g * 1e3, 3)] for i, g in enumerate(gaps) if g * 1e3 > GAP_KEPT_MS]}


def load_trace(doc: dict[str, Any]) -> Trace:
    """A stored trace (`compact`, or one with every start as "starts_s") as a `Trace`.

    Example:
        >>> t = load_trace({"step_ms": [5.0, 5.0, 6.0], "gap_ms": 0.0, "long_gaps": [[1, 10.0]]})
        >>> [round(s, 3) for s in t.starts]
        [0.0, 0.005, 0.02]
    """
    seconds = [ms / 1e3 for ms in doc["step_ms"]]
    if "starts_s" in doc:
        return Trace(doc["starts_s"], seconds)
    long_gaps = {int(i): ms / 1e3 for i, ms in doc.get("long_gaps", [])}
    starts, at = [], 0.0
    for i, s in enumerate(seconds):
        starts.append(at)
        at += s + long_gaps.get(i, doc.get("gap_ms", 0.0) / 1e3)
    return Trace(starts, seconds)


def windowed_spread(trace: Trace, length: float) -> dict[str, float] | None:
    """Relative standard deviation and range of the medians of consecutive `length`-second
    windows (None under 3 windows).

    Example:
        >>> t = Trace([i * 0.1 for i in range(100)], [1.0 if i < 50 else 2.0 for i in range(100)])
        >>> windowed_spread(t, 1.0)["max_over_min"]
        2.0
    """
    medians = [m for m in (trace.window(k * length, length) for k in range(int(trace.span // length)))
               if m is not None]
    if len(medians) < 3:
        return None
    mid = statistics.median(medians)
    return {"windows": len(medians), "relative_stdev": statistics.pstdev(medians) / mid,
            "max_over_min": max(medians) / min(medians)}


def lag_deviation(trace: Trace, length: float, lag: float) -> dict[str, float] | None:
    """|ratio - 1| of `length`-second windows `lag` seconds apart, over every whole window: median,
    90th percentile and the share within 0.10 (None when the trace holds no such pair)."""
    out = []
    for k in range(int(trace.span // length)):
        a, b = trace.window(k * length, length), trace.window(k * length + lag, length)
        if a is not None and b is not None:
            out.append(abs(a / b - 1.0))
    if not out:
        return None
    out.sort()
    return {"pairs": len(out), "median": out[len(out) // 2], "p90": out[int(len(out) * 0.9)],
            "within_0.10": sum(x <= 0.10 for x in out) / len(out)}


def perfect_model_rounds(trace: Trace, method: Method, trials: int, rng: random.Random) -> list[list[float]]:
    """`trials` rounds of the benchmark with a perfect model: per round, `method.specs` spec errors,
    each the median of `method.pairs` pair errors (calibration window median / run window median -
    1, the run `method.lag_s` after the calibration's start; with `method.lead_s` the mean of that
    run's median and the median of a run `method.lead_s` before the calibration's start)."""
    reach = method.lead_s + method.lag_s + max(method.cal_s, method.run_s)
    if trace.span <= reach:
        raise ValueError(f"the trace ({trace.span:.0f} s) is shorter than a pair's reach ({reach:.0f} s: "
                         f"lag plus window); record longer (--minutes)")

    def pair() -> float:
        for _ in range(1000):
            begin = rng.uniform(method.lead_s, trace.span - reach + method.lead_s)
            cal, run = trace.window(begin, method.cal_s), trace.window(begin + method.lag_s, method.run_s)
            if method.lead_s > 0 and run is not None:
                before = trace.window(begin - method.lead_s, method.run_s)
                run = None if before is None else (run + before) / 2
            if cal is not None and run is not None:
                return cal / run - 1.0
        raise ValueError(f"windows of {min(method.cal_s, method.run_s)} s hold fewer than {MIN_WINDOW_STEPS} "
                         f"steps: the step is too slow for this method")

    return [[statistics.median(pair() for _ in range(method.pairs)) for _ in range(method.specs)]
            for _ in range(trials)]


def floor_summary(rounds: list[list[float]], goal: float) -> dict[str, Any]:
    """The worst |error| of each round: median, 10th and 90th percentiles, the share of rounds
    within `goal`; and the median count of specs within `goal`.

    Example:
        >>> floor_summary([[0.05, -0.2], [0.01, 0.02], [0.3, 0.0]], 0.10)["worst_within_goal_share"]
        0.3333333333333333
    """
    worst = sorted(max(abs(e) for e in r) for r in rounds)
    within = sorted(sum(abs(e) <= goal for e in r) for r in rounds)
    n = len(worst)
    return {"rounds": n, "worst_error_median": worst[n // 2], "worst_error_p10": worst[int(n * 0.1)],
            "worst_error_p90": worst[min(n - 1, int(n * 0.9))],
            "worst_within_goal_share": sum(w <= goal for w in worst) / n,
            "specs_within_goal_median": within[n // 2], "spec_error_abs_median":
                statistics.median(abs(e) for r in rounds for e in r)}


def record(spec_path: Path, seconds: float, budget: str | None) -> tuple[Trace, dict[str, Any]]:
    """Step `spec_path`'s model on STAGED_BATCHES staged batches in turn for `seconds`: (trace, facts)."""
    import torch

    from flowrec.measure import robust
    from flowrec.measure.step import WARMUP_STEPS, _item_counts, _staged, replayable
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.hostmem import tune_host_allocator
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.nonfinite import LossGuard
    from flowrec.runtime.step import make_dense_optimizer, train_step
    from flowrec.spec import load_spec
    from operators.device import runtime_for

    spec = load_spec(spec_path)
    device = torch.device("cpu")
    plan = make_plan(spec, device_budget=budget, target="cpu")
    if not replayable(plan):
        raise SystemExit(f"{spec_path.name}: its plan keeps an embedding cache, whose staged batches cannot be "
                         f"stepped again; pick a spec without one, or --device-budget none")
    tune_host_allocator()
    load = os.getloadavg()[0]
    model = lower(plan, spec, device)
    starts: list[float] = []
    steps: list[float] = []
    try:
        batches = _staged(spec, plan, STAGED_BATCHES)
        _item_counts(model, batches)
        opt = spec.dense_optimizer
        optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
        guarded, micro = LossGuard(model), int(plan.meta.micro_batches)
        sync = runtime_for(model.device).synchronize
        for batch in batches[:WARMUP_STEPS]:
            train_step(guarded, optimizer, batch, micro, spec.training.precision, spec.training.clip_grad_norm)
        sync()
        end = time.perf_counter() + seconds
        k, last_print = 0, time.perf_counter()
        while (now := time.perf_counter()) < end:
            train_step(guarded, optimizer, batches[k % len(batches)], micro, spec.training.precision,
                       spec.training.clip_grad_norm)
            sync()
            starts.append(now)
            steps.append(time.perf_counter() - now)
            k += 1
            if time.perf_counter() - last_print >= 30:
                last_print = time.perf_counter()
                print(f"  {k} steps, {max(0.0, end - last_print):.0f} s left", file=sys.stderr, flush=True)
    finally:
        model.close()
    facts = {"spec": spec_path.name, "steps": len(steps), "seconds": seconds, "device_budget": budget or "none",
             "threads": torch.get_num_threads(), "step_ms_median": statistics.median(steps) * 1e3,
             "loadavg_before_after": [load, os.getloadavg()[0]], "clock": "wall (time.perf_counter) of train_step and its sync",
             "compute_threads": robust.compute_threads()}
    return Trace(starts, steps), facts


def analyse(trace: Trace, method: Method, goal: float, trials: int, seed: int) -> dict[str, Any]:
    """The floor of `method` and of each of VARIANTS on `trace`, and the trace's spread."""
    out: dict[str, Any] = {"method": vars(method), "goal": goal, "trials": trials, "seed": seed,
                           "trace_seconds": trace.span, "trace_steps": len(trace.seconds),
                           "windowed_spread": {f"{w:g}s": windowed_spread(trace, w) for w in WINDOWS_S},
                           "lag_deviation": {f"{w:g}s": lag_deviation(trace, w, method.lag_s) for w in WINDOWS_S},
                           "floors": {}}
    for name, change in {"as given": {}, **VARIANTS}.items():
        variant = Method(**{**vars(method), **change})
        try:
            rounds = perfect_model_rounds(trace, variant, trials, random.Random(seed))
        except ValueError as exc:
            out["floors"][name] = {"method": vars(variant), "error": str(exc)}
            continue
        out["floors"][name] = {"method": vars(variant), **floor_summary(rounds, goal)}
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_step_arguments(parser, "spec whose training step is timed")
    parser.add_argument("--minutes", type=float, default=10.0, help="minutes of steps to record (default 10)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="simulate the trace of an earlier result (its JSON) instead of recording one")
    parser.add_argument("--cal-seconds", type=float, default=3.0, help="calibration window, s (default 3)")
    parser.add_argument("--run-seconds", type=float, default=1.0, help="run window, s (default 1: RUN_SECONDS)")
    parser.add_argument("--lag", type=float, default=50.0,
                        help="seconds from a calibration window to its run (default 50: a calibration's ~45 s and the "
                             "run's start)")
    parser.add_argument("--pairs", type=int, default=5, help="pairs per spec (default 5: --runs 5)")
    parser.add_argument("--specs", type=int, default=19, help="specs per round (default 19: specs/)")
    parser.add_argument("--goal", type=float, default=0.10, help="the step-error goal (default 0.10)")
    parser.add_argument("--trials", type=int, default=2000, help="simulated rounds (default 2000)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/host_noise_cpu.json")
    args = parser.parse_args(argv)
    if min(args.cal_seconds, args.run_seconds, args.minutes) <= 0 or args.lag < 0 or min(args.pairs, args.specs,
                                                                                        args.trials) < 1:
        parser.error("windows, minutes, pairs, specs and trials must be positive, the lag at least 0")
    if args.trace is not None:
        doc = json.loads(args.trace.read_text())
        trace, facts = load_trace(doc["trace"]), doc["recorded"]
    else:
        use_threads(args.threads)
        budget = device_budget(args)
        print(f"recording {args.spec.name}'s step for {args.minutes:g} min ...", file=sys.stderr, flush=True)
        trace, facts = record(args.spec, args.minutes * 60.0, budget)
    method = Method(args.cal_seconds, args.run_seconds, args.lag, args.pairs, args.specs)
    result = {"benchmark": "host_noise", "recorded": facts,
              **analyse(trace, method, args.goal, args.trials, args.seed),
              "trace": compact(trace)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{facts['spec']}: {len(trace.seconds)} steps over {trace.span:.0f} s, median "
          f"{facts['step_ms_median']:.2f} ms")
    for w, s in result["windowed_spread"].items():
        lag = result["lag_deviation"][w]
        if s:
            print(f"  {w:>4} windows: rel. stdev {s['relative_stdev']:.3f}, max/min {s['max_over_min']:.2f}"
                  + (f"; {args.lag:g} s apart |ratio-1| median {lag['median']:.3f}, p90 {lag['p90']:.3f}" if lag else ""))
    print(f"perfect model, worst |step error| of {args.specs} specs (goal {args.goal}):")
    for name, f in result["floors"].items():
        if "error" in f:
            print(f"  {name:32s} {f['error']}")
            continue
        print(f"  {name:32s} median {f['worst_error_median']:.3f} (p10 {f['worst_error_p10']:.3f}, p90 "
              f"{f['worst_error_p90']:.3f}); within goal in {f['worst_within_goal_share']:.0%} of rounds; "
              f"{f['specs_within_goal_median']} specs within")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
