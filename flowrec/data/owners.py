"""What owns a folder: a training run, a model package, a dataset or an encoder, told by their
marker files. A leaf module (flowrec.data.layout names an owned folder given as a dataset with
it; flowrec.data.output_guard keeps outputs out of owned folders).

Example:
    >>> owner_of(Path("/")) is None
    True
"""
from __future__ import annotations

import os
from pathlib import Path

META_FILE = "_flowrec.json"  # a dataset's record (flowrec.data.layout's META_FILE)

# what marks a folder as owned, and by what: marker file -> the bytes its start must hold (None:
# any file); tests hold these names equal to the owners' constants
OWNERS = (
    ("a training run", {"checkpoint.pt": None, "run.json": None, ".flowrec.lock": None}),
    ("a model package", {"manifest.json": b'"flowrec-model"'}),
    # a split written by `data convert --test-fraction` (OUT/train, OUT/test) owns OUT; a dataset a
    # user happened to name `train` (its record holds no split part) does not own its parent
    ("a dataset", {META_FILE: None, f"train/{META_FILE}": b'"part": "train"'}),
    ("an encoder", {"encoder.json": b'"flowrec-encoder"'}),
)
MARKER_BYTES = 1 << 16  # bytes of a marker file searched for its format name
FOLLOW_FILE = "follow.json"  # a `--follow` stream folder's record of its days (flowrec.cli.streams)


def is_stream_folder(path: Path) -> bool:
    """True when `path` is a `--follow` stream folder (its follow.json, no checkpoint of its own)."""
    path = Path(path)
    return path.is_dir() and os.path.lexists(path / FOLLOW_FILE) and not os.path.lexists(path / "checkpoint.pt")


def owner_of(folder: Path) -> str | None:
    """What owns `folder` ("a training run", "a model package", ...), or None."""
    for owner, markers in OWNERS:
        if any(_marks(Path(folder) / name, needle) for name, needle in markers.items()):
            return owner
    return None


def _marks(path: Path, needle: bytes | None) -> bool:
    if needle is None:
        return os.path.lexists(path)
    if not path.is_file():  # never open a pipe or a device named like a marker (it could block)
        return False
    try:
        with open(path, "rb") as f:
            return needle in f.read(MARKER_BYTES)
    except OSError:
        return False
