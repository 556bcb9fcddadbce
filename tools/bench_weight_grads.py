"""Which path a CPU's fp32 weight gradients should take: oneDNN (with the transposed copies it
needs), torch's `mm` (which reads transposed operands in place), or the choice by layer shape that
`operators.onednn` makes on a CPU whose AVX-512 runs on 256-bit units (`mm_weight_grad`).

Two measurements, side by side in one process:
- per layer of each model (`bench_dense_bound.linear_layers`): the weight gradient grad^T x at the
  batch size, through oneDNN and through `mm`, fresh skewed operands, the two alternating over
  `--rounds` rounds, the median of each (ms) and their ratio, and the path the shape rule picks;
- whole training steps of the model as `tools/bench_train.py` trains flowrec's (`flowrec_system`)
  with every weight gradient through oneDNN, by shape, and through `mm`: blocks of `--steps` steps
  of each, the order rotated every round, the median ms a step of each arm and its ratio to all-oneDNN.

The arms set the module's decisions (`_WEIGHT_GRADS_BY_ONEDNN`, `_WEIGHT_GRADS_BY_SHAPE`) for
the measurement only; what this machine chooses by itself is recorded (`machine.chooses`).

Usage:
    python tools/bench_weight_grads.py --models dlrm,wide1000 --json bench/results/weight_grads_cpu.json
    python tools/bench_weight_grads.py --quick   # small tables and batch: a smoke run, no speed figures
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dense_bound import _median_s, linear_layers  # noqa: E402
from bench_train import BATCH, MODELS, QUICK_BATCH, QUICK_TABLE_ROWS, REPO, capped_spec, flowrec_system, staged_batches  # noqa: E402

from flowrec.planner.manager import make_plan  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402
from operators import onednn  # noqa: E402

ARMS = {"onednn": (True, False), "by_shape": (True, True), "mm": (False, False)}  # (by oneDNN, by shape)


def _arm(name: str) -> None:
    onednn._WEIGHT_GRADS_BY_ONEDNN, onednn._WEIGHT_GRADS_BY_SHAPE = ARMS[name]


def layer_rows(key: str, batch: int, rounds: int) -> list[dict[str, Any]]:
    """Per linear layer of `key`: its weight gradient's median ms through oneDNN and `mm`, their
    ratio, and the shape rule's pick."""
    gen = torch.Generator().manual_seed(0)
    rows = []
    for layer in linear_layers(key, batch):
        out, fan_in = layer["out"], layer["in"]
        scale = torch.rand(batch, 1, generator=gen).pow(4).mul(20).add(0.1)  # a few large rows
        grad = torch.randn(batch, out, generator=gen) * scale + 1e-3
        x = torch.randn(batch, fan_in, generator=gen) * scale + 1e-3
        repeats = 3 if out * fan_in * batch > 1e9 else 15
        times: dict[str, list[float]] = {"onednn": [], "mm": []}
        for _ in range(rounds):
            for arm in times:
                _arm(arm)
                times[arm].append(_median_s(lambda: onednn._weight_grad(grad, x), repeats) * 1e3)
        med = {arm: statistics.median(v) for arm, v in times.items()}
        # ms to the nanosecond: a 16 x 64 layer takes 5 us, and 4 decimals moved its ratio by 1%
        rows.append({"layer": layer["name"], "out": out, "in": fan_in, "onednn_ms": round(med["onednn"], 6),
                     "mm_ms": round(med["mm"], 6), "mm_vs_onednn": round(med["mm"] / med["onednn"], 3),
                     "shape_rule": "mm" if onednn.mm_weight_grad(out, fan_in) else "onednn"})
    return rows


def step_arms(key: str, batch: int, cap: int | None, rounds: int, steps: int) -> dict[str, Any]:
    """Median ms of flowrec's training step of `key` per arm (ARMS), blocks of `steps` steps
    rotated over `rounds` rounds, and each arm's ratio to all-oneDNN."""
    spec = capped_spec(load_spec(REPO / MODELS[key]), cap, batch)
    plan = make_plan(spec, target="cpu")
    system = flowrec_system(plan, spec, "fp32")
    try:
        batches = [system.prepare(b) for b in staged_batches(spec, plan, batch * steps, 1, batch, lookahead=1)]
        for b in batches[:2]:  # warm-up
            system.step(b)
        names, ms = list(ARMS), {arm: [] for arm in ARMS}
        for r in range(rounds):
            for arm in names[r % len(names):] + names[:r % len(names)]:
                _arm(arm)
                start = time.perf_counter()
                for b in batches:
                    system.step(b)
                ms[arm].append((time.perf_counter() - start) / len(batches) * 1e3)
    finally:
        system.close()
    med = {arm: statistics.median(v) for arm, v in ms.items()}
    return {"step_ms": {arm: round(m, 3) for arm, m in med.items()},
            "vs_onednn": {arm: round(m / med["onednn"], 3) for arm, m in med.items()},
            "rounds_ms": {arm: [round(x, 2) for x in v] for arm, v in ms.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="dlrm,wide1000", help="comma list of: " + ",".join(MODELS))
    parser.add_argument("--rounds", type=int, default=6, help="rounds of each measurement (default 6)")
    parser.add_argument("--steps", type=int, default=6, help="training steps a block (default 6)")
    parser.add_argument("--quick", action="store_true", help="small tables and batch (a smoke run)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    keys = args.models.split(",")
    for key in keys:
        if key not in MODELS:
            parser.error(f"--models: unknown model {key!r} (one of {', '.join(MODELS)})")
    if args.rounds < 1 or args.steps < 1:
        parser.error("--rounds and --steps must be at least 1")
    if not onednn.available():
        parser.error("oneDNN is not available in this torch build: there is no choice to measure")
    batch, cap = (QUICK_BATCH, QUICK_TABLE_ROWS) if args.quick else (BATCH, None)
    chooses = {"gemm_library": onednn.gemm_library(), "weight_grads_by_onednn": onednn._onednn_weight_grads(),
               "by_shape": onednn._shape_weight_grads()}
    saved = (onednn._WEIGHT_GRADS_BY_ONEDNN, onednn._WEIGHT_GRADS_BY_SHAPE)
    try:
        models = {key: {"layers": layer_rows(key, batch, args.rounds),
                        "steps": step_arms(key, batch, cap, args.rounds, args.steps)} for key in keys}
    finally:
        onednn._WEIGHT_GRADS_BY_ONEDNN, onednn._WEIGHT_GRADS_BY_SHAPE = saved
    doc = {"benchmark": "weight_grads", "quick": args.quick, "batch": batch,
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "vendor": onednn.cpu_vendor(),
                       "family": onednn.cpu_family(), "torch_threads": torch.get_num_threads(), "chooses": chooses},
           "torch": torch.__version__, "models": models}
    for key, m in models.items():
        for row in m["layers"]:
            print(f"{key:9} {row['out']:6} x {row['in']:<6} oneDNN {row['onednn_ms']:9.3f} ms  mm {row['mm_ms']:9.3f} ms"
                  f"  mm/oneDNN {row['mm_vs_onednn']:.3f}  by shape: {row['shape_rule']}")
        print(f"{key:9} step ms: " + ", ".join(f"{a} {ms} ({m['steps']['vs_onednn'][a]}x)"
                                              for a, ms in m["steps"]["step_ms"].items()))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return doc


if __name__ == "__main__":
    main()
