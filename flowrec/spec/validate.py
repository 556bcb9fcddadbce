"""Validate spec documents: JSON Schema first, then semantic checks; every problem at once."""
from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator, validators

from flowrec.spec.errors import SpecIssue
from flowrec.spec.schema_errors import schema_issues
from flowrec.spec.schemas import MODEL_SPEC_SCHEMA, load_schema
from flowrec.spec.semantic import SEMANTIC_CHECKS
from flowrec.spec.values import value_issues
from flowrec.spec.view import DocView

# JSON Schema counts 16.0 as an integer; a spec does not (it would reach torch as a float).
SpecValidator = validators.extend(
    Draft202012Validator,
    type_checker=Draft202012Validator.TYPE_CHECKER.redefine(
        "integer", lambda _checker, v: isinstance(v, int) and not isinstance(v, bool)),
)


def validate_document(doc: Any) -> list[SpecIssue]:
    """Every problem of a spec document: value, schema, then semantic errors on the clean parts.

    Never raises for any input.

    Example:
        >>> [str(i) for i in validate_document({"name": "m"})][:1]
        ["missing required key 'features'"]
    """
    try:
        return _unique(_issues(doc))
    except RecursionError:
        return [SpecIssue("", "the document nests too deeply (a YAML anchor that refers to itself?)")]


def _issues(doc: Any) -> list[SpecIssue]:
    issues = value_issues(doc)
    if any(not i.path for i in issues):
        return issues  # too deep or too large as a whole: nothing more is checked
    errors = sorted(SpecValidator(load_schema(MODEL_SPEC_SCHEMA)).iter_errors(doc),
                    key=lambda e: _document_position(doc, e.absolute_path))
    named = {i.path for i in issues}  # a value issue says more than the schema about the same value
    bad = _value_items(issues)
    issues += [i for e in errors for i in schema_issues(e) if i.path not in named]
    if not isinstance(doc, dict):
        return issues
    bad |= frozenset(tuple(e.absolute_path)[:2] for e in errors if e.absolute_path) | _missing_sections(errors, doc)
    view = DocView.of(doc, bad)
    for check in SEMANTIC_CHECKS:
        issues.extend(check(view))
    return issues


def _document_position(doc: Any, path: Any) -> tuple[int, ...]:
    """Where `path` is in `doc`, as the index of each key or item on the way: the schema errors in
    the order the document gives their values (jsonschema reports the keys one `additionalProperties`
    refuses in a set's order, so `data.columns` given as lists was listed in another order each run).

    >>> _document_position({"b": 1, "a": {"y": [0, 1], "x": 2}}, ["a", "y", 1])
    (1, 0, 1)
    """
    position, node = [], doc
    for step in path:
        if isinstance(node, dict) and step in node:
            position.append(list(node).index(step))
        elif isinstance(node, list) and isinstance(step, int) and 0 <= step < len(node):
            position.append(step)
        else:
            position.append(len(node) if isinstance(node, (dict, list)) else 0)
            break
        node = node[step]
    return tuple(position)


def _missing_sections(errors: list[Any], doc: dict) -> frozenset[tuple[Any, ...]]:
    """Required top-level sections that are absent count as bad (no checks against them)."""
    return frozenset(
        (key,) for e in errors if not e.absolute_path and e.validator == "required"
        for key in e.validator_value if key not in doc
    )


def _value_items(issues: list[SpecIssue]) -> frozenset[tuple[Any, ...]]:
    """Items holding a value issue count as bad, as schema errors do: ("features", 3), ("plan",)."""
    out = set()
    for issue in issues:
        head = issue.path.partition(".")[0]
        section, _, index = head.partition("[")
        out.add((section, int(index.split("]")[0])) if index[:1].isdigit() else (section,))
    return frozenset(out)


def _unique(issues: list[SpecIssue]) -> list[SpecIssue]:
    return list(dict.fromkeys(issues))
