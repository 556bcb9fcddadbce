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
        ranks: it ranks a catalogue (retrieval): its metrics are named per cut-off K
            (``hr@10``, `retrieval_metric_names`) and its label column is replaced by the item id.
    """

    name: str
    losses: tuple[str, ...]
    metrics: tuple[str, ...]
    labels: Literal["binary", "finite", "class"]
    score: Literal["sigmoid", "identity", "softmax"]
    classes: bool = False
    ranks: bool = False


TASKS: dict[str, TaskInfo] = {t.name: t for t in (
    TaskInfo("binary", ("bce",), ("auc", "gauc", "pr_auc", "logloss", "ne", "calibration"), "binary", "sigmoid"),
    TaskInfo("regression", ("mse",), ("mse", "mae"), "finite", "identity"),
    TaskInfo("multiclass", ("softmax_ce",), ("accuracy", "accuracy_at_k", "logloss", "auc"), "class", "softmax",
             classes=True),
    # two towers: softmax over in-batch or sampled negatives; metrics over the whole item catalogue
    TaskInfo("retrieval", ("sampled_softmax",), ("hr", "recall", "ndcg", "mrr"), "finite", "identity",
             ranks=True),
)}

AUC_MAX_CLASSES = 64  # a multiclass head reports its macro AUC up to this many classes (one exact AUC each)
DEFAULT_TOP_K = (10, 100)  # cut-offs K of a retrieval head's metrics when the spec gives none
RANK_METRICS = ("hr", "recall", "ndcg")  # retrieval metrics cut at K; mrr is over the whole ranking


def default_top_k(catalogue: int | None) -> tuple[int, ...]:
    """A retrieval head's cut-offs K when its spec gives no `top_k`: those of `DEFAULT_TOP_K` below
    the catalogue's size (a K at least that puts every item in the top K: hr@K would be 1.0 for
    any model), or (1,) for a catalogue of at most 10 items; `DEFAULT_TOP_K` when the size is not
    known from the spec (a managed item table).

    Example:
        >>> default_top_k(None), default_top_k(5000), default_top_k(60), default_top_k(8)
        ((10, 100), (10, 100), (10,), (1,))
    """
    if catalogue is None:
        return DEFAULT_TOP_K
    return tuple(k for k in DEFAULT_TOP_K if k < catalogue) or (1,)


def retrieval_metric_names(top_k: tuple[int, ...]) -> tuple[str, ...]:
    """The metrics a retrieval head reports for its cut-offs.

    Example:
        >>> retrieval_metric_names((10,))
        ('hr@10', 'recall@10', 'ndcg@10', 'mrr')
    """
    return tuple(f"{m}@{k}" for k in top_k for m in RANK_METRICS) + ("mrr",)
