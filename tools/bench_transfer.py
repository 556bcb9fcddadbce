"""The trainer's step against how its transfer stage sends batches to the device, side by side.

Trains a spec through `flowrec.api.train` (the trainer, its data stage and transfer stage, as
`flowrec train` runs it) on synthetic rows, one run per variant, the variants alternating
`--repeats` times in one process; the step is the gap between consecutive `on_step` calls
(after `--skip` steps), its median, p10 and p90 reported per run:

- `upload`: the transfer stage as it is (`DeviceRuntime.upload`: on CUDA a copy from pageable
  memory on the stage's thread);
- `pinned`: each staged tensor pinned (`pin_memory()`) and copied without blocking, as the stage
  did before 2026-12-04;
- `inline`: no transfer thread: the step moves its batch itself (as the calibration's live steps do).

On a CPU device the transfer stage passes batches through, so the variants differ only by the
machine's noise; the comparison is for a GPU.

With `--profile FILE` (a profile of `flowrec calibrate` on this machine) it first checks the cost
model's price of a batch's transfer: `--send-batches` batches of the spec staged as training stages
them (the casting index included), each sent by the stage's own `_move` (every tensor through
`DeviceRuntime.upload`), timed with a device synchronize, against `cost.upload_seconds` of the
profile at that batch's own bytes and copies (the rate constants alone), and the plan's predicted
transfer (its distinct rows by the access model): `send` in the JSON. On the CPU both are 0 (no
copies).

Usage:
    python tools/bench_transfer.py --device cuda [--spec specs/dlrm_criteo.yaml] [--precision fp32]
        [--steps 200] [--repeats 3] [--variants upload,pinned,inline] [--profile FILE]
        [--send-batches 30] [--json FILE]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import flowrec.runtime.trainer as trainer_module  # noqa: E402
from flowrec import api  # noqa: E402
from flowrec.runtime.pipeline import TransferStage  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402
from operators.device import runtime_for  # noqa: E402

VARIANTS = ("upload", "pinned", "inline")


class InlineStage(TransferStage):
    """No thread: batches pass through to the step, which moves them (`train_step`, `embed_step`)."""

    def __init__(self, batches: Any, device: torch.device, depth: int = 2,
                 host_groups: frozenset[str] = frozenset(), background: bool = False) -> None:
        self.device, self.host_groups, self.runtime = device, host_groups, runtime_for(device)
        self.wait_s, self._source, self._passthrough = 0.0, batches, True
        self.delivered_bytes = 0  # the step moves its batch: the stage copies nothing
        self._iter = iter(batches)


def pinned_send(stage: TransferStage, tensor: torch.Tensor) -> torch.Tensor:
    """The stage's send before 2026-12-04: page-locked, then a non-blocking copy."""
    return stage.runtime.pin(tensor).to(stage.device, non_blocking=True)


def trained_steps(spec: Any, device: str, steps: int, skip: int, seed: int) -> dict:
    """Train `steps` steps of `spec` through `api.train` on synthetic rows: the step (the gap
    between consecutive `on_step` calls after `skip` steps) at the median, p10 and p90, the timed
    steps' seconds, and the call's wall seconds."""
    stamps: list[float] = []
    started = time.perf_counter()
    api.train(spec, device=device, max_steps=steps, rows=spec.training.batch_size * (steps + 4), seed=seed,
              on_step=lambda event: stamps.append(time.perf_counter()))
    wall = time.perf_counter() - started
    gaps = sorted((b - a) * 1e3 for a, b in zip(stamps[skip:], stamps[skip + 1:]))
    if not gaps:
        raise SystemExit(f"--steps {steps} leaves no step after --skip {skip}")
    return {"step_ms_median": statistics.median(gaps), "step_ms_p10": gaps[len(gaps) // 10],
            "step_ms_p90": gaps[(9 * len(gaps)) // 10], "steps_timed": len(gaps),
            "steps_s": stamps[-1] - stamps[skip], "run_s": round(wall, 2)}


def send_check(spec: Any, device: str, profile: Path, profiled: Any, count: int) -> dict:
    """The send of `count` staged batches (`TransferStage._move`, synchronized) against the
    profile's price (`profiled`, read from `profile`) of each batch's own bytes and copies, as the
    stage counts them, and the plan's predicted transfer."""
    from flowrec.measure.step import _staged
    from flowrec.planner import cost
    from flowrec.planner.manager import make_plan

    plan = make_plan(spec, target=str(profile))
    batches = _staged(spec, plan, count + 2)
    stage = TransferStage(iter(()), torch.device(device))
    runtime = runtime_for(torch.device(device))
    measured, priced = [], []
    for k, batch in enumerate(batches):
        runtime.synchronize()
        started = time.perf_counter()
        stage._move(batch)
        runtime.synchronize()
        seconds = time.perf_counter() - started
        nbytes, copies = stage._sizes.pop()  # what the stage copied (no consumer takes it here)
        if k >= 2:  # the first copies warm the allocator
            measured.append(seconds * 1e3)
            priced.append(cost.upload_seconds(profiled, nbytes, copies) * 1e3)
    stage.close()
    return {"profile": str(profile), "batches": len(measured), "send_ms_median": statistics.median(measured),
            "priced_ms_median": statistics.median(priced),
            "plan_transfer_ms": dict(plan.cost.stage_ms)["transfer"],
            "plan_h2d_bytes": plan.cost.h2d_bytes_per_step,
            "upload_gbps": profiled.upload_gbps, "upload_us": profiled.upload_us, "pcie_gbps": profiled.pcie_gbps}


def run_variant(name: str, spec: Any, device: str, steps: int, skip: int, seed: int) -> dict:
    real_send = TransferStage._send
    if name == "pinned":
        TransferStage._send = pinned_send
    elif name == "inline":
        trainer_module.TransferStage = InlineStage
    try:
        return {"variant": name, **trained_steps(spec, device, steps, skip, seed)}
    finally:
        TransferStage._send = real_send
        trainer_module.TransferStage = TransferStage


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "specs" / "dlrm_criteo.yaml")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="default: the spec's")
    parser.add_argument("--steps", type=int, default=200, help="steps per run (default 200)")
    parser.add_argument("--skip", type=int, default=20, help="first steps left out (default 20)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each variant, alternating (default 3)")
    parser.add_argument("--variants", default=",".join(VARIANTS), help="comma list of: " + ",".join(VARIANTS))
    parser.add_argument("--seed", type=int, default=3)
    parser.add_argument("--profile", type=Path, help="a `flowrec calibrate` profile of this machine: check "
                        "its price of a batch's transfer first (see above)")
    parser.add_argument("--send-batches", type=int, default=30, help="batches timed by the send check (default 30)")
    parser.add_argument("--json", type=Path, help="write the figures here")
    args = parser.parse_args()
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown or not variants:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    if args.steps <= args.skip + 1:
        parser.error("--steps must exceed --skip + 1")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device")
    spec = load_spec(args.spec)
    spec = replace(spec, data=None)  # synthetic rows: the same data for every variant
    if args.precision:
        spec = replace(spec, training=replace(spec.training, precision=args.precision))
    doc = {"spec": str(args.spec), "device": torch.cuda.get_device_name(args.device)
           if args.device.startswith("cuda") else platform.processor() or "cpu",
           "torch": torch.__version__, "precision": spec.training.precision, "steps": args.steps,
           "skip": args.skip, "runs": []}
    if args.profile is not None:
        if args.send_batches < 1:
            parser.error("--send-batches must be at least 1")
        from flowrec.planner.cost import device_profile

        try:
            profiled = device_profile(str(args.profile))
        except ValueError as exc:
            parser.error(str(exc))
        doc["send"] = send_check(spec, args.device, args.profile, profiled, args.send_batches)
        print(f"send     {doc['send']['send_ms_median']:8.3f} ms median a batch, priced "
              f"{doc['send']['priced_ms_median']:.3f} ms (its bytes), the plan's transfer "
              f"{doc['send']['plan_transfer_ms']:.3f} ms", flush=True)
    for _ in range(args.repeats):
        for name in variants:
            row = run_variant(name, spec, args.device, args.steps, args.skip, args.seed)
            doc["runs"].append(row)
            print(f"{name:8s} step {row['step_ms_median']:8.3f} ms median, p10 {row['step_ms_p10']:.3f}, "
                  f"p90 {row['step_ms_p90']:.3f} ({row['run_s']} s)", flush=True)
    doc["median_of_medians_ms"] = {name: statistics.median(r["step_ms_median"] for r in doc["runs"]
                                                           if r["variant"] == name) for name in variants}
    print(json.dumps(doc["median_of_medians_ms"]))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))


if __name__ == "__main__":
    main()
