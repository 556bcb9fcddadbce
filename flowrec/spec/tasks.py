"""The table of head tasks every layer reads: losses, metrics, labels and scores per task.

Example:
    >>> TASKS["multiclass"].losses, TASKS["binary"].score
    (('softmax_ce',), 'sigmoid')
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class TaskInfo:
    """Facts about one head task.

    Args:
        name: as in a head's `task`.
        losses: the losses it trains with (the first is the default).
        metrics: what evaluation reports for it (and early stopping may watch).
        labels: what its label holds: ``binary`` (0 or 1), ``finite`` (any finite number) or
            ``class`` (a class index 0 .. num_classes - 1).
        score: how a logit becomes a score: ``sigmoid`` (a probability), ``identity`` or
            ``softmax`` (one probability per class).
        classes: the head has one logit per class (`num_classes`), else one.
    """

    name: str
    losses: tuple[str, ...]
    metrics: tuple[str, ...]
    labels: Literal["binary", "finite", "class"]
    score: Literal["sigmoid", "identity", "softmax"]
    classes: bool = False


TASKS: dict[str, TaskInfo] = {t.name: t for t in (
    TaskInfo("binary", ("bce",), ("auc", "gauc", "pr_auc", "logloss", "ne", "calibration"), "binary", "sigmoid"),
    TaskInfo("regression", ("mse",), ("mse", "mae"), "finite", "identity"),
    TaskInfo("multiclass", ("softmax_ce",), ("accuracy", "accuracy_at_k", "logloss", "auc"), "class", "softmax",
             classes=True),
)}
