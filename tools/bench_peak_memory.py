"""The planner's peak memory estimate against the measured peak of a short CPU run.

For each case (a spec of specs/, optionally with its mixture of experts enlarged) one child
process imports flowrec, records its resident memory (VmRSS), trains `--steps` steps on synthetic
rows with `flowrec.train` (device cpu, no run folder) and records its high-water mark (VmHWM).
The measured peak is VmHWM minus that baseline: everything the run allocated (model, optimizer
state, data, workspaces). The estimate is what `flowrec plan --target cpu` predicts and what
`flowrec.planner.fit` compares with host memory (`plan_need`). The ratio estimate / measured
justifies `flowrec.planner.fit.FIT_MARGIN`. One run, no assertions: a measurement.

Usage:
    python tools/bench_peak_memory.py [--steps 3] [--rows 4096] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

CASES = {  # name -> (spec file, experts, expert layers, batch size): None keeps the spec's
    "din_taobao": ("din_taobao.yaml", None, None, None),
    "dlrm_criteo": ("dlrm_criteo.yaml", None, None, None),
    "mmoe_16x2048": ("mmoe_movielens.yaml", 16, [2048, 2048], None),
    "dlrm_criteo_b65536": ("dlrm_criteo.yaml", None, None, 65536),  # activations a quarter of the need
}

CHILD = r"""
import json, sys
from dataclasses import replace
from flowrec.spec import load_spec
from flowrec.spec.model import ModelSpec

def rss(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise SystemExit(key + " not found")

path, experts, layers, steps, rows = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
batch = json.loads(sys.argv[6])
spec = load_spec(path)
if batch is not None:
    spec = replace(spec, training=replace(spec.training, batch_size=batch))
    rows = max(rows, 2 * batch)
if experts is not None:
    mods = tuple(replace(m, params=tuple((k, experts if k == "experts" else tuple(layers) if k == "expert_layers" else v)
                                           for k, v in m.params)) if m.kind == "moe" else m for m in spec.modules)
    spec = replace(spec, modules=mods)
spec = replace(spec, data=None)
from flowrec.planner.manager import make_plan
from flowrec.planner.fit import plan_need
plan = make_plan(spec, target="cpu")
need, parts = plan_need(plan, host_is_device=True)
import flowrec.api as api
import torch
torch.set_num_threads(1)
base = rss("VmRSS")
api.train(spec, device="cpu", max_steps=steps, rows=rows, epochs=1)
print(json.dumps({"estimate_bytes": need, "measured_bytes": rss("VmHWM") - base, "baseline_rss_bytes": base,
                  "largest": parts[:3]}))
"""


def measure(spec: str, experts, layers, batch, steps: int, rows: int) -> dict:
    out = run_tree([sys.executable, "-c", CHILD, str(REPO / "specs" / spec), json.dumps(experts),
                    json.dumps(layers), str(steps), str(rows), json.dumps(batch)], capture_output=True, text=True,
                   timeout_s=1200, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    results = {}
    for name, (spec, experts, layers, batch) in CASES.items():
        r = measure(spec, experts, layers, batch, args.steps, args.rows)
        r["estimate_over_measured"] = round(r["estimate_bytes"] / r["measured_bytes"], 3)
        results[name] = r
        print(f"{name:14s} estimate {r['estimate_bytes'] / 2**20:9.1f} MiB  measured {r['measured_bytes'] / 2**20:9.1f} MiB"
              f"  ratio {r['estimate_over_measured']:.3f}", flush=True)
    doc = {"steps": args.steps, "rows": args.rows, "machine": platform.machine(), "cpus": os.cpu_count(),
           "loadavg": open("/proc/loadavg").read().split()[:3], "results": results}
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
