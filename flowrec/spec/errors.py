"""Spec problems: each with the path of the offending value, all reported at once."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec document.

    Args:
        path: location in the document, e.g. ``modules[2].inputs[0]`` ("" for the whole file).
        message: what is wrong, and where possible what would be right.
    """

    path: str
    message: str

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class SpecError(Exception):
    """A spec that cannot be used; carries every issue found."""

    def __init__(self, issues: list[SpecIssue], source: str = "") -> None:
        self.issues = list(issues)
        self.source = source
        lines = "\n".join(f"  {i}" for i in self.issues)
        super().__init__(f"{source}: {len(self.issues)} error(s)\n{lines}")
