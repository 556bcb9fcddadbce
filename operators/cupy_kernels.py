"""CuPy RawKernels for the CUDA hot path, zero-copy with torch through DLPack.

`fused_rowwise_update` is the casted gather-reduce fused with the row-wise Adagrad update in one
kernel: one thread block per unique row, one thread per embedding element; each thread sums its
element over the row's run of (scaled) output-gradient rows, the block reduces mean(g^2) with a
halving-stride tree (so the block must be a power of two), updates the row's state and the row.
Rows are unique, so there are no atomics. The torch path (`operators.backends`) is the reference.

This module imports neither cupy nor CUDA APIs: `KERNELS` lists every RawKernel source (compiled
with NVRTC in CI by `operators.nvrtc`), `rowwise_launch` is the pure launch-configuration rule
(checked over every dim by `check_launch`), `rowwise_twin` replays the kernel's index arithmetic
in NumPy on the CPU, and the launch itself goes through `operators.device`.

Example:
    >>> rowwise_launch(num_unique=5, dim=40)
    LaunchConfig(grid=5, block=64, shared_mem_bytes=256)
    >>> check_launch(CASTED_ROWWISE_ADAGRAD, rowwise_launch(5, 40), dim=40)
    []
"""
from __future__ import annotations

import numpy as np
import torch

from operators.casting import Casting
from operators.device import KernelSource, LaunchConfig, runtime_for
from operators.sparse_optim import RowwiseAdagrad, SparseOptimizer

MAX_DIM = 1024  # elements per row: one thread each, at most one full block
WARP = 32  # threads per warp: the smallest block
MAX_SHARED_BYTES = 48 * 1024  # dynamic shared memory without an opt-in attribute, bytes
MAX_GRID_X = 2**31 - 1  # blocks in grid dimension x
FLOAT_BYTES = 4  # bytes of one float in shared memory

CASTED_ROWWISE_ADAGRAD = KernelSource(
    name="casted_rowwise_adagrad",
    entry="casted_rowwise_adagrad",
    tree_reduction=True,
    max_threads=MAX_DIM,
    source=r"""
extern "C" __global__ void casted_rowwise_adagrad(
    const float* __restrict__ grad_out, const long long* __restrict__ sorted_bags,
    const float* __restrict__ scale, const long long* __restrict__ unique_ids,
    const long long* __restrict__ unique_offsets, float* __restrict__ weight,
    float* __restrict__ state, const int dim, const int has_scale, const float lr,
    const float eps, const float weight_decay)
{
    extern __shared__ float partial[];
    const long long u = blockIdx.x;
    const int d = threadIdx.x;
    const long long row = unique_ids[u];
    float g = 0.0f;
    if (d < dim) {
        const long long end = unique_offsets[u + 1];
        for (long long p = unique_offsets[u]; p < end; ++p) {
            const float s = has_scale ? scale[p] : 1.0f;
            g += s * grad_out[sorted_bags[p] * dim + d];
        }
        if (weight_decay != 0.0f) g += weight_decay * weight[row * dim + d];
    }
    partial[d] = (d < dim) ? g * g : 0.0f;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (d < stride) partial[d] += partial[d + stride];
        __syncthreads();
    }
    const float acc = state[row] + partial[0] / dim;
    if (d < dim) weight[row * dim + d] -= lr * g / (sqrtf(acc) + eps);
    __syncthreads();
    if (d == 0) state[row] = acc;
}
""",
)

KERNELS: tuple[KernelSource, ...] = (CASTED_ROWWISE_ADAGRAD,)  # every RawKernel source in operators/


def supports(optimizer: SparseOptimizer, weight: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """True when a kernel exists for this optimizer, dtype and dim."""
    return (isinstance(optimizer, RowwiseAdagrad) and weight.dtype == torch.float32
            and grad_out.dtype == torch.float32 and weight.shape[1] <= MAX_DIM
            and weight.is_contiguous())


def rowwise_launch(num_unique: int, dim: int) -> LaunchConfig:
    """Launch of `casted_rowwise_adagrad`: one block per unique row, the smallest power-of-two
    block of at least one warp covering `dim`, one float of shared memory per thread."""
    threads = WARP
    while threads < dim:
        threads *= 2
    return LaunchConfig(grid=num_unique, block=threads, shared_mem_bytes=threads * FLOAT_BYTES)


def check_launch(kernel: KernelSource, config: LaunchConfig, dim: int) -> list[str]:
    """Every way `config` breaks the kernel's assumptions for rows of `dim` elements (empty: fine)."""
    problems = []
    block = config.block
    if kernel.tree_reduction and (block < 1 or block & (block - 1)):
        problems.append(f"block {block} is not a power of two (tree reduction)")
    if block % WARP:
        problems.append(f"block {block} is not a multiple of the warp ({WARP})")
    if block < dim:
        problems.append(f"block {block} has fewer threads than the {dim} elements of a row")
    if block > kernel.max_threads:
        problems.append(f"block {block} exceeds the kernel's {kernel.max_threads} threads")
    if config.shared_mem_bytes > MAX_SHARED_BYTES:
        problems.append(f"shared memory {config.shared_mem_bytes} B exceeds {MAX_SHARED_BYTES} B")
    if config.shared_mem_bytes < block * FLOAT_BYTES:
        problems.append(f"shared memory {config.shared_mem_bytes} B holds fewer than {block} floats")
    if not 0 <= config.grid <= MAX_GRID_X:
        problems.append(f"grid {config.grid} outside [0, {MAX_GRID_X}]")
    return problems


def fused_rowwise_update(weight: torch.Tensor, state: torch.Tensor, optimizer: SparseOptimizer,
                         grad_out: torch.Tensor, casting: Casting) -> None:
    """Casted gather-reduce + rowwise Adagrad on `weight` (R, D) and `state` (R, 1), in place.

    Args:
        weight: packed table on CUDA, float32, contiguous.  # (R, D)
        state: row-wise accumulator.  # (R, 1)
        optimizer: a `RowwiseAdagrad`.
        grad_out: output gradient.  # (NB, D)
        casting: the batch's casting on the same device.
    """
    dim = weight.shape[1]
    has_scale = casting.sorted_scale is not None
    scale = (casting.sorted_scale.to(torch.float32) if has_scale
             else torch.zeros(1, device=weight.device))
    params = optimizer.params
    config = rowwise_launch(casting.unique_ids.numel(), dim)
    args = (grad_out.contiguous(), casting.sorted_bags.contiguous(), scale, casting.unique_ids.contiguous(),
            casting.unique_offsets.contiguous(), weight, state, np.int32(dim), np.int32(has_scale),
            np.float32(optimizer.lr), np.float32(params["eps"]), np.float32(params["weight_decay"]))
    runtime_for(weight.device).launch(CASTED_ROWWISE_ADAGRAD, config, args)


def rowwise_twin(weight: np.ndarray, state: np.ndarray, lr: float, eps: float, weight_decay: float,
                 grad_out: np.ndarray, casting: Casting, config: LaunchConfig) -> None:
    """`casted_rowwise_adagrad` replayed in NumPy float32, thread by thread, in place.

    The same flat index arithmetic (`sorted_bags[p] * dim + d`, `row * dim + d`), the same
    per-thread sequential sum over the run, the same halving-stride shared-memory tree over
    `config.block` threads, the same guards (`d < dim`); blocks run in order (rows are unique).

    Args:
        weight: packed table, float32.  # (R, D)
        state: row-wise accumulator, float32.  # (R, 1)
        lr: learning rate.
        eps: Adagrad epsilon.
        weight_decay: L2 coefficient.
        grad_out: output gradient, float32.  # (NB, D)
        casting: the batch's casting (CPU).
        config: the launch to replay.
    """
    dim = weight.shape[1]
    flat_w, flat_s, flat_g = weight.reshape(-1), state.reshape(-1), grad_out.reshape(-1)
    bags = casting.sorted_bags.numpy()
    offsets = casting.unique_offsets.numpy()
    scale = None if casting.sorted_scale is None else casting.sorted_scale.numpy().astype(np.float32)
    threads = np.arange(config.block)
    active = threads < dim
    for u in range(config.grid):
        row = int(casting.unique_ids[u])
        g = np.zeros(config.block, dtype=np.float32)
        for p in range(int(offsets[u]), int(offsets[u + 1])):
            s = np.float32(1.0) if scale is None else scale[p]
            g[active] += s * flat_g[bags[p] * dim + threads[active]]
        if weight_decay != 0.0:
            g[active] += np.float32(weight_decay) * flat_w[row * dim + threads[active]]
        partial = np.where(active, g * g, np.float32(0.0)).astype(np.float32)
        stride = config.block // 2
        while stride > 0:
            partial[:stride] += partial[stride:2 * stride]
            stride >>= 1
        acc = np.float32(flat_s[row] + partial[0] / np.float32(dim))
        flat_w[row * dim + threads[active]] -= np.float32(lr) * g[active] / (np.sqrt(acc) + np.float32(eps))
        flat_s[row] = acc
