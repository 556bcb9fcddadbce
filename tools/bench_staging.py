"""Staging throughput (samples/s) on Criteo-shaped Parquet: flowrec staging vs a plain loop.

Generates DLRM-Criteo rows with flowrec's synth into a temp dir, then measures in one run:
  staging            iterate_batches over ParquetSource (direct pyarrow reads), batch 4096, with
                     the data checks on (the default: ids in their tables, finite values, labels;
                     each part file is checked once, then known by its fingerprint) and the
                     decoded rows kept across epochs (the default `cache_data="auto"`:
                     flowrec.data.rowcache; the first epoch reads and fills, later ones read nothing)
  staging_uncached   the same with cache_data="off": every epoch reads and decodes the files
                     (the "staging" of runs A-F)
  staging_unchecked  uncached with StagingOptions(check=False): what the checks cost
  staging_lookahead  staging with lookahead W=8 (unique rows, casting, window rows)
  staging_dask       partitions read by a local Dask cluster (full mode only; never cached)
  plain_loop_kept    pandas.read_parquet once, then per epoch df.sample shuffle + per-batch
                     torch.tensor: the plain loop with its DataFrame kept across epochs, as
                     staging keeps its rows (what a user writes for several epochs)
  plain_loop         the same reading the files every epoch (the "plain loop" of runs A-F)
  synth              synthetic rows generated per second
Figures are medians of repeated runs (the measured loops alternate in every repeat, so
background load hits them alike); ratios come from the same run: `staging_vs_plain` compares
like with like (both keep their rows), `uncached_vs_plain_reread` both reading every epoch (the
ratio of runs A-F). The checks' cost is measured, without the cache, in
back-to-back pairs (checked, unchecked; `--pairs`; medians of the pair ratios, of samples per
wall-clock second and per CPU second of the process, which other processes' load disturbs less):
  ratios.checked_vs_unchecked[_cpu]              every epoch after the files were checked once
  ratios.first_epoch_checked_vs_unchecked[_cpu]  an epoch that checks every file (no record)
and `checks.seconds`: one pass of the checks over the whole dataset, and its share of an epoch.

The loops above share one process, so each one's rate depends on the memory the loops before it
left (a first pass over fresh memory pays its page faults: 3-5x slower for the plain loop on this
VM). `isolated` measures staging and the plain loop alike in processes of their own (`--isolated`
processes per loop, alternating, each running `--epochs` epochs): `cold` is each process's first
epoch, `warm` the median of its later ones; figures are medians over the processes, with the
page faults and CPU seconds per epoch. The ratios `staging_vs_plain_cold` and
`staging_vs_plain_warm` compare like with like (staging keeping its decoded rows, the plain loop
its DataFrame); `uncached_vs_plain_reread_{cold,warm}` both reading every epoch (run F's ratios).

Usage: python tools/bench_staging.py [--quick] [--json PATH] [--isolated N] [--epochs E]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

BATCH = 4096  # samples per batch
WINDOW = 8  # lookahead window, batches


def _plain_loop(path: Path, dense: list[str], sparse: list[str], offsets: list[int], seed: int,
                kept: dict | None = None) -> int:
    """What a user writes: read the dataset with pandas, shuffle it, per batch torch.tensor.

    With `kept` (a dict living across epochs) the DataFrame is read once and kept there, and each
    epoch shuffles it with the next seed: the plain loop's equivalent of staging's row cache."""
    import pandas as pd
    import torch

    if kept is None:
        df = pd.read_parquet(path).sample(frac=1.0, random_state=seed)
    else:
        if "df" not in kept:
            kept["df"], kept["epoch"] = pd.read_parquet(path), 0
        kept["epoch"] += 1
        df = kept["df"].sample(frac=1.0, random_state=seed + kept["epoch"])
    base = torch.tensor(offsets)
    n = 0
    for i in range(0, len(df), BATCH):
        chunk = df.iloc[i:i + BATCH]
        x = torch.tensor(chunk[dense].values, dtype=torch.float32)
        ids = (torch.tensor(chunk[sparse].values) + base).reshape(-1)
        off = torch.arange(ids.numel() + 1)
        y = torch.tensor(chunk["label"].values, dtype=torch.float32)
        n += len(chunk)
        del x, off, y
    return n


def _staging(spec, source, lookahead: int, check: bool = True, cache: str = "auto") -> int:
    from flowrec.data.batches import StagingOptions, iterate_batches

    opts = StagingOptions(batch_size=BATCH, lookahead=lookahead, workers=2, prefetch=8, check=check,
                          cache_data=cache)
    n = 0
    with iterate_batches(spec, source, opts) as it:
        for batch in it:
            n += batch.size
    return n


def _rates(fns: dict, repeats: int) -> dict[str, list[float]]:
    """Samples/s of each function, the functions alternating in every repeat (fair under noise)."""
    rates: dict[str, list[float]] = {name: [] for name in fns}
    if repeats > 1:
        for fn in fns.values():  # warm-up pass (page cache, allocator, thread pools), not timed
            fn()
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            n = fn()
            rates[name].append(n / (time.perf_counter() - start))
    return rates


def _pairs(checked, unchecked, pairs: int) -> dict[str, list[float]]:
    """Ratios checked / unchecked of back-to-back runs (the order flips every pair): of samples
    per wall-clock second, and of samples per CPU second of this process (all its threads)."""
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    for i in range(pairs):
        order = [("checked", checked), ("unchecked", unchecked)]
        wall, cpu = {}, {}
        for name, fn in order if i % 2 == 0 else order[::-1]:
            start, start_cpu = time.perf_counter(), time.process_time()
            n = fn()
            wall[name] = n / (time.perf_counter() - start)
            cpu[name] = n / (time.process_time() - start_cpu)
        ratios["wall"].append(wall["checked"] / wall["unchecked"])
        ratios["cpu"].append(cpu["checked"] / cpu["unchecked"])
    return ratios


def _fresh(spec, data: Path, check: bool) -> int:
    """One epoch on a newly opened source with no check record: every file is checked."""
    from flowrec.data.checked import RECORD_FILE
    from flowrec.data.dataset import ParquetSource

    (data / RECORD_FILE).unlink(missing_ok=True)
    source = ParquetSource(data)
    try:
        return _staging(spec, source, 0, check, cache="off")
    finally:
        source.close()


def _check_seconds(spec, source) -> float:
    """Seconds of one pass of the checks over every partition (read beforehand; best of 3)."""
    from flowrec.data.batches import _columns
    from flowrec.data.checks import check_partition, partition_rules

    columns = _columns(spec)
    rules = partition_rules(spec, columns)
    tables = [source.submit(i, columns).result() for i in range(len(source.partition_rows()))]
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for i, table in enumerate(tables):
            check_partition(table, rules, str(i))
        best = min(best, time.perf_counter() - start)
    return best


def _check_figures(spec, data: Path, source, fns: dict, pairs: int, epoch_s: float) -> tuple[dict, dict]:
    """(ratios, details) of what the data checks cost; `epoch_s`: seconds of an unchecked epoch."""
    steady = _pairs(fns["staging_uncached"], fns["staging_unchecked"], pairs)
    first = _pairs(lambda: _fresh(spec, data, True), lambda: _fresh(spec, data, False), pairs)
    seconds = _check_seconds(spec, source)
    ratios = {"checked_vs_unchecked": statistics.median(steady["wall"]),
              "checked_vs_unchecked_cpu": statistics.median(steady["cpu"]),
              "first_epoch_checked_vs_unchecked": statistics.median(first["wall"]),
              "first_epoch_checked_vs_unchecked_cpu": statistics.median(first["cpu"])}
    return ratios, {"pairs": pairs, "steady": steady, "first_epoch": first, "seconds": seconds,
                    "epoch_seconds_unchecked": epoch_s, "share_of_epoch": seconds / epoch_s}


LOOPS = ("staging", "plain_loop_kept", "staging_uncached", "plain_loop")  # what `isolated` runs


def _loops(data: Path) -> tuple[dict, object]:
    """(name -> epoch function, source) of the loops `isolated` compares, on dataset `data`."""
    from flowrec.data.dataset import ParquetSource
    from flowrec.graph.packing import group_layout
    from flowrec.spec import load_spec

    spec = load_spec(REPO / "specs" / "dlrm_criteo.yaml")
    source = ParquetSource(data)
    group = group_layout(spec)[0]
    offsets = [group.row_offsets[f.table] for f in group.fields]
    dense = [f.name for f in spec.dense_features]
    sparse = [f.feature for f in group.fields]
    kept: dict = {}
    return {"staging": lambda: _staging(spec, source, 0),
            "staging_uncached": lambda: _staging(spec, source, 0, cache="off"),
            "plain_loop_kept": lambda: _plain_loop(data, dense, sparse, offsets, 0, kept),
            "plain_loop": lambda: _plain_loop(data, dense, sparse, offsets, 0)}, source


def _worker(loop: str, data: Path, epochs: int) -> None:
    """Run `epochs` epochs of one loop in this (fresh) process; print one JSON line per epoch."""
    fns, source = _loops(data)
    try:
        for _ in range(epochs):
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start, start_cpu = time.perf_counter(), time.process_time()
            n = fns[loop]()
            wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
            print(json.dumps({"samples_per_s": n / wall, "samples": n, "cpu_s": cpu,
                              "faults": resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults}), flush=True)
    finally:
        source.close()


def _isolated(data: Path, processes: int, epochs: int, environ: dict[str, str]) -> dict:
    """Staging and the plain loop, each in fresh processes (alternating): first (cold) and later
    (warm) epochs, medians over the processes. `environ`: the environment this benchmark was
    started with (a local Dask cluster writes MALLOC_TRIM_THRESHOLD_=65536 and OMP_NUM_THREADS=1
    into its parent's os.environ; inherited, glibc returns freed memory at once and every epoch
    faults its pages in again: 330,000 faults per warm epoch of the plain loop instead of 2,000)."""
    runs: dict[str, list[list[dict]]] = {loop: [] for loop in LOOPS}
    env = {**environ, "PYTHONPATH": os.pathsep.join([str(REPO), environ.get("PYTHONPATH", "")])}
    for _ in range(processes):
        for loop in runs:
            out = run_tree([sys.executable, __file__, "--worker", loop, "--data", str(data),
                            "--epochs", str(epochs)], capture_output=True, text=True, env=env,
                           timeout_s=600, check=True).stdout
            runs[loop].append([json.loads(line) for line in out.splitlines() if line.startswith("{")])
    figures: dict = {}
    for loop, procs in runs.items():
        cold = [p[0] for p in procs]
        warm = [statistics.median(e["samples_per_s"] for e in p[1:]) for p in procs if len(p) > 1]
        figures[loop] = {"cold": statistics.median(e["samples_per_s"] for e in cold),
                         "warm": statistics.median(warm) if warm else None,
                         "cold_faults": statistics.median(e["faults"] for e in cold),
                         "warm_faults": statistics.median(e["faults"] for p in procs for e in p[1:]) if warm else None,
                         "cold_cpu_s": statistics.median(e["cpu_s"] for e in cold),
                         "warm_cpu_s": statistics.median(e["cpu_s"] for p in procs for e in p[1:]) if warm else None}
    ratios = {}
    for name, (a, b) in {"staging_vs_plain": ("staging", "plain_loop_kept"),
                         "uncached_vs_plain_reread": ("staging_uncached", "plain_loop")}.items():
        ratios[f"{name}_cold"] = figures[a]["cold"] / figures[b]["cold"]
        if figures[a]["warm"] and figures[b]["warm"]:
            ratios[f"{name}_warm"] = figures[a]["warm"] / figures[b]["warm"]
    return {"processes": processes, "epochs": epochs, "samples_per_s": figures, "ratios": ratios, "runs": runs}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="small data, one repeat (smoke test)")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--rows", type=int, help="rows to generate (default 1.5M, quick 200k)")
    parser.add_argument("--pairs", type=int, help="checked/unchecked pairs (default 9, quick 1)")
    parser.add_argument("--isolated", type=int, help="processes per loop of `isolated` (default 3, quick 1)")
    parser.add_argument("--epochs", type=int, default=4, help="epochs per isolated process (first cold)")
    parser.add_argument("--worker", choices=LOOPS, help=argparse.SUPPRESS)
    parser.add_argument("--data", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        _worker(args.worker, args.data, args.epochs)
        return
    pairs = args.pairs or (1 if args.quick else 9)
    processes = args.isolated or (1 if args.quick else 3)
    rows = args.rows or (200_000 if args.quick else 1_500_000)
    repeats = 1 if args.quick else 3
    environ = dict(os.environ)  # as started: before Dask changes it (`_isolated`)
    with tempfile.TemporaryDirectory(prefix="flowrec-bench-") as tmp:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(tmp) / "inductor"))
        os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(Path(tmp) / "dask"))
        import torch

        from flowrec.data.dataset import DaskSource, ParquetSource
        from flowrec.data.synth import synth_dataset
        from flowrec.graph.packing import group_layout
        from flowrec.spec import load_spec

        spec = load_spec(REPO / "specs" / "dlrm_criteo.yaml")
        data = Path(tmp) / "criteo"
        start = time.perf_counter()
        synth_dataset(spec, data, rows, rows_per_file=1 << 18)
        synth_rate = rows / (time.perf_counter() - start)
        source = ParquetSource(data)
        group = group_layout(spec)[0]
        offsets = [group.row_offsets[f.table] for f in group.fields]
        dense = [f.name for f in spec.dense_features]
        sparse = [f.feature for f in group.fields]
        kept: dict = {}
        fns = {"staging": lambda: _staging(spec, source, 0),
               "staging_uncached": lambda: _staging(spec, source, 0, cache="off"),
               "staging_unchecked": lambda: _staging(spec, source, 0, check=False, cache="off"),
               "staging_lookahead": lambda: _staging(spec, source, WINDOW),
               "plain_loop_kept": lambda: _plain_loop(data, dense, sparse, offsets, 0, kept),
               "plain_loop": lambda: _plain_loop(data, dense, sparse, offsets, 0)}
        dask_source = None if args.quick else DaskSource(data, workers=2)
        if dask_source is not None:
            fns["staging_dask"] = lambda: _staging(spec, dask_source, 0)
        try:
            runs = _rates(fns, repeats)
            epoch_s = rows / statistics.median(runs["staging_unchecked"])
            cache_bytes = source.row_cache.nbytes  # the staged rows the cached loops kept
            kept.clear()  # the DataFrame the shared-process plain loop kept: not the isolated loops' memory
            check_ratios, checks = _check_figures(spec, data, source, fns, pairs, epoch_s)
            _fresh(spec, data, True)  # the check record the staging figures assume (files checked once)
        finally:
            if dask_source is not None:
                dask_source.close()
            source.close()
        gc.collect()
        isolated = _isolated(data, processes, args.epochs, environ)  # after this process freed its rows
        figures = {name: statistics.median(r) for name, r in runs.items()}
        figures["synth_rows"] = synth_rate
        staging, lookahead, plain = figures["staging"], figures["staging_lookahead"], figures["plain_loop_kept"]
    result = {
        "benchmark": "staging", "quick": args.quick, "rows": rows, "batch_size": BATCH,
        "lookahead_window": WINDOW, "repeats": repeats, "samples_per_s": figures, "runs": runs,
        "ratios": {"staging_vs_plain": staging / plain, "lookahead_vs_plain": lookahead / plain,
                   "uncached_vs_plain_reread": figures["staging_uncached"] / figures["plain_loop"],
                   **check_ratios},
        "row_cache_bytes": cache_bytes,
        "checks": checks, "isolated": isolated,
        "device": {"kind": "cpu", "cpus": os.cpu_count(), "machine": platform.machine(),
                   "python": platform.python_version(), "torch": torch.__version__,
                   "torch_threads": torch.get_num_threads()},
    }
    for name, value in figures.items():
        print(f"{name:<20} {value:>14,.0f} samples/s", file=sys.stderr)
    for name, value in result["ratios"].items():
        print(f"{name:<38} {value:>8.3f}x", file=sys.stderr)
    for loop, row in isolated["samples_per_s"].items():
        warm = f"{row['warm']:>14,.0f}" if row["warm"] else f"{'-':>14}"
        print(f"isolated {loop:<16} cold {row['cold']:>14,.0f} warm {warm} samples/s "
              f"(faults {row['cold_faults']:,.0f} / {row['warm_faults'] or 0:,.0f})", file=sys.stderr)
    for name, value in isolated["ratios"].items():
        print(f"isolated {name:<33} {value:>8.3f}x", file=sys.stderr)
    print(f"{'checks: one pass over the dataset':<38} {checks['seconds']:>8.3f} s "
          f"({checks['share_of_epoch']:.1%} of an unchecked epoch)", file=sys.stderr)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
