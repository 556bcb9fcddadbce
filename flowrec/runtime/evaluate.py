"""Evaluation: score a dataset with a lowered model, batch by batch, into streaming exact metrics
per head (`flowrec.runtime.evalmetrics`): AUC, PR-AUC, logloss, NE, calibration (and gAUC grouped by
a categorical feature) per binary head; MSE and MAE per regression head.

Example:
    >>> metrics = evaluate(model, batches, group_by="user_id")  # doctest: +SKIP
    >>> metrics["ctr"]["gauc"]  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from flowrec.runtime.evalmetrics import BinaryAccumulator, RegressionAccumulator
from flowrec.runtime.lowering import LoweredModel
from flowrec.runtime.step import autocast_context

Metrics = dict[str, dict[str, float]]


class GroupByError(ValueError):
    """The group-by feature is not a one-id categorical feature of the model; one line."""


def group_slot(model: LoweredModel, feature: str) -> tuple[str, int, int]:
    """(packed group, bag position within a sample, bags per sample) of a one-id categorical feature."""
    known = []
    for group in model.groups:
        for field in group.fields:
            known.append(field.feature)
            if field.feature != feature:
                continue
            if field.max_len != 1:
                raise GroupByError(f"cannot group by {feature!r}: it holds up to {field.max_len} ids per "
                                   f"sample; group by a one-id categorical feature")
            return group.name, group.field_bags()[feature].start, group.bags_per_sample
    raise GroupByError(f"cannot group by {feature!r}: not a categorical feature of the model "
                       f"(categorical features: {', '.join(known) or 'none'})")


def batch_groups(batch: Any, slot: tuple[str, int, int]) -> np.ndarray:
    """The encoded id of the group-by feature for every sample of a batch.  # (B,) int64"""
    name, position, width = slot
    ids = batch.groups[name]
    first = ids.offsets[torch.arange(batch.size) * width + position]  # (B,)
    return ids.ids[first].cpu().numpy()


@torch.no_grad()
def predict(model: LoweredModel, batches: Iterable[Any], precision: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """Predictions (probabilities for binary heads, values for regression) and labels.  # (N, T), (N, T)"""
    preds, labels = [], []
    for batch_preds, batch in _scored(model, batches, precision):
        preds.append(batch_preds)
        labels.append(batch.labels.cpu().numpy())
    if not preds:
        return np.zeros((0, len(model.tasks))), np.zeros((0, len(model.tasks)))
    return np.concatenate(preds), np.concatenate(labels)


def _scored(model: LoweredModel, batches: Iterable[Any], precision: str):
    """(predictions (B, T) as numpy, batch) for every batch, in eval mode."""
    was_training = model.training
    model.eval()
    try:
        for batch in batches:
            with torch.no_grad(), autocast_context(model.device, precision):
                out = model(batch).float()  # (B, T)
            for i, task in enumerate(model.tasks):
                if task == "binary":
                    out[:, i] = torch.sigmoid(out[:, i])
            yield out.cpu().numpy(), batch
    finally:
        model.train(was_training)


def evaluate(model: LoweredModel, batches: Iterable[Any], precision: str = "fp32",
             group_by: str | None = None) -> Metrics:
    """Score every batch of `batches` into streaming exact metrics per head.

    Args:
        model: the lowered model.
        batches: staged batches (labels in head order).
        precision: the dense-stage precision.
        group_by: a one-id categorical feature; binary heads then also report gAUC over its values.

    Raises:
        GroupByError: `group_by` is not a one-id categorical feature of the model.
    """
    slot = group_slot(model, group_by) if group_by is not None else None
    accs = [BinaryAccumulator(grouped=slot is not None) if task == "binary" else RegressionAccumulator()
            for task in model.tasks]
    samples = 0
    for preds, batch in _scored(model, batches, precision):
        labels = batch.labels.cpu().numpy()  # (B, T)
        groups = batch_groups(batch, slot) if slot is not None else None
        for i, acc in enumerate(accs):
            acc.update(labels[:, i], preds[:, i], groups)
        samples += preds.shape[0]
    return {head: {**acc.result(), "samples": samples} for head, acc in zip(model.head_names, accs)}
