"""Fused CPU sparse update: casted gather-reduce and optimizer update in one pass over the unique rows.

One numba kernel per entry point, multi-threaded over chunks of unique rows of about equal id
counts (a Zipf-hot row with a long run does not leave the other threads idle):

* `fused_casted_update`: for each unique row u, sum its run of output-gradient rows (the casted
  gather-reduce of `operators.casting`, in the same order as `casted_row_grads`: sorted position
  by position, from zero), then update the row and its state in place. No (U, D) gradient is
  materialised, every row is read and written once.
* `fused_row_update`: the same update from already coalesced row gradients (caches that split a
  batch between the device and the host reduce first, then update each part).

Both share the per-row update, so reducing first (`casted_row_grads`) and updating afterwards
gives bitwise the same float64 rows as the fused pass (in float32, torch's reduce of mean bags
uses fused multiply-adds: allclose). Arithmetic is in the table's dtype (float32 or float64), with every
operation rounded on its own (no fused multiply-add) and square roots correctly rounded; Adam's
bias corrections `beta^t` are computed in float64 with libm's `pow`. Kernels are compiled on first
use and cached on disk by numba (`cache=True`: next to this file, or in the user's cache folder
where that is read-only; `NUMBA_CACHE_DIR` overrides).

Both kernels prefetch the rows they will touch a few rows ahead (`PREFETCH_ROWS` unique rows of
the table and its state, `PREFETCH_IDS` positions of the output gradient): every access is a
random row of a large table, and the hint overlaps those cache misses instead of taking them one
at a time (26 Criteo fields, 24k unique rows of 34M: 1.33 -> 0.95 ms). A prefetch changes no value.

Optimizer codes (`KERNEL_IDS`): sgd 0, adagrad 1, rowwise_adagrad 2, adam 3. Hyper-parameters
`hp` (`HP_FIELDS`), in the table's dtype so that no operation widens; Adam also takes the
float64 betas `betas64` for the bias corrections.

Example:
    >>> import numpy as np
    >>> w, s = np.ones((3, 2)), np.zeros((3, 0))
    >>> hp = np.array([0.5, 0, 0, 0, 0, 0, 0, 0, 1, 2])
    >>> fused_row_update(0, w, s, np.array([2]), np.full((1, 2), 2.0), hp, np.zeros(2))
    >>> w[:, 0].tolist()
    [1.0, 1.0, 0.0]
"""
from __future__ import annotations

import threading

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, types
from numba.core import cgutils
from numba.extending import intrinsic

KERNEL_IDS = {"sgd": 0, "adagrad": 1, "rowwise_adagrad": 2, "adam": 3}
HP_FIELDS = ("lr", "eps", "weight_decay", "beta1", "beta2", "one_minus_beta1", "one_minus_beta2",
             "zero", "one", "dim")
CHUNKS_PER_THREAD = 4  # work items per thread, so hot rows do not serialise a chunk
PREFETCH_ROWS = 16  # unique rows ahead whose table and state rows are prefetched
PREFETCH_IDS = 32  # sorted id positions ahead whose output-gradient rows are prefetched

_start_lock = threading.Lock()
_started = False


def start_threads() -> int:
    """numba's thread count, its thread pool started without changing torch's threads.

    numba's OpenMP layer sets the OpenMP threads of the thread that starts it to its own count
    (`NUMBA_NUM_THREADS`, all the cores by default), and torch runs on the same OpenMP runtime:
    `OMP_NUM_THREADS=1 flowrec train` ran two-thread torch kernels on two cores from its first
    sparse update. This starts the pool and puts the caller's torch count back. numba's own count
    (`NUMBA_NUM_THREADS`) is left alone: numba refuses a change once its threads run."""
    global _started
    if not _started:  # every kernel call asks: the lock only until the pool runs
        with _start_lock:
            if not _started:
                import torch

                before = torch.get_num_threads()
                numba.get_num_threads()  # starts the pool
                if torch.get_num_threads() != before:
                    torch.set_num_threads(before)
                _started = True
    return numba.get_num_threads()


def running_threads() -> int | None:
    """The calling thread's numba thread count once the pool runs; None before (asking numba would
    start it)."""
    return numba.get_num_threads() if _started else None


def use_threads(count: int) -> None:
    """Run the kernels with `count` threads (at most numba's pool), the pool started first."""
    start_threads()
    numba.set_num_threads(max(1, min(count, numba.config.NUMBA_NUM_THREADS)))


@intrinsic
def _prefetch_row(typingctx, table, row):
    """Hint the CPU to bring row `row` of the 2-D array `table` into cache, for writing.

    Any layout: the address is the data pointer plus `row` times the row stride (bytes).
    """
    def codegen(context, builder, signature, args):
        array = context.make_array(signature.args[0])(context, builder, args[0])
        stride = cgutils.unpack_tuple(builder, array.strides, 2)[0]
        byte_ptr = ir.IntType(8).as_pointer()
        offset = builder.mul(builder.sext(args[1], stride.type), stride)
        address = builder.gep(builder.bitcast(array.data, byte_ptr), [offset])
        fnty = ir.FunctionType(ir.VoidType(), [byte_ptr] + [ir.IntType(32)] * 3)
        fn = builder.module.declare_intrinsic("llvm.prefetch", [byte_ptr], fnty)
        write, locality, data_cache = (ir.Constant(ir.IntType(32), v) for v in (1, 3, 1))
        builder.call(fn, [address, write, locality, data_cache])
        return context.get_dummy_value()
    return types.void(table, row), codegen


@njit(inline="always", cache=True)
def _prefetch_ahead(weight, state, rows, u, end):
    """Prefetch the table and state rows of unique row u + PREFETCH_ROWS of a chunk ending at `end`."""
    if u + PREFETCH_ROWS < end:
        _prefetch_row(weight, rows[u + PREFETCH_ROWS])
        if state.shape[1] > 0:
            _prefetch_row(state, rows[u + PREFETCH_ROWS])


@njit(inline="always", cache=True)
def _sgd_row(w, g, hp):
    lr = hp[0]
    for j in range(w.shape[0]):
        w[j] = w[j] - lr * g[j]


@njit(inline="always", cache=True)
def _adagrad_row(w, s, g, hp):
    lr, eps = hp[0], hp[1]
    for j in range(w.shape[0]):
        s[j] = s[j] + g[j] * g[j]
        w[j] = w[j] - (lr * g[j]) / (np.sqrt(s[j]) + eps)


@njit(inline="always", cache=True)
def _rowwise_adagrad_row(w, s, g, hp):
    lr, eps = hp[0], hp[1]
    dim = w.shape[0]
    total = hp[7]
    for j in range(dim):
        total = total + g[j] * g[j]
    s[0] = s[0] + total / hp[9]
    denom = np.sqrt(s[0]) + eps
    for j in range(dim):
        w[j] = w[j] - (lr * g[j]) / denom


@njit(inline="always", cache=True)
def _adam_row(w, s, g, hp, betas64, tmp):
    lr, eps, b2, c1, c2, one = hp[0], hp[1], hp[4], hp[5], hp[6], hp[8]
    dim = w.shape[0]
    s[2 * dim] = s[2 * dim] + one
    t = np.float64(s[2 * dim])
    tmp[0] = betas64[0] ** t  # rounded to the table's dtype by the store
    tmp[1] = betas64[1] ** t
    bc1 = one - tmp[0]
    bc2_sqrt = np.sqrt(one - tmp[1])
    for j in range(dim):
        m = s[j] + c1 * (g[j] - s[j])
        v = s[dim + j] * b2 + (c2 * g[j]) * g[j]
        s[j], s[dim + j] = m, v
        denom = (np.sqrt(v) / bc2_sqrt + eps) * bc1
        w[j] = w[j] - (lr * m) / denom


@njit(inline="always", cache=True)
def _update_row(kind, w, s, g, hp, betas64, tmp):
    decay = hp[2]
    if decay != 0:
        for j in range(w.shape[0]):
            g[j] = g[j] + decay * w[j]
    if kind == 0:
        _sgd_row(w, g, hp)
    elif kind == 1:
        _adagrad_row(w, s, g, hp)
    elif kind == 2:
        _rowwise_adagrad_row(w, s, g, hp)
    else:
        _adam_row(w, s, g, hp, betas64, tmp)


@njit(cache=True)
def _balanced_chunks(unique_offsets, chunks):
    """Row bounds of `chunks` pieces with about equal id counts.  # (chunks + 1,) int64"""
    rows = unique_offsets.shape[0] - 1
    nnz = unique_offsets[rows]
    bounds = np.empty(chunks + 1, np.int64)
    for c in range(chunks + 1):
        bounds[c] = np.searchsorted(unique_offsets, (nnz * c) // chunks)
    bounds[chunks] = rows
    for c in range(1, chunks + 1):
        bounds[c] = max(bounds[c], bounds[c - 1])
    return bounds


def _chunks(rows: int) -> int:
    return max(1, min(rows, CHUNKS_PER_THREAD * start_threads()))


@njit(parallel=True, cache=True, nogil=True)
def _fused_casted_kernel(kind, weight, state, grad_out, sorted_bags, unique_offsets, rows, scale,
                         hp, betas64, bounds):
    dim = weight.shape[1]
    nnz = sorted_bags.shape[0]
    weighted = scale.shape[0] > 0
    for c in prange(bounds.shape[0] - 1):
        acc = np.empty(dim, weight.dtype)
        tmp = np.empty(2, weight.dtype)
        end = bounds[c + 1]
        for u in range(bounds[c], end):
            _prefetch_ahead(weight, state, rows, u, end)
            acc[:] = 0
            for p in range(unique_offsets[u], unique_offsets[u + 1]):
                if p + PREFETCH_IDS < nnz:
                    _prefetch_row(grad_out, sorted_bags[p + PREFETCH_IDS])
                src = grad_out[sorted_bags[p]]
                if weighted:
                    sc = scale[p]
                    for j in range(dim):
                        acc[j] = acc[j] + src[j] * sc
                else:
                    for j in range(dim):
                        acc[j] = acc[j] + src[j]
            r = rows[u]
            _update_row(kind, weight[r], state[r], acc, hp, betas64, tmp)


@njit(parallel=True, cache=True, nogil=True)
def _row_update_kernel(kind, weight, state, rows, grads, hp, betas64, bounds):
    dim = weight.shape[1]
    for c in prange(bounds.shape[0] - 1):
        acc = np.empty(dim, weight.dtype)
        tmp = np.empty(2, weight.dtype)
        end = bounds[c + 1]
        for u in range(bounds[c], end):
            _prefetch_ahead(weight, state, rows, u, end)
            acc[:] = grads[u]
            r = rows[u]
            _update_row(kind, weight[r], state[r], acc, hp, betas64, tmp)


def fused_casted_update(kind: int, weight: np.ndarray, state: np.ndarray, grad_out: np.ndarray,
                        sorted_bags: np.ndarray, unique_offsets: np.ndarray, rows: np.ndarray,
                        scale: np.ndarray, hp: np.ndarray, betas64: np.ndarray) -> None:
    """Gather-reduce the casted gradient of every unique row and update it in place.

    Args:
        kind: optimizer code (`KERNEL_IDS`).
        weight: the table, float32 or float64, C-contiguous.  # (R, D)
        state: its optimizer state, same dtype.  # (R, k)
        grad_out: output gradient in the weight's dtype.  # (NB, D)
        sorted_bags: bag of each stably sorted id position.  # (nnz,) int64
        unique_offsets: run boundaries.  # (U + 1,) int64
        rows: unique rows to update (the runs' ids, possibly renamed to slots).  # (U,) int64
        scale: per sorted position pooling scale in the weight's dtype, or empty.  # (nnz,) | (0,)
        hp: hyper-parameters in the weight's dtype, in `HP_FIELDS` order.  # (10,)
        betas64: Adam's (beta1, beta2) in float64.  # (2,)
    """
    bounds = _balanced_chunks(unique_offsets, _chunks(rows.shape[0]))
    _fused_casted_kernel(kind, weight, state, grad_out, sorted_bags, unique_offsets, rows, scale,
                         hp, betas64, bounds)


def fused_row_update(kind: int, weight: np.ndarray, state: np.ndarray, rows: np.ndarray,
                     grads: np.ndarray, hp: np.ndarray, betas64: np.ndarray) -> None:
    """Update `weight[rows]` and `state[rows]` in place from coalesced gradients `grads` (U, D)."""
    count = rows.shape[0]
    chunks = _chunks(count)
    bounds = (np.arange(chunks + 1, dtype=np.int64) * count) // chunks
    _row_update_kernel(kind, weight, state, rows, grads, hp, betas64, bounds)

