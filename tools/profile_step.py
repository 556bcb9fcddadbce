"""Op-by-op profile of flowrec's training step as `flowrec train` runs it, on the CPU or a GPU.

Trains SPEC through `flowrec.api.train` (the trainer, data staging and transfer stage users run)
and records a window of steps with torch's profiler: every operator's self time per step on the
host and, on CUDA, on the device, its calls per step and input shapes, and the window's step
times. Prints the heaviest operators and writes them all to JSON; `--trace` also writes a Chrome
trace (chrome://tracing, Perfetto) of the window.

Usage:
    python tools/profile_step.py specs/dlrm_criteo.yaml --device cuda --steps 20 --json prof.json
    python tools/profile_step.py specs/dlrm_criteo.yaml --precision bf16 --rows 65536 --top 30
    OMP_NUM_THREADS=1 python tools/profile_step.py specs/deepfm_criteo.yaml --device-budget 64MiB --cache static_hot

Without data bound in the spec (or with `--synthetic`), it trains on `--rows` synthetic rows.
The first `--warmup` steps are left out of the window (allocations, first-call kernels and caches
settle there); the window's steps are then profiled, which slows them: the step times in the
JSON are the profiled ones, for comparing operators, not a benchmark (tools/bench_train.py is).
`--device-budget` and `--cache` plan the run as `flowrec train` does with them (a 64 MiB budget puts
a cache before the host tables, as `tools/bench_costmodel.py --device-budget 64MiB` runs them), so
a cached placement's own operators can be compared with a resident one's. Its temporary folder
(torch's inductor cache) is removed at the end, stopped or not.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec import api  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402


def _self_device_us(event: Any) -> float:
    """An averaged event's self time on the device (µs), across torch versions (0 without one)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        value = getattr(event, name, None)
        if value is not None:
            return float(value)
    return 0.0


def profiled_spec(path: Path, precision: str | None, batch: int | None, synthetic: bool,
                  cache: str | None = None) -> Any:
    """The spec to train: the file's, with another precision, batch size or cache policy where asked, its data
    binding made absolute (the API reads a loaded spec's data relative to the working folder), or
    dropped for synthetic rows."""
    spec = load_spec(path)
    if precision is not None:
        spec = replace(spec, training=replace(spec.training, precision=precision))
    if batch is not None:
        spec = replace(spec, training=replace(spec.training, batch_size=batch))
    if cache is not None:
        spec = replace(spec, plan=replace(spec.plan, cache=cache))
    if spec.data is not None and spec.data.path is not None:
        if synthetic:
            spec = replace(spec, data=None)
        elif not Path(spec.data.path).is_absolute():
            spec = replace(spec, data=replace(spec.data, path=str((path.parent / spec.data.path).resolve())))
    return spec


def profile(spec: Any, device: str, steps: int, warmup: int, rows: int, shapes: bool,
            trace: Path | None, device_budget: str | None = None) -> dict[str, Any]:
    """Train `warmup + steps` steps of `spec` on `device`, the last `steps` under the profiler."""
    cuda = device.startswith("cuda")
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    # the last warm-up step runs under the profiler unrecorded (its own start-up cost stays out)
    schedule = torch.profiler.schedule(wait=0, warmup=min(1, warmup), active=steps, repeat=1,
                                       skip_first=max(0, warmup - 1))
    stamps: list[float] = []
    prof = torch.profiler.profile(activities=activities, schedule=schedule, record_shapes=shapes)

    def on_step(event: Any) -> None:
        if cuda:
            torch.cuda.synchronize()  # the step's kernels end inside its window
        stamps.append(time.perf_counter())
        prof.step()

    started = time.perf_counter()
    with prof:
        stamps.append(time.perf_counter())
        run = api.train(spec, device=device, max_steps=warmup + steps, epochs=max(1, warmup + steps),
                        rows=rows, seed=0, on_step=on_step, device_budget=device_budget)
    took = time.perf_counter() - started
    if run.result is None or run.result.steps < warmup + steps:
        done = 0 if run.result is None else run.result.steps
        raise SystemExit(f"the run ended after {done} steps, before the profiled window "
                         f"({warmup} + {steps}): give more --rows, or fewer --warmup/--steps")
    window = [b - a for a, b in zip(stamps[warmup:], stamps[warmup + 1:])][:steps]
    averages = prof.key_averages(group_by_input_shape=shapes)
    ops = []
    for e in averages:
        self_cpu, self_dev = float(e.self_cpu_time_total), _self_device_us(e)
        if self_cpu <= 0 and self_dev <= 0:
            continue
        ops.append({"name": e.key, "shapes": str(e.input_shapes) if shapes else None,
                    "calls_per_step": e.count / steps, "self_cpu_ms_per_step": self_cpu / 1e3 / steps,
                    "cpu_total_ms_per_step": float(e.cpu_time_total) / 1e3 / steps,
                    "self_device_ms_per_step": self_dev / 1e3 / steps})
    key = "self_device_ms_per_step" if cuda else "self_cpu_ms_per_step"
    ops.sort(key=lambda r: r[key], reverse=True)
    if trace is not None:
        prof.export_chrome_trace(str(trace))
    return {"device": torch.cuda.get_device_name(torch.device(device)) if cuda else platform.processor() or "cpu",
            "torch": torch.__version__, "threads": torch.get_num_threads(), "profiled_steps": steps,
            "warmup_steps": warmup, "batch_size": spec.training.batch_size, "device_budget": device_budget,
            "cache": spec.plan.cache, "cache_counters": run.result.counters,
            "precision": spec.training.precision, "step_ms_profiled": [round(s * 1e3, 3) for s in window],
            "step_ms_median": round(statistics.median(window) * 1e3, 3) if window else None,
            "sorted_by": key, "run_seconds": round(took, 2), "ops": ops}


def table(doc: dict[str, Any], top: int) -> list[str]:
    """The `top` heaviest operators, ms per step."""
    cuda = doc["sorted_by"] == "self_device_ms_per_step"
    lines = [f"{doc['device']}, {doc['precision']}, batch {doc['batch_size']}: {doc['profiled_steps']} "
             f"profiled steps after {doc['warmup_steps']}, median {doc['step_ms_median']} ms a step (profiled)",
             f"{'operator':44s} {'calls':>6s} {'self cpu ms':>11s}" + (f" {'self dev ms':>11s}" if cuda else "")
             + ("  shapes" if doc["ops"] and doc["ops"][0]["shapes"] is not None else "")]
    for r in doc["ops"][:top]:
        line = f"{r['name'][:44]:44s} {r['calls_per_step']:6.1f} {r['self_cpu_ms_per_step']:11.3f}"
        if cuda:
            line += f" {r['self_device_ms_per_step']:11.3f}"
        if r["shapes"] is not None:
            line += f"  {r['shapes'][:70]}"
        lines.append(line)
    total = sum(r["self_cpu_ms_per_step"] for r in doc["ops"])
    lines.append(f"self cpu time of all {len(doc['ops'])} operators: {total:.2f} ms a step"
                 + (f"; self device time: {sum(r['self_device_ms_per_step'] for r in doc['ops']):.2f} ms"
                    if cuda else ""))
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("spec", type=Path, help="the spec file (YAML/JSON)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default cpu)")
    parser.add_argument("--precision", choices=("fp32", "bf16"), help="default: the spec's")
    parser.add_argument("--batch", type=int, help="batch size (default: the spec's)")
    parser.add_argument("--steps", type=int, default=5, help="profiled steps (default 5)")
    parser.add_argument("--warmup", type=int, default=3, help="steps before the profiled ones (default 3)")
    parser.add_argument("--rows", type=int, default=400_000,
                        help="synthetic training rows when the spec binds no data (default 400000)")
    parser.add_argument("--device-budget", default=None,
                        help="the plan's device budget, as `flowrec train --device-budget` (e.g. 64MiB: caches before host tables)")
    parser.add_argument("--cache", choices=("auto", "none", "static_hot", "lookahead"), default=None,
                        help="the plan's cache policy, as `flowrec train --cache` (default: the spec's)")
    parser.add_argument("--synthetic", action="store_true", help="synthetic rows even where the spec binds data")
    parser.add_argument("--shapes", action=argparse.BooleanOptionalAction, default=True,
                        help="one row per operator and input shapes (default) or per operator")
    parser.add_argument("--top", type=int, default=25, help="operators printed (default 25; the JSON has all)")
    parser.add_argument("--json", type=Path, help="write the profile here")
    parser.add_argument("--trace", type=Path, help="also write a Chrome trace of the profiled steps here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.warmup < 0 or args.rows < 1 or (args.batch is not None and args.batch < 1):
        parser.error("--steps, --rows and --batch must be >= 1, --warmup >= 0")
    if not args.spec.is_file():
        parser.error(f"no spec file at {args.spec}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error(f"--device {args.device}: torch sees no CUDA device here")
    if args.device_budget is not None:
        from flowrec.spec.units import parse_bytes

        try:
            parse_bytes(args.device_budget)
        except ValueError:
            parser.error(f"--device-budget: {args.device_budget!r} is not a size (like 64MiB)")
    spec = profiled_spec(args.spec, args.precision, args.batch, args.synthetic, args.cache)
    with tempfile.TemporaryDirectory(prefix="flowrec-profile-") as scratch:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(scratch) / "inductor"))
        doc = profile(spec, args.device, args.steps, args.warmup, args.rows, args.shapes, args.trace,
                      args.device_budget)
    doc["spec"] = str(args.spec)
    print("\n".join(table(doc, args.top)))
    if args.json is not None:
        args.json.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    sys.exit(run_stoppable(main))
