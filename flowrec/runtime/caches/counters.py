"""Traffic and time counters of one embedding module: data the trainer logs and the report shows.

Bytes of training steps are counted where they would cross the host-device link (on a CPU-only
machine nothing moves, but the same logical transfers are counted): ids and offsets of the batch
(and where the device is not the host, the casting index that crosses with them), rows fetched
into a cache with their optimizer state, rows written back, pooled rows of host lookups and their
gradients. Evaluation lookups are not step traffic and are not counted; a
one-time placement of rows (a static_hot group's hot rows) and write-backs for a checkpoint or an
evaluation are counted apart, as `outside_bytes`. Hits count lookups (ids) served by device-resident rows. Stall time is wall time
the training thread spent waiting for a stage (exchange, host gather, sync), by stage name.

Example:
    >>> c = CacheCounters()
    >>> c.add_h2d(128); c.add_lookups(10, hits=9); c.end_step()
    >>> c.snapshot()["hit_rate"]
    0.9
"""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Iterator

INDEX_BYTES = 8  # int64 ids and offsets


@dataclass
class CacheCounters:
    """Running totals of one module (mutable accumulator; `snapshot()` returns plain data).

    Args:
        h2d_bytes: host -> device bytes of training steps.
        d2h_bytes: device -> host bytes of training steps.
        outside_bytes: bytes moved either way outside training steps (`outside_steps`).
        rows_fetched: rows copied into device slots (with their optimizer state).
        rows_written_back: rows copied back to the host master copy.
        demand_rows: rows fetched while the training thread waited for them (not ahead).
        lookups: ids looked up.
        hits: ids whose row was device-resident at lookup time.
        steps: training steps counted.
        samples: samples looked up in training steps.
        stall_s: seconds the training thread waited, per stage.
        outside: transfers now are outside training steps.
    """

    h2d_bytes: int = 0
    d2h_bytes: int = 0
    outside_bytes: int = 0
    rows_fetched: int = 0
    rows_written_back: int = 0
    demand_rows: int = 0
    lookups: int = 0
    hits: int = 0
    steps: int = 0
    samples: int = 0
    stall_s: dict[str, float] = field(default_factory=dict)
    outside: bool = False  # within `outside_steps`

    def add_h2d(self, nbytes: int, rows: int = 0) -> None:
        if self.outside:
            self.outside_bytes += int(nbytes)
        else:
            self.h2d_bytes += int(nbytes)
        self.rows_fetched += int(rows)

    def add_d2h(self, nbytes: int, rows: int = 0) -> None:
        if self.outside:
            self.outside_bytes += int(nbytes)
        else:
            self.d2h_bytes += int(nbytes)
        self.rows_written_back += int(rows)

    @contextmanager
    def outside_steps(self) -> Iterator[None]:
        """Count the enclosed transfers as `outside_bytes` (placing hot rows at the start, writing
        rows back for a checkpoint or an evaluation), not as traffic of the training steps."""
        before, self.outside = self.outside, True
        try:
            yield
        finally:
            self.outside = before

    def add_index(self, nnz: int, num_offsets: int) -> None:
        """The batch's ids and offsets crossing to the device."""
        self.h2d_bytes += (int(nnz) + int(num_offsets)) * INDEX_BYTES

    def add_lookups(self, n: int, hits: int) -> None:
        self.lookups += int(n)
        self.hits += int(hits)

    def end_step(self, samples: int = 0) -> None:
        self.steps += 1
        self.samples += int(samples)

    @contextmanager
    def stall(self, stage: str) -> Iterator[None]:
        """Time the enclosed block as a stall of `stage`."""
        start = time.perf_counter()
        try:
            yield
        finally:
            self.stall_s[stage] = self.stall_s.get(stage, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        self.__init__()  # type: ignore[misc]

    def snapshot(self) -> dict[str, Any]:
        """Totals and per-step / per-sample rates as a dict of plain numbers."""
        steps, samples = max(self.steps, 1), max(self.samples, 1)
        return {
            "h2d_bytes": self.h2d_bytes, "d2h_bytes": self.d2h_bytes, "outside_bytes": self.outside_bytes,
            "rows_fetched": self.rows_fetched, "rows_written_back": self.rows_written_back,
            "demand_rows": self.demand_rows,
            "lookups": self.lookups, "hits": self.hits,
            "hit_rate": self.hits / self.lookups if self.lookups else 1.0,
            "steps": self.steps, "samples": self.samples,
            "h2d_bytes_per_step": self.h2d_bytes / steps, "d2h_bytes_per_step": self.d2h_bytes / steps,
            "bytes_per_sample": (self.h2d_bytes + self.d2h_bytes) / samples,
            "stall_s": dict(self.stall_s),
        }


def collect_counters(model: Any) -> dict[str, dict[str, Any]]:
    """Snapshots of every embedding module of a lowered model that keeps counters.

    Args:
        model: a `LoweredModel` (anything with an `embeddings` mapping).

    Returns:
        {group: counters snapshot} for the modules with a `counters` attribute.
    """
    return {name: module.counters.snapshot() for name, module in model.embeddings.items()
            if isinstance(getattr(module, "counters", None), CacheCounters)}
