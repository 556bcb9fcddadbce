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

import hashlib
import struct
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from flowrec.runtime.atomic import write_atomically

CHECKPOINT_NAME = "checkpoint.pt"
CHECKPOINT_FORMAT = "flowrec-checkpoint"
CHECKPOINT_VERSION = 2  # 2: content digest and skipped-batch count
REQUIRED_KEYS = ("format", "version", "digest", "spec", "plan", "model", "dense_optimizer", "rng",
                 "position", "skipped_batches")
POSITION_KEYS = ("epoch", "batch", "step", "samples")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message is one line naming the file."""


def write_state(state: dict[str, Any], file: Any) -> None:
    """Serialize a checkpoint dict into an open binary file (the seam tests fail on purpose)."""
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
    try:
        write_atomically(path, lambda f: (writer or write_state)(full, f))
    except OSError as exc:
        raise CheckpointError(f"could not write checkpoint {path}: {exc.strerror or exc}; "
                              f"the previous checkpoint is intact") from None
    return full["digest"]


def checkpoint_path(path: Path) -> Path:
    """The checkpoint file of a run folder, or `path` itself when it is a file."""
    path = Path(path)
    return path / CHECKPOINT_NAME if path.is_dir() else path


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load and check a checkpoint (`weights_only=True`: no code in the file runs), with its
    incremental deltas applied (`flowrec.runtime.checkpoint_delta`): the newest state of the run.

    Args:
        path: a checkpoint file, or a run folder holding `checkpoint.pt`.

    Raises:
        CheckpointError: missing, empty, truncated, damaged, foreign or hostile file, another
            version, or missing keys; one line naming the file.
    """
    path = checkpoint_path(path)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint {path}: {exc.strerror}") from None
    if size == 0:
        raise CheckpointError(f"checkpoint {path} is empty (0 bytes)")
    state = read_torch_file(path, map_location)
    check_structure(path, state)
    from flowrec.runtime.checkpoint_delta import apply_deltas  # deltas read the helpers above

    return apply_deltas(path, state, map_location)


def read_torch_file(path: Path, map_location: str | torch.device = "cpu",
                    what: str = "flowrec checkpoint") -> Any:
    """`torch.load(weights_only=True)` with every failure as a one-line CheckpointError."""
    path = Path(path)
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as exc:
        raise CheckpointError(f"cannot read {path}: {exc.strerror}") from None
    if magic[:2] != b"PK":
        raise CheckpointError(f"{path} is not a {what} (not a torch zip archive)")
    try:
        with warnings.catch_warnings():  # torch warns about odd pickle protocols of damaged files
            warnings.simplefilter("ignore")
            return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # any failure to parse the file is a damaged file, reported in our words
        raise CheckpointError(f"{path} is not a usable {what}: {_reason(exc)}") from None


def _reason(exc: BaseException) -> str:
    import pickle

    if isinstance(exc, pickle.UnpicklingError) and "weights_only" in str(exc).lower():
        return "damaged, or it holds objects a checkpoint never holds (refused without running them)"
    text = str(exc).lower()
    if "central directory" in text or "zip" in text or "archive" in text:
        return "damaged or truncated archive, or a zip file that is not a checkpoint"
    return f"damaged or truncated ({type(exc).__name__})"


def check_structure(path: Path, state: Any) -> None:
    """Format, version, keys, types and digest of a loaded full checkpoint."""
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(f"{path} is not a flowrec checkpoint (a torch file of something else)")
    if state.get("version") != CHECKPOINT_VERSION:
        raise CheckpointError(f"{path} is checkpoint version {state.get('version')!r}; this flowrec reads "
                              f"version {CHECKPOINT_VERSION}")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path} is incomplete: missing {', '.join(missing)}")
    check_structure_common(path, state)


def check_structure_common(path: Path, state: dict[str, Any]) -> None:
    """Types, position, RNG and digest: the checks full checkpoints and deltas share."""
    expected = {"spec": str, "plan": str, "model": dict, "dense_optimizer": dict, "rng": dict,
                "position": dict, "skipped_batches": int, "digest": str}
    wrong = [k for k, kind in expected.items() if not isinstance(state[k], kind)]
    if wrong:
        raise CheckpointError(f"{path} is damaged: {', '.join(wrong)} has the wrong type")
    position = state["position"]
    if sorted(position) != sorted(POSITION_KEYS) or not all(
            isinstance(position[k], int) and position[k] >= 0 for k in POSITION_KEYS):
        raise CheckpointError(f"{path} is damaged: position {position!r} is not a training position")
    rng = state["rng"].get("torch")
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise CheckpointError(f"{path} is damaged: rng.torch is not a torch RNG state")
    body = {k: v for k, v in state.items() if k != "digest"}
    if content_digest(body) != state["digest"]:
        raise CheckpointError(f"{path} is damaged: its content does not match its digest")


def check_tensors(path: Path, what: str, expected: Mapping[str, torch.Tensor], got: Any) -> None:
    """Same keys, shapes and dtypes as `expected` (the model the checkpoint is loaded into)."""
    if not isinstance(got, Mapping):
        raise CheckpointError(f"{path} is damaged: {what} is not a dict of tensors")
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    if missing or extra:
        detail = f"missing {', '.join(missing[:3])}" if missing else f"unexpected {', '.join(extra[:3])}"
        raise CheckpointError(f"{path} does not fit the spec's model: {what} {detail}")
    for key, ref in expected.items():
        value = got[key]
        if not isinstance(value, torch.Tensor) or value.shape != ref.shape or value.dtype != ref.dtype:
            shown = (f"{tuple(value.shape)} {value.dtype}" if isinstance(value, torch.Tensor)
                     else type(value).__name__)
            raise CheckpointError(f"{path} does not fit the spec's model: {what} {key} is {shown}, "
                                  f"expected {tuple(ref.shape)} {ref.dtype}")


def content_digest(value: Any) -> str:
    """SHA-256 of a checkpoint's content: structure, numbers, strings and tensor bytes."""
    h = hashlib.sha256()
    _feed(h, value)
    return h.hexdigest()


def _feed(h: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor):
        t = value.detach().cpu().contiguous()
        h.update(f"T{t.dtype}{tuple(t.shape)}".encode())
        if t.numel():
            h.update(t.reshape(-1).view(torch.uint8).numpy())
    elif isinstance(value, Mapping):
        h.update(b"D%d" % len(value))
        for key in sorted(value, key=repr):
            _feed(h, key)
            _feed(h, value[key])
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d" % len(value))
        for item in value:
            _feed(h, item)
    elif isinstance(value, bool) or value is None:
        h.update(f"B{value}".encode())
    elif isinstance(value, int):
        h.update(f"I{value}".encode())
    elif isinstance(value, float):
        h.update(b"F" + struct.pack("<d", value))
    elif isinstance(value, str):
        h.update(b"S%d:" % len(value.encode()) + value.encode())
    elif isinstance(value, bytes):
        h.update(b"Y%d:" % len(value) + value)
    else:
        h.update(f"O{type(value).__name__}{value!r}".encode())
