"""The data stage of managed tables: raw-id hashes become rows before packing and lookahead.

A `Remapper` holds the maps of a spec's managed tables (`flowrec.data.managed`) and rewrites the
columns of each batch, in batch order, before the batch is packed: the caches, the casted
backward and the lookahead window only ever see rows. In training mode it runs each map's step
(counts, admission, eviction) and the batch carries what the step did (`ManagedBatch`: the
distinct ids and their counts, so the trainer replays the step on the map it checkpoints, and
the packed rows freed by an eviction pass, reset before the batch trains); in evaluation mode
it only looks ids up. An id without a row is dropped from its bag after packing (`drop_defaults`),
which is reading an all-zero default row that trains nothing: a one-hot field pools to zeros, a
sum bag sums the other ids, a mean bag averages its admitted ids, a sequence position is empty
(masked, like padding).

Example (a managed table of 2 rows that admits an id at its second occurrence):
    >>> from flowrec.graph.types import PackedGroup, TableSlot
    >>> from flowrec.spec.load import spec_from_dict
    >>> spec = spec_from_dict({"name": "m", "features": [{"name": "user", "type": "categorical", "table": "users"}],
    ...     "tables": [{"name": "users", "dim": 4, "managed": {"rows": 2, "admit_min_count": 2}}],
    ...     "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
    ...     "heads": [{"name": "ctr", "input": "top"}]})
    >>> groups = (PackedGroup("g", 4, "fp32", ("sgd", 0.1, ()), (TableSlot("users", 2, 0),), ("user",)),)
    >>> remap = Remapper(spec, groups, {"users": ManagedMap(spec.table("users").managed)}, train=True)
    >>> cols, managed = remap.remap({"user": np.array([5, 5, 9])})  # raw-id hashes, in batch order
    >>> cols["user"].tolist() == [0, 0, DROPPED], managed.defaults, managed.lookups
    (True, 1, 3)
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from flowrec.data.managed import NO_ROW, ManagedMap
from flowrec.data.packed_ids import Column
from flowrec.graph.types import PackedGroup
from flowrec.spec.model import ModelSpec

DROPPED = -(1 << 62)  # local row of an id without one: every packed id it gives is negative
POLL_S = 0.05  # seconds between stop-flag checks while waiting for a turn


@dataclass(frozen=True)
class ManagedBatch:
    """What the managed maps did for one training batch.

    Args:
        steps: table -> (sorted distinct raw ids, their occurrences): the map step to replay.
        resets: group -> packed rows freed by an eviction pass, reset before the batch trains.
        clocks: table -> the map's clock before this batch (the step number it replays at).
        defaults: lookups that read the default row (missing, not admitted, evicted).
        lookups: lookups of managed tables in the batch.
        tables: table -> (its lookups, those that read the default row).
    """

    steps: dict[str, tuple[np.ndarray, np.ndarray]]
    resets: dict[str, torch.Tensor]
    clocks: dict[str, int]
    defaults: int
    lookups: int = 0
    tables: dict[str, tuple[int, int]] = field(default_factory=dict)


class Remapper:
    """Rewrites managed columns of batches (see the module docstring).

    Args:
        spec: the model spec.
        groups: the packed layout (for the packed rows of resets).
        maps: table -> its map (the remapper's own copies: training steps change them).
        train: step the maps (count, admit, evict) or only look ids up.
    """

    replicated = True  # under several ranks: this rank's maps are replicas, stepped on the whole batch

    def __init__(self, spec: ModelSpec, groups: tuple[PackedGroup, ...], maps: dict[str, ManagedMap],
                 train: bool):
        self.maps, self.train = maps, train
        self.features = {name: [f.name for f in spec.sparse_features if f.table == name] for name in maps}
        self.where = {t.table: (g.name, t.row_offset) for g in groups for t in g.tables if t.table in maps}
        self.groups = frozenset(name for name, _ in self.where.values())
        self._turn = 0
        self._cond = threading.Condition()

    def remap(self, cols: dict[str, Column]) -> tuple[dict[str, Column], ManagedBatch]:
        """Columns with rows instead of raw ids (DROPPED for the default) and what the maps did."""
        cols = dict(cols)
        steps, resets, clocks, defaults, lookups, tables = {}, {}, {}, 0, 0, {}
        for table, m in self.maps.items():
            names = self.features[table]
            flat = np.concatenate([_values(cols[n]) for n in names]) if names else np.zeros(0, np.int64)
            clocks[table] = m.clock
            if self.train:
                done = m.step(flat)
                rows = done.rows
                steps[table] = (done.unique, done.counts)
                if len(done.resets):
                    group, offset = self.where[table]
                    packed = torch.from_numpy(done.resets + offset)
                    resets[group] = torch.cat([resets[group], packed]) if group in resets else packed
            else:
                rows = m.lookup(flat)
            tables[table] = (len(rows), int((rows == NO_ROW).sum()))
            defaults += tables[table][1]
            lookups += len(rows)
            rows = np.where(rows == NO_ROW, DROPPED, rows)
            start = 0
            for n in names:
                k = len(_values(cols[n]))
                cols[n] = _with_values(cols[n], rows[start:start + k])
                start += k
        return cols, ManagedBatch(steps, {g: torch.sort(r).values for g, r in resets.items()}, clocks, defaults,
                                  lookups, tables)

    def in_turn(self, turn: int, stopped: Callable[[], bool], work: Callable[[], Any]) -> Any:
        """Run `work` as turn number `turn` (0, 1, ... in submission order), after turn - 1;
        returns None when `stopped` while waiting."""
        with self._cond:
            while self._turn != turn:
                if stopped():
                    return None
                self._cond.wait(POLL_S)
        try:
            return work()
        finally:
            with self._cond:
                self._turn = turn + 1
                self._cond.notify_all()


def drop_defaults(ids: np.ndarray, offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Remove the ids of DROPPED rows (negative packed ids) from their bags.  # (nnz',), (NB + 1,)"""
    keep = ids >= 0
    if keep.all():
        return ids, offsets
    lengths = np.diff(offsets)
    bag = np.repeat(np.arange(len(lengths)), lengths)
    kept = np.bincount(bag[keep], minlength=len(lengths))
    out = np.zeros(len(offsets), np.int64)
    np.cumsum(kept, out=out[1:])
    return ids[keep], out


def cut_columns(cols: dict[str, Column], lo: int, hi: int) -> dict[str, Column]:
    """Samples [lo, hi) of a batch's columns (one-hot ids, or (values, offsets) lists)."""
    out: dict[str, Column] = {}
    for name, col in cols.items():
        if isinstance(col, tuple):
            values, offsets = col
            out[name] = (values[offsets[lo]:offsets[hi]], offsets[lo:hi + 1] - offsets[lo])
        else:
            out[name] = col[lo:hi]
    return out


def fold_raw_ids(spec: ModelSpec, cols: dict[str, Column]) -> dict[str, Column]:
    """Managed columns folded into their tables' rows by hash (a stand-in for the rows the map
    would give: profiles and samples that only estimate accesses, before any map exists)."""
    cols = dict(cols)
    for f in spec.sparse_features:
        t = spec.table(f.table)
        if t.managed is not None:
            rows = (_values(cols[f.name]).view(np.uint64) % np.uint64(t.rows)).astype(np.int64)
            cols[f.name] = _with_values(cols[f.name], rows)
    return cols


def _values(col: Column) -> np.ndarray:
    return col[0] if isinstance(col, tuple) else col


def _with_values(col: Column, values: np.ndarray) -> Column:
    return (values, col[1]) if isinstance(col, tuple) else values
