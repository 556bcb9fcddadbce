"""The trainer's step with the data threads at idle priority (the default where possible) and at
normal priority (`FLOWREC_DATA_PRIORITY=normal`), side by side, on a quiet machine or beside a
CPU-bound neighbour.

Trains a spec through `flowrec.api.train` on synthetic rows, one run per setting, the settings
alternating (ABBA...) `--pairs` times in one process; the step is the gap between consecutive
`on_step` calls after `--skip` steps (median, p10, p90 per run), and each run's wall time from the
call to its return. `--neighbour` starts one process that spins on a core for the whole
benchmark (a CPU-bound job sharing the machine) and stops it at the end.

Usage:
    python tools/bench_data_priority.py [--spec specs/dlrm_criteo.yaml] [--precision bf16]
        [--device cpu] [--steps 80] [--pairs 3] [--neighbour] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.data import priority  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402
from bench_transfer import trained_steps  # noqa: E402  (tools/)

SPIN = "import time\nend = time.time() + {seconds}\nwhile time.time() < end: pass\n"


def run(spec, setting: str, device: str, steps: int, skip: int) -> dict:
    os.environ[priority.ENV] = setting
    row = trained_steps(spec, device, steps, skip, seed=3)
    return {"setting": setting, "idle_in_effect": setting == "idle" and priority.enabled(), **row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "specs" / "dlrm_criteo.yaml")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="default: the spec's")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--skip", type=int, default=10)
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--neighbour", action="store_true", help="a CPU-bound process beside the runs")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.steps <= args.skip + 2:
        parser.error("--steps must exceed --skip + 2")
    spec = replace(load_spec(args.spec), data=None)
    if args.precision:
        spec = replace(spec, training=replace(spec.training, precision=args.precision))
    saved = os.environ.get(priority.ENV)
    neighbour = None
    if args.neighbour:
        neighbour = subprocess.Popen([sys.executable, "-c", SPIN.format(seconds=3600)])
    doc = {"spec": str(args.spec), "precision": spec.training.precision, "device": args.device,
           "torch": torch.__version__, "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
           else os.cpu_count(), "neighbour": args.neighbour, "steps": args.steps, "skip": args.skip, "runs": []}
    try:
        for pair in range(args.pairs):
            order = ("idle", "normal") if pair % 2 == 0 else ("normal", "idle")
            for setting in order:
                row = run(spec, setting, args.device, args.steps, args.skip)
                doc["runs"].append(row)
                print(f"{setting:6s} step {row['step_ms_median']:8.2f} ms median (p10 {row['step_ms_p10']:.2f}, "
                      f"p90 {row['step_ms_p90']:.2f}), steps {row['steps_s']:.2f} s, run {row['run_s']:.1f} s",
                      flush=True)
    finally:
        if neighbour is not None:
            neighbour.kill()
            neighbour.wait(timeout=10)
        if saved is None:
            os.environ.pop(priority.ENV, None)
        else:
            os.environ[priority.ENV] = saved
    for setting in ("idle", "normal"):
        rows = [r for r in doc["runs"] if r["setting"] == setting]
        doc[setting] = {"step_ms_median_range": [min(r["step_ms_median"] for r in rows),
                                                 max(r["step_ms_median"] for r in rows)],
                        "steps_s_median": statistics.median(r["steps_s"] for r in rows)}
    print(json.dumps({k: doc[k] for k in ("idle", "normal")}))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
