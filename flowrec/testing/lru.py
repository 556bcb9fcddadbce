"""Baseline `lru`: a demand-fetch LRU cache of the same scratchpad, for comparison.

Each batch's missing rows are fetched when the batch arrives (the training thread waits: a
counted stall); when the slots are full the least recently used rows not used by this batch are
evicted and written back. No lookahead: rows a later batch needs may be evicted just before it.

Example:
    >>> emb = LRUEmbedding(group, seed=0, device=torch.device("cpu"), capacity=10_000)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any

import torch

from flowrec.runtime.caches.lookahead_cache import SlotCache
from flowrec.runtime.caches.scratchpad import EMPTY


class LRUEmbedding(SlotCache):
    """Demand-fetch LRU over a scratchpad (see the module docstring)."""

    def forward_group(self, gids: Any) -> torch.Tensor:
        self.count_index(gids)
        if not torch.is_grad_enabled():
            return self.gather_lookup(gids.ids, gids.offsets)
        self.stamp += 1
        rows = self.unique_rows(gids)
        hits = int((self.pad.slot_of[gids.ids.cpu()] != EMPTY).sum())
        self.counters.demand_rows += int((self.pad.slot_of[rows] == EMPTY).sum())
        with self.counters.stall("fetch"):
            self.pad.exchange(rows, rows, self.stamp)
        return self.train_lookup(gids, rows, hits)
