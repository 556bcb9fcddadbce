"""Why some of a head's metrics are undefined: one line per such head, said by `flowrec train`,
`flowrec eval` (beside the table) and the Python API (as a UserWarning), never a silent NaN.
"""
from __future__ import annotations

import math
from typing import Any

from flowrec.spec.units import counted

TABLE = "('-' in the table, null in JSON)"  # how the console shows an undefined metric
PYTHON = "(NaN in the returned metrics)"  # how flowrec.load(...).evaluate() and flowrec.train() give it
UNDEFINED_ORDER = ("auc", "gauc", "pr_auc", "ne", "calibration")  # the metrics one class leaves undefined


def _missing(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def undefined_notes(metrics: dict[str, dict[str, Any]], shown: str = TABLE) -> list[str]:
    """Why a head's cells show '-' where its evaluation rows hold one class of its label (AUC, NE and
    the rest are undefined there, not 0.5 or 0), or where the model scored NaN: one line per such
    head; a grouped head whose every group holds one class, gauc. `shown` says how the caller shows
    an undefined metric.

    >>> undefined_notes({"ctr": {"auc": float("nan"), "pr_auc": float("nan"), "logloss": 0.7, "samples": 88}})
    ["ctr: every evaluation label is 0 (88 rows): auc and pr_auc are undefined ('-' in the table, null in JSON)"]
    """
    lines = []
    for head, m in metrics.items():
        if m.get("samples") and "logloss" in m and _missing(m["logloss"]):  # of any labels: NaN scores
            why = getattr(metrics, "nonfinite", None) or "a parameter or an input beyond float32"  # (`Metrics`)
            lines.append(f"{head}: the model scored NaN for some of the {counted(int(m['samples']), 'evaluation row')} "
                         f"({why}): its metrics are undefined {shown}")
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
                     f"undefined {shown}")
    return lines
