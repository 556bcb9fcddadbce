"""One training step of a spec on 2 ranks (gloo, processes of this script) against one process, tensor
by tensor: every dense parameter's gradient and every table's step (the spec's sparse optimizer),
from the same initial parameters on the same global batch, each group row-wise over the ranks.
The dense optimizer is SGD (the gradients are read before it steps). Finds where W ranks part from
one process: a gradient applied twice or scaled per rank differs by its own size; rounding by
1e-16 (float64) or 1e-7 (float32) of it. Prints JSON: the loss of both, and per tensor the largest
value (`scale`) and the largest difference (`diff`), and per dense tensor both gradients.

Usage:
    python tools/rank_grads.py SPEC [--dtype float32] [--batch 37] [--timeout 120]
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args: argparse.Namespace) -> int:
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:]], env=env))
    try:
        codes = [p.wait(timeout=args.timeout * 3) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=30)
    return max(codes)


def _rank(args: argparse.Namespace) -> None:
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.checkpoint.layout import common_state, rank_shards
    from flowrec.runtime.distributed.data_parallel import DenseParallel
    from flowrec.runtime.distributed.world import join_world, leave_world
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.step import make_dense_optimizer, train_step
    from flowrec.spec import load_spec

    dtype = getattr(torch, args.dtype)
    world = join_world(2, int(os.environ["RANK"]), args.timeout, torch.device("cpu"))
    try:
        spec = load_spec(Path(args.spec))
        spec = replace(spec, training=replace(spec.training, batch_size=args.batch))
        plan = make_plan(spec, target="cpu", world_size=world.size)
        groups = tuple(replace(g, sharding="row_wise", shards=world.size) for g in plan.meta.groups)
        plan = plan.with_meta(replace(plan.meta, groups=groups))
        ref = lower(plan, spec, "cpu").to(dtype)
        model = lower(plan, spec, "cpu", world=world).to(dtype)
        table = synth_table(spec, args.batch, SynthConfig(seed=9))

        def first(groups, world_size, rank):
            opts = StagingOptions(batch_size=args.batch, shuffle=False, workers=1, world_size=world_size, rank=rank)
            with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, groups=groups) as it:
                b = next(iter(it))
            return replace(b, dense=b.dense.to(dtype), labels=b.labels.to(dtype))

        before = {k: v.clone() for k, v in ref.state_dict().items()}
        one = train_step(ref, make_dense_optimizer(ref, "sgd", 0.0, {}), first(ref.groups, 1, 0))
        two = train_step(model, make_dense_optimizer(model, "sgd", 0.0, {}), first(model.groups, 2, world.rank),
                         parallel=DenseParallel(model, world))
        got = common_state(model)
        for name, part in rank_shards(model).items():
            pieces: list = [None] * world.size
            dist.all_gather_object(pieces, (part["rows"], part["weight"]))
            rows, values = torch.cat([p[0] for p in pieces]), torch.cat([p[1] for p in pieces])
            got[f"embeddings.{name}.weight"] = torch.empty_like(values).index_copy_(0, rows, values)
        mine = dict(model.named_parameters())
        report: dict = {"loss_one": one, "loss_two": two, "dense": {}, "tables": {}}
        for name, p in ref.named_parameters():
            if p.grad is None or mine[name].grad is None:
                continue
            a, b = p.grad, mine[name].grad
            report["dense"][name] = {"scale": a.abs().max().item(), "diff": (a - b).abs().max().item(),
                                     "one": a.flatten()[:16].tolist(), "two": b.flatten()[:16].tolist()}
        for key, value in ref.state_dict().items():
            if key.startswith("embeddings.") and key.endswith(".weight"):
                step_one, step_two = before[key] - value, before[key] - got[key]
                report["tables"][key] = {"scale": step_one.abs().max().item(),
                                         "diff": (step_one - step_two).abs().max().item()}
        if world.rank == 0:
            print(json.dumps(report, indent=1))
    finally:
        leave_world()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("spec", help="spec YAML (synthetic rows of its features)")
    parser.add_argument("--dtype", choices=("float64", "float32"), default="float64")
    parser.add_argument("--batch", type=int, default=37, help="global batch size (odd: uneven rank slices)")
    parser.add_argument("--timeout", type=float, default=120.0, help="process group timeout, seconds")
    args = parser.parse_args()
    if "RANK" not in os.environ:
        return _launch(args)
    _rank(args)
    return 0


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    sys.exit(run_stoppable(main))
