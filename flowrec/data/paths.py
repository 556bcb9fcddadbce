"""Paths flowrec cannot use, told before anything reads or writes them: a name (or a whole path)
longer than the file system holds, or a name that is not UTF-8 text. The command line checks every
path argument and option with `unusable_path`, and the Python API (`flowrec.train`, `load`,
`Run.evaluate`, `load_model`) every path argument, so both refuse such a path in one line.

Example:
    >>> unusable_path(Path("runs/a")) is None
    True
"""
from __future__ import annotations

import os
from pathlib import Path, PurePath

NAME_MAX = 255  # bytes of one file name (ext4, xfs, btrfs, tmpfs), where the folder does not say
PATH_MAX = 4096  # bytes of a whole path (Linux)


def unusable_path(path: PurePath) -> str | None:
    """Why flowrec cannot use `path` (a name, or the whole path, longer than the file system holds;
    a name that is not UTF-8 text), or None. Python's `Path.exists()` raises on a name too long
    where it returns False for a missing file, and flowrec records paths in its JSON files (run.json,
    _flowrec.json), which hold text: both ended in tracebacks, so every command checks its paths first.

    >>> unusable_path(Path("runs") / ("x" * 300))
    "the name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx…' is 300 bytes long; a file name holds at most 255"
    >>> unusable_path(Path(os.fsdecode(b"runs/day\\xe9")))
    "the name 'day\\\\xe9' is not UTF-8 text, and flowrec reads and records paths as text: rename it (e.g. convmv -f latin1 -t utf8)"
    >>> unusable_path(Path("runs/a"))
    """
    if len(os.fsencode(path)) >= PATH_MAX:
        return f"the path is {len(os.fsencode(path)):,} bytes long; a path holds at most {PATH_MAX - 1:,}"
    limit = _name_max(Path(path))
    for part in PurePath(path).parts:
        size = len(os.fsencode(part))
        if size > limit:
            return f"the name {part[:30]!r}"[:-1] + f"…' is {size:,} bytes long; a file name holds at most {limit}"
        try:
            part.encode("utf-8")
        except UnicodeEncodeError:
            shown = os.fsencode(part).decode("utf-8", "backslashreplace")
            return (f"the name '{shown}' is not UTF-8 text, and flowrec reads and records paths as text: rename it "
                    "(e.g. convmv -f latin1 -t utf8)")
    return None


def _name_max(path: Path) -> int:
    """The longest file name the file system of `path`'s nearest existing folder holds."""
    for folder in path.absolute().parents:
        try:
            if folder.is_dir():
                return int(os.pathconf(folder, "PC_NAME_MAX"))
        except (OSError, ValueError):
            break
    return NAME_MAX
