"""Incremental checkpoints: deltas on the last full checkpoint, applied on every load.

A delta file `checkpoint.delta-000003.pt` (next to `checkpoint.pt`) holds the packed-table rows
touched since the previous checkpoint with their optimizer state, plus the whole dense part, the
dense optimizer, RNG, data position and skipped-batch count. It names its base by the base's
digest and its place in the chain by `sequence` (1, 2, ...). Deltas are written like full
checkpoints (temp file, fsync, rename; SHA-256 digest), so a kill during a delta write leaves the
chain up to the previous delta, which is a consistent earlier state. Deltas of another base (left
when a new full checkpoint replaced the old one and the process died before removing them) are
ignored; a damaged delta, a gap in the chain or rows that do not fit the base are errors naming
the file.

A delta of a distributed run (version 2) also names, in `shards`, the delta shard file of each
rank (the rows of its row-wise shards touched since the previous checkpoint; see
`flowrec.runtime.checkpoint.shards`); its `tables` then hold the replicated groups. Applying it
records those files for `assemble_shards`, which puts their rows over the base's shards.

Example:
    >>> state = apply_deltas(Path("runs/x/checkpoint.pt"), base)  # doctest: +SKIP
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable

import torch

from flowrec.runtime.checkpoint.format import CheckpointError, check_header, check_structure_common, read_torch_file
from flowrec.runtime.checkpoint.shards import DELTA_SHARDS_KEY, without_deltas
from flowrec.runtime.managed_state import MANAGED_PREFIX

DELTA_FORMAT = "flowrec-checkpoint-delta"
DELTA_VERSION = 1
RANKS_DELTA_VERSION = 2  # a delta of a distributed run: it has `shards`
DELTA_KEYS = ("format", "version", "digest", "base", "sequence", "spec", "plan", "model", "tables",
              "dense_optimizer", "rng", "position", "skipped_batches")
CARRIED_KEYS = ("spec", "plan", "dense_optimizer", "rng", "position", "skipped_batches")
TABLE_KEYS = ("weight", "state")  # per packed group: embeddings.<group>.weight / .state
_DELTA_RE = re.compile(r"\.delta-(\d{6})$")


def delta_path(base: Path, sequence: int) -> Path:
    """The file of delta `sequence` (1, 2, ...) on the full checkpoint `base`."""
    return base.with_name(f"{base.stem}.delta-{sequence:06d}{base.suffix}")


def delta_files(base: Path) -> list[tuple[int, Path]]:
    """(sequence, file) of every delta file next to `base`, in sequence order."""
    found = []
    for path in base.parent.glob(f"{base.stem}.delta-*{base.suffix}"):
        match = _DELTA_RE.search(path.name[: len(path.name) - len(base.suffix)])
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def is_delta_name(name: str, base_name: str) -> bool:
    """`name` is a delta file of the full checkpoint named `base_name`."""
    base = Path(base_name)
    return name.startswith(f"{base.stem}.delta-") and name.endswith(base.suffix) and bool(
        _DELTA_RE.search(name[: len(name) - len(base.suffix)]))


def remove_deltas(base: Path) -> None:
    """Delete every delta file of `base` (after a new full checkpoint replaced it)."""
    for _, path in delta_files(base):
        path.unlink(missing_ok=True)


def apply_deltas(base_path: Path, state: dict[str, Any], map_location: Any = "cpu",
                 replaced: Callable[[], bool] = lambda: False) -> dict[str, Any]:
    """`state` (the loaded, checked full checkpoint) with its chain of deltas applied in order.
    `replaced`: whether `base_path` is no longer the file `state` was read from (a run that trains
    put a new one in place); a delta gone since the listing is then an error the load retries on,
    else it was a replaced base's, which the run removes after putting this one in place.

    Raises:
        CheckpointError: a damaged delta, a gap in the chain, or a delta that does not fit the base.
    """
    expected = 1
    files = delta_files(base_path)
    for at, (sequence, path) in enumerate(files):
        try:
            delta = read_torch_file(path, map_location, "flowrec checkpoint delta")
            check_delta(path, delta)
            if delta["base"] != state["digest"]:
                continue  # a delta of a replaced full checkpoint
            if delta["sequence"] != sequence or sequence != expected:
                raise CheckpointError(f"{path} does not follow delta {expected - 1} of {base_path.name} "
                                      f"(a delta of the chain is missing)")
            _apply(path, state, delta)
        except CheckpointError as exc:
            if not os.path.lexists(path) and not replaced():
                continue  # gone since the listing: the run put this base in place and removes the old deltas
            raise CheckpointError(f"{exc}; {without_deltas([p for _, p in files[at:]], _step(state))}") from None
        expected += 1
    return state


def _step(state: dict[str, Any]) -> int | None:
    """The step of a checked checkpoint state (None where its position has none)."""
    position = state.get("position")
    step = position.get("step") if isinstance(position, dict) else None
    return step if isinstance(step, int) else None


def check_delta(path: Path, delta: Any) -> None:
    """Format, version, keys, types and digest of a loaded delta."""
    ranks = isinstance(delta, dict) and delta.get("version") == RANKS_DELTA_VERSION
    check_header(path, delta, DELTA_FORMAT, RANKS_DELTA_VERSION if ranks else DELTA_VERSION,
                 DELTA_KEYS + (("shards",) if ranks else ()), "flowrec checkpoint delta")
    if not isinstance(delta["base"], str) or not isinstance(delta["sequence"], int) \
            or not isinstance(delta["tables"], dict) or (ranks and not isinstance(delta["shards"], dict)):
        raise CheckpointError(f"{path} is damaged: base, sequence, tables or shards has the wrong type")
    check_structure_common(path, delta)


def _apply(path: Path, state: dict[str, Any], delta: dict[str, Any]) -> None:
    model = state["model"]
    if ("shards" in delta) != ("shards" in state):
        raise CheckpointError(f"{path} does not fit its base: one of them is of a distributed run, the other not")
    tables = {f"{group}.{name}" for group in delta["tables"] for name in TABLE_KEYS}
    if set(delta["model"]) | tables != set(model):
        raise CheckpointError(f"{path} does not fit its base: its parameters are not those of the base")
    for key, value in delta["model"].items():
        _check_like(path, key, model.get(key), value)
    for group, part in delta["tables"].items():
        if not isinstance(part, dict) or not isinstance(part.get("rows"), torch.Tensor):
            raise CheckpointError(f"{path} is damaged: table rows of {group} are not a tensor")
        rows = part["rows"]
        for name in TABLE_KEYS:
            target = model.get(f"{group}.{name}")
            _check_rows(path, f"{group}.{name}", target, rows, part.get(name))
    for group, part in delta["tables"].items():
        for name in TABLE_KEYS:
            target = model[f"{group}.{name}"]
            if target.shape[1]:
                target.index_copy_(0, part["rows"], part[name])
    model.update(delta["model"])
    for key in CARRIED_KEYS:
        state[key] = delta[key]
    if "shards" in delta:
        state.setdefault(DELTA_SHARDS_KEY, []).append((path, delta["shards"]))


def _check_like(path: Path, key: str, ref: Any, value: Any) -> None:
    """A delta's tensor fits the base's (a managed map's arrays may change length: ids come and go)."""
    resized = key.startswith(MANAGED_PREFIX) and isinstance(ref, torch.Tensor) and isinstance(value, torch.Tensor) \
        and ref.dim() == value.dim()
    if not isinstance(ref, torch.Tensor) or not isinstance(value, torch.Tensor) \
            or (ref.shape != value.shape and not resized) or ref.dtype != value.dtype:
        raise CheckpointError(f"{path} does not fit its base: model {key} differs in name, shape or dtype")


def _check_rows(path: Path, key: str, target: Any, rows: torch.Tensor, values: Any) -> None:
    if not isinstance(target, torch.Tensor) or target.dim() != 2:
        raise CheckpointError(f"{path} does not fit its base: no packed table {key}")
    if rows.dtype != torch.int64 or rows.dim() != 1 or (rows.numel() and (
            int(rows.min()) < 0 or int(rows.max()) >= target.shape[0])):
        raise CheckpointError(f"{path} is damaged: rows of {key} are not row numbers of the table")
    if not isinstance(values, torch.Tensor) or values.dtype != target.dtype \
            or tuple(values.shape) != (rows.numel(), target.shape[1]):
        raise CheckpointError(f"{path} does not fit its base: {key} rows are not "
                              f"({rows.numel()}, {target.shape[1]}) {target.dtype}")
