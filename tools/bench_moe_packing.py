"""MMoE training step with the experts packed into one batched kernel vs one MLP per expert.

specs/mmoe_movielens.yaml planned twice from the same spec: as planned (the `pack` pass packs the
experts, attr ``packed``) and with that one attribute removed (each expert its own MLP; the plan is
otherwise identical). Both train the same synthetic staged batches with `train_step`, alternating
step by step so machine noise hits both alike; the median step time of each and their ratio are
printed and written to JSON. One run, no assertions: a measurement.

Usage:
    python tools/bench_moe_packing.py [--experts 8] [--batch 1024] [--steps 60] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch
import yaml

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 5


def unpacked(plan):
    """The plan with its mixtures' ``packed`` attribute removed (experts run one by one)."""
    graph = plan.graph.copy()
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.attr("packed"):
            graph.nodes[node]["op"] = replace(op, attrs=tuple(kv for kv in op.attrs if kv[0] != "packed"))
    return replace(plan, graph=graph)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "moe_packing_cpu.json"))
    args = parser.parse_args()
    doc = yaml.safe_load((REPO / "specs" / "mmoe_movielens.yaml").read_text())
    doc.pop("data")
    doc["modules"][0]["experts"] = args.experts
    doc["training"]["batch_size"] = args.batch
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    table = synth_table(spec, args.batch * args.steps, SynthConfig(seed=1))
    opts = StagingOptions(batch_size=args.batch, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        batches = list(it)
    models = {}
    for name, p in (("packed", plan), ("unpacked", unpacked(plan))):
        model = lower(p, spec, "cpu")
        models[name] = (model, make_dense_optimizer(model, "adam", 1e-3, {}))
    times: dict[str, list[float]] = {name: [] for name in models}
    for i, batch in enumerate(batches):
        for name, (model, opt) in models.items():
            start = time.perf_counter()
            train_step(model, opt, batch)
            if i >= WARMUP_STEPS:
                times[name].append(time.perf_counter() - start)
    median = {name: statistics.median(t) * 1e3 for name, t in times.items()}
    ratio = median["unpacked"] / median["packed"]
    print(f"MMoE, {args.experts} experts of {doc['modules'][0]['expert_layers']}, batch {args.batch}: "
          f"packed {median['packed']:.2f} ms/step, unpacked {median['unpacked']:.2f} ms/step, "
          f"unpacked / packed = {ratio:.2f}")
    report = {"machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "experts": args.experts, "batch": args.batch, "steps_timed": len(times["packed"]),
              "median_ms": median, "unpacked_over_packed": ratio}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
