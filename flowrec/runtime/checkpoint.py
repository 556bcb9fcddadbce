"""Atomic checkpoints: write to a temp file in the same folder, fsync, rename.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts only, so it loads with
`torch.load(weights_only=True)`; a crash mid-write never leaves a half-written `checkpoint.pt`.

Example:
    >>> save_checkpoint(Path("runs/x/checkpoint.pt"), {"step": 3})   # doctest: +SKIP
"""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch

CHECKPOINT_NAME = "checkpoint.pt"


def save_checkpoint(path: Path, state: dict[str, Any]) -> None:
    """Write `state` atomically to `path` (temp file + fsync + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".ckpt-", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def load_checkpoint(path: Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Load a checkpoint with `weights_only=True` (no arbitrary code runs on load).

    Args:
        path: a checkpoint file, or a run folder holding `checkpoint.pt`.
    """
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT_NAME
    if not path.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}")
    return torch.load(path, map_location=map_location, weights_only=True)
