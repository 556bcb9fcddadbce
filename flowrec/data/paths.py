"""Paths flowrec cannot use, told before anything reads or writes them: a name (or a whole path)
longer than the file system holds, a name that is not UTF-8 text, or a link loop. The command line checks every
path argument and option with `unusable_path`, and the Python API (`flowrec.train`, `load`,
`Run.evaluate`, `load_model`) every path argument, so both refuse such a path in one line.

Example:
    >>> unusable_path(Path("runs/a")) is None
    True
"""
from __future__ import annotations

import errno
import os
from pathlib import Path, PurePath

NAME_MAX = 255  # bytes of one file name (ext4, xfs, btrfs, tmpfs), where the folder does not say
PATH_MAX = 4096  # bytes of a whole path (Linux)


def unusable_path(path: PurePath) -> str | None:
    """Why flowrec cannot use `path` (a name, or the whole path, longer than the file system holds;
    a name that is not UTF-8 text; a NUL character), or None. Python's `Path.exists()` raises on a name too long
    where it returns False for a missing file, and flowrec records paths in its JSON files (run.json,
    _flowrec.json), which hold text: both ended in tracebacks, so every command checks its paths first.

    >>> unusable_path(Path("runs") / ("x" * 300))
    "the name 'xxxxxxxxxxxxxxxxxxxxxxxxxxxxxx…' is 300 bytes long; a file name holds at most 255"
    >>> unusable_path(Path(os.fsdecode(b"runs/day\\xe9")))
    "the name 'day\\\\xe9' is not UTF-8 text, and flowrec reads and records paths as text: rename it (e.g. convmv -f latin1 -t utf8)"
    >>> unusable_path(Path("runs/a"))
    >>> unusable_path(Path("runs/a\\0"))
    "the path 'runs/a\\\\x00' holds a NUL character ('\\\\0'), which no file name can hold"
    """
    if "\0" in str(path):  # os.stat's bare ValueError ('embedded null byte'); a shell's argument cannot
        # hold one, Python text can
        return f"the path {str(path)[:80]!r} holds a NUL character ('\\0'), which no file name can hold"
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
    return _link_loop(Path(path))


def _link_loop(path: Path) -> str | None:
    """Why `path` cannot be reached: a link in it leads back to itself through links (`ln -s b a;
    ln -s a b`), which Python's `Path.resolve` raised as a RuntimeError traceback and other checks
    called a missing file; None otherwise (a missing file included: each command names that).

    >>> import tempfile
    >>> folder = Path(tempfile.mkdtemp())
    >>> (folder / "a").symlink_to("b"); (folder / "b").symlink_to("a")
    >>> print(_link_loop(folder / "a").replace(str(folder), "F"))
    F/a is a link loop (its links lead back to themselves): point the link at a file or folder
    """
    if not _loops(path):
        return None
    loop = next((p for p in reversed((path, *path.parents)) if _loops(p)), path)  # the link that loops
    where = "" if loop == path else f" (on the way to {path})"
    return f"{loop} is a link loop (its links lead back to themselves){where}: point the link at a file or folder"


def _loops(path: Path) -> bool:
    try:
        os.stat(path)
    except OSError as exc:
        return exc.errno == errno.ELOOP
    except ValueError:  # (a NUL in the name: unusable_path names it before)
        pass
    return False


def _name_max(path: Path) -> int:
    """The longest file name the file system of `path`'s nearest existing folder holds."""
    for folder in path.absolute().parents:
        try:
            if folder.is_dir():
                return int(os.pathconf(folder, "PC_NAME_MAX"))
        except (OSError, ValueError):
            break
    return NAME_MAX
