"""How steady a calibration's short-step constants are on this machine, at the calibration's own
settings and at a baseline's (by default round 27's: 3 live/staged blocks), side by side in one process.

`flowrec calibrate SPEC` prices the fixed cost of a step (`step_us`: real steps at tiny batch sizes
less their priced compute) and what the batch pipeline adds to a step (`staging_values_per_s`: live
steps less staged ones, in alternating blocks) from a few seconds of real steps each. Both are
differences of timings, so on a shared host they move from one calibration of the same spec to the
next, and with them the price of a short step (round 27: five calibrations of a 10 ms step priced
it 9.8-17.0 ms). This tool calibrates the spec once (machine constants, dense ops, the rest), then
measures those two constants `--repeats` times at each setting, the settings interleaved
(A B, B A, ...: a spell of load falls on both), and reports per setting the median, standard
deviation, least and most of:

- `step_us`: the fixed cost (`flowrec.measure.spec._framework_us`; the calibration's rounds of tiny
  steps, TINY_REPEATS, against `--baseline-rounds` rounds);
- `staging_added_ms`: what staging adds to a step (values per batch / the rate, as the plan prices
  it; `_staging_rate` with the calibration's blocks against `--baseline-blocks`);
- `predicted_step_ms`: the plan's step (`step_ms_overlap`, at `--device-budget`) from the one
  calibration with those two constants replaced by the repeat's, everything else the same;
- the seconds each measurement took.

The spread of `predicted_step_ms` is how far these two constants alone move a short step's price
between calibrations on this host; `tools/bench_costmodel.py` judges each run against its own
calibration, so that spread falls straight into its per-pair errors. It runs on the CPU, where the
staging rate is measured (a GPU's host stages beside the device: `flowrec.measure.spec`).

Usage:
    python tools/bench_calibration_noise.py [--spec specs/movielens.yaml] [--repeats 8] [--threads 1]
        [--device-budget 64MiB] [--baseline-rounds 2] [--baseline-blocks 3] [--seconds 0.5]
        [--json bench/results/calibration_noise_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.testing.benchargs import add_spec_step_arguments, device_budget, use_threads  # noqa: E402

SETTINGS = ("calibration", "baseline")


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, population standard deviation, least and most of `values` (at least one).

    Example:
        >>> spread([1.0, 3.0, 2.0, 6.0])
        {'median': 2.5, 'sd': 1.8708286933869707, 'min': 1.0, 'max': 6.0}
    """
    if not values:
        raise ValueError("no values")
    return {"median": statistics.median(values), "sd": statistics.pstdev(values),
            "min": min(values), "max": max(values)}


def interleaved(repeats: int, measure: Callable[[str], dict[str, float]],
                progress: Callable[[int, dict[str, dict[str, float]]], None] | None = None
                ) -> dict[str, list[dict[str, float]]]:
    """`repeats` measurements of each setting in SETTINGS, in turn and in alternating order
    (A B, B A, ...): {setting: [measure(setting), ...]}.

    Example:
        >>> seen = []
        >>> out = interleaved(3, lambda s: seen.append(s) or {"x": len(seen)})
        >>> seen
        ['calibration', 'baseline', 'baseline', 'calibration', 'calibration', 'baseline']
        >>> [r["x"] for r in out["baseline"]]
        [2, 3, 6]
    """
    out: dict[str, list[dict[str, float]]] = {s: [] for s in SETTINGS}
    for k in range(repeats):
        order = SETTINGS if k % 2 == 0 else SETTINGS[::-1]
        for setting in order:
            out[setting].append(measure(setting))
        if progress is not None:
            progress(k, {s: out[s][-1] for s in SETTINGS})
    return out


def summarize(results: dict[str, list[dict[str, float]]]) -> dict[str, dict[str, dict[str, float]]]:
    """{setting: {quantity: spread over the repeats}} of `interleaved`'s results."""
    return {setting: {key: spread([r[key] for r in rows]) for key in rows[0]}
            for setting, rows in results.items() if rows}


def run(spec: Any, name: str, repeats: int, budget: str | None, baseline_rounds: int, baseline_blocks: int,
        tmp: Path, seconds: float = 0.5) -> dict[str, Any]:
    """Calibrate `spec` (a loaded ModelSpec, its file's `name`) once, then measure its fixed cost and staging rate `repeats` times at
    each setting, interleaved; the raw repeats, their spread and the calibration's own values.
    `seconds`: per timed kernel of the one calibration (`flowrec calibrate --seconds`)."""
    import torch

    from flowrec.cli.calibrate_cmd import gemm_shapes
    from flowrec.measure import robust
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.calibrate import calibrate as measure_machine
    from flowrec.measure.step import with_batch
    from flowrec.planner.manager import make_plan

    device = torch.device("cpu")
    robust.reset_log()
    started = time.perf_counter()
    measured, _ = measure_machine(device, gemm_shapes(spec), seconds)
    own, details = calibrate_spec.spec_constants(spec, device, measured, seconds / 4)  # as `flowrec calibrate`
    calibrated_s = time.perf_counter() - started
    full = {**measured, **own}
    # the fixed cost is measured against the profile as it stands before it: the machine and the dense ops
    before = {k: v for k, v in full.items() if k not in ("step_us", "compute_scale", "staging_values_per_s",
                                                         "managed_ns_per_id", "epoch_start_us", "epoch_single_us",
                                                         "epoch_lean_us")}
    before_path = tmp / "before.json"
    calibrate_spec._write(before_path, device, before)  # the profile file calibration plans with
    plan_cache: dict[int, Any] = {}

    def plan_for(batch: int) -> Any:
        if batch not in plan_cache:
            plan_cache[batch] = make_plan(with_batch(spec, batch), target=str(before_path))
        return plan_cache[batch]

    calibrate_spec._write(tmp / "full.json", device, full)
    full_plan = make_plan(spec, target=str(tmp / "full.json"))  # the plan staging is timed on
    dense_ms = details["compute_scale"].get("measured_dense_ms")
    values = details["staging"]["values_per_batch"]

    def predicted_ms(step_us: float, rate: float) -> float:
        calibrate_spec._write(tmp / "repeat.json", device,
                              {**full, "step_us": (step_us, "repeat"), "staging_values_per_s": (rate, "repeat")})
        plan = make_plan(spec, target=str(tmp / "repeat.json"), device_budget=budget)
        return float(plan.cost.step_ms_overlap)

    def measure(setting: str) -> dict[str, float]:
        t0 = time.perf_counter()
        rounds = calibrate_spec.TINY_REPEATS if setting == "calibration" else baseline_rounds
        step_us, fw = calibrate_spec._framework_us(spec, device, plan_for, rounds)
        t1 = time.perf_counter()
        blocks = calibrate_spec.STAGING_BLOCKS if setting == "calibration" else baseline_blocks
        rate, st = calibrate_spec._staging_rate(spec, device, full_plan, dense_ms, blocks)
        t2 = time.perf_counter()
        return {"step_us": step_us, "tiny_rounds": float(fw["rounds"]), "framework_seconds": t1 - t0,
                "staging_added_ms": values / rate * 1e3, "staging_blocks": float(st["blocks"]),
                "staging_seconds": t2 - t1, "predicted_step_ms": predicted_ms(step_us, rate)}

    def progress(k: int, last: dict[str, dict[str, float]]) -> None:
        shown = "; ".join(f"{s}: step_us {r['step_us']:.0f}, staging {r['staging_added_ms']:.2f} ms, "
                          f"step {r['predicted_step_ms']:.2f} ms" for s, r in last.items())
        print(f"repeat {k + 1}/{repeats}: {shown}", file=sys.stderr, flush=True)

    results = interleaved(repeats, measure, progress)
    return {"benchmark": "calibration_noise", "spec": name, "device_budget": budget or "none",
            "repeats": repeats, "calibration_seconds": calibrated_s,
            "settings": {"calibration": {"tiny_rounds": calibrate_spec.TINY_REPEATS,
                                         "staging_blocks": calibrate_spec.STAGING_BLOCKS},
                         "baseline": {"tiny_rounds": baseline_rounds, "staging_blocks": baseline_blocks}},
            "calibrated": {"step_us": own["step_us"][0], "staging_values_per_s": own["staging_values_per_s"][0],
                           "compute_scale": own["compute_scale"][0],
                           "predicted_step_ms": predicted_ms(own["step_us"][0], own["staging_values_per_s"][0])},
            "spread": summarize(results), "repeats_raw": results}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_spec_step_arguments(parser, "spec to calibrate")
    parser.add_argument("--repeats", type=int, default=8, help="measurements of each setting (default 8)")
    parser.add_argument("--baseline-rounds", type=int, default=2, help="rounds of tiny steps at the baseline (default 2)")
    parser.add_argument("--baseline-blocks", type=int, default=3, help="live/staged blocks at the baseline (default 3)")
    parser.add_argument("--seconds", type=float, default=0.5,
                        help="seconds per timed kernel of the one calibration (as `flowrec calibrate --seconds`; default 0.5)")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/calibration_noise_cpu.json")
    args = parser.parse_args(argv)
    if min(args.repeats, args.threads, args.baseline_rounds, args.baseline_blocks) < 1:
        parser.error("--repeats, --threads, --baseline-rounds and --baseline-blocks must be at least 1")
    if not args.seconds > 0:
        parser.error("--seconds must be positive")
    if not args.spec.is_file():
        parser.error(f"--spec {args.spec}: no such file")
    from flowrec.spec import load_spec
    from flowrec.spec.errors import SpecError
    from flowrec.spec.units import parse_bytes

    try:  # before a minute of calibration, not after it
        spec = load_spec(args.spec)
        if args.device_budget != "none":
            parse_bytes(args.device_budget)
    except (SpecError, ValueError) as exc:
        parser.error(str(exc) if isinstance(exc, SpecError) else f"--device-budget: {exc}")
    if args.json.exists() and args.json.resolve() == args.spec.resolve():
        parser.error(f"--json {args.json} is the spec itself: name another file for the result")
    with tempfile.TemporaryDirectory(prefix="bench-calnoise-") as tmp:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "inductor"))
        os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(Path(tmp) / "dask"))
        use_threads(args.threads)
        budget = device_budget(args)
        print(f"calibrating {args.spec.name} once, then {args.repeats} repeats of each setting ...",
              file=sys.stderr, flush=True)
        result = run(spec, args.spec.name, args.repeats, budget, args.baseline_rounds, args.baseline_blocks, Path(tmp),
                     args.seconds)
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    print(f"{result['spec']} ({args.repeats} repeats of each setting, interleaved; calibrated in "
          f"{result['calibration_seconds']:.0f} s):")
    for setting, quantities in result["spread"].items():
        print(f"  {setting:11s} " + "; ".join(
            f"{key} median {q['median']:.2f} sd {q['sd']:.2f} [{q['min']:.2f}, {q['max']:.2f}]"
            for key, q in quantities.items() if key in ("step_us", "staging_added_ms", "predicted_step_ms",
                                                        "framework_seconds", "staging_seconds")))
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    raise SystemExit(run_stoppable(main))
