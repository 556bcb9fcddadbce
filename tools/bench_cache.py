"""Cache placements on a DLRM-Criteo-shaped model with a device budget of 10% of the table bytes.

Two traces over the 26 Criteo categorical tables (vocabularies capped so the run fits this
machine), dim 16, row-wise Adagrad, staged with lookahead W and a horizon of H more batches:

  zipf      Zipf-skewed synthetic rows (flowrec's synth, alpha 1.1), shuffled: the skewed trace
            (its figures are the top-level keys)
  drifting  popularity drifts: sample j comes from synth seed k or k+1 (k = 0..DRIFT_PHASES-2)
            with the share of k+1 rising linearly along the phase, in time order (no shuffle)

Each policy trains the embedding stage (lookups, casted backward, fused update and its cache
work) over the same batches behind a fixed nonlinear head:

  device      every table resident (fits here: the host is the device)
  host        the table on the host; pooled rows to the device, gradients back
  static_hot  FAE: hottest rows of a 25% sample on the device, hot/cold batches (HotColdBatcher)
  lookahead   ScratchPipe scratchpad of the budget's rows, exchange on a worker thread; victims
              by next use in the horizon, then fewest uses
  lru         demand-fetch LRU of the same capacity
  lfu         LFU of the same capacity on the batch trace (simulated, no timing)
  belady      Belady's OPT bound of the same capacity on the batch trace (simulated, no timing)

Figures: samples/s (median of repeats; the policies alternate within each repeat), bytes moved
per sample from the counters (ids and offsets + row traffic; `row_bytes_per_sample` without the
ids), train-time hit rates, and static_hot's hot-sample fraction against the profile's
prediction. Ratios compare row traffic of one run. Counted bytes are logical transfers: on a
CPU the "device" is host memory and nothing crosses a link.

Usage: python tools/bench_cache.py [--quick] [--horizon H] [--json PATH]
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

import numpy as np
import pyarrow as pa
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.data.batches import StagingOptions, iterate_batches  # noqa: E402
from flowrec.data.cachesim import batch_trace, belady_hits, lfu_hits  # noqa: E402
from flowrec.data.dataset import MemorySource, split_table  # noqa: E402
from flowrec.data.packed_ids import column_arrays, pack_group  # noqa: E402
from flowrec.data.profile import profile_access, sample_rows  # noqa: E402
from flowrec.data.synth import SynthConfig, synth_table  # noqa: E402
from flowrec.graph.packing import group_layout  # noqa: E402
from flowrec.runtime.caches import CACHE_MODULES, hottest_rows  # noqa: E402
from flowrec.testing.lru import LRUEmbedding  # noqa: E402
from flowrec.runtime.caches.fae_batches import HotColdBatcher, hot_samples  # noqa: E402
from flowrec.spec import load_spec  # noqa: E402
from operators.embedding import PackedEmbeddingBag  # noqa: E402

BUDGET_SHARE = 0.10  # device budget as a share of the table bytes
SAMPLE_RATE = 0.25  # FAE profile sample (large enough that the hottest rows, not all seen rows, fill the budget)
PROFILE_TRACE = 1000  # accesses of the profile's own cache curves (not used here; kept short)
WINDOW = 4  # lookahead window, batches
HORIZON = 12  # batches after the window whose rows the lookahead's victim choice knows
DRIFT_PHASES = 3  # synth seeds the drifting trace moves through
TOP_LEVEL = ("device", "host", "static_hot", "lookahead", "lru", "belady")  # zipf figures at the top level
ZIPF_ALPHA = 1.1
FULL = {"vocab_cap": 100_000, "batch": 2048, "batches": 40, "repeats": 2}
QUICK = {"vocab_cap": 3_000, "batch": 128, "batches": 8, "repeats": 1}


def criteo_spec(vocab_cap: int, batch: int):
    """specs/dlrm_criteo.yaml with vocabularies capped at `vocab_cap` and the bench's batch size."""
    spec = load_spec(REPO / "specs" / "dlrm_criteo.yaml")
    tables = tuple(replace(t, rows=min(t.rows, vocab_cap)) for t in spec.tables)
    return replace(spec, tables=tables, data=None, training=replace(spec.training, batch_size=batch))


def staged(spec, source, shuffle: bool, horizon: int):
    opts = StagingOptions(batch_size=spec.training.batch_size, workers=2, lookahead=WINDOW, horizon=horizon,
                          shuffle=shuffle)
    with iterate_batches(spec, source, opts) as it:
        return list(it)


def drifting_table(spec, rows: int, phases: int = DRIFT_PHASES) -> pa.Table:
    """`rows` rows in time order whose popularity drifts through the synth seeds 0..phases-1.

    Row j comes from seed k+1 with probability f and from seed k otherwise, where
    j / rows * (phases - 1) = k + f: the hot rows of seed k cool while those of k+1 heat up.
    """
    tables = [synth_table(spec, rows, SynthConfig(seed=seed, alpha=ZIPF_ALPHA)) for seed in range(phases)]
    pos = np.arange(rows) / rows * (phases - 1)
    phase = pos.astype(np.int64)
    later = np.random.default_rng(0).random(rows) < pos - phase
    source = np.minimum(phase + later, phases - 1)
    return pa.concat_tables(tables).take(pa.array(source * rows + np.arange(rows)))


def head(group) -> torch.Tensor:
    return torch.randn(group.bags_per_sample, group.dim, generator=torch.Generator().manual_seed(0))  # (S, D)


def run_policy(name: str, group, batches, capacity: int, hot_rows=None) -> tuple[float, dict]:
    """Train the embedding stage over `batches`; (seconds, counters snapshot after the final sync)."""
    w = head(group)
    if name == "device":
        module = PackedEmbeddingBag(group, seed=0)
        step = lambda g: module(g.ids, g.offsets, g.casting)  # noqa: E731
    else:
        cached = replace(group, placement=name if name != "lru" else "lookahead", cache_rows=capacity)
        module = (CACHE_MODULES[name] if name != "lru" else LRUEmbedding)(cached, 0, torch.device("cpu"))
        if hot_rows is not None:
            module.set_hot_rows(hot_rows)
            module.counters.reset()
        step = module.forward_group if name != "host" else lambda g: module(g.ids, g.offsets, g.casting)
    start = time.perf_counter()
    for batch in batches:
        torch.tanh(step(batch.groups[group.name]) * w).sum().backward()
    if hasattr(module, "sync_master"):
        module.sync_master()
    seconds = time.perf_counter() - start
    if hasattr(module, "close"):
        module.close()
    if name == "device":
        nnz = sum(b.groups[group.name].ids.numel() + b.groups[group.name].offsets.numel() for b in batches)
        return seconds, {"h2d_bytes": nnz * 8, "d2h_bytes": 0, "hit_rate": 1.0, "rows_fetched": 0,
                         "rows_written_back": 0, "samples": sum(b.size for b in batches)}
    return seconds, module.counters.snapshot()


def sample_hot_rows(spec, source, group, capacity: int):
    """FAE's hot set: the hottest `capacity` rows of a SAMPLE_RATE sample (same sample as the profile)."""
    table = sample_rows(spec, source, SAMPLE_RATE, seed=0)
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    ids, _ = pack_group(group, cols, table.num_rows)
    return hottest_rows(np.bincount(ids, minlength=group.rows), capacity)


def trace_figures(spec, group, source, shuffle: bool, cfg: dict, horizon: int) -> dict:
    """Every policy's figures on one trace: traffic, hit rates, timings, static_hot's hot samples."""
    batches = staged(spec, source, shuffle, horizon)
    row_bytes = group.row_bytes()
    window_need = max(b.groups[group.name].window_unique.numel() for b in batches)
    capacity = max(int(group.rows * row_bytes * BUDGET_SHARE) // row_bytes, window_need)  # tiny quick tables
    hot_rows = sample_hot_rows(spec, source, group, capacity)
    hot_flags = {group.name: torch.zeros(group.rows, dtype=torch.bool).index_fill_(0, hot_rows, True)}
    batcher = HotColdBatcher(batches, hot_flags, [group], cfg["batch"])
    fae_order = list(batcher)
    policies = ("device", "host", "static_hot", "lookahead", "lru")
    seconds: dict[str, list[float]] = {p: [] for p in policies}
    snaps: dict[str, dict] = {}
    for _ in range(cfg["repeats"]):
        for p in policies:
            order = fae_order if p == "static_hot" else batches
            t, snap = run_policy(p, group, order, capacity, hot_rows if p == "static_hot" else None)
            seconds[p].append(t)
            snaps.setdefault(p, snap)
    index_bytes = snaps["device"]["h2d_bytes"]
    trace, _ = batch_trace([b.groups[group.name].ids.numpy() for b in batches])
    row_traffic = {p: (s["h2d_bytes"] + s["d2h_bytes"] - index_bytes) for p, s in snaps.items()}
    row_traffic["lfu"] = 2 * (len(trace) - lfu_hits(trace, capacity)) * row_bytes
    row_traffic["belady"] = 2 * (len(trace) - belady_hits(trace, capacity)) * row_bytes
    bags = {group.name: group.bags_per_sample}
    return {"batches": batches, "capacity": capacity, "seconds": seconds, "snaps": snaps,
            "index_bytes": index_bytes, "row_traffic": row_traffic, "batcher": batcher,
            "hot_samples": sum(int(hot_samples(b, hot_flags, bags).sum()) for b in batches)}


def bytes_ratios(row_traffic: dict) -> dict:
    """Lookahead's row traffic over each other policy's."""
    return {f"lookahead_vs_{p}_bytes": round(row_traffic["lookahead"] / max(row_traffic[p], 1), 4)
            for p in ("lru", "lfu", "static_hot", "belady", "host")}


def trace_summary(fig: dict, samples: int) -> dict:
    """Row bytes per sample of every policy and lookahead's ratios on one trace."""
    traffic = {p: t for p, t in fig["row_traffic"].items() if p != "device"}
    return {"row_bytes_per_sample": {p: round(t / samples, 2) for p, t in traffic.items()},
            "hit_rate": {p: round(s["hit_rate"], 6) for p, s in fig["snaps"].items()},
            "capacity_rows": fig["capacity"], "ratios": bytes_ratios(traffic)}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="small smoke run (well under a minute)")
    ap.add_argument("--horizon", type=int, default=HORIZON,
                    help=f"batches after the lookahead window the victim choice knows (default {HORIZON})")
    ap.add_argument("--json", type=Path, help="write every figure as JSON here")
    args = ap.parse_args(argv)
    cfg = QUICK if args.quick else FULL
    torch.manual_seed(0)
    spec = criteo_spec(cfg["vocab_cap"], cfg["batch"])
    (group,) = group_layout(spec)
    rows = cfg["batch"] * cfg["batches"]
    source = MemorySource(split_table(synth_table(spec, rows, SynthConfig(seed=0, alpha=ZIPF_ALPHA)), 4))
    drifting = MemorySource(split_table(drifting_table(spec, rows), 4))
    fig = trace_figures(spec, group, source, True, cfg, args.horizon)
    drift = trace_figures(spec, group, drifting, False, cfg, args.horizon)
    batches, capacity, seconds, snaps = fig["batches"], fig["capacity"], fig["seconds"], fig["snaps"]
    row_bytes = group.row_bytes()
    window_need = max(b.groups[group.name].window_unique.numel() for b in batches)
    profile = profile_access(spec, source, sample_rate=SAMPLE_RATE, budget_bytes=capacity * row_bytes,
                             window=WINDOW, batch_size=cfg["batch"], max_trace=PROFILE_TRACE)
    samples = sum(b.size for b in batches)
    index_bytes, row_traffic, batcher = fig["index_bytes"], fig["row_traffic"], fig["batcher"]
    result = {
        "device": {"torch": torch.__version__, "cpu": platform.processor() or platform.machine(),
                   "threads": torch.get_num_threads(), "cuda": torch.cuda.is_available()},
        "config": {**cfg, "window": WINDOW, "horizon": args.horizon, "zipf_alpha": ZIPF_ALPHA,
                   "drift_phases": DRIFT_PHASES, "budget_share": BUDGET_SHARE,
                   "table_rows": group.rows, "row_bytes": row_bytes, "table_bytes": group.rows * row_bytes,
                   "capacity_rows": capacity, "window_rows_needed": window_need, "samples": samples},
        "samples_per_s": {p: round(samples / statistics.median(t), 1) for p, t in seconds.items()},
        "bytes_per_sample": {p: round((row_traffic[p] + index_bytes) / samples, 2) for p in TOP_LEVEL},
        "row_bytes_per_sample": {p: round(row_traffic[p] / samples, 2) for p in TOP_LEVEL},
        "hit_rate": {p: round(s["hit_rate"], 6) for p, s in snaps.items()},
        "counters": snaps,
        "traces": {"zipf": trace_summary(fig, samples), "drifting": trace_summary(drift, samples)},
        "static_hot": {"hot_sample_fraction": round(fig["hot_samples"] / samples, 4),
                       "profile_hot_sample_fraction": round(profile["budget"]["hot_sample_fraction"], 4),
                       "hot_batches": batcher.emitted["hot"], "cold_batches": batcher.emitted["cold"],
                       "switches": batcher.switches},
        "ratios": {
            **bytes_ratios(row_traffic),
            "lookahead_vs_device_samples_per_s": round(statistics.median(seconds["device"])
                                                       / statistics.median(seconds["lookahead"]), 4),
        },
    }
    text = json.dumps(result, indent=2, sort_keys=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return result


if __name__ == "__main__":
    main()
