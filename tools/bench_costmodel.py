"""Cost-model benchmark: predicted against measured step time and host<->device bytes per spec.

Calibrates this machine (`flowrec calibrate --out`, unless --profile is given), then for every spec
in specs/ trains a few thousand synthetic rows (`flowrec data synth`, then `flowrec train SPEC
--data DIR --target PROFILE --json`, a few steps; the planner samples that data for its access
model) and compares the plan's prediction (`plan.json` of the run: `cost.step_ms_overlap`,
`cost.h2d_bytes_per_step`) with the measurement: compute seconds per step, as `flowrec train
--report` shows them, of the steps after WARMUP_STEPS (two runs, the difference; wall seconds per
step are recorded too), and the host<->device bytes of a step from the cache counters (every
group's step traffic per sample times the batch, plus dense features and labels, as the plan
counts them; hot rows placed at the start and rows written back for checkpoints are not step
traffic). Bytes are compared only for specs with a group that is not device-resident (the
counters exist only there); `--device-budget` forces such placements.

Ratios:
    costmodel_max_step_error: max over specs of |predicted / measured - 1| (target <= 0.10).
    costmodel_max_bytes_error: the same for host<->device bytes per step (target <= 0.20).

Usage:
    python tools/bench_costmodel.py [--steps 12] [--profile FILE] [--device-budget 64MiB] [--cache POLICY]
        [--specs a.yaml,b.yaml] [--json PATH]
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
from flowrec.spec import load_spec  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 1200
SYNTH_ROWS = 8192  # synthetic rows per spec (every spec's batch is <= 4096)
EPOCHS = 100  # enough epochs for --steps over a few thousand rows
WARMUP_STEPS = 2  # steps whose compute time (first-call set-up) is not counted
FLOAT_BYTES = 4  # dense features and labels travel as float32


def flowrec(*args: str, cwd: Path) -> str:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run([sys.executable, "-m", "flowrec", *args], cwd=cwd, env=env, timeout=RUN_TIMEOUT_S,
                          capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"flowrec {' '.join(args)} failed: {done.stderr.strip().splitlines()[-1:]}")
    return done.stdout


def train_json(spec: Path, data: Path, profile: Path, steps: int, out: Path, tmp: Path,
               budget: str | None, cache: str | None) -> dict[str, Any]:
    text = flowrec("train", str(spec), "--data", str(data), "--max-steps", str(steps), "--epochs", str(EPOCHS),
                   "--target", str(profile), "--device", "cpu", "--out", str(out), "--quiet", "--json",
                   "--eval-every", "0", *(["--device-budget", budget] if budget else []),
                   *(["--cache", cache] if cache else []), cwd=tmp)
    return json.loads(text[text.index("{"):])


def measured_bytes_per_step(counters: dict[str, Any], batch: int, dense_and_labels: int) -> float:
    """Host<->device bytes of a full training step, as the plan predicts them: every group's step
    traffic per sample times the batch (FAE's hot/cold batches and an epoch's last batch are
    shorter), plus the dense features and labels (float32)."""
    groups = sum((c["h2d_bytes"] + c["d2h_bytes"]) / max(c["samples"], 1) for c in counters.values())
    return groups * batch + batch * dense_and_labels * FLOAT_BYTES


def measure_spec(spec: Path, profile: Path, steps: int, tmp: Path, budget: str | None,
                 cache: str | None = None) -> dict[str, Any]:
    """Predicted vs measured for one spec; the measured step is the compute seconds of `steps`
    steps beyond WARMUP_STEPS (a run of WARMUP_STEPS + steps minus one of WARMUP_STEPS)."""
    data = tmp / f"{spec.stem}-data"
    flowrec("data", "synth", str(spec), "--rows", str(SYNTH_ROWS), "--out", str(data), cwd=tmp)
    warm = train_json(spec, data, profile, WARMUP_STEPS, tmp / f"{spec.stem}-warm", tmp, budget, cache)
    result = train_json(spec, data, profile, WARMUP_STEPS + steps, tmp / spec.stem, tmp, budget, cache)
    plan = json.loads((tmp / spec.stem / "plan.json").read_text())
    cost = plan["cost"]
    measured_ms = (result["stage_seconds"]["compute"] - warm["stage_seconds"]["compute"]) / steps * 1e3
    row = {"spec": spec.name, "steps": steps, "batch": cost["batch_size"],
           "predicted_step_ms": cost["step_ms_overlap"], "measured_step_ms": measured_ms,
           "measured_wall_step_ms": (result["seconds"] - warm["seconds"]) / steps * 1e3,
           "step_error": cost["step_ms_overlap"] / measured_ms - 1.0}
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
    parser.add_argument("--steps", type=int, default=12, help="training steps per spec (the first warms up)")
    parser.add_argument("--profile", type=Path, default=None, help="a profile from `flowrec calibrate` (default: calibrate now)")
    parser.add_argument("--device-budget", default=None, help="device budget of every run (forces cache/host placements)")
    parser.add_argument("--cache", default=None, help="cache policy of every run (auto, none, static_hot, lookahead)")
    parser.add_argument("--specs", default="", help="comma-separated spec file names (default: all of specs/)")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/costmodel_cpu.json")
    args = parser.parse_args()
    specs = sorted((REPO / "specs").glob("*.yaml"))
    if args.specs:
        specs = [s for s in specs if s.name in args.specs.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-cost-") as tmp_name:
        tmp = Path(tmp_name)
        profile = args.profile or tmp / "profile.json"
        if args.profile is None:
            flowrec("calibrate", str(REPO / "specs/dlrm_criteo.yaml"), "--device", "cpu", "--out", str(profile), cwd=tmp)
        calibration = json.loads(Path(profile).read_text())
        rows = []
        for spec in specs:
            try:
                rows.append(measure_spec(spec, Path(profile), args.steps, tmp, args.device_budget, args.cache))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append({"spec": spec.name, "error": str(exc)})
            print(json.dumps(rows[-1]), flush=True)
    steps = [abs(r["step_error"]) for r in rows if "step_error" in r]
    byte_errors = [abs(r["bytes_error"]) for r in rows if r.get("bytes_error") is not None]
    result = {
        "benchmark": "costmodel",
        "calibration": {k: v["value"] for k, v in calibration["measured"].items()},
        "device_budget": args.device_budget,
        "cache": args.cache,
        "specs": rows,
        "ratios": {"costmodel_max_step_error": max(steps) if steps else None,
                   "costmodel_max_bytes_error": max(byte_errors) if byte_errors else None},
        "bytes_compared_specs": [r["spec"] for r in rows if r.get("bytes_error") is not None],
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
