"""The checkpoint file format shared by full checkpoints and deltas: errors, reading, digests.

Every problem is a `CheckpointError` with one line naming the file; torch's own messages never
reach the user. The SHA-256 digest covers structure, numbers, strings and tensor bytes (torch's zip
reader checks no CRC, so a flipped bit in a tensor would otherwise load silently).

Example:
    >>> state = read_torch_file(Path("runs/x/checkpoint.pt"))  # doctest: +SKIP
    >>> check_structure_common(Path("runs/x/checkpoint.pt"), state)  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import struct
import warnings
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

import torch

from flowrec.spec.json_doc import version_problem

POSITION_KEYS = ("epoch", "batch", "step", "samples")


class CheckpointError(ValueError):
    """A checkpoint that cannot be written or used; the message is one line naming the file."""


def read_torch_file(path: Path, map_location: str | torch.device = "cpu",
                    what: str = "flowrec checkpoint", mmap: bool = False) -> Any:
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
            return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)
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


def check_header(path: Path, doc: Any, fmt: str, version: int, keys: tuple[str, ...], what: str) -> None:
    """`doc` is a dict of format `fmt` and `version` holding every one of `keys` (else one line)."""
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise CheckpointError(f"{path} is not a {what}")
    if problem := version_problem(doc.get("version"), version):
        raise CheckpointError(f"{path}: {what} {problem}")
    missing = [k for k in keys if k not in doc]
    if missing:
        raise CheckpointError(f"{path} is incomplete: missing {', '.join(missing)}")


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
    if state["skipped_batches"] < 0:  # a count: a resume went on warning that -5 of 20 batches were skipped
        raise CheckpointError(f"{path} is damaged: skipped_batches {state['skipped_batches']} is not a count")
    rng = state["rng"].get("torch")
    if not isinstance(rng, torch.Tensor) or rng.dtype != torch.uint8 or rng.shape != torch.get_rng_state().shape:
        raise CheckpointError(f"{path} is damaged: rng.torch is not a torch RNG state")
    body = {k: v for k, v in state.items() if k != "digest"}
    if content_digest(body) != state["digest"]:
        raise CheckpointError(f"{path} is damaged: its content does not match its digest")


def content_digest(value: Any, tensor_bytes: Callable[[torch.Tensor], Iterable[Any]] | None = None) -> str:
    """SHA-256 of a checkpoint's content: structure, numbers, strings and tensor bytes.

    Args:
        value: the checkpoint content.
        tensor_bytes: the bytes of a tensor's content, in order, as buffers (default: the tensor's
            own; a streamed checkpoint hands out its tables' rows as taken, chunk by chunk).
    """
    h = hashlib.sha256()
    _feed(h, value, tensor_bytes or _own_bytes)
    return h.hexdigest()


DIGEST_CHUNK_BYTES = 64 << 20  # bytes of a tensor hashed in one call: a signal's handler runs between calls
# (one call over a 2 GB table held off a SIGTERM for seconds); the digest is the same whatever the chunks


def _own_bytes(t: torch.Tensor) -> Iterable[Any]:
    t = t.detach().cpu().contiguous()
    if not t.numel():
        return ()
    data = t.reshape(-1).view(torch.uint8).numpy()
    return (data[start:start + DIGEST_CHUNK_BYTES] for start in range(0, len(data), DIGEST_CHUNK_BYTES))


def _feed(h: Any, value: Any, tensor_bytes: Callable[[torch.Tensor], Iterable[Any]]) -> None:
    if isinstance(value, torch.Tensor):
        h.update(f"T{value.dtype}{tuple(value.shape)}".encode())
        for part in tensor_bytes(value):
            h.update(part)
    elif isinstance(value, Mapping):
        h.update(b"D%d" % len(value))
        for key in sorted(value, key=repr):
            _feed(h, key, tensor_bytes)
            _feed(h, value[key], tensor_bytes)
    elif isinstance(value, (list, tuple)):
        h.update(b"L%d" % len(value))
        for item in value:
            _feed(h, item, tensor_bytes)
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
