"""One rank of the every-spec distributed check (run by tests/integration/test_dist_specs.py).

For every spec in specs/ with tables capped at MAX_ROWS rows and an odd global batch: plan for
2 ranks, make the groups alternately row-wise and replicated, and train STEPS steps in float64 both as this
rank of the distributed model (its slice of each global batch, DDP, sharded exchanges) and as one
process on the whole batches (every rank runs that reference itself). Records, per spec, the
largest difference of the pooled lookups and logits of the first batch (same initial
parameters; `first_batch`) and of every parameter after training (whole tables assembled from the ranks' rows), relative to its scale.

Writes `rank{r}.json` into the output folder.

Usage (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): python tests/dist_specs_worker.py OUT_DIR TIMEOUT_S [SPECS_DIR]
(SPECS_DIR: check its specs instead of specs/; tests/integration/test_retrieval_ranks_exact.py)
"""
from __future__ import annotations

import json
import os
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.distributed.data_parallel import DenseParallel
from flowrec.runtime.checkpoint.layout import common_state, rank_shards
from flowrec.runtime.distributed.world import join_world, leave_world
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import load_spec

ROOT = Path(__file__).resolve().parents[1]
MAX_ROWS = 300
BATCH = 37
STEPS = 6


def shrunk(spec):
    tables = tuple(replace(t, rows=min(t.rows, MAX_ROWS)) for t in spec.tables)
    return replace(spec, tables=tables, training=replace(spec.training, batch_size=BATCH))


def batches(spec, groups, world_size: int, rank: int) -> list:
    table = synth_table(spec, BATCH * STEPS, SynthConfig(seed=9))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, workers=1, world_size=world_size, rank=rank)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, groups=groups) as it:
        return [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]


def whole_tables(model) -> dict[str, torch.Tensor]:
    """The distributed model's state with every row-wise table gathered whole (on every rank)."""
    shards = rank_shards(model)
    out = common_state(model)
    for name, part in shards.items():
        for key in ("weight", "state"):
            pieces: list = [None] * dist.get_world_size()
            dist.all_gather_object(pieces, (part["rows"], part[key]))
            rows = torch.cat([p[0] for p in pieces])
            values = torch.cat([p[1] for p in pieces])
            out[f"embeddings.{name}.{key}"] = torch.empty_like(values).index_copy_(0, rows, values)
    return out


def check_spec(path: Path, world) -> dict:
    spec = shrunk(load_spec(path))
    plan = make_plan(spec, target="cpu", world_size=world.size)
    groups = tuple(replace(g, sharding=s, shards=world.size if s == "row_wise" else 1)
                   for g, s in zip(plan.meta.groups, ["row_wise", "replicated"] * len(plan.meta.groups)))
    plan = plan.with_meta(replace(plan.meta, groups=groups))
    ref = lower(plan, spec, "cpu").to(torch.float64)
    model = lower(plan, spec, "cpu", world=world).to(torch.float64)
    opt = spec.dense_optimizer
    ref_opt = make_dense_optimizer(ref, opt.name, opt.lr, dict(opt.params))
    dist_opt = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
    parallel = DenseParallel(model, world)
    whole = batches(spec, ref.groups, 1, 0)
    mine = batches(spec, model.groups, world.size, world.rank)
    lo = whole[0].size * world.rank // world.size
    hi = whole[0].size * (world.rank + 1) // world.size
    model.eval()  # eval mode: logits of the parameters alone (no batch statistics, no dropout)
    ref.eval()
    with torch.no_grad():
        embed, first, logits_rel = first_batch(model, ref, mine[0], whole[0], slice(lo, hi))
    model.train()
    ref.train()
    losses = []
    for a, b in zip(whole, mine):
        ref_loss = train_step(ref, ref_opt, a)
        dist_loss = train_step(model, dist_opt, b, parallel=parallel)
        losses.append(abs(ref_loss - dist_loss) / max(abs(ref_loss), 1e-12))
    got, want = whole_tables(model), ref.state_dict()
    diffs = {}
    for key, value in want.items():
        scale = max(value.abs().max().item(), 1e-12) if value.numel() else 1.0
        diffs[key] = (got[key] - value).abs().max().item() / scale if value.numel() else 0.0
    sharding = sorted({g.sharding for g in plan.meta.groups})
    return {"first_embed": embed, "first_logits": first, "first_logits_rel": logits_rel,
            "loss_rel": max(losses), "param_rel": max(diffs.values()),
            "worst": max(diffs, key=diffs.get), "param_rels": diffs, "steps": len(mine), "sharding": sharding,
            "keys": sorted(got) == sorted(want)}


def first_batch(model, ref, mine, whole, rows: slice) -> tuple[float, float, float]:
    """The first batch, same initial parameters: (largest difference of the pooled lookups, of the
    logits of the dense stage on the same rows, relative difference of the logits against the
    whole batch's). The first two must be 0.0 (bitwise); the third is a rounding difference at
    most: a BLAS may pick another GEMM kernel (another summation order) for a batch of B / W rows
    than for B rows, so the same rows inside a larger batch need not round the same."""
    emb = model.embed(mine)
    out = model.dense_forward(mine.dense, emb, model.sequence_masks(mine))
    if rows.stop <= rows.start:
        return 0.0, 0.0, 0.0
    ref_emb, ref_masks = ref.embed(whole), ref.sequence_masks(whole)
    embed = max((emb[k] - ref_emb[k][rows]).abs().max().item() for k in ref_emb)
    same_rows = ref.dense_forward(whole.dense[rows], {k: v[rows] for k, v in ref_emb.items()},
                                  {k: m[rows] for k, m in ref_masks.items()})
    whole_batch = ref.dense_forward(whole.dense, ref_emb, ref_masks)[rows]
    scale = max(whole_batch.abs().max().item(), 1e-12)
    return embed, (out - same_rows).abs().max().item(), (out - whole_batch).abs().max().item() / scale


def main() -> None:
    out, timeout_s = Path(sys.argv[1]), float(sys.argv[2])
    specs = Path(sys.argv[3]) if len(sys.argv) > 3 else ROOT / "specs"
    world = join_world(int(os.environ["WORLD_SIZE"]), int(os.environ["RANK"]), timeout_s, torch.device("cpu"))
    try:
        report = {p.stem: check_spec(p, world) for p in sorted(specs.glob("*.yaml"))
              if "managed:" not in p.read_text()}  # managed tables: tests/integration/test_dist_managed*.py
    finally:
        leave_world()
    (out / f"rank{world.rank}.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
