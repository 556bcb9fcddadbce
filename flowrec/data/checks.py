"""Checks of encoded partitions as they are read: ids inside their tables, finite values, labels.

A Parquet dataset may come from another tool or be written by hand, so nothing in it is trusted:
every partition is checked before any of its rows is batched. An id outside ``[0, rows)`` of its
table would otherwise land in the neighbouring table of its packed group (packed id = row + the
table's row offset); a NaN or inf in a dense or label column trains to a NaN loss; a label other
than 0 or 1 under a binary head trains without a word.

Each check is one vectorised pass over each chunk of a column, without copies (the maximum of the
ids read as unsigned, so negatives count as huge; a float32 sum for finiteness, NaN and inf
propagating; two compares for binary labels); only when it fails is the column scanned again,
exactly, to find the first bad row. The error names the partition, the column and
that row (0-based within the partition).

Example:
    >>> import pyarrow as pa
    >>> rules = (ColumnRule("c", "ids", rows=10, table="t"),)
    >>> check_partition(pa.table({"c": [1, 12]}), rules, "part-0")
    Traceback (most recent call last):
    flowrec.data.layout.DataError: part-0: column 'c': id 12 outside [0, 10) of table 't' at row 1 (0-based)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.layout import DataError, is_multi, label_columns, weight_columns
from flowrec.spec.model import ModelSpec

RuleKind = Literal["ids", "finite", "binary", "classes", "weight"]
FLOAT32_MAX = float(np.finfo(np.float32).max)  # larger values become inf in a batch


@dataclass(frozen=True)
class ColumnRule:
    """What one column of a partition must hold.

    Args:
        name: column name.
        kind: "ids" (integers in [0, rows), any integer when rows is 0), "finite" (dense features,
            regression labels), "binary" (labels of binary heads: exactly 0 or 1) or "classes"
            (labels of multiclass heads: whole numbers in [0, rows)) or "weight" (sample weights:
            finite numbers >= 0, as conversion takes them; a negative weight flipped its row's loss).
        rows: rows of the table (ids; 0: raw ids of a managed table, any int64), classes of the
            head (classes).
        table: the table's name (ids only), or the heads reading the label (binary, classes) or
            weighted by the column (weight), for messages.
        one: ids only: the feature takes one id per row (one-hot), so a list column must hold lists
            of one id (read as a bag, its rows of two ids trained summed and its empty lists as no
            id, without a word).
    """

    name: str
    kind: RuleKind
    rows: int = 0
    table: str = ""
    one: bool = False


def partition_rules(spec: ModelSpec, columns: Sequence[str] | None = None) -> tuple[ColumnRule, ...]:
    """The rules of the spec's columns (all, or those in `columns`), in spec order."""
    rules = [ColumnRule(f.name, "ids", _id_bound(spec, f.table), f.table, one=not is_multi(f))
             for f in spec.sparse_features]
    rules += [ColumnRule(f.name, "finite") for f in spec.dense_features]
    binary: dict[str, list[str]] = {}
    classes: dict[str, list[tuple[int, str]]] = {}
    for head, label in zip(spec.heads, label_columns(spec)):
        binary.setdefault(label, [])
        if head.task == "binary":
            binary[label].append(head.name)
        elif head.task == "multiclass":
            classes.setdefault(label, []).append((head.num_classes, head.name))
    rules += [_label_rule(label, heads, classes.get(label, [])) for label, heads in binary.items()]
    rules += [ColumnRule(w, "weight", table=", ".join(h.name for h in spec.heads if h.sample_weight == w))
              for w in weight_columns(spec) if w not in binary]
    keep = None if columns is None else set(columns)
    return tuple(r for r in rules if keep is None or r.name in keep)


def _label_rule(label: str, binary_heads: list[str], class_heads: list[tuple[int, str]]) -> ColumnRule:
    """The strictest rule of the heads reading `label`: binary, else class indices, else finite."""
    if binary_heads:
        return ColumnRule(label, "binary", table=", ".join(binary_heads))
    if class_heads:
        return ColumnRule(label, "classes", rows=min(n for n, _ in class_heads),
                          table=", ".join(name for _, name in class_heads))
    return ColumnRule(label, "finite")


def _id_bound(spec: ModelSpec, table: str) -> int:
    """Ids of a table are in [0, rows); a managed table's column holds raw-id hashes: any int64 (0)."""
    t = spec.table(table)
    return 0 if t.managed is not None else t.rows


def check_partition(table: pa.Table, rules: Sequence[ColumnRule], where: str, first_row: int = 0) -> None:
    """Raise DataError naming `where`, the column and the first bad row if a rule is broken.

    Args:
        table: rows of a partition (all of them, or some of its row groups).
        rules: what to check.
        where: how messages name the partition.
        first_row: the partition row of the table's first row (rows are named within the partition).
    """
    names = table.column_names
    present = set(names)
    for rule in rules:
        if rule.name not in present:
            raise DataError(f"{where}: column {rule.name!r} missing (has {names[:12]})")
        col = table.column(rule.name)
        if _passes(col, rule):
            continue
        array = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
        prefix = f"{where}: column {rule.name!r}"
        if rule.kind == "ids":
            _check_ids(array, rule, prefix, first_row)
        else:
            _check_numbers(array, rule, prefix, first_row)


def _passes(col: pa.ChunkedArray, rule: ColumnRule) -> bool:
    """One pass per chunk, no copies: True when the column certainly obeys the rule (False sends
    it to the exact check, which finds the bad row, or passes it: a float32 sum may overflow)."""
    if col.null_count:
        return False
    for chunk in col.chunks:
        if rule.kind == "ids" and (pa.types.is_list(chunk.type) or pa.types.is_large_list(chunk.type)):
            if rule.one and (chunk.null_count or _lengths_not_one(chunk) is not None):
                return False
            chunk = pc.list_flatten(chunk)
        if chunk.null_count:
            return False
        if not len(chunk):
            continue
        if not pa.types.is_integer(chunk.type) and (rule.kind == "ids" or not pa.types.is_floating(chunk.type)):
            return False
        x = chunk.to_numpy()
        if rule.kind == "ids" and rule.rows:
            unsigned = x.view(f"u{x.itemsize}") if x.dtype.kind == "i" else x  # negatives become huge
            if unsigned.max() >= rule.rows:
                return False
        elif rule.kind == "binary":
            if np.count_nonzero((x != 0) & (x != 1)):
                return False
        elif rule.kind == "classes":
            if np.count_nonzero(~_class_index(x, rule.rows)):
                return False
        elif x.dtype != np.float32 or (rule.kind == "weight" and not x.min() >= 0):
            return False
        else:
            with np.errstate(invalid="ignore", over="ignore"):
                if not np.isfinite(np.add.reduce(x)):
                    return False
    return True


def _nulls(array: pa.Array) -> np.ndarray:
    return array.is_null().to_numpy(zero_copy_only=False)


def _check_ids(array: pa.Array, rule: ColumnRule, prefix: str, first_row: int) -> None:
    listed = pa.types.is_list(array.type) or pa.types.is_large_list(array.type)
    if listed and rule.one and not array.null_count:
        row = _lengths_not_one(array)
        if row is not None:
            n = len(array[row].values)
            raise DataError(f"{prefix}: {n} ids at row {row + first_row} (0-based), where the spec's feature "
                            "takes one id per row (int64 row ids, or lists of one; max_len > 1 makes it multi-hot)")
    values = pc.list_flatten(array) if listed else array
    if not pa.types.is_integer(values.type):
        raise DataError(f"{prefix}: type {array.type}, expected int64 row ids (or a list of them)")
    if not array.null_count and not values.null_count:
        low_high = pc.min_max(values)
        if not len(values) or not rule.rows or (low_high["min"].as_py() >= 0 and low_high["max"].as_py() < rule.rows):
            return
    null_value = _nulls(values)
    x = values.fill_null(0).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(null_value | (((x < 0) | (x >= rule.rows)) if rule.rows else False))
    row = _row(array, int(bad[0]), listed) if len(bad) else len(array)
    null_rows = np.flatnonzero(_nulls(array)) if listed else np.zeros(0, np.int64)
    if len(null_rows) and null_rows[0] < row:
        raise DataError(f"{prefix}: null list at row {null_rows[0] + first_row} (0-based); "
                        "a sample without ids is an empty list")
    i = int(bad[0])
    if null_value[i]:
        raise DataError(f"{prefix}: null id at row {row + first_row} (0-based); a missing value is row 0")
    raise DataError(f"{prefix}: id {int(x[i])} outside [0, {rule.rows}) of table {rule.table!r} "
                    f"at row {row + first_row} (0-based)")


def _lengths_not_one(array: pa.Array) -> int | None:
    """The first row of a list column whose list holds other than one id (None: every one does)."""
    lengths = pc.list_value_length(array).fill_null(1).to_numpy(zero_copy_only=False)
    bad = np.flatnonzero(lengths != 1)
    return int(bad[0]) if len(bad) else None


def _row(array: pa.Array, value_index: int, listed: bool) -> int:
    """The row holding the `value_index`-th flattened value of a (list) column."""
    if not listed:
        return value_index
    offsets = array.offsets.to_numpy() - array.offsets[0].as_py()
    return int(np.searchsorted(offsets, value_index, side="right")) - 1


def _check_numbers(array: pa.Array, rule: ColumnRule, prefix: str, first_row: int) -> None:
    if not (pa.types.is_floating(array.type) or pa.types.is_integer(array.type)):
        raise DataError(f"{prefix}: type {array.type}, expected float32 values")
    x = array.to_numpy(zero_copy_only=False)  # nulls read as nan
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf in the sum; nan compares
        if rule.kind == "binary":
            bad = np.flatnonzero((x != 0) & (x != 1))
        elif rule.kind == "classes":
            bad = np.flatnonzero(~_class_index(x, rule.rows))
        elif rule.kind == "weight":
            bad = np.flatnonzero(~((x >= 0) & (np.abs(x.astype(np.float64, copy=False)) <= FLOAT32_MAX)))
        elif not array.null_count and x.dtype == np.float32 and np.isfinite(np.add.reduce(x, dtype=np.float64)):
            return
        else:
            bad = np.flatnonzero(~(np.abs(x.astype(np.float64, copy=False)) <= FLOAT32_MAX))
    if not len(bad):
        return
    i = int(bad[0])
    row = i + first_row
    if array.null_count and _nulls(array)[i]:
        raise DataError(f"{prefix}: null value at row {row} (0-based); missing values are filled at conversion")
    if rule.kind == "binary":
        raise DataError(f"{prefix}: label {float(x[i])!r} at row {row} (0-based) is not 0 or 1 "
                        f"(binary head {rule.table}); convert -1/+1 labels with `flowrec data convert`")
    if rule.kind == "classes":
        raise DataError(f"{prefix}: label {float(x[i])!r} at row {row} (0-based) is not a class index "
                        f"0 .. {rule.rows - 1} (multiclass head {rule.table})")
    if rule.kind == "weight" and x[i] < 0:
        raise DataError(f"{prefix}: sample weight {float(x[i])!r} at row {row} (0-based) is negative (head "
                        f"{rule.table}); sample weights must be finite numbers >= 0")
    problem = "value beyond float32" if np.isfinite(x[i]) else "non-finite value"
    raise DataError(f"{prefix}: {problem} {float(x[i])!r} at row {row} (0-based); "
                    "dense and label values must be finite float32")


def _class_index(x: np.ndarray, classes: int) -> np.ndarray:
    """Which values are whole numbers in [0, classes) (NaN is not)."""
    with np.errstate(invalid="ignore"):
        return (x >= 0) & (x < classes) & (x == np.floor(x))
