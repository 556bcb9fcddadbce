"""Which folder a run writes into, claimed for this process alone (`flowrec.runtime.rundir` locks it).

Example:
    >>> folder, lock = claim_run_folder(Path("runs/ml"), None, False, "movielens")  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

from flowrec.runtime.messages import not_a_file
from flowrec.runtime.rundir import (
    RUN_FILE,
    RunFolderError,
    claim_new_folder,
    foreign_entries,
    has_run,
    lost_checkpoint,
    open_folder,
    run_folder_of,
)


def claim_run_folder(out: Path | None, resume: Path | None, overwrite: bool, name: str,
                     replace_with: str = "--overwrite", resume_with: str | None = None) -> tuple[Path, Any]:
    """(folder, lock) of a run: `resume`'s folder (it must hold a run's run.json, and may hold its
    checkpoint only with it: without its settings a resume trained the defaults' data), else `out`
    (new, empty, or a run folder; one holding a run needs `overwrite`), else runs/<name>, numbered
    if taken. Raises `RunFolderError` (one line; `replace_with` names how the caller replaces a
    run: the CLI's flag or the API's argument, which also says how the rest is named, and `resume_with` how
    it continues the run in `out`, by default `--resume OUT`); release the lock when the run ends.

    A folder whose checkpoint.pt was lost (deleted, moved) after the run wrote it
    (`flowrec.runtime.rundir.lost_checkpoint`) is neither resumed from step 0 nor trained into
    without `overwrite`: that would silently replace the run's metrics and plan. Only a run killed
    before its first checkpoint landed starts again from step 0 on resume (docs/runs.md)."""
    if resume is not None:
        folder = resume
        if folder.exists() and not folder.is_dir():
            raise RunFolderError(f"{folder} is a file, not a run folder")
        if not folder.is_dir():
            raise RunFolderError(f"nothing to resume: {folder} does not exist")
        if not has_run(folder) and not (folder / RUN_FILE).is_file():
            raise RunFolderError(f"nothing to resume: {folder} has no checkpoint.pt or run.json")
        python = not replace_with.startswith("--")  # flowrec.train(resume=RUN)
        if run_folder_of(folder) != folder:  # RUN/best: its 'run.json is missing' line said to --overwrite it
            again = f"resume={str(run_folder_of(folder))!r}" if python else f"--resume {run_folder_of(folder)}"
            start = f"--init-from {folder} --out NEW"
            start = f"`flowrec train SPEC {start}`" if python else start
            raise RunFolderError(f"{folder} is the best checkpoint of the run in {run_folder_of(folder)} (early "
                                 f"stopping writes it), not a run folder: continue that run with {again}, or train "
                                 f"a new run from this checkpoint with {start}")
        lock = open_folder(folder)
        _refuse_lost_checkpoint(folder, lock, f"put it back to continue, or start the run over with "
                                              f"{out_again(folder, python)}")
        if has_run(folder) and not (folder / RUN_FILE).is_file():  # the settings below the checkpoint
            lock.release()
            kind = not_a_file(folder / RUN_FILE)
            raise RunFolderError(f"{folder}/{RUN_FILE} is {f'{kind}, not the file the run wrote' if kind else 'missing'}: it records the data, rows, epochs and every "
                                 f"other setting the run was started with, without which the checkpoint would "
                                 f"go on training other data; put it back to continue, or start the run over "
                                 f"with {out_again(folder, python)}")
        return folder, lock
    if out is None:
        _check_not_inside_owned(Path("runs") / name)
        return claim_new_folder(Path("runs"), name)
    _check_not_inside_owned(out)
    foreign = foreign_entries(out)
    if foreign:
        raise RunFolderError(f"{out} is not empty and is not a flowrec run folder (it holds "
                             f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give an empty "
                             f"or new folder")
    lock = open_folder(out)
    if not overwrite:
        _refuse_lost_checkpoint(out, lock, f"put it back and continue with {resume_with or f'--resume {out}'}, "
                                           f"or replace the run with {replace_with}")
    if has_run(out) and not overwrite:
        lock.release()
        raise RunFolderError(f"{out} already holds a run (checkpoint.pt): continue it with "
                             f"{resume_with or f'--resume {out}'}, or replace it with {replace_with}")
    return out, lock


def out_again(folder: Path, python: bool) -> str:
    """How the caller trains a new run into `folder` over the one there: `--out F --overwrite`, or in
    Python (`python`) `out='F', overwrite=True`.

    >>> out_again(Path("runs/a"), False), out_again(Path("runs/a"), True)
    ('--out runs/a --overwrite', "out='runs/a', overwrite=True")
    """
    return f"out={str(folder)!r}, overwrite=True" if python else f"--out {folder} --overwrite"


def _refuse_lost_checkpoint(folder: Path, lock: Any, remedy: str) -> None:
    """Release `lock` and raise `RunFolderError` when `folder`'s run wrote a checkpoint.pt that is
    gone (nothing in the folder is changed); `remedy` says what the user can do."""
    why = lost_checkpoint(folder)
    if why is not None:
        lock.release()
        kind = not_a_file(folder / "checkpoint.pt")
        what = f"{kind}, not the file the run in {folder} wrote" if kind else f"missing, but the run in {folder} wrote one"
        raise RunFolderError(f"{folder}/checkpoint.pt is {what} ({why}); {remedy}")


def _check_not_inside_owned(out: Path) -> None:
    """A new run folder never lies inside a folder flowrec owns for something else (a dataset, a
    model package, an encoder, another run: `flowrec.data.output_guard`), links resolved; its
    checkpoint would land among their files (a dataset would read it as a part file)."""
    from flowrec.data.output_guard import OutputError, owning_folder

    above = Path(out).absolute().parent
    while not above.is_dir() and above != above.parent:
        if above.exists():
            raise RunFolderError(f"cannot create run folder {out}: {above} is not a folder")
        above = above.parent
    owned = None
    for folder in (above, Path(out).resolve().parent):  # and where a link named `out` leads
        try:
            owned = owned or owning_folder(folder)
        except (OSError, OutputError):
            pass
    if owned is not None:
        raise RunFolderError(f"refusing to put run folder {out} in {owned[0]}, {owned[1]}'s folder "
                             f"(flowrec writes there only for it); give a folder elsewhere")
