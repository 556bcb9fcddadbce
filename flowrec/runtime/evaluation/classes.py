"""Streaming exact metrics of a multiclass head: accuracy, accuracy@k, logloss and (up to
AUC_MAX_CLASSES classes) the macro one-vs-rest AUC.

Example:
    >>> acc = MulticlassAccumulator(k=2)
    >>> acc.update(np.array([0, 2]), np.array([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]]))
    >>> acc.result()["accuracy"], acc.result()["accuracy_at_k"]
    (0.5, 0.5)
"""
from __future__ import annotations

import numpy as np

from flowrec.runtime.evaluation.metrics import EPS, BinaryAccumulator
from flowrec.spec.tasks import AUC_MAX_CLASSES

TOP_K = 5  # accuracy@k: the label among the k most probable classes (k = min(5, classes - 1): with
# k = classes every label is among them, and the figure says nothing)


class MulticlassAccumulator:
    """Feed (class labels (B,), class probabilities (B, C)) per batch.

    Args:
        k: the k of accuracy@k.
    """

    def __init__(self, k: int = TOP_K) -> None:
        self.k = k  # at most the number of classes less one, once a batch was seen
        self.per_class: list[BinaryAccumulator] | None = None  # one-vs-rest AUC per class
        self.occurs: np.ndarray | None = None  # (C,) bool: the classes the labels so far hold
        self.n = 0
        self.correct = 0
        self.in_top_k = 0
        self.loss_sum = 0.0
        self.nan_scores = 0  # rows with a NaN probability: a NaN ranks below nothing (accuracy 1.0)

    def update(self, labels: np.ndarray, probs: np.ndarray, groups: np.ndarray | None = None) -> None:
        del groups  # grouped metrics are for binary heads
        labels = np.asarray(labels).reshape(-1).astype(np.int64)
        probs = np.asarray(probs, dtype=np.float64).reshape(labels.size, -1)
        k = self.k = min(self.k, max(1, probs.shape[1] - 1))
        rows = np.arange(labels.size)
        own = probs[rows, labels]  # (B,)
        # the classes ranked before the label: more probable, or as probable and of a lower index (as
        # argmax and a stable sort break ties; counting ties for the label gave equal logits accuracy 1)
        before = (probs > own[:, None]) | ((probs == own[:, None]) & (np.arange(probs.shape[1]) < labels[:, None]))
        rank = before.sum(axis=1)
        if self.occurs is None:
            self.occurs = np.zeros(probs.shape[1], bool)
        self.occurs[labels] = True
        self.n += labels.size
        self.nan_scores += int(np.count_nonzero(np.isnan(probs).any(axis=1)))
        self.correct += int((rank == 0).sum())
        self.in_top_k += int((rank < k).sum())
        self.loss_sum += float(-np.log(np.clip(own, EPS, 1.0)).sum())
        if self.per_class is None and probs.shape[1] <= AUC_MAX_CLASSES:
            self.per_class = [BinaryAccumulator() for _ in range(probs.shape[1])]
        for c, acc in enumerate(self.per_class or ()):
            acc.update(labels == c, probs[:, c])

    def result(self) -> dict[str, float]:
        if not self.n:
            nan = float("nan")
            return {"accuracy": nan, "accuracy_at_k": nan, "logloss": nan, "k": int(self.k), "classes": 0}
        ranked = not self.nan_scores  # NaN scores rank nothing: no accuracy to report
        out = {"accuracy": self.correct / self.n if ranked else float("nan"),
               "accuracy_at_k": self.in_top_k / self.n if ranked else float("nan"),
               "logloss": self.loss_sum / self.n, "k": int(self.k),  # counts: integers in JSON (COUNT_METRICS)
               "classes": int(np.count_nonzero(self.occurs))}
        if self.per_class is not None:
            out["auc"] = _macro_auc(self.per_class)
        return out


COUNT_METRICS = frozenset({"samples", "k", "classes"})  # whole numbers, written as integers (4, not 4.0)


def counts_as_integers(values: dict) -> dict:
    """A head's metrics with its counts (`COUNT_METRICS`) as integers: a flowrec of before
    2026-12-06 wrote a multiclass head's `k` and `classes` as floats (4.0) in metrics.jsonl."""
    return {name: int(value) if name in COUNT_METRICS and isinstance(value, float) and value.is_integer() else value
            for name, value in values.items()}


def top_k_covers_classes(metrics: dict[str, dict[str, float]]) -> list[str]:
    """A line for each multiclass head whose k of accuracy@k is at least the number of classes its
    evaluation rows hold (`classes`): a 6-class head, k = 5, evaluated on rows of 5 classes. Every
    label is then among the top k unless a class that never occurs ranks above it, so accuracy_at_k
    is 1.0 for any model that ranks those classes last (as training on the same classes teaches).

    >>> top_k_covers_classes({"genre": {"accuracy_at_k": 1.0, "k": 5, "classes": 5}})[0].split(":")[0]
    'head genre ranks the top 5 classes for accuracy_at_k, and its evaluation rows hold 5 classes'
    >>> top_k_covers_classes({"genre": {"accuracy_at_k": 0.9, "k": 5, "classes": 6}})
    []
    """
    lines = []
    for head, values in metrics.items():
        k, classes = values.get("k"), values.get("classes")
        if k is None or classes is None or not classes or k < classes:
            continue
        lines.append(f"head {head} ranks the top {k:.0f} classes for accuracy_at_k, and its evaluation rows hold "
                     f"{classes:.0f} class{'' if classes == 1 else 'es'}: every label is among the top {k:.0f} "
                     f"unless a class that never occurs ranks above it, so accuracy_at_k "
                     f"({values['accuracy_at_k']:.4f}) says little of the model (evaluate on rows of more classes)")
    return lines


def _macro_auc(per_class: list[BinaryAccumulator]) -> float:
    """Mean one-vs-rest AUC over the classes that have both positives and negatives (NaN: none)."""
    aucs = [a.result()["auc"] for a in per_class if 0 < a.label_sum < a.n]
    return float(np.mean(aucs)) if aucs else float("nan")
