"""Run folders: owned by one run at a time, claimed without races, written without tearing.

A run holds an exclusive advisory lock (`fcntl.flock`) on `RUN/.flowrec.lock`, with its pid written
in it, for its whole life; the kernel drops the lock when the process ends, however it ends
(SIGKILL included), so a stale lock never blocks a later run. Default folders `runs/<name>`,
`runs/<name>-2`, ... are claimed with an atomic `mkdir`, so two runs started together never share
one.

Example:
    >>> lock = RunLock.acquire(Path("runs/exp1"))   # doctest: +SKIP
    >>> folder, lock = claim_new_folder(Path("runs"), "dlrm")   # doctest: +SKIP
"""
from __future__ import annotations

import errno
import fcntl
import os
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from flowrec.data.run_paths import BEST_DIR, CHECKPOINT_NAME, RUN_FILE, run_folder_of  # noqa: F401 (re-exported)
from flowrec.runtime.atomic import TEMP_PREFIX, TEMP_SUFFIX, atomic_write, remove_stale_temps
from flowrec.runtime.checkpoint.delta import delta_files, is_delta_name, remove_deltas
from flowrec.runtime.checkpoint.shards import SHARDS_DIR
from flowrec.runtime.run_log import read_records

LOCK_NAME = ".flowrec.lock"
METRICS_FILE = "metrics.jsonl"
RUN_FILES = (CHECKPOINT_NAME, METRICS_FILE, RUN_FILE, "spec.json", "plan.json")
RUN_SUBFOLDERS = ("data", "tensorboard", BEST_DIR, "encoder", SHARDS_DIR)  # bound raw data encoded for the
# run; TensorBoard logs; the best checkpoint; the encoder of the run's data (flowrec.data.encoder_record);
# the ranks' shards of a distributed run's checkpoints (flowrec.runtime.checkpoint.shards)
PREPARED = ("data", "encoder")  # what a new run writes before it starts (and a refusal removes)
STARTED = (METRICS_FILE, RUN_FILE, "spec.json", "plan.json", "tensorboard")  # what it writes as it starts
# training, before its first checkpoint (a refusal then, e.g. bad data in a later partition, removes them too)
STOPPED_EVENT = "stopped"  # the metrics.jsonl record of a run stopped in training (a non-finite loss)
MAX_NUMBERED = 10_000  # runs/<name>-N tried before giving up


class RunFolderError(ValueError):
    """A run folder that cannot be used; the message is one line naming it."""


@dataclass
class RunLock:
    """The exclusive lock of a run folder, held until `release` or the end of the process."""

    folder: Path
    fd: int
    name: str = LOCK_NAME

    @classmethod
    def acquire(cls, folder: Path, name: str = LOCK_NAME, what: str = "run folder",
                holder: str = "flowrec run") -> "RunLock":
        """Lock `folder` (which must exist) with its file `name`, or raise RunFolderError naming the
        holder's pid (`what` names the folder, `holder` the kind of process, in the message). A lock
        this same process holds (another thread training into the folder, or `flowrec.train()` called
        from a callback of the run into its own folder: a second lock's open file is refused as
        another process's is) is said to be this process's, not another run's."""
        path = Path(folder) / name
        try:  # never through a link: the pid written below truncated the file a planted link named
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise RunFolderError(f"cannot lock {what} {folder}: its lock file {name} is a symbolic link "
                                     f"(to {os.readlink(path)!r}); remove the link") from None
            raise RunFolderError(f"cannot lock {what} {folder}: {exc.strerror}") from None
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:  # a hard link: another file's bytes too
            os.close(fd)
            kind = f"a hard link ({info.st_nlink} names of one file)" if stat.S_ISREG(info.st_mode) else \
                "not a regular file"
            raise RunFolderError(f"cannot lock {what} {folder}: its lock file {name} is {kind}; remove it "
                                 f"(when no flowrec process uses the folder), and the lock is made afresh")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            pid = _read_pid(fd)
            os.close(fd)
            raise RunFolderError(_in_use(what, folder, holder, pid)) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return cls(Path(folder), fd, name)

    def release(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def release_and_remove_if_unused(self, keep_folder: bool = False, written: tuple[str, ...] = PREPARED) -> None:
        """Release the lock of a folder this run created; one that holds nothing but the lock and
        `written` (what this run wrote: by default what preparing the run wrote, bound raw data
        encoded into data/ and its encoder/, the run refused before it started, e.g. early stopping
        without an evaluation set) is removed, so a refused run leaves no trace. Anything else there
        (a run file, a file of someone else's) keeps the whole folder. `keep_folder`: the folder was
        there, empty, before the run (the user's own `--out`), so it is emptied again rather than
        removed."""
        if self.fd >= 0 and {p.name for p in self.folder.iterdir()} <= {self.name, *written}:
            for name in written:  # made by this run: the folder was new or empty, and locked since
                entry = self.folder / name
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                elif entry.exists() or entry.is_symlink():
                    entry.unlink(missing_ok=True)
            (self.folder / self.name).unlink()  # while still holding the lock
            self.release()
            if not keep_folder:
                try:
                    self.folder.rmdir()
                except OSError:  # something appeared in it meanwhile: keep it
                    pass
        self.release()

    def release_as_found(self, found: str, refused: bool = False) -> None:
        """Release the lock at the end of a run whose folder was `found` (`folder_state` before
        the run): a refused run leaves a new folder absent and an empty one empty; a folder that
        held anything keeps all of it.

        `refused`: the run ended on bad input (data, settings: exit status 2), so the files it wrote
        as it started training go too, as long as it saved no checkpoint (none there: only the
        names of `STARTED`, which a checkpoint, best/ or a delta is not) and did not stop in
        training (a non-finite loss: its metrics say why). Otherwise (an interrupt, which printed
        the command that resumes the folder; running out of memory) only what preparing wrote goes.
        """
        if found == "used":
            self.release()
            return
        written = PREPARED + STARTED if refused and not self._stopped_in_training() else PREPARED
        self.release_and_remove_if_unused(keep_folder=found == "empty", written=written)

    def _stopped_in_training(self) -> bool:
        """metrics.jsonl records that training stopped (a non-finite loss); unreadable: as if it did."""
        try:
            return any(r.get("event") == STOPPED_EVENT for r in read_records(self.folder / METRICS_FILE))
        except OSError:
            return True


def folder_state(folder: Path | None, lock_name: str = LOCK_NAME) -> str:
    """What a run's folder holds before the run: "absent" (no such folder, or none given),
    "empty" (nothing, or only the lock `lock_name` a run killed at its start left) or "used".

    Example:
        >>> folder_state(None), folder_state(Path("no/such/folder"))
        ('absent', 'absent')
    """
    if folder is None or not folder.exists():
        return "absent"
    try:
        return "empty" if {p.name for p in folder.iterdir()} <= {lock_name} else "used"
    except OSError:  # not a folder, or unreadable: the claim that follows says why
        return "used"


def _in_use(what: str, folder: Path, holder: str, pid: str) -> str:
    """The line of a folder whose lock is held by the process `pid` (as its lock file says).

    Example:
        >>> _in_use("run folder", Path("runs/a"), "flowrec run", "unknown")
        'run folder runs/a is in use by another flowrec run (pid unknown)'
    """
    if pid != str(os.getpid()):
        return f"{what} {folder} is in use by another {holder} (pid {pid})"
    return (f"{what} {folder} is in use by this same process (pid {pid}), not another {holder}: another call "
            f"of this program (a thread, or a callback of the run) holds it; let that call end first, or give "
            f"another folder")


def _read_pid(fd: int) -> str:
    try:
        return os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
    except OSError:
        return "unknown"


def claim_new_folder(root: Path, name: str) -> tuple[Path, RunLock]:
    """The first of root/name, root/name-2, ... that this call creates (atomic mkdir), locked."""
    try:
        Path(root).mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFolderError(f"cannot create {root}: {exc.strerror}") from None
    for n in range(1, MAX_NUMBERED + 1):
        candidate = Path(root) / (name if n == 1 else f"{name}-{n}")
        try:
            os.mkdir(candidate)
        except FileExistsError:
            continue
        except OSError as exc:
            raise RunFolderError(f"cannot create run folder {candidate}: {exc.strerror}") from None
        return candidate, RunLock.acquire(candidate)
    raise RunFolderError(f"no free run folder name under {root} for {name} (tried {MAX_NUMBERED})")


def open_folder(folder: Path) -> RunLock:
    """Create `folder` if needed and lock it; an existing file there is an error."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise RunFolderError(f"{folder} is a file, not a run folder")
    dangling = _dangling_link(folder)
    if dangling is not None:  # mkdir said only 'File exists' of a name that holds nothing
        raise RunFolderError(f"cannot create run folder {folder}: {dangling}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise RunFolderError(f"cannot create run folder {folder}: {exc.strerror or exc}") from None
    lock = RunLock.acquire(folder)
    places = (folder / SHARDS_DIR, folder / BEST_DIR, folder / BEST_DIR / SHARDS_DIR)
    linked = next((place for place in places if place.is_symlink()), None)
    if linked is not None:  # the run removes and writes checkpoints in them: another run's, through the link
        lock.release()
        raise RunFolderError(f"{linked} is a symbolic link (to {os.readlink(linked)!r}); a run keeps its "
                             f"checkpoints in folders of its own: remove the link")
    for place in (folder, *places):
        remove_stale_temps(place)  # a rank killed in its shard's write leaves its temp file in checkpoint.shards/
    return lock


def _dangling_link(folder: Path) -> str | None:
    """Why `folder` cannot be made when it, or a folder above it, is a symbolic link to nothing (its
    target removed, moved or never made, or a loop of links), in words naming the link, its target
    and what to do; None otherwise.

    Example:
        >>> _dangling_link(Path("no/such/folder")) is None
        True
    """
    for place in (folder, *folder.parents):
        if place.is_symlink() and not place.exists():
            target = os.readlink(place)
            missing = "leads to no folder (a link to a link that is gone, or a loop of links)" \
                if os.path.lexists(place.parent / target) else "does not exist"
            return (f"{place} is a symbolic link to {target!r}, which {missing}; create the folder it "
                    f"names, or remove the link, or give another folder")
    return None


def foreign_entries(folder: Path) -> list[str]:
    """Names in `folder` that no flowrec run writes (a folder holding them is not a run folder)."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    own = set(RUN_FILES) | {LOCK_NAME} | set(RUN_SUBFOLDERS)
    return sorted(p.name for p in folder.iterdir()
                  if p.name not in own and not is_delta_name(p.name, CHECKPOINT_NAME)
                  and not (p.name.startswith(TEMP_PREFIX) and p.name.endswith(TEMP_SUFFIX)))


def has_run(folder: Path) -> bool:
    """A run with saved state lives here (its checkpoint must not be overwritten by another run)."""
    return (Path(folder) / CHECKPOINT_NAME).is_file()


def lost_checkpoint(folder: Path) -> str | None:
    """Why `folder` must have held a checkpoint.pt that is no longer there, in words; None when it
    holds one, or when nothing says it ever did (a run killed before its first checkpoint lands).

    The proofs are ones a checkpoint write leaves and a kill cannot fake: a delta file (deltas are
    written after their full checkpoint, in order, on one writer thread), a `saved` record in
    metrics.jsonl (written by training at its next step once the writer has renamed a checkpoint
    into place) and an `end` record (written after every checkpoint write of the run finished). A
    `checkpoint` record is no proof: it is written when the snapshot is taken, before the file lands.

    Args:
        folder: a run folder.

    Returns:
        One clause such as "its metrics.jsonl records the run's end at step 40", or None.
    """
    folder = Path(folder)
    if has_run(folder):
        return None
    deltas = delta_files(folder / CHECKPOINT_NAME)
    if deltas:
        return f"its incremental checkpoint {deltas[0][1].name} is still there"
    try:
        records = read_records(folder / METRICS_FILE)
    except OSError:  # unreadable: no proof either way, as before this check
        return None
    ends = [r.get("step") for r in records if r.get("event") == "end"]
    if ends:
        return f"its {METRICS_FILE} records the run's end at step {ends[-1]}"
    saved = [r.get("step") for r in records if r.get("event") == "saved"]
    if saved:
        return f"its {METRICS_FILE} records the checkpoint of step {saved[-1]} written"
    return None


def clear_run_files(folder: Path) -> None:
    """Remove the files of a previous run before a new one starts in the folder (the lock is held).

    run.json stays: the new run replaces it atomically, so a kill in between never leaves a folder
    that the printed resume command cannot continue. The deltas and metrics.jsonl (the proofs of
    `lost_checkpoint`) go before checkpoint.pt, so a kill in between never leaves a proof of a
    checkpoint without it; the shards of a distributed run's checkpoints go after it.
    """
    remove_deltas(Path(folder) / CHECKPOINT_NAME)
    for name in sorted(RUN_FILES, key=lambda n: n == CHECKPOINT_NAME):  # checkpoint.pt last
        if name != RUN_FILE:
            (Path(folder) / name).unlink(missing_ok=True)
    (Path(folder) / BEST_DIR / CHECKPOINT_NAME).unlink(missing_ok=True)
    for checkpoint in (Path(folder), Path(folder) / BEST_DIR):  # the ranks' shards, once no checkpoint names them
        shutil.rmtree(checkpoint / SHARDS_DIR, ignore_errors=True)


def write_text(path: Path, text: str) -> None:
    """Write a whole text file or leave the old one (temp, fsync, rename); one-line errors."""
    try:
        atomic_write(Path(path), text.encode())
    except OSError as exc:
        raise RunFolderError(f"cannot write {path}: {exc.strerror or exc}") from None
