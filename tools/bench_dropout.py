"""Dropout's mask on the CPU: the compiled one-pass mask (`operators.regularize._dropout_keep`, the
default) against the same hash as int64 tensor ops (the path GPUs and compiled graphs take), whole
training steps of specs with dropout, side by side in one process.

For each spec: one lowered model and optimizer, batches staged beforehand as the trainer stages
them (`flowrec.measure.step`), then steps alternating between the two masks (one step each in
turn, so the host's load falls on both alike), after warm-up steps of both. The two masks are
bitwise the same (`tests/unit/test_mlp_regularize.py`), so the model trains the same either way;
only the time differs. JSON: per spec the median ms a step of each and their ratio
(`tensor_ops_vs_compiled`: above 1, the compiled mask is faster).

Usage:
    python tools/bench_dropout.py [--specs esmm_multitask,deepfm_regularized,sasrec_movielens]
        [--steps 60] [--batch N] [--json bench/results/dropout_cpu.json]
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

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from flowrec.measure import step as staging  # noqa: E402
from flowrec.measure.step import with_batch  # noqa: E402
from flowrec.planner.manager import make_plan  # noqa: E402
from flowrec.runtime.hostmem import tune_host_allocator  # noqa: E402
from flowrec.runtime.lowering import lower  # noqa: E402
from flowrec.runtime.nonfinite import LossGuard  # noqa: E402
from flowrec.runtime.step import make_dense_optimizer, train_step  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402
from operators.regularize import SeededDropout  # noqa: E402

DEFAULT_SPECS = "esmm_multitask,deepfm_regularized,sasrec_movielens"
WARMUP = 2  # untimed steps of each mask
BATCHES = 8  # staged batches, stepped in turn


def compare(spec_name: str, steps: int, batch: int | None) -> dict:
    """Median ms a training step of `spec_name` with each mask, alternating step by step."""
    spec = load_spec(REPO / "specs" / f"{spec_name}.yaml")
    if batch:
        spec = with_batch(spec, batch)
    plan = make_plan(spec, target=None)
    tune_host_allocator()  # as the trainer does
    model = lower(plan, spec, torch.device("cpu"))
    try:
        drops = [m for m in model.modules() if isinstance(m, SeededDropout)]
        if not drops:
            raise SystemExit(f"bench_dropout: {spec_name} has no dropout")
        batches = staging._staged(spec, plan, BATCHES)
        staging._item_counts(model, batches)
        opt = spec.dense_optimizer
        optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
        guarded, micro = LossGuard(model), int(plan.meta.micro_batches)

        def use(compiled: bool) -> None:
            for d in drops:
                if compiled:
                    d.__dict__.pop("_keep_cpu", None)
                else:
                    d._keep_cpu = lambda x: None  # the tensor-op hash

        def one(k: int) -> float:
            started = time.perf_counter()
            train_step(guarded, optimizer, batches[k % BATCHES], micro, spec.training.precision,
                       spec.training.clip_grad_norm)
            return (time.perf_counter() - started) * 1e3

        times: dict[bool, list[float]] = {True: [], False: []}
        for k in range(2 * (WARMUP + steps)):
            compiled = k % 2 == 0
            use(compiled)
            ms = one(k)
            if k >= 2 * WARMUP:
                times[compiled].append(ms)
        use(True)
    finally:
        model.close()
    compiled_ms, tensor_ms = statistics.median(times[True]), statistics.median(times[False])
    return {"spec": spec_name, "batch": spec.training.batch_size, "dropouts": len(drops), "steps": steps,
            "compiled_mask_ms": round(compiled_ms, 6), "tensor_ops_mask_ms": round(tensor_ms, 6),
            "tensor_ops_vs_compiled": round(tensor_ms / compiled_ms, 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--specs", default=DEFAULT_SPECS, help="comma list of spec names in specs/ with dropout")
    parser.add_argument("--steps", type=int, default=60, help="timed steps of each mask (alternating)")
    parser.add_argument("--batch", type=int, default=None, help="batch size (default: each spec's)")
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    args = parser.parse_args()
    if args.steps < 1:
        parser.error("--steps must be at least 1")
    rows = []
    for name in args.specs.split(","):
        if not (REPO / "specs" / f"{name}.yaml").exists():
            parser.error(f"--specs: no spec {name!r} in specs/")
        rows.append(compare(name, args.steps, args.batch))
        r = rows[-1]
        print(f"{name:22} batch {r['batch']:5}: compiled mask {r['compiled_mask_ms']:9.2f} ms, tensor ops "
              f"{r['tensor_ops_mask_ms']:9.2f} ms a step: {r['tensor_ops_vs_compiled']:.3f}x", flush=True)
    doc = {"benchmark": "dropout", "machine": {"platform": platform.platform(), "cpus": os.cpu_count(),
                                               "torch_threads": torch.get_num_threads(),
                                               "load_average": list(os.getloadavg())},
           "torch": torch.__version__, "specs": rows}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=2) + "\n")


if __name__ == "__main__":
    main()
