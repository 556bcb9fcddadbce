"""Evaluation metrics (exact AUC, logloss) and the JSON-lines metrics log.

Example:
    >>> import numpy as np
    >>> auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    0.75
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

EPS = 1e-7  # probability clamp for logloss


def auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC (Mann-Whitney U with average ranks for ties).

    Args:
        labels: (N,) 0/1 labels.
        scores: (N,) scores; any monotone transform gives the same AUC.

    Returns:
        The AUC, or NaN when only one class is present.
    """
    labels = np.asarray(labels).astype(bool).ravel()
    scores = np.asarray(scores, dtype=np.float64).ravel()
    n_pos = int(labels.sum())
    n_neg = labels.size - n_pos
    if n_pos == 0 or n_neg == 0:
        return float("nan")
    order = np.argsort(scores, kind="mergesort")
    sorted_scores = scores[order]
    _, first, counts = np.unique(sorted_scores, return_index=True, return_counts=True)
    avg_rank = first + (counts + 1) / 2.0  # 1-based average rank of each tie run
    ranks = np.empty(scores.size, dtype=np.float64)
    ranks[order] = np.repeat(avg_rank, counts)
    return float((ranks[labels].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


def logloss(labels: np.ndarray, probs: np.ndarray) -> float:
    """Mean binary cross-entropy of probabilities (clamped to [EPS, 1 - EPS])."""
    labels = np.asarray(labels, dtype=np.float64).ravel()
    p = np.clip(np.asarray(probs, dtype=np.float64).ravel(), EPS, 1 - EPS)
    return float(-np.mean(labels * np.log(p) + (1 - labels) * np.log(1 - p)))


def mse(targets: np.ndarray, preds: np.ndarray) -> float:
    diff = np.asarray(targets, dtype=np.float64).ravel() - np.asarray(preds, dtype=np.float64).ravel()
    return float(np.mean(diff * diff))


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl`, and to TensorBoard when installed.

    Args:
        path: the JSON-lines file (created with its folder).
        tensorboard: also write TensorBoard scalars if `torch.utils.tensorboard` imports.
    """

    def __init__(self, path: Path, tensorboard: bool = True) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        self._tb = _tensorboard_writer(self.path.parent) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        self._file.write(json.dumps(clean, sort_keys=True) + "\n")
        self._file.flush()
        if self._tb is not None and "step" in record:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self._tb.add_scalar(f"{record.get('event', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        self._file.close()
        if self._tb is not None:
            self._tb.close()


def _jsonable(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None
    if isinstance(v, (np.floating, np.integer)):
        return v.item()
    if isinstance(v, dict):
        return {k: _jsonable(x) for k, x in v.items()}
    return v


def _tensorboard_writer(folder: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is optional
        return None
    return SummaryWriter(log_dir=str(folder / "tensorboard"))
