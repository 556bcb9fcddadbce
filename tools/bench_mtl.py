"""Multi-task and regularisation benchmark on MovieLens 100K: per-head test AUC over seeds.

Two comparisons, each model trained by `flowrec.api.train` on the spec's data binding (the same
80/20 split for every run; only the training seed changes):

- multi-task (specs/mmoe_movielens.yaml, heads like = rating >= 4 and love = rating = 5):
  shared-bottom (one 128-64 MLP under both towers), MMoE (4 experts of 128-64, a gate per head)
  and PLE (one CGC level: 1 expert per head + 2 shared, 128-64);
- regularisation: DeepFM (specs/movielens.yaml) against the same DeepFM with batch norm and
  dropout 0.2 in its deep part and L2 on the item table (specs/deepfm_regularized.yaml).

Prints one line per model and head (mean and standard deviation over the seeds) and writes every
run's metrics to JSON.

Usage:
    python tools/bench_mtl.py [--seeds 0,1,2] [--epochs N] [--comparisons multitask,regularisation]
                              [--json bench/results/mtl_movielens_cpu.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import yaml

from flowrec import api
from flowrec.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[1]
EXPERT_LAYERS = [128, 64]


def spec_doc(name: str) -> dict[str, Any]:
    """A spec of specs/ as a document, its data path made absolute."""
    path = REPO / "specs" / f"{name}.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["data"]["path"] = str((path.parent / doc["data"]["path"]).resolve())
    return doc


def multitask_variants() -> dict[str, dict[str, Any]]:
    """Shared-bottom, MMoE and PLE versions of specs/mmoe_movielens.yaml (same towers and heads)."""
    mmoe = spec_doc("mmoe_movielens")
    shared = copy.deepcopy(mmoe)
    shared["modules"][0] = {"name": "bottom", "kind": "mlp", "inputs": ["@sparse"], "layers": EXPERT_LAYERS}
    shared["modules"][1]["inputs"] = ["bottom"]
    shared["modules"][2]["inputs"] = ["bottom"]
    ple = copy.deepcopy(mmoe)
    ple["modules"][0] = {"name": "experts", "kind": "ple", "inputs": ["@sparse"], "levels": 1,
                         "shared_experts": 2, "task_experts": 1, "expert_layers": EXPERT_LAYERS,
                         "heads": ["like", "love"]}
    return {"shared_bottom": shared, "mmoe": mmoe, "ple": ple}


def regularisation_variants() -> dict[str, dict[str, Any]]:
    return {"deepfm": spec_doc("movielens"), "deepfm_regularized": spec_doc("deepfm_regularized")}


def run(doc: dict[str, Any], seed: int, epochs: int | None) -> dict[str, Any]:
    started = time.perf_counter()
    result = api.train(spec_from_dict(doc), seed=seed, epochs=epochs, device="cpu")
    return {"seed": seed, "seconds": time.perf_counter() - started,
            "metrics": {head: {k: v for k, v in m.items()} for head, m in result.metrics.items()}}


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Mean and standard deviation of each head's AUC over the runs."""
    out = {}
    for head in runs[0]["metrics"]:
        aucs = [r["metrics"][head]["auc"] for r in runs]
        out[head] = {"auc_mean": statistics.mean(aucs), "auc_std": statistics.stdev(aucs) if len(aucs) > 1 else 0.0,
                     "aucs": aucs}
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=None, help="override the specs' epochs")
    parser.add_argument("--comparisons", default="multitask,regularisation")
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "mtl_movielens_cpu.json"))
    args = parser.parse_args()
    data = Path(spec_doc("mmoe_movielens")["data"]["path"])
    if not (data / "u.data").is_file():
        print(f"MovieLens 100K not found at {data}; nothing to measure")
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    report: dict[str, Any] = {"machine": platform.machine(), "torch": torch.__version__,
                              "threads": torch.get_num_threads(), "seeds": seeds, "comparisons": {}}
    chosen = args.comparisons.split(",")
    for comparison, variants in (("multitask", multitask_variants()), ("regularisation", regularisation_variants())):
        if comparison not in chosen:
            continue
        report["comparisons"][comparison] = {}
        for name, doc in variants.items():
            runs = [run(doc, seed, args.epochs) for seed in seeds]
            summed = summary(runs)
            report["comparisons"][comparison][name] = {"runs": runs, "summary": summed}
            for head, s in summed.items():
                print(f"{comparison:<14} {name:<18} {head:<12} AUC {s['auc_mean']:.4f} +- {s['auc_std']:.4f} "
                      f"({', '.join(f'{a:.4f}' for a in s['aucs'])})", flush=True)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
