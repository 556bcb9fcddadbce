"""Spec files on disk: validate files and folders of specs (what `flowrec validate` runs).

Example:
    >>> [r.valid for r in validate_paths(["specs/movielens.yaml"])]
    [True]
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from flowrec.spec.class_paths import class_path_issues
from flowrec.spec.errors import SpecError, SpecIssue
from flowrec.spec.read import read_document
from flowrec.spec.validate import validate_document

SPEC_SUFFIXES = (".yaml", ".yml", ".json")


@dataclass(frozen=True)
class FileReport:
    """The validation result of one file.

    Args:
        path: the file as given (or found in a folder).
        issues: every problem found; empty when the file is valid.
    """

    path: str
    issues: tuple[SpecIssue, ...]

    @property
    def valid(self) -> bool:
        return not self.issues


def validate_file(path: str | Path) -> list[SpecIssue]:
    """Read and validate one spec file; unreadable or malformed files give issues, never raise.
    Custom modules' class paths are also checked without running them (`flowrec.spec.class_paths`:
    a missing file, one that does not parse or lacks the class)."""
    try:
        doc = read_document(path)
    except SpecError as exc:
        return list(exc.issues)
    return validate_document(doc) + class_path_issues(doc)


def spec_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand folders (recursively, sorted) into their *.yaml / *.yml / *.json files."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            # a link to a spec that is gone is reported (no such file), not skipped as if valid
            out.extend(sorted(f for f in p.rglob("*") if (f.is_file() or (f.is_symlink() and not f.exists()))
                              and f.suffix.lower() in SPEC_SUFFIXES))
        else:
            out.append(p)
    return out


def validate_paths(paths: Iterable[str | Path]) -> list[FileReport]:
    """Validate every file named or found under the folders named (an empty folder is an issue)."""
    reports = []
    for p in map(Path, paths):
        files = spec_files([p])
        if p.is_dir() and not files:
            reports.append(FileReport(str(p), (SpecIssue("", "no spec files (*.yaml, *.yml, *.json) here"),)))
        reports.extend(FileReport(str(f), tuple(validate_file(f))) for f in files)
    return reports
