"""Owner ranks of managed tables under `--nproc W`: each virtual shard's map lives on one rank.

With every managed table split in S > 1 virtual shards (`managed.shards`,
`flowrec.data.managed.ShardedMap`), rank w owns the shards s with s % W == w
(`owner_shards`; with S < W some ranks own none). The training data stage of each rank reads only
its slice of the global batch and, per batch and in batch order (the `Remapper` turn counter), on
a gloo process group of its own (`World.data_groups`, bounded by the run's `--dist-timeout`):

1. counts: an all-to-all of how many distinct ids of each table this rank sends to each owner;
2. ids: an all-to-all of (raw id, occurrences in this slice), to the owner of the id's shard;
3. the owner sums the occurrences of the global batch per id and steps its shards
   (`ShardedMap.step_counts`: the same step one process takes), then
4. counts and 5. rows: an all-to-all of the row of every id it got back to its sender, with
   the rows its eviction passes freed appended for every rank (each rank resets what it holds).

Evaluation reads the whole batch on every rank (every rank scores every sample): each rank looks
the batch's distinct ids up in the shards it owns and one all-reduce (max; NO_ROW is -1) gives
every rank every row, on a second group (evaluation may run while training batches are staged).

Every wait polls the collective with the iterator's stop flag and the timeout: a rank that dies
or stops makes the others fail within the timeout (RuntimeError), never hang; a stopped iterator
abandons its collective (the run is ending, or the epoch's batches were all consumed) and posts
none after it (`_wait`).

Example:
    >>> remap = OwnerRemapper(spec, groups, maps, True, world, world.data_groups[0])  # doctest: +SKIP
"""
from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from flowrec.data.managed import NO_ROW, ShardedMap, shard_of
from flowrec.data.managed_stage import DROPPED, ManagedBatch, Remapper, _values, _with_values
from flowrec.data.packed_ids import Column
from flowrec.data.raw_ids import MISSING_ID
from flowrec.graph.types import PackedGroup
from flowrec.runtime.distributed.exchange import start_exchange
from flowrec.runtime.messages import first_line
from flowrec.spec.model import ModelSpec

POLL_S = 0.0005  # seconds between checks of a collective in flight


class RemapStopped(RuntimeError):
    """The batch iterator was closed while its remap waited for a collective."""


class OwnerRemapper(Remapper):
    """The data stage's remap of a rank that owns some shards of every managed table (see the
    module docstring); the maps hold only the owned shards.

    Args:
        spec: the model spec.
        groups: the packed layout.
        maps: table -> its `ShardedMap` of this rank's owned shards (copies).
        train: step the maps (training) or look ids up (evaluation).
        world: this rank's `World` (size, rank, timeout).
        group: the gloo process group of these collectives (one per data stage kind).
    """

    replicated = False  # each rank reads only its slice of the global batch

    def __init__(self, spec: ModelSpec, groups: tuple[PackedGroup, ...], maps: dict[str, ShardedMap], train: bool,
                 world: Any, group: Any):
        super().__init__(spec, groups, maps, train)
        self.world, self.group = world, group
        self.tables = list(maps)
        self._stopped: Callable[[], bool] = lambda: False

    def in_turn(self, turn: int, stopped: Callable[[], bool], work: Callable[[], Any]) -> Any:
        self._stopped = stopped
        try:
            return super().in_turn(turn, stopped, work)
        except RemapStopped:
            return None

    def remap(self, cols: dict[str, Column]) -> tuple[dict[str, Column], ManagedBatch]:
        cols = dict(cols)
        flat = {t: self._flat(cols, t) for t in self.tables}
        clocks = {t: self.maps[t].clock for t in self.tables}
        if self.train:
            rows, steps, resets = self._train_step(flat)
        else:
            rows, steps, resets = self._lookup(flat), {}, {}
        defaults = lookups = 0
        tables = {}
        for t in self.tables:
            r = rows[t]
            tables[t] = (len(r), int((r == NO_ROW).sum()))
            defaults += tables[t][1]
            lookups += len(r)
            r = np.where(r == NO_ROW, DROPPED, r)
            start = 0
            for n in self.features[t]:
                k = len(_values(cols[n]))
                cols[n] = _with_values(cols[n], r[start:start + k])
                start += k
        packed: dict[str, torch.Tensor] = {}
        for t, freed in resets.items():
            if len(freed):
                group, offset = self.where[t]
                part = torch.from_numpy(freed + offset)
                packed[group] = torch.cat([packed[group], part]) if group in packed else part
        return cols, ManagedBatch(steps, {g: torch.sort(r).values for g, r in packed.items()}, clocks, defaults,
                                  lookups, tables)

    def _flat(self, cols: dict[str, Column], table: str) -> np.ndarray:
        names = self.features[table]
        return np.concatenate([_values(cols[n]) for n in names]) if names else np.zeros(0, np.int64)

    def _train_step(self, flat: dict[str, np.ndarray]):
        """The five exchanges of the module docstring; returns (rows of each table's ids, the
        owned shards' step per table to replay, every rank's freed rows per table)."""
        W, T = self.world.size, len(self.tables)
        # this slice's distinct ids per table, ordered by owner rank
        local, sends = {}, []
        counts_to = np.zeros((W, T), np.int64)
        for i, t in enumerate(self.tables):
            ids = flat[t]
            valid = ids != MISSING_ID
            unique, inverse, counts = np.unique(ids[valid], return_inverse=True, return_counts=True)
            owner = shard_of(unique, self.maps[t].spec.shards) % W
            order = np.argsort(owner, kind="stable")
            local[t] = (valid, inverse.reshape(-1), order)
            counts_to[:, i] = np.bincount(owner, minlength=W)
            sends.append((unique[order], counts[order], owner[order]))
        payload = np.zeros((int(counts_to.sum()), 2), np.int64)
        at = 0
        for d in range(W):  # dest-major, table-minor
            for i in range(T):
                unique, counts, owner = sends[i]
                sel = owner == d
                n = int(sel.sum())
                payload[at:at + n, 0], payload[at:at + n, 1] = unique[sel], counts[sel]
                at += n
        got_counts = self._exchange(torch.from_numpy(counts_to.reshape(-1)), [T] * W, [T] * W, "id counts")
        counts_from = got_counts.numpy().reshape(W, T)
        got = self._exchange(torch.from_numpy(payload), counts_to.sum(1).tolist(), counts_from.sum(1).tolist(),
                             "raw ids").numpy()
        # the owner's step on the global batch's ids of its shards
        starts = np.concatenate([[0], np.cumsum(counts_from.reshape(-1))]).reshape(-1)
        reply_rows = [[None] * T for _ in range(W)]
        steps, freed_mine = {}, []
        for i, t in enumerate(self.tables):
            segs = [got[starts[src * T + i]:starts[src * T + i + 1]] for src in range(W)]
            both = np.concatenate(segs) if segs else np.zeros((0, 2), np.int64)
            unique, inverse = np.unique(both[:, 0], return_inverse=True)
            summed = np.zeros(len(unique), np.int64)
            np.add.at(summed, inverse.reshape(-1), both[:, 1])
            freed, rows = self.maps[t].step_counts(unique, summed)
            steps[t] = (unique, summed)
            freed_mine.append(freed)
            at = 0
            for src in range(W):
                n = len(segs[src])
                reply_rows[src][i] = rows[inverse.reshape(-1)[at:at + n]]
                at += n
        tail = np.concatenate([[len(f) for f in freed_mine], *freed_mine]).astype(np.int64)
        reply = [np.concatenate([*reply_rows[src], tail]) for src in range(W)]
        send_n = [len(r) for r in reply]
        back_n = self._exchange(torch.tensor(send_n, dtype=torch.int64), [1] * W, [1] * W, "row counts").tolist()
        back = self._exchange(torch.from_numpy(np.concatenate(reply)), send_n, back_n, "rows").numpy()
        # this slice's rows, and every owner's freed rows
        rows_of = {t: np.full(len(sends[i][0]), NO_ROW, np.int64) for i, t in enumerate(self.tables)}
        freed_all: dict[str, list[np.ndarray]] = {t: [] for t in self.tables}
        at = 0
        for d in range(W):
            for i, t in enumerate(self.tables):
                n = int(counts_to[d, i])
                rows_of[t][sends[i][2] == d] = back[at:at + n]
                at += n
            lengths = back[at:at + T]
            at += T
            for i, t in enumerate(self.tables):
                freed_all[t].append(back[at:at + lengths[i]])
                at += int(lengths[i])
        out = {}
        for i, t in enumerate(self.tables):
            valid, inverse, order = local[t]
            unique_rows = np.empty(len(order), np.int64)
            unique_rows[order] = rows_of[t]
            r = np.full(len(flat[t]), NO_ROW, np.int64)
            r[valid] = unique_rows[inverse]
            out[t] = r
        return out, steps, {t: np.sort(np.concatenate(f)) for t, f in freed_all.items()}

    def _lookup(self, flat: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Rows of the (whole, identical on every rank) batch's ids: owned shards looked up here,
        the others' rows from their owners by one all-reduce (max)."""
        parts = [np.unique(flat[t]) for t in self.tables]
        mine = np.concatenate([self.maps[t].lookup(u) for t, u in zip(self.tables, parts)] or [np.zeros(0, np.int64)])
        every = torch.from_numpy(mine.astype(np.int64))
        work = dist.all_reduce(every, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        self._wait(work, "row lookups")
        out, at = {}, 0
        for t, u in zip(self.tables, parts):
            rows = every.numpy()[at:at + len(u)]
            at += len(u)
            r = rows[np.searchsorted(u, flat[t])] if len(u) else np.zeros(0, np.int64)
            out[t] = np.where(flat[t] == MISSING_ID, NO_ROW, r)
        return out

    def _exchange(self, send: torch.Tensor, send_counts: list[int], recv_counts: list[int], what: str) -> torch.Tensor:
        if self._stopped():  # once closed, post nothing more on the group (see `_wait`)
            raise RemapStopped("the batch iterator was closed")
        recv, work = start_exchange(send, send_counts, recv_counts, self.group)
        self._wait(work, what)
        return recv

    def _wait(self, work: Any, what: str) -> None:
        """Wait for a collective, checking the stop flag; fail after the world's timeout (or when
        the collective fails: the group's own timeout is the same, so either may fire first).

        A stop abandons the batch between two of its collectives, so a stopped remapper must
        post none after (`_exchange` checks first): gloo pairs the ranks' collectives on a group
        by their order, and a next batch's first exchange posted where the other rank, not yet
        stopped, sends this batch's next one is a size mismatch that aborts the process (the
        end of a run under owner ranks crashed so)."""
        deadline = time.monotonic() + self.world.timeout_s
        while not work.is_completed():
            if self._stopped():
                raise RemapStopped("the batch iterator was closed")
            if time.monotonic() > deadline:
                raise RuntimeError(f"managed remap: the exchange of {what} did not complete within "
                                   f"{self.world.timeout_s:g} s (another rank died or stopped)")
            time.sleep(POLL_S)
        try:
            work.wait()
        except RuntimeError as exc:  # gloo's own timeout (the group's, the same seconds) or a closed peer
            raise RuntimeError(f"managed remap: the exchange of {what} failed (another rank died or stopped): "
                               f"{first_line(exc)}") from exc

