"""Every evaluation metric, exact, in one place: as functions of whole arrays and as streaming
accumulators fed batch by batch (the same numbers, tested against scikit-learn).

Binary heads: AUC (ROC, ties averaged), gAUC (per-group AUC weighted by the group's impressions;
groups with one class only are left out, as in the gAUC literature), PR-AUC (average precision, the
step-wise area of scikit-learn's `average_precision_score`), logloss, NE (normalized entropy: logloss
over the entropy of the label mean) and calibration (mean prediction over mean label). Regression
heads: MSE and MAE.

The streaming accumulators keep one (score, group) key per distinct value with its positive and
negative counts, so their memory is bounded by the distinct scores, not the samples, and their
results equal the whole-array functions exactly.

Example:
    >>> import numpy as np
    >>> auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    0.75
    >>> acc = BinaryAccumulator()
    >>> acc.update(np.array([0, 1]), np.array([0.1, 0.35])); acc.update(np.array([0, 1]), np.array([0.4, 0.8]))
    >>> acc.result()["auc"]
    0.75
"""
from __future__ import annotations

import math

import numpy as np

EPS = 1e-7  # probability clamp for logloss
BINARY_METRICS = ("auc", "gauc", "pr_auc", "logloss", "ne", "calibration")
REGRESSION_METRICS = ("mse", "mae")
HIGHER_IS_BETTER = frozenset({"auc", "gauc", "pr_auc", "accuracy", "accuracy_at_k"})
COMPACT_EVERY = 1 << 20  # buffered samples before an accumulator merges duplicate keys


def _flat(values: np.ndarray, dtype: type = np.float64) -> np.ndarray:
    return np.asarray(values, dtype=dtype).ravel()


def _rank_auc(pos: np.ndarray, neg: np.ndarray) -> float:
    """AUC from positive / negative counts per distinct score, scores ascending.  # (K,), (K,)"""
    n_pos, n_neg = pos.sum(), neg.sum()
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    below = np.cumsum(neg) - neg  # negatives with a strictly lower score
    return float((pos * (below + 0.5 * neg)).sum() / (n_pos * n_neg))


def _counts(labels: np.ndarray, scores: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(distinct scores ascending, positives per score, negatives per score)."""
    values, inverse = np.unique(scores, return_inverse=True)
    pos = np.bincount(inverse, weights=labels, minlength=values.size)
    neg = np.bincount(inverse, weights=1.0 - labels, minlength=values.size)
    return values, pos, neg


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U, ties count one half).

    Args:
        labels: (N,) 0/1 labels.
        scores: (N,) scores; any monotone transform gives the same AUC.

    Returns:
        The AUC, or NaN when only one class is present.
    """
    labels = _flat(labels).astype(bool).astype(np.float64)
    _, pos, neg = _counts(labels, _flat(scores))
    return _rank_auc(pos, neg)


def _average_precision(pos: np.ndarray, neg: np.ndarray) -> float:
    """Average precision from counts per distinct score, scores ascending (thresholds descending)."""
    n_pos = pos.sum()
    if n_pos == 0:
        return float("nan")
    tp = np.cumsum(pos[::-1])
    fp = np.cumsum(neg[::-1])
    precision = tp / (tp + fp)
    return float((pos[::-1] / n_pos * precision).sum())


def pr_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Area under the precision-recall curve as average precision (sum of precision at each distinct
    threshold times the recall it adds); NaN without positives."""
    labels = _flat(labels).astype(bool).astype(np.float64)
    _, pos, neg = _counts(labels, _flat(scores))
    return _average_precision(pos, neg)


def gauc(labels: np.ndarray, scores: np.ndarray, groups: np.ndarray) -> float:
    """Group AUC: the AUC of each group (e.g. user) weighted by its number of samples; groups with
    only one class are left out. NaN when no group has both classes."""
    labels = _flat(labels).astype(bool).astype(np.float64)
    scores, groups = _flat(scores), _flat(groups, np.int64)
    keys, inverse = np.unique(np.stack([groups, scores.view(np.int64)]), axis=1, return_inverse=True)
    inverse = inverse.ravel()
    pos = np.bincount(inverse, weights=labels, minlength=keys.shape[1])
    neg = np.bincount(inverse, weights=1.0 - labels, minlength=keys.shape[1])
    return _grouped_auc(keys[0], keys[1].view(np.float64), pos, neg)


def _grouped_auc(group: np.ndarray, score: np.ndarray, pos: np.ndarray, neg: np.ndarray) -> float:
    """Weighted mean AUC over groups from counts per distinct (group, score) key."""
    order = np.lexsort((score, group))
    group, pos, neg = group[order], pos[order], neg[order]
    starts = np.flatnonzero(np.r_[True, group[1:] != group[:-1]])
    total, weight = 0.0, 0.0
    for lo, hi in zip(starts, np.r_[starts[1:], group.size]):
        value = _rank_auc(pos[lo:hi], neg[lo:hi])
        if not math.isnan(value):
            n = pos[lo:hi].sum() + neg[lo:hi].sum()
            total, weight = total + n * value, weight + n
    return float(total / weight) if weight else float("nan")


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities (clamped to [EPS, 1 - EPS])."""
    labels = _flat(labels)
    p = np.clip(_flat(probs), EPS, 1 - EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def entropy(rate: float) -> float:
    """Binary entropy (nats) of a base rate; NaN at 0 or 1, where NE is undefined."""
    if not 0.0 < rate < 1.0:
        return float("nan")
    return float(-(rate * math.log(rate) + (1 - rate) * math.log(1 - rate)))


def normalized_entropy(labels: np.ndarray, probs: np.ndarray) -> float:
    """NE: logloss divided by the entropy of the label mean (1.0 = predicting the base rate)."""
    return logloss(labels, probs) / entropy(float(np.mean(_flat(labels))))


def calibration(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean prediction over mean label (1.0 = calibrated on average); NaN without positives."""
    mean_label = float(np.mean(_flat(labels)))
    return float(np.mean(_flat(probs))) / mean_label if mean_label > 0 else float("nan")


def mse(targets: np.ndarray, preds: np.ndarray) -> float:
    diff = _flat(targets) - _flat(preds)
    return float(np.mean(diff * diff))


def mae(targets: np.ndarray, preds: np.ndarray) -> float:
    return float(np.mean(np.abs(_flat(targets) - _flat(preds))))


class BinaryAccumulator:
    """Streaming exact metrics of a binary head: feed (labels, probabilities[, groups]) per batch.

    Args:
        grouped: also compute gAUC (then every `update` needs `groups`).
    """

    def __init__(self, grouped: bool = False) -> None:
        self.grouped = grouped
        self.n = 0
        self.label_sum = 0.0
        self.prob_sum = 0.0
        self.loss_sum = 0.0
        self._keys: list[np.ndarray] = []  # (2, k) int64: group, score bits
        self._pos: list[np.ndarray] = []
        self._neg: list[np.ndarray] = []
        self._buffered = 0
        self.nan_scores = 0  # NaN probabilities (a model of non-finite parameters): no ranking to measure

    def update(self, labels: np.ndarray, probs: np.ndarray, groups: np.ndarray | None = None) -> None:
        labels = _flat(labels).astype(bool).astype(np.float64)
        probs = _flat(probs)
        self.nan_scores += int(np.count_nonzero(np.isnan(probs)))
        if self.grouped and groups is None:
            raise ValueError("a grouped accumulator needs the group of every sample")
        p = np.clip(probs, EPS, 1 - EPS)
        self.n += labels.size
        self.label_sum += float(labels.sum())
        self.prob_sum += float(probs.sum())
        self.loss_sum += float(-(labels * np.log(p) + (1 - labels) * np.log(1 - p)).sum())
        group = _flat(groups, np.int64) if self.grouped else np.zeros(labels.size, np.int64)
        score = probs + 0.0  # -0.0 and 0.0 are one score
        self._keys.append(np.stack([group, score.view(np.int64)]))
        self._pos.append(labels)
        self._neg.append(1.0 - labels)
        self._buffered += labels.size
        if self._buffered >= COMPACT_EVERY:
            self._compact()

    def _compact(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        if not self._keys:
            return np.zeros((2, 0), np.int64), np.zeros(0), np.zeros(0)
        keys, inverse = np.unique(np.concatenate(self._keys, axis=1), axis=1, return_inverse=True)
        inverse = inverse.ravel()
        pos = np.bincount(inverse, weights=np.concatenate(self._pos), minlength=keys.shape[1])
        neg = np.bincount(inverse, weights=np.concatenate(self._neg), minlength=keys.shape[1])
        self._keys, self._pos, self._neg, self._buffered = [keys], [pos], [neg], keys.shape[1]
        return keys, pos, neg

    def result(self) -> dict[str, float]:
        """The metrics of everything fed so far (NaN where undefined)."""
        keys, pos, neg = self._compact()
        score = keys[1].view(np.float64)
        values, inverse = np.unique(score, return_inverse=True)
        pos_s = np.bincount(inverse.ravel(), weights=pos, minlength=values.size)
        neg_s = np.bincount(inverse.ravel(), weights=neg, minlength=values.size)
        nan = float("nan")
        loss = self.loss_sum / self.n if self.n else nan
        rate = self.label_sum / self.n if self.n else nan
        if self.nan_scores:  # NaN sorted above every score: an AUC of 0.51 from a model scoring NaN
            pos_s, neg_s = np.zeros(0), np.zeros(0)
            pos, neg = np.zeros_like(pos), np.zeros_like(neg)
        out = {"auc": _rank_auc(pos_s, neg_s), "pr_auc": _average_precision(pos_s, neg_s), "logloss": loss,
               "ne": loss / entropy(rate) if self.n else nan,
               "calibration": (self.prob_sum / self.n) / rate if self.n and rate > 0 else nan}
        if self.grouped:
            out["gauc"] = _grouped_auc(keys[0], score, pos, neg)
        return out


class RegressionAccumulator:
    """Streaming MSE and MAE of a regression head."""

    def __init__(self) -> None:
        self.n = 0
        self.sq_sum = 0.0
        self.abs_sum = 0.0

    def update(self, targets: np.ndarray, preds: np.ndarray, groups: np.ndarray | None = None) -> None:
        del groups  # per-group regression metrics are not defined here
        diff = _flat(targets) - _flat(preds)
        self.n += diff.size
        self.sq_sum += float((diff * diff).sum())
        self.abs_sum += float(np.abs(diff).sum())

    def result(self) -> dict[str, float]:
        nan = float("nan")
        return {"mse": self.sq_sum / self.n if self.n else nan, "mae": self.abs_sum / self.n if self.n else nan}


def metric_names(task: str, grouped: bool) -> tuple[str, ...]:
    """The metrics reported for a head of `task` ("binary" or "regression")."""
    if task == "binary":
        return tuple(m for m in BINARY_METRICS if grouped or m != "gauc")
    return REGRESSION_METRICS
