"""Columns of raw rows that hold no value: a feature column empty in every row of an input (a
mistyped or lost column, an export that dropped it) converts to the missing id (or the dense
fill) in every row, so a model would train on nothing from it; so does one that holds one value in
every row (an export that filled a column, a file whose every row is one row repeated); a label
column empty in every row read would make each row malformed, with advice to skip them all.

A value is empty when it is null, text of blanks only, a float NaN or an empty list.

Example:
    >>> import pyarrow as pa
    >>> from flowrec.testing.specs import csv_spec
    >>> spec = csv_spec("e")
    >>> seen = EmptyColumns(spec, {})
    >>> seen.observe("a.csv", pa.table({"price": [1.5, None], "user": [None, " "], "clicked": [0.0, 1.0]}))
    >>> print(seen.lines()[0])
    a.csv: column 'user' (feature user) is empty in every one of its 2 rows: every row encodes it as the missing id (row 0) or an id of blank text; a mistyped or lost column? (data.columns maps features to columns)
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.layout import DataError, is_multi, label_columns
from flowrec.spec.model import ModelSpec
from flowrec.spec.units import counted

MAP_HINT = "a mistyped or lost column? (data.columns maps features to columns)"
MIN_ROWS = 2  # rows an input gives before its columns are judged (one row's missing label is said by its line)
ONE, VARIED = object(), object()  # a feature no row of an input has shown yet; one that holds two values


def filled_rows(column: pa.ChunkedArray | pa.Array, blank: bool = True) -> int:
    """The rows of `column` that hold a value (not null, empty or blank text (with `blank`; else
    only empty text), NaN or an empty list).

    >>> filled_rows(pa.array(["a", " ", None, ""])), filled_rows(pa.array(["a", " ", None, ""]), blank=False)
    (1, 2)
    >>> filled_rows(pa.array([1.0, float("nan")])), filled_rows(pa.array([[1], [], None]))
    (1, 1)
    """
    return filled_counts([column], blank)[0]


def filled_counts(columns: list[pa.ChunkedArray | pa.Array], blank: bool = True) -> list[int]:
    """`filled_rows` of each of `columns`, in one pass per type over the columns of that type put
    end to end (a text or float column of a 1,000-field model's rows took four Arrow calls of its
    own: 55 ms per call of predict on one row).

    >>> filled_counts([pa.array(["a", " "]), pa.array([None, "b"]), pa.array([1, None]), pa.array([" "])])
    [1, 1, 1, 0]
    """
    columns, counts = list(columns), [0] * len(columns)
    alike: dict[pa.DataType, list[int]] = {}  # columns of one type whose values are judged together
    for i, column in enumerate(columns):
        kind = column.type
        if pa.types.is_dictionary(kind):
            column = columns[i] = column.cast(kind.value_type)
            kind = kind.value_type
        if pa.types.is_null(kind):
            continue
        if _judged(kind):
            alike.setdefault(kind, []).append(i)
        else:
            counts[i] = len(column) - column.null_count
    for kind, chosen in alike.items():
        whole = pa.chunked_array([chunk for i in chosen for chunk in _chunks(columns[i])], kind)  # (no copy)
        filled = pc.fill_null(_filled(whole, kind, blank), False).to_numpy(zero_copy_only=False)
        ends = np.cumsum([len(columns[i]) for i in chosen])
        sums = np.concatenate([[0], np.cumsum(filled, dtype=np.int64)])
        for i, start, end in zip(chosen, np.concatenate([[0], ends[:-1]]), ends):
            counts[i] = int(sums[end] - sums[start])
    return counts


@functools.lru_cache(maxsize=256)  # (Arrow's type tests cost 13 us a column of 1,000)
def _judged(kind: pa.DataType) -> bool:
    """Whether a column of this type is judged by its values (not by its nulls alone)."""
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind)
            or pa.types.is_large_binary(kind) or pa.types.is_floating(kind) or pa.types.is_list(kind)
            or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind))


def _chunks(column: pa.ChunkedArray | pa.Array) -> list[pa.Array]:
    return list(column.chunks) if isinstance(column, pa.ChunkedArray) else [column]


def _filled(values: pa.ChunkedArray, kind: pa.DataType, blank: bool) -> pa.Array:
    """Per value of a `_judged` type: whether it holds a value (null where it is null).  # (N,) bool"""
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        return pc.not_equal(pc.utf8_trim_whitespace(values) if blank else values, "")
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        return pc.greater(pc.binary_length(values), 0)  # text checked by its readers; blanks are rare here
    if pa.types.is_floating(kind):
        return pc.invert(pc.is_nan(values))
    return pc.greater(pc.list_value_length(values), 0)


class EmptyColumns:
    """Per input, the feature columns holding no value in any row it gave (`observe`), as warning
    lines (`lines`).

    Args:
        spec: the model spec.
        columns: feature name -> raw column name (the spec's data.columns).
        features: the features judged (default: every feature of the spec).
        one_value: whether a column of one value in every row is said too (conversion: a model
            learns nothing from it; scoring rows of one user is no fault).
        hint: the end of an empty column's line: what to look at.
    """

    def __init__(self, spec: ModelSpec, columns: dict[str, str], features: list[str] | None = None,
                 one_value: bool = True, hint: str = MAP_HINT) -> None:
        self.spec, self.columns, self.one_value, self.hint = spec, columns, one_value, hint
        chosen = None if features is None else set(features)
        self.features = [f for f in spec.features if chosen is None or f.name in chosen]
        self.rows: dict[str, int] = {}
        self.filled: dict[str, set[str]] = {}  # input -> features with a value in some row
        self.spaced: dict[str, set[str]] = {}  # input -> features with text of blanks in some row
        self.values: dict[str, dict[str, Any]] = {}  # input -> feature -> its one value so far (one-value columns)

    def observe(self, source: str, chunk: pa.Table) -> None:
        """Take rows of input `source` (a file or a folder, as the user named it)."""
        self.rows[source] = self.rows.get(source, 0) + chunk.num_rows
        filled = self.filled.setdefault(source, set())
        spaced = self.spaced.setdefault(source, set())
        values = self.values.setdefault(source, {})
        present = set(chunk.column_names)  # (once: Arrow builds the list anew at each ask)
        judged = [(f.name, chunk.column(self.columns.get(f.name, f.name))) for f in self.features
                  if f.name not in filled and self.columns.get(f.name, f.name) in present]
        unfilled = [(feature, column) for (feature, column), rows in zip(judged, filled_counts([c for _, c in judged]))
                    if not rows]
        filled.update({feature for feature, _ in judged} - {feature for feature, _ in unfilled})
        for (feature, _), rows in zip(unfilled, filled_counts([c for _, c in unfilled], blank=False)):
            if rows:
                spaced.add(feature)
        for f in self.features:
            name = self.columns.get(f.name, f.name)
            if name not in present:
                continue
            if self.one_value and values.get(f.name, ONE) is not VARIED and chunk.num_rows:
                one = one_value(chunk.column(name))
                values[f.name] = one if values.get(f.name, one) == one else VARIED

    def add(self, other: EmptyColumns) -> None:
        """Take what `other` (of the same spec, columns and features) observed, as if its rows had been
        observed here too (predict's rows, call by call)."""
        for source, rows in other.rows.items():
            self.rows[source] = self.rows.get(source, 0) + rows
            self.filled.setdefault(source, set()).update(other.filled[source])
            self.spaced.setdefault(source, set()).update(other.spaced[source])
            values = self.values.setdefault(source, {})
            for name, value in other.values[source].items():
                values[name] = value if values.get(name, value) == value else VARIED

    def lines(self, shown: str | None = None) -> list[str]:
        """One line per feature whose column was empty (or of one value, with `one_value`) in every row of
        an input that gave `MIN_ROWS` rows or more, the input named `shown` (default: as observed)."""
        out = []
        for source, rows in self.rows.items():
            if rows < MIN_ROWS:
                continue
            named = shown or source
            for f in self.features:
                name = self.columns.get(f.name, f.name)
                value = self.values[source].get(f.name, VARIED)
                if f.name in self.filled[source] and value is not VARIED:
                    out.append(f"{named}: column {name!r} (feature {f.name}) holds one value ({value!r:.40}) in every "
                               f"one of its {counted(rows, 'row')}: a model learns nothing from it; a column an export filled, "
                               "or a file of one row repeated?")
                if f.name in self.filled[source]:
                    continue
                if f.kind == "dense":
                    becomes = f"every row encodes it as its fill value {f.fill:g}"
                elif f.name in self.spaced[source]:  # a text of blanks is an id, all alike
                    becomes = "every row encodes it as the missing id (row 0) or an id of blank text"
                elif is_multi(f):
                    becomes = "every row encodes it as an empty list of ids"
                else:
                    becomes = "every row encodes it as the missing id (row 0)"
                out.append(f"{named}: column {name!r} (feature {f.name}) is empty in every one of its {rows:,} "
                           f"row{'' if rows == 1 else 's'}: {becomes}; {self.hint}")
        return out


def one_value(column: pa.ChunkedArray | pa.Array) -> Any:
    """The one value every row of `column` holds (its Python value; None where every row is null),
    else `VARIED` (two values, null and a value, or a type with no such count: lists).

    >>> one_value(pa.array(["u1", "u1"])), one_value(pa.array(["u1", None])) is VARIED
    ('u1', True)
    """
    try:
        if pc.count_distinct(column, mode="all").as_py() != 1:
            return VARIED
    except (pa.ArrowNotImplementedError, pa.ArrowInvalid, pa.ArrowTypeError):
        return VARIED
    first = column[0].as_py()
    return VARIED if isinstance(first, float) and first != first else first  # NaN: no value to show


class EmptyLabels:
    """The label and sample-weight columns that a head reads on every row (not only in task
    spaces) and that no row of one input has held a value in so far (`observe`): `check` refuses
    such a column, as each row would be malformed ('missing label') and the advice to skip such
    rows would skip them all.

    Args:
        spec: the model spec.
        columns: the spec's data.columns.
        tasks: `flowrec.data.labels.label_tasks` (source column -> task).
        spaces: `flowrec.data.labels.label_spaces` (columns read only in task spaces).
        source: the input (a file or a folder, as the user named it).
    """

    def __init__(self, spec: ModelSpec, columns: dict[str, str], tasks: dict[str, str], spaces: dict[str, tuple],
                 source: str) -> None:
        self.spec, self.columns, self.tasks, self.source = spec, columns, tasks, source
        self.unfilled = [c for c in tasks if c not in spaces]
        self.rows = 0

    def observe(self, chunk: pa.Table) -> None:
        """Take rows of the input (its columns checked: every label column is there)."""
        self.rows += chunk.num_rows
        self.unfilled = [c for c in self.unfilled if c in chunk.column_names and not filled_rows(chunk.column(c))]

    def check(self, whole: bool) -> None:
        """DataError when a column held no value in any row observed (`whole`: every row of the input)."""
        if not self.unfilled or self.rows < MIN_ROWS:
            return
        column = self.unfilled[0]
        what = "sample weight" if self.tasks[column] == "weight" else "label"
        heads = [h.name for h, label in zip(self.spec.heads, label_columns(self.spec))
                 if self.columns.get(label, label) == column]
        heads = heads or [h.name for h in self.spec.heads if h.sample_weight is not None
                          and self.columns.get(h.sample_weight, h.sample_weight) == column]
        rows = f"its {counted(self.rows, 'row')}" if whole else f"the {counted(self.rows, 'row')} read"
        raise DataError(f"{self.source}: column {column!r}, the {what} of head {', '.join(heads)}, is empty in every "
                        f"one of {rows}: no row could train; a mistyped or lost column? (data.label or the head's "
                        "label names it; data.columns maps it)")
