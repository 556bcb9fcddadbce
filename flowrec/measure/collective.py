"""Collective bandwidth and per-call cost between processes, measured for the cost model.

`flowrec calibrate --nproc W` starts W processes on this machine (gloo on CPU, NCCL with one GPU
per process), and times the collectives a sharded step issues: `all_to_all_single` (row-wise
groups' ids, rows and gradients) and `all_reduce` (replicated groups, dense gradients) at message
sizes from 16 KiB to 16 MiB per rank. A call's time is the slowest rank's, the median over
repeats; the fit is

    t = collective_us + bytes one rank sends / collective_gbps

with the bytes one rank sends counted as the planner counts them (`flowrec.planner.exchange`):
`(W-1)/W x size` for an all-to-all, `2 (W-1)/W x size` for a ring all-reduce. Every process has a
timeout on its process group and the whole measurement one on the processes; on any failure every
process is killed and the error names the rank.

Example:
    >>> sent_bytes("all_to_all", 2**20, 2)
    524288.0
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import dataclass
from statistics import median
from typing import Any

from flowrec.measure.ops import fit_linear
from flowrec.runtime.distributed.launch import free_port, run_local_ranks

SIZES = (2**14, 2**16, 2**18, 2**20, 2**22, 2**24)  # bytes per rank of each timed call
OPS = ("all_to_all", "all_reduce")
REPEATS = 7  # timed calls per (op, size) after one warm-up
GROUP_TIMEOUT_S = 60  # every collective of the worker's process group
TIMEOUT_S = 180  # the whole measurement


class CollectiveError(RuntimeError):
    """The collective measurement could not run (one line naming the rank and why)."""


@dataclass(frozen=True)
class CollectiveFit:
    """Fitted constants of one world size (units in the names)."""

    world_size: int
    backend: str
    gbps: float  # bytes one rank sends per second / 1e9
    us: float  # fixed cost of one collective call
    points: dict[str, float]  # "op/bytes" -> median seconds of the slowest rank


def sent_bytes(op: str, size: int, world_size: int) -> float:
    """Bytes one rank sends in one call of `op` with `size` bytes per rank (as the planner counts)."""
    share = (world_size - 1) / world_size
    return (2 * share if op == "all_reduce" else share) * size


def measure_collectives(world_size: int, device_kind: str, timeout_s: float = TIMEOUT_S) -> CollectiveFit:
    """Start `world_size` processes, time their collectives and fit `CollectiveFit`.

    Raises:
        CollectiveError: a process failed or did not finish within `timeout_s`.
    """
    if world_size < 2:
        raise CollectiveError(f"collectives need 2 or more processes (got {world_size})")
    backend = "nccl" if device_kind == "cuda" else "gloo"
    if backend == "nccl":
        import torch
        if torch.cuda.device_count() < world_size:
            raise CollectiveError(f"NCCL collectives of {world_size} processes need {world_size} GPUs "
                                  f"(found {torch.cuda.device_count()})")
    try:
        outputs = run_local_ranks("flowrec.measure.collective", backend, world_size, free_port(),
                                  timeout_s)
    except subprocess.TimeoutExpired:
        raise CollectiveError(f"{backend} collectives of {world_size} processes: no result within "
                              f"{timeout_s:g} s") from None
    for rank, (code, _, err) in enumerate(outputs):
        if code != 0:
            last = err.splitlines()[-1] if err else f"exit {code}"
            raise CollectiveError(f"{backend} collectives, rank {rank} of {world_size} failed: {last}")
    return fit_collectives(world_size, backend, json.loads(outputs[0][1]))


def fit_collectives(world_size: int, backend: str, points: dict[str, float]) -> CollectiveFit:
    """Fit fixed cost and bandwidth to {"op/size": seconds} (least squares on relative error)."""
    keys = sorted(points)
    features = [[1e-6, sent_bytes(k.split("/")[0], int(k.split("/")[1]), world_size) / 1e9] for k in keys]
    us, seconds_per_gb = fit_linear(features, [points[k] for k in keys])
    if seconds_per_gb <= 0:
        raise CollectiveError(f"{backend} collectives of {world_size} processes: times do not grow with the "
                              f"bytes sent ({json.dumps(points)})")
    return CollectiveFit(world_size, backend, 1.0 / seconds_per_gb, us, dict(points))


def worker(backend: str, rank: int, world_size: int, port: int) -> dict[str, float]:
    """One rank: time every (op, size); returns the slowest rank's median seconds (on every rank)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from operators.device import select_device

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    select_device(device)  # NCCL: one GPU per rank
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    try:
        result = {}
        for op in OPS:
            for size in SIZES:
                result[f"{op}/{size}"] = _time_call(op, size, world_size, device)
        return result
    finally:
        dist.destroy_process_group()


def _time_call(op: str, size: int, world_size: int, device: Any) -> float:
    import torch
    import torch.distributed as dist

    from operators.device import runtime_for

    runtime = runtime_for(device)
    elements = max(world_size, size // 4 // world_size * world_size)  # float32, divisible by W
    send = torch.rand(elements, device=device)
    recv = torch.empty_like(send)
    times = torch.zeros(REPEATS, dtype=torch.float64)
    for i in range(REPEATS + 1):
        dist.barrier()
        start = time.perf_counter()
        if op == "all_to_all":
            dist.all_to_all_single(recv, send)
        else:
            dist.all_reduce(send)
        runtime.synchronize()
        if i:
            times[i - 1] = time.perf_counter() - start
    slowest = times.to(device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    return float(median(slowest.cpu().tolist()))


def _main(argv: list[str]) -> None:
    backend, rank, world_size, port = argv
    result = worker(backend, int(rank), int(world_size), int(port))
    if int(rank) == 0:
        print(json.dumps(result), flush=True)


if __name__ == "__main__":
    _main(sys.argv[1:])
