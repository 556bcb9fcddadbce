"""The `shard` pass: spread every packed group over the ranks of the world size.

Needs: a packed graph (``graph.graph["plan"].groups``), the spec, the target and
``ctx.world_size`` (W, from ``--world-size``, the launch environment, else 1).

Changes: ``world_size`` of the plan, and each group's ``sharding`` and ``shards``:

* ``row_wise`` over W shards: packed row r lives on rank r mod W at local row r div W (every
  table of the group spreads over all ranks; uneven counts are fine; the mapping is a pure
  function of W). Each step a rank sends the ids of its distinct rows to their owners and gets
  the rows back, then sends their gradients (`flowrec.planner.exchange`).
* ``replicated`` (one shard per rank, every rank holds every row): for groups so small that
  all-reducing their row gradients takes less time on the target's interconnect than the
  row-wise exchanges, and whose table is at most `REPLICATED_MAX_SHARE` of a rank's memory.

The notes give both predicted times for every group, so the report says why. With W = 1 every
group is ``row_wise`` over one shard (the whole table on the one rank) and nothing changes.
Afterwards every group has ``shards`` in {1, W}; a second run changes nothing.
"""
from __future__ import annotations

from dataclasses import replace

from flowrec.graph.types import OpGraph, PackedGroup, PassContext, PassResult
from flowrec.planner import exchange
from flowrec.planner.cost import default_budget, device_link, device_profile, group_access
from flowrec.planner.passes.meta import plan_meta
from flowrec.spec.units import format_bytes

REPLICATED_MAX_SHARE = 0.01  # of a rank's device memory budget: larger tables are never replicated
MAX_NOTE_GROUPS = 12  # groups described one per line; the rest are counted


def shard(graph: OpGraph, ctx: PassContext) -> PassResult:
    """Choose row-wise or replicated sharding per group (see the module docstring)."""
    meta = plan_meta(graph)
    world = ctx.world_size
    if world < 1:
        raise ValueError(f"world size must be at least 1, not {world}")
    if not meta.groups and meta.world_size == world:
        return PassResult(graph, False, ("no packed groups (run pack first)",))
    if not meta.groups:  # a model without tables: only its dense part runs on the ranks
        groups, notes = (), [f"world size {world}: no packed groups, the dense part data-parallel"]
    elif world == 1:
        groups = tuple(replace(g, sharding="row_wise", shards=1) for g in meta.groups)
        notes = ["world size 1: every group whole on the one rank"]
    else:
        groups, notes = _shard_groups(meta.groups, ctx)
    new_meta = replace(meta, groups=groups, world_size=world)
    if new_meta == meta:
        return PassResult(graph, False, tuple(notes))
    g = graph.copy()
    g.graph["plan"] = new_meta
    return PassResult(g, True, tuple(notes))


def _shard_groups(groups: tuple[PackedGroup, ...], ctx: PassContext) -> tuple[tuple[PackedGroup, ...], list[str]]:
    world = ctx.world_size
    link = device_link(device_profile(ctx.target), world)
    budget = ctx.device_budget_bytes if ctx.device_budget_bytes is not None else default_budget(device_profile(ctx.target))
    batch = -(-ctx.spec.training.batch_size // world)  # samples per rank
    out, notes = [], [f"world size {world} over {link.name} ({link.gbps:g} GB/s per rank, "
                      f"{link.latency_us:g} us per collective)"]
    for i, g in enumerate(groups):
        row_wise = replace(g, sharding="row_wise", shards=world)
        distinct = group_access(g, ctx.profile).distinct(batch * sum(f.max_len for f in g.fields))
        rw_s = exchange.seconds(exchange.row_wise_bytes(row_wise, distinct, world), 4, link)
        replicated = replace(g, sharding="replicated", shards=1)
        rep_s = exchange.seconds(exchange.replicated_bytes(replicated, world), 1, link)
        small = g.bytes <= REPLICATED_MAX_SHARE * budget
        pick = replicated if rep_s < rw_s and small else row_wise
        out.append(pick)
        if i < MAX_NOTE_GROUPS:
            why = ("all-reduce cheaper" if pick is replicated else
                   "exchange cheaper" if small else f"too large to replicate ({format_bytes(g.bytes)})")
            notes.append(f"{g.name}: {pick.sharding}, {format_bytes(pick.bytes_per_rank)} per rank ({why}: "
                         f"row-wise exchange {rw_s * 1e3:.3f} ms, replicated all-reduce {rep_s * 1e3:.3f} ms)")
    if len(groups) > MAX_NOTE_GROUPS:
        rest = out[MAX_NOTE_GROUPS:]
        notes.append(f"... {len(rest)} more group(s): {sum(g.sharding == 'replicated' for g in rest)} replicated, "
                     f"{sum(g.sharding == 'row_wise' for g in rest)} row-wise")
    return tuple(out), notes
