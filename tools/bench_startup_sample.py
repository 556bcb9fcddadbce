"""A run's start-up with a static hot set: FAE's sample read once (kept from the planner's access
profile) against read twice (the planner's read, then the hot set's own), side by side.

Generates a spec's rows with flowrec's synth into a temp dir, then starts `flowrec.train` on them
with a device budget (`--device-budget`) and the spec's cache policy set to static_hot
(`--cache`) for one step, alternating the two variants `--rounds`
times in this process:
  kept        as `flowrec train` runs: the planner's sample is kept and the hot set takes it
  read_twice  nothing kept (as before the sample was kept): the hot set reads every partition again
For each variant: the wall-clock seconds of the whole call (plan, model, hot set, one step), the
seconds spent in `flowrec.data.profile.sample_rows` (the planner's profile and the hot set's,
apart) and the part files those reads checked. A first start, not counted, warms the process. Figures are medians over the rounds; `ratios.startup_kept_vs_twice`
is the kept call's speed-up from the same run. A plan without a static_hot group keeps nothing and
is reported as such (`static_hot_groups` 0): raise or lower the budget.

Usage: python tools/bench_startup_sample.py [--quick] [--spec S] [--rows N] [--device-budget B]
           [--rounds R] [--json PATH]
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.benchargs import add_start_arguments, bench_spec, in_temp_folder, refuse_below_one  # noqa: E402


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small spec and 30,000 rows, 1 round (smoke run)")
    add_start_arguments(p, "2,000,000")
    p.add_argument("--rows-per-file", type=int, default=None, help="rows per part file (default 250,000; quick 8,000)")
    p.add_argument("--device-budget", default=None, help="device budget of the plan (default 64MiB; quick 256KiB)")
    p.add_argument("--cache", default="static_hot", choices=("static_hot", "auto"),
                   help="the spec's cache policy (default static_hot, whose hot set reads the sample; "
                        "auto: the planner's choice, which may keep nothing)")
    a = p.parse_args(argv)
    refuse_below_one(p, a, "rows", "rounds", "rows_per_file")
    return a


QUICK_SPEC = {"name": "startup_quick", "features": [
    {"name": "x", "type": "dense"},
    {"name": "a", "type": "categorical", "hash_buckets": 30_000, "dim": 16},
    {"name": "b", "type": "categorical", "hash_buckets": 20_000, "dim": 16}],
    "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}],
    "heads": [{"name": "h", "input": "m"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 256, "seed": 5}}


@contextlib.contextmanager
def _measured(keep: bool, record: dict):
    """Count the part files the sample reads check and time `sample_rows`; `keep` False: nothing is
    kept (the key of every sample is None), as before the planner's sample was kept."""
    from flowrec.data import profile

    real_check, real_sample, real_key = profile.check_partition, profile.sample_rows, profile._sample_key

    def check(table, rules, where, *rest):
        record["files_read"] += 1
        return real_check(table, rules, where, *rest)

    def sample(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real_sample(*args, **kwargs)
        finally:
            profiled = len(args) > 4 and args[4] is not None or kwargs.get("visit") is not None
            record["profile_sample_s" if profiled else "hot_set_sample_s"] += time.perf_counter() - t

    # the module's own globals: the hot set imports sample_rows from it at call time (caches.static_hot)
    profile.check_partition, profile.sample_rows = check, sample
    if not keep:
        profile._sample_key = lambda *a: None
    try:
        yield
    finally:
        profile.check_partition, profile.sample_rows, profile._sample_key = real_check, real_sample, real_key


def _start(spec, data: Path, budget: str, keep: bool) -> dict:
    import flowrec
    from flowrec.runtime.caches.static_hot import StaticHotEmbedding

    record = {"files_read": 0, "profile_sample_s": 0.0, "hot_set_sample_s": 0.0}
    with _measured(keep, record):
        t = time.perf_counter()
        run = flowrec.train(spec, data=str(data), device_budget=budget, max_steps=1, device="cpu")
        record["startup_s"] = time.perf_counter() - t
    record["sample_s"] = record["profile_sample_s"] + record["hot_set_sample_s"]
    model = run.trained.model
    record["static_hot_groups"] = sum(isinstance(m, StaticHotEmbedding) for m in model.embeddings.values())
    record["hot_rows"] = {n: int(m.hot_rows.numel()) for n, m in model.embeddings.items()
                          if isinstance(m, StaticHotEmbedding)}
    record["placements"] = {g.name: g.placement for g in run.trained.plan.meta.groups}
    model.close()
    return record


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); the figures, also written to --json."""
    a = _args(argv)
    return in_temp_folder(lambda tmp: _run(a, tmp), "flowrec-startup-")


def _run(a: argparse.Namespace, tmp: Path) -> dict:
    from dataclasses import replace

    from flowrec.data.dataset import parquet_files
    from flowrec.data.synth import SynthConfig, synth_dataset

    spec = bench_spec(a.spec, QUICK_SPEC if a.quick else None)
    spec = replace(spec, plan=replace(spec.plan, cache=a.cache))
    rows = a.rows or (30_000 if a.quick else 2_000_000)
    budget = a.device_budget or ("256KiB" if a.quick else "64MiB")
    rounds = a.rounds or (1 if a.quick else 3)
    data = tmp / "data"
    t = time.perf_counter()
    synth_dataset(spec, data, rows, SynthConfig(seed=7), rows_per_file=a.rows_per_file or (8_000 if a.quick else 250_000))
    print(f"{rows:,} synthetic rows of {spec.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    files = len(parquet_files(data))
    warm = _start(spec, data, budget, False)  # first start of the process (imports, compiled kernels): not counted
    print(f"warm-up start: {warm['startup_s']:.2f} s (not counted)", file=sys.stderr)
    runs: dict[str, list[dict]] = {"kept": [], "read_twice": []}
    for r in range(rounds):
        order = ("kept", "read_twice") if r % 2 == 0 else ("read_twice", "kept")
        for name in order:
            rec = _start(spec, data, budget, name == "kept")
            runs[name].append(rec)
            print(f"[round {r + 1}/{rounds}] {name}: start-up {rec['startup_s']:.2f} s, sampling "
                  f"{rec['profile_sample_s']:.2f} s (profile) + {rec['hot_set_sample_s']:.2f} s (hot set), "
                  f"{rec['files_read']} part files read", file=sys.stderr)
    med = {n: {k: statistics.median(x[k] for x in rs)
               for k in ("startup_s", "sample_s", "profile_sample_s", "hot_set_sample_s", "files_read")}
           for n, rs in runs.items()}
    out = {
        "benchmark": "startup_sample", "spec": spec.name, "rows": rows, "part_files": files,
        "device_budget": budget, "cache": a.cache, "rounds": rounds,
        "static_hot_groups": runs["kept"][0]["static_hot_groups"], "placements": runs["kept"][0]["placements"],
        "hot_rows": runs["kept"][0]["hot_rows"],
        "median": med, "runs": runs,
        "saved_s": {"startup": med["read_twice"]["startup_s"] - med["kept"]["startup_s"],
                    "hot_set_sample": med["read_twice"]["hot_set_sample_s"] - med["kept"]["hot_set_sample_s"]},
        "ratios": {"startup_kept_vs_twice": med["read_twice"]["startup_s"] / med["kept"]["startup_s"],
                   "sampling_kept_vs_twice": (med["read_twice"]["sample_s"] / med["kept"]["sample_s"]
                                              if med["kept"]["sample_s"] > 0 else None)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("static_hot_groups", "part_files", "median", "saved_s", "ratios")}, indent=2))
    return out


if __name__ == "__main__":
    main()
