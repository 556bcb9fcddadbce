"""Policy `static_hot` (FAE, Adnan et al., VLDB 2022): the globally hottest rows live on the device.

From an access profile (counts of row accesses in a sample of the data) the hottest rows that fit
the plan's `cache_rows` are copied, with their optimizer state, into a device hot table; `hot_slot`
maps a packed row to its slot (a bijection between the hot rows and the slots). A batch whose
ids are all hot (a hot batch, formed by `flowrec.runtime.caches.fae_batches`) runs entirely on the
device, training the hot table in place. A cold batch gathers its cold rows from the host master
(they travel to the device) and its hot rows from the hot table; after the backward the hot rows
are updated in their slots and the cold rows on the host (their gradients travel back). At each
switch between hot and cold batches the hot rows updated since the last switch are written to the
host master, so host and device copies of the hot rows agree after every switch.

Example:
    >>> emb = StaticHotEmbedding(group, seed=0, device=torch.device("cpu"))  # doctest: +SKIP
    >>> emb.set_hot_rows(hottest_rows(counts, group.cache_rows))  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from flowrec.graph.kinds import hot_sample_rate
from flowrec.graph.types import PackedGroup
from flowrec.runtime.caches.base import CacheCapacityError, CachedEmbedding
from flowrec.runtime.caches.slots import SlotTable, local_ids, remap_casting, slot_bag, split_bag

NOT_HOT = -1  # hot_slot value of a cold row


def hottest_rows(counts: np.ndarray | torch.Tensor, capacity: int) -> torch.Tensor:
    """The `capacity` most accessed rows (ties: the lower row), sorted.  # (H,) int64

    Args:
        counts: accesses per packed row.  # (R,)
        capacity: hot slots.
    """
    counts = torch.as_tensor(np.asarray(counts), dtype=torch.int64)
    seen = int((counts > 0).sum())
    take = min(int(capacity), seen)
    order = torch.argsort(-counts, stable=True)[:take]
    return torch.sort(order).values


class StaticHotEmbedding(CachedEmbedding):
    """FAE's hot-embedding placement (see the module docstring).

    Args:
        group: the packed group (`cache_rows` hot slots).
        seed: model seed.
        device: compute device.
        hot_rows: the hot rows (default: none until `set_hot_rows`; every batch is then cold).
    """

    def __init__(self, group: PackedGroup, seed: int, device: torch.device,
                 hot_rows: torch.Tensor | None = None):
        super().__init__(group, seed, device)
        self.hot_slot = torch.full((group.rows,), NOT_HOT, dtype=torch.int64)  # (R,)
        self.hot_rows = torch.zeros(0, dtype=torch.int64)  # (H,)
        self.hot = SlotTable(self.master.weight[:0].to(self.device), self.master.state[:0].to(self.device),
                             self.optimizer, None if self.mean_flags is None else self.mean_flags.to(self.device),
                             group.bags_per_sample)
        self.dirty = torch.zeros(0, dtype=torch.bool)  # (H,) updated since the last sync
        self.last_kind = ""  # "hot" or "cold": the kind of the previous training batch
        self.switches = 0
        if hot_rows is not None:
            self.set_hot_rows(hot_rows)

    def set_hot_rows(self, rows: torch.Tensor) -> None:
        """Place sorted unique `rows` (at most `group.cache_rows`) in the hot table."""
        rows = torch.as_tensor(rows, dtype=torch.int64).cpu()
        if self.group.cache_rows and rows.numel() > self.group.cache_rows:
            raise CacheCapacityError(f"group {self.group.name}: {rows.numel():,} hot rows for "
                                     f"{self.group.cache_rows:,} slots")
        with self.counters.outside_steps():
            self.sync_master()
        self.hot_rows = rows
        self.hot_slot.fill_(NOT_HOT)
        self.hot_slot[rows] = torch.arange(rows.numel())
        w, s = self.master.read_rows(rows)
        self.hot.weight, self.hot.state = w.to(self.device), s.to(self.device)
        self.dirty = torch.zeros(rows.numel(), dtype=torch.bool)
        with self.counters.outside_steps():
            self.counters.add_h2d(rows.numel() * self.row_bytes, rows.numel())

    def is_hot(self) -> torch.Tensor:
        """Hot flag of every packed row.  # (R,) bool"""
        return self.hot_slot != NOT_HOT

    def forward_group(self, gids: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.gather_lookup(gids.ids, gids.offsets)
        self.count_index(gids)
        ids = gids.ids.cpu()
        rows = self.unique_rows(gids)
        casting = self.casting_of(gids)
        unique_slots = self.hot_slot[rows]  # (U,): the batch's hits counted over its unique rows, not its ids
        # `rows` are the casting's unique ids (the cold path's split bag relies on it too): its counts
        # give each unique row's ids
        hot_hits = int(casting.counts.cpu()[unique_slots != NOT_HOT].sum())
        self.counters.add_lookups(ids.numel(), hot_hits)
        self.counters.end_step(gids.offsets.numel() // max(self.group.bags_per_sample, 1))
        kind = "hot" if hot_hits == ids.numel() else "cold"
        if kind != self.last_kind:
            self._switch()
            self.last_kind = kind
        if kind == "hot":
            self.dirty[unique_slots] = True
            return slot_bag(self.hot, self.hot_slot[ids].to(self.device), gids.offsets.to(self.device),
                            remap_casting(casting, unique_slots))
        return self._cold_lookup(gids, rows, unique_slots, casting)

    def _cold_lookup(self, gids: Any, rows: torch.Tensor, unique_slots: torch.Tensor, casting: Any) -> torch.Tensor:
        hot_mask = unique_slots != NOT_HOT  # (U,)
        hot_pos, cold_pos = hot_mask.nonzero().flatten(), (~hot_mask).nonzero().flatten()  # on the host: no device sync
        cold_rows = rows[cold_pos]
        hot_slots = unique_slots[hot_pos]
        dev_hot_pos, dev_cold_pos = hot_pos.to(self.device), cold_pos.to(self.device)
        with self.counters.stall("host_gather"):
            cold_w = self.master.weight.index_select(0, cold_rows)  # (Uc, D)
            self.counters.add_h2d(cold_w.numel() * self.elem_bytes)
            working = torch.empty(rows.numel(), self.group.dim, dtype=self.hot.weight.dtype, device=self.device)
            working.index_copy_(0, dev_hot_pos, self.hot.weight.index_select(0, hot_slots.to(self.device)))
            working.index_copy_(0, dev_cold_pos, cold_w.to(self.device, non_blocking=True))
        self.dirty[hot_slots] = True
        local = local_ids(gids.ids.cpu(), rows, casting, gids.offsets.cpu()).to(self.device)

        def update(grads: torch.Tensor) -> None:  # (U, D) in rows order
            if hot_slots.numel():
                self.optimizer.step(self.hot.weight, self.hot.state, hot_slots.to(grads.device),
                                    grads.index_select(0, dev_hot_pos))
            if cold_rows.numel():
                cold_grads = grads.index_select(0, dev_cold_pos).cpu()
                self.counters.add_d2h(cold_grads.numel() * cold_grads.element_size())
                self.optimizer.step(self.master.weight, self.master.state, cold_rows, cold_grads)

        return split_bag(working, local, gids.offsets.to(self.device), casting, self.hot.mean_flags,
                         self.group.bags_per_sample, update)

    def _switch(self) -> None:
        """Hot/cold switch: write the hot rows updated since the last switch to the host master."""
        if self.last_kind:
            self.switches += 1
        with self.counters.stall("sync"):
            self._sync_dirty()

    def _sync_dirty(self) -> None:
        slots = self.dirty.nonzero().flatten()
        if not slots.numel():
            return
        dev = slots.to(self.device)
        self.master.write_rows(self.hot_rows[slots], self.hot.weight.index_select(0, dev).cpu(),
                               self.hot.state.index_select(0, dev).cpu())
        self.counters.add_d2h(slots.numel() * self.row_bytes, slots.numel())
        self.dirty[slots] = False

    def current_rows(self, rows: torch.Tensor) -> torch.Tensor:
        out = self.master.weight.index_select(0, rows).clone()
        slots = self.hot_slot[rows]
        hit = slots != NOT_HOT
        if bool(hit.any()):
            out[hit] = self.hot.weight.index_select(0, slots[hit].to(self.device)).cpu()
        return out

    def sync_master(self) -> None:
        self._sync_dirty()

    def reload_from_master(self) -> None:
        w, s = self.master.read_rows(self.hot_rows)
        self.hot.weight, self.hot.state = w.to(self.device), s.to(self.device)
        self.dirty.zero_()


def assign_hot_rows(model: Any, spec: Any, source: Any, sample_rate: float | None = None,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """FAE's profiling step for a lowered model: sample the data, count row accesses, and load the
    hottest `cache_rows` rows of every static_hot group into its hot table.

    Args:
        model: a `LoweredModel` (its `embeddings`).
        spec: the model spec.
        source: the training data (a `PartitionSource`).
        sample_rate: Bernoulli sample of the rows counted (default `hot_sample_rate`).
        seed: sampling seed.

    Returns:
        Per static_hot group, the hot flag of each packed row (for `HotColdBatcher`).  # {group: (R,) bool}
    """
    from flowrec.data.packed_ids import column_arrays, pack_group
    from flowrec.data.profile import sample_rows

    modules = {n: m for n, m in model.embeddings.items() if isinstance(m, StaticHotEmbedding)}
    if not modules:
        return {}
    rate = sample_rate if sample_rate is not None else hot_sample_rate(sum(source.partition_rows()))
    table = sample_rows(spec, source, rate, seed)
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    flags = {}
    for name, module in modules.items():
        ids, _ = pack_group(module.group, cols, table.num_rows)
        module.set_hot_rows(hottest_rows(np.bincount(ids, minlength=module.group.rows), module.group.cache_rows))
        flags[name] = module.is_hot()
    return flags
