"""How `flowrec plan` scales with the number of categorical fields: 1k, 10k, 100k fields.

For each size, writes a wide spec (fields of dims 1/4/8/16 drawn with a seed, vocabularies of 10 to
10^6 rows, a tenth of them bags of 3 with mean pooling, all read by one concat into an MLP; few keys
per field, as the spec reader takes at most 1,000,000 values) as YAML in a temp dir, then times what `flowrec plan SPEC --json P` does, in this process:

  load     read, validate and convert the spec (`flowrec.spec.load.load_spec`)
  plan     build the graph and run the passes and the cost model (`make_plan`)
  json     the plan's JSON (`plan_json`)
  report   the text report (`text_report`)
  pack     the pack pass alone on the built graph

`--old-up-to N` also times the pack pass as it was before plan15 (each group rewrote every
consumer's slots, and merged pooled slots by growing tuples: quadratic), kept as the reference in
tests/unit/test_pack_scale.py, for sizes up to N (the old pass took over 5 minutes at 100k).
`--packing off` plans one group per table (the case where the old pass was slowest).

Usage: python tools/bench_plan_fields.py [--sizes 1000 10000 100000] [--packing on|off]
                                         [--old-up-to N] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DIMS = (1, 4, 8, 16)
SEED = 0


def spec_text(fields: int, packing: bool) -> str:
    """A wide spec of `fields` categorical fields (see the module docstring)."""
    rng = random.Random(SEED)
    lines = ["name: wide_fields", "features:", "  - {name: d0, type: dense}", "  - {name: d1, type: dense}"]
    for i in range(fields):
        dim = rng.choice(DIMS)
        rows = int(10 ** rng.uniform(1, 6))
        bag = ", max_len: 3, pooling: mean" if i % 10 == 0 else ""
        lines.append(f"  - {{name: f{i}, type: categorical, hash_buckets: {rows}, dim: {dim}{bag}}}")
    lines += [
        "modules:",
        "  - {name: deep_in, kind: concat, inputs: ['@dense', '@sparse']}",
        "  - {name: deep, kind: mlp, inputs: [deep_in], layers: [64]}",
        "heads:",
        "  - {name: ctr, input: deep, task: binary, loss: bce}",
        "training: {batch_size: 4096, epochs: 1}",
        f"plan: {{packing: {'true' if packing else 'false'}}}",
    ]
    return "\n".join(lines) + "\n"


def timed(fn):
    start = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - start


def measure(fields: int, packing: bool, old: bool, folder: Path) -> dict:
    from flowrec.graph.build import build_graph
    from flowrec.graph.plan_io import plan_json
    from flowrec.graph.types import PassContext
    from flowrec.planner.manager import make_plan
    from flowrec.planner.passes.pack import pack
    from flowrec.planner.report import text_report
    from flowrec.spec.load import load_spec

    path = folder / f"wide_{fields}.yaml"
    path.write_text(spec_text(fields, packing), encoding="utf-8")
    spec, load_s = timed(lambda: load_spec(path))
    plan, plan_s = timed(lambda: make_plan(spec))
    _, json_s = timed(lambda: plan_json(plan))
    _, report_s = timed(lambda: text_report(plan))
    graph, ctx = build_graph(spec), PassContext(spec=spec)
    packed, pack_s = timed(lambda: pack(graph, ctx))
    row = {"fields": fields, "packing": packing, "groups": len(plan.meta.groups), "seconds": {
        "load": round(load_s, 3), "plan": round(plan_s, 3), "json": round(json_s, 3),
        "report": round(report_s, 3), "pack": round(pack_s, 3)}}
    if old:
        sys.path.insert(0, str(REPO / "tests" / "unit"))
        from test_pack_scale import reference_pack, snapshot

        before, old_s = timed(lambda: reference_pack(graph, ctx))
        if snapshot(before.graph) != snapshot(packed.graph):
            raise SystemExit(f"error: the pack pass and the old one differ at {fields} fields")
        row["seconds"]["pack_old"] = round(old_s, 3)
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 100000],
                        help="numbers of categorical fields (default: 1000 10000 100000)")
    parser.add_argument("--packing", choices=("on", "off"), default="on",
                        help="pack tables of equal (dim, dtype, optimizer) (on, default) or one group per table")
    parser.add_argument("--old-up-to", type=int, default=0, metavar="N",
                        help="also time the old quadratic pack pass for sizes up to N (default 0: never)")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    if any(n < 1 for n in args.sizes):
        parser.error("--sizes must be positive")
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench_plan_fields_") as tmp:
        for n in args.sizes:
            row = measure(n, args.packing == "on", n <= args.old_up_to, Path(tmp))
            rows.append(row)
            print(json.dumps(row), flush=True)
    result = {"tool": "bench_plan_fields", "python": platform.python_version(), "machine": platform.machine(),
              "packing": args.packing, "rows": rows}
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    sys.exit(run_stoppable(main))
