"""Writing a dataset folder all at once: into a new sibling folder, then swapped in.

`data convert` and `data synth` never write into an existing dataset: a non-empty output folder is
refused unless ``overwrite``; the new dataset is written into ``.NAME.partial-*`` next to it and
renamed into place only when complete, so an interrupted or failed run leaves the old folder as
it was (a kill -9 may leave the hidden partial folder, never a mix of old and new part files; the
next command writing that output removes it).

Example:
    >>> with staged_output(Path("data/criteo"), overwrite=False) as tmp:  # doctest: +SKIP
    ...     write_parts(tmp)
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator, Sequence

from flowrec.data.layout import DataError
from flowrec.data.output_guard import remove_leftovers, replace_folder, short, temp_tag, written_path
from flowrec.data.readers import held_exclusively


DISK_FULL = frozenset({errno.ENOSPC, errno.EFBIG, errno.EDQUOT})  # a write the disk (or a size limit) refused


def check_output(out: Path, overwrite: bool, inputs: Sequence[Path] = ()) -> None:
    """Raise DataError if `out` cannot be (re)written: a file, a non-empty folder without
    `overwrite`, or a folder holding one of the `inputs` (replacing it would delete them)."""
    if out.exists() and not out.is_dir():
        raise DataError(f"output {out} exists and is not a folder")
    if out.is_dir() and any(out.iterdir()):
        if not overwrite:
            raise DataError(f"output folder {out} is not empty; pass --overwrite to replace it")
        root = out.resolve()
        for path in inputs:
            if path.resolve() == root or root in path.resolve().parents:
                raise DataError(f"input {path} is inside the output folder {out}, which --overwrite replaces")


@contextmanager
def staged_output(out: Path, overwrite: bool, inputs: Sequence[Path] = (),
                  status: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Yield a new empty sibling folder of `out`; on success it replaces `out`, on error it is removed.
    The folders a command killed while it wrote `out` left beside it are removed first
    (`remove_leftovers`). `status` is told what was removed, and when the replacement waits for
    flowrec processes reading `out`.

    Raises:
        DataError: as `check_output`, or the folder cannot be created.
    """
    out = written_path(out)  # a link keeps naming the dataset, now the new one
    check_output(out, overwrite, inputs)
    remove_leftovers(out, status)  # of commands killed (kill -9) while they wrote `out`
    tmp = out.parent / f".{short(out.name)}.partial-{temp_tag()}"
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise DataError(f"cannot create the output folder next to {out}: {exc.strerror}") from None
    try:
        yield tmp
        _swap(tmp, out, overwrite, status)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) and exc.errno in DISK_FULL:  # pyarrow's words name no file
            raise DataError(f"cannot write {out}: {os.strerror(exc.errno)}; "
                            f"{'the old ' + str(out) + ' is kept' if out.exists() else 'nothing was written'}") from None
        raise


def _swap(new: Path, out: Path, overwrite: bool, status: Callable[[str], None] | None = None) -> None:
    """Rename `new` to `out`; an existing `out` is moved aside first and deleted after, once no
    flowrec process reads it (a run training on it: `flowrec.data.readers`), which `status` is told."""
    def waiting() -> None:
        if status is not None:
            status(f"waiting for the flowrec processes reading {out} (a run training on it) to finish before "
                   f"replacing it; Ctrl-C leaves {out} as it is")

    with held_exclusively([out, out / "train", out / "test"], waiting):
        check_output(out, overwrite)  # another process may have written there meanwhile
        replace_folder(new, out, overwrite)


@contextmanager
def folder_locked(folder: Path, waiting: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Hold an exclusive lock on `folder` itself (flock on the folder, no lock file left behind),
    waiting while another process holds it (`waiting` is called once before waiting); released
    when the block ends or the process dies. It serialises writers of one of its subfolders (two
    runs encoding the same bound data) without touching what a run folder's own lock guards.

    Raises:
        DataError: the folder cannot be created or opened.
    """
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    except OSError as exc:
        raise DataError(f"cannot lock {folder}: {exc.strerror or exc}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            waiting()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
