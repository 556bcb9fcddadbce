"""The common part of every non-resident placement: a host master table and counters.

A `CachedEmbedding` keeps the whole packed table (weight and optimizer state) in host memory,
pinned where CUDA is present, as `master` (a `PackedEmbeddingBag`); subclasses keep some rows on
the compute device and say where the current value of a row is (`current_rows`) and how to make
the master complete again (`sync_master`). The lowering calls `forward_group(GroupIds)` on modules
with `takes_group_ids`, so a policy sees the data stage's lookahead output; `forward(ids,
offsets, casting)` also works (evaluation, no lookahead): it gathers the current rows.

Example:
    >>> module = LookaheadEmbedding(group, seed=0, device=torch.device("cpu"))  # doctest: +SKIP
    >>> out = module.forward_group(batch.groups[group.name])  # (B, S, D)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from flowrec.graph.types import PackedGroup
from flowrec.runtime.caches.counters import CacheCounters
from flowrec.runtime.caches.slots import pooled, rows_of
from operators.casting import Casting, compute_casting
from operators.device import runtime_for
from operators.embedding import PackedEmbeddingBag, mean_bag_flags


class CacheCapacityError(RuntimeError):
    """A batch or lookahead window needs more device slots than the plan gave the cache."""


class CachedEmbedding(nn.Module):
    """Base of the cache placements (see the module docstring).

    Args:
        group: the packed group (placement, cache_rows from the plan).
        seed: model seed (the same initial rows as a device-resident table).
        device: compute device (where slots live).
    """

    takes_group_ids = True

    def __init__(self, group: PackedGroup, seed: int, device: torch.device):
        super().__init__()
        self.group = group
        self.device = torch.device(device)
        self.runtime = runtime_for(self.device)  # streams, events, pinned buffers
        self.master = PackedEmbeddingBag(group, seed=seed, device="cpu")
        self.master.weight = self.runtime.pin(self.master.weight)
        self.master.state = self.runtime.pin(self.master.state)
        flags = mean_bag_flags(group)
        self.mean_flags = flags if bool(flags.any()) else None
        self.optimizer = self.master.optimizer
        self.counters = CacheCounters()
        self.elem_bytes = self.master.weight.element_size()
        self.register_load_state_dict_post_hook(lambda module, _: module.reload_from_master())
        self._register_state_dict_hook(_portable_keys)
        self._register_load_state_dict_pre_hook(_master_keys)
        self.row_bytes = group.dim * self.elem_bytes + self.master.state.shape[1] * self.master.state.element_size()

    @property
    def weight(self) -> torch.Tensor:
        """The host master table (complete only after `sync_master`)."""
        return self.master.weight

    def casting_of(self, gids: Any) -> Casting:
        """The staged casting of a batch (computed here when staging had no lookahead)."""
        if gids.casting is not None:
            return gids.casting
        return compute_casting(gids.ids.cpu(), gids.offsets.cpu(), self.mean_flags)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, casting: Casting | None = None) -> torch.Tensor:
        """Lookups without lookahead information: like `forward_group` on these ids."""
        from flowrec.data.batches import GroupIds

        return self.forward_group(GroupIds(ids, offsets, casting))

    def gather_lookup(self, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        """Inference lookup of the current values (no update).  # (B, S, D)"""
        ids, offsets = ids.cpu(), offsets.cpu()
        rows = torch.unique(ids)
        working = self.current_rows(rows).to(self.device)  # (U, D)
        local = torch.searchsorted(rows, ids).to(self.device)
        return pooled(working, local, offsets.to(self.device), self.mean_flags, self.group.bags_per_sample)

    def count_index(self, gids: Any) -> None:
        """Count a training batch's ids and offsets (evaluation lookups are not step traffic) and,
        where the device is not the host, the staged casting its slots cross with (the cost
        model's `casting_bytes`, which it prices only where a link exists)."""
        self.counters.add_index(gids.ids.numel(), gids.offsets.numel())
        if gids.casting is not None and self.device.type != "cpu":
            self.counters.add_h2d(gids.casting.nbytes)

    def current_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Current weights of sorted unique packed `rows`, wherever they live.  # (n, D)"""
        raise NotImplementedError

    def sync_master(self) -> None:
        """Write every device-held row back so the master table is complete."""
        raise NotImplementedError

    def reload_from_master(self) -> None:
        """Refresh the device-held rows from the master (after `load_state_dict`)."""
        raise NotImplementedError

    def forward_group(self, gids: Any) -> torch.Tensor:
        raise NotImplementedError

    def reset_rows(self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Overwrite packed `rows` and their optimizer state (a managed table's eviction) in the
        master and in every device copy, so no copy serves the evicted values."""
        with self.counters.outside_steps():
            self.sync_master()
            self.master.write_rows(rows, weights, state)
            self.reload_from_master()

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        with self.counters.outside_steps():  # checkpoints hold the complete master table
            self.sync_master()
        super()._save_to_state_dict(destination, prefix, keep_vars)

    def full_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The complete packed weight and optimizer state (after a sync).  # (R, D), (R, k)"""
        with self.counters.outside_steps():
            self.sync_master()
        return self.master.weight, self.master.state

    def table_rows(self, table: str) -> torch.Tensor:
        """One logical table's rows (as `PackedEmbeddingBag.table_rows`), after a sync."""
        with self.counters.outside_steps():
            self.sync_master()
        return self.master.table_rows(table)

    def unique_rows(self, gids: Any) -> torch.Tensor:
        return rows_of(gids)


MASTER_KEYS = ("weight", "state")  # checkpoint keys shared by every placement


def _portable_keys(module: nn.Module, state: dict, prefix: str, metadata: Any) -> None:
    """Save the master table as `weight` / `state`, the keys of a device-placed group, so a
    checkpoint loads under any placement (a GPU cache run can be scored on a CPU)."""
    for key in MASTER_KEYS:
        state[prefix + key] = state.pop(prefix + "master." + key)


def _master_keys(state: dict, prefix: str, *args: Any) -> None:
    for key in MASTER_KEYS:
        if prefix + key in state:
            state[prefix + "master." + key] = state.pop(prefix + key)
