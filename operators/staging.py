"""Staging, reference-embedding and loss operators.

dense_input / sparse_input / label_input move and cast batch tensors to the run's device and
dtype; embedding_lookup + pooling are the unpacked per-table reference path (lookup (B, L, D),
then sum/mean pooling with lengths); loss combines per-head losses with weights (multi-task).

Example:
    >>> lookup = EmbeddingLookup(10, 4, table="t")
    >>> x = lookup(torch.tensor([[1, 2, 0]]))  # (1, 3, 4)
    >>> Pooling("mean")(x, torch.tensor([2])).shape
    torch.Size([1, 4])
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from operators.dense import Shapes
from operators.embedding import TORCH_DTYPES, init_table_rows


def _device_dtype(config: dict[str, Any]) -> tuple[torch.device | None, torch.dtype | None]:
    device = config.get("device")
    dtype = config.get("dtype")
    return (torch.device(device) if device else None,
            TORCH_DTYPES.get(dtype, dtype) if dtype else None)


class DenseInput(nn.Module):
    """Dense columns -> (B, n_dense) on `device` as `dtype` (default fp32).

    Example:
        >>> DenseInput()(torch.ones(2, 3, dtype=torch.float64)).dtype
        torch.float32
    """

    def __init__(self, device: torch.device | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        self.device, self.dtype = device, dtype or torch.float32

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "DenseInput":
        return cls(*_device_dtype(config))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(device=self.device or x.device, dtype=self.dtype, non_blocking=True)


class LabelInput(DenseInput):
    """Labels -> (B, n_tasks) float on `device` (a (B,) vector becomes (B, 1))."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = super().forward(x)
        return x.unsqueeze(1) if x.dim() == 1 else x


class SparseInput(nn.Module):
    """ids + offsets (one feature or a packed group) -> int64 tensors on `device`.

    Example:
        >>> ids, offsets = SparseInput()(torch.tensor([1, 2], dtype=torch.int32), torch.tensor([0, 2]))
        >>> ids.dtype
        torch.int64
    """

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.device = device

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "SparseInput":
        return cls(_device_dtype(config)[0])

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        device = self.device or ids.device
        return (ids.to(device=device, dtype=torch.int64, non_blocking=True),
                offsets.to(device=device, dtype=torch.int64, non_blocking=True))


class EmbeddingLookup(nn.Module):
    """Per-table reference lookup: ids (B, L) -> (B, L, D); the weight is a dense nn.Parameter.

    Args:
        rows: table rows.
        dim: D.
        table: table name (seeds the same init as the packed table's rows).
        seed: model seed.

    Example:
        >>> EmbeddingLookup(5, 2)(torch.tensor([[0, 4]])).shape
        torch.Size([1, 2, 2])
    """

    def __init__(self, rows: int, dim: int, table: str = "table", seed: int = 0):
        super().__init__()
        self.weight = nn.Parameter(init_table_rows(table, rows, dim, seed))  # (rows, D)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "EmbeddingLookup":
        return cls(config["rows"], config["dim"], config.get("table", "table"), config.get("seed", 0))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)  # (B, L, D)


class Pooling(nn.Module):
    """Bag reduction of a lookup (B, L, D) with lengths (B,): sum or mean over the first lengths.

    Positions at or past a sample's length contribute nothing; empty bags give zeros.

    Example:
        >>> Pooling("sum")(torch.ones(1, 3, 2), torch.tensor([2])).tolist()
        [[2.0, 2.0]]
    """

    def __init__(self, mode: str = "sum"):
        super().__init__()
        if mode not in ("sum", "mean"):
            raise ValueError(f"unknown pooling {mode!r}; known: ['mean', 'sum']")
        self.mode = mode

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "Pooling":
        return cls(config.get("pooling", config.get("mode", "sum")))

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        mask = torch.arange(x.shape[1], device=x.device) < lengths.unsqueeze(1)  # (B, L)
        pooled = (x * mask.unsqueeze(-1).to(x.dtype)).sum(dim=1)  # (B, D)
        if self.mode == "mean":
            pooled = pooled / lengths.clamp_min(1).unsqueeze(1).to(x.dtype)
        return pooled
