"""Checkpoints of a distributed run: one shard file per rank, tied by the manifest in checkpoint.pt.

Each rank writes the rows it owns of every row-wise sharded group, with their optimizer state
(packed ids, rows, state), to `checkpoint.shards/step<S>-rank<r>-of<W>.pt`, atomically and with a
digest. When every rank has written, rank 0 writes `checkpoint.pt` (atomically, as one process
does): the dense part, replicated tables, data position, RNG, plan and spec, plus a `shards`
manifest naming the files and their digests. Shards of older steps are removed only after the new
manifest is in place, so a kill at any moment leaves the previous checkpoint whole.

Incremental checkpoints (`--checkpoint-full-every K`) add delta shards: at a delta, each rank
writes the rows of its shards touched since the previous checkpoint to
`checkpoint.shards/step<S>-rank<r>-of<W>-delta<N>.pt`, and rank 0 writes the delta manifest
`checkpoint.delta-<N>.pt` (`flowrec.runtime.checkpoint.delta`) naming them, after every rank has
written. Loading applies them, in order, over the base's rows.

Under owner ranks of managed tables (`flowrec.runtime.managed_owner`) each shard file also holds
the arrays of the virtual shards of the maps its rank owns (`managed`, whole in a delta shard
too); loading puts every rank's into the model state (a delta's replace the base's), so any
world size regroups whole map shards.

Loading (`assemble_shards`, inside every `load_checkpoint`) checks each shard against the manifest
(its name, step, rank and content digest) and puts the rows back into whole tables by their
packed ids, so the state is the single-process one: eval and export load it as they load any checkpoint. A run resumed on W' ranks loads with
`lazy=True`: each row-wise group's weight and state are then `ShardRows`, the memory-mapped shards
as they are, and each rank copies only the rows it owns by the modulo rule
(`distributed.model.load_whole_state`), so no rank holds a whole table.

Example:
    >>> state = load_checkpoint(Path("runs/exp1"))  # (shards assembled)  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch

from flowrec.runtime.checkpoint.format import CheckpointError, check_header, content_digest, read_torch_file

SHARDS_DIR = "checkpoint.shards"
SHARD_FORMAT = "flowrec-checkpoint-shard"
SHARD_VERSION = 1
SHARD_KEYS = ("format", "version", "step", "rank", "world_size", "groups", "digest")
DELTA_SHARDS_KEY = "delta_shards"  # (delta file, its shards manifest) of each applied delta, in order


def shard_name(step: int, rank: int, world_size: int, sequence: int = 0) -> str:
    """File name of rank `rank`'s shard of the checkpoint at `step` (`sequence` N > 0: of delta N)."""
    delta = f"-delta{sequence:06d}" if sequence else ""
    return f"step{step:09d}-rank{rank}-of{world_size}{delta}.pt"


def write_shard(folder: Path, step: int, rank: int, world_size: int,
                groups: dict[str, dict[str, torch.Tensor]],
                save: Callable[[Path, dict[str, Any]], str], sequence: int = 0,
                managed: dict[str, torch.Tensor] | None = None) -> tuple[str, str]:
    """Write this rank's shard (atomically, via `save`, which returns the digest).

    Args:
        sequence: 0 for a full checkpoint's shard, N for delta N's (only the rows it changed).
        managed: the arrays of the managed maps' virtual shards this rank owns
            (``managed.<table>.shard<s>.<key>``, whole in a delta too), under owner ranks.

    Returns:
        (file name, digest) for the manifest.
    """
    (folder / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    name = shard_name(step, rank, world_size, sequence)
    doc = {"format": SHARD_FORMAT, "version": SHARD_VERSION, "step": step, "rank": rank,
           "world_size": world_size, "groups": groups}
    if managed:
        doc["managed"] = managed
    return name, save(folder / SHARDS_DIR / name, doc)


def manifest(step: int, world_size: int, files: list[tuple[str, str]]) -> dict[str, Any]:
    """The `shards` entry of checkpoint.pt: the step, the world size and each rank's (file, digest)."""
    return {"step": step, "world_size": world_size, "files": [name for name, _ in files],
            "digests": [digest for _, digest in files]}


def remove_stale_shards(folder: Path, keep: list[str]) -> None:
    """Delete the shard and delta shard files of older checkpoints (after the new manifest is written).
    With none to keep (a whole checkpoint: a distributed run resumed on one process), the folder
    goes too when nothing else is in it, so the run folder no longer lists an empty
    `checkpoint.shards/` as if the run were still sharded."""
    shards = folder / SHARDS_DIR
    for path in shards.glob("step*-rank*-of*.pt"):
        if path.name not in keep:
            path.unlink(missing_ok=True)
    if not keep:
        try:
            shards.rmdir()
        except OSError:  # absent, or holding other files (a rank's temp file): left as it is
            pass


class ShardRows:
    """A whole table (weight or optimizer state) of a row-wise group, as its shards hold it: the
    packed ids and rows of each shard, memory-mapped, never assembled unless `whole` is called.

    It has the whole table's `shape` and `dtype`, so a checkpoint is checked against the model
    before anything is copied. Parts apply in order: the base shards (each row once), then the
    rows of each delta shard, which overwrite them.

    Args:
        rows: packed ids of each part (base shards first, then delta shards).
        values: the rows of each part.
        table_rows: rows of the whole table (default: the sum of the parts' rows).
    """

    def __init__(self, rows: list[torch.Tensor], values: list[torch.Tensor], table_rows: int | None = None):
        self.parts = list(zip(rows, values))
        n = sum(r.numel() for r in rows) if table_rows is None else table_rows
        self.shape = torch.Size((n, *values[0].shape[1:]))
        self.dtype = values[0].dtype

    def whole(self) -> torch.Tensor:
        """The assembled table (whole-table memory)."""
        out = torch.empty(self.shape, dtype=self.dtype)
        for rows, values in self.parts:
            out.index_copy_(0, rows, values.to(self.dtype))
        return out


def assemble_shards(path: Path, state: dict[str, Any], map_location: str | torch.device = "cpu",
                    lazy: bool = False) -> dict[str, Any]:
    """The single-process state of a sharded checkpoint (unchanged when it has no `shards`).

    Args:
        lazy: leave each row-wise group's tables as `ShardRows` (checked, not assembled).

    Raises:
        CheckpointError: a shard file missing, damaged, of another checkpoint, or whose rows do
            not cover the table exactly once; one line naming the file.
    """
    entry = state.get("shards")
    deltas = state.get(DELTA_SHARDS_KEY, [])
    if entry is None:
        return state
    maps: dict[str, torch.Tensor] = {}
    tables = _read_shards(path, entry, map_location, maps)
    for group, parts in tables.items():
        _check_cover(path, group, parts)
    sizes = {group: sum(r.numel() for r in parts["rows"]) for group, parts in tables.items()}
    for at, (delta_path, delta_entry) in enumerate(deltas):
        try:
            patches = _read_shards(delta_path, delta_entry, map_location, maps)  # a delta's maps replace the base's
            _check_patches(delta_path, tables, sizes, patches)
        except CheckpointError as exc:
            before = (deltas[at - 1][1] if at else entry).get("step")  # checked by `_read_shards`
            raise CheckpointError(f"{exc}; {without_deltas([p for p, _ in deltas[at:]], before)}") from None
        for group, parts in patches.items():
            for key in ("rows", "weight", "state"):
                tables[group][key] += parts[key]
    model = dict(state["model"])
    model.update(maps)
    for group, parts in tables.items():
        weight = ShardRows(parts["rows"], parts["weight"], sizes[group])
        opt = ShardRows(parts["rows"], parts["state"], sizes[group])
        model[f"embeddings.{group}.weight"] = weight if lazy else weight.whole()
        model[f"embeddings.{group}.state"] = opt if lazy else opt.whole()
    out = {k: v for k, v in state.items() if k not in ("shards", DELTA_SHARDS_KEY)}
    out["model"] = model
    return out


def without_deltas(paths: list[Path], step: int | None) -> str:
    """What to do about a delta that cannot be applied (the first of `paths`, the deltas from it
    on): removing them leaves the chain before it, a consistent earlier state (of `step`)."""
    names = [p.name for p in paths]
    if len(names) > 3:
        listed = f"{names[0]} to {names[-1]} ({len(names)} files)"
    else:
        listed = names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"
    state = "the checkpoint before it" + (f" (step {step})" if step is not None else "")
    return f"removing {listed} from {paths[0].parent} leaves {state}, which --resume, eval and export read"


def _read_shards(path: Path, entry: Any, map_location: str | torch.device,
                 maps: dict[str, torch.Tensor]) -> dict[str, dict[str, Any]]:
    """The groups of every shard `entry` (a manifest in `path`) names, checked against it:
    {group: {"rows": [...], "weight": [...], "state": [...]}}, one item per shard; the managed
    maps' arrays the shards hold (owner ranks) go into `maps`."""
    files, digests = _manifest_files(path, entry)
    tables: dict[str, dict[str, Any]] = {}
    for rank, (name, digest) in enumerate(zip(files, digests)):
        shard_path = path.parent / SHARDS_DIR / name
        if not shard_path.is_file():
            raise CheckpointError(f"{path}: shard {shard_path} of rank {rank} is missing")
        doc = read_torch_file(shard_path, map_location, what="flowrec checkpoint shard", mmap=True)
        check_header(shard_path, doc, SHARD_FORMAT, SHARD_VERSION, SHARD_KEYS, "flowrec checkpoint shard")
        if doc["digest"] != digest or doc["step"] != entry["step"] or doc["rank"] != rank:
            raise CheckpointError(f"{shard_path} is not rank {rank}'s shard of the checkpoint in {path} "
                                  f"(another step or a damaged file)")
        if content_digest({k: v for k, v in doc.items() if k != "digest"}) != digest:
            raise CheckpointError(f"{shard_path} is damaged: its content does not match its digest")
        _collect(shard_path, doc["groups"], tables)
        _collect_maps(shard_path, doc.get("managed", {}), maps)
    return tables


def _collect_maps(shard_path: Path, managed: Any, maps: dict[str, torch.Tensor]) -> None:
    if not isinstance(managed, dict) or not all(
            isinstance(k, str) and k.startswith("managed.") and isinstance(v, torch.Tensor) and v.dim() == 1
            for k, v in managed.items()):
        raise CheckpointError(f"{shard_path} is damaged: its managed maps are not arrays of managed keys")
    maps.update(managed)


def _check_patches(path: Path, tables: dict[str, dict[str, Any]], sizes: dict[str, int],
                   patches: dict[str, dict[str, Any]]) -> None:
    """The rows of a delta's shards are rows of the base's row-wise groups, of their widths.

    Raises:
        CheckpointError: they are not (one line naming the delta).
    """
    for group, parts in patches.items():
        if group not in tables:
            raise CheckpointError(f"{path} does not fit its base: no row-wise group {group}")
        base_w, base_s = tables[group]["weight"][0], tables[group]["state"][0]
        for rows, w, st in zip(parts["rows"], parts["weight"], parts["state"]):
            if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= sizes[group]):
                raise CheckpointError(f"{path} is damaged: rows of group {group} are not rows of the table")
            if w.shape[1:] != base_w.shape[1:] or st.shape[1:] != base_s.shape[1:] \
                    or w.dtype != base_w.dtype or st.dtype != base_s.dtype:
                raise CheckpointError(f"{path} does not fit its base: rows of group {group} have another width")


def _manifest_files(path: Path, entry: Any) -> tuple[list[str], list[str]]:
    if not isinstance(entry, dict) or not isinstance(entry.get("files"), list) \
            or not isinstance(entry.get("digests"), list) or len(entry["files"]) != len(entry["digests"]) \
            or entry.get("world_size") != len(entry["files"]) or not isinstance(entry.get("step"), int):
        raise CheckpointError(f"{path} is damaged: its shards manifest is not one")
    names = entry["files"]
    if any(not isinstance(n, str) or "/" in n or "\\" in n or n.startswith(".") for n in names):
        raise CheckpointError(f"{path} is damaged: a shard file name is not a plain file name")
    return names, entry["digests"]


def _collect(shard_path: Path, groups: Any, tables: dict[str, dict[str, Any]]) -> None:
    if not isinstance(groups, dict):
        raise CheckpointError(f"{shard_path} is damaged: groups is not a dict")
    for group, part in groups.items():
        if not isinstance(part, dict) or not all(isinstance(part.get(k), torch.Tensor)
                                                 for k in ("rows", "weight", "state")):
            raise CheckpointError(f"{shard_path} is damaged: group {group!r} has no rows, weight and state")
        rows, weight, opt = part["rows"], part["weight"], part["state"]
        if rows.dtype != torch.int64 or rows.dim() != 1 or weight.shape[0] != rows.numel() \
                or opt.shape[0] != rows.numel():
            raise CheckpointError(f"{shard_path} is damaged: group {group!r} rows and tensors do not match")
        tables.setdefault(group, {"rows": [], "weight": [], "state": []})
        for key in ("rows", "weight", "state"):
            tables[group][key].append(part[key])


def _check_cover(path: Path, group: str, parts: dict[str, list[torch.Tensor]]) -> None:
    """The shards of a group hold each of its rows exactly once, in rows of one width.

    Raises:
        CheckpointError: they do not.
    """
    n = sum(rows.numel() for rows in parts["rows"])
    first_w, first_s = parts["weight"][0], parts["state"][0]
    seen = torch.zeros(n, dtype=torch.bool)
    for rows, w, st in zip(parts["rows"], parts["weight"], parts["state"]):
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= n or bool(seen[rows].any())
                             or torch.unique(rows).numel() != rows.numel()):
            raise CheckpointError(f"{path}: the shards of group {group} do not hold each of its rows once")
        if w.shape[1:] != first_w.shape[1:] or st.shape[1:] != first_s.shape[1:] \
                or w.dtype != first_w.dtype or st.dtype != first_s.dtype:
            raise CheckpointError(f"{path}: the shards of group {group} have rows of different widths")
        seen[rows] = True
