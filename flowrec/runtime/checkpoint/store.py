"""Checkpoints that are atomic on write and checked on every load.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
`torch.load(weights_only=True)`. Writing goes to a temp file in the same folder, is fsynced, then
renamed over `checkpoint.pt`: a crash, a kill or a full disk never leaves a half-written checkpoint
and never harms the previous one. Every load checks the format, the version, that every expected
key is there, and a SHA-256 digest of the whole content (torch's zip reader checks no CRC, so a
flipped bit in a tensor would otherwise load silently). Every problem is a `CheckpointError` with
one line naming the file; torch's own messages never reach the user.

Example:
    >>> save_checkpoint(Path("runs/x/checkpoint.pt"), state)   # doctest: +SKIP
    >>> state = load_checkpoint(Path("runs/x"))                 # doctest: +SKIP
"""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch
from torch.utils.serialization import config as serialization_config

from flowrec.runtime.atomic import write_atomically
from flowrec.runtime.checkpoint.delta import apply_deltas
from flowrec.runtime.checkpoint.shards import ShardRows, assemble_shards
from flowrec.runtime.checkpoint.format import (
    CheckpointError,
    check_header,
    check_structure_common,
    content_digest,
    read_torch_file,
)
from flowrec.data.run_paths import BEST_DIR, CHECKPOINT_NAME, RUN_FILE
from flowrec.runtime.managed_state import MANAGED_PREFIX
from flowrec.runtime.messages import first_line, not_a_file

DISK_MARGIN = 1.05  # a write failing with less free space than this x the tensors' bytes: the disk is full
CHECKPOINT_FORMAT = "flowrec-checkpoint"
CHECKPOINT_VERSION = 2  # 2: content digest and skipped-batch count
LOAD_TRIES = 5  # reads of a run that keeps replacing its checkpoint under them (eval while it trains)
REQUIRED_KEYS = ("format", "version", "digest", "spec", "plan", "model", "dense_optimizer", "rng",
                 "position", "skipped_batches")


def write_state(state: dict[str, Any], file: Any) -> None:
    """Serialize a checkpoint dict into an open binary file (the seam tests fail on purpose).

    The archive's per-record CRC-32 is not computed: the content digest covers every byte and is
    checked on every load (torch's reader checks no CRC), and the CRC took most of the write time
    of a multi-GiB table (2.1 GiB: ~3 s of ~4 s on the 2-core machine).
    """
    with serialization_config.patch({"save.compute_crc32": False}):
        torch.save(state, file)


def save_checkpoint(path: Path, state: dict[str, Any],
                    writer: Callable[[dict[str, Any], Any], None] | None = None) -> str:
    """Write `state` (plus its digest) atomically to `path`: temp file, fsync, rename.

    Args:
        path: the checkpoint file; its folder must exist.
        state: the checkpoint content (without `digest`).
        writer: serializes a dict to an open binary file (default `write_state`).

    Returns:
        The content digest written into the file.

    Raises:
        CheckpointError: the disk is full, the folder is not writable, ...; the previous checkpoint
            at `path` is untouched and no temp file is left.
    """
    path = Path(path)
    full = {**state, "digest": content_digest(state)}
    with write_errors(path, full):
        write_atomically(path, lambda f: (writer or write_state)(full, f))
    return full["digest"]


@contextmanager
def write_errors(path: Path, state: dict[str, Any]) -> Iterator[None]:
    """A failed write of checkpoint `path` (holding `state`) as one `CheckpointError` line that
    says the previous checkpoint is intact (the write is atomic), or, for the first checkpoint at
    `path` (nothing there, and not a delta, which always has its base), that none was saved."""
    kept = ("the previous checkpoint is intact" if path.exists() or ".delta-" in path.name
            else "no checkpoint was there before it")
    try:
        yield
    except OSError as exc:
        raise CheckpointError(f"could not write checkpoint {path}: {exc.strerror or exc}; {kept}") from None
    except RuntimeError as exc:  # torch's zip writer reports a full disk as "unexpected pos ..."
        raise CheckpointError(f"could not write checkpoint {path}: {write_failure(path, state, exc)}; "
                              f"{kept}") from None


def write_failure(path: Path, state: dict[str, Any], exc: RuntimeError) -> str:
    """Why torch.save failed: a disk without room for the state's tensors, else its first line."""
    need = tensor_bytes(state)
    try:
        free = shutil.disk_usage(path.parent).free
    except OSError:
        free = None
    if free is not None and free < need * DISK_MARGIN:
        return f"its disk has {free / 2**20:,.0f} MiB free and the checkpoint needs about {need / 2**20:,.0f} MiB"
    return f"torch.save failed ({first_line(exc)})"


def tensor_bytes(value: Any) -> int:
    """Bytes of the tensors in a nested dict / list / tuple."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


SPEC_SUFFIXES = (".yaml", ".yml", ".json")  # a spec file given where a run or checkpoint goes


def checkpoint_path(path: Path) -> Path:
    """The checkpoint file of a run folder, or `path` itself when it is a file (or a folder named
    checkpoint.pt holding none: the checkpoint's place, which a second call named
    RUN/checkpoint.pt/checkpoint.pt in its line)."""
    path = Path(path)
    stray = path.name == CHECKPOINT_NAME and not (path / CHECKPOINT_NAME).exists()
    return path / CHECKPOINT_NAME if path.is_dir() and not stray else path


def _not_a_run(given: Path) -> str:
    """Why `given` holds no checkpoint, where a user's next step follows from it: a model package
    or a dataset given for a run, or RUN/best of a run that never wrote one (the help's `flowrec
    eval runs/ml/best` on a run without early stopping said only "no checkpoint at runs/ml/best")."""
    from flowrec.data.output_guard import owner_of

    folder = given if given.is_dir() else given.parent if given.name == CHECKPOINT_NAME else None
    if folder is not None and folder.is_dir():
        owner = owner_of(folder)
        if owner == "a model package":
            return (f": {folder} is a model package (from `flowrec export`), not a run folder; score raw rows "
                    f"with it: `flowrec predict {folder} RAW --out FILE`, in Python flowrec.load_model({str(folder)!r})")
        if owner in ("a dataset", "an encoder"):
            return f": {folder} is {owner}'s folder, not a run folder"
    elif given.name == BEST_DIR and ((given.parent / RUN_FILE).is_file() or (given.parent / CHECKPOINT_NAME).is_file()):
        return (f": a run writes {BEST_DIR}/ only with training.early_stopping in its spec, at its best "
                f"evaluation; {given.parent} holds the run's last checkpoint")
    elif not given.exists() and not given.is_symlink():
        return f": there is no such file or folder{_close_run(given)}"
    return ""


def _close_run(given: Path) -> str:
    """` (did you mean 'runs/ple'?)` for a run folder beside `given` of a really close name
    (`runs/pel` for `runs/ple`), else ""."""
    import difflib

    try:
        runs = sorted(p.name for p in given.parent.iterdir() if (p / CHECKPOINT_NAME).is_file())
    except OSError:  # the parent is missing or unreadable too
        return ""
    close = difflib.get_close_matches(given.name, runs, n=1)
    return f" (did you mean {str(given.parent / close[0])!r}?)" if close else ""


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu", mmap: bool = False,
                    lazy_shards: bool = False) -> dict[str, Any]:
    """Load and check a checkpoint (`weights_only=True`: no code in the file runs), with its
    incremental deltas applied (`flowrec.runtime.checkpoint.delta`) and the shards of a
    distributed run put back into whole tables (`flowrec.runtime.checkpoint.shards`): the newest
    state of the run, in the single-process layout.
    `mmap` maps the base checkpoint's tensors instead of reading them into memory (export).

    Args:
        path: a checkpoint file, or a run folder holding `checkpoint.pt`.
        mmap: map the tensors from the file instead of reading them (export: no second copy).
        lazy_shards: leave a distributed run's row-wise tables as their shards (`ShardRows`), for
            ranks that each copy only their own rows.

    Raises:
        CheckpointError: missing, empty, truncated, damaged, foreign or hostile file, another
            version, or missing keys; one line naming the file.
    """
    given, path = Path(path), checkpoint_path(path)
    for attempt in range(1, LOAD_TRIES + 1):
        if not path.is_file():
            kind = not_a_file(path)
            if kind is not None:  # a folder, a FIFO ...: "no checkpoint at" said neither
                raise CheckpointError(f"{path} is {kind}, not a checkpoint file")
            raise CheckpointError(f"no checkpoint at {path}{_not_a_run(given)}")
        try:
            read = path.stat()
        except OSError as exc:
            raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
        if read.st_size == 0:
            raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
        try:
            state = read_torch_file(path, map_location, mmap=mmap)
        except CheckpointError as exc:
            if path.name != CHECKPOINT_NAME and (path.parent / CHECKPOINT_NAME).is_file():  # runs/first/spec.json
                raise CheckpointError(f"{exc}; give the run folder it lies in, {path.parent}") from None
            if path.suffix.lower() in SPEC_SUFFIXES:  # `flowrec eval my_model.yaml`: the spec for its run
                raise CheckpointError(f"{exc}: a spec file's name; train it into a run first (`flowrec train "
                                      f"{path} --out RUN`) and give RUN") from None
            raise
        check_structure(path, state)
        try:
            state = apply_deltas(path, state, map_location, lambda read=read: _replaced(path, read))
            return assemble_shards(path, state, map_location, lazy=lazy_shards)
        except CheckpointError:
            if attempt == LOAD_TRIES or not _replaced(path, read):
                raise
        # the run is still training: it put a new full checkpoint in place while this load read the
        # one before, and removed that one's deltas (or shards) under it; read the new one
    raise AssertionError("the last try returns or raises")


def _replaced(path: Path, read: os.stat_result) -> bool:
    """`path` is no longer the file that was read (a new checkpoint was renamed over it)."""
    try:
        now = path.stat()
    except OSError:
        return True
    return (now.st_ino, now.st_dev) != (read.st_ino, read.st_dev)


def check_structure(path: Path, state: Any) -> None:
    """Format, version, keys, types and digest of a loaded full checkpoint."""
    check_header(path, state, CHECKPOINT_FORMAT, CHECKPOINT_VERSION, REQUIRED_KEYS, "flowrec checkpoint")
    check_structure_common(path, state)


def _key_text(key: Any) -> str:
    """A state dict's key as a message names it: a text as it is, anything else as its repr."""
    return key if isinstance(key, str) else repr(key)


def check_tensors(path: Path, what: str, expected: Mapping[str, torch.Tensor], got: Any) -> None:
    """Same keys, shapes and dtypes as `expected` (the model the checkpoint is loaded into)."""
    if not isinstance(got, Mapping):
        raise CheckpointError(f"{path} is damaged: {what} is not a dict of tensors")
    # a key that is no text (an edited checkpoint's 5) is named, not joined into a TypeError's traceback
    missing = sorted(map(_key_text, set(expected) - set(got)))
    extra = sorted(map(_key_text, set(got) - set(expected)))
    if missing or extra:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise CheckpointError(f"{path} does not fit the spec's model: {what} {detail}")
    for key, ref in expected.items():
        value = got[key]
        tensor = isinstance(value, (torch.Tensor, ShardRows))
        if tensor and key.startswith(MANAGED_PREFIX) and value.dim() == ref.dim() and value.dtype == ref.dtype:
            continue  # a managed map's length varies; the map checks itself when loaded
        if not tensor or value.shape != ref.shape or value.dtype != ref.dtype:
            shown = (f"{tuple(value.shape)} {value.dtype}" if tensor
                     else type(value).__name__)
            raise CheckpointError(f"{path} does not fit the spec's model: {what} {key} is {shown}, "
                                  f"expected {tuple(ref.shape)} {ref.dtype}")
