"""Which folder a run writes into, claimed for this process alone (`flowrec.runtime.rundir` locks it).

Example:
    >>> folder, lock = claim_run_folder(Path("runs/ml"), None, False, "movielens")  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrec.runtime.rundir import RUN_FILE, RunFolderError, claim_new_folder, foreign_entries, has_run, open_folder


def claim_run_folder(out: Path | None, resume: Path | None, overwrite: bool, name: str,
                     replace_with: str = "--overwrite") -> tuple[Path, Any]:
    """(folder, lock) of a run: `resume`'s folder (it must hold a run or its run.json), else `out`
    (new, empty, or a run folder; one holding a run needs `overwrite`), else runs/<name>, numbered
    if taken. Raises `RunFolderError` (one line; `replace_with` names how the caller replaces a
    run: the CLI's flag or the API's argument); release the lock when the run ends."""
    if resume is not None:
        folder = resume
        if folder.exists() and not folder.is_dir():
            raise RunFolderError(f"{folder} is a file, not a run folder")
        if not folder.is_dir():
            raise RunFolderError(f"nothing to resume: {folder} does not exist")
        if not has_run(folder) and not (folder / RUN_FILE).is_file():
            raise RunFolderError(f"nothing to resume: {folder} has no checkpoint.pt or run.json")
        return folder, open_folder(folder)
    if out is None:
        return claim_new_folder(Path("runs"), name)
    foreign = foreign_entries(out)
    if foreign:
        raise RunFolderError(f"{out} is not empty and is not a flowrec run folder (it holds "
                             f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give an empty "
                             f"or new folder")
    lock = open_folder(out)
    if has_run(out) and not overwrite:
        lock.release()
        raise RunFolderError(f"{out} already holds a run (checkpoint.pt): continue it with "
                             f"--resume {out}, or replace it with {replace_with}")
    return out, lock
