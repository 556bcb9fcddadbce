"""Spec problems: each with the path of the offending value, all reported at once."""
from __future__ import annotations

import re
from dataclasses import dataclass

_LINE_BREAKS = re.compile(r"[\r\n\x0b\x0c\x1c-\x1e\x85\u2028\u2029]+")  # what str.splitlines() splits at


@dataclass(frozen=True)
class SpecIssue:
    """One problem in a spec document.

    Args:
        path: location in the document, e.g. ``modules[2].inputs[0]`` ("" for the whole file).
        message: what is wrong, and where possible what would be right.

    Both are kept on one line (line breaks in quoted text become spaces).
    """

    path: str
    message: str

    def __post_init__(self) -> None:  # one issue is one line, whatever text it quotes
        object.__setattr__(self, "path", _LINE_BREAKS.sub(" ", self.path))
        object.__setattr__(self, "message", _LINE_BREAKS.sub(" ", self.message))

    def __str__(self) -> str:
        return f"{self.path}: {self.message}" if self.path else self.message


class SpecError(Exception):
    """A spec that cannot be used; carries every issue found."""

    def __init__(self, issues: list[SpecIssue], source: str = "") -> None:
        self.issues = list(issues)
        self.source = source
        lines = "\n".join(f"  {i}" for i in self.issues)
        super().__init__(f"{source}: {len(self.issues)} error(s)\n{lines}")
