"""A plain reference of the managed map: the rule of `flowrec.data.managed`, one id at a time
over Python dicts and lists (for tests: the fast map must equal it on any stream).

Example:
    >>> from flowrec.spec.model import ManagedSpec
    >>> DictMap(ManagedSpec(rows=2, admit_min_count=2)).step([5, 5, 9])
    ([0, 0, -1], [])
"""
from __future__ import annotations

from flowrec.data.managed import NO_ROW
from flowrec.data.raw_ids import MISSING_ID
from flowrec.spec.model import ManagedSpec


class DictMap:
    """The rule of `flowrec.data.managed`, one id at a time over plain dicts.

    Args:
        spec: the table's managed settings.
    """

    def __init__(self, spec: ManagedSpec):
        self.spec = spec
        self.ids: dict[int, list] = {}  # raw id -> [row or None, count, last]
        self.free = list(range(spec.rows))
        self.clock = 0

    def score(self, key: int) -> tuple:
        row, count, last = self.ids[key]
        if self.spec.evict == "decayed_lfu":
            count = count * self.spec.decay ** ((self.clock - last) / self.spec.every_steps)
        first, second = (last, count) if self.spec.evict == "lru" else (count, last)
        return (-first, -second, key)

    def give_rows(self, keys: list[int]) -> None:
        for key in sorted(keys, key=self.score):
            if not self.free:
                return
            self.ids[key][0] = self.free.pop(0)

    def evict(self) -> list[int]:
        freed = []
        for key in list(self.ids):
            row, _, last = self.ids[key]
            if self.spec.ttl_steps is not None and self.clock - last > self.spec.ttl_steps:
                if row is not None:
                    freed.append(row)
                del self.ids[key]
        admit = self.spec.admit_min_count
        holders = [k for k, v in self.ids.items() if v[0] is not None]
        eligible = [k for k, v in self.ids.items() if v[0] is None and -self.score(k)[0 if self.spec.evict != "lru" else 1] >= admit]
        contenders = sorted(holders + eligible, key=self.score)
        for key in contenders[self.spec.rows:]:
            if self.ids[key][0] is not None:
                freed.append(self.ids[key][0])
                self.ids[key][0] = None
        self.free = sorted(self.free + freed)
        self.give_rows(eligible)
        waiting = sorted((k for k, v in self.ids.items() if v[0] is None), key=self.score)
        for key in waiting[self.spec.rows:]:
            del self.ids[key]
        return sorted(freed)

    def step(self, batch: list[int]) -> tuple[list[int], list[int]]:
        resets = self.evict() if self.clock and self.clock % self.spec.every_steps == 0 else []
        for key in sorted(set(batch) - {MISSING_ID}):
            n = batch.count(key)
            if key in self.ids:
                entry = self.ids[key]
                decayed = -self.score(key)[0] if self.spec.evict == "decayed_lfu" else entry[1]
                entry[1], entry[2] = decayed + n, self.clock
            else:
                self.ids[key] = [None, float(n), self.clock]
        self.give_rows([k for k in set(batch) - {MISSING_ID}
                        if self.ids[k][0] is None and self.ids[k][1] >= self.spec.admit_min_count])
        self.clock += 1
        rows = [NO_ROW if k == MISSING_ID or self.ids[k][0] is None else self.ids[k][0] for k in batch]
        return rows, resets


MASK64 = (1 << 64) - 1


def dict_shard(key: int, shards: int) -> int:
    """splitmix64's finalizer of a raw id (as unsigned 64 bits) modulo `shards`, in Python ints."""
    x = key & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return (x ^ (x >> 31)) % shards


class ShardedDictMap:
    """`spec.shards` independent `DictMap`s: shard s takes the ids with `dict_shard(id) == s` and
    the table's rows r with r % shards == s (its local row l is row l * shards + s).

    Args:
        spec: the table's managed settings (rows: the whole table's).
    """

    def __init__(self, spec: ManagedSpec):
        n = spec.shards
        self.n = n
        self.maps = [DictMap(ManagedSpec(rows=len(range(s, spec.rows, n)), admit_min_count=spec.admit_min_count,
                                         evict=spec.evict, decay=spec.decay, every_steps=spec.every_steps,
                                         ttl_steps=spec.ttl_steps)) for s in range(n)]

    def step(self, batch: list[int]) -> tuple[list[int], list[int]]:
        rows, resets = [NO_ROW] * len(batch), []
        for s, m in enumerate(self.maps):
            mine = [i for i, k in enumerate(batch) if k != MISSING_ID and dict_shard(k, self.n) == s]
            got, freed = m.step([batch[i] for i in mine])
            for i, r in zip(mine, got):
                rows[i] = NO_ROW if r == NO_ROW else r * self.n + s
            resets += [r * self.n + s for r in freed]
        return rows, sorted(resets)

    def held(self) -> dict[int, int]:
        """Raw id -> table row of every id holding one."""
        return {k: v[0] * self.n + s for s, m in enumerate(self.maps) for k, v in m.ids.items() if v[0] is not None}

    @property
    def clock(self) -> int:
        return self.maps[0].clock

    def keys(self) -> list[int]:
        """Every raw id of every shard, sorted."""
        return sorted(k for m in self.maps for k in m.ids)
