"""The checkpoint layout of a model whose packed groups are spread across ranks.

A distributed model's state in the single-process layout (`embeddings.<group>.weight` / `.state`
of the whole table; a replicated group has exactly these keys), except that a row-wise group's rows
are given as (packed ids, rows, optimizer state) of this rank, so any world size can load them by
the modulo rule (`flowrec.runtime.distributed.groups.owner_of`). `common_state` is what rank 0
writes into checkpoint.pt, `rank_shards` / `rank_delta_shards` what each rank writes into its
shard, `load_whole_state` what every rank loads.

Example:
    >>> shards = rank_shards(model)  # {group: {"rows", "weight", "state"}}  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowrec.runtime.checkpoint.shards import ShardRows
from flowrec.runtime.distributed.groups import local_index, owner_of
from flowrec.runtime.distributed.sharded import ShardedPackedEmbedding


def common_state(model: Any) -> dict[str, torch.Tensor]:
    """The model's state in the single-process layout without the row-wise groups (dense
    parameters, whole replicated tables) nor, under owner ranks, the managed maps' shards: what
    rank 0 writes into checkpoint.pt."""
    owned = owned_maps(model)
    return {k: v for k, v in model.state_dict().items() if _sharded(model, k) is None and k not in owned}


def owned_maps(model: Any) -> dict[str, torch.Tensor]:
    """The arrays of the managed maps' virtual shards this rank owns when the maps live on owner
    ranks (`flowrec.runtime.managed_owner`): what this rank writes into its checkpoint shard
    (full or delta); {} otherwise (replicas: rank 0 writes the maps into checkpoint.pt)."""
    managed = getattr(model, "managed", None)
    return managed.owned_state() if managed is not None else {}


def rank_shards(model: Any) -> dict[str, dict[str, torch.Tensor]]:
    """Per row-wise group, this rank's packed ids, rows and optimizer state (copies;
    {"rows", "weight", "state"}): what this rank writes into its checkpoint shard."""
    shards = {}
    for name, module in model.embeddings.items():
        if isinstance(module, ShardedPackedEmbedding):
            rows, weight, state = module.shard_rows()
            shards[name] = {"rows": rows, "weight": weight, "state": state}
    return shards


def rank_delta_shards(model: Any, rows: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Per row-wise group, the rows among `rows` (packed ids, every rank's) that this rank owns,
    with their optimizer state (copies; {"rows", "weight", "state"}): its delta shard."""
    shards = {}
    for name, module in model.embeddings.items():
        if isinstance(module, ShardedPackedEmbedding):
            picked = rows.get(name, torch.zeros(0, dtype=torch.int64))
            mine = picked[owner_of(picked, module.world_size) == module.rank]
            local = local_index(mine, module.world_size)
            shards[name] = {"rows": mine.clone(),
                            "weight": module.weight.index_select(0, local.to(module.weight.device)).cpu(),
                            "state": module.state.index_select(0, local.to(module.state.device)).cpu()}
    return shards


def replicated_embeddings(model: Any) -> dict[str, nn.Module]:
    """The groups whose whole table every rank holds (rank 0 writes them, as one process does)."""
    return {name: m for name, m in model.embeddings.items() if not isinstance(m, ShardedPackedEmbedding)}


def whole_state_like(model: Any) -> dict[str, torch.Tensor]:
    """The model's state in the single-process layout, a row-wise group's tensors as meta tensors
    of the whole table's shape: what a checkpoint is checked against before it is loaded."""
    out = {}
    for key, value in model.state_dict().items():
        module = _sharded(model, key)
        out[key] = value if module is None else torch.empty(
            (module.group.rows, *value.shape[1:]), dtype=value.dtype, device="meta")
    managed = getattr(model, "managed", None)
    if managed is not None:  # an owner rank holds some shards of a map; the checkpoint holds all
        out.update({k: v for k, v in managed.whole_like().items() if k not in out})
    return out


def load_whole_state(model: Any, state: dict[str, Any]) -> None:
    """Load a single-process-layout model state: each row-wise group keeps its own rows of the
    whole tables (the modulo rule); everything else loads as in one process. A table may be given
    as `ShardRows` (a sharded checkpoint, not assembled): a row-wise group then copies its rows
    from each shard, and any other part is assembled first."""
    for name, module in model.embeddings.items():
        if isinstance(module, ShardedPackedEmbedding):
            prefix = f"embeddings.{name}."
            weight, opt = state[prefix + "weight"], state[prefix + "state"]
            if isinstance(weight, ShardRows) and isinstance(opt, ShardRows):
                for (rows, w), (_, st) in zip(weight.parts, opt.parts):
                    module.load_rows(rows, w, st)
            else:
                weight, opt = _whole(weight), _whole(opt)
                module.load_rows(torch.arange(weight.shape[0], dtype=torch.int64), weight, opt)
    rest = {k: _whole(v) for k, v in state.items() if _sharded(model, k) is None}
    missing = [k for k in model.load_state_dict(rest, strict=False).missing_keys if _sharded(model, k) is None]
    if missing:
        raise KeyError(f"missing {missing[0]}")


def _whole(value: Any) -> Any:
    return value.whole() if isinstance(value, ShardRows) else value


def _sharded(model: Any, key: str) -> ShardedPackedEmbedding | None:
    """The row-wise sharded module a state-dict key belongs to (None: another part)."""
    parts = key.split(".")
    module = model.embeddings[parts[1]] if parts[0] == "embeddings" and parts[1] in model.embeddings else None
    return module if isinstance(module, ShardedPackedEmbedding) else None


def initial_whole_states(model: Any) -> dict[str, torch.Tensor]:
    """The row-wise groups' initial sparse optimizer states, whole (single-process layout): what a
    run started from another with a fresh optimizer loads (the other groups' are the model's own)."""
    return {f"embeddings.{name}.state": module.optimizer.initial_state(
                module.group.rows, module.group.dim, module.state.dtype, module.state.device)
            for name, module in model.embeddings.items() if isinstance(module, ShardedPackedEmbedding)}
