"""Embedding placements for tables larger than device memory, and their counters.

`CACHE_MODULES` maps each host-side placement of `flowrec.graph.kinds.PLACEMENTS` to the module
class that runs it: `host` (the whole table on the host), `static_hot` (FAE hot rows on the
device), `lookahead` (ScratchPipe scratchpad). `flowrec.testing.lru.LRUEmbedding` is a demand-fetch baseline for
benchmarks and tests; no plan places a group with it. Every class takes `(group, seed, device)`.

Example:
    >>> sorted(CACHE_MODULES)
    ['host', 'lookahead', 'static_hot']
"""
from __future__ import annotations

from flowrec.runtime.caches.base import CacheCapacityError, CachedEmbedding
from flowrec.runtime.caches.counters import CacheCounters, collect_counters
from flowrec.runtime.caches.host import HostEmbedding
from flowrec.runtime.caches.lookahead_cache import LookaheadEmbedding
from flowrec.runtime.caches.static_hot import StaticHotEmbedding, hottest_rows

CACHE_MODULES = {
    "host": HostEmbedding,
    "static_hot": StaticHotEmbedding,
    "lookahead": LookaheadEmbedding,
}

__all__ = ["CACHE_MODULES", "CacheCapacityError", "CacheCounters", "CachedEmbedding", "HostEmbedding",
           "LookaheadEmbedding", "StaticHotEmbedding", "collect_counters", "hottest_rows"]
