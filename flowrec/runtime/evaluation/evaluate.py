"""Evaluation: score a dataset with a lowered model, batch by batch, into streaming exact metrics
per head (`flowrec.runtime.evaluation.metrics`): AUC, PR-AUC, logloss, NE, calibration (and gAUC grouped by
a categorical feature) per binary head; MSE and MAE per regression head.

Example:
    >>> metrics = evaluate(model, batches, group_by="user_id")  # doctest: +SKIP
    >>> metrics["ctr"]["gauc"]  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np
import torch

from flowrec.runtime.evaluation.classes import MulticlassAccumulator
from flowrec.runtime.evaluation.metrics import BinaryAccumulator, RegressionAccumulator
from flowrec.runtime.evaluation.retrieval import RankingAccumulator, SeenItems
from flowrec.runtime.lowering import LoweredModel
from flowrec.runtime.modes import eval_mode
from flowrec.runtime.retrieval import catalogue_vectors, item_labels
from flowrec.runtime.evaluation.scores import head_columns, scores
from flowrec.runtime.step import autocast_context
from flowrec.spec.schema_errors import did_you_mean
from flowrec.spec.tasks import TASKS
from operators.custom import forget_outputs, non_finite_note, non_finite_rows

class Metrics(dict):
    """Head -> metric -> value, and `nonfinite`: the custom modules whose outputs held NaN or
    infinity on some evaluation rows, with how many (`operators.custom.non_finite_note`; None:
    none), which the line of a head's NaN scores names (`flowrec.cli.metrics_table.undefined_notes`)."""

    nonfinite: str | None = None


class GroupByError(ValueError):
    """The group-by feature is not a one-id categorical feature of the model; one line."""


NO_GROUP = -1  # batch_groups' value of a row without one: missing or unknown (own_groups)


def group_slot(model: LoweredModel, feature: str) -> tuple[str, int, int, int, bool]:
    """(packed group, bag position within a sample, bags per sample, the first packed row of its
    table, whether the table is managed) of a one-id categorical feature."""
    known = []  # the features it can group by: one-id categorical ones (a multi-hot one cannot)
    managed = getattr(model, "managed", None)
    for group in model.groups:
        for field in group.fields:
            if field.max_len == 1:
                known.append(field.feature)
            if field.feature != feature:
                continue
            if field.max_len != 1:
                raise GroupByError(f"cannot group by {feature!r}: it holds up to {field.max_len} ids per "
                                   f"sample; group by a one-id categorical feature")
            return (group.name, group.field_bags()[feature].start, group.bags_per_sample,
                    int(group.row_offsets[field.table]), managed is not None and field.table in managed.maps)
    raise GroupByError(f"cannot group by {feature!r}: not a categorical feature of the model"
                       f"{did_you_mean(feature, known)} (one-id categorical features: {', '.join(known) or 'none'})")


def batch_groups(batch: Any, slot: tuple[str, int, int, int, bool]) -> np.ndarray:
    """The encoded id of the group-by feature for every sample of a batch: its row of the feature's
    own table, as the dataset holds it (a batch's ids are rows of the packed group, the table's
    rows after the tables packed before it; exclude_seen's training pairs are the dataset's), or
    NO_GROUP where the value is missing or unknown: row 0 of a vocabulary or hashed table, and an
    empty bag of a managed table, whose ids without a row (unknown, not admitted, evicted) are
    dropped from their bags (the bag's first offset is the next bag's id; a managed table's row 0
    is a slot like any other).  # (B,) int64"""
    name, position, width, offset, managed = slot
    ids = batch.groups[name]
    bags = torch.arange(batch.size) * width + position  # (B,)
    first, end = ids.offsets[bags].cpu(), ids.offsets[bags + 1].cpu()
    values = ids.ids.cpu()
    if not len(values):
        return np.full(batch.size, NO_GROUP, np.int64)
    rows = values[first.clamp(max=len(values) - 1)].to(torch.int64) - offset
    none = end == first if managed else rows == 0
    return torch.where(none, torch.full_like(rows, NO_GROUP), rows).numpy()


def own_groups(groups: np.ndarray, before: int) -> tuple[np.ndarray, int]:
    """Groups with each row of NO_GROUP (a missing value, or one the table holds no row for:
    unknown, below min_freq, a managed id not admitted) a group of its own, numbered -1, -2, ...
    after the `before` such rows of earlier batches: they are not one user, so gAUC leaves them out
    (one sample, one class) and a retrieval head ranks each as a user of one row with no training
    items.  # (B,) int64, the count so far"""
    alone = groups == NO_GROUP
    count = int(np.count_nonzero(alone))
    if not count:
        return groups, before
    out = groups.copy()
    out[alone] = -1 - before - np.arange(count)
    return out, before + count


@torch.no_grad()
def predict(model: LoweredModel, batches: Iterable[Any], precision: str = "fp32") -> tuple[np.ndarray, np.ndarray]:
    """Scores (`scores.scores`: one column per head, one per class of a multiclass head) and the label
    columns.  # (N, sum of head widths), (N, T [+ sample weights])"""
    preds, labels = [], []
    for batch_preds, batch in _scored(model, batches, precision):
        preds.append(batch_preds)
        labels.append(batch.labels.cpu().numpy())
    if not preds:
        return np.zeros((0, len(model.tasks))), np.zeros((0, len(model.tasks)))
    return np.concatenate(preds), np.concatenate(labels)


def _scored(model: LoweredModel, batches: Iterable[Any], precision: str,
            customs: dict[str, list[int]] | None = None):
    """(predictions (B, T) as numpy, batch) for every batch, in eval mode; with `customs`, each
    custom module's rows of non-finite output and rows, summed into it (`non_finite_rows`)."""
    with eval_mode(model):
        for batch in batches:
            counting = customs is not None and getattr(model, "custom", False)
            if counting:
                forget_outputs(model)
            with torch.no_grad(), autocast_context(model.device, precision):
                out = scores(model(batch).float(), model.tasks, model.head_widths)  # (B, sum of widths)
            if counting:
                for name, (bad, rows) in non_finite_rows(model).items():
                    tally = customs.setdefault(name, [0, 0])
                    tally[0], tally[1] = tally[0] + bad, tally[1] + rows
            yield out.cpu().numpy(), batch


def evaluate(model: LoweredModel, batches: Iterable[Any], precision: str = "fp32",
             group_by: str | None = None, seen: SeenItems | None = None) -> Metrics:
    """Score every batch of `batches` into streaming exact metrics per head.

    Args:
        model: the lowered model.
        batches: staged batches (labels in head order).
        precision: the dense-stage precision.
        group_by: a one-id categorical feature; binary heads then also report gAUC over its values
            (retrieval heads: per-user recall and NDCG).
        seen: the (user, item) pairs of the training data, for a retrieval head with exclude_seen.

    Raises:
        GroupByError: `group_by` is not a one-id categorical feature of the model.
    """
    slot = group_slot(model, group_by) if group_by is not None else None
    if seen is not None and slot is not None and slot[4]:
        seen = _seen_in_rows(model, group_by, seen)
    accs = [ACCUMULATORS[task](model, i, slot is not None, *([seen] if TASKS[task].ranks else []))
            for i, task in enumerate(model.tasks)]
    samples = [0] * len(accs)
    columns = head_columns(model.head_widths)
    alone = 0  # rows so far without a group-by value (NO_GROUP), each a group of its own
    customs: dict[str, list[int]] = {}  # custom module -> [rows of non-finite output, rows]
    for preds, batch in _scored(model, batches, precision, customs):
        labels = item_labels(model.retrieval, batch, batch.labels).cpu().numpy()  # (B, T [+ sample weights])
        groups = batch_groups(batch, slot) if slot is not None else None
        if groups is not None:
            groups, alone = own_groups(groups, alone)
        for i, acc in enumerate(accs):
            rows = _task_space(model, labels, i)
            head_preds = preds[:, columns[i]] if model.head_widths[i] > 1 else preds[:, columns[i].start]
            acc.update(labels[rows, i], head_preds[rows], groups[rows] if groups is not None else None)
            samples[i] += int(np.count_nonzero(rows))
    metrics = Metrics({head: {**acc.result(), "samples": n} for head, acc, n in zip(model.head_names, accs, samples)})
    metrics.nonfinite = non_finite_note({name: (bad, rows) for name, (bad, rows) in customs.items()})
    return metrics


def _seen_in_rows(model: LoweredModel, feature: str, seen: SeenItems) -> SeenItems:
    """The training pairs of a managed user feature with the users' rows as the model holds them now
    (the dataset holds raw ids, a batch the rows they map to; a user without a row is left out, as
    their evaluation rows are each a group of their own)."""
    table = next(f.table for g in model.groups for f in g.fields if f.feature == feature)
    managed = model.managed
    managed.sync()
    lookup = managed.maps[table].lookup
    if managed.owners:  # a rank's map holds the rows of its own shards only: the others' from their owners
        lookup = _owners_lookup(lookup, managed.world)
    return seen.through(lookup)


def _owners_lookup(lookup: Any, world: Any) -> Any:
    """`lookup` (raw ids -> rows; NO_ROW for ids of shards this rank does not own) answered for every
    shard: each rank's rows of the ids it owns, gathered from every rank (a collective: every rank
    calls it, as every rank evaluates). Without it, the training pairs of users on the other ranks'
    shards were left out, and exclude_seen excluded nothing for them."""
    import torch.distributed as dist

    from flowrec.data.managed import NO_ROW

    def rows(ids: np.ndarray) -> np.ndarray:
        unique = np.unique(np.asarray(ids, np.int64))
        mine = np.asarray(lookup(unique), np.int64)
        held = mine != NO_ROW
        found: list[Any] = [None] * world.size
        dist.all_gather_object(found, (unique[held], mine[held]))
        known = np.concatenate([f[0] for f in found])
        at = np.argsort(known, kind="stable")
        known, known_rows = known[at], np.concatenate([f[1] for f in found])[at]
        out = np.full(len(ids), NO_ROW, np.int64)
        if len(known):
            where = np.clip(np.searchsorted(known, ids), 0, len(known) - 1)
            hit = known[where] == ids
            out[hit] = known_rows[where[hit]]
        return out

    return rows


def _task_space(model: LoweredModel, labels: np.ndarray, head: int) -> np.ndarray:
    """Rows of a batch in head `head`'s task space (`trained_where`; every row without one).  # (B,) bool"""
    column, value = model.loss.masks[head]
    return labels[:, column] == value if column >= 0 else np.ones(labels.shape[0], bool)


def _ranking(model: LoweredModel, head: int, seen: SeenItems | None) -> RankingAccumulator:
    """A retrieval head's metrics over the catalogue of its item tower, as the model is now
    (`seen`: the training items left out of each user's ranking, for a head with exclude_seen)."""
    binding = model.retrieval
    attrs = binding.attrs
    if attrs.get("exclude_seen") and seen is None:
        raise ValueError(f"head {model.head_names[head]} excludes each user's training items: give the training "
                         "data (flowrec eval --seen DIR; Run.evaluate(seen=DIR))")
    return RankingAccumulator(catalogue_vectors(model, binding), attrs["metric"], attrs["temperature"],
                              tuple(attrs["top_k"]), seen if attrs.get("exclude_seen") else None, binding.named)


# The streaming metrics of each task (arguments: the model, the head's index, grouped: gAUC of
# binary heads, per-user recall and NDCG of retrieval heads).
ACCUMULATORS = {
    "binary": lambda model, head, grouped: BinaryAccumulator(grouped=grouped),
    "regression": lambda model, head, grouped: RegressionAccumulator(),
    "multiclass": lambda model, head, grouped: MulticlassAccumulator(),
    "retrieval": lambda model, head, grouped, seen=None: _ranking(model, head, seen),
}
