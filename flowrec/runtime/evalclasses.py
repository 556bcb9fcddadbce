"""Streaming exact metrics of a multiclass head: accuracy, accuracy@k and logloss.

Example:
    >>> acc = MulticlassAccumulator(k=2)
    >>> acc.update(np.array([0, 2]), np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]]))
    >>> acc.result()["accuracy"], acc.result()["accuracy_at_k"]
    (0.5, 0.5)
"""
from __future__ import annotations

import numpy as np

from flowrec.runtime.evalmetrics import EPS

TOP_K = 5  # accuracy@k: the label among the k most probable classes (k = min(5, classes))


class MulticlassAccumulator:
    """Feed (class labels (B,), class probabilities (B, C)) per batch.

    Args:
        k: the k of accuracy@k.
    """

    def __init__(self, k: int = TOP_K) -> None:
        self.k = k  # at most the number of classes, once a batch was seen
        self.n = 0
        self.correct = 0
        self.in_top_k = 0
        self.loss_sum = 0.0

    def update(self, labels: np.ndarray, probs: np.ndarray, groups: np.ndarray | None = None) -> None:
        del groups  # grouped metrics are for binary heads
        labels = np.asarray(labels).reshape(-1).astype(np.int64)
        probs = np.asarray(probs, dtype=np.float64).reshape(labels.size, -1)
        k = self.k = min(self.k, probs.shape[1])
        rows = np.arange(labels.size)
        own = probs[rows, labels]  # (B,)
        rank = (probs > own[:, None]).sum(axis=1)  # classes strictly more probable than the label
        self.n += labels.size
        self.correct += int((rank == 0).sum())
        self.in_top_k += int((rank < k).sum())
        self.loss_sum += float(-np.log(np.clip(own, EPS, 1.0)).sum())

    def result(self) -> dict[str, float]:
        if not self.n:
            nan = float("nan")
            return {"accuracy": nan, "accuracy_at_k": nan, "logloss": nan, "k": float(self.k)}
        return {"accuracy": self.correct / self.n, "accuracy_at_k": self.in_top_k / self.n,
                "logloss": self.loss_sum / self.n, "k": float(self.k)}
