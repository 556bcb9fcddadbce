"""How the plan's step prices the epochs after the first, with the data's rows kept in memory and
without.

`tools/bench_costmodel.py` judges the plan (`cost.step_ms_overlap`, calibrated by `flowrec
calibrate`) on data seen once: its runs stay inside the first epoch, the regime calibration
measures (its live steps read a Parquet dataset once). A real run goes over its data for several
epochs, and from the second on two things differ:

- `flowrec train` keeps a Parquet dataset's decoded rows after the first epoch where its batches
  allow it and the rows fit (`--cache-data auto`, the default; `flowrec.data.rowcache`: one id per
  field, no sequence, list or managed table): later epochs read and decode no file, so their batch
  pipeline takes less of the cores the step shares on a CPU;
- other specs, and any spec with `--cache-data off`, read every epoch again.

The plan prices every epoch's step as the first's. This tool measures, per spec:

1. `flowrec calibrate SPEC` (one process, `--threads` compute threads);
2. synthetic rows for epochs of about `--epoch-seconds` of the calibration's live steps
   (`--min-batches` to `--max-batches` batches), written once as Parquet;
3. `flowrec train` runs of `--epochs` epochs from that profile, the trainer's step timed as
   `tools/bench_costmodel.py` times it: `--cache-data on` (rows kept where the spec's batches allow
   it) and `--cache-data off`, in alternating order from one spec to the next; a spec whose
   batches the row cache does not keep (checked on its own data with the library's own pipeline)
   runs once, `off` (the two would be the same run);
4. per run the robust step (`flowrec.measure.robust`) of the first epoch (after the warm-up) and
   of the later ones, and their errors against the plan's step; and the host<->device bytes per
   step over all the run's epochs (as `tools/bench_costmodel.py` counts them) against the plan's
   (a cache placement's traffic in epochs that meet the same rows again).

Usage:
    python tools/bench_later_epochs.py [--specs dlrm_criteo.yaml,movielens.yaml] [--threads 1]
        [--epochs 3] [--epoch-seconds 2] [--device-budget 64MiB] [--json bench/results/later_epochs_cpu.json]
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.measure import robust  # noqa: E402

_bench_spec = importlib.util.spec_from_file_location("bench_costmodel", REPO / "tools" / "bench_costmodel.py")
bench = importlib.util.module_from_spec(_bench_spec)
_bench_spec.loader.exec_module(bench)

MODES = ("on", "off")  # --cache-data of the two runs of a spec whose rows are kept


def epoch_rounds(rounds: list[robust.Round], epochs: list[int]) -> tuple[list[robust.Round], list[robust.Round]]:
    """(first epoch's, later epochs') rounds of a run's steps, `epochs` the epoch of each step (the
    run's `metrics.jsonl`: FAE's hot and cold batches make an epoch more steps than its batches).

    Example:
        >>> r = [robust.Round(float(i)) for i in range(7)]
        >>> [[x.wall for x in part] for part in epoch_rounds(r, [0, 0, 0, 1, 1, 2, 2])]
        [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0, 6.0]]
    """
    if len(rounds) != len(epochs):
        raise ValueError(f"{len(rounds)} timed steps against {len(epochs)} logged")
    return ([r for r, e in zip(rounds, epochs) if e == 0], [r for r, e in zip(rounds, epochs) if e > 0])


def step_epochs(metrics: Path) -> list[int]:
    """The epoch of every training step a run logged (`metrics.jsonl`'s train events, in order)."""
    out = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        record = json.loads(line) if line.strip() else {}
        if record.get("event") == "train":
            out.append(int(record["epoch"]))
    return out


def epoch_batches_for(live_ms: float, seconds: float, least: int, most: int) -> int:
    """Batches of an epoch of about `seconds` of steps of `live_ms`, `least` to `most`.

    Example:
        >>> epoch_batches_for(10.0, 2.0, 16, 400), epoch_batches_for(500.0, 2.0, 16, 400), epoch_batches_for(1.0, 2.0, 16, 400)
        (200, 16, 400)
    """
    if not live_ms > 0:
        return least
    return min(most, max(least, math.ceil(seconds * 1e3 / live_ms)))


def error(predicted: float | None, measured: float) -> float | None:
    """predicted / measured - 1, None without a prediction.

    Example:
        >>> round(error(11.0, 10.0), 6), error(None, 10.0)
        (0.1, None)
    """
    return None if predicted is None else predicted / measured - 1.0


def rows_kept(model: Any, data: Path) -> bool:
    """Whether a run keeps the rows of `data` for the spec `model` after its first epoch: one epoch
    of the trainer's batch pipeline (`trainer_options`, the plan's packed layout) with `cache_data`
    on over the data, then whether the source's row cache holds every row (`flowrec.data.rowcache`:
    a spec with sequences, lists or managed tables streams every epoch)."""
    from dataclasses import replace

    from flowrec.data.batches import iterate_batches
    from flowrec.data.dataset import ParquetSource
    from flowrec.measure.step import trainer_options
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.managed_state import fresh_remapper

    plan = make_plan(model, target="cpu")
    groups = tuple(plan.meta.groups)
    source = ParquetSource(data)
    try:
        options = replace(trainer_options(model, plan), cache_data="on")
        with iterate_batches(model, source, options, 0, 0, groups, remap=fresh_remapper(model, groups)) as epoch:
            for _ in epoch:
                pass
        return source.row_cache.complete()
    finally:
        source.close()


def timed_run(spec: Path, model: Any, work: Path, data: Path, profile: Path, mode: str,
              args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, Any]]:
    """One `flowrec train` run of the spec file `spec` (loaded: `model`), `args.epochs` epochs with
    `--cache-data mode`: (its first and later epochs' robust steps and stage seconds, the plan's cost)."""
    out = work / f"run-{mode}"
    text = bench.flowrec("train", str(spec), "--data", str(data), "--epochs", str(args.epochs),
                         "--cache-data", mode, "--target", str(profile), "--device", "cpu", "--out", str(out),
                         "--quiet", "--json", "--eval-every", "0",
                         *(["--device-budget", args.device_budget] if args.device_budget else []),
                         cwd=work, timed=True)
    times = json.loads((work / "times" / "rank0.json").read_text())
    rounds = [robust.Round(wall * 1e3, waited * 1e3) for wall, waited in times]
    epochs = step_epochs(out / "metrics.jsonl")
    if sorted(set(epochs)) != list(range(args.epochs)) or len(epochs) != len(rounds):
        raise RuntimeError(f"{spec.name}: the run with --cache-data {mode} logged steps of epochs "
                           f"{sorted(set(epochs))} and timed {len(rounds)} of {len(epochs)}: expected "
                           f"{args.epochs} epochs, every step timed")
    first, later = epoch_rounds(rounds, epochs)
    result = json.loads(text[text.index("{"):text.rindex("}") + 1])
    by_epoch = [robust.estimate([r for r, e in zip(rounds, epochs) if e == k]).seconds for k in range(args.epochs)]
    cost = json.loads((out / "plan.json").read_text())["cost"]
    run = {"first_epoch_ms": robust.estimate(first[bench.WARMUP_STEPS:]).seconds,
           "later_epochs_ms": robust.estimate(later).seconds, "by_epoch_ms": by_epoch,
           "steps": len(rounds), "steps_by_epoch": [epochs.count(k) for k in range(args.epochs)], "stage_seconds": result.get("stage_seconds")}
    if result.get("counters"):  # host<->device traffic of every epoch, as tools/bench_costmodel.py counts it
        measured = bench.measured_bytes_per_step(result["counters"], cost["batch_size"],
                                                 len(model.dense_features) + len(model.heads))
        run["measured_h2d_bytes"] = measured
        run["bytes_error"] = cost["h2d_bytes_per_step"] / measured - 1.0 if measured else None
    return run, cost


def run_spec(spec: Path, tmp: Path, args: argparse.Namespace, order: tuple[str, ...]) -> dict[str, Any]:
    """Calibrate `spec`, write its data, run it (`--cache-data` on and off, in `order`, or off alone
    where its rows are not kept) and compare each epoch kind's step with the plan's."""
    work = tmp / spec.stem
    work.mkdir()
    profile = work / "profile.json"
    bench.flowrec("calibrate", str(spec), "--device", "cpu", "--out", str(profile), cwd=work)
    model = bench.load_spec(spec)
    batch = model.training.batch_size
    batches = epoch_batches_for(bench.calibrated_live_ms(profile), args.epoch_seconds, args.min_batches,
                                args.max_batches)
    data = work / "data"
    bench.flowrec("data", "synth", str(spec), "--rows", str(batch * batches), "--out", str(data), cwd=work)
    kept = rows_kept(model, data)
    runs: dict[str, Any] = {}
    cost: dict[str, Any] = {}
    for mode in (order if kept else ("off",)):
        runs[mode], cost = timed_run(spec, model, work, data, profile, mode, args)
    predicted = cost["step_ms_overlap"]
    row: dict[str, Any] = {"spec": spec.name, "rows_kept": kept, "batch": batch, "epoch_batches": batches,
                           "epochs": args.epochs, "order": list(runs), "predicted_step_ms": predicted, "runs": runs}
    row["predicted_h2d_bytes"] = cost["h2d_bytes_per_step"]
    for mode, run in runs.items():
        row[f"first_epoch_error_{mode}"] = error(predicted, run["first_epoch_ms"])
        row[f"later_epochs_error_{mode}"] = error(predicted, run["later_epochs_ms"])
        row[f"bytes_error_{mode}"] = run.get("bytes_error")
    if kept:
        row["later_kept_over_streamed"] = runs["on"]["later_epochs_ms"] / runs["off"]["later_epochs_ms"]
        row["later_kept_over_first"] = runs["on"]["later_epochs_ms"] / runs["on"]["first_epoch_ms"]
    row["later_streamed_over_first"] = runs["off"]["later_epochs_ms"] / runs["off"]["first_epoch_ms"]
    return row


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--specs", default="", help="comma-separated spec file names in specs/ (default: all)")
    parser.add_argument("--threads", type=int, default=1, help="compute threads of calibration and runs (default 1)")
    parser.add_argument("--epochs", type=int, default=3, help="epochs of each run (at least 2; default 3)")
    parser.add_argument("--epoch-seconds", type=float, default=2.0,
                        help="an epoch holds about this many seconds of the calibration's live steps (default 2)")
    parser.add_argument("--min-batches", type=int, default=16, help="batches of an epoch at least (default 16)")
    parser.add_argument("--max-batches", type=int, default=400, help="batches of an epoch at most (default 400)")
    parser.add_argument("--device-budget", default=None, help="device budget of every run (e.g. 64MiB)")
    parser.add_argument("--json", type=Path, default=REPO / "bench" / "results" / "later_epochs_cpu.json")
    args = parser.parse_args(argv)
    if args.epochs < 2:
        parser.error("--epochs must be at least 2 (the first epoch fills the rows)")
    if args.threads < 1 or args.min_batches < 1 or args.max_batches < args.min_batches:
        parser.error("--threads and --min-batches must be at least 1, --max-batches at least --min-batches")
    if not args.epoch_seconds > 0:
        parser.error("--epoch-seconds must be positive")
    try:
        specs = bench.chosen_specs(args.specs)
    except ValueError as exc:
        parser.error(str(exc))
    if args.json.is_dir():
        parser.error(f"--json {args.json} is a folder: give a file")
    if args.json.resolve() in {s.resolve() for s in specs}:
        parser.error(f"--json {args.json} is one of the specs to run: give another file")
    if args.device_budget:
        from flowrec.spec.units import parse_bytes

        try:
            parse_bytes(args.device_budget)
        except ValueError:
            parser.error(f"--device-budget: {args.device_budget!r} is not a size (like 64MiB)")
    bench.THREADS.update(OMP_NUM_THREADS=str(args.threads), NUMBA_NUM_THREADS=str(args.threads))
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="bench-epochs-") as tmp_name:
        tmp = Path(tmp_name)
        for k, spec in enumerate(specs):
            order = MODES if k % 2 == 0 else MODES[::-1]
            print(f"[{k + 1}/{len(specs)}] {spec.name}", file=sys.stderr, flush=True)
            try:
                rows.append(run_spec(spec, tmp, args, order))
            except (RuntimeError, subprocess.TimeoutExpired) as exc:
                rows.append({"spec": spec.name, "error": str(exc)})
            shutil.rmtree(tmp / spec.stem, ignore_errors=True)
            print(json.dumps(rows[-1]), flush=True)
    def worst(key: str) -> float | None:
        values = [r[key] for r in rows if r.get(key) is not None]
        return max(values, key=abs) if values else None

    result = {"tool": "bench_later_epochs", "options": {k: v for k, v in vars(args).items() if k != "json"},
              "rows": rows, **{f"worst_{k}": worst(k) for k in (
                  "first_epoch_error_off", "later_epochs_error_off", "first_epoch_error_on", "later_epochs_error_on",
                  "bytes_error_off", "bytes_error_on")},
              "specs_failed": [r["spec"] for r in rows if "error" in r]}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k.startswith(("worst_", "specs_failed"))}, indent=2))


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
