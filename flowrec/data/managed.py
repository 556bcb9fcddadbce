"""The id-to-row map of a managed table: admission by count, eviction every N steps.

Decision (from the peers in issue 27): sorted raw ids searched by bisection, as TorchRec's
managed-collision modules (MCH/ZCH) keep them, over parallel numpy arrays (``keys`` sorted,
``row``, ``count``, ``last``), instead of a hash map (Monolith's cuckoo tables, HierarchicalKV):
one `np.searchsorted` remaps a whole batch with no Python loop, the state is a few flat arrays
that are saved and restored as they are, and the O(map) work happens only at merges: new ids
wait in a small sorted buffer (`BUFFER_IDS`) searched beside the main entries (`Entries`), which
is merged into them at every eviction pass (where ids are also deleted) or when it is full, as
ZCH buffers new ids; a batch that brings new ids moves the buffer, not the map.

The rule, per step (one batch), exactly as the plain dict reference `flowrec.testing.managed_ref`:

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

from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from flowrec.data.raw_ids import MISSING_ID
from flowrec.spec.model import ManagedSpec

NO_ROW = -1  # the row of an id that has none (reads the default)
STATE_KEYS = ("keys", "row", "count", "last", "free", "clock", "stats")
STATS = ("admitted", "evicted", "expired")  # ids given a row, rows lost in a contest, rows lost by TTL
BUFFER_IDS = 1 << 16  # new ids held in the sorted buffer before it is merged into the main entries


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


class Entries:
    """Raw ids sorted, with their row (or NO_ROW), count and last step: parallel arrays.

    Args:
        keys: sorted unique raw ids.  # (M,) int64
        row: row of each, NO_ROW when it has none.  # (M,) int64
        count: occurrences (decayed under decayed_lfu as of `last`).  # (M,) float64
        last: map step that last saw each.  # (M,) int64
    """

    def __init__(self, keys: np.ndarray | None = None, row: np.ndarray | None = None,
                 count: np.ndarray | None = None, last: np.ndarray | None = None):
        self.keys = np.zeros(0, np.int64) if keys is None else keys
        self.row = np.zeros(0, np.int64) if row is None else row
        self.count = np.zeros(0, np.float64) if count is None else count
        self.last = np.zeros(0, np.int64) if last is None else last

    def __len__(self) -> int:
        return len(self.keys)

    def find(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(position, found) of each of `ids` (positions of unfound ids are insertion points)."""
        pos = np.searchsorted(self.keys, ids)
        found = pos < len(self.keys)
        found[found] = self.keys[pos[found]] == ids[found]
        return pos, found

    def add(self, ids: np.ndarray, counts: np.ndarray, clock: int) -> None:
        """Insert sorted `ids` (none present) without a row, seen `counts` times at `clock`."""
        self._insert(np.searchsorted(self.keys, ids), ids, np.full(len(ids), NO_ROW, np.int64),
                     counts.astype(np.float64), np.full(len(ids), clock, np.int64))

    def _insert(self, at: np.ndarray, keys: np.ndarray, row: np.ndarray, count: np.ndarray,
                last: np.ndarray) -> None:
        """Insert entries at their (nondecreasing) insertion points `at`: one pass per array, no sort."""
        slots = at + np.arange(len(at))  # their positions in the grown arrays
        old = np.ones(len(self.keys) + len(at), bool)
        old[slots] = False
        grown = []
        for mine, new in ((self.keys, keys), (self.row, row), (self.count, count), (self.last, last)):
            out = np.empty(len(old), mine.dtype)
            out[slots] = new
            out[old] = mine
            grown.append(out)
        self.keys, self.row, self.count, self.last = grown

    def keep(self, mask: np.ndarray) -> None:
        self.keys, self.row = self.keys[mask], self.row[mask]
        self.count, self.last = self.count[mask], self.last[mask]

    def merged(self, other: "Entries") -> "Entries":
        """Both sets of entries (disjoint ids) as one, sorted: `other` inserted into a copy of these
        (linear in the entries, no sort)."""
        if not len(other):
            return self
        out = Entries(self.keys, self.row, self.count, self.last)
        out._insert(np.searchsorted(self.keys, other.keys), other.keys, other.row, other.count, other.last)
        return out


def step_ids(step_counts: Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]],
             ids: np.ndarray) -> MapStep:
    """One map step on a batch's raw ids (every occurrence; MISSING_ID reads no row): its distinct
    ids and occurrences go to `step_counts(unique, counts) -> (resets, rows of the distinct ids)`,
    and each occurrence gets its id's row."""
    valid = ids != MISSING_ID
    unique, inverse, counts = np.unique(ids[valid], return_inverse=True, return_counts=True)
    resets, unique_rows = step_counts(unique, counts)
    rows = np.full(len(ids), NO_ROW, np.int64)
    rows[valid] = unique_rows[inverse.reshape(-1)]
    return MapStep(rows, resets, unique, counts)


class ManagedMap:
    """The id-to-row map of one managed table (see the module docstring).

    Ids new since the last merge wait in a small sorted buffer (`recent`) searched beside the main
    entries and merged into them at each eviction pass or when it exceeds `buffer_ids`, so a batch
    that brings new ids moves the buffer, not the whole map (TorchRec ZCH buffers new ids alike).

    Args:
        spec: the table's managed settings.
        buffer_ids: ids the buffer holds before it is merged.
    """

    def __init__(self, spec: ManagedSpec, buffer_ids: int = BUFFER_IDS):
        self.spec, self.buffer_ids = spec, buffer_ids
        self.main, self.recent = Entries(), Entries()
        self.free = np.arange(spec.rows, dtype=np.int64)  # sorted free rows
        self.clock = 0  # steps taken
        self.stats = np.zeros(len(STATS), np.int64)  # totals since the map began (STATS)

    def step(self, ids: np.ndarray) -> MapStep:
        """Count, admit and remap one batch's raw ids (all occurrences of the table)."""
        return step_ids(self.step_counts, ids)

    def step_counts(self, unique: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step from the batch's sorted distinct ids and their occurrences.

        Each id is searched once in the main entries and, when it is not there, once in the
        buffer (after the new ids enter it); admission reuses those positions.

        Returns:
            (rows freed and reset by this step's eviction pass, the row of each distinct id).
        """
        resets = self._evict() if self.clock > 0 and self.clock % self.spec.every_steps == 0 else _EMPTY
        main, recent = self.main, self.recent
        pos, in_main = main.find(unique)
        at_main = pos[in_main]
        main.count[at_main] = self._decayed(main, at_main) + counts[in_main]
        main.last[at_main] = self.clock
        rest = np.flatnonzero(~in_main)  # ids of the batch not in the main entries
        at_recent = _EMPTY
        if len(rest):
            ids = unique[rest]
            pos, found = recent.find(ids)
            hit = pos[found]
            recent.count[hit] = self._decayed(recent, hit) + counts[rest[found]]
            recent.last[hit] = self.clock
            if not found.all():
                recent.add(ids[~found], counts[rest[~found]], self.clock)
                pos = np.searchsorted(recent.keys, ids)
            at_recent = pos
        rows = self._admit(len(unique), ((main, np.flatnonzero(in_main), at_main), (recent, rest, at_recent)))
        if len(self.recent) > self.buffer_ids:
            self._merge()
        self.clock += 1
        return resets, rows

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of raw ids without counting them (evaluation, serving): NO_ROW for unknown ids."""
        out = np.full(len(ids), NO_ROW, np.int64)
        for part in (self.main, self.recent):
            pos, found = part.find(ids)
            out[found] = part.row[pos[found]]
        out[ids == MISSING_ID] = NO_ROW
        return out

    def _merge(self) -> None:
        self.main, self.recent = self.main.merged(self.recent), Entries()

    def _decayed(self, part: Entries, at: np.ndarray | slice) -> np.ndarray:
        """Counts of entries `at` as of now (decayed_lfu: by the steps since each was seen)."""
        if self.spec.evict != "decayed_lfu":
            return part.count[at]
        idle = (self.clock - part.last[at]) / self.spec.every_steps
        return part.count[at] * self.spec.decay ** idle

    def _keys_of(self, part: Entries, at: np.ndarray) -> tuple[np.ndarray, ...]:
        """lexsort keys of entries `at`, best score first: (raw id, -second, -first)."""
        score = self._decayed(part, at)
        first, second = (part.last[at], score) if self.spec.evict == "lru" else (score, part.last[at])
        return part.keys[at], -second, -first

    def _order(self, part: Entries, at: np.ndarray) -> np.ndarray:
        """Entries `at` best score first (ties by the smaller raw id)."""
        return at[np.lexsort(self._keys_of(part, at))]

    def _admit(self, n: int, located: tuple[tuple[Entries, np.ndarray, np.ndarray], ...]) -> np.ndarray:
        """Free rows to the batch's ids that have none and reached the admission count (ids of
        both parts ranked together); returns the row of each of the batch's `n` distinct ids.

        Args:
            n: distinct ids of the batch.
            located: per part, (entries, which of the distinct ids it holds, their positions in it).
        """
        if len(self.free):
            waiting = [at[(part.row[at] == NO_ROW) & (part.count[at] >= self.spec.admit_min_count)]
                       for part, _, at in located]
            if sum(len(w) for w in waiting):
                keys = [np.concatenate(k) for k in zip(*(self._keys_of(part, w) for (part, _, _), w in
                                                         zip(located, waiting)))]
                take = np.lexsort(keys)[:len(self.free)]
                rows = np.empty(len(keys[0]), np.int64)
                rows[take] = self.free[:len(take)]
                given = np.zeros(len(keys[0]), bool)
                given[take] = True
                start = 0
                for (part, _, _), w in zip(located, waiting):
                    mine = slice(start, start + len(w))
                    part.row[w[given[mine]]] = rows[mine][given[mine]]
                    start += len(w)
                self.free = self.free[len(take):]
                self.stats[0] += len(take)
        out = np.full(n, NO_ROW, np.int64)
        for part, which, at in located:
            out[which] = part.row[at]
        return out

    def _give(self, part: Entries, ordered: np.ndarray) -> None:
        """Free rows, lowest first, to entries `ordered` (best first) while free rows last."""
        take = ordered[:len(self.free)]
        part.row[take] = self.free[:len(take)]
        self.free = self.free[len(take):]
        self.stats[0] += len(take)

    def _evict(self) -> np.ndarray:
        """The eviction pass (rule 1) on the merged entries; returns the freed rows, sorted."""
        self._merge()
        m, ttl = self.main, self.spec.ttl_steps
        drop = (self.clock - m.last > ttl) if ttl is not None else np.zeros(len(m), bool)
        freed = [m.row[drop & (m.row != NO_ROW)]]
        self.stats[2] += len(freed[0])
        m.keep(~drop)
        holders = np.flatnonzero(m.row != NO_ROW)
        eligible = np.flatnonzero((m.row == NO_ROW) & (self._decayed(m, slice(None)) >= self.spec.admit_min_count))
        contenders = np.concatenate([holders, eligible])
        if len(contenders) > self.spec.rows:
            losers = self._order(m, contenders)[self.spec.rows:]
            losers = losers[m.row[losers] != NO_ROW]
            freed.append(m.row[losers])
            self.stats[1] += len(losers)
            m.row[losers] = NO_ROW
        freed_rows = np.sort(np.concatenate(freed))
        if len(freed_rows):  # two disjoint sorted sets merged in one pass: no sort of every free row at every pass
            self.free = np.insert(self.free, np.searchsorted(self.free, freed_rows), freed_rows)
        waiting = eligible[m.row[eligible] == NO_ROW]
        if len(waiting) and len(self.free):
            self._give(m, self._order(m, waiting))
        self._bound_waiting()
        return freed_rows

    def _bound_waiting(self) -> None:
        """Keep at most `rows` ids without a row: the best scored."""
        m = self.main
        waiting = np.flatnonzero(m.row == NO_ROW)
        if len(waiting) <= self.spec.rows:
            return
        keep = np.ones(len(m), bool)
        keep[self._order(m, waiting)[self.spec.rows:]] = False
        m.keep(keep)

    @property
    def occupied(self) -> int:
        """Rows held by ids."""
        return self.spec.rows - len(self.free)

    def entries(self) -> Entries:
        """Every id of the map (main and buffer) as one sorted set of entries (copies)."""
        both = self.main.merged(self.recent)
        return Entries(both.keys.copy(), both.row.copy(), both.count.copy(), both.last.copy())

    def state(self) -> dict[str, np.ndarray]:
        """The map as arrays (`STATE_KEYS`): what a checkpoint saves (the buffer merged)."""
        e = self.entries()
        return {"keys": e.keys, "row": e.row, "count": e.count, "last": e.last, "free": self.free.copy(),
                "clock": np.array([self.clock], np.int64), "stats": self.stats.copy()}

    def load(self, state: dict[str, np.ndarray], check: bool = True) -> "ManagedMap":
        """Restore `state()`; returns self (`check` False: a state this process made, `copy`).

        Raises:
            ValueError: arrays of different lengths, or rows that do not fit the capacity, or
                values no map holds (`check_state`): a damaged or edited state.
        """
        # copies: the map changes its arrays in place as it steps, and must never change the
        # caller's (a checkpoint's state dict, or a state loaded twice)
        keys, row = np.array(state["keys"], np.int64), np.array(state["row"], np.int64)
        count, last = np.array(state["count"], np.float64), np.array(state["last"], np.int64)
        free = np.array(state["free"], np.int64)
        clock, stats = np.array(state["clock"], np.int64).reshape(-1), np.array(state["stats"], np.int64).reshape(-1)
        held = row[row != NO_ROW]
        if not (len(keys) == len(row) == len(count) == len(last)) or len(held) + len(free) != self.spec.rows:
            raise ValueError(f"a managed map of {len(keys)} ids does not fit a table of {self.spec.rows} rows")
        problem = check_state(keys, row, count, last, free, clock, stats, self.spec.rows) if check else None
        if problem:
            raise ValueError(f"a managed map of {len(keys)} ids is damaged: {problem}")
        self.main, self.recent, self.free = Entries(keys, row, count, last), Entries(), free
        self.clock = int(clock[0])
        self.stats = stats
        return self

    def report(self) -> dict[str, int]:
        """Occupancy and totals: rows, rows held, ids waiting for a row, admitted, evicted, expired."""
        held = self.occupied
        return {"rows": self.spec.rows, "held": held, "waiting": len(self.main) + len(self.recent) - held,
                **{name: int(v) for name, v in zip(STATS, self.stats)}}

    def state_keys(self) -> tuple[str, ...]:
        """The keys of `state()`."""
        return STATE_KEYS

    def copy(self) -> "ManagedMap":
        return ManagedMap(self.spec, self.buffer_ids).load(self.state(), check=False)


_EMPTY = np.zeros(0, np.int64)


def check_state(keys: np.ndarray, row: np.ndarray, count: np.ndarray, last: np.ndarray, free: np.ndarray,
                clock: np.ndarray, stats: np.ndarray, rows: int) -> str | None:
    """What is wrong with a map's arrays (lengths already checked), or None: ids sorted and
    distinct, every row of the table either held by exactly one id or free (free rows sorted), the
    missing id holding no entry, counts are finite and >= 0, one clock >= 0 and no id seen after it, and the
    totals are `STATS` counts >= 0. A map loaded from anything else would give two ids one row,
    read rows outside the table or expire ids at random: silent wrong training."""
    held = row[row != NO_ROW]
    if len(clock) != 1 or clock[0] < 0:
        return f"its clock is {clock.tolist()[:3]}, not one step count >= 0"
    if len(stats) != len(STATS) or bool((stats < 0).any()):
        return f"its totals are {stats.tolist()[:5]}, not {len(STATS)} counts >= 0 ({', '.join(STATS)})"
    if len(keys) > 1 and bool((keys[1:] <= keys[:-1]).any()):
        return "its ids are not sorted and distinct"
    if bool((keys == MISSING_ID).any()):
        return f"it holds the missing id ({MISSING_ID})"
    every = np.concatenate([held, free])  # rows in all (their count was checked): each in range, none twice
    if bool((row < NO_ROW).any()) or (len(every) and (every.min() < 0 or every.max() >= rows
                                                      or np.bincount(every, minlength=rows).max() > 1)):
        return f"its held and free rows are not each of the rows 0 .. {rows - 1} once"
    if len(free) > 1 and bool((free[1:] <= free[:-1]).any()):
        return "its free rows are not sorted"
    if not bool(np.isfinite(count).all()) or bool((count < 0).any()):
        return "its counts are not finite numbers >= 0"
    if bool((last < 0).any()) or bool((last > clock[0]).any()):
        return f"it has ids last seen outside the steps 0 .. {int(clock[0])} it took"
    return None


def shard_of(ids: np.ndarray, shards: int) -> np.ndarray:
    """The virtual shard of each raw id: splitmix64's finalizer of the 64-bit id, modulo `shards`
    (a stable mixing, so neighbouring raw ids spread over the shards).  # (N,) int64"""
    if shards == 1:
        return np.zeros(len(ids), np.int64)
    x = np.asarray(ids, np.int64).view(np.uint64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    x = x ^ (x >> np.uint64(31))
    return (x % np.uint64(shards)).astype(np.int64)


def shard_rows(rows: int, shards: int, shard: int) -> int:
    """Rows of a table of `rows` that shard `shard` of `shards` manages: those with r % shards == shard."""
    return (rows - shard + shards - 1) // shards


def shard_spec(spec: ManagedSpec, shard: int) -> ManagedSpec:
    """The settings of one shard's map: the table's, with the shard's share of the rows."""
    return replace(spec, rows=shard_rows(spec.rows, spec.shards, shard), shards=1)


class ShardedMap:
    """The map of a managed table of `spec.shards` virtual shards (S > 1): S independent
    `ManagedMap`s, shard s = `shard_of(id)` managing the table's rows r with r % S == s (its local
    row l is the table's row l * S + s), each with its own contest, free rows and clock. Every
    shard steps at every batch (with the batch's ids of that shard, maybe none), so their clocks
    agree. The split depends on the spec only, never on the ranks that train it.

    A rank of a distributed run holds only the shards it owns (`owned`; `owner_shards`): the
    others are None, their ids get NO_ROW here, and the map's clock still moves at every step.

    Args:
        spec: the table's managed settings (rows: the whole table's).
        buffer_ids: ids each shard's buffer holds before it is merged.
        owned: the shards this map holds (None: all).
    """

    def __init__(self, spec: ManagedSpec, buffer_ids: int = BUFFER_IDS, owned: tuple[int, ...] | None = None):
        self.spec, self.buffer_ids = spec, buffer_ids
        self.owned = tuple(range(spec.shards)) if owned is None else tuple(sorted(owned))
        self.shards: list[ManagedMap | None] = [None] * spec.shards
        for s in self.owned:
            self.shards[s] = ManagedMap(shard_spec(spec, s), buffer_ids)
        self.clock = 0  # steps taken (every held shard's clock)

    def _held(self):
        return ((s, self.shards[s]) for s in self.owned)

    def step(self, ids: np.ndarray) -> MapStep:
        """Count, admit and remap one batch's raw ids, each in its shard (`ManagedMap.step`)."""
        return step_ids(self.step_counts, ids)

    def step_counts(self, unique: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """One step of every held shard on the batch's sorted distinct ids of it
        (`ManagedMap.step_counts`; ids of shards not held get NO_ROW).

        Returns:
            (the table's rows freed by the shards' eviction passes, sorted; the row of each id).
        """
        which = shard_of(unique, len(self.shards))
        rows = np.full(len(unique), NO_ROW, np.int64)
        freed = [_EMPTY]
        for s, m in self._held():
            sel = np.flatnonzero(which == s)
            resets, got = m.step_counts(unique[sel], counts[sel])
            rows[sel] = self.to_table(got, s)
            freed.append(self.to_table(resets, s))
        self.clock += 1
        return np.sort(np.concatenate(freed)), rows

    def to_table(self, local: np.ndarray, shard: int) -> np.ndarray:
        """A shard's local rows as the table's rows (NO_ROW kept)."""
        return np.where(local == NO_ROW, NO_ROW, local * len(self.shards) + shard)

    def lookup(self, ids: np.ndarray) -> np.ndarray:
        """Rows of raw ids without counting them: NO_ROW for unknown ids (and ids of shards not held)."""
        which = shard_of(ids, len(self.shards))
        out = np.full(len(ids), NO_ROW, np.int64)
        for s, m in self._held():
            sel = np.flatnonzero(which == s)
            out[sel] = self.to_table(m.lookup(ids[sel]), s)
        return out

    @property
    def occupied(self) -> int:
        return sum(m.occupied for _, m in self._held())

    def entries(self) -> Entries:
        """Every id of every held shard, with the table's rows, as one sorted set of entries (copies)."""
        parts = [(s, m.entries()) for s, m in self._held()]
        if not parts:
            return Entries()
        keys = np.concatenate([e.keys for _, e in parts])
        order = np.argsort(keys, kind="stable")
        return Entries(keys[order], np.concatenate([self.to_table(e.row, s) for s, e in parts])[order],
                       np.concatenate([e.count for _, e in parts])[order],
                       np.concatenate([e.last for _, e in parts])[order])

    def state(self) -> dict[str, np.ndarray]:
        """Every held shard's arrays (`ManagedMap.state`, local rows) under ``shard<s>.<key>``."""
        return {f"shard{s}.{k}": v for s, m in self._held() for k, v in m.state().items()}

    def state_keys(self, every: bool = False) -> list[str]:
        """The keys of `state()` (`every`: of all S shards, held or not)."""
        shards = range(len(self.shards)) if every else self.owned
        return [f"shard{s}.{k}" for s in shards for k in STATE_KEYS]

    def load(self, state: dict[str, np.ndarray]) -> "ShardedMap":
        """Restore the held shards from `state()` of any holder of them (keys of other shards are
        ignored); returns self.

        Raises:
            ValueError: a shard's arrays do not fit it, or the shards' clocks differ.
        """
        for s, m in self._held():
            try:
                m.load({k: state[f"shard{s}.{k}"] for k in STATE_KEYS})
                if bool((shard_of(m.main.keys, len(self.shards)) != s).any()):
                    raise ValueError("it holds ids of other shards")
            except ValueError as exc:
                raise ValueError(f"shard {s} of {len(self.shards)}: {exc}") from None
        clocks = {tuple(np.asarray(v).reshape(-1).tolist()) for k, v in state.items() if k.endswith(".clock")}
        if len(clocks) != 1 or len(next(iter(clocks))) != 1:
            raise ValueError(f"the clocks of the {len(self.shards)} shards differ" if len(clocks) > 1
                             else "no shard's clock" if not clocks else "its clock is not one step count")
        self.clock = int(clocks.pop()[0])
        return self

    def report(self) -> dict[str, int]:
        """The held shards' `ManagedMap.report` summed (the table's totals when all are held) and S."""
        parts = [m.report() for _, m in self._held()]
        keys = ("rows", "held", "waiting", *STATS)
        return {**{k: sum(p[k] for p in parts) for k in keys}, "shards": len(self.shards)}

    def copy(self) -> "ShardedMap":
        out = ShardedMap(self.spec, self.buffer_ids, owned=())  # no fresh shards, only to be replaced
        out.owned, out.shards = self.owned, [None if m is None else m.copy() for m in self.shards]
        out.clock = self.clock
        return out


def owner_shards(shards: int, world_size: int, rank: int) -> tuple[int, ...]:
    """The virtual shards rank `rank` of `world_size` owns: s % world_size == rank (none when
    rank >= shards)."""
    return tuple(range(rank, shards, world_size))


def new_map(spec: ManagedSpec, buffer_ids: int = BUFFER_IDS) -> "ManagedMap | ShardedMap":
    """The map of a managed table: one `ManagedMap` (one shard), or a `ShardedMap` of `spec.shards`."""
    return ManagedMap(spec, buffer_ids) if spec.shards == 1 else ShardedMap(spec, buffer_ids)
