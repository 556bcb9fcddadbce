"""Measure this machine for the cost model: GEMMs, row gathers and scatters, memory, transfers.

Each measurement repeats its kernel in rounds until `min_seconds` have passed (after one warm-up
call) and keeps what the machine does without other processes' load (`flowrec.measure.robust`: the
median of the rounds no other process delayed, else the median one less its wait), so the
kernels' calibration (`flowrec calibrate` without a spec) takes about a minute on a loaded machine too. Results are
{profile field: (value, how it was measured)} plus raw details per shape and dim; the CLI turns
them into a device profile document (`flowrec.planner.calibration`).

Example:
    >>> measured, details = calibrate(torch.device("cpu"), [(4096, 512, 256)])  # doctest: +SKIP
"""
from __future__ import annotations

import time
from functools import partial
from typing import Any, Callable, Sequence

import torch

from flowrec.measure import ops, robust
from operators.device import cuda_devices, runtime_for
from operators.lowp import matmul

GATHER_DIMS = (16, 32, 64, 128)  # embedding dims whose row gather / scatter rates are measured
GATHER_TABLE_ROWS = 1_000_000
GATHER_LOOKUPS = 200_000
COPY_BYTES = 64 * 2**20
TRANSFER_BYTES = 64 * 2**20
UPLOAD_BYTES = (64 * 2**10, 16 * 2**20)  # the transfer stage's copies timed at a small and a large tensor
REFERENCE_DIM = 16  # the profile's gather rate is for 64-byte rows (fp32, dim 16)
RATES = ("fp32_tflops", "gemm_gbps", "gemm_bwd_tflops", "gemm_bwd_gbps", "elementwise_gbps")  # fitted rates (a 0 one: not separable here)


def _sync(device: torch.device) -> None:
    runtime_for(device).synchronize()


def mean_seconds(run: Callable[[], Any], device: torch.device, min_seconds: float) -> float:
    """Wall seconds of one call of `run` on this machine without other processes' load: one
    warm-up call, then short rounds of calls (about 2 ms each, at least one call: short rounds
    are the ones other processes leave alone) until `min_seconds` have passed and 8 rounds are
    timed, estimated by `flowrec.measure.robust`
    (the median clean round, else the median round less its run-queue wait)."""
    return interleaved_seconds([run], device, min_seconds, rounds=8)[0]


def interleaved_seconds(runs: Sequence[Callable[[], Any]], device: torch.device, min_seconds: float,
                        rounds: int = 5, batch_seconds: float = 2e-3) -> list[float]:
    """Wall seconds of one call of each of `runs` on this machine without other processes'
    load: timed in rounds (each round times a batch of calls, about `batch_seconds`, of every run
    in turn, until `rounds` rounds and `min_seconds` have passed), each round with the run-queue
    wait other processes caused in it; per run the estimate of `flowrec.measure.robust` (the
    median of the rounds that did not wait, else the median round less its wait; counted
    in `robust.LOG`). The profile describes the machine, not its neighbours' load at
    calibration time (which `tools/bench_costmodel.py` shows as the spread of the measured steps)."""
    reps = []
    for run in runs:
        run()
        _sync(device)
        t0 = time.perf_counter()
        run()
        _sync(device)
        reps.append(max(1, int(batch_seconds / max(time.perf_counter() - t0, 1e-9))))
    samples: list[list[robust.Round]] = [[] for _ in runs]
    start = time.perf_counter()
    sync = partial(_sync, device)
    while len(samples[0]) < rounds or time.perf_counter() - start < min_seconds:
        for run, n, out in zip(runs, reps, samples):
            out += robust.time_rounds(run, 1, n, sync)
    return [robust.LOG.add(robust.estimate(out)).seconds for out in samples]


def gemm_tflops(device: torch.device, shapes: list[tuple[int, int, int]], dtype: torch.dtype,
                min_seconds: float) -> tuple[float, dict[str, float]]:
    """FLOP-weighted achieved TFLOP/s of forward GEMMs (m x k) @ (k x n) at `shapes`, as training
    runs them (bf16 on a CPU without bf16 kernels: fp32 products of bf16 values, `operators.lowp`)."""
    total_flops = total_s = 0.0
    per_shape = {}
    for m, k, n in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        seconds = mean_seconds(lambda: matmul(torch.mm, a, b), device, min_seconds)
        flops = 2.0 * m * k * n
        per_shape[f"{m}x{k}x{n}"] = flops / seconds / 1e12
        total_flops, total_s = total_flops + flops, total_s + seconds
    return total_flops / total_s / 1e12, per_shape


def gather_rates(device: torch.device, min_seconds: float, table_device: torch.device | None = None,
                 ) -> tuple[dict[int, float], dict[int, float]]:
    """Random row gather and scatter-add rates (rows/s) by dim, uniform ids over a large table."""
    table_device = table_device or device
    gen = torch.Generator().manual_seed(0)
    gathers, scatters = {}, {}
    for dim in GATHER_DIMS:
        table = torch.zeros(GATHER_TABLE_ROWS, dim, device=table_device)
        ids = torch.randint(0, GATHER_TABLE_ROWS, (GATHER_LOOKUPS,), generator=gen).to(table_device)
        grads = torch.ones(GATHER_LOOKUPS, dim, device=table_device)
        gathers[dim] = GATHER_LOOKUPS / mean_seconds(lambda: table.index_select(0, ids), table_device, min_seconds)
        scatters[dim] = GATHER_LOOKUPS / mean_seconds(lambda: table.index_add_(0, ids, grads), table_device,
                                                      min_seconds)
    return gathers, scatters


def copy_gbps(device: torch.device, min_seconds: float) -> float:
    """Device memory bandwidth of a large copy, GB/s counting read + write."""
    src = torch.ones(COPY_BYTES // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * COPY_BYTES / mean_seconds(lambda: dst.copy_(src), device, min_seconds) / 1e9


def transfer_gbps(device: torch.device, min_seconds: float) -> tuple[float, float]:
    """Pinned host -> device and device -> host GB/s (CUDA only)."""
    host = runtime_for(device).pin(torch.ones(TRANSFER_BYTES // 4))
    dev = torch.empty(TRANSFER_BYTES // 4, device=device)
    h2d = TRANSFER_BYTES / mean_seconds(lambda: dev.copy_(host, non_blocking=True), device, min_seconds)
    d2h = TRANSFER_BYTES / mean_seconds(lambda: host.copy_(dev, non_blocking=True), device, min_seconds)
    return h2d / 1e9, d2h / 1e9


def upload_cost(device: torch.device, min_seconds: float) -> tuple[float, float]:
    """(GB/s, us a copy) of the transfer stage's copies (CUDA): `DeviceRuntime.upload`, the stage's
    own send, of a pageable host tensor at the two sizes of `UPLOAD_BYTES`, timed interleaved and
    fitted by `upload_fit`."""
    runtime = runtime_for(device)
    small, large = (torch.ones(n // 4) for n in UPLOAD_BYTES)
    seconds = interleaved_seconds([lambda: runtime.upload(small), lambda: runtime.upload(large)], device,
                                  min_seconds)
    return upload_fit(UPLOAD_BYTES, seconds)


def upload_fit(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """(GB/s, fixed us) of t = fixed + bytes / rate through two (bytes, seconds) points; where the
    larger copy was not the slower (noise), the rate of the larger alone and no fixed part.

    Example:
        >>> gbps, us = upload_fit((1_000, 1_001_000), (12e-6, 112e-6))
        >>> round(gbps, 3), round(us, 3)
        (10.0, 11.9)
    """
    (b0, b1), (t0, t1) = sizes, seconds
    if t1 <= t0:
        return b1 / t1 / 1e9, 0.0
    per_byte = (t1 - t0) / (b1 - b0)
    return 1.0 / per_byte / 1e9, max(t0 - b0 * per_byte, 0.0) * 1e6


def launch_us(device: torch.device, min_seconds: float) -> float:
    """Wall microseconds of a tiny kernel (the per-op overhead)."""
    x = torch.ones(8, device=device)
    return mean_seconds(lambda: x.add_(1.0), device, min_seconds) * 1e6


def memory_bytes(device: torch.device) -> int:
    """Total memory of the device (host RAM for the CPU)."""
    if device.type == "cuda":
        return next(d.total_bytes for d in cuda_devices() if d.index == (device.index or 0))
    import os

    return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def calibrate(device: torch.device, shapes: list[tuple[int, int, int]], min_seconds: float = 0.5,
              ) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
    """Measure every profile constant this machine can show.

    Args:
        device: the compute device.
        shapes: (m, k, n) GEMMs of the spec's dense layers at its batch size.
        min_seconds: time spent per measured rate; each point of a fitted per-op cost gets
            a quarter of it.

    Returns:
        ({profile field: (value, how)}, raw details).
    """
    bf16, bf16_shapes = gemm_tflops(device, shapes, torch.bfloat16, min_seconds)
    gathers, scatters = gather_rates(device, min_seconds)
    shape_text = ", ".join(f"{m}x{k}x{n}" for m, k, n in shapes)
    measured: dict[str, tuple[Any, str]] = {
        "memory_bytes": (memory_bytes(device), "total device memory (host RAM on the CPU)"),
        "bf16_tflops": (bf16, f"bf16 GEMMs at the spec's shapes {shape_text}, FLOP-weighted, mean of repeats"),
        "gemm_efficiency": (1.0, "the TFLOP/s are achieved rates (fp32: fitted over GEMM shapes)"),
        "hbm_gbps": (copy_gbps(device, min_seconds), f"copy of {COPY_BYTES >> 20} MiB, read + write"),
        "gather_rows_per_s": (gathers[REFERENCE_DIM], f"index_select of {GATHER_LOOKUPS} random rows of dim "
                                                      f"{REFERENCE_DIM} fp32 from {GATHER_TABLE_ROWS} rows"),
        "launch_us": (launch_us(device, min_seconds), "wall time of an 8-element add"),
    }
    details: dict[str, Any] = {"bf16_tflops_by_shape": bf16_shapes,
                               "gather_rows_per_s_by_dim": gathers, "scatter_add_rows_per_s_by_dim": scatters}
    op_measured, op_details = per_op_costs(device, shapes, min_seconds / 4)
    measured.update(op_measured)
    details.update(op_details)
    if device.type == "cuda":
        h2d, d2h = transfer_gbps(device, min_seconds)
        host_gathers, _ = gather_rates(torch.device("cpu"), min_seconds)
        measured["pcie_gbps"] = (min(h2d, d2h), f"pinned copies of {TRANSFER_BYTES >> 20} MiB, slower direction")
        up_gbps, up_us = upload_cost(device, min_seconds)
        sizes = " and ".join(f"{n >> 10} KiB" for n in UPLOAD_BYTES)
        measured["upload_gbps"] = (up_gbps, f"the transfer stage's copies (`DeviceRuntime.upload` of pageable "
                                            f"tensors of {sizes}), t = fixed + bytes / rate")
        measured["upload_us"] = (up_us, "as upload_gbps: the fixed part of one copy")
        measured["host_gather_rows_per_s"] = (host_gathers[REFERENCE_DIM], "as gather_rows_per_s, on host memory")
        details.update(h2d_gbps=h2d, d2h_gbps=d2h)
    else:
        for key in ("pcie_gbps", "upload_gbps", "upload_us"):
            measured[key] = (None, "the host is the device: no transfer stage")
        measured["host_gather_rows_per_s"] = (gathers[REFERENCE_DIM], "as gather_rows_per_s (same memory)")
    details["collective_gbps"] = "not measured: single process (`flowrec calibrate --nproc N` measures them)"
    return measured, details


def per_op_costs(device: torch.device, shapes: list[tuple[int, int, int]], seconds: float,
                 ) -> tuple[dict[str, tuple[Any, str]], dict[str, Any]]:
    """The fitted per-op constants (`flowrec.measure.ops`), `seconds` per timed point."""
    def measure(runs: Sequence[Callable[[], Any]]) -> list[float]:
        return interleaved_seconds(runs, device, seconds * len(runs))

    threshold, fault_ns, alloc_points = ops.alloc_fit(measure, device)

    def fresh(size: float) -> float:
        return size * fault_ns * 1e-9 if threshold and size >= threshold else 0.0

    (gemm_us, tflops, gemm_gbps), backward, gemm_points = ops.layer_fit(measure, device, shapes, fresh)
    ew_us, ew_gbps, ew_points = ops.elementwise_fit(measure, device, fresh)
    forward, updates, sparse_points = ops.sparse_fit(measure, device)
    dense = ops.dense_update_fit(measure, device)
    small_map, large_map = ops.map_ns_per_id(measure, device)
    exchange_ns, exchange_details = ops.exchange_ns_per_slot(measure, device)
    fit = "least squares on relative error over"
    gemm_how = f"fp32 nn.Linear + relu forward under autograd, t = fixed + FLOPs / rate + bytes / bandwidth, " \
               f"{fit} {len(gemm_points)} shapes (the spec's layers and a grid)"
    bwd_how = (f"the forward's constants x the median ratio of backward (forward + backward minus forward) to "
               f"forward time over the same {len(gemm_points) - 1} shapes")
    cases = f"{len(ops.SPARSE_CASES)} (ids, unique rows, dim) cases"
    measured: dict[str, tuple[Any, str]] = {
        "fp32_tflops": (tflops, gemm_how),
        "gemm_us": (gemm_us, gemm_how),
        "gemm_gbps": (gemm_gbps, gemm_how),
        "gemm_bwd_us": (backward[0], bwd_how),
        "gemm_bwd_tflops": (backward[1], bwd_how),
        "gemm_bwd_gbps": (backward[2], bwd_how),
        "op_us": (ops.autograd_op_us(measure, device), f"{ops.AUTOGRAD_CHAIN} tiny multiplies forward and "
                                                       f"backward through autograd, per kernel"),
        "elementwise_us": (ew_us, f"relu and its backward at {len(ops.ELEMENTWISE_SIZES)} sizes, "
                                  f"t = fixed + bytes / bandwidth"),
        "elementwise_gbps": (ew_gbps, "as elementwise_us"),
        "sparse_fwd_us": (forward[0], f"PackedEmbeddingBag forward, t = fixed + ids x (a + b x dim), {fit} {cases}"),
        "sparse_fwd_ns_per_id": (forward[1], "as sparse_fwd_us"),
        "sparse_fwd_ns_per_elem": (forward[2], "as sparse_fwd_us"),
        "sparse_update": ({k: list(v) for k, v in updates.items()},
                          f"fused_backward per sparse optimizer on a staged casting (computed by the data "
                          f"pipeline in training), t = fixed + ids x (a + b x dim) + "
                          f"unique rows x dim x c (c per optimizer), {fit} {cases}"),
        "dense_update": ({k: list(v) for k, v in dense.items()},
                         f"torch.optim step per dense optimizer, t = tensors x a + elements x b, "
                         f"{fit} {len(ops.DENSE_TENSORS)} parameter sets"),
        "alloc_threshold_bytes": (threshold or None, "smallest of fills of new tensors of 4-256 MiB costing at "
                                                     "least half the largest's extra per byte over an existing one"),
        "alloc_ns_per_byte": (fault_ns, "median extra of those fills per byte (fresh pages faulted in)"),
        "map_small_ns_per_id": (small_map, f"int64 row map lookup of {ops.MAP_LOOKUPS} random ids in "
                                           f"{ops.MAP_ENTRIES[0]} entries"),
        "map_ns_per_id": (large_map, f"int64 row map lookup of {ops.MAP_LOOKUPS} random ids in {ops.MAP_ENTRIES[1]} entries"),
        "exchange_ns_per_slot": (exchange_ns, f"what a lookahead scratchpad's exchanges (Scratchpad, NextUseFirst, a "
                                              f"horizon of 3W; a cycled Zipf trace over {ops.EXCHANGE_TABLE_ROWS} rows at "
                                              f"1.25 x its window's rows) on a worker thread add to {ops.EXCHANGE_PROBE}^3 "
                                              f"GEMMs on the run's compute threads, per exchange and slot; at least 0"),
    }
    unfitted = sorted(k for k, (v, _) in measured.items() if (v == 0 and k in RATES) or v is None)
    details = {"layer_us_by_shape": gemm_points, "elementwise_us_by_size": ew_points,
               "sparse_backward_us_by_case": sparse_points, "fresh_memory": alloc_points, "exchange": exchange_details,
               "unfitted": [f"{k}: not shown by the timings (datasheet kept)" for k in unfitted]}
    return {k: v for k, v in measured.items() if k not in unfitted}, details
