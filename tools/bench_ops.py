"""Embedding forward+backward+update benchmark: per-field dense, per-field sparse, flowrec packed.

Runs on the same Zipf batches, in one process: (a) per-field `nn.EmbeddingBag` with dense
gradients + torch.optim.Adagrad, (b) per-field `sparse=True` + torch.optim.Adagrad (sparse
gradients), (c) flowrec `PackedEmbeddingBag` with precomputed casting and fused adagrad (the
same optimizer family), plus (c') fused rowwise_adagrad, and the random-gather floor (a plain
`index_select` of the batch's rows from the same packed table). On CPU (c) also runs unfused
as before the fused kernel (forward, torch `casted_row_grads`, torch gather-update-scatter).
The packed variants and their floor are timed side by side: each step runs every one of them
in turn, so a busy machine slows them alike.

Usage:
    python tools/bench_ops.py [--quick] [--json PATH] [--device auto|cpu|cuda]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import numba
import torch
import yaml

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators.casting import casted_row_grads, compute_casting, torch_casting
from operators.embedding import PackedEmbeddingBag
from operators.random_batches import random_batch

REPO = Path(__file__).resolve().parents[1]
WIDE_VOCABS = (10, 100, 1_000, 10_000, 50_000)  # rows, cycled over the fields of the wide cases
DIM = 16
BASELINE_STEPS = 5  # timed steps of the per-field baselines (seconds per step at 26 fields)
LR = 0.01


def criteo_vocabs() -> list[int]:
    doc = yaml.safe_load((REPO / "specs" / "dlrm_criteo.yaml").read_text())
    return [f["hash_buckets"] for f in doc["features"] if f.get("type") == "categorical"]


def make_group(vocabs: list[int], optimizer: str) -> PackedGroup:
    slots, offset = [], 0
    for i, rows in enumerate(vocabs):
        slots.append(TableSlot(f"t{i}", rows, offset))
        offset += rows
    fields = tuple(GroupField(f"f{i}", f"t{i}", 1, "sum") for i in range(len(vocabs)))
    return PackedGroup("bench", DIM, "fp32", (optimizer, LR, ()), tuple(slots), fields)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def paired_median_ms(fns: dict[str, Callable[[int], None]], steps: int,
                     device: torch.device) -> dict[str, float]:
    """Median wall time (ms) of each `fn(i)`, all run in turn at every step, after one warm-up."""
    for fn in fns.values():
        fn(0)
    times: dict[str, list[float]] = {name: [] for name in fns}
    for i in range(steps):
        for name, fn in fns.items():
            _sync(device)
            start = time.perf_counter()
            fn(i)
            _sync(device)
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e3 for name, t in times.items()}


def median_ms(fn: Callable[[int], None], steps: int, device: torch.device) -> float:
    """Median wall time of `fn(i)` over `steps` calls after one warm-up call."""
    return paired_median_ms({"fn": fn}, steps, device)["fn"]


class PerField(torch.nn.Module):
    """One nn.EmbeddingBag per field, initialised with the packed table's rows."""

    def __init__(self, packed: PackedEmbeddingBag, sparse: bool):
        super().__init__()
        self.bags = torch.nn.ModuleList(
            torch.nn.EmbeddingBag.from_pretrained(packed.table_rows(t.table).clone(), freeze=False,
                                                  mode="sum", sparse=sparse)
            for t in packed.group.tables)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        return torch.stack([bag(ids[:, f], offsets) for f, bag in enumerate(self.bags)], dim=1)


def run_case(name: str, vocabs: list[int], batch_size: int, steps: int,
             device: torch.device, seed: int = 0) -> dict:
    """Time every variant on the same batches; returns the case's figures."""
    gen = torch.Generator().manual_seed(seed)
    fields = len(vocabs)
    group = make_group(vocabs, "adagrad")
    packed = PackedEmbeddingBag(group, device=device)
    batches = [random_batch(group, batch_size, gen) for _ in range(steps + 1)]
    castings = [compute_casting(b.ids, b.offsets) for b in batches]
    cast = paired_median_ms({"kernel": lambda i: compute_casting(batches[i].ids, batches[i].offsets),
                             "torch": lambda i: torch_casting(batches[i].ids, batches[i].offsets)},
                            steps, torch.device("cpu"))  # the data stage's casting: numba kernel, torch's ops
    cast_ms = cast["kernel"]
    batches = [(b.ids.to(device), b.offsets.to(device)) for b in batches]
    castings = [c.to(device) for c in castings]
    grad = torch.randn(batch_size, fields, DIM, generator=gen).to(device)  # (B, F, D)
    offsets_b = torch.arange(batch_size, device=device)  # one id per bag
    starts = torch.tensor([t.row_offset for t in group.tables], device=device)
    local = [(ids.view(batch_size, fields) - starts) for ids, _ in batches]  # (B, F) per-table ids
    figures: dict[str, float] = {}

    def packed_step(module: PackedEmbeddingBag) -> Callable[[int], None]:
        def step(i: int) -> None:
            ids, offsets = batches[i]
            module(ids, offsets, casting=castings[i]).backward(grad)
        return step

    def unfused_step(i: int) -> None:
        ids, offsets = batches[i]
        packed.lookup(ids, offsets)
        grads = casted_row_grads(grad.view(-1, DIM), castings[i])  # (U, D)
        packed.optimizer.torch_step(packed.weight, packed.state, castings[i].unique_ids, grads)

    variants = {"gather_floor": lambda i: packed.weight.index_select(0, batches[i][0]),
                "flowrec_packed_adagrad": packed_step(packed)}
    if device.type == "cpu":
        variants["flowrec_packed_adagrad_unfused"] = unfused_step
    figures.update(paired_median_ms(variants, steps, device))
    for sparse, key in ((True, "per_field_sparse_adagrad"), (False, "per_field_dense_adagrad")):
        model = PerField(packed, sparse).to(device)
        opt = torch.optim.Adagrad(model.parameters(), lr=LR)

        def step(i: int, model=model, opt=opt) -> None:
            model(local[i], offsets_b).backward(grad)
            opt.step()
            opt.zero_grad()
        figures[key] = median_ms(step, min(steps, BASELINE_STEPS), device)
        del model, opt
    del packed
    rowwise = PackedEmbeddingBag(make_group(vocabs, "rowwise_adagrad"), device=device)
    figures.update(paired_median_ms(
        {"gather_floor_2": lambda i: rowwise.weight.index_select(0, batches[i][0]),
         "flowrec_packed_rowwise_adagrad": packed_step(rowwise)}, steps, device))
    floor = figures["gather_floor"]
    nnz = batch_size * fields
    out = {"case": name, "fields": fields, "batch_size": batch_size, "dim": DIM,
           "rows": sum(vocabs), "steps": steps, "baseline_steps": min(steps, BASELINE_STEPS),
           "casting_cpu_ms": cast_ms, "casting_torch_ms": cast["torch"],
           "median_ms": figures, "gather_floor_ms": floor,
           "floor_rows_per_s": nnz / (floor / 1e3),
           "samples_per_s": {k: batch_size / (v / 1e3) for k, v in figures.items()
                             if not k.startswith("gather")}}
    if device.type == "cuda":
        unique = statistics.mean(c.unique_ids.numel() for c in castings)
        moved = nnz * DIM * 4 + 2 * unique * (2 * DIM) * 4  # bytes: lookups + adagrad row+state r/w
        out["embedding_bandwidth_gbps"] = moved / (figures["flowrec_packed_adagrad"] / 1e3) / 1e9
    del rowwise
    return out


def copy_bandwidth_gbps(device: torch.device, mib: int = 1024) -> float:
    """Device-to-device copy bandwidth (read + write bytes per second)."""
    src = torch.empty(mib * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda i: dst.copy_(src), 10, device)
    return 2 * src.numel() * 4 / (ms / 1e3) / 1e9


def machine(device: torch.device) -> dict:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = torch.get_num_threads()
    name = (f"cuda: {torch.cuda.get_device_name(device)}" if device.type == "cuda"
            else f"cpu: {cpu}, {cores} cores")
    return {"platform": platform.platform(), "cpu": cpu, "cpu_count": cores,
            "torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "device": name}


def run(quick: bool, device: torch.device) -> dict:
    """Every case; returns the report (machine, cases, ratios)."""
    scale = 1000 if quick else 1
    steps = 3 if quick else 15
    criteo = [max(4, v // scale) for v in criteo_vocabs()]
    cases = [("criteo26", criteo, 512 if quick else 4096)]
    for fields in (128, 512, 1000):
        vocabs = [max(4, WIDE_VOCABS[i % len(WIDE_VOCABS)] // scale) for i in range(fields)]
        cases.append((f"wide{fields}", vocabs, 128 if quick else 1024))
    results = {}
    for name, vocabs, batch_size in cases:
        print(f"{name}: {len(vocabs)} fields, batch {batch_size}", file=sys.stderr, flush=True)
        results[name] = run_case(name, vocabs, batch_size, steps, device)
    f26, f1000 = results["criteo26"], results["wide1000"]

    def ratio(case: dict, baseline: str) -> float:
        return case["median_ms"][baseline] / case["median_ms"]["flowrec_packed_adagrad"]

    def vs_floor(case: dict, variant: str) -> float:
        return case["median_ms"][variant] / case["gather_floor_ms"]

    report = {"machine": machine(device), "device": machine(device)["device"], "quick": quick,
              "wide_vocabs_cycled": list(WIDE_VOCABS), "optimizer_family": "adagrad",
              "cases": results,
              "ratios": {
                  "packed_vs_dense_grad_f26": ratio(f26, "per_field_dense_adagrad"),
                  "packed_vs_floor_f26": vs_floor(f26, "flowrec_packed_adagrad"),
                  "packed_vs_sparse_f1000": ratio(f1000, "per_field_sparse_adagrad"),
                  "packed_vs_floor_f1000": vs_floor(f1000, "flowrec_packed_adagrad"),
              }}
    if device.type == "cpu":
        report["fused_cpu_kernel"] = f"numba {numba.__version__}, {numba.get_num_threads()} threads"
        report["ratios"].update({
            "unfused_vs_floor_f26": vs_floor(f26, "flowrec_packed_adagrad_unfused"),
            "unfused_vs_floor_f1000": vs_floor(f1000, "flowrec_packed_adagrad_unfused")})
    if device.type == "cuda":
        bw = copy_bandwidth_gbps(device)
        report["copy_bandwidth_gbps"] = bw
        report["embedding_bandwidth_fraction"] = {
            k: c["embedding_bandwidth_gbps"] / bw for k, c in results.items()}
    return report


def table(report: dict) -> str:
    cols = ["per_field_dense_adagrad", "per_field_sparse_adagrad", "flowrec_packed_adagrad",
            "flowrec_packed_adagrad_unfused", "flowrec_packed_rowwise_adagrad"]
    cols = [c for c in cols if all(c in case["median_ms"] for case in report["cases"].values())]
    lines = [f"device: {report['device']}  (median ms per step; casting precomputed on CPU)",
             f"{'case':<10}{'B':>6}" + "".join(f"{c:>32}" for c in cols) + f"{'floor':>9}{'cast':>8}{'cast_torch':>11}"]
    for name, c in report["cases"].items():
        lines.append(f"{name:<10}{c['batch_size']:>6}"
                     + "".join(f"{c['median_ms'][k]:>32.2f}" for k in cols)
                     + f"{c['gather_floor_ms']:>9.2f}{c['casting_cpu_ms']:>8.2f}{c['casting_torch_ms']:>11.2f}")
    lines.append("ratios: " + ", ".join(f"{k}={v:.2f}" for k, v in report["ratios"].items()))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="few steps, small vocabularies")
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args()
    name = "cuda" if args.device == "auto" and torch.cuda.is_available() else args.device
    device = torch.device("cpu" if name == "auto" else name)
    report = run(args.quick, device)
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
