"""Readers of an encoded dataset against a conversion that replaces it (`--overwrite`).

A dataset source (`flowrec.data.dataset`) reads its part files by name for as long as it lives
(a run reads them again every epoch). `data convert OUT --overwrite` (and `data synth`) renamed a
new folder over OUT meanwhile, so a run training on OUT read the new dataset's part files under the
old one's layout: 'unreadable Parquet part' in the middle of training, or, where the layouts
matched, the new rows mixed silently into the old. A reader therefore holds a shared `flock` on the
dataset's folder while it reads (`hold_for_reading`), and the swap of a conversion takes it
exclusively (`held_exclusively`) before the old folder is moved aside, waiting for the readers: the
kernel drops a reader's lock however it ends (SIGKILL included), so no stale lock blocks a swap.

Example:
    >>> fd = hold_for_reading(Path("data/criteo"))  # doctest: +SKIP
    >>> release(fd)  # doctest: +SKIP
"""
from __future__ import annotations

import fcntl
import os
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

TRIES = 5  # times a reader opens the folder again when it was replaced between its open and its lock
_HELD: dict[int, tuple[int, int]] = {}  # this process's read locks: descriptor -> the folder's (st_dev, st_ino)


def hold_for_reading(folder: Path) -> int | None:
    """A descriptor of `folder` holding a shared lock on it (waiting while a conversion replaces
    it), the folder still under its name once locked; None where it cannot be locked (a file system
    without flock: the reader goes on, unprotected)."""
    for _ in range(TRIES):
        try:
            fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_SH)
            held, now = os.fstat(fd), os.stat(folder)
        except OSError:
            os.close(fd)
            return None
        except BaseException:
            os.close(fd)
            raise
        if (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino):
            _HELD[fd] = (held.st_dev, held.st_ino)
            return fd
        os.close(fd)  # replaced while this reader waited: read the new one
    return None


def release(fd: int | None) -> None:
    """Drop a lock `hold_for_reading` took (None: none was)."""
    if fd is not None:
        _HELD.pop(fd, None)
        os.close(fd)


@contextmanager
def held_exclusively(folders: Sequence[Path], waiting: Callable[[], None]) -> Iterator[None]:
    """Within: an exclusive lock on each of `folders` that is a folder (not a link: replacing a link
    leaves the folder it names, and its readers, alone), taken once no reader holds it (`waiting` is
    called once before the first wait). A folder this process reads itself is not waited for (its
    own read lock would block it forever)."""
    fds: list[int] = []
    told = False
    try:
        for folder in folders:
            if folder.is_symlink() or not folder.is_dir():
                continue
            try:
                fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
            except OSError:
                continue
            fds.append(fd)
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) in _HELD.values():
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not told:
                    waiting()
                    told = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError:  # no flock here: nothing to wait for
                continue
        yield
    finally:
        for fd in fds:
            os.close(fd)
