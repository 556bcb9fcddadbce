"""Evaluation metrics as a console table: one row per head, one column per metric.

Example:
    >>> print("\\n".join(metrics_table({"ctr": {"auc": 0.75, "logloss": 0.5, "samples": 4}})))
    head  auc     logloss  samples
    ctr   0.7500  0.5000   4
"""
from __future__ import annotations

import math
from typing import Any

from flowrec.runtime.messages import number_cell  # one formatter: the table, the bar, inspect

COLUMN_ORDER = ("auc", "gauc", "pr_auc", "logloss", "ne", "calibration", "mse", "mae")


COUNT_COLUMNS = frozenset({"samples", "k", "classes"})  # counts, whatever their number type: no decimals


def _cell(value: Any, column: str = "") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if isinstance(value, int) or (column in COUNT_COLUMNS and float(value).is_integer()):
        return f"{int(value):,}"
    return number_cell(value)


def metrics_table(metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Lines of a left-aligned table of `metrics` (head -> metric -> value; NaN shown as '-')."""
    present = {name for m in metrics.values() for name in m}
    columns = [c for c in COLUMN_ORDER if c in present]
    columns += sorted(present - set(columns) - {"samples"}) + (["samples"] if "samples" in present else [])
    rows = [["head", *columns]] + [[head, *(_cell(m.get(c), c) for c in columns)] for head, m in metrics.items()]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
