"""What one virtual shard of a managed table costs per batch: the figure behind the spec's bound on
the managed shards of all tables together (`flowrec.spec.semantic.MAX_MANAGED_SHARDS`).

Every shard of every managed table steps at every batch, with its ids of the batch or none
(`ShardedMap.step_counts`: its clock, its counting and admission, its pass every `every_steps`
steps), in the data stage and once more when the model's maps replay the step. So the map work of
a batch grows with the total number of shards, whatever the batch holds. For each number of
shards S this steps one `ShardedMap` of S shards (16 rows each, LFU, a pass every 10 steps)
through batches of `--ids` Zipf raw ids (and through empty batches), and reports the median
seconds of a step (wall clock and CPU seconds of the thread) and that divided by S: the cost of
one shard. Writes JSON.

Usage:
    python tools/bench_managed_shards.py --json bench/results/managed_shard_step_cpu.json [--steps 30] [--ids 4096]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import numpy as np

from flowrec.data.managed import ShardedMap
from flowrec.spec.model import ManagedSpec

SHARDS = (64, 1024, 4096)
WARMUP = 5  # steps not timed (first merges, allocator)


def time_steps(shards: int, ids_per_batch: int, steps: int, seed: int) -> dict:
    """Median seconds of one step of a map of `shards` shards on batches of `ids_per_batch` ids."""
    rng = np.random.default_rng(seed)
    table = ShardedMap(ManagedSpec(rows=16 * shards, every_steps=10, shards=shards))
    wall, cpu = [], []
    for k in range(steps + WARMUP):
        ids = (rng.zipf(1.2, ids_per_batch).astype(np.int64) * 2654435761 + 1)
        unique, counts = np.unique(ids, return_counts=True)
        t0, c0 = time.perf_counter(), time.thread_time()
        table.step_counts(unique, counts)
        if k >= WARMUP:
            wall.append(time.perf_counter() - t0)
            cpu.append(time.thread_time() - c0)
    step, step_cpu = statistics.median(wall), statistics.median(cpu)
    return {"shards": shards, "ids_per_batch": ids_per_batch, "step_s": step, "step_cpu_s": step_cpu,
            "per_shard_us": step / shards * 1e6, "per_shard_cpu_us": step_cpu / shards * 1e6,
            "held": table.occupied}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="write the figures here (refused if it exists)")
    parser.add_argument("--steps", type=int, default=30, help="timed steps per case (default 30)")
    parser.add_argument("--ids", type=int, default=4096, help="raw ids per batch of the busy case (default 4096)")
    parser.add_argument("--quick", action="store_true", help="64 and 256 shards, 5 steps (a smoke run)")
    args = parser.parse_args()
    if args.steps < 1 or args.ids < 1:
        parser.error("--steps and --ids must be >= 1")
    if args.json.exists():
        parser.error(f"--json {args.json} exists: give a new file (results are never overwritten)")
    shards, steps = ((64, 256), 5) if args.quick else (SHARDS, args.steps)
    load = os.getloadavg()
    cases = [time_steps(s, n, steps, seed) for seed, (s, n) in enumerate((s, n) for s in shards for n in (0, args.ids))]
    for c in cases:
        print(f"{c['shards']:>5} shards, {c['ids_per_batch']:>5} ids a batch: {c['step_s'] * 1e3:7.1f} ms a step, "
              f"{c['per_shard_us']:5.1f} us a shard ({c['per_shard_cpu_us']:5.1f} us CPU)")
    doc = {"benchmark": "managed_shard_step", "steps": steps, "cases": cases,
           "per_shard_us_max": max(c["per_shard_us"] for c in cases),
           "load_before": load, "load_after": os.getloadavg(),
           "device": {"cpu": platform.machine(), "cores": os.cpu_count()}}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")


if __name__ == "__main__":
    main()
