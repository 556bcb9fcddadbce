"""Evaluation metrics (exact AUC, logloss) and the JSON-lines metrics log.

Example:
    >>> import numpy as np
    >>> auc(np.array([0, 0, 1, 1]), np.array([0.1, 0.4, 0.35, 0.8]))
    0.75
"""
from __future__ import annotations

import errno
import json
import math
import os
from pathlib import Path
from typing import Any

import numpy as np

from flowrec.runtime.atomic import atomic_write

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


class MetricsError(OSError):
    """metrics.jsonl cannot be written (disk full, permissions); the message is one line."""


class MetricsLog:
    """Appends one JSON object per line to `metrics.jsonl`, and to TensorBoard when installed.

    Each record is one `write` of a whole line; if it fails (disk full), the file is cut back to
    its last complete line, so the log is never torn.

    Args:
        path: the JSON-lines file (its folder must exist).
        tensorboard: also write TensorBoard scalars if `torch.utils.tensorboard` imports.
        keep_through_step: first drop every record of a later step (and any torn line), atomically
            (a resumed run logs the steps after its checkpoint again, so each step stays once).
    """

    def __init__(self, path: Path, tensorboard: bool = True, keep_through_step: int | None = None) -> None:
        self.path = Path(path)
        if keep_through_step is not None:
            trim_metrics(self.path, keep_through_step)
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as exc:
            raise MetricsError(f"cannot write {self.path}: {exc.strerror}") from None
        self._tb = _tensorboard_writer(self.path.parent) if tensorboard else None

    def write(self, record: dict[str, Any]) -> None:
        clean = {k: _jsonable(v) for k, v in record.items()}
        _append_line(self._fd, self.path, (json.dumps(clean, sort_keys=True) + "\n").encode())
        if self._tb is not None and "step" in record:
            for key, value in clean.items():
                if isinstance(value, (int, float)) and key != "step" and value is not None:
                    self._tb.add_scalar(f"{record.get('event', 'train')}/{key}", value, record["step"])

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
        if self._tb is not None:
            self._tb.close()


def _append_line(fd: int, path: Path, line: bytes) -> None:
    """Append `line` whole, or cut the file back to where it was and raise MetricsError."""
    size = os.fstat(fd).st_size
    try:
        written = os.write(fd, line)
        if written != len(line):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    except OSError as exc:
        try:
            os.ftruncate(fd, size)
        except OSError:
            pass
        raise MetricsError(f"cannot write {path}: {exc.strerror or exc}") from None


def read_records(path: Path) -> list[dict[str, Any]]:
    """The complete records of a metrics log (a torn last line is skipped)."""
    if not Path(path).is_file():
        return []
    records = []
    for line in Path(path).read_bytes().split(b"\n"):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if isinstance(record, dict):
            records.append(record)
    return records


def trim_metrics(path: Path, step: int) -> None:
    """Keep the records up to `step` (each step once after a resume): new file, then rename."""
    path = Path(path)
    if not path.is_file():
        return
    kept = [r for r in read_records(path) if isinstance(r.get("step"), int) and r["step"] <= step]
    text = "".join(json.dumps(r, sort_keys=True) + "\n" for r in kept)
    try:
        atomic_write(path, text.encode())
    except OSError as exc:
        raise MetricsError(f"cannot rewrite {path}: {exc.strerror or exc}") from None


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
