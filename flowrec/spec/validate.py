"""Placeholder replaced by the spec validation work (schema + semantic checks)."""
from __future__ import annotations

from typing import Any

from flowrec.spec.errors import SpecIssue


def validate_document(doc: Any) -> list[SpecIssue]:
    return [] if isinstance(doc, dict) else [SpecIssue("", "a spec must be a mapping")]
