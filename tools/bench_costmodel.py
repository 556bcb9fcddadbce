"""Cost-model benchmark: predicted against measured step time and host<->device bytes per spec.

For every spec in specs/: calibrates this machine for the spec (`flowrec calibrate SPEC --out`, its
dense-layer shapes; right before its run, so that calibration and measurement see the same load on
a shared machine; `--profile FILE` uses one given profile for every spec instead), then trains a few thousand synthetic rows (`flowrec data synth`, then `flowrec train SPEC
--data DIR --target PROFILE --json`, a few steps; the planner samples that data for its access
model) and compares the plan's prediction (`plan.json` of the run) with the measurement. Step time:
the predicted step (`cost.step_ms_overlap`; on the CPU staging + compute, since the data threads
run on the trainer's cores: their time shows up in the trainer's compute seconds, while it waits
for batches for almost nothing) against the compute seconds of the steps after WARMUP_STEPS
(each step timed as the trainer's guarded step call, `Trainer._step`, in the `flowrec train`
process), estimated by the same rule as calibration's timings (`flowrec.measure.robust`: the
median of the steps other processes did not delay, else the fastest one less its wait;
the run's own data threads are not other processes: the cores they take from the step are part
of the step), so that prediction and measurement stand on the same footing on a shared machine;
the plain median and quartiles show the load). Bytes: the host<->device bytes of a step from the cache counters (every
group's step traffic per sample times the batch, plus dense features and labels, as the plan
counts them; hot rows placed at the start and rows written back for checkpoints are not step
traffic). Bytes are compared only for specs with a group that is not device-resident (the
counters exist only there); `--device-budget` forces such placements.

Ratios:
    costmodel_max_step_error: max over specs of |predicted / measured - 1| (target <= 0.10), the
        measured step being the robust estimate; costmodel_median_step_error: the median over specs;
        costmodel_max_step_error_wall_median: the same against the plain median wall time (the load included);
        costmodel_max_step_error_fastest_quartile: the same against each spec's fastest-quartile
        step (less of the other processes' load on a shared machine).
    costmodel_max_bytes_error: the same for host<->device bytes per step (target <= 0.20).

Usage:
    python tools/bench_costmodel.py [--steps 20] [--profile FILE] [--device-budget 64MiB] [--cache POLICY]
        [--specs a.yaml,b.yaml] [--threads N] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from flowrec.measure import robust  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 1200
SYNTH_ROWS = 8192  # synthetic rows per spec (every spec's batch is <= 4096)
EPOCHS = 100  # enough epochs for --steps over a few thousand rows
WARMUP_STEPS = 2  # steps whose compute time (first-call set-up) is not counted
FLOAT_BYTES = 4  # dense features and labels travel as float32


STEP_TIMES = "FLOWREC_BENCH_STEP_SECONDS "  # the harness's last line: this marker, then JSON
HARNESS = f"""
import json, sys
from flowrec.measure import robust
from flowrec.runtime import trainer
seconds = []
step = trainer.Trainer._step
clock = robust.SchedClock(exclude=robust.python_side_threads)  # the data threads are the run's own
def timed(self, batch):
    started = clock.start()
    out = step(self, batch)
    r = clock.stop(started)
    seconds.append([r.wall, r.waited])
    return out
trainer.Trainer._step = timed
from flowrec.cli import main
sys.argv = ["flowrec", *sys.argv[1:]]
try:
    main()
finally:
    print("{STEP_TIMES}" + json.dumps(seconds), flush=True)
"""


THREADS: dict[str, str] = {}  # --threads: OMP_NUM_THREADS of every flowrec process (calibration and runs)


def flowrec(*args: str, cwd: Path, timed: bool = False) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO), **THREADS}
    command = ["-c", HARNESS] if timed else ["-m", "flowrec"]
    done = subprocess.run([sys.executable, *command, *args], cwd=cwd, env=env, timeout=RUN_TIMEOUT_S,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"flowrec {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def train_json(spec: Path, data: Path, profile: Path, steps: int, out: Path, tmp: Path,
               budget: str | None, cache: str | None) -> tuple[dict[str, Any], list[list[float]]]:
    """The run's `--json` result and [wall seconds, other processes' run-queue wait] of each of its steps."""
    text = flowrec("train", str(spec), "--data", str(data), "--max-steps", str(steps), "--epochs", str(EPOCHS),
                   "--target", str(profile), "--device", "cpu", "--out", str(out), "--quiet", "--json",
                   "--eval-every", "0", *(["--device-budget", budget] if budget else []),
                   *(["--cache", cache] if cache else []), cwd=tmp, timed=True)
    body, _, times = text.rpartition(STEP_TIMES)
    return json.loads(body[body.index("{"):]), json.loads(times)


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of `values` (linear interpolation)."""
    ordered = sorted(values)
    pos = q * (len(ordered) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def measured_bytes_per_step(counters: dict[str, Any], batch: int, dense_and_labels: int) -> float:
    """Host<->device bytes of a full training step, as the plan predicts them: every group's step
    traffic per sample times the batch (FAE's hot/cold batches and an epoch's last batch are
    shorter), plus the dense features and labels (float32)."""
    groups = sum((c["h2d_bytes"] + c["d2h_bytes"]) / max(c["samples"], 1) for c in counters.values())
    return groups * batch + batch * dense_and_labels * FLOAT_BYTES


def measure_spec(spec: Path, profile: Path, steps: int, tmp: Path, budget: str | None,
                 cache: str | None = None) -> dict[str, Any]:
    """Predicted vs measured for one spec: one run of WARMUP_STEPS + `steps` steps; the measured
    step is the robust estimate (`flowrec.measure.robust`) over the steps after WARMUP_STEPS."""
    data = tmp / f"{spec.stem}-data"
    flowrec("data", "synth", str(spec), "--rows", str(SYNTH_ROWS), "--out", str(data), cwd=tmp)
    result, seconds = train_json(spec, data, profile, WARMUP_STEPS + steps, tmp / spec.stem, tmp, budget, cache)
    plan = json.loads((tmp / spec.stem / "plan.json").read_text())
    cost = plan["cost"]
    rounds = [robust.Round(w * 1e3, q * 1e3) for w, q in seconds[WARMUP_STEPS:]]
    timed = [r.wall for r in rounds]
    robust_ms = robust.estimate(rounds)
    measured_ms = robust_ms.seconds
    predicted_ms = cost["step_ms_overlap"]
    row = {"spec": spec.name, "steps": len(timed), "batch": cost["batch_size"],
           "predicted_step_ms": predicted_ms,
           "predicted_compute_ms": cost["step_ms_serial"] - cost["stage_ms"]["staging"],
           "predicted_stage_ms": cost["stage_ms"], "measured_step_ms": measured_ms,
           "measured_clean_steps": robust_ms.clean, "measured_method": robust_ms.method,
           "measured_step_ms_median": quantile(timed, 0.5),
           "measured_wait_ms_median": quantile([r.waited for r in rounds], 0.5),
           "measured_step_ms_quartiles": [quantile(timed, 0.25), quantile(timed, 0.75)],
           "measured_step_ms_mean": sum(timed) / len(timed),
           "measured_staging_wait_ms": result["stage_seconds"].get("staging_wait", 0.0) / max(result["steps"], 1) * 1e3,
           "step_error": predicted_ms / measured_ms - 1.0,
           "step_error_fastest_quartile": predicted_ms / quantile(timed, 0.25) - 1.0,
           "step_error_wall_median": predicted_ms / quantile(timed, 0.5) - 1.0}
    if result["counters"]:
        model = load_spec(spec)
        measured = measured_bytes_per_step(result["counters"], cost["batch_size"],
                                           len(model.dense_features) + len(model.heads))
        row["measured_h2d_bytes"] = measured
        row["predicted_h2d_bytes"] = cost["h2d_bytes_per_step"]
        row["bytes_error"] = cost["h2d_bytes_per_step"] / measured - 1.0 if measured else None
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help=f"timed training steps per spec (after {WARMUP_STEPS} warm-up steps)")
    parser.add_argument("--profile", type=Path, default=None,
                        help="a profile from `flowrec calibrate` for every spec (default: calibrate each spec before its run)")
    parser.add_argument("--device-budget", default=None, help="device budget of every run (forces cache/host placements)")
    parser.add_argument("--cache", default=None, help="cache policy of every run (auto, none, static_hot, lookahead)")
    parser.add_argument("--specs", default="", help="comma-separated spec file names (default: all of specs/)")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/costmodel_cpu.json")
    parser.add_argument("--threads", type=int, default=None,
                        help="compute threads of calibration and runs (OMP_NUM_THREADS; default: torch's, one per core)")
    args = parser.parse_args()
    if args.threads:
        THREADS["OMP_NUM_THREADS"] = str(args.threads)
    specs = sorted((REPO / "specs").glob("*.yaml"))
    if args.specs:
        specs = [s for s in specs if s.name in args.specs.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp_name:
        tmp = Path(tmp_name)
        rows, calibrations = [], {}
        for spec in specs:
            profile = args.profile or tmp / f"{spec.stem}-profile.json"
            try:
                if args.profile is None:
                    flowrec("calibrate", str(spec), "--device", "cpu", "--out", str(profile), cwd=tmp)
                doc = json.loads(Path(profile).read_text())
                calibrations[spec.name] = {"seconds": doc.get("details", {}).get("seconds"),
                                           **{k: v["value"] for k, v in doc["measured"].items()}}
                rows.append(measure_spec(spec, Path(profile), args.steps, tmp, args.device_budget, args.cache))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append({"spec": spec.name, "error": str(exc)})
            print(json.dumps(rows[-1]), flush=True)
    steps = [abs(r["step_error"]) for r in rows if "step_error" in r]
    quick = [abs(r["step_error_fastest_quartile"]) for r in rows if "step_error" in r]
    plain = [abs(r["step_error_wall_median"]) for r in rows if "step_error" in r]
    byte_errors = [abs(r["bytes_error"]) for r in rows if r.get("bytes_error") is not None]
    result = {
        "benchmark": "costmodel",
        "calibration": calibrations if args.profile is None else {"given": str(args.profile),
                                                                  **next(iter(calibrations.values()), {})},
        "device_budget": args.device_budget,
        "threads": args.threads,
        "cache": args.cache,
        "specs": rows,
        "ratios": {"costmodel_max_step_error": max(steps) if steps else None,
                   "costmodel_median_step_error": quantile(steps, 0.5) if steps else None,
                   "costmodel_max_step_error_fastest_quartile": max(quick) if quick else None,
                   "costmodel_max_step_error_wall_median": max(plain) if plain else None,
                   "costmodel_max_bytes_error": max(byte_errors) if byte_errors else None},
        "bytes_compared_specs": [r["spec"] for r in rows if r.get("bytes_error") is not None],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
