"""Folders made as a user's machine makes them, for tests: a run folder on a read-only mount.

Example:
    >>> make_read_only(tmp_path / "run", monkeypatch)  # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def make_read_only(run: Path, monkeypatch: Any) -> None:
    """Make the run folder read-only: its modes (real for a user); for root, whom modes do not stop,
    the folder's lock and write check fail as a read-only mount makes them fail (`monkeypatch`:
    pytest's, undone after the test)."""
    from flowrec.runtime.rundir import RunFolderError, RunLock

    for path in [run, *run.rglob("*")]:
        path.chmod(path.stat().st_mode & ~0o222)
    if os.geteuid() != 0:
        return
    access = os.access

    def acquire(cls, folder, *a, **k):
        raise RunFolderError(f"cannot lock run folder {folder}: Read-only file system")

    monkeypatch.setattr(RunLock, "acquire", classmethod(acquire))
    monkeypatch.setattr(os, "access", lambda p, mode, *a, **k: False if Path(p).absolute() == run.absolute()
                        and mode & os.W_OK else access(p, mode, *a, **k))
