"""Running the exchanges of several sharded groups, one after another or interleaved.

A group's lookup (and its update) is written as a generator of steps that yields a collective's
work handle each time it must wait for it. `drive` runs the generators of several groups either
one group after another, or interleaved (K-interleaving): every group starts its next collective
before any group waits, so the exchange of one group overlaps the gather or pooling of another.
Every rank issues the same collectives in the same order either way, and each group's arithmetic
is the same, so both orders give bitwise the same outputs and parameters.

Example:
    >>> lookups = ShardedLookups([emb_a, emb_b], interleave=True)  # doctest: +SKIP
    >>> out_a, out_b = lookups([(ids_a, offsets_a), (ids_b, offsets_b)])  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Generator, Sequence

import torch
import torch.distributed as dist

Steps = Generator[dist.Work, None, Any]  # yields the work it waits for; returns its result


def drive(steps: Sequence[Steps], interleave: bool) -> list[Any]:
    """Run every group's steps to the end; their results, in order.

    Args:
        steps: one step generator per group.
        interleave: start every group's next collective before waiting on any (else one group
            after another).
    """
    results: list[Any] = [None] * len(steps)
    groups = [list(steps)] if interleave else [[s] for s in steps]
    offset = 0
    for batch in groups:
        active = [(offset + i, s, _advance(s, None)) for i, s in enumerate(batch)]
        while active:
            waiting = []
            for index, s, (done, value) in active:
                if done:
                    results[index] = value
                    continue
                value.wait()
                waiting.append((index, s, _advance(s, None)))
            active = waiting
        offset += len(batch)
    return results


def _advance(steps: Steps, _: None) -> tuple[bool, Any]:
    """Run a step generator to its next wait: (False, work) or (True, its result)."""
    try:
        return False, next(steps)
    except StopIteration as stop:
        return True, stop.value


class _GroupsLookup(torch.autograd.Function):
    """Forward: every group's lookup; backward: every group's reverse exchange and update."""

    @staticmethod
    def forward(ctx, trigger, tables, inputs, interleave):
        done = drive([t.lookup_steps(ids, offsets) for t, (ids, offsets, _) in zip(tables, inputs)],
                     interleave)
        ctx.tables, ctx.inputs, ctx.interleave = tables, inputs, interleave
        ctx.routes = [route for _, route in done]
        return tuple(out for out, _ in done)

    @staticmethod
    def backward(ctx, *grads):
        drive([t.update_steps(route, ids, offsets, g, casting) for t, route, (ids, offsets, casting), g
               in zip(ctx.tables, ctx.routes, ctx.inputs, grads)], ctx.interleave)
        return None, None, None, None


def lookup_groups(tables: Sequence[Any], inputs: Sequence[tuple], interleave: bool) -> list[torch.Tensor]:
    """Look up several sharded groups; the backward updates their owners' rows.

    Args:
        tables: `ShardedPackedEmbedding` modules, the same sequence on every rank.
        inputs: per table (ids, offsets) or (ids, offsets, casting) of this rank's samples.
        interleave: overlap the groups' exchanges (same results either way).

    Returns:
        Pooled embeddings per table.  # (B_r, S, D) each
    """
    if not tables:  # a model without categorical features: nothing to look up or exchange
        return []
    inputs = [(ids, offsets, rest[0] if rest else None) for ids, offsets, *rest in inputs]
    if not torch.is_grad_enabled():
        done = drive([t.lookup_steps(ids, offsets) for t, (ids, offsets, _) in zip(tables, inputs)],
                     interleave)
        return [out for out, _ in done]
    trigger = torch.empty(0, device=tables[0].weight.device, requires_grad=True)
    return list(_GroupsLookup.apply(trigger, list(tables), inputs, interleave))


class ShardedLookups(torch.nn.Module):
    """Several row-wise sharded groups looked up together (`lookup_groups`).

    Args:
        tables: the groups' `ShardedPackedEmbedding` modules, in plan order.
        interleave: overlap one group's exchange with another's gather / pooling
            (`--no-interleave` gives the same parameters).
    """

    def __init__(self, tables: Sequence[torch.nn.Module], interleave: bool = True):
        super().__init__()
        self.tables = torch.nn.ModuleList(tables)
        self.interleave = interleave

    def forward(self, inputs: Sequence[tuple]) -> list[torch.Tensor]:
        """Pooled embeddings of every group for this rank's samples.  # (B_r, S, D) each"""
        return lookup_groups(list(self.tables), inputs, self.interleave)
