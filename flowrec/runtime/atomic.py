"""Whole-file writes: a temp file in the same folder, fsync, rename, so a file is never torn.

A crash, a kill or a full disk leaves either the old file or the new one, never a mix; temp files a
kill leaves behind are named `.ckpt-*.tmp` and removed by the next run that owns the folder.

Example:
    >>> atomic_write(Path("runs/x/run.json"), b"{}")   # doctest: +SKIP
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

TEMP_PREFIX = ".ckpt-"
TEMP_SUFFIX = ".tmp"
NEW_FILE_MODE = 0o644  # what open() gives under the usual umask 022


def write_atomically(path: Path, write: Callable[[BinaryIO], None]) -> None:
    """Call `write(file)` on a temp file next to `path`, fsync it, rename it over `path`.

    Raises:
        OSError: from the write (disk full, permissions); `path` is untouched, no temp file is left.
    """
    write_atomically_at(path, lambda f, _: write(f))


def write_atomically_at(path: Path, write: Callable[[BinaryIO, Path], None]) -> None:
    """`write_atomically`, with the temp file's path handed to `write(file, temp_path)` too (a
    writer that reads back what it wrote)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, suffix=TEMP_SUFFIX, dir=path.parent)
    try:
        os.fchmod(fd, _mode_of(path))
        with os.fdopen(fd, "wb") as f:
            write(f, Path(tmp))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)


def _mode_of(path: Path) -> int:
    """Keep the permissions of the file being replaced; new files get rw-r--r--."""
    try:
        return path.stat().st_mode & 0o7777
    except OSError:
        return NEW_FILE_MODE


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` as the whole content of `path` (see `write_atomically`)."""
    write_atomically(path, lambda f: f.write(data))


def fsync_folder(folder: Path) -> None:
    """Make a rename in `folder` durable (best effort where folders cannot be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def remove_stale_temps(folder: Path) -> list[Path]:
    """Delete temp files a killed run left in `folder` (call only while owning the folder)."""
    removed = []
    for stale in Path(folder).glob(f"{TEMP_PREFIX}*{TEMP_SUFFIX}"):
        stale.unlink(missing_ok=True)
        removed.append(stale)
    return removed
