"""One rank of a distributed embedding test (run as a script by tests/integration/test_dist_*.py).

Modes:
    equal: for every case of `CASES`, 20 steps on slice `rank` of the same global batches, checked
        against one process running `PackedEmbeddingBag` on the whole batch (every rank runs that
        reference itself): the forward of every batch bitwise on the same (initial) parameters,
        outputs, rows and optimizer state allclose while and after training.
    dead: one good step, then rank 1 exits and rank 0 records the error of its next step.
    hung: one good step, then rank 1 stops taking part (sleeps until rank 0 has reported) and
        rank 0 records the error of its next step (the process group's timeout).

Writes `rank{r}.json` into the output folder.

Usage: python tests/dist_worker.py MODE RANK WORLD PORT OUT_DIR TIMEOUT_S [CASE ...]
"""
from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from flowrec.runtime.distributed import (ReplicatedPackedEmbedding, ShardedLookups,
                                         ShardedPackedEmbedding, embedding_group)
from operators.embedding import PackedEmbeddingBag
from operators.random_batches import PackedBatch, random_batch

STEPS = 20
GLOBAL_BATCH = 11  # uneven slices for W = 2 and 3
TABLES = (("big", 13), ("small", 7), ("tiny", 3))  # 23 packed rows: uneven on 2 and 3 ranks
FIELDS = {
    "sum": (GroupField("a", "big", 1, "sum"), GroupField("b", "small", 3, "sum")),
    "mean": (GroupField("a", "big", 4, "mean"), GroupField("b", "tiny", 2, "sum")),
    "seq": (GroupField("a", "big", 3, "none"), GroupField("b", "small", 2, "mean")),
    "mixed": (GroupField("a", "big", 3, "none"), GroupField("b", "small", 3, "mean"),
              GroupField("c", "tiny", 2, "sum")),
}
OPTIMIZERS = {
    "sgd": ("sgd", 0.5, ()),
    "adagrad": ("adagrad", 0.2, ()),
    "rowwise_adagrad": ("rowwise_adagrad", 0.2, ()),
    "adam": ("adam", 0.05, ()),
}
# name -> (sharding, fields, optimizer, dim, dtype)
CASES = {
    "rw_sum_sgd_f64": ("row_wise", "sum", "sgd", 4, "fp64"),
    "rw_mean_adagrad_f64": ("row_wise", "mean", "adagrad", 3, "fp64"),
    "rw_seq_rowwise_f64": ("row_wise", "seq", "rowwise_adagrad", 2, "fp64"),
    "rw_mixed_adam_dim1_f64": ("row_wise", "mixed", "adam", 1, "fp64"),
    "rw_mixed_adam_f32": ("row_wise", "mixed", "adam", 3, "fp32"),
    "rw_mixed_rowwise_f32": ("row_wise", "mixed", "rowwise_adagrad", 1, "fp32"),
    "rep_mixed_adam_f64": ("replicated", "mixed", "adam", 2, "fp64"),
    "rep_sum_sgd_f32": ("replicated", "sum", "sgd", 3, "fp32"),
    "rw_interleave_f64": ("interleave", "mixed", "adam", 2, "fp64"),  # + a sum / adagrad group
    "rw_one_sample_adam_f64": ("row_wise", "mixed", "adam", 2, "fp64"),  # ranks with no sample
}
BATCH_OF_CASE = {"rw_one_sample_adam_f64": 1}  # global batch when not GLOBAL_BATCH


def max_abs(t: torch.Tensor) -> float:
    """Largest absolute element (0 for an empty tensor)."""
    return float(t.abs().max()) if t.numel() else 0.0


def make_group(fields: str, optimizer: str, dim: int, dtype: str) -> PackedGroup:
    """A packed group of the three test tables with the given fields and optimizer."""
    slots, offset = [], 0
    for name, rows in TABLES:
        slots.append(TableSlot(name, rows, offset))
        offset += rows
    return PackedGroup(name="g", dim=dim, dtype=dtype, optimizer=OPTIMIZERS[optimizer],
                       tables=tuple(slots), fields=FIELDS[fields])


def sample_slice(batch: PackedBatch, lo: int, hi: int, bags_per_sample: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Ids and offsets of samples [lo, hi) of a packed batch."""
    first, last = batch.offsets[lo * bags_per_sample], batch.offsets[hi * bags_per_sample]
    offsets = batch.offsets[lo * bags_per_sample:hi * bags_per_sample + 1] - first
    return batch.ids[first:last], offsets


def run_case(name: str, rank: int, world: int, pg: dist.ProcessGroup) -> dict:
    """Train one case on this rank and on the single-process reference; report the differences."""
    sharding, fields, optimizer, dim, dtype = CASES[name]
    if sharding == "interleave":
        return run_interleaved(make_group(fields, optimizer, dim, dtype), rank, world, pg)
    group = make_group(fields, optimizer, dim, dtype)
    ref = PackedEmbeddingBag(group, seed=3)
    if sharding == "row_wise":
        emb = ShardedPackedEmbedding(group, world, rank, process_group=pg, seed=3)
        mine = slice(rank, None, world)
    else:
        emb = ReplicatedPackedEmbedding(group, process_group=pg, seed=3)
        mine = slice(None)
    initial_bitwise = torch.equal(emb.weight, ref.weight[mine])
    size = BATCH_OF_CASE.get(name, GLOBAL_BATCH)
    lo, hi = rank * size // world, (rank + 1) * size // world
    gen = torch.Generator().manual_seed(11)
    batches = [random_batch(group, size, gen) for _ in range(STEPS)]
    coefs = [torch.randn(size, group.bags_per_sample, dim, generator=gen, dtype=ref.weight.dtype)
             for _ in range(STEPS)]  # (B, S, D) each: a loss with varied gradients
    with torch.no_grad():  # the same parameters: every batch's forward bitwise
        forward_bitwise = all(
            torch.equal(emb(*sample_slice(b, lo, hi, group.bags_per_sample)), ref(b.ids, b.offsets)[lo:hi])
            for b in batches)
    if sharding == "row_wise":
        emb.bytes_sent = dict.fromkeys(emb.bytes_sent, 0)  # count the training steps only
    train_forward_diff, looked_up = 0.0, 0
    for step, (batch, coef) in enumerate(zip(batches, coefs)):
        ref_out = ref(batch.ids, batch.offsets)
        ((ref_out * coef).sum() / size).backward()
        ids, offsets = sample_slice(batch, lo, hi, group.bags_per_sample)
        out = emb(ids, offsets)
        if step == 0:  # the autograd path, still on the same parameters
            forward_bitwise &= torch.equal(out.detach(), ref_out.detach()[lo:hi])
        train_forward_diff = max(train_forward_diff, max_abs(out.detach() - ref_out.detach()[lo:hi]))
        looked_up += ids.numel()
        ((out * coef[lo:hi]).sum() / size).backward()
    if sharding == "row_wise":  # what left this rank, counted independently from the batches
        remote = [int((ids % world != rank).sum()) for ids in
                  (torch.unique(sample_slice(b, lo, hi, group.bags_per_sample)[0]) for b in batches)]
        row_bytes = dim * ref.weight.element_size()
        expected = {"counts": STEPS * 8 * (world - 1), "ids": 8 * sum(remote), "grads": row_bytes * sum(remote)}
        sent = {part: emb.bytes_sent[part] for part in expected}
        bytes_ok = sent == expected
        rows_sent = emb.bytes_sent["rows"]
    else:
        bytes_ok = emb.bytes_reduced == STEPS * group.rows * (dim + 1) * ref.weight.element_size()
        rows_sent = 0
    return {
        "bytes_ok": bytes_ok,
        "rows_bytes_sent": rows_sent,
        "grad_bytes_sent": emb.bytes_sent["grads"] if sharding == "row_wise" else 0,
        "initial_bitwise": initial_bitwise,
        "forward_bitwise": forward_bitwise,
        "train_forward_max_diff": train_forward_diff,
        "weight_max_diff": float((emb.weight - ref.weight[mine]).abs().max()),
        "state_max_diff": float((emb.state - ref.state[mine]).abs().max()) if emb.state.numel() else 0.0,
        "weight_moved": float((ref.weight - PackedEmbeddingBag(group, seed=3).weight).abs().max()),
        "local_rows": int(emb.weight.shape[0]),
        "ids_looked_up": looked_up,
        "global_ids": sum(b.ids.numel() for b in batches),
        "dtype": dtype,
    }


def run_interleaved(first: PackedGroup, rank: int, world: int, pg: dist.ProcessGroup) -> dict:
    """Two row-wise groups trained together, interleaved and not, against one process: the two
    schedules give bitwise the same outputs and rows, both allclose to the reference."""
    groups = (first, make_group("sum", "adagrad", 3, first.dtype))
    refs = [PackedEmbeddingBag(g, seed=3) for g in groups]
    runs = {mode: ShardedLookups([ShardedPackedEmbedding(g, world, rank, process_group=pg, seed=3)
                                  for g in groups], interleave=mode)
            for mode in (True, False)}
    lo, hi = rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world
    gen = torch.Generator().manual_seed(5)
    initial_bitwise = all(torch.equal(t.weight, r.weight[rank::world]) for t, r in zip(runs[True].tables, refs))
    forward_bitwise, interleave_bitwise, forward_diff, looked_up, global_ids = True, True, 0.0, 0, 0
    for step in range(STEPS):
        batches = [random_batch(g, GLOBAL_BATCH, gen) for g in groups]
        coefs = [torch.randn(GLOBAL_BATCH, g.bags_per_sample, g.dim, generator=gen, dtype=torch.float64)
                 for g in groups]
        ref_outs = [r(b.ids, b.offsets) for r, b in zip(refs, batches)]
        (sum((o * c).sum() for o, c in zip(ref_outs, coefs)) / GLOBAL_BATCH).backward()
        mine = [sample_slice(b, lo, hi, g.bags_per_sample) for b, g in zip(batches, groups)]
        outs = {mode: run(mine) for mode, run in runs.items()}
        for mode in runs:
            (sum((o * c[lo:hi]).sum() for o, c in zip(outs[mode], coefs)) / GLOBAL_BATCH).backward()
        interleave_bitwise &= all(torch.equal(a, b) for a, b in zip(outs[True], outs[False]))
        if step == 0:  # the same (initial) parameters
            forward_bitwise = all(torch.equal(o.detach(), r.detach()[lo:hi]) for o, r in zip(outs[True], ref_outs))
        forward_diff = max([forward_diff] + [float((o - r[lo:hi]).detach().abs().max())
                                             for o, r in zip(outs[True], ref_outs)])
        looked_up += mine[0][0].numel()
        global_ids += batches[0].ids.numel()
    tables = {mode: list(run.tables) for mode, run in runs.items()}
    interleave_bitwise &= all(torch.equal(a.weight, b.weight) and torch.equal(a.state, b.state)
                              for a, b in zip(tables[True], tables[False]))
    inter = tables[True]
    return {
        "interleave_bitwise": interleave_bitwise,
        "bytes_ok": all(a.bytes_sent == b.bytes_sent for a, b in zip(inter, tables[False])),
        "rows_bytes_sent": inter[0].bytes_sent["rows"],
        "grad_bytes_sent": inter[0].bytes_sent["grads"],
        "initial_bitwise": initial_bitwise,
        "forward_bitwise": forward_bitwise,
        "train_forward_max_diff": forward_diff,
        "weight_max_diff": max(float((t.weight - r.weight[rank::world]).abs().max()) for t, r in zip(inter, refs)),
        "state_max_diff": max(float((t.state - r.state[rank::world]).abs().max()) for t, r in zip(inter, refs)),
        "weight_moved": min(float((r.weight - PackedEmbeddingBag(g, seed=3).weight).abs().max())
                            for r, g in zip(refs, groups)),
        "local_rows": int(inter[0].weight.shape[0]),
        "ids_looked_up": looked_up,
        "global_ids": global_ids,
        "dtype": first.dtype,
    }


START_S = 120.0  # the rendezvous: a loaded machine starts the processes seconds apart (a 5 s one failed)


def main(argv: list[str]) -> int:
    mode, rank, world, port, out_dir, timeout_s = argv[:6]
    rank, world = int(rank), int(world)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=max(float(timeout_s), START_S)))
    pg = embedding_group(float(timeout_s))
    out = Path(out_dir) / f"rank{rank}.json"
    if mode == "equal":
        result = {name: run_case(name, rank, world, pg) for name in (argv[6:] or CASES)}
        dist.barrier()
        out.write_text(json.dumps(result))
        dist.destroy_process_group()
        return 0
    return failed_rank(mode, rank, world, pg, out)


def failed_rank(mode: str, rank: int, world: int, pg: dist.ProcessGroup, out: Path) -> int:
    """One good step; then rank 1 exits (dead) or stops taking part (hung), and rank 0 tries
    another step."""
    group = make_group("mixed", "adam", 2, "fp64")
    emb = ShardedPackedEmbedding(group, world, rank, process_group=pg)
    gen = torch.Generator().manual_seed(rank)
    batch = random_batch(group, 4, gen)
    emb(batch.ids, batch.offsets).sum().backward()
    dist.barrier()
    if rank == 1:
        deadline = time.monotonic() + 120
        while mode == "hung" and time.monotonic() < deadline and not (out.parent / "rank0.json").exists():
            time.sleep(0.2)
        os._exit(0)
    time.sleep(0.5)  # rank 1 is gone or idle
    start = time.monotonic()
    try:
        emb(batch.ids, batch.offsets).sum().backward()
        error = None
    except Exception as exc:  # noqa: BLE001 - any failure is the expected outcome; it is reported
        error = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    out.write_text(json.dumps({"error": error, "elapsed_s": time.monotonic() - start}))
    os._exit(0)  # the group cannot be torn down cleanly without its peer


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
