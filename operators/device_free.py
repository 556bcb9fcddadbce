"""Steps that follow their input's device when a model is exported (`torch.export`, for serving).

An exported program keeps each tensor it makes from nothing (`torch.arange`, `torch.full`,
`torch.triu_indices`) on the device it was traced on, as a constant of the graph, and a `.to(dtype)`
or `.float()` as a check that its tensor is on that device (`_assert_tensor_metadata`), even where
the dtype is already the one asked for: a program traced on the CPU and moved to a GPU then made
its index ranges on the CPU, or refused its own tensors. These helpers compute the same values
(bitwise, in training too) from an input tensor, so the program makes them where its inputs are.

Example:
    >>> positions(torch.zeros(2), 4)
    tensor([0, 1, 2, 3])
    >>> as_dtype(torch.ones(2, dtype=torch.bool), torch.float32)
    tensor([1., 1.])
"""
from __future__ import annotations

import torch


def positions(like: torch.Tensor, n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 on the device of `like`: `torch.arange(n, device=like.device)`, which an
    exported program makes on the device it was traced on.  # (n,) int64"""
    return like.new_ones(n, dtype=torch.int64).cumsum(0) - 1


def as_dtype(tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`tensor.to(dtype)` with no device in an exported program (`.to` exports a check that the
    tensor is on the traced device); `tensor` itself when it is of `dtype` already.  # same shape"""
    return tensor if tensor.dtype == dtype else torch.ops.aten._to_copy.default(tensor, dtype=dtype)
