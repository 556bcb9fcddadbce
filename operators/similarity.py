"""The `similarity` operator: the score of a query vector against an item vector (two towers).

query (B, ...), item (B, ...) -> (B, 1): each input is flattened per sample to (B, D) and

- ``metric: dot``: sum_d q_d i_d / temperature;
- ``metric: cosine``: (q / max(|q|, eps)) . (i / max(|i|, eps)) / temperature (eps 1e-12, as
  `torch.nn.functional.normalize`).

Example:
    >>> score = Similarity("cosine", 0.5)(torch.ones(2, 3), torch.ones(2, 3))  # cosine 1 over 0.5
    >>> score.shape, torch.allclose(score, torch.full((2, 1), 2.0))
    (torch.Size([2, 1]), True)
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from operators.dense import flat_rows

Shapes = Sequence[tuple[int, ...]]
METRICS = ("dot", "cosine")
EPS = 1e-12


class Similarity(nn.Module):
    """Dot or cosine similarity over a temperature: query (B, D), item (B, D) -> (B, 1).

    Args:
        metric: ``dot`` or ``cosine``.
        temperature: the similarity is divided by it (> 0).
    """

    def __init__(self, metric: str = "dot", temperature: float = 1.0):
        super().__init__()
        self.cosine, self.temperature = metric == "cosine", float(temperature)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "Similarity":
        return cls(config.get("metric", "dot"), config.get("temperature", 1.0))

    def forward(self, query: torch.Tensor, item: torch.Tensor) -> torch.Tensor:
        q, i = flat_rows(query), flat_rows(item)
        if self.cosine:
            q, i = F.normalize(q, dim=1, eps=EPS), F.normalize(i, dim=1, eps=EPS)
        return (q * i).sum(dim=1, keepdim=True) / self.temperature
