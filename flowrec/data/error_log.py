"""Malformed input rows: counted, reported with line numbers, skipped or fatal by policy.

Example:
    >>> log = ErrorLog("skip")
    >>> log.add(3, "wrong field count (2, expected 40)", "1\\t2")
    >>> log.count
    1
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Literal, Optional

from flowrec.data.layout import DataError

ErrorPolicy = Literal["skip", "fail"]
KEPT_ERRORS = 50  # examples kept for the report; the count covers every error
SKIP_HINT = "use --on-error skip to skip such rows"  # (`flowrec data convert`'s and `predict`'s option)


@dataclass(frozen=True)
class RowError:
    """One malformed input row: 1-based line number in its file, why, and the text (trimmed)."""

    path: str
    line: int
    reason: str
    text: str = ""

    def __str__(self) -> str:
        snippet = f": {self.text[:80]!r}" if self.text else ""
        return f"{self.path}:{self.line}: {self.reason}{snippet}"


@dataclass
class ErrorLog:
    """Collects malformed rows. With policy "fail" the first one raises `DataError`."""

    policy: ErrorPolicy = "fail"
    path: str = ""
    count: int = 0
    examples: list[RowError] = field(default_factory=list)
    # the file's line of a reader's line number, where they differ (a reader that skips blank lines
    # without counting them: `flowrec.data.sources.csv_chunks`); asked only for a reported row
    file_line: Optional[Callable[[int], int]] = None

    def add(self, line: int, reason: str, text: str = "", skippable: bool = True) -> None:
        """Count a malformed row; under "fail" raise for it, with the hint to skip such rows unless
        `skippable` is False (a row whose skipping would bias the data: every row of a class)."""
        self.count += 1
        if len(self.examples) >= KEPT_ERRORS and self.policy != "fail":
            return
        err = RowError(self.path, line if self.file_line is None else self.file_line(line), reason, text)
        if len(self.examples) < KEPT_ERRORS:
            self.examples.append(err)
        if self.policy == "fail":
            raise DataError(f"malformed row at {err}" + (f" ({SKIP_HINT})" if skippable else ""))
