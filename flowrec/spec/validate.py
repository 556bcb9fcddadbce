"""Validate spec documents: JSON Schema first, then semantic checks; every problem at once."""
from __future__ import annotations

from typing import Any

from jsonschema import Draft202012Validator

from flowrec.spec.errors import SpecIssue
from flowrec.spec.schema_errors import schema_issues
from flowrec.spec.schemas import MODEL_SPEC_SCHEMA, load_schema
from flowrec.spec.semantic import SEMANTIC_CHECKS
from flowrec.spec.view import DocView

def validate_document(doc: Any) -> list[SpecIssue]:
    """Every problem of a spec document: schema errors, then semantic errors on the clean parts.

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
    validator = Draft202012Validator(load_schema(MODEL_SPEC_SCHEMA))
    errors = list(validator.iter_errors(doc))
    issues = [issue for e in errors for issue in schema_issues(e)]
    if not isinstance(doc, dict):
        return issues
    bad = frozenset(tuple(e.absolute_path)[:2] for e in errors if e.absolute_path) | _missing_sections(errors, doc)
    view = DocView.of(doc, bad)
    for check in SEMANTIC_CHECKS:
        issues.extend(check(view))
    return issues


def _missing_sections(errors: list[Any], doc: dict) -> frozenset[tuple[Any, ...]]:
    """Required top-level sections that are absent count as bad (no checks against them)."""
    return frozenset(
        (key,) for e in errors if not e.absolute_path and e.validator == "required"
        for key in e.validator_value if key not in doc
    )


def _unique(issues: list[SpecIssue]) -> list[SpecIssue]:
    return list(dict.fromkeys(issues))
