"""Checks on every value of a document, before the schema: plain JSON values, finite, 64-bit, bounded.

A spec holds only what JSON can: text, finite numbers, true / false, null, lists and mappings with
text keys. YAML can say more (`.nan`, `.inf`, dates, binary, sets, `1: x`), and Python callers can
pass anything, so this walk names each such value by its path (text with a lone surrogate, which
JSON's escapes allow, included), bounds integers to 64 bits and bounds the nesting depth and size
of the document (a self-referencing document is too deep).
It is iterative: no document makes it recurse.

Example:
    >>> [str(i) for i in value_issues({"optimizer": {"sparse": {"lr": float("nan")}}})]
    ['optimizer.sparse.lr: must be a finite number, not nan']
"""
from __future__ import annotations

import math
import re
from typing import Any

from flowrec.spec.errors import SpecIssue
from flowrec.spec.read import MAX_DEPTH, MAX_VALUES
from flowrec.spec.schema_errors import format_path, show

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
_SCALARS = (bool, type(None))
_SURROGATE = re.compile("[\ud800-\udfff]")  # JSON's "\ud800" escape; no UTF-8 file can hold one
_KINDS = {"date": "a date", "datetime": "a timestamp", "bytes": "binary data", "set": "a set", "tuple": "a tuple"}


def value_issues(doc: Any) -> list[SpecIssue]:
    """One issue per value a spec cannot hold, each with its path; never raises."""
    issues: list[SpecIssue] = []
    todo: list[tuple[Any, tuple[Any, ...]]] = [(doc, ())]
    seen = 0
    while todo:
        value, path = todo.pop()
        seen += 1
        if seen > MAX_VALUES:
            return issues + [SpecIssue("", f"the document has more than {MAX_VALUES:,} values")]
        problem = _problem(value, len(path))
        if problem is not None:
            issues.append(SpecIssue(format_path(path), problem))
        elif isinstance(value, dict):
            issues += [SpecIssue(format_path(path), f"key {show(k)} must be text (quote it)")
                       for k in value if not _text_key(k)]
            todo.extend((v, (*path, k)) for k, v in reversed(value.items()) if _text_key(k))
        elif isinstance(value, list):
            todo.extend((v, (*path, i)) for i, v in reversed(list(enumerate(value))))
    return issues


def _text_key(key: Any) -> bool:
    return isinstance(key, str) and _SURROGATE.search(key) is None


def _problem(value: Any, depth: int) -> str | None:
    if isinstance(value, _SCALARS):
        return None
    if isinstance(value, str):
        bad = _SURROGATE.search(value)
        return None if bad is None else f"must be valid Unicode text (lone surrogate U+{ord(bad.group()):04X})"
    if isinstance(value, int):
        return None if INT64_MIN <= value <= INT64_MAX else "must be an integer within 64 bits (-2^63 .. 2^63-1)"
    if isinstance(value, float):
        return None if math.isfinite(value) else f"must be a finite number, not {value}"
    if isinstance(value, (dict, list)):
        return None if depth < MAX_DEPTH else f"nests deeper than {MAX_DEPTH} levels"
    kind = _KINDS.get(type(value).__name__, f"a {type(value).__name__}")
    return f"must be text, a number, true / false, null, a list or a mapping (got {kind}; quote text)"
