"""A lookahead plan's host <-> device bytes per step over runs of several epochs, priced and measured.

The planner prices a lookahead group's traffic over the run's epochs (`flowrec train --epochs`,
`flowrec plan --epochs`; `flowrec.planner.access.EpochCounts.fetches`): its scratchpad keeps its
rows from one epoch to the next, so a dataset of a few dozen batches fetches fewer rows a step in
later epochs, and rows still resident when the run ends are never written back in a step. This
runs `flowrec train` on synthetic data of `--rows` rows for each of `--epochs` (the trainer's own
plan: FAE's sample of the data, `--device-budget`, `--cache lookahead`) and compares the plan's
`h2d_bytes_per_step` with the run's counted bytes per step (`tools/bench_costmodel.py`'s
measure: every group's h2d + d2h bytes a sample times the batch, plus dense features and labels),
beside the price of one epoch (the plan of the same data's one-epoch run: the same seeded sample,
the same scratchpad; before round 38 every run was priced so, and with every fetched row written
back). No timing: the figures are counts, the same on any machine.

Usage:
    python tools/bench_epoch_traffic.py --specs avazu.yaml,two_task.yaml --rows 94208,200000 \\
        --epochs 1,3 --json bench/results/epoch_traffic.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

_bench_spec = importlib.util.spec_from_file_location("bench_costmodel", REPO / "tools" / "bench_costmodel.py")
bench = importlib.util.module_from_spec(_bench_spec)
_bench_spec.loader.exec_module(bench)

from flowrec.spec.load import load_spec  # noqa: E402


def run_bytes(spec: Path, data: Path, epochs: int, work: Path, budget: str) -> tuple[float, float, list[str]]:
    """(priced, measured) bytes a step of a `flowrec train` run of `epochs` epochs, and its placements."""
    out = work / f"{data.name}-e{epochs}"
    text = bench.flowrec("train", str(spec), "--data", str(data), "--epochs", str(epochs), "--device", "cpu",
                         "--device-budget", budget, "--cache", "lookahead", "--out", str(out), "--quiet", "--json",
                         "--eval-every", "0", cwd=work)
    result = json.loads(text[text.index("{"):text.rindex("}") + 1])
    plan = json.loads((out / "plan.json").read_text())
    model = load_spec(spec)
    measured = bench.measured_bytes_per_step(result["counters"], model.training.batch_size,
                                             len(model.dense_features) + len(model.heads))
    return float(plan["cost"]["h2d_bytes_per_step"]), measured, [g["placement"] for g in plan["groups"]]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--specs", default="avazu.yaml", help="comma-separated spec files in specs/")
    ap.add_argument("--rows", default="94208", help="synthetic rows per spec, comma-separated (one for all, or one each)")
    ap.add_argument("--epochs", default="1,3", help="epochs of each run, comma-separated (default 1,3)")
    ap.add_argument("--device-budget", default="64MiB", help="device budget of the runs (default 64MiB)")
    ap.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "epoch_traffic_cpu.json")
    args = ap.parse_args(argv)
    specs = [s.strip() for s in args.specs.split(",") if s.strip()]
    try:
        rows = [int(r) for r in args.rows.split(",")]
        epochs = [int(e) for e in args.epochs.split(",")]
    except ValueError as exc:
        ap.error(f"--rows and --epochs are comma-separated whole numbers: {exc}")
    if len(rows) not in (1, len(specs)) or min(rows) < 1 or not epochs or min(epochs) < 1:
        ap.error("--rows: one positive count, or one per spec; --epochs: positive counts")
    out: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-epoch-traffic-") as tmp:
        work = Path(tmp)
        for spec_name, n in zip(specs, rows * len(specs) if len(rows) == 1 else rows):
            spec = REPO / "specs" / spec_name
            if not spec.is_file():
                ap.error(f"no spec {spec}")
            data = work / f"{spec.stem}-{n}"  # a spec may come twice, with other rows
            bench.flowrec("data", "synth", str(spec), "--rows", str(n), "--out", str(data), cwd=work)
            batch = load_spec(spec).training.batch_size
            runs = {e: run_bytes(spec, data, e, work, args.device_budget) for e in sorted({1, *epochs})}
            for e in epochs:
                priced, measured, placements = runs[e]
                one = runs[1][0]  # the same plan priced for one epoch (the E = 1 run's: the same sample)
                row = {"spec": spec_name, "rows": n, "batches_per_epoch": -(-n // batch), "epochs": e,
                       "placements": placements, "priced_bytes": priced, "one_epoch_priced_bytes": one,
                       "measured_bytes": round(measured, 1), "error": round(priced / measured - 1.0, 4),
                       "one_epoch_error": round(one / measured - 1.0, 4)}
                out.append(row)
                print(f"{spec_name:<22} {row['batches_per_epoch']:>5} batches x {e} epochs  {placements}  "
                      f"measured {measured:>12,.0f} B/step  priced {priced:>12,.0f} ({row['error']:+.3f})  "
                      f"one-epoch price {one:>12,.0f} ({row['one_epoch_error']:+.3f})", flush=True)
    doc = {"benchmark": "epoch_traffic", "host": platform.node(), "device_budget": args.device_budget,
           "runs": out, "max_abs_error": max(abs(r["error"]) for r in out),
           "max_abs_one_epoch_error": max(abs(r["one_epoch_error"]) for r in out)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
