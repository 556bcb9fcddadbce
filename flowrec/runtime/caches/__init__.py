"""Embedding placements for tables larger than device memory, and their counters.

`PLACEMENTS` maps a placement name to the module class that runs it: `host` (the whole table on
the host), `static_hot` (FAE hot rows on the device), `lookahead` (ScratchPipe scratchpad), and
`lru` (a demand-fetch baseline for comparison; the planner never chooses it). Every class takes
`(group, seed, device)`.

Example:
    >>> sorted(PLACEMENTS)
    ['host', 'lookahead', 'lru', 'static_hot']
"""
from __future__ import annotations

from flowrec.runtime.caches.base import CacheCapacityError, CachedEmbedding
from flowrec.runtime.caches.counters import CacheCounters, collect_counters
from flowrec.runtime.caches.host import HostEmbedding
from flowrec.runtime.caches.lookahead import LookaheadEmbedding
from flowrec.runtime.caches.lru import LRUEmbedding
from flowrec.runtime.caches.static_hot import StaticHotEmbedding, hottest_rows

PLACEMENTS = {
    "host": HostEmbedding,
    "static_hot": StaticHotEmbedding,
    "lookahead": LookaheadEmbedding,
    "lru": LRUEmbedding,
}

__all__ = ["PLACEMENTS", "CacheCapacityError", "CacheCounters", "CachedEmbedding", "HostEmbedding",
           "LRUEmbedding", "LookaheadEmbedding", "StaticHotEmbedding", "collect_counters", "hottest_rows"]
