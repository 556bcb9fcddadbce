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
from flowrec.spec.units import counted

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


UNDEFINED_ORDER = ("auc", "gauc", "pr_auc", "ne", "calibration")  # the metrics one class leaves undefined


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def undefined_notes(metrics: dict[str, dict[str, Any]]) -> list[str]:
    """Why a head's cells show '-' where its evaluation rows hold one class of its label (AUC, NE and
    the rest are undefined there, not 0.5 or 0): one line per such head; a grouped head whose every
    group holds one class, gauc.

    >>> undefined_notes({"ctr": {"auc": float("nan"), "pr_auc": float("nan"), "logloss": 0.7, "samples": 88}})
    ["ctr: every evaluation label is 0 (88 rows): auc and pr_auc are undefined ('-' in the table, null in JSON)"]
    """
    lines = []
    for head, m in metrics.items():
        if m.get("samples") and "logloss" in m and _missing(m["logloss"]):  # of any labels: NaN scores
            why = getattr(metrics, "nonfinite", None) or "a parameter or an input beyond float32"  # (`Metrics`)
            lines.append(f"{head}: the model scored NaN for some of the {counted(int(m['samples']), 'evaluation row')} "
                         f"({why}): its metrics are undefined ('-' in the table, null in JSON)")
            continue
        if not m.get("samples") or "auc" not in m:
            continue
        undefined = [name for name in UNDEFINED_ORDER if name in m and _missing(m[name])]
        if _missing(m["auc"]):
            if "pr_auc" in m:  # binary: no positives leave average precision undefined too
                what = f"every evaluation label is {0 if _missing(m['pr_auc']) else 1}"
            else:
                what = "the evaluation labels hold one class"
        elif undefined == ["gauc"]:
            what = "no group of the evaluation rows holds both classes"
        else:
            continue
        named = " and ".join([", ".join(undefined[:-1]), undefined[-1]] if len(undefined) > 1 else undefined)
        lines.append(f"{head}: {what} ({counted(int(m['samples']), 'row')}): {named} {'is' if len(undefined) == 1 else 'are'} "
                     f"undefined ('-' in the table, null in JSON)")
    return lines

