"""The planner's lookahead traffic against the runtime's scratchpad, over one epoch of a spec's data.

A lookahead group's host <-> device traffic is the rows its scratchpad fetches (each written back
once evicted). The planner prices them per batch (`flowrec.planner.cost.new_rows_per_batch`):

  window    the model before Round 23: a row is fetched when none of the last W batches read it
            (distinct rows of W+1 batches minus W's)
  priced    the model now: each row's first read of the epoch, then every gap between two reads
            longer than the scratchpad keeps the row (its spare slots, Belady's rule within the
            horizon; `flowrec.planner.access.retained_fetches`), from the profile's `dataset_counts`

  one_epoch (with --epochs above 1) the price of one epoch, as the planner priced every run before
            it was given the run's epochs

and this runs the real thing: the data stage's batches (the run's shuffle, window W and horizon
3W) through the runtime's `Scratchpad` with its victim policy (`NextUseFirst`), at the plan's
capacity (`cache_rows`: `flowrec.planner.passes.cache.lookahead_slots`) and at larger
ones (`--spare`), counting the rows fetched (`measured`, per batch over the epoch). Only the ids
matter, so the tables are held at dim 1. No timing: the figures are counts, the same on any machine.

Usage:
    python tools/bench_lookahead_fetches.py --spec specs/two_task.yaml --synth 500000 --json out.json
    python tools/bench_lookahead_fetches.py --spec specs/movielens.yaml --data data/ml/train --spare 1,2
    python tools/bench_lookahead_fetches.py --spec specs/avazu.yaml --synth 94208 --epochs 3   # 23 batches an epoch
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tools"))

from flowrec.data.batches import StagingOptions, iterate_batches  # noqa: E402
from flowrec.data.profile import profile_access  # noqa: E402
from flowrec.graph.kinds import HORIZON_WINDOWS  # noqa: E402
from flowrec.graph.packing import group_layout  # noqa: E402
from flowrec.planner.cost import group_access, new_rows_per_batch  # noqa: E402
from flowrec.planner.passes.cache import lookahead_slots  # noqa: E402
from flowrec.runtime.caches.counters import CacheCounters  # noqa: E402
from flowrec.runtime.caches.scratchpad import Scratchpad  # noqa: E402
from flowrec.runtime.caches.victims import Horizon, NextUseFirst  # noqa: E402
from flowrec.spec.load import load_spec  # noqa: E402
from operators.embedding import PackedEmbeddingBag  # noqa: E402

from bench_hit_rate import opened_dataset  # noqa: E402  (tools/)


def measure(spec: Any, source: Any, spares: list[float], epochs: int = 1) -> dict[str, Any]:
    """Per group and scratchpad size: rows fetched a batch, measured over `epochs` epochs (each
    shuffled anew, as the trainer's; one scratchpad throughout: it keeps its rows from one epoch
    to the next) and priced for that many epochs (`priced`) and, with more than one, for one
    (`one_epoch`: the price before the run's epochs reached the planner)."""
    batch, window = spec.training.batch_size, spec.plan.window
    profile = profile_access(spec, source, seed=spec.training.seed)
    groups = group_layout(spec)
    caps = {g.name: [max(1, int(lookahead_slots(g, profile, batch, window) * s)) for s in spares] for g in groups}
    pads = {g.name: [Scratchpad(PackedEmbeddingBag(replace(g, dim=1), seed=0), min(c, g.rows), torch.device("cpu"),
                                CacheCounters(), victims=NextUseFirst()) for c in caps[g.name]] for g in groups}
    opts = StagingOptions(batch_size=batch, seed=spec.training.seed, lookahead=window,
                          horizon=HORIZON_WINDOWS * window)
    batches = 0
    for epoch in range(epochs):
        with iterate_batches(spec, source, opts, epoch) as it:
            for b in it:
                batches += 1
                for g in groups:
                    gids = b.groups[g.name]
                    rows = torch.unique(gids.ids)
                    pinned = gids.window_unique if gids.window_unique is not None else rows
                    horizon = Horizon(gids.horizon_rows, gids.horizon_next) if gids.horizon_rows is not None else None
                    for pad in pads[g.name]:
                        pad.exchange(pinned, pinned, batches, horizon)  # as `LookaheadEmbedding`: the window, ahead
                        pad.touch(rows, batches)
    out = []
    for g in groups:
        sizes = []
        for spare, cap, pad in zip(spares, caps[g.name], pads[g.name]):
            planned = replace(g, cache_rows=min(cap, g.rows))
            measured = pad.counters.rows_fetched / max(batches, 1)
            priced = new_rows_per_batch(planned, batch, window, profile, epochs=epochs)
            one = new_rows_per_batch(planned, batch, window, profile)
            old = new_rows_per_batch(replace(planned, cache_rows=0), batch, window, profile)
            sizes.append({"spare": spare, "cache_rows": planned.cache_rows, "measured": round(measured, 1),
                          "priced": round(priced, 1), "one_epoch": round(one, 1), "window": round(old, 1),
                          "one_epoch_error": round(one / measured - 1.0, 4) if measured else None,
                          "priced_error": round(priced / measured - 1.0, 4) if measured else None,
                          "window_error": round(old / measured - 1.0, 4) if measured else None})
        out.append({"group": g.name, "rows": g.rows, "counted": group_access(g, profile).epoch is not None,
                    "sizes": sizes})
    return {"epochs": epochs, "batches": batches, "batch": batch, "window": window, "horizon": HORIZON_WINDOWS * window,
            "dataset_rows": profile["dataset_rows"], "groups": out}


def spares_of(text: str) -> list[float]:
    """`--spare`: multiples of the plan's scratchpad, comma-separated, each >= 1."""
    out = []
    for part in text.split(","):
        try:
            value = float(part)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number") from None
        if not value >= 1.0 or value != value or value == float("inf"):
            raise argparse.ArgumentTypeError(f"{part!r}: a scratchpad is at least the plan's (>= 1)")
        out.append(value)
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--data", type=Path, help="an encoded dataset folder (flowrec data convert / synth)")
    ap.add_argument("--synth", type=int, help="synthesize this many rows for the spec instead of --data")
    ap.add_argument("--spare", type=spares_of, default=[1.0, 2.0],
                    help="scratchpad sizes as multiples of the plan's, comma-separated (default 1,2)")
    ap.add_argument("--epochs", type=int, default=1,
                    help="epochs over the data, one scratchpad throughout (default 1)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.epochs < 1:
        ap.error("--epochs must be at least 1")
    if (args.data is None) == (args.synth is None):
        ap.error("give --data DIR or --synth ROWS")
    spec = load_spec(args.spec)
    with opened_dataset(args.spec, spec, args.data, args.synth) as source:
        result = measure(spec, source, args.spare, args.epochs)
    sizes = [s for g in result["groups"] for s in g["sizes"] if s["measured"]]
    doc = {"benchmark": "lookahead_fetches", "spec": args.spec.name,
           "data": str(args.data) if args.data else f"synth {args.synth}", "host": platform.node(), **result,
           "max_abs_priced_error": max((abs(s["priced_error"]) for s in sizes), default=None),
           "max_abs_one_epoch_error": max((abs(s["one_epoch_error"]) for s in sizes), default=None),
           "max_abs_window_error": max((abs(s["window_error"]) for s in sizes), default=None)}
    print(f"{doc['spec']}: {result['dataset_rows']:,} rows, {result['epochs']} epoch(s), {result['batches']} batches of {result['batch']:,}, "
          f"window {result['window']}, horizon {result['horizon']}")
    for g in result["groups"]:
        print(f"  {g['group']} ({g['rows']:,} rows{'' if g['counted'] else ', reads not counted'})")
        print(f"    {'spare':>5} {'slots':>10} {'measured':>10} {'priced':>10} {'error':>7} {'1 epoch':>10} {'error':>7} "
              f"{'window':>10} {'error':>7}")
        for s in g["sizes"]:
            print(f"    {s['spare']:>5g} {s['cache_rows']:>10,} {s['measured']:>10,.1f} {s['priced']:>10,.1f} "
                  f"{s['priced_error']:>+7.3f} {s['one_epoch']:>10,.1f} {s['one_epoch_error']:>+7.3f} "
                  f"{s['window']:>10,.1f} {s['window_error']:>+7.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return doc


if __name__ == "__main__":
    main()
