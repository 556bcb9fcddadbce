"""A run's start-up: `flowrec train --data` to its first step now, against the start-up before the
cuts of Round 45, side by side in one process.

  now     as `flowrec train` starts: the planner's access profile holds only what the planner
          reads (`profile_access(..., planner_only=True)`); its read of the data reads the next
          part while it counts one, and counts each part's reads in one pass over its ids, a
          one-hot group's column by column (`RowsRead`), and a table's sampled counts come from
          one unique of its group's ids; a large host table's tables are drawn on torch's intra-op threads
          (`operators.embedding.init_packed_rows`)
  before  the run's profile also simulates the cache curves (five policies at twelve sizes per
          group) and the budget's hot set, which the planner never reads; each part is read, then
          counted (its packed ids, numpy's bincount over every row of the group); the tables are
          drawn one after another. (Both take a table's sampled counts from one unique of its
          group's ids: the mask per table it replaced is not kept here; Round 45 in
          docs/benchmarks/training-rounds-40-49.md times it from the command line against the
          commit before.)

Generates a spec's rows with flowrec's synth into a temp dir, then starts `flowrec.train` on them
for one step (`max_steps=1`, the CPU), alternating the two variants `--rounds` times in this
process after a warm-up start that is not counted. For each variant: the wall-clock seconds of the
whole call (plan, model, one step), of the access profile and of drawing the tables. Both variants
must make the same plan (its JSON) and the same tables after the step (bitwise): the benchmark
stops with an error otherwise. Figures are medians over the rounds; `ratios.startup_now_vs_before`
is the speed-up to the first step from the same run.

Usage: python tools/bench_startup.py [--quick] [--spec S] [--rows N] [--rounds R] [--json PATH]
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

VARIANTS = ("now", "before")
QUICK_SPEC = {"name": "startup_quick", "features": [
    {"name": "x", "type": "dense"},
    {"name": "a", "type": "categorical", "hash_buckets": 900_000, "dim": 8},
    {"name": "b", "type": "categorical", "hash_buckets": 300_000, "dim": 8},
    {"name": "c", "type": "categorical", "hash_buckets": 40, "dim": 8}],
    "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}],
    "heads": [{"name": "h", "input": "m"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 256, "seed": 5}}


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="a small built-in spec (1.24 M table rows) and 30,000 rows, 1 round (smoke run)")
    add_start_arguments(p, "1,000,000")
    a = p.parse_args(argv)
    refuse_below_one(p, a, "rows", "rounds")
    return a


class _ReadThenCount:
    """A source whose `submit` returns once the part is read: no read overlaps the counting of the
    part before it (as `sample_rows` read before the read-ahead)."""

    def __init__(self, source):
        self._source = source

    def __getattr__(self, name: str):
        return getattr(self._source, name)

    def submit(self, *args, **kwargs):
        done = self._source.submit(*args, **kwargs)
        done.result()
        return done


def _bincount_visit(self, table) -> None:
    """`RowsRead.visit` before Round 45: a bincount over every row of the group per part."""
    import numpy as np

    from flowrec.data.packed_ids import column_arrays, pack_group

    if not self.groups:
        return
    cols = {f.name: column_arrays(table.column(f.name)) for f in self.spec.sparse_features}
    for g in self.groups:
        ids = pack_group(g, cols, table.num_rows)[0]
        counts = self.counts[g.name]
        if 8 * len(ids) >= len(counts):
            np.add(counts, np.bincount(ids, minlength=len(counts)), out=counts, casting="unsafe")
        else:
            rows, n = np.unique(ids, return_counts=True)
            counts[rows] += n.astype(np.uint32)


@contextlib.contextmanager
def _variant(name: str, record: dict):
    """Time the run's access profile and its table draws; `before`: as before the cuts (the
    profile with every section, each part read then counted by bincount, the tables drawn one by
    one)."""
    from flowrec.data import profile
    from operators import embedding

    real_profile, real_init, real_rows = profile.profile_access, embedding.init_packed_rows, embedding.PARALLEL_INIT_ROWS
    real_sample, real_visit = profile.sample_rows, profile.RowsRead.visit

    def read_then_count(spec, source, *args, **kwargs):
        return real_sample(spec, _ReadThenCount(source), *args, **kwargs)

    def timed_profile(*args, **kwargs):
        if name == "before":
            kwargs["planner_only"] = False
        t = time.perf_counter()
        made = real_profile(*args, **kwargs)
        record["profile_s"] += time.perf_counter() - t
        record["profile_sections"] = sorted(made)
        return made

    def timed_init(*args, **kwargs):
        t = time.perf_counter()
        try:
            return real_init(*args, **kwargs)
        finally:
            record["init_s"] += time.perf_counter() - t

    profile.profile_access, embedding.init_packed_rows = timed_profile, timed_init
    if name == "before":
        embedding.PARALLEL_INIT_ROWS = 1 << 62
        profile.sample_rows, profile.RowsRead.visit = read_then_count, _bincount_visit
    try:
        yield
    finally:
        profile.profile_access, embedding.init_packed_rows = real_profile, real_init
        embedding.PARALLEL_INIT_ROWS = real_rows
        profile.sample_rows, profile.RowsRead.visit = real_sample, real_visit


def _start(spec, data: Path, name: str) -> tuple[dict, dict, str]:
    import flowrec
    from flowrec.graph.plan_io import plan_json

    record = {"profile_s": 0.0, "init_s": 0.0, "profile_sections": []}
    with _variant(name, record):
        t = time.perf_counter()
        run = flowrec.train(spec, data=str(data), max_steps=1, device="cpu")
        record["startup_s"] = time.perf_counter() - t
    model = run.trained.model
    tables = {n: m.weight.detach().clone() for n, m in model.embeddings.items()}
    plan = plan_json(run.trained.plan)
    record["groups"] = len(tables)
    record["table_rows"] = sum(int(w.shape[0]) for w in tables.values())
    model.close()
    return record, tables, plan


def _same(a: tuple[dict, str], b: tuple[dict, str]) -> None:
    import torch

    if a[1] != b[1]:
        sys.exit("error: the two variants made different plans")
    if a[0].keys() != b[0].keys() or not all(torch.equal(a[0][k], b[0][k]) for k in a[0]):
        sys.exit("error: the two variants' tables differ after the step")


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); the figures, also written to --json."""
    a = _args(argv)
    return in_temp_folder(lambda tmp: _run(a, tmp), "flowrec-startup-")


def _run(a: argparse.Namespace, tmp: Path) -> dict:
    import torch

    from flowrec.data.synth import SynthConfig, synth_dataset

    spec = bench_spec(a.spec, QUICK_SPEC if a.quick else None)
    rows = a.rows or (30_000 if a.quick else 1_000_000)
    rounds = a.rounds or (1 if a.quick else 3)
    data = tmp / "data"
    t = time.perf_counter()
    synth_dataset(spec, data, rows, SynthConfig(seed=7))
    print(f"{rows:,} synthetic rows of {spec.name} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    warm, *_ = _start(spec, data, "now")  # first start of the process (imports, compiled kernels): not counted
    print(f"warm-up start: {warm['startup_s']:.2f} s (not counted)", file=sys.stderr)
    runs: dict[str, list[dict]] = {n: [] for n in VARIANTS}
    for r in range(rounds):
        order = VARIANTS if r % 2 == 0 else VARIANTS[::-1]
        made = {}
        for name in order:
            rec, tables, plan = _start(spec, data, name)
            runs[name].append(rec)
            made[name] = (tables, plan)
            print(f"[round {r + 1}/{rounds}] {name}: start-up {rec['startup_s']:.2f} s, access profile "
                  f"{rec['profile_s']:.2f} s, tables drawn in {rec['init_s']:.2f} s", file=sys.stderr)
        _same(made["now"], made["before"])
    keys = ("startup_s", "profile_s", "init_s")
    med = {n: {k: statistics.median(x[k] for x in rs) for k in keys} for n, rs in runs.items()}
    out = {
        "benchmark": "startup", "spec": spec.name, "rows": rows, "rounds": rounds,
        "profile_sections": {n: runs[n][0]["profile_sections"] for n in VARIANTS},
        "groups": runs["now"][0]["groups"], "table_rows": runs["now"][0]["table_rows"],
        "torch_threads": torch.get_num_threads(), "same_plan_and_tables": True,
        "median": med, "runs": runs,
        "saved_s": {k: med["before"][k] - med["now"][k] for k in keys},
        "ratios": {"startup_now_vs_before": med["before"]["startup_s"] / med["now"]["startup_s"],
                   "profile_now_vs_before": med["before"]["profile_s"] / max(med["now"]["profile_s"], 1e-9),
                   "init_now_vs_before": med["before"]["init_s"] / max(med["now"]["init_s"], 1e-9)},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("table_rows", "median", "saved_s", "ratios")}, indent=2))
    return out


if __name__ == "__main__":
    main()
