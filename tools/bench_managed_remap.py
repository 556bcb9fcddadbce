"""What the managed remap costs next to the DLRM-Criteo training step (one run, side by side).

specs/dlrm_criteo.yaml twice: as it is (26 hashed tables) and with every categorical table
managed at the same rows (LFU, eviction every `--every-steps` steps). Both train on synthetic
Zipf batches of the same draws (the managed arm's columns hold the draws' raw 64-bit ids), from
the same plan, in one process, alternating step by step. Measured per batch: the remap in the
data stage (`Remapper.remap`, all 26 maps: counts, admission, eviction, lookup; off the
training thread), the replay of the map step and the reset of evicted rows on the training
thread (`before_step` + `after_step`), and `train_step` of each arm. The remap is also timed in
CPU seconds of its thread, which a loaded machine inflates less than the wall clock. With `--prefill N` every
map first takes N synthetic batches (not timed), so the maps are measured as full as a long
run leaves them. With `--shards S` (S > 1) a third arm stages the same batches through maps of S
virtual shards per table (`managed.shards`, at most a table's rows), prefilled alike, and its
remap is timed beside the one-shard remap (data stage only: it trains nothing). Writes JSON
(medians over the timed batches).

Usage:
    python tools/bench_managed_remap.py --json bench/results/managed_remap_cpu.json [--steps 12] [--prefill 40] [--shards 8]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from dataclasses import replace
from pathlib import Path

import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.managed_stage import Remapper
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.lowering import lower
from flowrec.runtime.managed_state import ManagedState
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import load_spec
from flowrec.spec.model import ManagedSpec

REPO = Path(__file__).resolve().parents[1]
BATCH = 4096  # samples per step


class TimedRemapper(Remapper):
    """A remapper that records the seconds of each batch's remap: wall clock, and CPU time of its
    thread (`time.thread_time`: without the time spent waiting for a core on a loaded machine)."""

    seconds: list[float]
    cpu_seconds: list[float]

    def remap(self, cols):
        t0, c0 = time.perf_counter(), time.thread_time()
        out = super().remap(cols)
        self.seconds.append(time.perf_counter() - t0)
        self.cpu_seconds.append(time.thread_time() - c0)
        return out


def managed_spec(spec, every_steps: int, shards: int = 1):
    tables = tuple(replace(t, hashed=False, managed=ManagedSpec(rows=t.rows, every_steps=every_steps,
                                                               shards=min(shards, t.rows)))
                   for t in spec.tables)
    return replace(spec, name=spec.name + "_managed", tables=tables)


def staged(spec, plan, rows: int, seed: int, remap: Remapper | None) -> list:
    table = synth_table(spec, rows, SynthConfig(seed=seed))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 4)), opts, 0, 0, plan.meta.groups, remap=remap) as it:
        return list(it)


def prefill(state: ManagedState, spec, plan, batches: int, every_steps: int) -> None:
    """Step the maps through `batches` synthetic batches (other draws than the timed ones)."""
    for k in range(batches):
        remap = state.remapper(train=True)
        for b in staged(spec, plan, BATCH, 1000 + k, remap):
            state.after_step(b)
    state.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--steps", type=int, default=12, help="timed steps (after 2 warm-up steps)")
    parser.add_argument("--prefill", type=int, default=40, help="batches each map takes before the timed ones")
    parser.add_argument("--every-steps", type=int, default=1000)
    parser.add_argument("--shards", type=int, default=1, help="also time the remap through maps of this many "
                                                                "virtual shards per table (data stage only)")
    args = parser.parse_args()
    if args.shards < 1:
        parser.error("--shards must be >= 1")
    torch.set_num_threads(max(1, torch.get_num_threads()))
    hashed = load_spec(REPO / "specs" / "dlrm_criteo.yaml")
    managed = managed_spec(hashed, args.every_steps)
    plan = make_plan(hashed, target="cpu", device_budget="64GiB")
    rows = BATCH * (args.steps + 2)
    arms = {}
    for name, spec in (("hashed", hashed), ("managed", managed)):
        model = lower(plan, spec, "cpu")
        opt = spec.dense_optimizer
        arms[name] = {"model": model, "opt": make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params)),
                      "step_s": [], "replay_s": []}
    state = arms["managed"]["model"].managed
    prefill(state, managed, plan, args.prefill, args.every_steps)
    held = {t: m.occupied for t, m in state.maps.items()}
    remap = TimedRemapper(managed, plan.meta.groups, {t: m.copy() for t, m in state.maps.items()}, train=True)
    remap.seconds, remap.cpu_seconds = [], []
    batches = {"hashed": staged(hashed, plan, rows, 0, None), "managed": staged(managed, plan, rows, 0, remap)}
    sharded = None
    if args.shards > 1:
        sharded_spec = managed_spec(hashed, args.every_steps, args.shards)
        sharded_state = ManagedState(sharded_spec, plan.meta.groups)
        prefill(sharded_state, sharded_spec, plan, args.prefill, args.every_steps)
        sharded = TimedRemapper(sharded_spec, plan.meta.groups,
                                {t: m.copy() for t, m in sharded_state.maps.items()}, train=True)
        sharded.seconds, sharded.cpu_seconds = [], []
        staged(sharded_spec, plan, rows, 0, sharded)
        del sharded_state
    for k in range(args.steps + 2):
        for name, arm in arms.items():
            batch, model = batches[name][k], arm["model"]
            t0 = time.perf_counter()
            if name == "managed":
                model.managed.before_step(model.embeddings, batch)
            t1 = time.perf_counter()
            train_step(model, arm["opt"], batch)
            t2 = time.perf_counter()
            if name == "managed":
                model.managed.after_step(batch)
            t3 = time.perf_counter()
            if k >= 2:
                arm["step_s"].append(t2 - t1)
                arm["replay_s"].append((t1 - t0) + (t3 - t2))
    t0 = time.perf_counter()
    state.sync()  # replays still queued at the end (off the training thread)
    tail_s = time.perf_counter() - t0
    med = statistics.median
    step_h, step_m = med(arms["hashed"]["step_s"]), med(arms["managed"]["step_s"])
    remap_s, replay_s = med(remap.seconds[2:]), med(arms["managed"]["replay_s"])
    result = {
        "batch": BATCH, "timed_steps": args.steps, "prefill_batches": args.prefill, "every_steps": args.every_steps,
        "threads": torch.get_num_threads(), "load_average": os.getloadavg(),
        "ids_held_largest_tables": dict(sorted(held.items(), key=lambda kv: -kv[1])[:3]),
        "ids_in_maps": int(sum(len(m.entries()) for m in remap.maps.values())),
        "step_s_hashed": round(step_h, 4), "step_s_managed": round(step_m, 4),
        "remap_s_data_stage": round(remap_s, 4),
        "remap_thread_cpu_s_data_stage": round(med(remap.cpu_seconds[2:]), 4), "replay_and_reset_s_training_thread": round(replay_s, 4),
        "remap_share_of_step": round(remap_s / step_h, 4),
        "training_thread_share_of_step": round(replay_s / step_h, 4),
    }
    if sharded is not None:
        result.update({"shards": args.shards, "remap_s_data_stage_sharded": round(med(sharded.seconds[2:]), 4),
                       "remap_thread_cpu_s_data_stage_sharded": round(med(sharded.cpu_seconds[2:]), 4),
                       "ids_in_maps_sharded": int(sum(len(m.entries()) for m in sharded.maps.values()))})
    print(json.dumps(result, indent=2))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    del arms, batches
    gc.collect()


if __name__ == "__main__":
    main()
