"""How fast any system could train a spec's dense part on this machine: the sum of the GEMMs its
linear layers must run, each timed alone with the fastest implementation torch has here, against
the step times of `tools/bench_train.py`.

Every system that trains the model (flowrec, TorchRec, plain PyTorch) runs, each step, the same
three GEMMs per linear layer at batch B: the forward (B x in x out), the input gradient (B x out x
in; not for the first layer of a module fed by dense features alone) and the weight gradient (out
x B x in). Their summed time is a lower bound on the dense part of a step (everything else: the
interaction, activations, the loss, the optimizer, the whole sparse side, is left out). So, with
TorchRec's measured step T, no system reaches more than T / bound times TorchRec here: the ratio
a goal such as "wide_1000 >= 3x TorchRec in bf16" needs is checked against what the arithmetic
allows on this CPU.

Each GEMM is timed as torch's `mm` and as oneDNN's linear (`torch.ops.mkldnn._linear_pointwise`,
flowrec's fp32 path), in fp32 and in bf16 (what autocast runs), and in bf16 also as the fp32
product of the bf16 values (`operators.lowp`, the same arithmetic as an emulated bf16 kernel; its
casts, elementwise passes, are left out like the activations), median of `--repeats` after a
warm-up; the fastest counts. Thread count: torch's default (the benchmark's).

Usage:
    python tools/bench_dense_bound.py --models wide1000,dlrm --json bench/results/dense_bound_cpu.json \\
        [--train-json bench/results/train_cpu.json ...]   # adds the ratio bounds from those runs
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
from typing import Any, Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_train import BATCH, MODELS, REPO, capped_spec  # noqa: E402

from flowrec.planner.manager import make_plan  # noqa: E402
from flowrec.runtime.lowering import lower  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def linear_layers(key: str, batch: int) -> list[dict[str, Any]]:
    """The dense model's linear layers: name, (out, in), whether its input needs a gradient."""
    spec = capped_spec(load_spec(REPO / MODELS[key]), 64, batch)  # tables do not change the dense part
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    dense_only = {m.name for m in spec.modules if m.inputs and all(i == "@dense" for i in m.inputs)}
    tables = {name for name, _ in model.embeddings.named_parameters(prefix="embeddings")}
    layers = []
    for name, p in model.named_parameters():
        if name in tables or p.dim() != 2:
            continue
        parts = name.split(".")
        first_of_dense = parts[1] in dense_only and parts[2:4] == ["layers", "0"]
        layers.append({"name": name, "out": p.shape[0], "in": p.shape[1], "input_grad": not first_of_dense})
    model.close()
    return layers


def _median_s(call: Callable[[], Any], repeats: int) -> float:
    call()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def gemm_seconds(m: int, k: int, n: int, dtype: torch.dtype, repeats: int) -> dict[str, float]:
    """a (m x k) times b^T (b: n x k): torch.mm and oneDNN's linear, median seconds each; in bf16
    also the fp32 product of the bf16 values (`operators.lowp.product`'s GEMM, what flowrec runs
    on a CPU without bf16 kernels: any system could), its casts left out."""
    gen = torch.Generator().manual_seed(m * 31 + k * 7 + n)
    a = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, k, generator=gen).to(dtype)
    out = {"mm": _median_s(lambda: torch.mm(a, b.t()), repeats)}
    linear = getattr(getattr(torch.ops, "mkldnn", None), "_linear_pointwise", None)
    if linear is not None and torch.backends.mkldnn.is_available():
        try:
            out["onednn"] = _median_s(lambda: linear(a, b, None, "none", [], ""), repeats)
        except Exception:  # noqa: BLE001 - not in this build / dtype: the other one counts
            pass
    if dtype == torch.bfloat16:  # the fp32 product of the bf16 values (`operators.lowp`; its casts are
        wide_a, wide_b = a.float(), b.float()  # elementwise passes, left out as activations are)
        out["fp32_of_bf16"] = _median_s(lambda: torch.mm(wide_a, wide_b.t()), repeats)
    return out


def bound(key: str, batch: int, precision: str, repeats: int) -> dict[str, Any]:
    dtype = DTYPES[precision]
    rows, total, flops = [], 0.0, 0
    for layer in linear_layers(key, batch):
        o, i = layer["out"], layer["in"]
        shapes = {"forward": (batch, i, o), "weight_grad": (o, batch, i)}
        if layer["input_grad"]:
            shapes["input_grad"] = (batch, o, i)
        for what, (m, k, n) in shapes.items():
            seconds = gemm_seconds(m, k, n, dtype, repeats)
            best = min(seconds.values())
            total += best
            flops += 2 * m * k * n
            rows.append({"layer": layer["name"], "gemm": what, "m_k_n": [m, k, n],
                         "ms": {impl: round(s * 1e3, 3) for impl, s in seconds.items()},
                         "gflops": round(2 * m * k * n / best / 1e9, 1)})
    return {"model": key, "precision": precision, "batch": batch, "gemms": rows,
            "dense_bound_ms": round(total * 1e3, 2), "gflop_per_step": round(flops / 1e9, 2),
            "gflops_at_bound": round(flops / total / 1e9, 1)}


def ratio_bounds(bounds: list[dict], train_files: list[Path]) -> list[dict]:
    """For each bench_train run: TorchRec's step against the bound, and flowrec's measured ratio;
    where the run has the plain model, the same for it (`plain_ratio_bound`: its step over the
    bound, the most any system could beat it by here; `plain_tables_capped_at`: the rows its
    tables were capped at to fit memory, None uncapped, since a cap shortens its step).

    Example:
        >>> import tempfile; p = Path(tempfile.mkdtemp()) / "t.json"
        >>> _ = p.write_text(json.dumps({"models": {"wide1000": {"plain_tables_capped_at": 299420, "precisions":
        ...     {"fp32": {"torchrec": {"ms_per_step": 2700.0}, "flowrec": {"ms_per_step": 1250.0},
        ...               "plain": {"ms_per_step": 8400.0}}}}}}))
        >>> r = ratio_bounds([{"model": "wide1000", "precision": "fp32", "dense_bound_ms": 1100.0}], [p])[0]
        >>> r["ratio_bound"], r["measured_plain_ratio"], r["plain_ratio_bound"], r["plain_tables_capped_at"]
        (2.455, 6.72, 7.636, 299420)
    """
    out = []
    for path in train_files:
        doc = json.loads(path.read_text())
        for b in bounds:
            model = doc.get("models", {}).get(b["model"], {})
            figs = model.get("precisions", {}).get(b["precision"])
            if not figs or not figs.get("torchrec") or not figs.get("flowrec"):
                continue
            torchrec, flowrec = figs["torchrec"]["ms_per_step"], figs["flowrec"]["ms_per_step"]
            row = {"train_json": str(path), "model": b["model"], "precision": b["precision"],
                   "torchrec_ms": torchrec, "flowrec_ms": flowrec, "dense_bound_ms": b["dense_bound_ms"],
                   "measured_ratio": round(torchrec / flowrec, 3),
                   "ratio_bound": round(torchrec / b["dense_bound_ms"], 3),
                   "flowrec_ms_over_bound": round(flowrec / b["dense_bound_ms"], 3)}
            plain = (figs.get("plain") or {}).get("ms_per_step")
            if plain:
                row.update(plain_ms=plain, measured_plain_ratio=round(plain / flowrec, 3),
                           plain_ratio_bound=round(plain / b["dense_bound_ms"], 3),
                           plain_tables_capped_at=model.get("plain_tables_capped_at"))
            out.append(row)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="wide1000,dlrm", help="comma list of: " + ",".join(MODELS))
    parser.add_argument("--precisions", default="fp32,bf16")
    parser.add_argument("--batch", type=int, default=BATCH)
    parser.add_argument("--repeats", type=int, default=5, help="timed calls of each GEMM (median)")
    parser.add_argument("--train-json", type=Path, nargs="*", default=[],
                        help="bench_train.py results: adds TorchRec's step against the bound")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    for key in args.models.split(","):
        if key not in MODELS:
            parser.error(f"--models: unknown model {key!r} (one of {', '.join(MODELS)})")
    for precision in args.precisions.split(","):
        if precision not in DTYPES:
            parser.error(f"--precisions: unknown precision {precision!r} (fp32 or bf16)")
    bounds = [bound(key, args.batch, precision, args.repeats)
              for key in args.models.split(",") for precision in args.precisions.split(",")]
    doc = {"benchmark": "dense_bound", "machine": {
        "platform": platform.platform(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
        "cpu_flags": sorted({f for f in _cpu_flags() if f.startswith(("avx", "amx", "fma"))}),
        "load_average": list(os.getloadavg())},
        "torch": torch.__version__, "bounds": bounds, "ratio_bounds": ratio_bounds(bounds, args.train_json)}
    for b in bounds:
        print(f"{b['model']:9} {b['precision']}: dense GEMMs >= {b['dense_bound_ms']:8.1f} ms a step "
              f"({b['gflop_per_step']} GFLOP at {b['gflops_at_bound']} GFLOP/s)")
    for r in doc["ratio_bounds"]:
        print(f"{r['model']:9} {r['precision']}: TorchRec {r['torchrec_ms']} ms, flowrec {r['flowrec_ms']} ms "
              f"(measured {r['measured_ratio']}x); no system can beat TorchRec by more than "
              f"{r['ratio_bound']}x here ({r['train_json']})")
        if "plain_ms" in r:
            capped = r["plain_tables_capped_at"]
            print(f"{'':9} plain {r['plain_ms']} ms{f' (tables capped at {capped:,} rows)' if capped else ''}: "
                  f"measured {r['measured_plain_ratio']}x; no system can beat it by more than "
                  f"{r['plain_ratio_bound']}x here")
    if args.json:
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


def _cpu_flags() -> list[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line.split(":", 1)[1].split()
    except OSError:
        pass
    return []


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
