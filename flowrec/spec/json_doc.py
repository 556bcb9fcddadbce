"""Every JSON document flowrec reads, held to the limits of spec files before it is parsed.

A run's run.json, a package's manifest.json, an encoder.json, a dataset's _flowrec.json, a plan or
a device profile may come from anywhere: each is read as a regular file of at most
`MAX_SPEC_BYTES` (`max_bytes` for larger kinds), as UTF-8 text (a byte-order mark allowed, as in a
spec), its nesting bounded by `MAX_DEPTH` (Python's parser recurses once per level) and its
duplicate keys refused, all before the parser builds anything (`flowrec.spec.read`'s limits,
`flowrec.spec.json_scan`'s scan). With ``finite`` the literals NaN / Infinity are refused too.
Every problem is one line (ValueError).

Example:
    >>> parse_json_text('{"a": 1}', "x.json")
    {'a': 1}
"""
from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from flowrec.spec.json_scan import scan_json
from flowrec.spec.read import MAX_DEPTH, MAX_SPEC_BYTES


class NotJsonError(ValueError):
    """The text is within the limits but is not JSON (one line)."""


def read_json_document(path: str | Path, finite: bool = False, max_bytes: int = MAX_SPEC_BYTES) -> Any:
    """The JSON document in `path` (see the module docstring). Raises ValueError (one line)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a pipe named like the file must not block
        with open(fd, "rb") as f:
            info = os.fstat(f.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise ValueError(f"{path} is not a regular file")
            if info.st_size > max_bytes:
                raise ValueError(f"{path} is larger than {max_bytes:,} bytes")
            data = f.read(max_bytes + 1)
    except OSError as exc:
        raise ValueError(f"cannot read {path}: {exc.strerror or type(exc).__name__}") from None
    try:
        text = data.decode("utf-8-sig")  # a UTF-8 byte-order mark (an editor's) allowed, as in a spec
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not UTF-8 text") from None
    return parse_json_text(text, str(path), finite)


def parse_json_text(text: str, where: str, finite: bool = False) -> Any:
    """Parse JSON text after the scan: nesting within `MAX_DEPTH`, no duplicate keys, and (with
    `finite`) no NaN / Infinity. Raises ValueError (one line) naming `where`."""
    if not text.strip():
        raise ValueError(f"{where} is empty")
    scan = scan_json(text, MAX_DEPTH)
    if scan.too_deep is not None:
        raise ValueError(f"{where}: line {scan.too_deep}: nested deeper than {MAX_DEPTH} levels")
    problems = [p for p in scan.problems if finite or "duplicate key" in p]
    if problems:
        raise ValueError(f"{where}: {problems[0]}")
    try:
        return json.loads(text)
    except ValueError as exc:
        raise NotJsonError(f"{where} is not JSON ({exc})") from None


def version_problem(version: Any, readable: int | tuple[int, ...]) -> str | None:
    """What is wrong with a record's ``version`` field, in words that follow the record's name
    ("package format " + ...), or None when this flowrec reads `version`. A version written as
    text ("1") or as another non-integer is named as such: "version '1' (this flowrec reads
    version 1)" read as a contradiction.

    >>> version_problem(1, 1) is None
    True
    >>> version_problem("1", 1)
    "version must be an integer, not the text '1' (this flowrec reads version 1)"
    >>> version_problem(3, (1, 2))
    'version 3 (this flowrec reads versions 1, 2)'
    """
    readable = (readable,) if isinstance(readable, int) else tuple(readable)
    reads = (f"this flowrec reads version {readable[0]}" if len(readable) == 1
             else f"this flowrec reads versions {', '.join(map(str, readable))}")
    if version is None:
        return f"version is missing ({reads})"
    if type(version) is not int:  # bool is an int to Python (True == 1), and 1.0 == 1
        shown = f"the text {version!r}" if isinstance(version, str) else json.dumps(version)[:40]
        return f"version must be an integer, not {shown} ({reads})"
    if version not in readable:
        return f"version {version} ({reads})"
    return None

