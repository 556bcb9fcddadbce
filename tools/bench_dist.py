"""Distributed embedding benchmark: W = 1 and W = 2 gloo ranks on a DLRM-Criteo-shaped packed group.

For each world size, every rank trains its slice of the same Zipf-skewed global batches (synthetic
rows from the spec, staged as training stages them) through `ShardedPackedEmbedding`, and counts the
bytes it sends (counts, ids, rows, row gradients). Beside the counted bytes per sample:

* the planner's prediction for the same plan (`flowrec plan --world-size 2`), from its Zipf model
  and from an access profile of the same data (what `flowrec data profile` writes);
* what TorchRec's row-wise sharding sends on the same batches, computed from its algorithm (every
  id out to its owner; pooled partial embeddings reduce-scattered back; their gradients
  all-gathered in the backward): TorchRec's DistributedModelParallel refuses row-wise sharding on
  CPU over gloo (docs/distributed.md).

Ratios: `dist_bytes_vs_torchrec_rw` (target <= 0.5) and `dist_bytes_predicted_vs_counted` (profiled
prediction; target 0.9..1.1). Reads: the stored Parquet bytes each rank of W = 2 and 4 reads in one
shuffled epoch of a synthetic DLRM-Criteo dataset, over what one process reads
(`read_bytes_rank_vs_epoch_w2`, `_w4`: the largest rank's share; about 1/W is the aim). Tables are capped (`--rows-cap`) so two ranks fit this machine.

End to end (`--train SPEC`, default specs/movielens.yaml when its data is in ../shared/data): the
whole `flowrec train SPEC` on 1 and on 2 ranks (`--nproc 2`), `--repeats` times each, alternating:
median samples/s and the final test AUC of each; ratio `train_w2_vs_w1_samples_per_s`.

Usage: python tools/bench_dist.py [--quick] [--train SPEC | --no-train] [--json bench/results/dist_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from datetime import timedelta
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

SPEC = REPO / "specs" / "dlrm_criteo.yaml"
TIMEOUT_S = 600  # per run of W processes


def capped_spec(rows_cap: int, batch: int):
    from flowrec.spec import load_spec

    spec = load_spec(SPEC)
    tables = tuple(replace(t, rows=min(t.rows, rows_cap)) for t in spec.tables)
    return replace(spec, tables=tables, training=replace(spec.training, batch_size=batch))


def global_batches(spec, steps: int):
    """The staged global batches every rank (and the profile) sees: (group, [Batch, ...])."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.graph.packing import group_layout

    (group,) = group_layout(spec)
    table = synth_table(spec, steps * spec.training.batch_size, SynthConfig(seed=11))
    opts = StagingOptions(batch_size=spec.training.batch_size, shuffle=False, lookahead=0, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, groups=(group,)) as it:
        return group, table, [b.groups[group.name] for b in it]


def rank_slice(ids, offsets, bags_per_sample: int, lo: int, hi: int):
    """Samples [lo, hi) of a packed global batch: (ids, rebased offsets)."""
    start, stop = int(offsets[lo * bags_per_sample]), int(offsets[hi * bags_per_sample])
    return ids[start:stop], offsets[lo * bags_per_sample: hi * bags_per_sample + 1] - start


def worker(rank: int, world: int, port: int, result: Path, rows_cap: int, batch: int, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from flowrec.runtime.distributed import ShardedPackedEmbedding, embedding_group

    spec = capped_spec(rows_cap, batch)
    group, _, batches = global_batches(spec, steps)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=TIMEOUT_S // 2))
    try:
        pg = embedding_group(TIMEOUT_S // 2)
        emb = ShardedPackedEmbedding(group, world, rank, process_group=pg, seed=0)
        lo, hi = rank * batch // world, (rank + 1) * batch // world
        weights = torch.randn(group.bags_per_sample, group.dim, generator=torch.Generator().manual_seed(0))
        nnz = 0
        dist.barrier()
        start = time.perf_counter()
        for gids in batches:
            ids, offsets = rank_slice(gids.ids, gids.offsets, group.bags_per_sample, lo, hi)
            nnz += int(ids.numel())
            out = emb(ids, offsets)  # (B_r, S, D)
            (torch.tanh(out * weights).sum() / batch).backward()
        dist.barrier()
        seconds = time.perf_counter() - start
        result.parent.mkdir(parents=True, exist_ok=True)
        result.write_text(json.dumps({"rank": rank, "seconds": seconds, "bytes_sent": emb.bytes_sent,
                                   "nnz": nnz, "samples": (hi - lo) * len(batches)}))
    finally:
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_world(world: int, args, folder: Path) -> list[dict]:
    port = free_port()
    threads = str(max(1, (os.cpu_count() or 1) // world))  # the cores shared out, as `flowrec train --nproc`
    env = {**os.environ, "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads}
    procs = [subprocess.Popen([sys.executable, __file__, "--worker", str(r), str(world), str(port),
                               str(folder / f"w{world}_r{r}.json"), str(args.rows_cap), str(args.batch),
                               str(args.steps)], env=env) for r in range(world)]
    try:
        for p in procs:
            if p.wait(timeout=TIMEOUT_S) != 0:
                raise RuntimeError(f"a rank of the W={world} run failed (exit {p.returncode})")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return [json.loads((folder / f"w{world}_r{r}.json").read_text()) for r in range(world)]


def torchrec_rw_bytes(group, nnz_per_rank: float, batch: int, world: int) -> float:
    """Bytes one rank sends per step under TorchRec's row-wise sharding of the same group."""
    share = (world - 1) / world
    ids = nnz_per_rank * share * 8  # every id of the rank's slice goes to the rank owning its row
    lengths = (batch // world) * group.bags_per_sample * 4 * share  # bag lengths travel with them
    pooled = share * batch * group.bags_per_sample * group.dim * 4  # reduce-scatter of partial sums
    return ids + lengths + 2 * pooled  # + the all-gather of their gradients in the backward


def predictions(spec, table, world: int) -> dict[str, float]:
    """The planner's per-rank bytes per step for the group: Zipf model and a profile of the data."""
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.profile import profile_access
    from flowrec.planner.manager import make_plan

    profile = profile_access(spec, MemorySource(split_table(table, 2)), sample_rate=1.0, seed=0)
    out = {}
    for name, prof in (("zipf", None), ("profiled", profile)):
        plan = make_plan(spec, target="cpu", world_size=world, profile=prof)
        out[name] = float(dict(plan.cost.group_exchange_bytes)[plan.meta.groups[0].name])
    return out


def end_to_end(spec: Path, repeats: int) -> dict:
    """`flowrec train SPEC` on 1 and 2 ranks, alternating, `repeats` times each (medians)."""
    import statistics

    runs: dict[int, list[dict]] = {1: [], 2: []}
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(repeats):
            for world in (1, 2):
                cmd = [sys.executable, "-m", "flowrec", "train", str(spec), "--out", f"{tmp}/w{world}_{i}", "-q",
                       "--json"] + (["--nproc", str(world)] if world > 1 else [])
                done = run_tree(cmd, cwd=REPO, capture_output=True, text=True, timeout_s=TIMEOUT_S)
                if done.returncode != 0:
                    return {"skipped": f"flowrec train {spec.name} failed: {done.stderr.strip().splitlines()[-1]}"}
                result = json.loads(done.stdout)
                runs[world].append({"samples_per_s": round(result["samples_per_s"], 1),
                                    "auc": {h: m.get("auc") for h, m in result["eval"].items()}})
                print(f"train W={world}: {result['samples_per_s']:,.0f} samples/s", file=sys.stderr)
    return {"spec": spec.name, **{f"world_{w}": {
        "runs": r, "median_samples_per_s": statistics.median(x["samples_per_s"] for x in r)} for w, r in runs.items()}}


def rank_reads(rows: int, worlds: tuple[int, ...] = (1, 2, 4)) -> dict:
    """Stored bytes each rank reads in one shuffled epoch of a DLRM-Criteo-shaped Parquet dataset
    (`flowrec data synth` layout: 2^18-row files, ROW_GROUP_ROWS-row groups, default staging)."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.convert import ROW_GROUP_ROWS
    from flowrec.data.dataset import ParquetSource
    from flowrec.data.synth import SynthConfig, synth_dataset
    from flowrec.spec import load_spec

    spec = load_spec(SPEC)
    out: dict = {"rows": rows, "row_group_rows": ROW_GROUP_ROWS, "batch": spec.training.batch_size}
    with tempfile.TemporaryDirectory() as tmp:
        synth_dataset(spec, Path(tmp) / "d", rows, SynthConfig(seed=3))
        for world in worlds:
            read = []
            for rank in range(world):
                source = ParquetSource(Path(tmp) / "d")
                opts = StagingOptions(world_size=world, rank=rank)
                with iterate_batches(spec, source, opts, epoch=1) as it:
                    samples = sum(b.size for b in it)
                source.close()
                read.append({"bytes_read": source.bytes_read, "samples": samples})
            out[f"world_{world}"] = read
            print(f"reads W={world}: {[r['bytes_read'] for r in read]} bytes", file=sys.stderr)
    whole = out["world_1"][0]["bytes_read"]
    for world in worlds[1:]:
        out[f"max_rank_share_w{world}"] = round(max(r["bytes_read"] for r in out[f"world_{world}"]) / whole, 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small run for smoke tests")
    parser.add_argument("--rows-cap", type=int, default=200_000, help="rows per table at most")
    parser.add_argument("--batch", type=int, default=4096, help="global batch")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--json", type=Path, default=None, help="write the results here")
    parser.add_argument("--train", type=Path, default=REPO / "specs" / "movielens.yaml",
                        help="spec trained end to end on 1 and 2 ranks")
    parser.add_argument("--no-train", action="store_true", help="skip the end-to-end runs")
    parser.add_argument("--repeats", type=int, default=3, help="end-to-end runs per world size")
    parser.add_argument("--read-rows", type=int, default=1 << 19, help="rows of the dataset whose reads per rank are counted")
    args = parser.parse_args()
    if args.quick:
        args.rows_cap, args.batch, args.steps, args.no_train, args.read_rows = 20_000, 512, 4, True, 1 << 16
    spec = capped_spec(args.rows_cap, args.batch)
    group, table, _ = global_batches(spec, args.steps)
    results: dict = {"spec": SPEC.name, "rows_cap": args.rows_cap, "global_batch": args.batch,
                     "steps": args.steps, "group": group.name, "fields": len(group.fields), "dim": group.dim}
    with tempfile.TemporaryDirectory() as tmp:
        for world in (1, 2):
            ranks = run_world(world, args, Path(tmp))
            sent = sum(sum(r["bytes_sent"].values()) for r in ranks) / world / args.steps  # per rank per step
            nnz = sum(r["nnz"] for r in ranks) / world / args.steps
            seconds = max(r["seconds"] for r in ranks)
            entry = {"samples_per_s": round(args.batch * args.steps / seconds, 1),
                     "bytes_sent_per_rank_step": round(sent, 1),
                     "bytes_per_sample": round(sent * world / args.batch, 3),
                     "parts_per_rank_step": {k: round(sum(r["bytes_sent"][k] for r in ranks) / world / args.steps, 1)
                                             for k in ranks[0]["bytes_sent"]}}
            if world > 1:
                pred = predictions(spec, table, world)
                rw = torchrec_rw_bytes(group, nnz, args.batch, world)
                entry.update({"predicted_per_rank_step": {k: round(v, 1) for k, v in pred.items()},
                              "torchrec_rw_per_rank_step": round(rw, 1),
                              "torchrec_rw_bytes_per_sample": round(rw * world / args.batch, 3)})
                results["ratios"] = {
                    "dist_bytes_vs_torchrec_rw": round(sent / rw, 4),
                    "dist_bytes_predicted_vs_counted": round(pred["profiled"] / sent, 4),
                    "dist_bytes_predicted_zipf_vs_counted": round(pred["zipf"] / sent, 4),
                }
            results[f"world_{world}"] = entry
            print(f"W={world}: {entry['samples_per_s']:,.0f} samples/s, {entry['bytes_per_sample']} bytes/sample sent",
                  file=sys.stderr)
    results["ratios"]["w2_vs_w1_samples_per_s"] = round(results["world_2"]["samples_per_s"]
                                                        / results["world_1"]["samples_per_s"], 4)
    results["reads"] = rank_reads(args.read_rows)
    results["ratios"]["read_bytes_rank_vs_epoch_w2"] = results["reads"]["max_rank_share_w2"]
    results["ratios"]["read_bytes_rank_vs_epoch_w4"] = results["reads"]["max_rank_share_w4"]
    if not args.no_train:
        train = end_to_end(args.train, args.repeats)
        results["train"] = train
        if "world_2" in train:
            results["ratios"]["train_w2_vs_w1_samples_per_s"] = round(
                train["world_2"]["median_samples_per_s"] / train["world_1"]["median_samples_per_s"], 4)
    text = json.dumps(results, indent=2, sort_keys=True) + "\n"
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        r, w, port, out, cap, batch, steps = sys.argv[2:9]
        worker(int(r), int(w), int(port), Path(out), int(cap), int(batch), int(steps))
    else:
        run_stoppable(main)
