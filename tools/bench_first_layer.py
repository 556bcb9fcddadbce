"""Whether wide_1000's first layer would gain from storing its weight column-major (W^T contiguous)
instead of row-major, as `operators.onednn._Sources` trains it now.

The deep MLP's input is its sources side by side (the dense features and each packed group's
lookups), a permutation of the spec's column order; `_Sources` gathers the weight's columns per
source in the forward (`index_select` along dim 1 of an (Out, In) weight) and scatters the weight
gradient back (`index_copy_` along dim 1). With the weight stored column-major both are row
copies of 2 KB rows (dim 0 of the (In, Out) transpose), and the GEMMs read the transposed operands.

Measured side by side in one process, alternating: the forward and backward of the first layer
(batch `--batch`, `--out` outputs, the sources' widths of `--spec`'s plan, the spec's fields in a
random order of columns; fresh skewed operands), as CPU time of the process (`time.process_time`:
what a loaded machine moves least), medians of `--rounds`; the outputs and gradients of the two
compared (bitwise where the threads' split of the sums is the same). `--threads 1` (the default)
times one core, the GEMMs at its peak: a 2-thread step gains about half the CPU time saved.

Usage:
    python tools/bench_first_layer.py --json bench/results/first_layer_cpu.json
    python tools/bench_first_layer.py --quick   # small shapes: a smoke run, no speed figures
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.runtime.hostmem import tune_host_allocator  # noqa: E402
from operators.onednn import gemm_library, linear_sources  # noqa: E402


class ColumnMajor(torch.autograd.Function):
    """`_Sources`' product with the weight stored as its transpose (In, Out), contiguous."""

    @staticmethod
    def forward(ctx, weight_t: torch.Tensor, bias: torch.Tensor, inverse: torch.Tensor, *flats: torch.Tensor):
        cols, start = [], 0
        for f in flats:
            cols.append(inverse[start:start + f.shape[1]])
            start += f.shape[1]
        parts = [weight_t.index_select(0, c) for c in cols]  # (w_i, Out) each, row copies
        y = torch.addmm(bias, flats[0], parts[0])
        for x, p in zip(flats[1:], parts[1:]):
            y.addmm_(x, p)
        ctx.cols = cols
        ctx.save_for_backward(*flats, *parts)
        return y  # (B, Out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        n = len(ctx.cols)
        flats, parts = ctx.saved_tensors[:n], ctx.saved_tensors[n:]
        grad = grad.contiguous()
        full_t = torch.empty(sum(p.shape[0] for p in parts), grad.shape[1])  # (In, Out)
        grads_x = []
        for x, p, c in zip(flats, parts, ctx.cols):
            grads_x.append(torch.mm(grad, p.t()))  # (B, w_i)
            full_t.index_copy_(0, c, torch.mm(x.t(), grad))  # (w_i, Out) rows scattered
        return (full_t, grad.sum(0), None, *grads_x)


def source_widths(spec_path: Path) -> tuple[list[int], list[tuple[int, int]]]:
    """The deep MLP's sources' widths in `spec_path`'s plan (dense first, then each packed group's
    fields that feed it) and its fields as (source, dim) in the spec's order."""
    from flowrec.planner.manager import make_plan
    from flowrec.spec import load_spec

    spec = load_spec(spec_path)
    plan = make_plan(spec, target="cpu")
    deep = {f.name for f in spec.features if hasattr(f, "table") and "deep" in (f.tags or ())}  # "@deep"
    dense = sum(1 for f in spec.features if not hasattr(f, "table"))
    widths, fields, source_of = [dense], [(0, 1)] * dense, {}
    for group in plan.meta.groups:
        members = [f for f in group.fields if f.feature in deep]
        if members:
            widths.append(len(members) * group.dim)
            for f in members:
                source_of[f.feature] = (len(widths) - 1, group.dim)
    fields += [source_of[f.name] for f in spec.features if f.name in source_of]
    return widths, fields


def inverse_order(widths: list[int], fields: list[tuple[int, int]], gen: torch.Generator) -> torch.Tensor:
    """Where each column of the sources side by side goes in the layer's input: the fields in a
    random order of the spec's columns, each source's fields in that order.  # (In,) int64"""
    order = torch.randperm(len(fields), generator=gen).tolist()
    spec_start, start = {}, 0
    for k in sorted(range(len(fields)), key=lambda k: order[k]):
        spec_start[k] = start
        start += fields[k][1]
    inverse: list[int] = []
    for source in range(len(widths)):
        for k in sorted((k for k in range(len(fields)) if fields[k][0] == source), key=lambda k: order[k]):
            inverse += range(spec_start[k], spec_start[k] + fields[k][1])
    return torch.tensor(inverse, dtype=torch.int64)


def measure(widths: list[int], inverse: torch.Tensor, batch: int, out: int, rounds: int,
            gen: torch.Generator) -> dict[str, Any]:
    """Both layouts' forward + backward, alternating; CPU ms medians and the largest differences."""
    fan_in = sum(widths)
    scale = torch.rand(batch, 1, generator=gen).pow(4).mul(20).add(0.1)  # a few large rows
    xs = [(torch.randn(batch, w, generator=gen) * scale).requires_grad_() for w in widths]
    weight = torch.randn(out, fan_in, generator=gen) / fan_in ** 0.5
    bias = torch.randn(out, generator=gen) * 0.1
    grad_y = torch.randn(batch, out, generator=gen) * scale

    def row_major():
        w, b = weight.clone().requires_grad_(), bias.clone().requires_grad_()
        y = linear_sources(xs, w, b, inverse)
        y.backward(grad_y)
        return y, w.grad, [x.grad for x in xs]

    weight_t = weight.t().contiguous()

    def column_major():
        w, b = weight_t.clone().requires_grad_(), bias.clone().requires_grad_()
        y = ColumnMajor.apply(w, b, inverse, *xs)
        y.backward(grad_y)
        return y, w.grad.t(), [x.grad for x in xs]

    def clear():
        for x in xs:
            x.grad = None

    arms = {"row_major": row_major, "column_major": column_major}
    results = {}
    for name, arm in arms.items():
        results[name] = arm()
        clear()
    if results["row_major"][0] is None:
        raise SystemExit("operators.onednn.linear_sources does not apply on this machine (fp32 oneDNN/MKL on the CPU)")
    (ya, gwa, gxa), (yb, gwb, gxb) = results["row_major"], results["column_major"]
    times: dict[str, list[float]] = {name: [] for name in arms}
    for r in range(rounds):
        for name in (list(arms) if r % 2 == 0 else list(arms)[::-1]):
            start = time.process_time()
            arms[name]()
            times[name].append(time.process_time() - start)
            clear()
    med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
    return {"row_major_cpu_ms": round(med["row_major"], 2), "column_major_cpu_ms": round(med["column_major"], 2),
            "saved_cpu_ms": round(med["row_major"] - med["column_major"], 2),
            "column_major_over_row_major": round(med["column_major"] / med["row_major"], 4),
            "max_abs_diff": {"y": (ya - yb).abs().max().item(), "weight_grad": (gwa - gwb).abs().max().item(),
                             "input_grads": max((a - b).abs().max().item() for a, b in zip(gxa, gxb))},
            "bitwise": {"y": torch.equal(ya, yb), "weight_grad": torch.equal(gwa, gwb),
                        "input_grads": all(torch.equal(a, b) for a, b in zip(gxa, gxb))},
            "rounds_cpu_ms": {name: [round(t * 1e3, 2) for t in v] for name, v in times.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", default=str(REPO / "specs" / "wide_1000.yaml"),
                        help="a spec shaped like wide_1000 (its deep MLP reads the dense features and the fields tagged deep) whose sources are measured (default specs/wide_1000.yaml)")
    parser.add_argument("--batch", type=int, default=4096, help="rows of a batch (default 4096, as bench_train)")
    parser.add_argument("--out", type=int, default=512, help="the first layer's outputs (default 512, wide_1000's)")
    parser.add_argument("--rounds", type=int, default=15, help="timed rounds of each layout, alternating (default 15)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1: one core's CPU time)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the operands and the column order")
    parser.add_argument("--quick", action="store_true", help="small shapes, 2 rounds: a smoke run, no speed figures")
    parser.add_argument("--json", help="write the figures to this JSON file")
    args = parser.parse_args(argv)
    for name in ("batch", "out", "rounds", "threads"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, not {getattr(args, name)}")
    tune_host_allocator()  # as `flowrec train` runs: large blocks reused, no page faults per step
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(args.seed)
    if args.quick:
        widths, fields = [3, 8, 16], [(0, 1)] * 3 + [(1, 4), (1, 4), (2, 8), (2, 8)]
        batch, out, rounds = 64, 16, 2
    else:
        widths, fields = source_widths(Path(args.spec))
        batch, out, rounds = args.batch, args.out, args.rounds
    inverse = inverse_order(widths, fields, gen)
    doc = {"benchmark": "first_layer", "spec": None if args.quick else Path(args.spec).name, "quick": args.quick,
           "batch": batch, "out": out, "in": sum(widths), "source_widths": widths, "threads": args.threads,
           "rounds": rounds, "gemm_library": gemm_library(), "torch": torch.__version__,
           "machine": platform.processor() or platform.machine(), **measure(widths, inverse, batch, out, rounds, gen)}
    print(f"first layer ({batch} x {sum(widths)} -> {out}, {len(widths)} sources, {args.threads} thread(s)), CPU ms "
          f"a forward + backward, medians of {rounds}: row-major {doc['row_major_cpu_ms']}, column-major "
          f"{doc['column_major_cpu_ms']} ({doc['column_major_over_row_major']}x); bitwise {doc['bitwise']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
