"""Backend choice for the fused embedding backward: CuPy kernels on CUDA when usable, torch otherwise.

The torch path always exists and is the reference. The CuPy path is taken only when the table is
on CUDA, cupy imports, `cupy.cuda.is_available()` is true, and a kernel exists for the optimizer.

Example:
    >>> cupy_usable()  # False on a machine without a CUDA driver
    False
"""
from __future__ import annotations

import torch

from operators.casting import Casting
from operators.device import cupy_usable
from operators.sparse_optim import SparseOptimizer

__all__ = ["cupy_usable", "fused_backward"]


def fused_backward(weight: torch.Tensor, state: torch.Tensor, optimizer: SparseOptimizer,
                   grad_out: torch.Tensor, casting: Casting, use_cupy: bool | None = None) -> str:
    """Apply the casted gradient of `grad_out` to `weight`/`state` with `optimizer`.

    Args:
        weight: packed table.  # (R, D)
        state: optimizer state.  # (R, k)
        optimizer: the group's fused optimizer.
        grad_out: output gradient, one row per bag.  # (NB, D)
        casting: the batch's casting (on the table's device).
        use_cupy: whether cupy is usable (None: ask `cupy_usable()`); callers memoize it.

    Returns:
        The backend that ran: "cupy" or "torch".
    """
    if weight.is_cuda and casting.unique_ids.numel() and (
            cupy_usable() if use_cupy is None else use_cupy):
        from operators import cupy_kernels

        if cupy_kernels.supports(optimizer, weight, grad_out):
            cupy_kernels.fused_rowwise_update(weight, state, optimizer, grad_out, casting)
            return "cupy"
    optimizer.casted_step(weight, state, grad_out, casting)
    return "torch"
