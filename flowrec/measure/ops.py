"""Measure what a training step costs beyond its arithmetic: per-op overhead, elementwise passes,
dense layers of every shape (forward and backward), the dense optimizers, the sparse path.

Every cost is fit as a linear model, fixed + work / rate, to timings at a few sizes
(`fit_linear`: least squares on relative errors, coefficients kept non-negative), so it applies to
shapes that were not measured. Timings are interleaved rounds estimated by the timing rule
(`flowrec.measure.calibrate.interleaved_seconds`, `flowrec.measure.robust`).
Dense layers are timed as the runtime runs them (`nn.Linear` and its activation under autograd,
forward, then forward + backward). The sparse path is timed through the project's own operators
(`operators.embedding.PackedEmbeddingBag`: the embedding-bag forward, then the casted
gather-reduce and the fused row-wise update of every sparse optimizer), the dense optimizers
through torch.optim as the runtime builds them (`flowrec.runtime.step.make_dense_optimizer`).

Example:
    >>> [round(c, 9) for c in fit_linear([[1, 10], [1, 20], [1, 40]], [3.0, 5.0, 9.0])]  # t = 1 + 0.2 x
    [1.0, 0.2]
"""
from __future__ import annotations

from functools import partial
from types import SimpleNamespace
from typing import Any, Callable, Sequence

import numpy as np
import torch

from flowrec.graph.kinds import OPTIMIZERS
from flowrec.runtime.step import make_dense_optimizer
from operators.backends import fused_backward
from operators.casting import compute_casting
from operators.embedding import PackedEmbeddingBag
from operators.packed_layout import BagField, Layout, TableRange

ELEMENTWISE_SIZES = (1 << 16, 1 << 20, 1 << 22)  # fp32 elements of the timed activation passes
AUTOGRAD_CHAIN = 32  # tiny ops of the per-op overhead chain
LAYER_GRID = ((1024, 64, 64), (4096, 16, 256), (4096, 256, 256), (4096, 1024, 512), (16384, 64, 32),
              (1024, 4096, 16))  # (m, k, n) beyond the spec's: every regime (memory- and compute-bound)
DENSE_TENSORS = ((32, 256), (4, 1 << 18), (16, 1 << 16))  # (tensors, elements each) per optimizer fit
SPARSE_TABLE_ROWS = 1 << 18
SPARSE_CASES = ((16384, SPARSE_TABLE_ROWS, 16), (131072, SPARSE_TABLE_ROWS, 16), (131072, 2048, 16),
                (131072, SPARSE_TABLE_ROWS, 64), (16384, SPARSE_TABLE_ROWS, 64), (131072, 2048, 64))  # (ids, id range, dim)
MAP_ENTRIES = (1 << 20, 1 << 25)  # int64 row maps (small, large) of the lookups host and cached placements make per id
MAP_LOOKUPS = 1 << 17

Measure = Callable[[Sequence[Callable[[], Any]]], list[float]]  # seconds per call of each (`calibrate.interleaved_seconds`)


def fit_linear(features: Sequence[Sequence[float]], seconds: Sequence[float]) -> list[float]:
    """Non-negative coefficients c minimising sum(((features @ c) - t) / t)^2.

    Relative errors, so that small kernels weigh as much as large ones; a coefficient the data
    would make negative is dropped (set to 0) and the rest refit.

    Args:
        features: one row per timing (e.g. [1, work]).
        seconds: the timings (positive).

    Returns:
        One coefficient per feature column.
    """
    x = np.asarray(features, dtype=np.float64)
    t = np.asarray(seconds, dtype=np.float64)
    if x.ndim != 2 or x.shape[0] != t.shape[0] or x.shape[0] < 1 or not (t > 0).all():
        raise ValueError("fit_linear needs one positive timing per feature row")
    weighted = x / t[:, None]
    keep = list(range(x.shape[1]))
    coef = np.zeros(x.shape[1])
    while keep:
        sol = np.linalg.lstsq(weighted[:, keep], np.ones(len(t)), rcond=None)[0]
        if (sol >= 0).all():
            coef[keep] = sol
            break
        keep.pop(int(np.argmin(sol)))
    return [float(round(c, 15)) for c in coef]


def autograd_op_us(measure: Measure, device: torch.device) -> float:
    """Wall microseconds per autograd kernel (forward op or backward node) on tiny tensors."""
    x = torch.ones(8, device=device, requires_grad=True)

    def chain() -> None:
        y = x
        for _ in range(AUTOGRAD_CHAIN):
            y = y * 1.0001
        y.sum().backward()

    kernels = 2 * (AUTOGRAD_CHAIN + 1)
    return measure([chain])[0] / kernels * 1e6


ALLOC_SIZES = (1 << 20, 1 << 22, 1 << 24, 1 << 26)  # fp32 elements (4 MiB to 256 MiB) of the fresh-memory fit


def alloc_fit(measure: Measure, device: torch.device) -> tuple[float, float, dict[str, float]]:
    """(threshold bytes, ns per byte, raw) of fresh memory: filling a new tensor minus filling an
    existing one, at ALLOC_SIZES. From the threshold on (the smallest size costing at least half
    the largest's extra per byte) the allocator hands out new pages that fault in on first touch;
    (0, 0) when no size shows it (or on a GPU: no page faults)."""
    if device.type != "cpu":
        return 0.0, 0.0, {}
    runs = []
    for n in ALLOC_SIZES:
        existing = torch.empty(n)
        runs += [partial(existing.fill_, 1.0), partial(_fresh_fill, n)]
    times = measure(runs)
    extra = [max(fresh - old, 0.0) / (4 * n) for n, old, fresh in zip(ALLOC_SIZES, times[0::2], times[1::2])]
    details = {f"fresh_{4 * n >> 20}MiB_ns_per_byte": e * 1e9 for n, e in zip(ALLOC_SIZES, extra)}
    if extra[-1] <= 0:
        return 0.0, 0.0, details
    first = next(i for i, e in enumerate(extra) if e >= extra[-1] / 2 and all(x >= extra[-1] / 2 for x in extra[i:]))
    faulting = sorted(extra[first:])
    return float(4 * ALLOC_SIZES[first]), faulting[len(faulting) // 2] * 1e9, details


def _fresh_fill(n: int) -> torch.Tensor:
    return torch.empty(n).fill_(1.0)


def elementwise_fit(measure: Measure, device: torch.device,
                    fresh: Callable[[float], float] = lambda size: 0.0) -> tuple[float, float, dict[str, float]]:
    """(us per pass, GB/s) of activation passes: relu forward (read + write) and its backward
    (read two, write one) at ELEMENTWISE_SIZES, fit t = fixed + bytes / bandwidth after taking
    off `fresh(bytes)`, the page faults of each pass's new output."""
    rows, runs, names = [], [], []
    for n in ELEMENTWISE_SIZES:
        x = torch.randn(n, device=device)
        g = torch.randn(n, device=device)
        runs += [partial(torch.relu, x), partial(torch.ops.aten.threshold_backward, g, x, 0.0)]
        rows += [[1.0, 2 * 4.0 * n], [1.0, 3 * 4.0 * n]]  # read + write; read two, write one
        names += [f"relu_{n}", f"relu_backward_{n}"]
    times = measure(runs)
    details = {name: t * 1e6 for name, t in zip(names, times)}
    times = [max(t - fresh(4.0 * n), t / 10) for t, n in zip(times, [n for n in ELEMENTWISE_SIZES for _ in (0, 1)])]
    fixed, per_byte = fit_linear(rows, times)
    return fixed * 1e6, _rate(per_byte, 1e9), details


def layer_fit(measure: Measure, device: torch.device, shapes: Sequence[tuple[int, int, int]],
              fresh: Callable[[float], float] = lambda size: 0.0,
              ) -> tuple[tuple[float, float, float], tuple[float, float, float], dict[str, Any]]:
    """A dense layer as the runtime runs it (`nn.Linear` + relu under autograd, fresh graph per
    call) at the spec's shapes and LAYER_GRID (m samples, k in, n out): forward t = fixed +
    flops / rate + bytes / bandwidth (bytes: input, weight and output); the backward (forward +
    backward minus forward, per shape) as the forward's constants times the median ratio of
    backward to forward over the shapes (a difference of two timings is too noisy for a fit of
    its own on a shared machine); each after taking off `fresh(bytes)` for the tensors it
    allocates (as `flowrec.planner.op_work` lists them: output and activation; output gradient,
    dX and dW).

    Returns:
        ((fixed us, TFLOP/s, GB/s) forward, the same backward, {shape: [forward us, backward us]}).
    """
    todo = list(dict.fromkeys([*shapes, *LAYER_GRID]))
    rows, runs = [], []
    for m, k, n in todo:
        layer = torch.nn.Linear(k, n, device=device)
        x = torch.randn(m, k, device=device, requires_grad=True)
        grad = torch.ones(m, n, device=device)
        runs += [partial(_layer_forward, layer, x), partial(_layer_backward, layer, x, grad)]
        rows.append([1.0, 2.0 * m * k * n, 4.0 * (m * k + k * n + m * n)])
    times = measure(runs)
    fwd_t = times[0::2]
    bwd_t = [max(both - fwd, fwd / 10) for fwd, both in zip(times[0::2], times[1::2])]  # a noisy difference
    details = {f"{m}x{k}x{n}": [f * 1e6, b * 1e6] for (m, k, n), f, b in zip(todo, fwd_t, bwd_t)}
    fwd_net = [max(t - 2 * fresh(4.0 * m * n), t / 10) for t, (m, k, n) in zip(fwd_t, todo)]
    bwd_net = [max(t - fresh(4.0 * m * n) - fresh(4.0 * m * k) - fresh(4.0 * k * n), t / 10)
               for t, (m, k, n) in zip(bwd_t, todo)]
    forward = _layer_constants(fit_linear(rows, fwd_net))
    ratios = sorted(b / f for b, f in zip(bwd_net, fwd_net))
    ratio = ratios[len(ratios) // 2]
    details["backward_over_forward"] = ratio
    return forward, (forward[0] * ratio, forward[1] / ratio, forward[2] / ratio), details


def _layer_forward(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return torch.relu(layer(x))


def _layer_backward(layer: torch.nn.Linear, x: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return torch.autograd.grad(torch.relu(layer(x)), [x, *layer.parameters()], grad)


def _layer_constants(coef: Sequence[float]) -> tuple[float, float, float]:
    """(fixed us, TFLOP/s, GB/s) of fitted (seconds, seconds per FLOP, seconds per byte); a rate
    the fit could not separate is 0."""
    fixed, per_flop, per_byte = coef
    return fixed * 1e6, _rate(per_flop, 1e12), _rate(per_byte, 1e9)


def _rate(seconds_per_unit: float, scale: float) -> float:
    """A fitted cost per unit as units per second / `scale` (1e12: TFLOP/s, 1e9: GB/s); 0 when the
    fit could not separate it (a 0 cost)."""
    return 1.0 / seconds_per_unit / scale if seconds_per_unit > 0 else 0.0


def dense_update_fit(measure: Measure, device: torch.device) -> dict[str, tuple[float, float]]:
    """Per dense optimizer: (us per parameter tensor, ns per parameter element) of one step."""
    out = {}
    for name, info in OPTIMIZERS.items():
        if not info.dense:
            continue
        rows, runs = [], []
        for tensors, elems in DENSE_TENSORS:
            params = [torch.nn.Parameter(torch.randn(elems, device=device)) for _ in range(tensors)]
            for p in params:
                p.grad = torch.randn_like(p)
            runs.append(make_dense_optimizer(SimpleNamespace(dense_parameters=partial(list, params)),
                                             name, 1e-3, {}).step)
            rows.append([float(tensors), float(tensors * elems)])
        times = measure(runs)
        per_tensor, per_elem = fit_linear(rows, times)
        out[name] = (per_tensor * 1e6, per_elem * 1e9)
    return out


def _sparse_module(optimizer: str, dim: int, device: torch.device) -> PackedEmbeddingBag:
    table = TableRange("t", SPARSE_TABLE_ROWS, 0)
    layout = Layout("calibrate", dim, "fp32", (optimizer, 0.01, ()), (table,), (BagField("f", "t", 1, "sum"),))
    return PackedEmbeddingBag(layout, device=device)


def sparse_fit(measure: Measure, device: torch.device) -> tuple[list[float], dict[str, list[float]], dict[str, float]]:
    """The sparse path at SPARSE_CASES. Forward (`PackedEmbeddingBag` under autograd): t = fixed +
    ids x (a + b x dim). Backward as `_CastedEmbeddingBag.backward` runs it in training (the
    gather-reduce and fused update of `fused_backward` on the casting the data pipeline staged):
    t = fixed + ids x (a + b x dim) + unique rows x dim x c_o, the row update c_o per sparse
    optimizer o (one joint fit).

    Returns:
        (forward [us, ns per id, ns per id and dim element],
         {optimizer: backward [us, ns per id, ns per id elem, ns per unique row, ns per row elem]},
         raw timings in us).
    """
    names = [n for n, info in OPTIMIZERS.items() if info.sparse]
    gen = torch.Generator().manual_seed(0)
    fwd_rows, fwd_t, bwd_rows, bwd_t, details = [], [], [], [], {}
    for ids_n, id_range, dim in SPARSE_CASES:
        ids = torch.randint(0, id_range, (ids_n,), generator=gen).to(device)
        offsets = torch.arange(ids_n + 1, device=device)
        unique = float(torch.unique(ids).numel())
        grad = torch.ones(ids_n, dim, device=device)
        modules = [_sparse_module(name, dim, device) for name in names]
        casting = compute_casting(ids, offsets, None)  # staged by the data pipeline, as the trainer does
        runs = [partial(modules[0], ids, offsets)] + [partial(_sparse_backward, m, casting, grad) for m in modules]
        times = measure(runs)  # the optimizers of one case interleaved (all cases at once would hold ~1 GB)
        fwd_rows.append([1.0, ids_n, ids_n * dim])
        fwd_t.append(times[0])
        details[f"forward_{ids_n}ids_d{dim}"] = times[0] * 1e6
        for j, (name, seconds) in enumerate(zip(names, times[1:])):
            row = [1.0, ids_n, ids_n * dim] + [0.0] * len(names)
            row[3 + j] = unique * dim
            bwd_rows.append(row)
            bwd_t.append(seconds)
            details[f"{name}_{ids_n}ids_{int(unique)}rows_d{dim}"] = seconds * 1e6
    forward = fit_linear(fwd_rows, fwd_t)
    backward = fit_linear(bwd_rows, bwd_t)
    shared = [backward[0] * 1e6, backward[1] * 1e9, backward[2] * 1e9, 0.0]
    per_opt = {name: shared + [backward[3 + j] * 1e9] for j, name in enumerate(names)}
    return [forward[0] * 1e6, forward[1] * 1e9, forward[2] * 1e9], per_opt, details


def _sparse_backward(module: PackedEmbeddingBag, casting: Any, grad: torch.Tensor) -> None:
    """What `_CastedEmbeddingBag.backward` runs with the casting staged by the data pipeline (the
    trainer's default lookahead computes it there; its cost is in the staging rate)."""
    fused_backward(module.weight, module.state, module.optimizer, grad, casting)


def map_ns_per_id(measure: Measure, device: torch.device) -> tuple[float, float]:
    """Nanoseconds per id of random lookups in a small and a large int64 row map (MAP_ENTRIES):
    host and cached placements map every id to a slot or a working row, in a map of the group's
    rows (cache misses grow with it)."""
    gen = torch.Generator().manual_seed(1)
    runs = []
    for entries in MAP_ENTRIES:
        table = torch.arange(entries, dtype=torch.int64)
        ids = torch.randint(0, entries, (MAP_LOOKUPS,), generator=gen)
        runs.append(partial(table.__getitem__, ids))
    small, large = measure(runs)
    return small / MAP_LOOKUPS * 1e9, large / MAP_LOOKUPS * 1e9


EXCHANGE_TABLE_ROWS = 1 << 24  # rows of the timed scratchpad's master (dim 1: its index work grows with them)
EXCHANGE_TRACE = (40, 80_000, 8)  # batches of the cycled trace, Zipf(1.1) ids a batch, window W (horizon 3W)


EXCHANGE_PROBE = 1024  # the step's stand-in beside the exchanges: an n x n x n fp32 GEMM on the compute threads
EXCHANGE_ROUNDS = 3  # rounds of probes alone and beside the exchanges, interleaved


def exchange_ns_per_slot(measure: Measure, device: torch.device,
                         probe_seconds: float = 0.4) -> tuple[float, dict[str, Any]]:
    """(ns per slot, details) of what a lookahead scratchpad's exchanges add to the step beside
    them: the runtime's `Scratchpad` with its victims (`NextUseFirst`) and a horizon, over a
    cycled Zipf trace at a capacity of 1.25 x its largest window (as the plan sizes one), run
    without pause on a worker thread (as `LookaheadEmbedding` runs it) while this thread times
    GEMMs on the compute threads: (GEMMs beside the exchanges - the same GEMMs alone) per
    exchange done meanwhile, the median of `EXCHANGE_ROUNDS` interleaved rounds, over the
    capacity; at least 0. What an exchange takes alone is in the details.

    Its host work (the window's row-map lookups, the ranking of every resident row the window
    does not pin, fetches and write-backs) is what it costs a step when it finds no free core:
    wide_deep's dim-1 group of 149,630 slots over 33.8M rows takes 33-45 ms an exchange alone on
    a 2-core CPU, and with the trainer's default two compute threads its step measured 66 ms more
    than with the group static_hot, priced nowhere before. On one compute thread of two cores the
    exchange runs on the other core (two_task: lookahead 100.8 ms a step, static_hot 100.0 ms),
    which a time alone priced at +37 ms. Alone, this trace took 114 ns a slot at 4M rows and
    175 ns at 33M; 16M rows is the middle."""
    import threading
    import time

    from flowrec.data.cores import run_threads
    from flowrec.data.lookahead import first_uses, union_sorted
    from flowrec.graph.kinds import HORIZON_WINDOWS
    from flowrec.graph.packing import group_layout
    from flowrec.runtime.caches.counters import CacheCounters
    from flowrec.runtime.caches.scratchpad import Scratchpad
    from flowrec.runtime.caches.victims import Horizon, NextUseFirst
    from flowrec.spec.load import spec_from_dict

    batches, ids, window = EXCHANGE_TRACE
    horizon = HORIZON_WINDOWS * window
    rng = np.random.default_rng(7)
    perm = rng.permutation(EXCHANGE_TABLE_ROWS)
    rows = [torch.from_numpy(np.unique(perm[np.minimum(rng.zipf(1.1, ids) - 1, EXCHANGE_TABLE_ROWS - 1)]))
            for _ in range(batches)]
    cyc = rows + rows[:window + horizon]
    windows = [union_sorted(cyc[i:i + window]) for i in range(batches)]
    horizons = [Horizon(*first_uses(cyc[i + window:i + window + horizon], window)) for i in range(batches)]
    capacity = int(1.25 * max(w.numel() for w in windows))
    spec = spec_from_dict({"name": "exchange", "features": [
        {"name": "c", "type": "categorical", "hash_buckets": EXCHANGE_TABLE_ROWS, "dim": 1}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [1]}],
        "heads": [{"name": "h", "input": "m"}]})
    pad = Scratchpad(PackedEmbeddingBag(group_layout(spec)[0], seed=0), capacity, torch.device("cpu"),
                     CacheCounters(), victims=NextUseFirst())
    state = {"i": 0}

    def step() -> None:
        i = state["i"]
        state["i"] += 1
        b = i % batches
        pad.exchange(windows[b], windows[b], i + 1, horizons[b])
        pad.touch(rows[b], i + 1)

    for _ in range(2 * batches):  # past the fill: every exchange evicts
        step()
    fetched, start = pad.counters.rows_fetched, state["i"]
    (alone,) = measure([step])
    calls, fetched = state["i"] - start, pad.counters.rows_fetched - fetched
    saved = torch.get_num_threads()
    torch.set_num_threads(run_threads())  # the step's threads, as the trainer sets them
    gen = torch.Generator().manual_seed(3)
    a, b = (torch.randn(EXCHANGE_PROBE, EXCHANGE_PROBE, generator=gen) for _ in range(2))
    t0 = time.perf_counter()
    a @ b
    probes = max(3, int(probe_seconds / max(time.perf_counter() - t0, 1e-4)))

    def gemms() -> float:
        t = time.perf_counter()
        for _ in range(probes):
            a @ b
        return time.perf_counter() - t

    def beside() -> tuple[float, int]:
        stop = threading.Event()

        def run() -> None:
            while not stop.is_set():
                step()

        worker = threading.Thread(target=run, name="flowrec-calibrate-exchange", daemon=True)
        first = state["i"]
        worker.start()
        seconds = gemms()
        done = state["i"] - first
        stop.set()
        worker.join()
        return seconds, done

    added, rounds = [], []
    for _ in range(EXCHANGE_ROUNDS):
        base = gemms()
        with_, done = beside()
        rounds.append([round(base * 1e3, 3), round(with_ * 1e3, 3), done])
        if done:
            added.append(max(0.0, with_ - base) / done)
    threads = torch.get_num_threads()
    torch.set_num_threads(saved)
    per_exchange = float(np.median(added)) if added else 0.0
    details = {"capacity": capacity, "window_rows": int(np.median([w.numel() for w in windows])),
               "rows_fetched_per_exchange": round(fetched / max(calls, 1), 1), "compute_threads": threads,
               "ms_per_exchange_alone": round(alone * 1e3, 3), "ms_added_per_exchange": round(per_exchange * 1e3, 3),
               "probe_gemms": probes, "rounds_ms_alone_beside_exchanges": rounds}
    return per_exchange / capacity * 1e9, details
