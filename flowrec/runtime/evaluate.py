"""Evaluation: score a dataset with a lowered model; exact AUC / logloss per binary head, MSE per
regression head.

Example:
    >>> metrics = evaluate(model, batches)  # doctest: +SKIP
    >>> metrics["ctr"]["auc"]  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from flowrec.runtime.lowering import LoweredModel
from flowrec.runtime.metrics import auc, logloss, mse
from flowrec.runtime.step import autocast_context


@torch.no_grad()
def predict(model: LoweredModel, batches: Iterable[Any], precision: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """Predictions (probabilities for binary heads, values for regression) and labels.  # (N, T), (N, T)"""
    was_training = model.training
    model.eval()
    preds, labels = [], []
    try:
        for batch in batches:
            with autocast_context(model.device, precision):
                logits = model(batch).float()  # (B, T)
            for i, task in enumerate(model.tasks):
                if task == "binary":
                    logits[:, i] = torch.sigmoid(logits[:, i])
            preds.append(logits.cpu().numpy())
            labels.append(batch.labels.cpu().numpy())
    finally:
        model.train(was_training)
    if not preds:
        return np.zeros((0, len(model.tasks))), np.zeros((0, len(model.tasks)))
    return np.concatenate(preds), np.concatenate(labels)


def score(model: LoweredModel, preds: np.ndarray, labels: np.ndarray) -> dict[str, dict[str, float]]:
    """Metrics per head from predictions and labels."""
    out: dict[str, dict[str, float]] = {}
    for i, (head, task) in enumerate(zip(model.head_names, model.tasks)):
        if task == "binary":
            out[head] = {"auc": auc(labels[:, i], preds[:, i]), "logloss": logloss(labels[:, i], preds[:, i])}
        else:
            out[head] = {"mse": mse(labels[:, i], preds[:, i])}
        out[head]["samples"] = int(preds.shape[0])
    return out


def evaluate(model: LoweredModel, batches: Iterable[Any], precision: str = "fp32") -> dict[str, dict[str, float]]:
    """Score every batch of `batches`; metrics per head."""
    preds, labels = predict(model, batches, precision)
    return score(model, preds, labels)
