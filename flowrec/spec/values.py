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
_NONFINITE = "must be a finite number"
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
        return None if math.isfinite(value) else f"{_NONFINITE}, not {value}"
    if isinstance(value, (dict, list)):
        return None if depth < MAX_DEPTH else f"nests deeper than {MAX_DEPTH} levels"
    if _numpy_scalar(value):  # only Python passes one (a YAML or JSON file cannot)
        plain = {"i": "int", "u": "int", "f": "float", "b": "bool"}.get(getattr(value.dtype, "kind", ""))
        if plain is not None:
            return f"must be a Python {plain}, not numpy.{type(value).__name__} ({value}): give {plain}(x)"
        return (f"must be text, a number, True / False, None, a list or a dict, not numpy.{type(value).__name__} "
                f"({str(value):.40})")
    if isinstance(value, tuple):  # only Python makes one: a list is what a spec holds
        return "must be a list, not a tuple: give a list"
    if type(value).__name__ in _KINDS:  # what a YAML file can say: its text, quoted, is what was meant
        return (f"must be text, a number, true / false, null, a list or a mapping (got "
                f"{_KINDS[type(value).__name__]}; quote text)")
    if isinstance(value, type):  # a custom module's class, given as the class: its path is the spec's
        return (f"must be text, a number, True / False, None, a list or a dict, not the class "
                f"{value.__qualname__}: give its class path as text ('{value.__module__}.{value.__qualname__}')")
    return (f"must be text, a number, True / False, None, a list or a dict, not a {type(value).__name__} "
            f"({value!r:.40})")


def _numpy_scalar(value: Any) -> bool:
    """A numpy scalar (np.int64(8), np.float32(0.1), np.bool_(True)), told without importing numpy."""
    return type(value).__module__ == "numpy" and getattr(value, "ndim", None) == 0 and hasattr(value, "item")


def python_values(doc: Any) -> Any:
    """`doc` with each numpy integer, float and bool scalar in it as its Python value (a spec built in
    Python from arrays holds `np.int64(8)` where a file says 8); the containers holding one are copied,
    `doc` itself is not changed. Anything else stays for `value_issues` to judge.

    Example:
        >>> import numpy as np
        >>> python_values({"dim": np.int64(8), "lr": [np.float32(0.5)], "name": "t"})
        {'dim': 8, 'lr': [0.5], 'name': 't'}
    """
    try:
        return _python_values(doc)
    except RecursionError:  # a document that holds itself: `value_issues` says it is too deep
        return doc


def _python_values(doc: Any) -> Any:
    if isinstance(doc, dict):
        return {k: _python_values(v) for k, v in doc.items()} if _holds_numpy(doc) else doc
    if isinstance(doc, list):
        return [_python_values(v) for v in doc] if _holds_numpy(doc) else doc
    if _numpy_scalar(doc) and getattr(doc.dtype, "kind", "") in "iufb":
        return doc.item()
    return doc


def _holds_numpy(doc: Any) -> bool:
    """Whether a numpy scalar is anywhere in `doc` (iterative: no document makes it recurse)."""
    todo, seen = [doc], 0
    while todo and seen <= MAX_VALUES:
        value = todo.pop()
        seen += 1
        if _numpy_scalar(value):
            return True
        if isinstance(value, dict):
            todo.extend(value.values())
        elif isinstance(value, list):
            todo.extend(value)
    return False


def nonfinite_issues(doc: Any) -> list[SpecIssue]:
    """One issue per NaN or infinite number in `doc`, each with its path (`training.batch_size: must
    be a finite number, not nan`); never raises.

    Example:
        >>> [str(i) for i in nonfinite_issues({"training": {"batch_size": float("nan")}})]
        ['training.batch_size: must be a finite number, not nan']
    """
    return [issue for issue in value_issues(doc) if issue.message.startswith(_NONFINITE)]
