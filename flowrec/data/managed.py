"""The id-to-row map of a managed table: admission by count, eviction every N steps.

Decision (from the peers in issue 27): sorted raw ids searched by bisection, as TorchRec's
managed-collision modules (MCH/ZCH) keep them, over parallel numpy arrays (``keys`` sorted,
``row``, ``count``, ``last``), instead of a hash map (Monolith's cuckoo tables, HierarchicalKV):
one `np.searchsorted` remaps a whole batch with no Python loop, the state is five flat arrays
that are saved and restored as they are, and the only O(map) work, deleting ids, happens at the
eviction passes every `every_steps` steps. A new id is inserted with `np.insert` (a memory move of
the arrays per batch that brings new ids).

The rule, per step (one batch), exactly as `tests/unit/test_managed_map.py`'s plain dict reference:

1. If ``clock > 0`` and ``clock % every_steps == 0``: an eviction pass (`_evict`). Ids unseen for
   more than ``ttl_steps`` steps are dropped. Then the contenders (ids holding a row, and ids
   without one whose count reaches ``admit_min_count``) compete: if there are more than
   ``rows``, the best ``rows`` by score keep or get a row and the other row holders lose theirs.
   Ids without a row are bounded to the best ``rows`` of them. Every freed row is *reset* (its
   weights and optimizer state start afresh before this step trains).
2. Each distinct raw id of the batch adds its occurrences to its count (decayed first under
   decayed_lfu) and its last step becomes ``clock``; unknown ids enter without a row.
3. Ids of the batch without a row whose count reaches ``admit_min_count`` take free rows, lowest
   row first, best score first, while free rows last.
4. Each occurrence reads its id's row, or -1 (the default: missing, not admitted, evicted).

Scores (higher keeps the row; ties by the other field, then the smaller raw id): lfu: (count,
last); lru: (last, count); decayed_lfu: (count * decay ** ((clock - last) / every_steps), last).

Example:
    >>> from flowrec.spec.model import ManagedSpec
    >>> m = ManagedMap(ManagedSpec(rows=2, admit_min_count=2))
    >>> m.step(np.array([5, 5, 9])).rows.tolist()
    [0, 0, -1]
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flowrec.data.raw_ids import MISSING_ID
from flowrec.spec.model import ManagedSpec

NO_ROW = -1  # the row of an id that has none (reads the default)
STATE_KEYS = ("keys", "row", "count", "last", "free", "clock", "stats")
STATS = ("admitted", "evicted", "expired")  # ids given a row, rows lost in a contest, rows lost by TTL


@dataclass(frozen=True)
class MapStep:
    """What one step of a map did.

    Args:
        rows: the row of each input id, NO_ROW for the default.  # (N,) int64
        resets: rows freed by this step's eviction pass, sorted (reset before the step trains).
        unique: the distinct raw ids of the step (MISSING_ID excluded), sorted.  # (U,) int64
        counts: their occurrences.  # (U,) int64
    """

    rows: np.ndarray
    resets: np.ndarray
    unique: np.ndarray
    counts: np.ndarray


class ManagedMap:
    """The id-to-row map of one managed table (see the module docstring).

    Args:
        spec: the table's managed settings.
    """

    def __init__(self, spec: ManagedSpec):
        self.spec = spec
        self.keys = np.zeros(0, np.int64)  # (M,) sorted raw ids
        self.row = np.zeros(0, np.int64)  # (M,) row or NO_ROW
        self.count = np.zeros(0, np.float64)  # (M,) occurrences (decayed under decayed_lfu)
        self.last = np.zeros(0, np.int64)  # (M,) clock of the last step that saw the id
        self.free = np.arange(spec.rows, dtype=np.int64)  # sorted free rows
        self.clock = 0  # steps taken
        self.stats = np.zeros(len(STATS), np.int64)  # totals since the map began (STATS)

    def step(self, ids: np.ndarray) -> MapStep:
        """Count, admit and remap one batch's raw ids (all occurrences of the table)."""
        valid = ids != MISSING_ID
        unique, inverse, counts = np.unique(ids[valid], return_inverse=True, return_counts=True)
        resets, unique_rows = self.step_counts(unique, counts)
        rows = np.full(len(ids), NO_ROW, np.int64)
        rows[valid] = unique_rows[inverse.reshape(-1)]
        return MapStep(rows, resets, unique, counts)

    def step_counts(self, unique: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step from the batch's sorted distinct ids and their occurrences.

        Returns:
            (rows freed and reset by this step's eviction pass, the row of each distinct id).
        """
        resets = self._evict() if self.clock > 0 and self.clock % self.spec.every_steps == 0 else _EMPTY
        pos = np.searchsorted(self.keys, unique)
        found = pos < len(self.keys)
        found[found] = self.keys[pos[found]] == unique[found]
        hit = pos[found]
        self.count[hit] = self._decayed(hit) + counts[found]
        self.last[hit] = self.clock
        new = ~found
        if new.any():
            at = pos[new]
            self.keys = np.insert(self.keys, at, unique[new])
            self.row = np.insert(self.row, at, NO_ROW)
            self.count = np.insert(self.count, at, counts[new].astype(np.float64))
            self.last = np.insert(self.last, at, self.clock)
            pos = np.searchsorted(self.keys, unique)
        self._admit(pos)
        self.clock += 1
        return resets, self.row[pos]

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of raw ids without counting them (evaluation, serving): NO_ROW for unknown ids."""
        pos = np.minimum(np.searchsorted(self.keys, ids), max(len(self.keys) - 1, 0))
        if not len(self.keys):
            return np.full(len(ids), NO_ROW, np.int64)
        return np.where((self.keys[pos] == ids) & (ids != MISSING_ID), self.row[pos], NO_ROW)

    def _decayed(self, at: np.ndarray | slice) -> np.ndarray:
        """Counts of entries `at` as of now (decayed_lfu: by the steps since each was seen)."""
        if self.spec.evict != "decayed_lfu":
            return self.count[at]
        idle = (self.clock - self.last[at]) / self.spec.every_steps
        return self.count[at] * self.spec.decay ** idle

    def _order(self, at: np.ndarray) -> np.ndarray:
        """Entries `at` best score first (ties by the smaller raw id)."""
        score = self._decayed(at)
        first, second = (self.last[at], score) if self.spec.evict == "lru" else (score, self.last[at])
        return at[np.lexsort((self.keys[at], -second, -first))]

    def _admit(self, pos: np.ndarray) -> None:
        """Free rows to the batch's ids that have none and reached the admission count."""
        waiting = pos[(self.row[pos] == NO_ROW) & (self.count[pos] >= self.spec.admit_min_count)]
        if not len(waiting) or not len(self.free):
            return
        self._give(self._order(waiting))

    def _give(self, ordered: np.ndarray) -> None:
        """Free rows, lowest first, to entries `ordered` (best first) while free rows last."""
        take = ordered[:len(self.free)]
        self.row[take] = self.free[:len(take)]
        self.free = self.free[len(take):]
        self.stats[0] += len(take)

    def _evict(self) -> np.ndarray:
        """The eviction pass (rule 1); returns the freed rows, sorted."""
        ttl = self.spec.ttl_steps
        drop = (self.clock - self.last > ttl) if ttl is not None else np.zeros(len(self.keys), bool)
        freed = [self.row[drop & (self.row != NO_ROW)]]
        self.stats[2] += len(freed[0])
        self._keep(~drop)
        holders = np.flatnonzero(self.row != NO_ROW)
        eligible = np.flatnonzero((self.row == NO_ROW) & (self._decayed(slice(None)) >= self.spec.admit_min_count))
        contenders = np.concatenate([holders, eligible])
        if len(contenders) > self.spec.rows:
            losers = self._order(contenders)[self.spec.rows:]
            losers = losers[self.row[losers] != NO_ROW]
            freed.append(self.row[losers])
            self.stats[1] += len(losers)
            self.row[losers] = NO_ROW
        freed_rows = np.sort(np.concatenate(freed))
        self.free = np.sort(np.concatenate([self.free, freed_rows]))
        waiting = eligible[self.row[eligible] == NO_ROW]
        if len(waiting) and len(self.free):
            self._give(self._order(waiting))
        self._bound_waiting()
        return freed_rows

    def _bound_waiting(self) -> None:
        """Keep at most `rows` ids without a row: the best scored."""
        waiting = np.flatnonzero(self.row == NO_ROW)
        if len(waiting) <= self.spec.rows:
            return
        keep = np.ones(len(self.keys), bool)
        keep[self._order(waiting)[self.spec.rows:]] = False
        self._keep(keep)

    def _keep(self, mask: np.ndarray) -> None:
        self.keys, self.row = self.keys[mask], self.row[mask]
        self.count, self.last = self.count[mask], self.last[mask]

    @property
    def occupied(self) -> int:
        """Rows held by ids."""
        return self.spec.rows - len(self.free)

    def state(self) -> dict[str, np.ndarray]:
        """The map as arrays (`STATE_KEYS`): what a checkpoint saves."""
        return {"keys": self.keys.copy(), "row": self.row.copy(), "count": self.count.copy(),
                "last": self.last.copy(), "free": self.free.copy(), "clock": np.array([self.clock], np.int64),
                "stats": self.stats.copy()}

    def load(self, state: dict[str, np.ndarray]) -> "ManagedMap":
        """Restore `state()`; returns self.

        Raises:
            ValueError: arrays of different lengths, or rows that do not fit the capacity.
        """
        keys, row = np.asarray(state["keys"], np.int64), np.asarray(state["row"], np.int64)
        count, last = np.asarray(state["count"], np.float64), np.asarray(state["last"], np.int64)
        free = np.asarray(state["free"], np.int64)
        held = row[row != NO_ROW]
        if not (len(keys) == len(row) == len(count) == len(last)) or len(held) + len(free) != self.spec.rows \
                or (len(keys) > 1 and bool((np.diff(keys) <= 0).any())):
            raise ValueError(f"a managed map of {len(keys)} ids does not fit a table of {self.spec.rows} rows")
        self.keys, self.row, self.count, self.last, self.free = keys, row, count, last, free
        self.clock = int(np.asarray(state["clock"]).reshape(-1)[0])
        self.stats = np.asarray(state["stats"], np.int64).reshape(-1)[:len(STATS)].copy()
        return self

    def report(self) -> dict[str, int]:
        """Occupancy and totals: rows, rows held, ids waiting for a row, admitted, evicted, expired."""
        held = int((self.row != NO_ROW).sum())
        return {"rows": self.spec.rows, "held": held, "waiting": len(self.keys) - held,
                **{name: int(v) for name, v in zip(STATS, self.stats)}}

    def copy(self) -> "ManagedMap":
        return ManagedMap(self.spec).load(self.state())


_EMPTY = np.zeros(0, np.int64)
