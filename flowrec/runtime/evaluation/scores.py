"""Scores from logits, head by head: what each head's task makes of its logits (`TaskInfo.score`):
a probability (sigmoid), the value itself, or a probability per class (softmax).

Example:
    >>> scores(torch.zeros(2, 3), ("binary", "multiclass"), (1, 2))[0].tolist()
    [0.5, 0.5, 0.5]
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from flowrec.spec.tasks import TASKS

SCORES: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sigmoid": torch.sigmoid,
    "identity": lambda x: x,
    "softmax": lambda x: torch.softmax(x, dim=1),
}


def scores(logits: torch.Tensor, tasks: Sequence[str], widths: Sequence[int]) -> torch.Tensor:
    """Each head's scores from its logits, side by side.  # (B, sum of widths)"""
    parts = logits.split(list(widths), dim=1)
    return torch.cat([SCORES[TASKS[t].score](p) for t, p in zip(tasks, parts)], dim=1)


def head_columns(widths: Sequence[int]) -> list[slice]:
    """The columns of each head in a (B, sum of widths) logits or scores tensor."""
    out, start = [], 0
    for w in widths:
        out.append(slice(start, start + w))
        start += w
    return out
