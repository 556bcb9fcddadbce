"""Cost-model benchmark: predicted against measured step time and host<->device bytes per spec.

For every spec in specs/: calibrates this machine for the spec (`flowrec calibrate SPEC --out`, its
dense-layer shapes; right before its run, so that calibration and measurement see the same load on
a shared machine; `--profile FILE` uses one given profile for every spec instead), then trains on
synthetic rows (`flowrec data synth`, then `flowrec train SPEC --data DIR --target PROFILE --json`;
the planner samples that data for its access model): by default enough rows that no run sees a
batch twice (`synth_rows`), as on a dataset larger than the run, which is what calibration prices
(its live steps stream one pass of Parquet); `--cycled` trains SYNTH_ROWS rows over and over
instead, where later epochs come from the trainer's row cache with no Parquet read or decode and
no managed id new: the runs' steps there were 0.77-0.93 of the priced ones (the cost model's
Rounds 19-20 in docs/benchmarks/costmodel-rounds-4-25.md)) and compares the plan's prediction (`plan.json` of the run) with the measurement. Step time:
the predicted step (`cost.step_ms_overlap`; on the CPU staging + compute, since the data threads
run on the trainer's cores: their time shows up in the trainer's compute seconds, while it waits
for batches for almost nothing) against the compute seconds of the steps after WARMUP_STEPS
(each step timed as the trainer's guarded step call, `Trainer._step`, in the `flowrec train`
process), estimated by the same rule as calibration's timings (`flowrec.measure.robust`: the
median of the steps other processes did not delay, else the median one less its wait;
the run's own data threads are not other processes: the cores they take from the step are part
of the step), so that prediction and measurement stand on the same footing on a shared machine;
the plain median and quartiles show the load). Beside it, the plan's throughput (`samples_per_s`: the
step and its share of an epoch's start) and the runs' own (their samples over the seconds of their
training loops: the first steps' set-up, logging and every process's load included). Bytes: the host<->device bytes of a step from the cache counters (every
group's step traffic per sample times the batch, plus dense features and labels, as the plan
counts them; hot rows placed at the start and rows written back for checkpoints are not step
traffic), measured over one whole epoch (one more run, of every batch of the synthetic data, on
the first run's profile): the plan prices an epoch's traffic (a static hot set's refills, a
lookahead scratchpad's fetches: every row's first read of the epoch and the gaps between reads),
and the first run's 20-odd steps over-count the start (the first window fetched at once, the hot
rows' first reads early): two_task's lookahead measured 1.85 MB a step over 22 steps, 1.7 over
its 123 (Round 23; `measured_h2d_bytes_first_run` keeps the first run's, and with `--cycled` that
is the measurement). Bytes are compared only for specs with a group that is not device-resident
(the counters exist only there); `--device-budget` forces such placements.

With `--nproc N` every calibration also measures this machine's collectives (`flowrec calibrate
--nproc N`) and every run trains on N local ranks (gloo, through flowrec's launcher): the plan's
per-rank step, its exchange priced by the measured link, against the slowest rank's step (the
ranks meet in each step's collectives), estimated by the same rule.

Ratios:
    costmodel_max_step_error: max over specs of |predicted / measured - 1| (target <= 0.10), the
        measured step being the robust estimate; costmodel_median_step_error: the median over specs;
        costmodel_max_step_error_wall_median: the same against the plain median wall time (the load included);
        costmodel_max_step_error_fastest_quartile: the same against each spec's fastest-quartile
        step (less of the other processes' load on a shared machine).
    costmodel_max_bytes_error: the same for host<->device bytes per step (target <= 0.20).
    costmodel_max_run_spread: max over specs of the spread of a spec's runs' own estimates, (max -
        min) / the pooled estimate: the precision the measurement has (a spec of a few ms is run in
        up to MAX_RUNS processes, `measure_spec`).
    costmodel_max_pair_error_spread (`--interleave`): max over specs of the spread (max - min) of
        a spec's per-pair step errors: how far the host moved one comparison from the next.
    costmodel_specs_within / _undecided / _beyond (`--interleave`): the specs whose interval for
        the median pair error (`step_error_interval`, at least 90 % coverage by order statistics:
        `median_interval`) lies within +-0.10, straddles it (or rests on fewer than 5 pairs), or
        lies wholly outside it: a miss of an undecided spec is the host's noise as much as the
        model's; `--until-decided` gives such a spec further pairs up to --runs.
    host_gemm_drift_range: the lowest and highest `host_drift` of the probe's GEMM over every run
        (a run's / its calibration's): how far the machine's own speed moved (not an error).
    host_max_steal_share: the largest share of a run's wall time the hypervisor took from one of
        this machine's vCPUs (steal time; each run's `host_probe.steal_share`, a calibration's in
        its probe too); 0 on a machine without it, None where not recorded (before Round 37).

With `--other-budget B` (`none`: no device budget) every spec is also run under a second device
budget from the same calibration (the one at `--device-budget`): a user calibrates once and plans
many layouts, and a budget that shards or places the tables otherwise prices a plan with other
collective calls (`flowrec calibrate --nproc N` fits its per-call price on the world-size plan at
its own budget). That run's row is the spec's at `run_device_budget` B (every row records its
budget, the plan's collective calls a step and its groups' sharding and placement,
`plan_layout`); the ratios are over every row. Where the profile has the two-plan fit of a call's
price (`rank_step_fixed_us`, `rank_step_per_call_us`), a row also keeps the same plan priced at the
lumped call of the same calibration (`predicted_step_ms_lumped_call`, `lumped_call_ms`).

The host's own speed is probed just before and after every calibration and every run (`host_probe`:
a fixed fp32 GEMM of 1,024^3 and a 64 MiB add, in this process, on the runs' compute threads): a
run row keeps each run's probe and its calibration's (`host_drift`: run / calibration, per run),
so that a result shows how far the machine itself moved between the profile and the run it is
judged against, which no profile can know. Nothing of a probe enters a prediction or an error.
The probe also records the share of the run's (or calibration's) wall time the hypervisor stole
from a vCPU (`steal_share`); the steps' timing rule rejects rounds with steal as it rejects
rounds other processes delayed (`flowrec.measure.robust`).

With `--interleave` a short step's further runs each come right after a calibration of their own
(calibrate, run, calibrate, run ...: `measure_spec`), every run of about RUN_SECONDS of steps: a
run is judged against the plan of the profile measured next to it, and the spec's step error is
the median of these per-pair errors (`pair_errors`; `step_error_pooled` keeps the median
prediction against the pooled runs). On a shared host the speed moves between a spec's
calibration and its runs by more than the goal (round 9: the same spec measured 4.40 and 5.62 ms
in two runs back to back); pairs put each comparison within one spell of load. The prediction
still comes from `flowrec calibrate` and the plan alone. With `--bracket` a lead-in pair comes
first and each later calibration is judged against the mean of the runs right before and right
after it (run, calibrate, run: `pair_errors`), so that the host's drift across a pair cancels
to first order instead of landing whole on the run after it.

Usage:
    python tools/bench_costmodel.py [--steps 20] [--profile FILE] [--device-budget 64MiB] [--cache POLICY]
        [--specs a.yaml,b.yaml] [--threads N] [--nproc N] [--cycled] [--runs 3] [--interleave [--min-pairs K] [--bracket]]
        [--other-budget none|SIZE] [--json PATH]
    python tools/bench_costmodel.py --merge part1.json,part2.json --json PATH
"""
from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowrec.measure import robust  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402
from flowrec.testing.processes import run_tree  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 1200
SYNTH_ROWS = 8192  # synthetic rows per spec (every spec's batch is <= 4096)
EPOCHS = 100  # enough epochs for --steps over a few thousand rows
WARMUP_STEPS = 2  # steps whose compute time (first-call set-up) is not counted
RUN_SECONDS = 1.0  # timed seconds of steps a further run of a spec aims at (its steps: `run_steps`) ...
MAX_STEPS = 400  # ... in at most this many steps
POOL_SECONDS = 3.0  # a spec gets further runs while its runs' timed steps make fewer seconds ...
MAX_RUNS = 3  # ... and fewer runs
ONE_EPOCH_ROWS = 500_000  # `--one-epoch`: synthetic rows at most (unless `--steps` needs more) ...
ONE_EPOCH_VALUES = 40_000_000  # ... and feature values at most (wide_1000: 1,000 fields a row)
FLOAT_BYTES = 4  # dense features and labels travel as float32


TIMES_ENV = "FLOWREC_BENCH_TIMES"  # the folder each process of a run writes its step rounds to
HARNESS_MODULE = "_bench_costmodel_harness"  # `python -m` it: `flowrec` with the trainer's step timed
HARNESS = f"""
import json, os, sys
from flowrec.measure import robust
from flowrec.runtime import trainer
seconds = []
step = trainer.Trainer._step
clock = robust.SchedClock(exclude=robust.python_side_threads)  # the data threads are the run's own
def timed(self, batch, *args, **kwargs):
    started = clock.start()
    out = step(self, batch, *args, **kwargs)
    r = clock.stop(started)
    seconds.append([r.wall, r.waited])
    return out
trainer.Trainer._step = timed
def dump():
    path = os.path.join(os.environ["{TIMES_ENV}"], "rank" + os.environ.get("RANK", "0") + ".json")
    with open(path, "w") as f:
        json.dump(seconds, f)
hard_exit = os._exit
def exiting(code):  # a finished rank ends without the interpreter's teardown (`train_cmds._exit_finished_rank`)
    dump()
    hard_exit(code)
os._exit = exiting
from flowrec.cli import main
sys.argv = ["flowrec", *sys.argv[1:]]
try:
    main()
finally:
    dump()
"""


THREADS: dict[str, str] = {}  # --threads: OMP_NUM_THREADS and NUMBA_NUM_THREADS of every flowrec process


def flowrec(*args: str, cwd: Path, timed: bool = False, nproc: int = 1) -> str:
    """Run `flowrec ARGS` (`timed`: through the harness, each step's rounds written under
    cwd/times; `nproc` > 1: on that many local ranks through flowrec's launcher)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(cwd)]), **THREADS}
    command = ["-m", "flowrec"]
    if timed:
        (cwd / f"{HARNESS_MODULE}.py").write_text(HARNESS)
        times = cwd / "times"
        shutil.rmtree(times, ignore_errors=True)
        times.mkdir()
        env[TIMES_ENV] = str(times)
        command = ["-m", HARNESS_MODULE]
    if nproc > 1:
        from flowrec.cli.ranks import NPROC_ENV
        from flowrec.data.cores import thread_budget

        threads = str(thread_budget(ranks=nproc).compute)
        env = {"OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads, **env, NPROC_ENV: str(nproc),
               "LOGLEVEL": "CRITICAL"}
        command = ["-m", "flowrec.cli.ranks", "--standalone", f"--nproc-per-node={nproc}", "--max-restarts=0",
                   "--monitor-interval=0.5", *command]
    done = run_tree([sys.executable, *command, *args], cwd=cwd, env=env, timeout_s=RUN_TIMEOUT_S,
                    capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"flowrec {' '.join(args)} failed: {done.stderr.strip().splitlines()[-20:]}")  # the ranks' own lines too
    return done.stdout


def train_json(spec: Path, data: Path, profile: Path, steps: int, out: Path, tmp: Path,
               budget: str | None, cache: str | None, nproc: int = 1) -> tuple[dict[str, Any], list[robust.Round]]:
    """The run's `--json` result (rank 0's) and a round per step: the slowest rank's wall seconds
    (the ranks meet in every step's collectives) and that rank's wait for cores taken by other
    processes (`flowrec.measure.robust`)."""
    text = flowrec("train", str(spec), "--data", str(data), "--max-steps", str(steps), "--epochs", str(EPOCHS),
                   "--target", str(profile), "--device", "cpu", "--out", str(out), "--quiet", "--json",
                   "--eval-every", "0", *(["--device-budget", budget] if budget else []),
                   *(["--cache", cache] if cache else []), cwd=tmp, timed=True, nproc=nproc)
    ranks = [json.loads(p.read_text()) for p in sorted((tmp / "times").glob("rank*.json"))]
    if len(ranks) != nproc or len({len(r) for r in ranks}) != 1:
        raise RuntimeError(f"expected step times of {nproc} ranks with as many steps each, got {[len(r) for r in ranks]}")
    rounds = [robust.Round(*max(per_rank, key=lambda wq: wq[0])) for per_rank in zip(*ranks)]
    return json.loads(text[text.index("{"):text.rindex("}") + 1]), rounds


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


STEP_GOAL = 0.10  # issue 28: every spec's step error within this
INTERVAL_LEVEL = 0.9  # the least coverage of a spec's interval for its median pair error (`median_interval`)


def median_interval(values: list[float], level: float = INTERVAL_LEVEL) -> tuple[float, float, float]:
    """(low, high, coverage) of a distribution-free interval for the median of the distribution
    `values` are independent draws of: the k-th smallest and the k-th largest value, k the largest
    for which the interval covers the median with probability at least `level` (1 - 2 P(X < k), X
    binomial(n, 1/2)); with too few values for `level`, the range of all of them and its own
    coverage. A spec's pair errors are such draws: each pair's calibration and run meet the host in
    a spell of its own, so the median of a few pairs moves by tenths on a noisy host (Round 38's
    custom_module: -0.141 over 4 pairs, -0.056 over 8 in Round 39), and the interval says how far
    the figure can be trusted. Bracketed pairs (`pair_errors`) share a run with their neighbours,
    so theirs are not quite independent: the interval is then a little narrower than it should be.

    Raises:
        ValueError: no values.

    Example:
        >>> median_interval([0.3, -0.1, 0.0, 0.2, 0.1, -0.2, 0.05, 0.15])
        (-0.1, 0.2, 0.9296875)
        >>> median_interval([0.1, -0.1, 0.0, 0.2])
        (-0.1, 0.2, 0.875)
    """
    if not values:
        raise ValueError("no values to bound the median of")
    ordered, n = sorted(values), len(values)
    below = [math.comb(n, i) / 2 ** n for i in range(n + 1)]  # P(X = i)

    def coverage(k: int) -> float:  # [k-th smallest, k-th largest]
        return 1.0 - 2.0 * sum(below[:k])

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= level:
        k += 1
    return ordered[k - 1], ordered[n - k], coverage(k)


def interval_fields(errors: list[float]) -> dict[str, Any]:
    """A row's `step_error_interval` ([low, high] of `median_interval` over its pair errors), its
    coverage, and `step_error_verdict`: "within" (the whole interval within +-STEP_GOAL), "beyond"
    (wholly outside: a miss the pairs' spread does not explain) or "undecided" (it straddles the
    goal, or too few pairs for INTERVAL_LEVEL: fewer than 5; more pairs needed).

    Example:
        >>> [interval_fields(e)["step_error_verdict"] for e in ([0.01] * 5, [-0.2] * 5, [0.01] * 4)]
        ['within', 'beyond', 'undecided']
    """
    low, high, cover = median_interval(errors)
    verdict = "undecided"
    if cover >= INTERVAL_LEVEL and -STEP_GOAL <= low and high <= STEP_GOAL:
        verdict = "within"
    elif cover >= INTERVAL_LEVEL and (high < -STEP_GOAL or low > STEP_GOAL):
        verdict = "beyond"
    return {"step_error_interval": [low, high], "step_error_interval_coverage": cover, "step_error_verdict": verdict}


def with_interval(row: dict[str, Any]) -> dict[str, Any]:
    """`row` with `interval_fields` over its pair errors where it has pairs and none yet (a result
    from before the interval: its pairs are what it is computed from), else as it is."""
    if row.get("pair_step_errors") and "step_error_interval" not in row:
        return {**row, **interval_fields(row["pair_step_errors"])}
    return row


def measured_bytes_per_step(counters: dict[str, Any], batch: int, dense_and_labels: int) -> float:
    """Host<->device bytes of a full training step, as the plan predicts them: every group's step
    traffic per sample times the batch (FAE's hot/cold batches and an epoch's last batch are
    shorter), plus the dense features and labels (float32)."""
    groups = sum((c["h2d_bytes"] + c["d2h_bytes"]) / max(c["samples"], 1) for c in counters.values())
    return groups * batch + batch * dense_and_labels * FLOAT_BYTES


def synth_rows(spec: Path, steps: int, one_epoch: bool) -> int:
    """Synthetic rows of a spec's run: SYNTH_ROWS, or with `one_epoch` enough for every step of
    every run in one epoch: no epoch's start (its readers' and shuffle's set-up on the data threads)
    inside the timed steps, and no batch seen twice (no rows served from the trainer's row cache, no
    managed id met again), as in a run over a dataset larger than the run. That is MAX_STEPS steps
    (a further run's most), at most ONE_EPOCH_ROWS rows and ONE_EPOCH_VALUES feature values unless
    `steps` alone needs more; a run is then cut to the one epoch (`run_steps`)."""
    if not one_epoch:
        return SYNTH_ROWS
    model = load_spec(spec)
    batch = model.training.batch_size
    values = len(model.features) + len(model.heads)  # per row: a value per field (sequences: more) and label
    return max(SYNTH_ROWS, batch * (WARMUP_STEPS + steps + 1),
               min(ONE_EPOCH_ROWS, ONE_EPOCH_VALUES // max(values, 1),
                   batch * (WARMUP_STEPS + max(steps, MAX_STEPS) + 1)))


def run_steps(first_ms: float, steps: int, batch: int, rows: int, epochs: int = EPOCHS) -> int:
    """Timed steps of a spec's further runs: enough for RUN_SECONDS of steps at the first run's
    step `first_ms`, at least `steps`, at most MAX_STEPS and what the run's data holds (`epochs`
    epochs of `rows` rows at `batch`, less the warm-up; `--one-epoch`: one).

    Example:
        >>> run_steps(1.3, 20, 1024, 8192), run_steps(70.0, 20, 4096, 8192), run_steps(1.0, 20, 4096, 8192)
        (400, 20, 197)
        >>> run_steps(1.3, 20, 1024, 100_000, epochs=1)
        94
    """
    wanted = max(steps, min(MAX_STEPS, math.ceil(RUN_SECONDS * 1e3 / max(first_ms, 1e-6))))
    return max(1, min(wanted, (rows // max(batch, 1)) * epochs - WARMUP_STEPS - 1))


def pool_seconds(max_runs: int) -> float:
    """Timed seconds of steps below which a spec gets a further run (of at most `max_runs`):
    POOL_SECONDS for the default MAX_RUNS, in proportion for more, so that `--runs 5` gives a
    short step five runs of RUN_SECONDS rather than stopping at three.

    Example:
        >>> pool_seconds(3), pool_seconds(5), pool_seconds(1)
        (3.0, 5.0, 1.0)
    """
    return POOL_SECONDS * max_runs / MAX_RUNS


def chosen_specs(names: str) -> list[Path]:
    """The files of specs/ named in `names` (`--specs`: comma-separated file names; empty: all).

    Raises:
        ValueError: a name not in specs/, or only commas, in one line naming them.
    """
    specs = sorted((REPO / "specs").glob("*.yaml"))
    if not names:
        return specs
    asked = [name.strip() for name in names.split(",") if name.strip()]
    unknown = sorted(set(asked) - {s.name for s in specs})
    if not asked:
        raise ValueError("--specs: none given (file names in specs/, like dlrm_criteo.yaml)")
    if unknown:
        raise ValueError(f"--specs: {', '.join(unknown)} not in specs/ (file names, like dlrm_criteo.yaml)")
    return [s for s in specs if s.name in asked]


PROBE_REPEATS = 9  # calls of each probe kernel (the median kept)


def host_probe() -> dict[str, float]:
    """The host's speed now: ms of a fixed fp32 GEMM (1,024 x 1,024 by 1,024 x 1,024) and of a
    64 MiB elementwise add, each the median of PROBE_REPEATS calls after one untimed, on the
    runs' compute threads (`--threads`, else torch's default), in this process."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(int(THREADS.get("OMP_NUM_THREADS") or 0) or saved)
    try:
        g = torch.Generator().manual_seed(0)
        a, b = torch.rand(1024, 1024, generator=g), torch.rand(1024, 1024, generator=g)
        x, y = torch.rand(1 << 24, generator=g), torch.rand(1 << 24, generator=g)

        def ms(kernel: Callable[[], Any]) -> float:
            kernel()
            times = []
            for _ in range(PROBE_REPEATS):
                started = time.perf_counter()
                kernel()
                times.append((time.perf_counter() - started) * 1e3)
            return quantile(times, 0.5)

        return {"gemm_ms": ms(lambda: a @ b), "add_ms": ms(lambda: x + y)}
    finally:
        torch.set_num_threads(saved)


def probed(work: Callable[[], Any]) -> tuple[Any, dict[str, float]]:
    """(what `work` returns, the mean of `host_probe` just before and just after it, and
    `steal_share`: the largest share of the work's wall time the hypervisor took from a vCPU this
    process may run on, `flowrec.measure.robust`'s steal; 0 where not readable)."""
    before = host_probe()
    clock = robust.SchedClock()
    stolen0, started = clock.steal(), time.perf_counter()
    out = work()
    seconds, stolen = time.perf_counter() - started, clock.steal()
    after = host_probe()
    probe = {k: (before[k] + after[k]) / 2 for k in before}
    probe["steal_share"] = clock.stolen_seconds(stolen0, stolen) / seconds if seconds > 0 else 0.0
    return out, probe


def host_drift(row: dict[str, Any], calibration_probes: list[dict[str, float]]) -> dict[str, Any]:
    """The host's speed at each run of `row` over its calibration's (the pair's own with
    `--interleave`, else the first): {"gemm": [ratios], "add": [ratios]} (above 1: slower at the
    run); {} where a probe is missing.

    Example:
        >>> row = {"measured_runs": [{"host_probe": {"gemm_ms": 12.0, "add_ms": 5.0}}]}
        >>> host_drift(row, [{"gemm_ms": 10.0, "add_ms": 5.0}])
        {'gemm': [1.2], 'add': [1.0]}
    """
    runs = [r.get("host_probe") for r in row.get("measured_runs", [])]
    if not runs or not calibration_probes or any(r is None for r in runs):
        return {}
    own = [calibration_probes[min(k, len(calibration_probes) - 1)] for k in range(len(runs))]
    return {kind: [r[f"{kind}_ms"] / c[f"{kind}_ms"] for r, c in zip(runs, own)] for kind in ("gemm", "add")}


def pair_errors(pairs: list[tuple[float, list[robust.Round]]], bracket: list[bool] | None = None
                ) -> dict[str, Any]:
    """The comparison of interleaved (calibration, run) pairs of one spec (`--interleave`), each
    (the plan's predicted step from that pair's calibration, the run's timed rounds): each run
    judged against the prediction of the profile measured right before it (`pair_step_errors`:
    predicted / the run's estimate by the timing rule - 1), so that the host's drift between one
    pair and the next is not counted as the model's error; the spec's error is their median
    (`step_error`, the middle one of three), their spread (max - min) says how far the host moved
    the comparison between pairs. Nothing of a run enters a prediction.

    With `bracket` (`--bracket`: a flag for each pair after the first) the first pair is a
    lead-in: its run only measures, and each later calibration k is judged against the mean of the
    estimates of the run right before it (k - 1) and the run right after it (k) where
    bracket[k - 1] (the two runs trained the same program, `same_program`), else against run k
    alone. A calibration then sits in the middle of its measurement: a drift of the host's speed
    over the pair, which a run after it alone takes in whole, cancels to first order (round 31:
    Round 30's pairs in bench/results/round30/costmodel_all.json recomputed so, the standard
    deviation of a spec's pair errors fell in all 17 specs of 3-7 pairs, 0.206 to 0.185 for the
    most scattered).

    Raises:
        ValueError: no pairs; with `bracket`, fewer than two pairs or not a flag for each after the first.

    Example:
        >>> r = [robust.Round(2.0)] * 3
        >>> pair_errors([(2.2, r), (1.8, r), (2.1, r)])["step_error"]
        0.050000000000000044
        >>> fast, slow = [robust.Round(1.8)] * 3, [robust.Round(2.2)] * 3
        >>> pair_errors([(9.9, fast), (2.0, slow), (2.0, fast)], [True, True])["pair_step_errors"]
        [0.0, 0.0]
    """
    if not pairs:
        raise ValueError("no (calibration, run) pairs to compare")
    measured = [robust.estimate(rounds).seconds for _, rounds in pairs]
    predicted = [p for p, _ in pairs]
    out: dict[str, Any] = {}
    if bracket is not None:
        if len(pairs) < 2 or len(bracket) != len(pairs) - 1:
            raise ValueError(f"bracketed pairs need a lead-in run and at least one more pair, a flag each "
                             f"after the lead-in (got {len(pairs)} pairs and {len(bracket)} flags)")
        out = {"pair_run_step_ms": measured, "lead_predicted_step_ms": predicted[0], "pair_bracketed": list(bracket)}
        measured = [(before + after) / 2 if both else after
                    for before, after, both in zip(measured, measured[1:], bracket)]
        predicted = predicted[1:]
    errors = [p / ms - 1.0 for p, ms in zip(predicted, measured)]
    return {"pair_predicted_step_ms": predicted, "pair_measured_step_ms": measured,
            "pair_step_errors": errors, "pair_error_spread": max(errors) - min(errors),
            "step_error": quantile(errors, 0.5), **interval_fields(errors), **out}


def judged_pairs(pairs: list[tuple[float, list[robust.Round]]], run_plans: list[dict[str, Any]],
                 bracket: bool) -> dict[str, Any]:
    """`pair_errors` of a spec's pairs as `measure_spec` judges them: with `bracket`, each pair
    bracketed where the two runs around its calibration trained the same program, and what
    they laid out otherwise (`pair_program_changes`, `program_changes`)."""
    if not bracket:
        return pair_errors(pairs)
    changes = [program_changes(a, b) for a, b in zip(run_plans, run_plans[1:])]
    return {**pair_errors(pairs, [not c for c in changes]), "pair_program_changes": changes}


def decided(pairs: list[tuple[float, list[robust.Round]]], run_plans: list[dict[str, Any]], bracket: bool) -> bool:
    """Whether the pairs made so far decide a spec's step error against the goal (`interval_fields`:
    "within" or "beyond"), judged as at the end (`judged_pairs`); False while too few to judge."""
    if len(pairs) < (2 if bracket else 1):
        return False
    return judged_pairs(pairs, run_plans, bracket)["step_error_verdict"] != "undecided"


PLAN_PRICES = ("cost", "passes", "target")  # a plan document's prices, its pass notes and the profile they came
# from (each pair's calibration is a file of its own): not the program it trains


def same_program(first: dict[str, Any], second: dict[str, Any]) -> bool:
    """Whether two runs' plan documents train the same program: equal but for their prices
    (PLAN_PRICES, the profile's path among them, and each group's `expected_hit_rate`), which come
    from each run's own calibration. Two calibrations can lay a spec out otherwise (a cache's rows, a placement), and
    then the two runs measured two programs (`pair_errors`' `bracket`).

    Example:
        >>> a = {"groups": [{"placement": "host", "expected_hit_rate": 0.5}], "cost": {"step_ms_overlap": 3.0}}
        >>> same_program(a, {"groups": [{"placement": "host", "expected_hit_rate": 0.7}], "cost": {}})
        True
        >>> same_program(a, {"groups": [{"placement": "device", "expected_hit_rate": 0.5}], "cost": {}})
        False
    """
    return not program_changes(first, second)


_MISSING = object()  # a key one plan document has and the other has not (`program_changes`)


def program_changes(first: dict[str, Any], second: dict[str, Any]) -> list[str]:
    """Where two runs' plan documents lay out different programs (`same_program`): the paths of the
    values that differ once prices are set aside, in document order with keys sorted (a row's
    `pair_program_changes`, so that a pair judged by its own run alone says why: a cache's rows, a
    group's placement, ...).

    Example:
        >>> a = {"groups": [{"name": "g0", "cache_rows": 10, "expected_hit_rate": 0.5}], "cost": {"step_ms": 3.0}}
        >>> program_changes(a, {"groups": [{"name": "g0", "cache_rows": 12, "expected_hit_rate": 0.7}], "cost": {}})
        ['groups[0].cache_rows']
    """
    def program(doc: dict[str, Any]) -> dict[str, Any]:
        kept = {k: v for k, v in doc.items() if k not in PLAN_PRICES}
        kept["groups"] = [{k: v for k, v in g.items() if k != "expected_hit_rate"} for g in doc.get("groups", [])]
        return kept

    def walk(a: Any, b: Any, path: str) -> list[str]:
        if isinstance(a, dict) and isinstance(b, dict):
            return [c for key in sorted(set(a) | set(b), key=str)
                    for c in walk(a.get(key, _MISSING), b.get(key, _MISSING), f"{path}.{key}" if path else str(key))]
        if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
            return [c for i, (x, y) in enumerate(zip(a, b)) for c in walk(x, y, f"{path}[{i}]")]
        return [] if a == b else [path or "(document)"]

    return walk(program(first), program(second), "")


def plan_layout(plan_doc: dict[str, Any], spec: Path) -> dict[str, Any]:
    """What a run's plan (`plan_doc`, its plan.json) lays out for the collectives: its collective
    calls a step and the bytes one rank sends (`flowrec.planner.cost.step_collectives`, as the
    cost model prices them; 0 for one rank) and each group's [name, sharding, placement]."""
    from flowrec.graph.plan_io import plan_from_document
    from flowrec.planner.cost import step_collectives

    plan = plan_from_document(plan_doc)
    calls, sent = step_collectives(plan.graph, load_spec(spec))
    return {"calls": calls, "exchange_bytes": sent,
            "groups": [[g["name"], g["sharding"], g["placement"]] for g in plan_doc["groups"]]}


def lumped_call_ms(profile: Path, predicted_ms: float, calls: int) -> float | None:
    """The plan's step (`predicted_ms`, of `calls` collective calls) had its exchange been priced
    by the lumped price per call (`rank_step_call_us`, fitted at the calibrated plan's own call
    count) instead of the two-plan fit (`rank_step_fixed_us` + calls x `rank_step_per_call_us`,
    `flowrec.planner.cost.step_call_fit`); None where the profile has no fit (the lumped price
    priced it).

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "p.json"
        >>> _ = p.write_text(json.dumps({"measured": {"rank_step_call_us": {"value": 1500.0},
        ...     "rank_step_fixed_us": {"value": 3000.0}, "rank_step_per_call_us": {"value": 1000.0}}}))
        >>> lumped_call_ms(p, 20.0, 3)
        18.5
    """
    measured = json.loads(Path(profile).read_text()).get("measured", {})
    value = {k: (measured.get(k) or {}).get("value") for k in ("rank_step_call_us", "rank_step_fixed_us",
                                                               "rank_step_per_call_us")}
    if not value["rank_step_per_call_us"] or not value["rank_step_call_us"] or calls <= 0:
        return None
    fitted_us = (value["rank_step_fixed_us"] or 0.0) + calls * value["rank_step_per_call_us"]
    return predicted_ms + (calls * value["rank_step_call_us"] - fitted_us) * 1e-3


def measure_spec(spec: Path, profile: Path, steps: int, tmp: Path, budget: str | None,
                 cache: str | None = None, nproc: int = 1, one_epoch: bool = True,
                 max_runs: int = MAX_RUNS, recalibrate: Callable[[int], Path] | None = None,
                 tag: str = "", min_runs: int = 1, bracket: bool = False, until_decided: bool = False
                 ) -> dict[str, Any]:
    """Predicted vs measured for one spec: runs of WARMUP_STEPS + steps steps (on `nproc` ranks),
    a new `flowrec train` process each, one plan (the same profile): the first of `steps` steps,
    further ones (`run_steps`: RUN_SECONDS of steps each) while the timed steps of all the runs
    make fewer than `pool_seconds(max_runs)` and fewer than `max_runs` runs were made. A step of a few
    milliseconds is thus measured on hundreds of steps in three processes: one run's 20 steps
    moved a 1-6 ms spec by 0.07-0.25 between two runs of the same code (round 8). The measured
    step is the robust estimate (`flowrec.measure.robust`) over the steps after WARMUP_STEPS of
    every run pooled; each run's own estimate is kept (`measured_runs`), their spread
    (`measured_run_spread`: (max - min) / the pooled estimate) is the precision the measurement
    has.

    With `recalibrate` (`--interleave`) each further run gets a profile of its own, measured right
    before it (`recalibrate(k)`: the k-th calibration of the spec), and every run, the first too, is
    of RUN_SECONDS of steps sized by its calibration's own live step (`run_steps`); each run is
    judged against its own plan and the spec's error is the median of the pairs' (`pair_errors`).
    A spec gets at least `min_runs` runs (`--min-pairs`), whatever its step: a long step's timed
    seconds fill the pool in one run, and its one pair then carries all the host's drift between
    that calibration and that run (round 29: bst_taobao's single pairs -0.19 ... +0.28 around a
    mean of 0.01). With `bracket` (`--bracket`, with `recalibrate`) the first run is a lead-in
    and each later calibration is judged against the runs on both sides of it (`pair_errors`):
    `min_runs` and `max_runs` count the pairs after the lead-in, and the pool its timed steps.
    With `until_decided` (`--until-decided`, with `recalibrate`) a spec gets further pairs, past the
    pool, while the interval of its median pair error straddles the goal (`interval_fields`'s
    verdict "undecided"), up to `max_runs`, and no more once it is decided: a short step's few pairs
    on a noisy host leave its error undecided (Round 38's custom_module, -0.141 over 4 pairs, -0.056
    over 8), a steady one is decided in five. Stopping once decided makes the interval's coverage a
    little below INTERVAL_LEVEL (a chance decision ends the pairs); the row says it ran so.
    `tag` names the spec's data and run folders apart from another measurement of it in `tmp`
    (`--other-budget`)."""
    if bracket and recalibrate is None:
        raise ValueError("bracketed pairs need a calibration before each run (recalibrate)")
    if until_decided and recalibrate is None:
        raise ValueError("--until-decided adds (calibration, run) pairs: it needs a calibration before each run")
    lead = 1 if bracket else 0
    stem = f"{spec.stem}-{tag}" if tag else spec.stem
    data = tmp / f"{stem}-data"
    rows = synth_rows(spec, steps, one_epoch)
    epochs = 1 if one_epoch else EPOCHS
    flowrec("data", "synth", str(spec), "--rows", str(rows), "--out", str(data), cwd=tmp)
    runs: list[tuple[dict[str, Any], list[robust.Round]]] = []
    pooled: list[robust.Round] = []
    pairs: list[tuple[float, list[robust.Round]]] = []
    run_plans: list[dict[str, Any]] = []  # each run's plan document (`--bracket`: the same program as the last?)
    probes: list[dict[str, float]] = []  # `host_probe` around each run
    count = steps
    batch = load_spec(spec).training.batch_size
    first_profile = profile  # the plan every run is compared with (with --interleave, the first pair's)
    while True:
        if recalibrate is not None:  # a pair: the run's own calibration right before it
            profile = recalibrate(len(runs)) if runs else profile
            count = run_steps(calibrated_live_ms(profile), steps, batch, rows, epochs)
        out = tmp / f"{stem}-run{len(runs)}"
        (result, seconds), probe = probed(lambda: train_json(spec, data, profile, WARMUP_STEPS + count, out, tmp,
                                                             budget, cache, nproc))
        probes.append(probe)
        rounds = [robust.Round(r.wall * 1e3, r.waited * 1e3) for r in seconds[WARMUP_STEPS:]]
        runs.append((result, rounds))
        if len(runs) > lead:  # the pool (and the pooled estimate) is of the pairs' runs, not the lead-in's
            pooled += rounds
        if len(runs) == 1 or recalibrate is not None:  # a pair's own plan with --interleave, else one
            run_plan = json.loads((out / "plan.json").read_text())
            if len(runs) == 1:  # every run trains this plan (the same profile)
                plan = run_plan
            if recalibrate is not None:
                pairs.append((run_plan["cost"]["step_ms_overlap"], rounds))
                run_plans.append(run_plan)
        made = len(runs) - lead
        if made >= min_runs and (made >= max_runs or (decided(pairs, run_plans, bracket) if until_decided
                                                       else sum(r.wall for r in pooled) >= pool_seconds(max_runs) * 1e3)):
            break
        count = run_steps(robust.estimate(rounds).seconds, steps, plan["cost"]["batch_size"], rows, epochs)
    cost = plan["cost"]
    result, first = runs[0]
    timed = [r.wall for r in pooled]
    robust_ms = robust.estimate(pooled)
    measured_ms = robust_ms.seconds
    predicted_ms = cost["step_ms_overlap"]
    own = [p for p, _ in pairs] or [predicted_ms] * len(runs)  # each run's own plan's prediction
    if pairs:
        predicted_ms = quantile(own[lead:], 0.5)
    per_run = [robust.estimate(r) for _, r in runs]
    run_ms = [e.seconds for e in per_run]
    staging_wait = sum(r["stage_seconds"].get("staging_wait", 0.0) for r, _ in runs) / max(
        sum(r["steps"] for r, _ in runs), 1) * 1e3
    row = {"spec": spec.name, "run_device_budget": budget or "none", "plan_layout": plan_layout(plan, spec),
           "steps": len(timed), "synth_rows": rows, "batch": cost["batch_size"], "world_size": cost["world_size"],
           "predicted_step_ms": predicted_ms, "predicted_exchange_ms": cost.get("exchange_ms", 0.0),
           "predicted_exchange_bytes": cost.get("exchange_bytes_per_step", 0),
           "predicted_compute_ms": cost["step_ms_serial"] - cost["stage_ms"]["staging"],
           "predicted_stage_ms": cost["stage_ms"], "measured_step_ms": measured_ms,
           "measured_clean_steps": robust_ms.clean, "measured_method": robust_ms.method,
           "measured_step_ms_median": quantile(timed, 0.5),
           "measured_wait_ms_median": quantile([r.waited for r in pooled], 0.5),
           "measured_step_ms_quartiles": [quantile(timed, 0.25), quantile(timed, 0.75)],
           "measured_step_ms_mean": sum(timed) / len(timed),
           "predicted_samples_per_s": cost["samples_per_s"],  # the step and its share of the epoch's start
           "measured_samples_per_s": sum(r["samples"] for r, _ in runs) / max(sum(r["seconds"] for r, _ in runs), 1e-9),
           "measured_staging_wait_ms": staging_wait,
           "measured_runs": [{"steps": len(r), "step_ms": e.seconds, "clean_steps": e.clean, "method": e.method,
                              "step_ms_median": quantile([x.wall for x in r], 0.5),
                              "step_error": p / e.seconds - 1.0, "predicted_step_ms": p, "host_probe": probe}
                             for (_, r), e, p, probe in zip(runs, per_run, own, probes)],
           "measured_run_spread": (max(run_ms) - min(run_ms)) / measured_ms,
           "step_error": predicted_ms / measured_ms - 1.0, "min_runs": min_runs,
           "step_error_fastest_quartile": predicted_ms / quantile(timed, 0.25) - 1.0,
           "step_error_wall_median": predicted_ms / quantile(timed, 0.5) - 1.0,
           "measured_rounds_ms": [[round(r.wall, 4), round(r.waited, 4)] for r in first]}
    lumped = lumped_call_ms(profile, predicted_ms, row["plan_layout"]["calls"]) if not pairs else None
    if lumped is not None:  # the same plan with every call at the lumped price (what a profile without the fit gives)
        row["predicted_step_ms_lumped_call"] = lumped
        row["step_error_lumped_call"] = lumped / measured_ms - 1.0
    if pairs:  # each run against its own calibration; the pooled comparison (median prediction) kept beside
        row["step_error_pooled"] = row["step_error"]
        row.update(judged_pairs(pairs, run_plans, bracket))  # bracketed: each pair's runs' layout changes too
        row["bracket"] = bracket
        row["until_decided"] = until_decided
    if result["counters"]:
        model = load_spec(spec)
        local = -(-cost["batch_size"] // cost["world_size"])
        extra = len(model.dense_features) + len(model.heads)
        measured = measured_bytes_per_step(result["counters"], local, extra)  # one rank's
        row["predicted_h2d_bytes"] = cost["h2d_bytes_per_step"]
        if one_epoch:  # the plan prices an epoch's traffic: measure a whole one (see the module docstring)
            first = measured
            batches = -(-rows // cost["batch_size"])
            (epoch, _) = train_json(spec, data, first_profile, batches, tmp / f"{stem}-epoch", tmp, budget, cache,
                                    nproc)
            measured = measured_bytes_per_step(epoch["counters"], local, extra)
            row["measured_h2d_bytes_first_run"] = first
            row["bytes_error_first_run"] = cost["h2d_bytes_per_step"] / first - 1.0 if first else None
            row["bytes_epoch_steps"] = batches
        row["measured_h2d_bytes"] = measured
        row["bytes_error"] = cost["h2d_bytes_per_step"] / measured - 1.0 if measured else None
    return row


def calibration_probes(summary: dict[str, Any], interleave: bool) -> list[dict[str, float]]:
    """The `host_probe`s of a spec's calibrations in the order of the runs they priced: each pair's
    with `--interleave`, else the one calibration's; [] where none was probed (`--profile`)."""
    pairs = [p["host_probe"] for p in summary.get("pairs", []) if p.get("host_probe")] if interleave else []
    return pairs or ([summary["host_probe"]] if summary.get("host_probe") else [])


def calibrated_live_ms(profile: Path) -> float:
    """A calibration's own live step of the spec (`details.staging.live_step_ms`), to size the run
    that follows it (`run_steps`); 1e3 (one step's worth: `--steps`) where the profile has none."""
    staging = json.loads(Path(profile).read_text()).get("details", {}).get("staging") or {}
    return float(staging.get("live_step_ms") or 1e3)


def calibration_summary(doc: dict[str, Any]) -> dict[str, Any]:
    """What a result keeps of a spec's calibration (profile document `doc`): its seconds, the
    measured constants and how the spec's own ones were measured."""
    details = doc.get("details", {})
    return {"seconds": details.get("seconds"), **{k: v["value"] for k, v in doc["measured"].items()},
            "how": {"compute_scale": details.get("compute_scale"),
                    "step_us": details.get("framework_us_by_batch", {}).get("fit"),
                    "staging": details.get("staging"), "shared_cores": details.get("shared_cores"),
                    "timing": details.get("timing")}}


PAIR_FIELDS = ("seconds", "compute_scale", "step_us", "staging_values_per_s", "epoch_lean_us")  # a further pair's calibration, kept


OPTIONS = ("device_budget", "threads", "nproc", "cache", "one_epoch", "interleave", "other_budget", "bracket")  # a result's run options (--merge: all equal)
OPTION_DEFAULTS = {"bracket": False}  # an option a result from before it existed ran without


def summarize(rows: list[dict[str, Any]], calibrations: dict[str, Any], options: dict[str, Any]) -> dict[str, Any]:
    """The result document of per-spec `rows` (`measure_spec`, or {"spec", "error"}): the rows, the
    calibrations, the run `options` (OPTIONS) and the ratios over every row with a step error."""
    steps = [abs(r["step_error"]) for r in rows if "step_error" in r]
    quick = [abs(r["step_error_fastest_quartile"]) for r in rows if "step_error" in r]
    plain = [abs(r["step_error_wall_median"]) for r in rows if "step_error" in r]
    byte_errors = [abs(r["bytes_error"]) for r in rows if r.get("bytes_error") is not None]
    spreads = [r["measured_run_spread"] for r in rows if "measured_run_spread" in r]
    pair_spreads = [r["pair_error_spread"] for r in rows if "pair_error_spread" in r]
    drifts = [x for r in rows for x in (r.get("host_drift") or {}).get("gemm", [])]
    steal = [run["host_probe"]["steal_share"] for r in rows for run in r.get("measured_runs", [])
             if "steal_share" in (run.get("host_probe") or {})]
    return {
        "benchmark": "costmodel",
        "calibration": calibrations,
        **options,
        "specs": rows,
        "ratios": {"costmodel_max_step_error": max(steps) if steps else None,
                   "costmodel_median_step_error": quantile(steps, 0.5) if steps else None,
                   "costmodel_max_step_error_fastest_quartile": max(quick) if quick else None,
                   "costmodel_max_step_error_wall_median": max(plain) if plain else None,
                   "costmodel_max_bytes_error": max(byte_errors) if byte_errors else None,
                   "costmodel_max_run_spread": max(spreads) if spreads else None,
                   "costmodel_max_pair_error_spread": max(pair_spreads) if pair_spreads else None,
                   "host_gemm_drift_range": [min(drifts), max(drifts)] if drifts else None,
                   **{f"costmodel_specs_{verdict}": [r["spec"] for r in rows if r.get("step_error_verdict") == verdict]
                      for verdict in ("within", "undecided", "beyond")},
                   "host_max_steal_share": max(steal) if steal else None},
        "bytes_compared_specs": [r["spec"] for r in rows if r.get("bytes_error") is not None],
    }


def row_key(row: dict[str, Any], budget: str | None = None) -> str:
    """A result row's name in a merge: its spec, and the budget it ran under (`--other-budget`
    gives a spec two rows); a row of a result from before rows recorded their budget ran under
    its file's `--device-budget` (`budget`), so a rerun of the spec replaces it."""
    return f"{row['spec']}@{row.get('run_device_budget', budget or 'none')}"


MODEL_CODE = ("flowrec", "operators", "schemas")  # the folders whose code makes a plan's prediction


def model_code(repo: Path = REPO) -> dict[str, Any] | None:
    """The identity of the model code a result measured: the git tree of each of MODEL_CODE at the
    checkout's HEAD, and whether the checkout had changes there that HEAD does not hold (`dirty`);
    None outside a git checkout. Two results with equal trees and no changes measured the same
    model, whatever else changed between them (the benchmark, docs), which `--merge --pool` needs."""
    try:
        trees = run_tree(["git", "-C", str(repo), "rev-parse", *(f"HEAD:{d}" for d in MODEL_CODE)],
                         capture_output=True, text=True, timeout_s=60)
        status = run_tree(["git", "-C", str(repo), "status", "--porcelain", "--", *MODEL_CODE],
                          capture_output=True, text=True, timeout_s=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    lines = trees.stdout.split()
    if trees.returncode != 0 or status.returncode != 0 or len(lines) != len(MODEL_CODE):
        return None
    return {**dict(zip(MODEL_CODE, lines)), "dirty": bool(status.stdout.strip())}


def pooled_row(parts: list[tuple[str, dict[str, Any], dict[str, Any] | None]]) -> dict[str, Any]:
    """One spec's row over the interleaved pairs of every part that measured it (`--merge --pool`),
    each (part file, its row, its `model_code`), in the parts' order: the last part's row, its step
    error the median of all the parts' per-pair errors (`pooled_pair_step_errors`, in order), its
    own kept as `step_error_part`, and what each part gave (`pooled_from`). More pairs of one model
    make the median steadier on a shared host: a perfect model is within 0.10 on every spec in
    about half the rounds of 7 bracketed pairs and in 82 % of rounds of 15 (Round 31,
    tools/bench_host_noise.py); pooling every part measured, not a chosen one, keeps it a
    measurement of the model.

    Raises:
        SystemExit: a part's row without pairs (a run without --interleave), two parts whose rows
            are of the same runs (a part given twice), or model code that differs between parts or
            had changes that HEAD did not hold, in one line naming the spec and the part.

    Example:
        >>> a = {"spec": "s.yaml", "step_error": 0.2, "pair_step_errors": [0.2, 0.3, -0.1],
        ...      "pair_run_step_ms": [1.0, 2.0, 3.0], "pair_predicted_step_ms": [1.2, 2.6, 2.7],
        ...      "pair_measured_step_ms": [1.0, 2.0, 3.0]}
        >>> b = {**a, "step_error": 0.0, "pair_step_errors": [0.0, -0.05], "pair_run_step_ms": [2.0, 2.1]}
        >>> row = pooled_row([("a.json", a, None), ("b.json", b, None)])
        >>> row["step_error"], row["step_error_part"], [p["pairs"] for p in row["pooled_from"]]
        (0.0, 0.0, [3, 2])
    """
    seen: dict[tuple, str] = {}
    codes = {}
    for path, row, code in parts:
        if not row.get("pair_step_errors"):
            raise SystemExit(f"{path}: {row['spec']} has no (calibration, run) pairs to pool (a run without --interleave)")
        runs = tuple(row.get("pair_run_step_ms") or row.get("pair_measured_step_ms") or ())
        if runs in seen:
            raise SystemExit(f"{path}: {row['spec']}'s runs are those of {seen[runs]} (a part given twice?)")
        seen[runs] = path
        if code is not None:
            if code.get("dirty"):
                raise SystemExit(f"{path}: measured model code with changes its commit does not hold: not poolable")
            codes[path] = {k: code.get(k) for k in MODEL_CODE}
    if len({json.dumps(c, sort_keys=True) for c in codes.values()}) > 1:
        raise SystemExit(f"{parts[-1][1]['spec']}: the parts measured different model code ({codes}): not poolable")
    errors = [e for _, row, _ in parts for e in row["pair_step_errors"]]
    predicted = [x for _, row, _ in parts for x in row.get("pair_predicted_step_ms", [])]
    measured = [x for _, row, _ in parts for x in row.get("pair_measured_step_ms", [])]
    last = parts[-1][1]
    out = {**last, "step_error_part": last["step_error"], "step_error": quantile(errors, 0.5),
           "pooled_pair_step_errors": errors, "pooled_pair_error_spread": max(errors) - min(errors),
           **interval_fields(errors), "pooled_from": [{"part": path, "pairs": len(row["pair_step_errors"]), "step_error": row["step_error"],
                            "model_code": code} for path, row, code in parts]}
    if predicted and measured:
        out["pooled_predicted_step_ms"] = quantile(predicted, 0.5)
        out["pooled_measured_step_ms"] = quantile(measured, 0.5)
    return out


def merge(paths: list[Path], pool: bool = False) -> dict[str, Any]:
    """One result of several runs' results (parts of one benchmark run with `--specs`, each under a
    short exclusive hold of a shared machine, and reruns of single specs): their rows by spec name
    and run budget (`row_key`) in name order, a later file's row replacing an earlier one's, each spec's calibration with its
    row, the ratios over the merged rows; every part's run options must be equal, and the
    result records its `parts` and their `model_code`. With `pool` (`--pool`, parts run with
    --interleave) a spec measured in pairs in several parts keeps the pairs of all of them instead
    (`pooled_row`; the result lists such rows as `pooled_specs`); a failed run of it in a later
    part drops none of them, and rows without pairs (`--other-budget`'s) are replaced as without.

    Raises:
        SystemExit: (2) a part that is not a result of this benchmark, a given profile (not per spec
            calibrations), options that differ, a file given twice, a malformed `model_code`, or (`pool`) parts run without
            --interleave and rows that `pooled_row` refuses, in one line naming the file.
    """
    rows: dict[str, list[tuple[str, dict[str, Any], dict[str, Any] | None]]] = {}
    calibrations: dict[str, Any] = {}
    options = None
    codes = []
    if len({Path(p).resolve() for p in paths}) != len(paths):
        raise SystemExit(f"a part is given twice: {', '.join(str(p) for p in paths)}")
    for path in paths:
        try:
            doc = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SystemExit(f"{path}: not a bench_costmodel result ({exc})") from None
        if not isinstance(doc, dict) or doc.get("benchmark") != "costmodel" or "given" in doc.get("calibration", {}):
            raise SystemExit(f"{path}: not a bench_costmodel result with per-spec calibrations")
        these = {name: doc.get(name, OPTION_DEFAULTS.get(name)) for name in OPTIONS}
        if options is not None and these != options:
            raise SystemExit(f"{path}: run options {these} differ from the first part's {options}")
        if pool and not these.get("interleave"):
            raise SystemExit(f"{path}: --pool pools (calibration, run) pairs: this part ran without --interleave")
        options = these
        code = doc.get("model_code")
        if code is not None and not (isinstance(code, dict) and all(isinstance(code.get(k), str) for k in MODEL_CODE)):
            raise SystemExit(f"{path}: its model_code is not a git tree for each of {', '.join(MODEL_CODE)}")
        codes.append(code)
        for row in doc["specs"]:
            key = row_key(row, doc.get("device_budget"))
            found = (str(path), row, code)
            if pool and row.get("pair_step_errors"):  # beside the earlier parts' rows of pairs (not a failed one)
                rows[key] = [r for r in rows.get(key, []) if r[1].get("pair_step_errors")] + [found]
            elif not pool or "error" not in row or key not in rows:  # the later replaces, but a failed run
                rows[key] = [found]  # drops no part's pairs under --pool: it stands only where none measured the spec
            if row["spec"] in doc["calibration"]:
                calibrations[row["spec"]] = doc["calibration"][row["spec"]]
    pooled = sorted(name for name, found in rows.items() if len(found) > 1)
    ordered = [pooled_row(rows[name]) if name in pooled else with_interval(rows[name][-1][1]) for name in sorted(rows)]
    result = summarize(ordered, {name: calibrations[name] for name in sorted(calibrations)}, options or {})
    result["parts"] = [str(p) for p in paths]
    result["parts_model_code"] = codes
    if pool:
        result["pooled_specs"] = pooled
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help=f"timed training steps of a spec's first run (after {WARMUP_STEPS} warm-up steps; "
                             f"further runs of a short step: `measure_spec`)")
    parser.add_argument("--runs", type=int, default=MAX_RUNS,
                        help="at most this many runs of a spec (a new process each) while its timed steps make "
                             f"under {POOL_SECONDS:g} s per {MAX_RUNS} runs (default {MAX_RUNS}; 1: one run of --steps "
                             "steps; with --interleave each run has a calibration of its own, and more runs make the "
                             "median of the pairs steadier on a shared host)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a profile from `flowrec calibrate` for every spec (default: calibrate each spec before its run)")
    parser.add_argument("--device-budget", default=None, help="device budget of every run (forces cache/host placements)")
    parser.add_argument("--cache", default=None, help="cache policy of every run (auto, none, static_hot, lookahead)")
    parser.add_argument("--specs", default="", help="comma-separated spec file names (default: all of specs/)")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/costmodel_cpu.json")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads of calibration and runs (OMP_NUM_THREADS and NUMBA_NUM_THREADS; default: one per core)")
    parser.add_argument("--one-epoch", dest="one_epoch", action="store_true", default=True,
                        help=f"(the default) synthesize enough rows for every step of every run in one epoch, at "
                             f"most {ONE_EPOCH_ROWS:,} rows and {ONE_EPOCH_VALUES:,} values: no batch seen twice, as "
                             f"on a dataset larger than the run, the regime calibration prices")
    parser.add_argument("--cycled", dest="one_epoch", action="store_false",
                        help=f"train {SYNTH_ROWS} synthetic rows cycled instead (an epoch of 2-8 batches: its starts "
                             f"fall inside the timed steps, and later epochs come from the trainer's row cache, "
                             f"which calibration does not price)")
    parser.add_argument("--nproc", type=int, default=1,
                        help="ranks of every run (local processes, gloo); with N > 1 each calibration also measures "
                             "the collectives (`flowrec calibrate --nproc N`), so the plan prices its exchange "
                             "with this machine's link; the measured step is the slowest rank's")
    parser.add_argument("--interleave", action="store_true",
                        help="each further run of a spec (a short step's, `--runs`) right after a calibration of "
                             "its own (calibrate, run, calibrate, run ...), every run of about "
                             f"{RUN_SECONDS:g} s of steps; each run judged against its own calibration's plan, "
                             "the spec's error the median of the pairs' (the host's drift between pairs is not "
                             "the model's error); not with --profile")
    parser.add_argument("--min-pairs", dest="min_pairs", type=int, default=1,
                        help="with --interleave, at least this many (calibration, run) pairs of every spec, "
                             "however long its step (default 1: a step whose first run of --steps steps fills the pool "
                             f"of --runs, {POOL_SECONDS:g} s per {MAX_RUNS} runs, gets one pair: at --runs 5 a step "
                             "over about 250 ms); --runs is raised to it. "
                             "A pair costs a calibration (about a minute; wide_1000's about nine)")
    parser.add_argument("--bracket", action="store_true",
                        help="with --interleave, one lead-in (calibration, run) first, then each calibration "
                             "judged against the mean of the runs right before and right after it (the host's "
                             "drift over a pair cancels to first order); --runs and --min-pairs count the pairs "
                             "after the lead-in, which costs one more calibration a spec")
    parser.add_argument("--until-decided", dest="until_decided", action="store_true",
                        help="with --interleave, after --min-pairs a spec gets further pairs (up to --runs, past "
                             f"the pool of timed seconds) while the {INTERVAL_LEVEL:.0%}% interval of its median pair "
                             f"error straddles +-{STEP_GOAL:g}, and none once it lies within or beyond it (at least 5 "
                             "pairs decide: each row's step_error_interval and step_error_verdict)")
    parser.add_argument("--other-budget", default=None,
                        help="also run every spec under this device budget (`none`: no budget) from the same "
                             "calibration (the one at --device-budget): a plan with other shardings or "
                             "placements priced by a profile calibrated on another")
    parser.add_argument("--merge", default="",
                        help="comma-separated result files of parts of one run (--specs) to merge into --json "
                             "(rows by spec, a later file's replacing an earlier's; ratios recomputed); runs nothing")
    parser.add_argument("--pool", action="store_true",
                        help="with --merge, parts run with --interleave: a spec measured in several parts is judged "
                             "on the pairs of all of them (the median of every pair's error) instead of the last "
                             "part's; the parts must have measured the same model code (`model_code`)")
    args = parser.parse_args()
    if args.pool and not args.merge:
        parser.error("--pool pools the pairs of result files: it needs --merge")
    if args.merge:
        try:
            result = merge([Path(p) for p in args.merge.split(",")], pool=args.pool)
        except SystemExit as exc:
            print(f"bench_costmodel: {exc}", file=sys.stderr)
            raise SystemExit(2) from None
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps(result["ratios"], indent=2))
        return
    if args.nproc < 1:
        parser.error("--nproc must be at least 1")
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    if args.other_budget is not None and args.other_budget != "none":
        from flowrec.spec.units import parse_bytes

        try:
            parse_bytes(args.other_budget)
        except ValueError:
            parser.error(f"--other-budget: {args.other_budget!r} is not a size (like 64MiB) or none")
    if args.min_pairs < 1:
        parser.error("--min-pairs must be at least 1")
    if args.min_pairs > 1 and not args.interleave:
        parser.error("--min-pairs counts (calibration, run) pairs: it needs --interleave")
    if args.until_decided and not args.interleave:
        parser.error("--until-decided adds (calibration, run) pairs: it needs --interleave")
    if args.bracket and not args.interleave:
        parser.error("--bracket judges each calibration by the runs on both sides of it: it needs --interleave")
    if args.interleave and args.profile is not None:
        parser.error("--interleave calibrates before each run: not with --profile")
    if args.threads:
        # numba's OpenMP layer (the fused sparse kernels) sets the process's OpenMP threads to its own
        # count when it starts, torch's included: both, or torch runs NUMBA_NUM_THREADS threads
        THREADS.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    try:
        specs = chosen_specs(args.specs)
    except ValueError as exc:
        parser.error(str(exc))
    code = model_code()  # before the runs: the code they measure
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp_name:
        tmp = Path(tmp_name)
        rows, calibrations = [], {}
        for spec in specs:
            def calibrate(k: int, spec: Path = spec) -> Path:
                """The spec's k-th calibration (`--interleave`: one before each run), kept in the result."""
                path = tmp / f"{spec.stem}-profile{k or ''}.json"
                _, probe = probed(lambda: flowrec(
                    "calibrate", str(spec), "--device", "cpu", "--out", str(path),
                    *(["--nproc", str(args.nproc)] if args.nproc > 1 else []),
                    *(["--device-budget", args.device_budget] if args.nproc > 1 and args.device_budget else []),
                    cwd=tmp))
                summary = {**calibration_summary(json.loads(path.read_text())), "host_probe": probe}
                if k == 0:
                    calibrations[spec.name] = summary
                if args.interleave:
                    calibrations[spec.name].setdefault("pairs", []).append(
                        {**{f: summary.get(f) for f in PAIR_FIELDS},
                         "live_step_ms": (summary["how"]["staging"] or {}).get("live_step_ms"),
                         "host_probe": probe})
                return path

            try:
                if args.profile is None:
                    profile = calibrate(0)
                else:
                    profile = args.profile
                    calibrations[spec.name] = calibration_summary(json.loads(Path(profile).read_text()))
                rows.append(measure_spec(spec, Path(profile), args.steps, tmp, args.device_budget, args.cache,
                                         args.nproc, args.one_epoch, args.runs,
                                         calibrate if args.interleave else None, min_runs=args.min_pairs,
                                         bracket=args.bracket, until_decided=args.until_decided))
                rows[-1]["host_drift"] = host_drift(rows[-1], calibration_probes(calibrations.get(spec.name, {}),
                                                                                 args.interleave))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append({"spec": spec.name, "error": str(exc)})
            print(json.dumps(rows[-1]), flush=True)
            if args.other_budget is not None and "error" not in rows[-1]:  # the same calibration, another layout
                other = None if args.other_budget == "none" else args.other_budget
                try:
                    rows.append(measure_spec(spec, Path(profile), args.steps, tmp, other, args.cache, args.nproc,
                                             args.one_epoch, args.runs, None, tag="other"))
                    rows[-1]["host_drift"] = host_drift(rows[-1], calibration_probes(
                        calibrations.get(spec.name, {}), False))
                except (RuntimeError, subprocess.TimeoutExpired) as exc:
                    rows.append({"spec": spec.name, "run_device_budget": args.other_budget, "error": str(exc)})
                print(json.dumps(rows[-1]), flush=True)
    result = summarize(rows, calibrations if args.profile is None else
                       {"given": str(args.profile), **next(iter(calibrations.values()), {})},
                       {name: getattr(args, name) for name in OPTIONS})
    result["model_code"] = code
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
