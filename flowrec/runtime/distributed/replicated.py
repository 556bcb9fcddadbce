"""Replicated packed embedding: every rank holds the whole table of a (small) packed group.

The forward is the single-process lookup of this rank's samples. The backward all-reduces the
gradients of the rows touched anywhere in the global batch: each rank writes its unique-row
gradients (casted gather-reduce) and a touched flag into one (rows, D + 1) buffer, one
all-reduce sums them, and every rank applies the group's fused sparse optimizer to the touched
rows with the same summed gradients, so the replicas stay identical. The buffer covers the whole
table: this placement is for groups small enough that this is cheaper than two exchanges.

Example (on every rank, after `torch.distributed.init_process_group`):
    >>> emb = ReplicatedPackedEmbedding(group)  # doctest: +SKIP
    >>> (emb(batch.ids, batch.offsets).sum() / global_batch).backward()  # doctest: +SKIP
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from flowrec.graph.types import PackedGroup
from flowrec.runtime.distributed.pooling import unique_row_grads
from flowrec.runtime.distributed.schedule import Steps
from operators.casting import Casting, compute_casting
from operators.embedding import PackedEmbeddingBag


class _ReplicatedLookup(torch.autograd.Function):
    """Forward: the local lookup; backward: all-reduced row gradients, the same update everywhere."""

    @staticmethod
    def forward(ctx, trigger, module, ids, offsets, casting):
        ctx.module, ctx.ids, ctx.offsets, ctx.casting = module, ids, offsets, casting
        return module.lookup(ids, offsets)

    @staticmethod
    def backward(ctx, grad_out):
        ctx.module.apply_gradients(ctx.ids, ctx.offsets, grad_out, ctx.casting)
        return None, None, None, None, None


class ReplicatedPackedEmbedding(PackedEmbeddingBag):
    """A whole packed table on every rank, updated with the gradients of every rank: a
    `PackedEmbeddingBag` (same buffers, same state-dict keys, same lookup) whose backward sums the
    row gradients over the ranks first.

    Args:
        group: the packed group.
        process_group: the group the all-reduce runs on (None: the default group), with a timeout.
        seed: model seed of the deterministic per-table init (the same table on every rank).
        device: where the table lives.
        dtype: storage dtype (default: the group's dtype).
    """

    def __init__(self, group: PackedGroup, process_group: dist.ProcessGroup | None = None,
                 seed: int = 0, device: torch.device | str | None = None,
                 dtype: torch.dtype | None = None):
        super().__init__(group, seed, device, dtype)
        self.process_group = process_group
        self.bytes_reduced = 0  # bytes of the all-reduced buffers (a ring moves 2 (W-1)/W of it per rank)

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor,
                casting: Casting | None = None) -> torch.Tensor:
        """Look up every bag of this rank's samples; the backward updates every replica.

        Args:
            ids: packed row ids of this rank's samples.  # (nnz,) int64
            offsets: bag boundaries, bag = b * S + s.  # (B_r * S + 1,) int64
            casting: precomputed `compute_casting(ids, offsets, mean_flags)` (else computed in
                the backward).

        Returns:
            Pooled embeddings.  # (B_r, S, D)
        """
        if not torch.is_grad_enabled():
            return self.lookup(ids, offsets)
        trigger = torch.empty(0, device=self.weight.device, requires_grad=True)
        return _ReplicatedLookup.apply(trigger, self, ids, offsets, casting)

    def lookup_steps(self, ids: torch.Tensor, offsets: torch.Tensor) -> Steps:
        """The lookup as steps (`schedule.drive`, beside sharded groups): local, no exchange;
        returns the pooled output (B, S, D) and no route."""
        yield from ()  # a step generator that never waits
        return self.lookup(ids, offsets), None

    def update_steps(self, route: None, ids: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor,
                     casting: Casting | None = None) -> Steps:
        """The update as steps: the all-reduce of the touched rows' gradients (started, then
        waited for), and the same update on every rank."""
        buffer = self._gradient_buffer(ids, offsets, grad_out, casting)
        work = dist.all_reduce(buffer, group=self.process_group, async_op=True)
        yield work
        self._update_rows(buffer)

    def apply_gradients(self, ids: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor,
                        casting: Casting | None = None) -> None:
        """Sum the touched rows' gradients over the ranks and update them on every rank."""
        buffer = self._gradient_buffer(ids, offsets, grad_out, casting)
        dist.all_reduce(buffer, group=self.process_group)
        self._update_rows(buffer)

    def _gradient_buffer(self, ids: torch.Tensor, offsets: torch.Tensor, grad_out: torch.Tensor,
                         casting: Casting | None) -> torch.Tensor:
        """This rank's unique-row gradients and touched flags in a (rows, D + 1) buffer."""
        if casting is None:
            casting = compute_casting(ids, offsets, self.mean_flags)
        grads = unique_row_grads(grad_out, casting, self.weight.shape[1])  # (U, D)
        weight = self.weight
        buffer = torch.zeros(weight.shape[0], weight.shape[1] + 1, dtype=grads.dtype,
                             device=weight.device)  # (rows, D + 1): gradient, touched count
        buffer.index_copy_(0, casting.unique_ids, torch.nn.functional.pad(grads, (0, 1), value=1.0))
        return buffer

    def _update_rows(self, buffer: torch.Tensor) -> None:
        """Update the rows touched on any rank with their summed gradients."""
        weight = self.weight
        self.bytes_reduced += buffer.numel() * buffer.element_size()
        rows = torch.nonzero(buffer[:, -1]).squeeze(1)  # (U_global,)
        self.optimizer.step(weight, self.state, rows, buffer.index_select(0, rows)[:, :-1])
