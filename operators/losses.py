"""The training loss: a weighted sum of per-head losses, with sample weights and task spaces.

Each head's loss is a per-row loss (bce, mse, softmax cross-entropy), multiplied by the row's
sample weight and its task-space mask (0 outside it), summed and divided by the batch size: a
mean over the batch's rows in which masked rows count zero. Divided by the batch size, not by the
rows in the task space, the loss is a sum over rows, so micro-batches and ranks add up to the full
batch exactly (`flowrec.runtime.step`).

Example:
    >>> loss = Loss(["bce", "mse"], [1.0, 0.5])
    >>> float(loss(torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [0.0, 1.0]])))
    1.1931...
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
from torch import nn

from operators.retrieval import Candidates, retrieval_loss

F = nn.functional


def _bce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.binary_cross_entropy_with_logits(logits.reshape(-1), labels, reduction="none")


def _mse(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(logits.reshape(-1), labels, reduction="none")


def _softmax_ce(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, labels.long(), reduction="none")  # logits (B, C), labels class ids


# Per-row loss of a head: logits (B, width), labels (B,) -> (B,)
LOSSES: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "bce": _bce, "mse": _mse, "softmax_ce": _softmax_ce,
}


class Loss(nn.Module):
    """Weighted sum of per-head losses: logits (B, sum of widths), labels (B, T [+ weights]) -> scalar.

    Args:
        losses: loss name per head (bce = BCE with logits, mse, softmax_ce).
        weights: weight per head (default 1 each).
        widths: logits per head (default 1 each; num_classes for softmax_ce).
        sample_weights: per head, the label-tensor column of its sample weights (-1: none).
        masks: per head, (label-tensor column, value) of its task space ((-1, _): every row).
        retrieval: (head index, metric, temperature, negatives, logq_correction) of the retrieval
            head (its loss is "sampled_softmax"; its label column holds each row's item id), or None.

    Example:
        >>> loss = Loss(["bce", "bce"], masks=[(-1, 0.0), (0, 1.0)])
        >>> float(loss(torch.zeros(2, 2), torch.tensor([[1.0, 1.0], [0.0, 1.0]])))
        1.0397...
    """

    def __init__(self, losses: Sequence[str], weights: Sequence[float] | None = None,
                 widths: Sequence[int] | None = None, sample_weights: Sequence[int] | None = None,
                 masks: Sequence[tuple[int, float]] | None = None, retrieval: Sequence[Any] | None = None):
        super().__init__()
        unknown = [name for name in losses if name not in LOSSES and name != "sampled_softmax"]
        if unknown:
            raise KeyError(f"unknown losses {unknown}; known: {sorted(LOSSES)}")
        n = len(losses)
        self.losses = list(losses)
        self.weights = list(weights) if weights is not None else [1.0] * n
        self.widths = [int(w) for w in widths] if widths is not None else [1] * n
        self.sample_weights = list(sample_weights) if sample_weights is not None else [-1] * n
        self.masks = [(int(c), float(v)) for c, v in masks] if masks is not None else [(-1, 0.0)] * n
        self.retrieval = tuple(retrieval) if retrieval is not None else None

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Sequence[tuple[int, ...]]) -> "Loss":
        return cls(config.get("losses", ["bce"]), config.get("weights"), config.get("widths"),
                   config.get("sample_weights"), config.get("masks"), config.get("retrieval"))

    def split(self, logits: torch.Tensor) -> list[torch.Tensor]:
        """Each head's logits.  # [(B, width), ...]"""
        return list(logits.split(self.widths, dim=1))

    def row_factors(self, labels: torch.Tensor, i: int) -> torch.Tensor | None:
        """Head i's sample weight times task-space mask per row (None: 1 for every row).  # (B,)"""
        factor = None
        column, value = self.masks[i]
        if column >= 0:
            factor = (labels[:, column] == value).to(labels.dtype)
        if self.sample_weights[i] >= 0:
            weight = labels[:, self.sample_weights[i]]
            factor = weight if factor is None else factor * weight
        return factor

    def per_head(self, logits: Sequence[torch.Tensor], labels: torch.Tensor,
                 candidates: Candidates | None = None) -> list[torch.Tensor]:
        """Unweighted loss of each head, in float32 at least (a float64 model keeps float64);
        `candidates`: the retrieval head's sampled items and logQ (`operators.retrieval`)."""
        labels = labels.unsqueeze(1) if labels.dim() == 1 else labels
        wide = any(logit.dtype == torch.float64 for logit in logits)
        cast = (lambda t: t.double()) if wide else (lambda t: t.float())
        labels = cast(labels)
        out = []
        for i, (name, logit) in enumerate(zip(self.losses, logits)):
            if self.retrieval is not None and i == self.retrieval[0]:
                _, metric, temperature, negatives, _ = self.retrieval
                rows = retrieval_loss(cast(logit), labels[:, i].long(), candidates, metric, temperature, negatives)
            else:
                rows = LOSSES[name](cast(logit), labels[:, i])  # (B,)
            factor = self.row_factors(labels, i)
            out.append((rows if factor is None else rows * factor).mean())
        return out

    def forward(self, logits: Sequence[torch.Tensor] | torch.Tensor, labels: torch.Tensor,
                candidates: Candidates | None = None) -> torch.Tensor:
        if isinstance(logits, torch.Tensor):
            logits = self.split(logits)
        parts = self.per_head(logits, labels, candidates)
        return sum(w * part for w, part in zip(self.weights, parts))
