"""Labels of raw input rows: what each head accepts, and the libsvm/libfm -1/+1 convention.

A binary head trains on labels that are exactly 0 or 1; a multiclass head of N classes on class
indices 0 .. N-1 (whole numbers); a regression head on finite numbers; a sample-weight column holds
finite numbers >= 0. Any other value (2, 7, 0.5, -1 as a weight, nan, inf, a missing label) makes
its row malformed: reported with its line
number and skipped or fatal by the ``--on-error`` policy. A head with a task space
(`trained_where`) never reads its label or sample weight on a row outside it: there any value,
a missing one included, is kept as 0 (`label_spaces`), so an ESMM conversion head whose label is
empty on the rows not clicked converts every row. libsvm and libfm files often write the
classes as -1/+1: for those formats -1 is read as 0 (+1 is 1 already) and the rewritten labels are
counted in the conversion report.

Example:
    >>> import pyarrow as pa
    >>> from flowrec.data.error_log import ErrorLog
    >>> raw = pa.table({"label": [1.0, -1.0], LINE_COLUMN: [1, 2]})
    >>> table, mapped = check_labels(raw, {"label": "binary"}, ErrorLog("fail"), plus_minus=True)
    >>> table.column("label").to_pylist(), mapped
    ([1.0, 0.0], 1)
"""
from __future__ import annotations

import numpy as np
import pyarrow as pa

from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import label_columns, weight_columns
from flowrec.data.sources import LINE_COLUMN
from flowrec.spec.model import ModelSpec

PLUS_MINUS_FORMATS = ("libsvm",)  # formats whose binary labels may be written -1/+1


def label_tasks(spec: ModelSpec, columns: dict[str, str]) -> dict[str, str]:
    """Source label column -> "binary" (any binary head reads it), else "multiclass:N" (the
    fewest classes of the multiclass heads reading it), else "weight" (a head's sample weights),
    else "regression"."""
    tasks: dict[str, str] = {}
    for head, label in zip(spec.heads, label_columns(spec)):
        source = columns.get(label, label)
        tasks[source] = _stricter(tasks.get(source, "regression"), _task(head))
    for weight in weight_columns(spec):
        source = columns.get(weight, weight)
        tasks[source] = _stricter(tasks.get(source, "regression"), "weight")
    return tasks


NEGATIVE_WORDS = ("no", "n", "false", "f", "neg", "negative", "0", "noclick", "not")  # mapped to 0 in the example


def text_label_line(column: str, values: list[str], task: str, before: str = "converting") -> str:
    """One line for a label column (`label_tasks`' source column and task) whose values are
    mostly text (`flowrec.data.sources.TextColumn`): what it must hold and how to map it before
    converting, with no hint to skip such rows (skipping them drops most rows).

    >>> text_label_line("clk", ["no", "yes"], "binary")
    "label column clk holds text ('no', 'yes'), not numbers: a binary head's label must be 0 or 1; map it before converting, e.g. in pandas: df['clk'] = df['clk'].map({'no': 0, 'yes': 1})"
    """
    words = sorted(values, key=lambda v: (v.lower() not in NEGATIVE_WORDS, v))
    example = ", ".join(f"{v!r}: {i}" for i, v in enumerate(words[:3]))
    must = {"binary": "a binary head's label must be 0 or 1",
            "weight": "a sample weight must be a number >= 0",
            "regression": "a regression head's label must be a number"}.get(task)
    if must is None:  # multiclass:N
        must = f"a multiclass head's label must be a class number 0 .. {int(task.split(':')[1]) - 1}"
    mapped = (f"; map it before {before}, e.g. in pandas: df[{column!r}] = df[{column!r}].map({{{example}}})"
              if task.startswith(("binary", "multiclass")) else "")
    return f"label column {column} holds text ({', '.join(repr(v) for v in values)}), not numbers: {must}{mapped}"


def _task(head) -> str:
    return f"multiclass:{head.num_classes}" if head.task == "multiclass" else head.task


def _stricter(a: str, b: str) -> str:
    """The rule a label read by heads of both tasks must obey (binary labels are class indices too)."""
    if "binary" in (a, b):
        return "binary"
    classes = [int(t.split(":")[1]) for t in (a, b) if t.startswith("multiclass:")]
    if classes:
        return f"multiclass:{min(classes)}"
    return "weight" if "weight" in (a, b) else "regression"


def label_spaces(spec: ModelSpec, columns: dict[str, str]) -> dict[str, tuple[tuple[str, float], ...]]:
    """Source label or sample-weight column -> the task spaces ((source column, value), ...) of the
    heads reading it, for a column that only heads with a task space read: a row outside all of
    them is read by no loss or metric. A column some head reads on every row, or whose values
    decide a task space, is left out."""
    readers: dict[str, list] = {}
    for head, label in zip(spec.heads, label_columns(spec)):
        readers.setdefault(columns.get(label, label), []).append(head.trained_where)
        if head.sample_weight is not None:
            readers.setdefault(columns.get(head.sample_weight, head.sample_weight), []).append(head.trained_where)
    deciding = {columns.get(h.trained_where.label, h.trained_where.label) for h in spec.heads
                if h.trained_where is not None}
    return {column: tuple(dict.fromkeys((columns.get(w.label, w.label), float(w.equals)) for w in spaces))
            for column, spaces in readers.items()
            if column not in deciding and all(w is not None for w in spaces)}


def label_features(spec: ModelSpec, columns: dict[str, str]) -> list[str]:
    """A warning line per feature that reads a head's label (or sample-weight) column: the model is
    given the answer it is to predict (a data.columns entry mapped to the wrong column), trains to
    a loss near 0 and scores nothing it was not told.

    >>> from flowrec.testing.specs import csv_spec
    >>> print(label_features(csv_spec("leak"), {"user": "clicked"})[0])
    feature user reads column 'clicked', the label of head ctr: the model is given the answer it is to predict; map feature user to another column (data.columns)
    """
    readers: dict[str, list[str]] = {}
    for head, label in zip(spec.heads, label_columns(spec)):
        readers.setdefault(columns.get(label, label), []).append(f"the label of head {head.name}")
    for head in spec.heads:
        if head.sample_weight is not None:
            source = columns.get(head.sample_weight, head.sample_weight)
            readers.setdefault(source, []).append(f"the sample weight of head {head.name}")
    return [f"feature {f.name} reads column {columns.get(f.name, f.name)!r}, "
            f"{' and '.join(dict.fromkeys(readers[columns.get(f.name, f.name)]))}: the model is given the answer it is "
            f"to predict; map feature {f.name} to another column (data.columns)"
            for f in spec.features if columns.get(f.name, f.name) in readers]


MINUS_ONE = ("; labels written -1/+1? only libsvm and libfm read -1 as 0: write the negatives as 0 (skipping "
             "these rows would drop the class)")


def one_based(classes: int, column: str = "label") -> str:
    """What a multiclass label equal to `classes` (one past the last index) of `column` most likely
    means: relabelling first; num_classes + 1 trains too, but with a class no row holds, which the
    evaluation's accuracy_at_k then warns says little (`top_k_covers_classes`).

    >>> one_based(5, "stars")
    "; classes numbered 1 .. 5? a class index counts from 0: write each label less 1 (0 .. 4; e.g. in pandas: df['stars'] = df['stars'] - 1); num_classes: 6 would read them as they are, at a cost: a class 0 that no row holds, an output the model only learns to rank last, so accuracy_at_k with k >= 5 finds every label in the top k and says little (skipping these rows would drop the class)"
    """
    return (f"; classes numbered 1 .. {classes}? a class index counts from 0: write each label less 1 (0 .. "
            f"{classes - 1}; e.g. in pandas: df[{column!r}] = df[{column!r}] - 1); num_classes: {classes + 1} would "
            "read them as they are, at a cost: a class 0 that no row holds, an output the model only learns to rank "
            f"last, so accuracy_at_k with k >= {classes} finds every label in the top k and says little (skipping "
            "these rows would drop the class)")


COUNTED_SHARE = 0.1  # whole numbers past 1 in this share of a chunk's binary labels or more: ratings or counts,
# not a stray value (which `--on-error skip` may well skip)


def not_binary(column: str) -> str:
    """What a binary label of a whole number past 1 (a rating, a count) most likely means: a column
    that is not 0/1 at all, whose rows `--on-error skip` would drop, most of them.

    >>> not_binary("rating")
    "; ratings or counts? a binary head reads 0 or 1 only: make a 0/1 column of them (e.g. in pandas: df['liked'] = (df['rating'] >= 4).astype(int)) and name it as the head's label, or give the head task: regression (or task: multiclass) to predict the values themselves (skipping these rows would drop most of them)"
    """
    return (f"; ratings or counts? a binary head reads 0 or 1 only: make a 0/1 column of them (e.g. in pandas: "
            f"df['liked'] = (df[{column!r}] >= 4).astype(int)) and name it as the head's label, or give the head "
            "task: regression (or task: multiclass) to predict the values themselves (skipping these rows would "
            "drop most of them)")


def check_labels(table: pa.Table, tasks: dict[str, str], log: ErrorLog,
                 plus_minus: bool, spaces: dict[str, tuple[tuple[str, float], ...]] | None = None
                 ) -> tuple[pa.Table, int]:
    """A raw chunk without rows whose label its head cannot take, and how many -1 became 0.

    Args:
        table: raw chunk with the label columns (float64, null = missing) and `LINE_COLUMN`.
        tasks: `label_tasks` of the spec.
        log: malformed rows go here (raises DataError under the "fail" policy).
        plus_minus: read -1 as 0 for binary labels (libsvm / libfm).
        spaces: `label_spaces` of the spec: on a row outside every task space of its column, a
            value its head could not take is no error and is kept as 0.
    """
    lines = table.column(LINE_COLUMN).to_numpy()
    bad = np.zeros(table.num_rows, bool)
    minus: dict[str, np.ndarray] = {}
    unread: dict[str, np.ndarray] = {}
    for name, task in tasks.items():
        y = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
        if task == "binary":
            minus[name] = (y == -1) if plus_minus else np.zeros(len(y), bool)
            ok = (y == 0) | (y == 1) | minus[name]
            allowed = "0 or 1 (or -1/+1)" if plus_minus else "0 or 1"
            reason = f"not {allowed} for a binary head"
            with np.errstate(invalid="ignore"):
                whole_past_one = np.isfinite(y) & (y >= 2) & (y == np.floor(y))
            many_past_one = whole_past_one.sum() >= COUNTED_SHARE * max(1, np.isfinite(y).sum())
        elif task.startswith("multiclass:"):
            classes = int(task.split(":")[1])
            ok = (y >= 0) & (y < classes) & (y == np.floor(y))
            reason = f"not a class index 0 .. {classes - 1} for a multiclass head"
        elif task == "weight":
            ok = np.isfinite(y) & (y >= 0)
            reason = "not a finite number >= 0 for a sample weight"
        else:
            ok = np.isfinite(y)
            reason = "not a finite number for a regression head"
        if spaces and name in spaces:
            outside = _outside(table, spaces[name], tasks, plus_minus)
            unread[name] = outside & ~ok
            ok = ok | outside
        for i in np.flatnonzero(~ok & ~bad):
            bad[i] = True
            missing = table.column(name)[i].as_py() is None
            what = "sample weight" if task == "weight" else "label"
            minus_one = task == "binary" and y[i] == -1  # not plus_minus: a -1/+1 file, whose -1 rows skip would drop
            past_last = task.startswith("multiclass:") and y[i] == int(task.split(":")[1])  # 1-based classes
            counted = task == "binary" and whole_past_one[i] and many_past_one  # ratings 1-5, not a stray 2
            hint = MINUS_ONE if minus_one else one_based(int(task.split(":")[1]), name) if past_last else \
                not_binary(name) if counted else ""
            log.add(int(lines[i]), f"missing {what} in column {name}" if missing else
                    f"{what} {float(y[i])!r} in column {name}: {reason}{hint}", skippable=not hint)
    mapped = sum(int(np.count_nonzero(is_minus & ~bad)) for is_minus in minus.values())
    none = np.zeros(table.num_rows, bool)
    for name in dict.fromkeys([*minus, *unread]):
        zero = minus.get(name, none) | unread.get(name, none)  # -1 read as 0, a value no head reads
        if zero.any():
            y = table.column(name).to_numpy(zero_copy_only=False).astype(np.float64)
            column = pa.array(np.where(zero, 0.0, y), pa.float64())
            table = table.set_column(table.column_names.index(name), name, column)
    return (table.filter(pa.array(~bad)) if bad.any() else table), mapped


def _outside(table: pa.Table, spaces: tuple[tuple[str, float], ...], tasks: dict[str, str],
             plus_minus: bool) -> np.ndarray:
    """Rows outside every one of the task spaces (a row whose deciding value is itself not
    valid is malformed by that column's own check).  # (rows,) bool"""
    outside = np.ones(table.num_rows, bool)
    for column, equals in spaces:
        y = table.column(column).to_numpy(zero_copy_only=False).astype(np.float64)
        if plus_minus and tasks.get(column) == "binary":
            y = np.where(y == -1, 0.0, y)
        outside &= y != equals
    return outside
