"""Lookups over cache slots: pooled embedding bags whose backward updates rows where they live.

`SlotBag`: the batch's ids are already slot numbers of one device table (a cache scratchpad or
a hot table); forward pools those slots, backward applies the casted gradient and the fused
optimizer to the slots in place (`operators.backends.fused_backward`, CuPy on CUDA when usable).

`SplitBag`: the batch's unique rows live in two places (device slots and host rows); forward
pools a (U, D) working table of the unique rows, backward computes the U coalesced gradients
once and updates each row where it lives: device rows in their slots, host rows on the host (the
gradients travel back). Both equal a lookup of the full table bit for bit: the same values are
summed in the same order, and the row-wise optimizers treat every row independently.

Example:
    >>> out = slot_bag(table, slot_ids, offsets, slot_casting)  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch
import torch.nn.functional as F

from operators.backends import fused_backward
from operators.casting import Casting, casted_row_grads
from operators.sparse_optim import SparseOptimizer


@dataclass
class SlotTable:
    """A device table of slots with optimizer state (a scratchpad or hot table).

    Args:
        weight: slot rows.  # (C, D)
        state: their optimizer state.  # (C, k)
        optimizer: the group's fused optimizer.
        mean_flags: mean-pooling flag per bag position, or None.  # (S,) bool
        bags_per_sample: S.
    """

    weight: torch.Tensor
    state: torch.Tensor
    optimizer: SparseOptimizer
    mean_flags: torch.Tensor | None
    bags_per_sample: int
    use_cupy: bool | None = None


def pooled(table: torch.Tensor, ids: torch.Tensor, offsets: torch.Tensor, mean_flags: torch.Tensor | None,
           bags_per_sample: int) -> torch.Tensor:
    """Pooled bags over `table` exactly as `PackedEmbeddingBag.lookup`.  # (B, S, D)"""
    out = F.embedding_bag(ids, table, offsets, mode="sum", include_last_offset=True)  # (NB, D)
    if mean_flags is not None:
        lengths = (offsets[1:] - offsets[:-1]).clamp_min(1).to(out.dtype)  # (NB,)
        flags = mean_flags.to(out.device).repeat(out.shape[0] // bags_per_sample)
        out = out.div_(torch.where(flags, lengths, torch.ones_like(lengths)).unsqueeze(1))
    return out.view(-1, bags_per_sample, table.shape[1])


def remap_casting(casting: Casting, unique_ids: torch.Tensor) -> Casting:
    """The same casting with its unique rows renamed (e.g. packed rows -> slots)."""
    return replace(casting, unique_ids=unique_ids.to(casting.unique_ids.device))


class _SlotBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trigger, table: SlotTable, slot_ids, offsets, casting):
        ctx.table, ctx.casting = table, casting
        return pooled(table.weight, slot_ids, offsets, table.mean_flags, table.bags_per_sample)

    @staticmethod
    def backward(ctx, grad_out):
        t, casting = ctx.table, ctx.casting
        if casting.unique_ids.device != grad_out.device:
            casting = casting.to(grad_out.device)
        fused_backward(t.weight, t.state, t.optimizer, grad_out.reshape(casting.num_bags, -1), casting,
                       t.use_cupy)
        return None, None, None, None, None


def slot_bag(table: SlotTable, slot_ids: torch.Tensor, offsets: torch.Tensor,
             slot_casting: Casting) -> torch.Tensor:
    """Pooled lookup of slots; under autograd the backward updates the slots in place.  # (B, S, D)"""
    if not torch.is_grad_enabled():
        return pooled(table.weight, slot_ids, offsets, table.mean_flags, table.bags_per_sample)
    trigger = torch.empty(0, device=table.weight.device, requires_grad=True)
    return _SlotBag.apply(trigger, table, slot_ids, offsets, slot_casting)


RowUpdate = Callable[[torch.Tensor], None]  # applies (U, D) coalesced gradients to the rows


class _SplitBag(torch.autograd.Function):
    @staticmethod
    def forward(ctx, trigger, working, local_ids, offsets, casting, mean_flags, bags_per_sample, update):
        ctx.casting, ctx.update = casting, update
        return pooled(working, local_ids, offsets, mean_flags, bags_per_sample)

    @staticmethod
    def backward(ctx, grad_out):
        casting = ctx.casting
        if casting.unique_ids.device != grad_out.device:
            casting = casting.to(grad_out.device)
        ctx.update(casted_row_grads(grad_out.reshape(casting.num_bags, -1), casting))  # (U, D)
        return (None,) * 8


def split_bag(working: torch.Tensor, local_ids: torch.Tensor, offsets: torch.Tensor, casting: Casting,
              mean_flags: torch.Tensor | None, bags_per_sample: int, update: RowUpdate) -> torch.Tensor:
    """Pooled lookup of a (U, D) working table of the batch's unique rows; the backward hands the
    coalesced (U, D) gradients (in `casting.unique_ids` order) to `update`.  # (B, S, D)

    Args:
        working: the batch's unique rows, in sorted-unique order.  # (U, D)
        local_ids: each id's position among the unique rows.  # (nnz,) int64
        offsets: bag boundaries.  # (B*S + 1,) int64
        casting: the batch's casting (its sorted_bags / unique_offsets index the U rows).
        mean_flags: mean-pooling flags per bag position.  # (S,) bool
        bags_per_sample: S.
        update: called once in the backward with the row gradients.
    """
    if not torch.is_grad_enabled():
        return pooled(working, local_ids, offsets, mean_flags, bags_per_sample)
    trigger = torch.empty(0, device=working.device, requires_grad=True)
    return _SplitBag.apply(trigger, working, local_ids, offsets, casting, mean_flags, bags_per_sample, update)


def rows_of(gids: Any) -> torch.Tensor:
    """Sorted unique packed rows of a batch's `GroupIds` (staged ones, else computed; on the host)."""
    if gids.casting is not None:
        return gids.casting.unique_ids.cpu()
    if gids.unique is not None:
        return gids.unique.cpu()
    return torch.unique(gids.ids.cpu())
