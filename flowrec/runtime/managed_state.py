"""The managed tables' maps as model state, and the reset of evicted rows.

`ManagedState` is the `managed` submodule of a lowered model: the maps as of the last trained
step (the data stage runs ahead on its own copies, `flowrec.data.managed_stage`). Its state dict
holds each map's arrays under ``managed.<table>.<keys|row|count|last|free|clock|stats>`` (a map of
S > 1 virtual shards: ``managed.<table>.shard<s>.<key>`` for every shard), next to the
tables' rows and optimizer state in the same model state, so every checkpoint (full or delta:
a delta carries the whole model state but the packed tables) and every load restores rows,
optimizer state and the map together. The trainer calls `before_step` (reset the rows an
eviction pass freed, wherever they live: table, host master or cache slots) and `after_step`
(queue the replay of the batch's map step, checking it freed the same rows). The replays run in
order on a worker thread, off the training thread; everything that reads the maps (state dict,
remapper, report) first waits for the replays queued so far.

Example:
    >>> state = ManagedState(spec, groups)                  # doctest: +SKIP
    >>> state.before_step(model.embeddings, batch); train_step(...); state.after_step(batch)  # doctest: +SKIP
"""
from __future__ import annotations

from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from flowrec.data.managed import ShardedMap, new_map, owner_shards
from flowrec.data.managed_stage import ManagedBatch, Remapper
from flowrec.graph.types import PackedGroup
from flowrec.spec.model import ModelSpec
from operators.embedding import table_seed

MANAGED_PREFIX = "managed."  # model-state keys of the maps (their lengths vary with the map)


class ManagedState(nn.Module):
    """The maps of a spec's managed tables (see the module docstring).

    Args:
        spec: the model spec.
        groups: the packed layout.
        seed: model seed (seeds the fresh rows of a reset).
    """

    def __init__(self, spec: ModelSpec, groups: tuple[PackedGroup, ...], seed: int = 0, world: Any = None):
        super().__init__()
        self.spec, self.groups, self.seed, self.world = spec, groups, seed, world
        managed = [t for t in spec.tables if t.managed is not None]
        self.owners = owner_ranks(spec, world)
        if self.owners:  # this rank's shards only (`flowrec.runtime.managed_owner`)
            self.maps = {t.name: ShardedMap(t.managed, owned=owner_shards(t.managed.shards, world.size, world.rank))
                         for t in managed}
        else:
            self.maps = {t.name: new_map(t.managed) for t in managed}
        self.slots = {t.table: (g.name, t.row_offset, t.rows) for g in groups for t in g.tables}
        self.lookups = [0, 0]  # managed lookups trained by this process, and those that read the default
        self.table_lookups = {t: [0, 0] for t in self.maps}  # the same per table
        self._replays: deque[Future] = deque()
        self._pool: ThreadPoolExecutor | None = None

    def remapper(self, train: bool) -> Remapper | None:
        """A data-stage remapper on copies of the maps (None without managed tables)."""
        if not self.maps:
            return None
        self.sync()
        maps = {t: m.copy() for t, m in self.maps.items()}
        if self.owners:
            from flowrec.runtime.managed_owner import OwnerRemapper

            group = self.world.data_groups[0 if train else 1]
            return OwnerRemapper(self.spec, self.groups, maps, train, self.world, group)
        return Remapper(self.spec, self.groups, maps, train)

    def before_step(self, embeddings: nn.ModuleDict, batch: Any) -> None:
        """Reset the rows this batch's eviction pass freed: fresh weights, initial optimizer state."""
        managed = batch.managed
        if managed is None:
            return
        clock = next(iter(managed.clocks.values()), 0)
        for group, rows in managed.resets.items():
            module = embeddings[group]
            weights = torch.cat([self._fresh(table, rows, clock) for table in self._tables(group)])
            order = torch.cat([rows[(rows >= off) & (rows < off + n)] for _, off, n in self._ranges(group)])
            state = module_optimizer(module).initial_state(len(order), weights.shape[1], torch.float32)
            reset_rows(module, order, weights, state)

    def after_step(self, batch: Any) -> None:
        """Queue the replay of the batch's map steps on these maps (in batch order, on a worker
        thread); `sync` waits for it. A replay that disagrees with the data stage (clock or freed
        rows) raises RuntimeError at the next `sync`."""
        managed = batch.managed
        if managed is None:
            return
        self.lookups[0] += managed.lookups
        self.lookups[1] += managed.defaults
        for table, (n, defaults) in managed.tables.items():
            self.table_lookups[table][0] += n
            self.table_lookups[table][1] += defaults
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="flowrec-managed-replay")
        self._replays.append(self._pool.submit(self._replay, managed))

    def sync(self) -> None:
        """Wait for the queued replays: the maps then hold the state after the last trained batch.

        Raises:
            RuntimeError: a replay disagreed with the data stage.
        """
        while self._replays:
            self._replays.popleft().result()

    def close(self) -> None:
        """Wait for the queued replays and stop the worker thread."""
        try:
            self.sync()
        finally:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None

    def _replay(self, managed: ManagedBatch) -> None:
        for table, (unique, counts) in managed.steps.items():
            m = self.maps[table]
            if m.clock != managed.clocks[table]:
                raise RuntimeError(f"managed table {table}: the data stage was at step {managed.clocks[table]}, "
                                   f"the model's map at {m.clock}")
            freed, _ = m.step_counts(unique, counts)
            group, offset, _ = self.slots[table]
            staged = managed.resets.get(group, torch.zeros(0, dtype=torch.int64)).numpy()
            mine = staged[(staged >= offset) & (staged < offset + m.spec.rows)] - offset
            if self.owners:  # the rows of the shards this rank owns
                mine = mine[np.isin(mine % m.spec.shards, m.owned)]
            if not np.array_equal(np.sort(freed), mine):
                raise RuntimeError(f"managed table {table}: the replayed eviction freed other rows")

    def report(self) -> dict[str, object]:
        """Per table occupancy and totals (`ManagedMap.report`) with this process's trained lookups
        and those that read the default row, and the share of all its trained managed lookups
        that read the default row."""
        self.sync()
        trained, defaults = self.lookups
        tables = {t: {**m.report(), "lookups": self.table_lookups[t][0],
                      "default_lookups": self.table_lookups[t][1]} for t, m in self.maps.items()}
        if self.owners:  # every rank's shards and lookups (a collective: every rank calls report)
            every: list[Any] = [None] * self.world.size
            dist.all_gather_object(every, (tables, trained, defaults))
            tables = {t: {k: sum(part[0][t][k] for part in every) if k != "shards" else v for k, v in r.items()}
                      for t, r in tables.items()}
            trained, defaults = sum(part[1] for part in every), sum(part[2] for part in every)
        return {"tables": tables, "default_lookup_share": round(defaults / trained, 6) if trained else None}

    @staticmethod
    def _all_keys(m: Any) -> list[str]:
        return m.state_keys(every=True) if isinstance(m, ShardedMap) else list(m.state_keys())

    def whole_like(self) -> dict[str, torch.Tensor]:
        """Every map's state keys, every shard's (an owner rank holds some), as empty tensors of
        their dtypes: what a checkpoint of the whole model holds (`checkpoint.layout`)."""
        return {f"{MANAGED_PREFIX}{t}.{k}": torch.zeros(0, dtype=torch.float64 if k.endswith("count") else torch.int64)
                for t, m in self.maps.items() for k in self._all_keys(m)}

    def owned_state(self) -> dict[str, torch.Tensor]:
        """The arrays of the virtual shards this rank owns, as `managed.<table>.shard<s>.<key>`,
        when the maps live on owner ranks (each rank writes them into its checkpoint shard); {}
        otherwise."""
        if not self.owners:
            return {}
        self.sync()
        return {f"{MANAGED_PREFIX}{t}.{k}": torch.from_numpy(v) for t, m in self.maps.items()
                for k, v in m.state().items()}

    def _tables(self, group: str) -> list[str]:
        return [t for t, (g, _, _) in self.slots.items() if g == group and t in self.maps]

    def _ranges(self, group: str) -> list[tuple[str, int, int]]:
        return [(t, self.slots[t][1], self.slots[t][2]) for t in self._tables(group)]

    def _fresh(self, table: str, packed_rows: torch.Tensor, clock: int) -> torch.Tensor:
        """Fresh weights of a table's rows among `packed_rows` (`fresh_rows`).  # (n, D)"""
        _, offset, rows = self.slots[table]
        n = int(((packed_rows >= offset) & (packed_rows < offset + rows)).sum())
        return fresh_rows(self.seed, table, rows, n, self.spec.table(table).dim, clock)

    def _save_to_state_dict(self, destination: dict, prefix: str, keep_vars: bool) -> None:
        self.sync()
        for table, m in self.maps.items():
            for key, value in m.state().items():
                destination[f"{prefix}{table}.{key}"] = torch.from_numpy(value)

    def _load_from_state_dict(self, state_dict: dict, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list, unexpected_keys: list, error_msgs: list) -> None:
        self.sync()
        for table, m in self.maps.items():
            keys = {k: f"{prefix}{table}.{k}" for k in m.state_keys()}
            absent = [full for full in keys.values() if full not in state_dict]
            if absent:
                missing_keys.extend(absent)
                continue
            every = {k[len(prefix) + len(table) + 1:]: v for k, v in state_dict.items()
                     if k.startswith(f"{prefix}{table}.")}  # an owner rank's map: every shard's clock too
            try:
                m.load({k: v.cpu().numpy() for k, v in every.items()})
            except ValueError as exc:
                error_msgs.append(f"managed table {table}: {exc}")
        known = {f"{prefix}{t}.{k}" for t, m in self.maps.items() for k in self._all_keys(m)}
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in known)


def owner_ranks(spec: ModelSpec, world: Any) -> bool:
    """Whether the managed tables' maps live on owner ranks (`flowrec.runtime.managed_owner`):
    under several ranks when every managed table has more than one virtual shard. Otherwise
    every rank holds a replica of every map, stepped on the global batch's ids."""
    managed = [t.managed for t in spec.tables if t.managed is not None]
    return world is not None and world.size > 1 and bool(managed) and all(m.shards > 1 for m in managed)


def managed_state(spec: ModelSpec, groups: tuple[PackedGroup, ...], seed: int, world: Any = None
                  ) -> ManagedState | None:
    """The maps of a model's managed tables (None without any). Under several ranks, either each
    rank holds the shards it owns (`owner_ranks`) or every rank holds a replica, stepped on the
    global batch's ids (`BatchIterator._pack`).

    Raises:
        ValueError: managed tables in a static_hot group (not supported).
    """
    managed = {t.name for t in spec.tables if t.managed is not None}
    if not managed:
        return None
    for g in groups:
        if g.placement == "static_hot" and any(t.table in managed for t in g.tables):
            raise ValueError(f"group {g.name} holds managed tables and is planned static_hot, which cannot "
                             "follow their changing rows; use --cache lookahead or --cache none")
    return ManagedState(spec, groups, seed, world)


def fresh_remapper(spec: ModelSpec, groups: tuple[PackedGroup, ...]) -> Remapper | None:
    """A training remapper on empty maps (measurements that stage batches without a model's
    maps); None without managed tables."""
    if not any(t.managed is not None for t in spec.tables):
        return None
    return ManagedState(spec, groups).remapper(train=True)


def eval_remapper(model: Any) -> Remapper | None:
    """The data stage's lookup-only maps of a model's managed tables (None without any)."""
    managed = getattr(model, "managed", None)
    return managed.remapper(train=False) if managed is not None else None


def fresh_rows(seed: int, table: str, table_rows: int, n: int, dim: int, clock: int) -> torch.Tensor:
    """Weights of `n` rows of a managed table reset at map step `clock`, in row order: uniform
    (+-sqrt(1/table_rows)) as initial rows, from a generator seeded by (seed, table, clock).  # (n, D)"""
    gen = torch.Generator().manual_seed((table_seed(seed, table) * 31 + clock) % (2**63 - 1))
    bound = (1.0 / table_rows) ** 0.5
    return torch.empty(n, dim).uniform_(-bound, bound, generator=gen)


def module_optimizer(module: nn.Module) -> Any:
    """The sparse optimizer of an embedding module (any placement)."""
    return module.optimizer


def reset_rows(module: nn.Module, rows: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> None:
    """Overwrite packed `rows` (weights and optimizer state) wherever the module keeps them."""
    reset = getattr(module, "reset_rows", None) or getattr(module, "load_rows", None)  # load_rows: a
    if reset is not None:  # row-wise shard keeps the rows it owns
        reset(rows, weights, state)
        return
    module.write_rows(rows.to(module.weight.device), weights.to(module.weight.device),
                      state.to(module.state.device))
