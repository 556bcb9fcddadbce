"""CuPy RawKernels for the CUDA hot path, zero-copy with torch through DLPack.

`fused_rowwise_update` is the casted gather-reduce fused with the row-wise Adagrad update in one
kernel: one thread block per unique row, one thread per embedding element; each thread sums its
element over the row's run of (scaled) output-gradient rows, the block reduces mean(g^2), updates
the row's state and the row. Rows are unique, so there are no atomics. The torch path
(`operators.backends`) is the reference; this module is imported only when cupy is usable.

Example:
    >>> fused_rowwise_update(weight, state, optimizer, grad_out, casting)  # doctest: +SKIP
"""
from __future__ import annotations

import cupy
import torch

from operators.casting import Casting
from operators.sparse_optim import RowwiseAdagrad, SparseOptimizer

MAX_DIM = 1024  # elements per row: one thread each, at most one full block

_SOURCE = r"""
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
"""


def supports(optimizer: SparseOptimizer, weight: torch.Tensor, grad_out: torch.Tensor) -> bool:
    """True when a kernel exists for this optimizer, dtype and dim."""
    return (isinstance(optimizer, RowwiseAdagrad) and weight.dtype == torch.float32
            and grad_out.dtype == torch.float32 and weight.shape[1] <= MAX_DIM
            and weight.is_contiguous())


def _block(dim: int) -> int:
    threads = 32
    while threads < dim:
        threads *= 2
    return threads


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
    grad_out = grad_out.contiguous()
    has_scale = casting.sorted_scale is not None
    scale = (casting.sorted_scale.to(torch.float32) if has_scale
             else torch.zeros(1, device=weight.device))
    kernel = cupy.RawKernel(_SOURCE, "casted_rowwise_adagrad")  # cupy caches the compiled module
    threads = _block(dim)
    params = optimizer.params
    args = tuple(cupy.from_dlpack(t.detach()) for t in (
        grad_out, casting.sorted_bags.contiguous(), scale, casting.unique_ids.contiguous(),
        casting.unique_offsets.contiguous(), weight, state))
    stream = cupy.cuda.ExternalStream(torch.cuda.current_stream(weight.device).cuda_stream)
    with cupy.cuda.Device(weight.device.index or 0), stream:
        kernel((casting.unique_ids.numel(),), (threads,),
               (*args, cupy.int32(dim), cupy.int32(has_scale), cupy.float32(optimizer.lr),
                cupy.float32(params["eps"]), cupy.float32(params["weight_decay"])),
               shared_mem=threads * 4)
