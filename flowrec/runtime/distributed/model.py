"""A lowered model's packed groups across ranks, as its plan shards them.

A `row_wise` group becomes a `ShardedPackedEmbedding` (this rank's rows only), a `replicated`
group a `ReplicatedPackedEmbedding` (the whole table on every rank). The lookups of all groups
of a step run together (`schedule.lookup_groups`: one autograd node, so every rank issues the same
collectives in the same order, forward and backward; K-interleaving overlaps one group's exchange
with another's gather or pooling).

Checkpoint layout (`shard_state`, `load_shards`): the model's state in the single-process layout
(`embeddings.<group>.weight` / `.state` of the whole table), except that a row-wise group's rows
are given as (packed ids, rows, optimizer state) of this rank, so any world size can load them by
the modulo rule.

Example:
    >>> modules = sharded_embeddings(plan.meta.groups, seed, device, world)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import PackedGroup
from flowrec.runtime.distributed.replicated import ReplicatedPackedEmbedding
from flowrec.runtime.distributed.schedule import lookup_groups
from flowrec.runtime.distributed.sharded import ShardedPackedEmbedding
from flowrec.runtime.distributed.world import World


class ShardingError(ValueError):
    """A group whose placement or sharding this distributed runtime cannot run."""


def sharded_embeddings(groups: tuple[PackedGroup, ...], seed: int, device: torch.device,
                       world: World) -> dict[str, nn.Module]:
    """One module per group for its sharding (this rank's rows of a row-wise group)."""
    out: dict[str, nn.Module] = {}
    for g in groups:
        if PLACEMENTS[g.placement].cached:
            raise ShardingError(f"group {g.name}: cache placement {g.placement} is not yet supported for "
                                f"sharded groups")
        if g.sharding == "replicated":
            out[g.name] = ReplicatedPackedEmbedding(g, world.embedding_group, seed, device)
        else:
            out[g.name] = ShardedPackedEmbedding(g, world.size, world.rank, world.embedding_group, seed, device)
    return out


def embed_all(model: Any, batch: Any, interleave: bool) -> dict[str, torch.Tensor]:
    """Pooled lookups of every group for this rank's samples, in the plan's group order.
    # {group: (B_r, S, D)}"""
    names = list(model.group_order)
    inputs = []
    for name in names:
        ids = batch.groups[name]
        inputs.append((ids.ids.to(model.device, non_blocking=True),
                       ids.offsets.to(model.device, non_blocking=True), ids.casting))
    outs = lookup_groups([model.embeddings[n] for n in names], inputs, interleave)
    return dict(zip(names, outs))


def shard_state(model: Any) -> tuple[dict[str, torch.Tensor], dict[str, dict[str, torch.Tensor]]]:
    """The model's state split for a checkpoint.

    Returns:
        (common, shards): `common` in the single-process layout without the row-wise groups
        (dense parameters, whole replicated tables); `shards` per row-wise group this rank's
        packed ids, rows and optimizer state ({"rows", "weight", "state"}).
    """
    common: dict[str, torch.Tensor] = {}
    shards: dict[str, dict[str, torch.Tensor]] = {}
    modules = dict(model.embeddings.items())
    for key, value in model.state_dict().items():
        parts = key.split(".")
        if parts[0] == "embeddings" and isinstance(modules.get(parts[1]), ShardedPackedEmbedding):
            continue
        if parts[0] == "embeddings" and isinstance(modules.get(parts[1]), ReplicatedPackedEmbedding):
            key = ".".join(p for p in parts if p != "table")
        common[key] = value
    for name, module in modules.items():
        if isinstance(module, ShardedPackedEmbedding):
            rows, weight, state = module.shard_rows()
            shards[name] = {"rows": rows, "weight": weight, "state": state}
    return common, shards


def whole_state_like(model: Any) -> dict[str, torch.Tensor]:
    """Meta tensors shaped like the model's state in the single-process layout (whole tables),
    to check a checkpoint against before loading it."""
    out: dict[str, torch.Tensor] = {}
    modules = dict(model.embeddings.items())
    for key, value in model.state_dict().items():
        parts = key.split(".")
        module = modules.get(parts[1]) if parts[0] == "embeddings" else None
        shape = value.shape
        if isinstance(module, ShardedPackedEmbedding):
            shape = torch.Size([module.group.rows, *value.shape[1:]])
        elif isinstance(module, ReplicatedPackedEmbedding):
            key = ".".join(p for p in parts if p != "table")
        out[key] = torch.empty(shape, dtype=value.dtype, device="meta")
    return out


def load_whole_state(model: Any, state: dict[str, torch.Tensor]) -> None:
    """Load a single-process-layout model state: each row-wise group keeps its own rows of the
    whole tables (the modulo rule), replicated groups take the whole tables."""
    rest: dict[str, torch.Tensor] = {}
    for name, module in model.embeddings.items():
        prefix = f"embeddings.{name}."
        if isinstance(module, ShardedPackedEmbedding):
            weight, opt = state[prefix + "weight"], state[prefix + "state"]
            module.load_rows(torch.arange(weight.shape[0], dtype=torch.int64), weight, opt)
        elif isinstance(module, ReplicatedPackedEmbedding):
            rest[prefix + "table.weight"], rest[prefix + "table.state"] = state[prefix + "weight"], state[prefix + "state"]
    for key, value in state.items():
        parts = key.split(".")
        if parts[0] == "embeddings" and isinstance(model.embeddings[parts[1]],
                                                   (ShardedPackedEmbedding, ReplicatedPackedEmbedding)):
            continue
        rest[key] = value
    own = model.state_dict()
    missing = [k for k in own if k not in rest and not _sharded_key(model, k)]
    if missing:
        raise KeyError(f"missing {missing[0]}")
    model.load_state_dict(rest, strict=False)


def _sharded_key(model: Any, key: str) -> bool:
    parts = key.split(".")
    return parts[0] == "embeddings" and isinstance(model.embeddings[parts[1]], ShardedPackedEmbedding)


def initial_whole_states(model: Any) -> dict[str, torch.Tensor]:
    """Every group's initial sparse optimizer state, whole (single-process layout): what a run
    started from another with a fresh optimizer loads."""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.embeddings.items():
        if isinstance(module, ShardedPackedEmbedding):
            out[f"embeddings.{name}.state"] = module.optimizer.initial_state(
                module.group.rows, module.group.dim, module.state.dtype, module.state.device)
        elif isinstance(module, ReplicatedPackedEmbedding):
            out[f"embeddings.{name}.state"] = module.state.clone()
    return out
