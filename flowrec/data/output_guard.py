"""The one output guard of every command that writes (predict, eval, export, convert, synth,
calibrate, plan, profile).

An output never lands inside a folder flowrec owns for something else (a training run, a model
package, a dataset, an encoder folder: found by their marker files, in the output's folder and
every folder above it, symlinks resolved), never on one of the command's inputs (same resolved
path, inside an input folder, or the same file through a hard link: same st_dev / st_ino), and
never over an existing file without ``overwrite``. Files are written through `atomic_output`: a
temp file in the same folder renamed over the target when complete, so a failure or a kill
leaves the old file (or none); an output that is a link is written where it leads (`written_path`).
Temp names carry the process and the machine (`temp_tag`), so the next command removes only the
leftovers of killed commands of its own machine (`remove_leftovers`).

Example:
    >>> check_file_output(Path("scores.parquet"), [Path("pkg"), Path("rows.csv")], overwrite=False)  # doctest: +SKIP
    >>> with atomic_output(Path("scores.parquet")) as tmp:  # doctest: +SKIP
    ...     write(tmp)
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import shutil
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from flowrec.data.layout import DataError
from flowrec.data.owners import MARKER_BYTES, OWNERS, owner_of  # noqa: F401 (the guard's names)
from flowrec.spec.units import format_bytes

MAX_INPUT_FILES = 100_000  # files of a folder looked at (an input's part files, a replaced folder's entries)


class OutputError(DataError):
    """An output the guard refuses; the message is one line naming it."""


def owning_folder(path: Path) -> tuple[Path, str] | None:
    """The nearest folder at or above `path` (resolved) that flowrec owns, with its owner."""
    resolved = Path(path).resolve()
    for folder in (resolved, *resolved.parents):
        owner = owner_of(folder)
        if owner is not None:
            return folder, owner
    return None


def check_replacing_own_output(out: Path, own: Callable[[Path], bool], what: str) -> None:
    """Raise ValueError (one line) when `--overwrite` would replace an existing file that is not
    `what` the command writes (`own(out)` False; an empty file is replaced). The guard knows only a
    command's inputs, so `eval --json` and `predict --out` replaced the spec or the raw training
    CSV they never read: each replaces only its own earlier output."""
    if not os.path.lexists(out) or not out.is_file() or out.stat().st_size == 0:
        return
    if not own(out):
        raise ValueError(f"refusing to replace {out}: it is not {what}, the only file --overwrite replaces; "
                         "give another file")


OWN_JSON_LIMIT = 1 << 27  # bytes of an existing JSON output read to tell what it is (128 MiB: a plan of 10^5 fields)
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def holds_kind(path: Path, kind: str) -> bool:
    """Whether the file `path` is an output of `kind`: 'dot' (Graphviz text), 'svg', 'png', or the
    `format` a JSON document of flowrec's names ('flowrec-plan', 'flowrec-access-profile', ...).

    >>> import tempfile
    >>> d = Path(tempfile.mkdtemp())
    >>> _ = (d / "p.json").write_text('{"format": "flowrec-plan", "version": 1}')
    >>> _ = (d / "s.yaml").write_text("name: x\\n")
    >>> holds_kind(d / "p.json", "flowrec-plan"), holds_kind(d / "p.json", "svg"), holds_kind(d / "s.yaml", "dot")
    (True, False, False)
    """
    if kind not in ("dot", "svg", "png"):
        return holds_json(path, lambda doc: isinstance(doc, dict) and doc.get("format") == kind)
    try:
        with open(path, "rb") as f:
            head = f.read(4096)
    except OSError:
        return False
    text = head.lstrip().lower()
    return (head.startswith(PNG_MAGIC) if kind == "png"
            else text.startswith((b"digraph", b"strict digraph")) if kind == "dot"
            else text.startswith((b"<svg", b"<?xml")) and b"<svg" in text)


def holds_json(path: Path, accept: Callable[[Any], bool], limit: int = OWN_JSON_LIMIT) -> bool:
    """Whether the file `path` is a JSON document (of at most `limit` bytes) that `accept` takes."""
    import json

    try:
        with open(path, "rb") as f:
            return accept(json.loads(f.read(limit)))
    except (OSError, ValueError):  # not JSON, not UTF-8, or longer than any such output
        return False


def written_path(out: Path) -> Path:
    """Where the output `out` is written: `out`, or what it names where it is a link (links
    resolved), which the new file or folder replaces, the link kept. Renaming the new output over
    the link replaced the link and left what it named as it was: `--overwrite latest` (a link to
    a dataset on another disk) wrote the new dataset beside the link, and the old one lived on
    where no name of the user's led any more.

    >>> written_path(Path("scores.csv"))
    PosixPath('scores.csv')
    """
    out = Path(out)
    return out.resolve() if out.is_symlink() else out


def check_file_output(out: Path, inputs: Sequence[Path], overwrite: bool) -> None:
    """Raise OutputError unless the file `out` may be (re)written by a command reading `inputs`."""
    out = Path(out)
    parent = _existing_parent(out)
    owned = owning_folder(parent) or owning_folder(out.resolve().parent)  # a link into such a folder
    if owned is not None:
        raise OutputError(f"refusing to write {out}: it lies in {owned[0]}, {owned[1]}'s folder (flowrec "
                          "writes there only for it); write the output elsewhere")
    if out.is_dir():
        raise OutputError(f"{out} is a folder; give a file name")
    if os.path.lexists(out) and not out.is_file():
        raise OutputError(f"refusing to write {out}: it is not a regular file (a device, pipe, socket or "
                          "broken link)")
    _check_inputs(out, inputs)
    if os.path.lexists(out) and not overwrite:
        raise OutputError(f"{out} exists; give --overwrite to replace it")
    _make_parents(out)


def check_folder_output(out: Path, inputs: Sequence[Path], overwrite: bool, kind: str,
                        rows: Sequence[Path] = ()) -> None:
    """Raise OutputError unless the folder `out` may be created, or replaced (with `overwrite`)
    when it is empty or holds `kind` ("a model package", "a dataset"); never inside a folder of
    `rows`, the raw rows the command reads (`_check_not_inside_inputs`)."""
    out = Path(out)
    owned = owning_folder(_existing_parent(out)) or owning_folder(written_path(out).parent)  # a link into one
    if owned is not None:
        raise OutputError(f"refusing to write {out}: it lies in {owned[0]}, {owned[1]}'s folder (flowrec "
                          "writes there only for it)")
    if os.path.lexists(out) and not out.is_dir():
        raise OutputError(f"{out} is a file; give a folder for the output")
    owner = owner_of(out) if out.is_dir() else None
    if owner is not None and owner != kind:
        raise OutputError(f"refusing to write {out}: it is {owner}'s folder, not {kind}'s")
    _check_inputs(out, inputs)
    _check_not_inside_inputs(out, rows)
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise OutputError(f"{out} is not empty; give --overwrite to replace it")
    held = _owned_below(out) if owner is None and out.is_dir() else None
    if held is not None:
        raise OutputError(f"refusing to replace {out}: it holds {held[1]}'s folder {held[0]}, which only "
                          "that owner writes")
    mine = _a_file_below(out) if owner is None and out.is_dir() else None
    if mine is not None:
        raise OutputError(f"refusing to replace {out}: it is not {kind}'s folder (it holds {mine}), and "
                          f"--overwrite replaces only {kind} flowrec wrote; give an empty or new folder")
    _make_parents(out)


def _existing_parent(out: Path) -> Path:
    """The nearest folder above `out` that exists (missing ones are made once every check passed);
    a file on the way is an error."""
    for folder in out.absolute().parents:
        if folder.is_dir():
            return folder
        if os.path.lexists(folder):
            raise OutputError(f"cannot write {out}: {folder} is not a folder")
    raise OutputError(f"cannot write {out}: no folder above it exists")


def _make_parents(out: Path) -> None:
    """Create the missing folders above `out` (as `mkdir -p`), after every check passed, and make
    sure a file can be written there: `flowrec eval RUN --json ro/m.json` scored the whole run, then
    said 'cannot write' (a read-only mount, a folder of another user), its work lost."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputError(f"cannot create folder {out.parent}: {exc.strerror or exc}") from None
    try:
        handle, probe = tempfile.mkstemp(prefix=".flowrec-probe-", dir=out.parent)
    except OSError as exc:
        raise OutputError(f"cannot write {out}: {exc.strerror or exc} (its folder {out.parent} takes no new "
                          "file)") from None
    os.close(handle)
    os.unlink(probe)


def _owned_below(folder: Path) -> tuple[Path, str] | None:
    """The first folder below `folder` that flowrec owns (bounded walk), or None."""
    for n, path in enumerate(folder.rglob("*")):
        if n >= MAX_INPUT_FILES:
            return None
        owner = owner_of(path) if path.is_dir() and not path.is_symlink() else None
        if owner is not None:
            return path, owner
    return None


def _a_file_below(folder: Path) -> str | None:
    """The path (relative to `folder`, shown escaped as `repr` shows it where needed) of the first
    thing below `folder` that is not a folder (a file, a link, a pipe), or of the entry at which a
    bounded walk stopped; None when `folder` holds only (empty) folders. `--overwrite` of a
    dataset or package folder once replaced a folder of the user's own files whole, no flowrec
    output among them (`data synth --out ~/notes --overwrite`)."""
    for n, path in enumerate(folder.rglob("*")):
        if n >= MAX_INPUT_FILES or path.is_symlink() or not path.is_dir():
            name = str(path.relative_to(folder))
            return name if name.isprintable() else repr(name)
    return None


def _check_inputs(out: Path, inputs: Sequence[Path]) -> None:
    """The output is none of the inputs, holds none, and is no file of one (same inode: a hard
    link, or a file inside an input folder); a new file inside an input folder replaces nothing."""
    target = out.resolve()
    written = identity(out)
    for given in inputs:
        source = Path(given).resolve()
        if target == source or source.is_relative_to(target):
            raise OutputError(f"refusing to write {out}: it would replace {given}, which this command reads "
                              "(or writes as another output)")
        if written is not None and written in _identities(source):
            raise OutputError(f"refusing to write {out}: it is the input {given} (the same file, linked)")


def _check_not_inside_inputs(out: Path, rows: Sequence[Path]) -> None:
    """A folder output is not inside a folder of raw rows the command reads: `data convert parquet
    raw raw/out` wrote the dataset among the raw rows, so the next conversion (or a run bound to
    `raw`) refused `raw` as an encoded dataset, and a reader of every file below it would take the
    dataset's parts for rows."""
    target = out.resolve()
    for given in rows:
        source = Path(given).resolve()
        if source.is_dir() and target.is_relative_to(source):
            raise OutputError(f"refusing to write {out}: it lies in {given}, the folder of rows this command reads, and "
                              f"a later read of {given} would find it among its files; write the output elsewhere")


def identity(path: Path) -> tuple[int, int] | None:
    """(st_dev, st_ino) of what `path` names now (through a link: what it names); None if nothing."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    return info.st_dev, info.st_ino


def _identities(path: Path) -> set[tuple[int, int]]:
    """(st_dev, st_ino) of `path` and, for a folder, of the files in it (bounded)."""
    found = {i for i in [identity(path)] if i is not None}
    if path.is_dir():
        for n, child in enumerate(path.rglob("*")):
            if n >= MAX_INPUT_FILES:
                break
            known = identity(child)
            if known is not None:
                found.add(known)
    return found


SHORT_BYTES = 200  # of an output's name in the names of its temp files: the rest (55 bytes) holds their tag


def short(name: str) -> str:
    """`name` cut to SHORT_BYTES bytes (whole characters), for a temp file named after it: a name the
    file system holds (255 bytes) gave a temp name it did not ('File name too long' for a valid name).

    >>> len(short("x" * 250)), short("day1")
    (200, 'day1')
    """
    return os.fsencode(name)[:SHORT_BYTES].decode("utf-8", "ignore") if len(os.fsencode(name)) > SHORT_BYTES else name


STALE_AFTER_S = 7 * 24 * 3600  # seconds a leftover of another machine (or without one) goes unmodified before it is removed


def host_tag() -> str:
    """This machine's tag in temp names: 8 hex digits of a hash of its host name. A folder shared
    between machines (NFS, a cluster's home) holds temp names of several; a PID is a process of
    the machine that made the name only."""
    import hashlib
    import socket

    return hashlib.sha256(socket.gethostname().encode("utf-8", "surrogateescape")).hexdigest()[:8]


def temp_tag() -> str:
    """`PID-HOST-X` of a temp name made now: this process, this machine (`host_tag`), 8 random hex
    digits (two temp names of one process differ)."""
    return f"{os.getpid()}-{host_tag()}-{secrets.token_hex(4)}"


def _leftover_patterns(out: Path) -> tuple[re.Pattern[str], re.Pattern[str]]:
    """The names flowrec gives its temp folders and files of the output `out` (a folder's: staged
    `.OUT.partial-TAG`, set aside `.OUT.old-TAG`, an old one being removed `.OUT.gone-TAG`,
    export's `.OUT.export-TAG`; a file's,
    `atomic_output`'s: `.STEM.TAG.tmpSUFFIX`), TAG being `temp_tag`'s `PID-HOST-X`: groups `pid` and
    `host`. An older flowrec wrote `PID-X` (no host: group `host` None), and its export staged in
    `.OUT.export-tmp` (neither)."""
    tag = r"(?P<pid>\d+)(?:-(?P<host>[0-9a-f]{8}))?-[0-9a-f]{8}"
    folders = re.compile(rf"\.{re.escape(short(out.name))}\.(?:(?P<kind>partial|old|gone|export)-{tag}|export-tmp)")
    files = re.compile(rf"\.{re.escape(short(out.stem))}\.{tag}\.tmp{re.escape(out.suffix)}")
    return folders, files


def running(pid: int) -> bool:
    """Whether a process `pid` runs on this machine (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's; a number no process has is not ours to judge
        return True
    return True


def remove_leftovers(out: Path, status: Callable[[str], None] | None = None) -> list[tuple[Path, int]]:
    """Remove the temp folders and files of the output `out` that a flowrec command killed while it
    wrote them left beside it (kill -9, the out-of-memory killer: no cleanup runs), each with its
    size in bytes; `status` is told, in one line, what was removed. Only names of flowrec's exact
    patterns (`_leftover_patterns`) are removed, and of those only: this machine's (`host_tag`)
    whose process no longer runs, never the temp of a command writing `out` now; another
    machine's, or an older flowrec's (no host in the name), once nothing in it was modified for
    STALE_AFTER_S (its PID names no process here: on a shared folder the next command of one
    machine removed another's output while it was written). Those left are named in one line. An
    old `out` set aside by a command killed before its new one was in place is put back
    (`_set_aside_put_back`), and a set-aside link goes, never the folder it names."""
    out = Path(out)
    folders, files = _leftover_patterns(out)
    try:
        entries = list(os.scandir(out.parent if str(out.parent) else "."))
    except OSError:  # no folder yet: nothing left there
        return []
    gone: list[tuple[Path, re.Match[str]]] = []
    left: list[str] = []
    here = host_tag()
    for entry in entries:
        matched = folders.fullmatch(entry.name)
        is_folder = matched is not None
        matched = matched or files.fullmatch(entry.name)
        aside_link = is_folder and matched.group("kind") == "old" and entry.is_symlink()  # an older flowrec's
        if matched is None or not (entry.is_dir(follow_symlinks=False) or aside_link if is_folder
                                   else entry.is_file(follow_symlinks=False)):
            continue
        path = Path(entry.path)
        if matched.group("host") == here:
            pid = int(matched.group("pid"))
            if pid == os.getpid() or running(pid):
                continue
        elif not _stale(path):  # another machine's, or an older flowrec's: its process may run there
            left.append(entry.name)
            continue
        gone.append((path, matched))
    back = _set_aside_put_back(out, gone)
    if back is not None and status is not None:
        status(f"restored {out} from {back.name}, where a flowrec command killed while it replaced {out} had "
               "set it aside (its new one was not in place yet)")
    removed: list[tuple[Path, int]] = []
    for path, matched in gone:
        if path == back:
            continue
        size = _size(path)
        if path.is_symlink() or not path.is_dir():  # a link set aside goes, never the folder it names
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
        if not os.path.lexists(path):
            removed.append((path, size))
    if removed and status is not None:
        status(f"removed {', '.join(f'{path.name} ({format_bytes(size)})' for path, size in removed)} beside {out}: "
               "left by flowrec commands killed while they wrote it (their processes no longer run)")
    if left and status is not None:
        status(f"left {', '.join(sorted(left))} beside {out}: temp output of a flowrec command on another machine, "
               f"or of an older flowrec, which may still be writing it; removed once unmodified for "
               f"{STALE_AFTER_S // 86400} days (remove it yourself if no command writes {out})")
    return removed


def _set_aside_put_back(out: Path, gone: list[tuple[Path, re.Match[str]]]) -> Path | None:
    """Rename back to `out` the old `out` that `replace_folder` set aside (`.OUT.old-TAG`), where
    the command was killed between its two renames: `out` is absent. The kill left the user's
    output only there, and the next command removed it as a leftover. A set-aside folder is whole:
    `replace_folder` renames it to `.OUT.gone-TAG` before removing it, so it is put back even where
    the killed command's staged folder was removed by hand since. An older flowrec's (no machine in
    the name) removed it under its set-aside name: put back only beside that command's staged
    folder (which shows the kill came between the renames). Returns the folder put back, or None."""
    if os.path.lexists(out):
        return None
    def command(m: re.Match[str]) -> tuple[str, str | None]:
        return m.group("pid"), m.group("host")

    staged = {command(m) for _, m in gone if m.groupdict().get("kind") in ("partial", "export")}
    aside = [(command(m) in staged, _mtime(path), path) for path, m in gone
             if m.groupdict().get("kind") == "old" and not path.is_symlink()
             and (command(m) in staged or m.group("host") is not None)]
    if not aside:
        return None
    path = max(aside)[2]  # a staged partner's first, then the newest
    try:
        os.rename(path, out)
    except OSError:
        return None
    return path


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return 0.0


def _stale(path: Path) -> bool:
    """Whether nothing in the file or folder `path` (the folder itself and what lies below it, at
    most MAX_INPUT_FILES entries; links not followed) was modified in the last STALE_AFTER_S."""
    import time

    since = time.time() - STALE_AFTER_S
    try:
        if path.lstat().st_mtime > since:
            return False
        seen = 0
        for root, folders, names in os.walk(path):  # a file: nothing below it
            for name in (*folders, *names):
                seen += 1
                if seen > MAX_INPUT_FILES or os.lstat(os.path.join(root, name)).st_mtime > since:
                    return False
    except OSError:  # changing while it is looked at: something writes it
        return False
    return True


def _size(path: Path) -> int:
    """Bytes of the file, or of the files below the folder, `path` (links not followed)."""
    if path.is_symlink() or not path.is_dir():
        return path.lstat().st_size
    total = 0
    for root, _, names in os.walk(path):
        for name in names:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


@contextmanager
def atomic_output(out: Path, overwrite: bool = True, status: Callable[[str], None] | None = None) -> Iterator[Path]:
    """Yield a temp path next to `out`; renamed over `out` when the block completes, removed when it
    fails (the old `out`, if any, is untouched until the rename). Without `overwrite` the file is
    put in place only where `out` is still absent (an OutputError otherwise): another process may
    have written it since the command checked it (two `predict --out F` at once each said they
    wrote F, the second over the first). The temp files of `out` that killed commands left are
    removed first (`remove_leftovers`, which tells `status`)."""
    out = written_path(out)  # a link keeps naming the output
    remove_leftovers(out, status)
    tmp = out.parent / f".{short(out.stem)}.{temp_tag()}.tmp{out.suffix}"  # suffix kept: writers
    # such as matplotlib choose the format by it
    try:
        yield tmp
        if overwrite:
            os.replace(tmp, out)
        else:
            _put_new(tmp, out)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def _put_new(tmp: Path, out: Path) -> None:
    """Give the file `tmp` the name `out` unless `out` exists (a hard link, atomic; where the file
    system has none, a check then a rename), then drop the name `tmp`."""
    try:
        os.link(tmp, out)
    except FileExistsError:
        raise OutputError(f"{out} was written by another process while this one ran; give --overwrite to "
                          "replace it") from None
    except OSError:  # no hard links here (EPERM, ENOTSUP, EMLINK)
        if os.path.lexists(out):
            raise OutputError(f"{out} was written by another process while this one ran; give --overwrite to "
                              "replace it") from None
        os.replace(tmp, out)
        return
    tmp.unlink()


def replace_folder(new: Path, out: Path, overwrite: bool = True) -> None:
    """Rename the complete folder `new` to `out`; an existing `out` is moved aside first, put back
    if the rename fails, and deleted after, so `out` is always the old folder or the new one (an
    `out` that is a link to a folder is replaced as a link: the folder it names is left as it is;
    the commands give the folder a link names, `written_path`, staged beside it).
    Without `overwrite`, `out` must be absent or an empty folder when the rename happens (an
    OutputError otherwise, `new` left to the caller): another process may have written it since
    the command checked it (two exports into one new OUT each said they wrote it, the second over
    the first)."""
    new, out = Path(new), Path(out)
    if not overwrite and not os.path.islink(out):  # (a link to an empty folder is replaced as below)
        try:  # atomic: the kernel refuses to rename a folder over a non-empty one
            os.rename(new, out)
        except OSError as exc:
            if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR):
                raise
            raise OutputError(f"{out} was written by another process while this one ran; give --overwrite to "
                              "replace it") from None
        return
    if not os.path.lexists(out):
        os.rename(new, out)
        return
    tag = temp_tag()
    old = out.parent / f".{short(out.name)}.old-{tag}"
    with _interrupts_held():  # a Ctrl-C or SIGTERM between the renames left no `out` at all (the old
        os.rename(out, old)  # folder hidden aside, the new one removed as unfinished), and one in the
        try:  # removal after them a hidden, half-removed old folder and a command that said it was
            os.rename(new, out)  # interrupted though `out` was new: the swap and the removal finish, and
        except OSError:  # the command with them (its output is complete)
            os.rename(old, out)
            raise
        if old.is_symlink():  # `out` was a link: the link goes, never the folder it names (which
            old.unlink()  # rmtree refuses, and ignore_errors would have left the link behind)
        else:  # renamed first: a kill in the removal leaves a `.gone-` folder, never a half-removed `.old-`
            gone = out.parent / f".{short(out.name)}.gone-{tag}"  # (one `_set_aside_put_back` would restore)
            try:
                os.rename(old, gone)
            except OSError:
                gone = old
            shutil.rmtree(gone, ignore_errors=True)


@contextmanager
def _interrupts_held() -> Iterator[None]:
    """Within: Ctrl-C, SIGTERM and SIGHUP do nothing (main thread only; a signal there is dropped,
    the work within being the end of the command's)."""
    import signal

    from flowrec.data.interrupts import handlers_installed, stop_signals

    with handlers_installed({sig: signal.SIG_IGN for sig in (signal.SIGINT, *stop_signals())}):
        yield
