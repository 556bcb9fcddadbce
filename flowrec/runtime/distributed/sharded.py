"""Row-wise sharded packed embedding (HybridBackend style) for one packed group.

Packed row R lives on rank R mod W at local row R div W (`groups`). Every rank holds its rows and
their optimizer state; the union over ranks is bitwise the table one process builds
(`operators.embedding.PackedEmbeddingBag`: each logical table drawn whole from its own generator,
each rank keeping its rows).

Forward, per rank on its slice of the global batch: deduplicate the ids, send them to their
owners (counts first, then ids), owners gather their local rows and send them back, and the
requester pools (sum, mean, sequences) from the unique rows: the output is bitwise the
single-process output of those samples. Backward: the casted gather-reduce
(`operators.casting`) gives one gradient per unique id at the requester; the reverse exchange
sends them to the owners, which sum them per row in a fixed order (source rank, then position)
and apply the group's fused sparse optimizer once per row per step, so a row touched by several
ranks is updated once with the sum of their gradients, as in one process. Lazy Adam's step count
is per row and advances once per global step in which the row was touched, so it is the global
count (no rank-local counter exists).

Several groups run together through `schedule.ShardedLookups`, which can overlap their exchanges.
Every rank must run every forward and backward of every step (they are collectives).
`bytes_sent` counts what this rank sent to other ranks (counts, ids out, rows back, row
gradients out), for benchmarks beside the planner's prediction.

Example (on every rank, after `torch.distributed.init_process_group`):
    >>> emb = ShardedPackedEmbedding(group, world_size=2, rank=rank)  # doctest: +SKIP
    >>> out = emb(batch.ids, batch.offsets)  # (B_r, S, D)  # doctest: +SKIP
    >>> (out.sum() / global_batch).backward()  # owners' rows updated in place  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.distributed as dist

from flowrec.graph.types import PackedGroup
from flowrec.runtime.distributed.exchange import start_counts, start_exchange
from flowrec.runtime.distributed.groups import local_index, local_row_count, owned_rows, owner_of
from flowrec.runtime.distributed.pooling import pool_unique, unique_row_grads
from flowrec.runtime.distributed.schedule import Steps, lookup_groups
from operators.casting import Casting, casted_row_grads, compute_casting
from operators.embedding import TORCH_DTYPES, init_table_chunks, mean_bag_flags, restoring
from operators.sparse_optim import SparseOptimizer, make_optimizer

EXCHANGE_PARTS: tuple[str, ...] = ("counts", "ids", "rows", "grads")  # `bytes_sent` keys


@dataclass(frozen=True)
class Route:
    """How one rank's batch of one group travels between ranks in a step.

    Args:
        unique_ids: the batch's sorted unique packed ids.  # (U,) int64
        inverse: each id's index into `unique_ids`.  # (nnz,) int64
        order: positions of `unique_ids` grouped by owner (stable: sorted within an owner).  # (U,)
        send_counts: unique ids sent to each rank (length W).
        recv_counts: ids received from each rank (length W).
        served: local rows requested of this rank, source rank 0 first, then by position.  # (n,)
    """

    unique_ids: torch.Tensor
    inverse: torch.Tensor
    order: torch.Tensor
    send_counts: list[int]
    recv_counts: list[int]
    served: torch.Tensor


class ShardedPackedEmbedding(torch.nn.Module):
    """This rank's rows of one row-wise sharded packed group, looked up across all ranks.

    Args:
        group: the packed group (tables with row offsets, fields in output order, optimizer).
        world_size: W, ranks in `process_group`.
        rank: this rank in `process_group`.
        process_group: the group the exchanges run on (None: the default group); give it a
            timeout (`groups.embedding_group`) so a dead rank fails the others.
        seed: model seed of the deterministic per-table init.
        device: where the local rows live (the exchanges' device: cpu for gloo, cuda for nccl).
        dtype: storage dtype (default: the group's dtype).
    """

    def __init__(self, group: PackedGroup, world_size: int, rank: int,
                 process_group: dist.ProcessGroup | None = None, seed: int = 0,
                 device: torch.device | str | None = None, dtype: torch.dtype | None = None):
        super().__init__()
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in a world of size {world_size}")
        self.group, self.world_size, self.rank = group, world_size, rank
        self.process_group = process_group
        self.dim, self.bags_per_sample = group.dim, group.bags_per_sample
        self.optimizer: SparseOptimizer = make_optimizer(group.optimizer)
        dtype = dtype or TORCH_DTYPES[group.dtype]
        state_dtype = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        local = local_row_count(group.rows, world_size, rank)
        weight = (torch.empty(local, group.dim, dtype=dtype, device=device) if restoring()  # loaded next
                  else initial_local_rows(group, world_size, rank, seed, dtype).to(device))
        self.register_buffer("weight", weight)
        self.register_buffer("state", self.optimizer.initial_state(local, group.dim, state_dtype, device))
        flags = mean_bag_flags(group)
        self.register_buffer("mean_flags", flags.to(device) if bool(flags.any()) else None, persistent=False)
        self.bytes_sent = {part: 0 for part in EXCHANGE_PARTS}  # bytes this rank sent to other ranks
        # called with the local rows a step (or a reset) is about to overwrite, before it does:
        # a checkpoint's copy-on-write snapshot saves those it has not written yet
        self.before_write: Callable[[torch.Tensor], None] | None = None

    @property
    def packed_rows(self) -> torch.Tensor:
        """Packed ids of the local rows, in local order (for checkpoints).  # (local_rows,) int64"""
        return owned_rows(self.group.rows, self.world_size, self.rank)

    def shard_rows(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's rows for a checkpoint: packed ids, weights and optimizer state (copies).

        Returns:
            Packed ids, rows and state, in local order.  # (n,) int64, (n, D), (n, k)
        """
        return self.packed_rows, self.weight.detach().clone(), self.state.clone()

    def load_rows(self, packed: torch.Tensor, weights: torch.Tensor, state: torch.Tensor) -> int:
        """Overwrite the rows of `packed` that this rank owns (the rest are ignored), so that
        shards saved at any world size load at this one.

        Args:
            packed: packed ids (unique).  # (n,) int64
            weights: their rows.  # (n, D)
            state: their optimizer state.  # (n, k)

        Returns:
            How many of this rank's rows were written.
        """
        if packed.numel() and (int(packed.min()) < 0 or int(packed.max()) >= self.group.rows):
            raise ValueError(f"group {self.group.name}: packed rows outside [0, {self.group.rows})")
        mine = owner_of(packed, self.world_size) == self.rank
        local = local_index(packed[mine], self.world_size).to(self.weight.device)
        if self.before_write is not None:
            self.before_write(local)
        self.weight.index_copy_(0, local, weights[mine].to(self.weight))
        if self.state.shape[1]:
            self.state.index_copy_(0, local, state[mine].to(self.state))
        return int(mine.sum())

    def lookup_steps(self, ids: torch.Tensor, offsets: torch.Tensor) -> Steps:
        """The lookup as steps (`schedule.drive`): deduplicate, ids to their owners (counts
        first), owners' rows back, pool. Yields each exchange's work; returns the pooled
        output (B, S, D) and the `Route` the backward reuses."""
        unique_ids, inverse = torch.unique(ids, sorted=True, return_inverse=True)
        owners = owner_of(unique_ids, self.world_size)
        order = torch.sort(owners, stable=True).indices
        send_counts = torch.bincount(owners, minlength=self.world_size).tolist()
        counts, work = start_counts(send_counts, self.process_group, self.weight.device)
        yield work
        recv_counts = counts.tolist()
        wanted, work = start_exchange(unique_ids[order], send_counts, recv_counts, self.process_group)
        yield work
        route = Route(unique_ids, inverse, order, send_counts, recv_counts,
                      local_index(wanted, self.world_size))
        served = self.weight.index_select(0, route.served)  # (n, D)
        got, work = start_exchange(served, recv_counts, send_counts, self.process_group)  # (U, D) by owner
        yield work
        self.bytes_sent["counts"] += 8 * (self.world_size - 1)
        self.bytes_sent["ids"] += 8 * self._to_others(send_counts)
        self.bytes_sent["rows"] += self._to_others(recv_counts) * self.dim * served.element_size()
        unique_rows = torch.empty_like(got).index_copy_(0, order, got)  # (U, D) sorted-id order
        return pool_unique(inverse, unique_rows, offsets, self.mean_flags, self.bags_per_sample), route

    def update_steps(self, route: Route, ids: torch.Tensor, offsets: torch.Tensor,
                     grad_out: torch.Tensor, casting: Casting | None = None) -> Steps:
        """The update as steps: one gradient per unique id (casted gather-reduce), sent to the
        owners, summed per row in a fixed order, applied once per row."""
        if casting is None:
            casting = compute_casting(ids, offsets, self.mean_flags)
        grads = unique_row_grads(grad_out, casting, self.dim)  # (U, D) sorted ids
        received, work = start_exchange(grads.index_select(0, route.order), route.send_counts,
                                        route.recv_counts, self.process_group)  # (n, D)
        yield work
        self.bytes_sent["grads"] += self._to_others(route.send_counts) * self.dim * grads.element_size()
        rows, summed = sum_per_row(route.served, received)
        if self.before_write is not None:
            self.before_write(rows)
        self.optimizer.step(self.weight, self.state, rows, summed)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                casting: Casting | None = None) -> torch.Tensor:
        """Look up every bag of this rank's samples; the backward updates the owners' rows.

        Args:
            ids: packed row ids of this rank's samples.  # (nnz,) int64
            offsets: bag boundaries, bag = b * S + s.  # (B_r * S + 1,) int64
            casting: precomputed `compute_casting(ids, offsets, mean_flags)` (else computed in
                the backward).

        Returns:
            Pooled embeddings.  # (B_r, S, D)
        """
        return lookup_groups([self], [(ids, offsets, casting)], interleave=False)[0]

    def _to_others(self, counts: list[int]) -> int:
        """Items of per-rank `counts` that leave this rank."""
        return sum(counts) - counts[self.rank]


def sum_per_row(rows: torch.Tensor, grads: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum gradients of equal rows in their input order (a fixed order: a stable sort, then one
    sequential sum per row).

    Args:
        rows: local row of each gradient.  # (n,) int64
        grads: the gradients.  # (n, D)

    Returns:
        The sorted unique rows and their summed gradients.  # (U,), (U, D)
    """
    if rows.numel() == 0:
        return rows, grads
    each = torch.arange(rows.numel() + 1, dtype=torch.int64, device=rows.device)  # one bag per gradient
    casting = compute_casting(rows, each)
    return casting.unique_ids, casted_row_grads(grads, casting)


def initial_local_rows(group: PackedGroup, world_size: int, rank: int, seed: int,
                       dtype: torch.dtype) -> torch.Tensor:
    """This rank's rows of the group's initial packed table, bitwise those one process draws.

    Each logical table is drawn by its own generator (`init_table_chunks`, so the values depend
    neither on the packing nor on the world size), a chunk of `INIT_CHUNK_ROWS` rows at a time, and
    this rank keeps its rows of each chunk: peak memory is its share plus one chunk. Drawing whole
    tables (and their packed ids in int64) took about five times a rank's share: two ranks of a
    table that fit the host were killed by the out-of-memory killer before training.  # (local_rows, D)
    """
    out = torch.empty(local_row_count(group.rows, world_size, rank), group.dim, dtype=dtype)
    for slot in group.tables:
        for start, chunk in init_table_chunks(slot.table, slot.rows, group.dim, seed, dtype, INIT_CHUNK_ROWS):
            first = slot.row_offset + start  # packed id of the chunk's first row
            lo, hi = first + (rank - first) % world_size, first + len(chunk)  # this rank's first packed id, the end
            mine = torch.arange(lo, max(lo, hi), world_size, dtype=torch.int64)  # empty where it owns none
            if mine.numel():
                out.index_copy_(0, local_index(mine, world_size), chunk.index_select(0, mine - first))
    return out


INIT_CHUNK_ROWS = 1 << 18  # rows of a table drawn at once by `initial_local_rows`
