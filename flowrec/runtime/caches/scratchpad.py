"""A device scratchpad: slots of rows with an id -> slot map over a host master copy.

`exchange(needed, pinned)` makes every row of `needed` resident: it fetches the missing rows
with their optimizer state into free slots, and when none are free it evicts resident rows that
are not `pinned` (in the order of its victim policy, `flowrec.runtime.caches.victims`: least
recently used first by default), writing each victim's row and state back to the master before
its slot is reused. A row is therefore written back before it can be read again,
and a pinned row (one an in-flight batch uses) is never evicted; a request that cannot be met is
a `CacheCapacityError`, never a silent miss. Maps live on the host; slot rows on the device.

Example:
    >>> pad = Scratchpad(master, capacity=1024, device=torch.device("cpu"), counters=CacheCounters())  # doctest: +SKIP
    >>> pad.exchange(needed=rows, pinned=rows, stamp=0)  # doctest: +SKIP
    >>> slots = pad.slot_of[rows]  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flowrec.runtime.caches.base import CacheCapacityError
from flowrec.runtime.caches.counters import CacheCounters
from flowrec.runtime.caches.victims import Horizon, LeastRecent, SlotState, VictimPolicy
from operators.embedding import PackedEmbeddingBag

EMPTY = -1  # slot_of / row_of value of "none"


@dataclass(frozen=True)
class Exchange:
    """One exchange: rows fetched into slots, victims written back (for tests and logs)."""

    stamp: int
    fetched: tuple[int, ...]
    evicted: tuple[int, ...]


class Scratchpad:
    """Slots on `device` over the rows of `master` (see the module docstring).

    Args:
        master: the host master table (weight and optimizer state).
        capacity: slots.
        device: where the slots live.
        counters: traffic counters to add fetches and write-backs to.
        record: keep a log of every exchange (`log`) for checking.
        victims: the victim policy (default `LeastRecent`).
    """

    def __init__(self, master: PackedEmbeddingBag, capacity: int, device: torch.device,
                 counters: CacheCounters, record: bool = False, victims: VictimPolicy | None = None):
        if capacity < 1:
            raise CacheCapacityError(f"a scratchpad needs at least one slot, got {capacity}")
        self.master, self.capacity, self.device, self.counters = master, int(capacity), device, counters
        dim, width = master.weight.shape[1], master.state.shape[1]
        self.weight = torch.zeros(capacity, dim, dtype=master.weight.dtype, device=device)  # (C, D)
        self.state = torch.zeros(capacity, width, dtype=master.state.dtype, device=device)  # (C, k)
        self.slot_of = torch.full((master.weight.shape[0],), EMPTY, dtype=torch.int64)  # (R,)
        self.row_of = torch.full((capacity,), EMPTY, dtype=torch.int64)  # (C,)
        self.last_use = torch.zeros(capacity, dtype=torch.int64)  # (C,) stamp of the last use
        self.uses = torch.zeros(capacity, dtype=torch.int64)  # (C,) batches that used it since its fetch
        self.victims = victims if victims is not None else LeastRecent()
        self.row_bytes = (dim * master.weight.element_size() + width * master.state.element_size())
        self.log: list[Exchange] | None = [] if record else None

    @property
    def resident(self) -> int:
        return int((self.row_of != EMPTY).sum())

    def exchange(self, needed: torch.Tensor, pinned: torch.Tensor, stamp: int,
                 horizon: Horizon | None = None) -> None:
        """Make `needed` (sorted unique rows) resident without evicting `pinned` (sorted unique,
        a superset of `needed`); `horizon` is what the victim policy may know of later batches."""
        if pinned.numel() > self.capacity:
            raise CacheCapacityError(
                f"{pinned.numel():,} rows must be resident together but the cache has "
                f"{self.capacity:,} slots: plan a larger cache (cache_rows) or a smaller window")
        at = self.slot_of[needed]
        missing = needed[at == EMPTY]
        if not missing.numel():
            return
        free = (self.row_of == EMPTY).nonzero().flatten()
        victims = self._victims(missing.numel() - free.numel(), pinned, horizon, at if pinned is needed else None)
        evicted = self.row_of[victims]
        if victims.numel():
            self._write_back(victims, evicted)
        slots = torch.cat([free, victims])[:missing.numel()]
        w, s = self.master.read_rows(missing)
        dev_slots = slots.to(self.device)
        self.weight.index_copy_(0, dev_slots, w.to(self.device, non_blocking=True))
        if self.state.shape[1]:
            self.state.index_copy_(0, dev_slots, s.to(self.device, non_blocking=True))
        self.counters.add_h2d(missing.numel() * self.row_bytes, missing.numel())
        self.slot_of[missing] = slots
        self.row_of[slots] = missing
        self.last_use[slots] = stamp
        self.uses[slots] = 0
        if self.log is not None:
            self.log.append(Exchange(stamp, tuple(missing.tolist()), tuple(evicted.tolist())))

    def _victims(self, n: int, pinned: torch.Tensor, horizon: Horizon | None,
                 pinned_slots: torch.Tensor | None = None) -> torch.Tensor:
        """The first `n` slots of the policy's order among resident rows not `pinned` (whose
        `slot_of` the caller may pass, `pinned_slots`).  # (n,) int64"""
        if n <= 0:
            return torch.zeros(0, dtype=torch.int64)
        occupied = (self.row_of != EMPTY).nonzero().flatten()
        held = torch.zeros(self.capacity, dtype=torch.bool)  # slots of the resident pinned rows
        slots = self.slot_of[pinned] if pinned_slots is None else pinned_slots
        held[slots[slots != EMPTY]] = True  # a third of `torch.isin`'s time over 100,000s of rows
        free_to_go = occupied[~held[occupied]]
        state = SlotState(self.row_of[free_to_go], self.last_use[free_to_go], self.uses[free_to_go])
        return free_to_go[self.victims.order(state, horizon)[:n]]

    def _write_back(self, slots: torch.Tensor, rows: torch.Tensor) -> None:
        dev_slots = slots.to(self.device)
        self.master.write_rows(rows, self.weight.index_select(0, dev_slots).cpu(),
                               self.state.index_select(0, dev_slots).cpu())
        self.counters.add_d2h(rows.numel() * self.row_bytes, rows.numel())
        self.slot_of[rows] = EMPTY
        self.row_of[slots] = EMPTY

    def touch(self, rows: torch.Tensor, stamp: int) -> torch.Tensor:
        """Slots of resident sorted unique `rows`, stamped and counted as used now (call once a
        batch).  # (n,) int64"""
        slots = self.slot_of[rows]
        self.last_use[slots] = stamp
        self.uses[slots] += 1
        return slots

    def flush(self) -> None:
        """Write every resident row back (they stay resident and clean copies stay valid)."""
        slots = (self.row_of != EMPTY).nonzero().flatten()
        if slots.numel():
            dev_slots = slots.to(self.device)
            rows = self.row_of[slots]
            self.master.write_rows(rows, self.weight.index_select(0, dev_slots).cpu(),
                                   self.state.index_select(0, dev_slots).cpu())
            self.counters.add_d2h(rows.numel() * self.row_bytes, rows.numel())

    def clear(self) -> None:
        """Forget every resident row without writing it back (after the master was reloaded)."""
        self.slot_of.fill_(EMPTY)
        self.row_of.fill_(EMPTY)
        self.last_use.zero_()
        self.uses.zero_()

    def current_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """Current weights of `rows`: resident ones from their slots, the rest from the master.  # (n, D)"""
        out = self.master.weight.index_select(0, rows).clone()
        slots = self.slot_of[rows]
        hit = slots != EMPTY
        if bool(hit.any()):
            out[hit] = self.weight.index_select(0, slots[hit].to(self.device)).cpu()
        return out
