"""Policy `lookahead` (ScratchPipe, Kwon & Rhu, ISCA 2022): every train-time lookup hits.

The data stage attaches to batch i, per group, the unique rows of batches i..i+W-1
(`GroupIds.window_unique`). When batch i arrives its rows are already resident (fetched while an
earlier batch trained) unless it is the first batch or W = 1, in which case the exchange runs
first (a counted stall). The cache then starts the exchange for the window of batch i, pinning
every row that batches i..i+W-1 use, so the rows of batch i+W-1 arrive while batch i trains in
place on its slots; victims are never rows of batches i..i+W-1 and are written back, with their
optimizer state, before their slot is reused. Victims use the future the data stage knows
(`victims.NextUseFirst`): rows that no batch of the horizon after the window uses go first,
fewest uses since their fetch first, then the rows the horizon uses, furthest next use first.
The exchange runs on a worker thread on a side stream that first waits for the work queued so
far (`operators.device`: a CUDA stream, or the CPU runtime's synchronous one); with
`interleave=False` it runs inline. Capacity comes from the plan's `cache_rows`; a window that
does not fit is a `CacheCapacityError`.

Example:
    >>> emb = LookaheadEmbedding(group, seed=0, device=torch.device("cpu"))  # doctest: +SKIP
    >>> out = emb.forward_group(batch.groups[group.name])  # (B, S, D), every lookup a hit  # doctest: +SKIP
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from flowrec.graph.types import PackedGroup
from flowrec.runtime.caches.base import CachedEmbedding
from flowrec.runtime.caches.scratchpad import EMPTY, Scratchpad
from flowrec.runtime.caches.slots import SlotTable, remap_casting, slot_bag
from flowrec.runtime.caches.victims import Horizon, LeastRecent, NextUseFirst, VictimPolicy
from operators.device import DeviceEvent


class SlotCache(CachedEmbedding):
    """A scratchpad-backed placement: lookups train in place on slots (LRU and lookahead).

    Args:
        group: the packed group; `group.cache_rows` slots unless `capacity` is given.
        seed: model seed.
        device: compute device.
        capacity: slots (default: the plan's cache_rows).
        record: keep the scratchpad's exchange log.
    """

    victims: type[VictimPolicy] = LeastRecent

    def __init__(self, group: PackedGroup, seed: int, device: torch.device, capacity: int | None = None,
                 record: bool = False):
        super().__init__(group, seed, device)
        self.pad = Scratchpad(self.master, capacity if capacity is not None else group.cache_rows,
                              self.device, self.counters, record, self.victims())
        self.slots = SlotTable(self.pad.weight, self.pad.state, self.optimizer,
                               None if self.mean_flags is None else self.mean_flags.to(self.device),
                               group.bags_per_sample)
        self.stamp = 0

    def train_lookup(self, gids: Any, rows: torch.Tensor, hits: int | None = None) -> torch.Tensor:
        """Pooled lookup of a batch whose `rows` are all resident; trains the slots in place.

        Args:
            gids: the batch's `GroupIds`.
            rows: its sorted unique rows.
            hits: lookups that hit before a demand fetch (default: those resident now).
        """
        ids = gids.ids.cpu()
        slot_ids = self.pad.slot_of[ids]
        resident = int((slot_ids != EMPTY).sum())
        if resident != ids.numel():
            raise RuntimeError(f"group {self.group.name}: {ids.numel() - resident} lookups missed the cache")
        self.counters.add_lookups(ids.numel(), resident if hits is None else hits)
        casting = self.casting_of(gids)
        unique_slots = self.pad.touch(rows, self.stamp)
        out = slot_bag(self.slots, slot_ids.to(self.device), gids.offsets.to(self.device),
                       remap_casting(casting, unique_slots))
        self.counters.end_step(gids.offsets.numel() // max(self.group.bags_per_sample, 1))
        return out

    def current_rows(self, rows: torch.Tensor) -> torch.Tensor:
        self.wait()
        return self.pad.current_rows(rows)

    def sync_master(self) -> None:
        self.wait()
        self.pad.flush()

    def wait(self) -> None:
        """Finish any exchange in flight (no-op here)."""

    def reload_from_master(self) -> None:
        self.wait()
        self.pad.clear()

    def reset_rows(self, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
        """Overwrite packed `rows` in the master and in the slots holding them (they stay resident)."""
        self.wait()
        self.master.write_rows(rows, weights, state)
        slots = self.pad.slot_of[rows]
        hit = slots != EMPTY
        if bool(hit.any()):
            dev = slots[hit].to(self.device)
            self.pad.weight.index_copy_(0, dev, weights[hit].to(self.device, self.pad.weight.dtype))
            if self.pad.state.shape[1]:
                self.pad.state.index_copy_(0, dev, state[hit].to(self.device, self.pad.state.dtype))


def horizon_of(gids: Any) -> Horizon | None:
    """The data stage's rows after the window with their next use, or None (no horizon staged)."""
    if gids.horizon_rows is None:
        return None
    return Horizon(gids.horizon_rows.cpu(), gids.horizon_next.cpu())


class LookaheadEmbedding(SlotCache):
    """ScratchPipe's lookahead cache (see the module docstring).

    Args:
        group: the packed group (`cache_rows` slots).
        seed: model seed.
        device: compute device.
        capacity: slots (default: the plan's cache_rows).
        interleave: run the exchange for the window on a worker thread / side stream while the
            current batch trains (False: inline, the sequential schedule).
        record: keep the scratchpad's exchange log.
    """

    victims = NextUseFirst

    def __init__(self, group: PackedGroup, seed: int, device: torch.device, capacity: int | None = None,
                 interleave: bool = True, record: bool = False):
        super().__init__(group, seed, device, capacity, record)
        self.interleave = interleave
        self._pool: ThreadPoolExecutor | None = None
        self._pending: Future | None = None
        self._stream = self.runtime.side_stream()

    def forward_group(self, gids: Any) -> torch.Tensor:
        if not torch.is_grad_enabled():
            return self.gather_lookup(gids.ids, gids.offsets)
        self.count_index(gids)
        self.wait()
        self.stamp += 1
        rows = self.unique_rows(gids)
        window = gids.window_unique.cpu() if gids.window_unique is not None else rows
        horizon = horizon_of(gids)
        missing = int((self.pad.slot_of[rows] == EMPTY).sum())
        if missing:  # pipeline fill (first batch, or W = 1): the batch waits for its rows
            self.counters.demand_rows += missing
            with self.counters.stall("exchange"):
                self.pad.exchange(rows, window, self.stamp, horizon)
        if self.interleave and window.numel() > rows.numel():
            self._pending = self._executor().submit(self._exchange, window, horizon, self._ready_event())
        else:
            with self.counters.stall("exchange"):
                self.pad.exchange(window, window, self.stamp, horizon)
        return self.train_lookup(gids, rows)

    def _exchange(self, window: torch.Tensor, horizon: Horizon | None, ready: DeviceEvent) -> DeviceEvent:
        with self._stream.use():
            self._stream.wait(ready)
            self.pad.exchange(window, window, self.stamp, horizon)
            return self._stream.record()

    def _ready_event(self) -> DeviceEvent:
        return self.runtime.record_current()

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix=f"flowrec-cache-{self.group.name}")
        return self._pool

    def wait(self) -> None:
        """Block until the exchange in flight is done (its rows and maps are then usable)."""
        if self._pending is None:
            return
        pending, self._pending = self._pending, None
        with self.counters.stall("exchange_wait"):
            self.runtime.wait_current(pending.result())

    def close(self) -> None:
        """Finish the exchange in flight and stop the worker thread."""
        self.wait()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    def __del__(self) -> None:
        pool = getattr(self, "_pool", None)
        if pool is not None:
            pool.shutdown(wait=False)
