"""Spec files on disk: validate files and folders of specs (what `flowrec validate` runs).

Example:
    >>> [r.valid for r in validate_paths(["specs/movielens.yaml"])]
    [True]
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from flowrec.spec.class_paths import class_path_issues
from flowrec.spec.errors import SpecError, SpecIssue
from flowrec.spec.read import flowrec_format, not_a_spec, read_document
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
    own = flowrec_document(Path(path))
    if own is not None:
        return [not_a_spec(own)]
    try:
        doc = read_document(path)
    except SpecError as exc:
        return list(exc.issues)
    return validate_document(doc) + class_path_issues(doc)


RUN_MARKERS = (".flowrec.lock", "checkpoint.pt")  # a run folder's run.json is its settings, not a spec
MAX_PEEK_BYTES = 256 * 2**20  # a JSON file larger than this is not looked into for its format


def flowrec_document(path: Path) -> str | None:
    """What `path` is when flowrec wrote it for itself, not a spec: a JSON document whose `format`
    is flowrec's (`flowrec-plan`, `-encoder`, `-dataset`, `-model`, `-checked`), a dataset's
    `_flowrec*.json` record, or a run folder's `run.json`; None for anything else.

    Example:
        >>> flowrec_document(Path("specs/movielens.yaml")) is None
        True
    """
    if path.suffix.lower() != ".json" or not path.is_file():
        return None
    if path.name.startswith("_flowrec"):
        return "a dataset's record"
    if path.name == "run.json" and any((path.parent / m).exists() for m in RUN_MARKERS):
        return "a training run's settings"
    try:
        if path.stat().st_size > MAX_PEEK_BYTES:
            return None
        doc = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError):
        return None
    return flowrec_format(doc)


def _hidden(relative: Path) -> bool:
    return any(part.startswith(".") for part in relative.parts)


def spec_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand folders (recursively, sorted) into their *.yaml / *.yml / *.json files, without the
    files flowrec wrote for itself (`flowrec_document`: `validate .` over a project reported every
    plan.json, run.json and dataset record of its runs as an invalid spec, line after line) and
    without hidden files and folders below a folder named (a project's .venv, .git, .github)."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            # a link to a spec that is gone is reported (no such file), not skipped as if valid
            out.extend(sorted(f for f in p.rglob("*") if (f.is_file() or (f.is_symlink() and not f.exists()))
                              and f.suffix.lower() in SPEC_SUFFIXES and not _hidden(f.relative_to(p))
                              and flowrec_document(f) is None))
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
