"""The `cache` pass: place every packed group under the device memory budget.

Needs: a packed graph (``graph.graph["plan"].groups``), the spec, the target device, optionally
a budget and an access profile in the context.

Changes: each group's ``placement``, ``cache_rows`` and ``expected_hit_rate``:

* the table budget is the device budget (context, else the target's memory minus its reserve)
  minus dense parameters/optimizer state and one batch of activations;
* if every group fits, all are ``device`` (hit rate 1.0);
* otherwise groups are decided largest first: a group whose size with every smaller group fits
  the remaining budget makes them all ``device``; else it gets a cache budget (the remaining
  budget less what the smaller groups need, at least half of it) and becomes
  ``static_hot`` (the hottest cache_rows rows on the device, FAE: at most the rows its profiling
  sample counts, `AccessModel.hot_set_hit_rate`), ``lookahead`` (a scratchpad
  for the distinct rows of W+1 batches, a retrieval head's sampled negatives included, times
  `LOOKAHEAD_MARGIN`, ScratchPipe; train-time hit rate
  1.0) or ``host`` (hit rate 0): the plan's cache hint forces a policy (``none`` -> host),
  ``auto`` takes the one the cost model prices lowest (row traffic plus host gathers per step).

Two rules make every placement runnable as planned (the runtime never changes one):

* a cache placement left without device rows is ``host`` (a cache of nothing is the host path);
* on a target whose host memory *is* the device (cpu) and with no explicit budget (context or
  spec hint), groups that do not fit the nominal budget stay ``device``: host memory holds them,
  and an explicit budget plans cache placements as on a GPU (which shows their traffic on any
  machine).

Hit rates come from the access profile when given, else from the Zipf model
(`flowrec.planner.access`). Afterwards the device tables and caches fit the budget whenever a
host placement was possible, and a second run changes nothing.
"""
from __future__ import annotations

from dataclasses import replace
from math import ceil

from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import OpGraph, PackedGroup, PassContext, PassResult
from flowrec.planner.cost import (
    DeviceProfile,
    access_source,
    activation_bytes,
    default_budget,
    dense_memory_bytes,
    device_profile,
    group_access,
    group_step_seconds,
    step_lookups,
)
from flowrec.planner.passes.meta import plan_meta
from flowrec.spec.units import format_bytes

LOOKAHEAD_MARGIN = 1.25  # scratchpad rows per expected distinct row of the window
POLICY_ORDER = ("lookahead", "static_hot", "host")  # tie-break of equal predicted costs


def sharded_cache_refusal(policy: str, world_size: int) -> str | None:
    """Why cache policy `policy` cannot be planned for `world_size` ranks, None when it can: the
    cache pass's refusal, which `flowrec train --nproc N` gives before it starts any rank."""
    if world_size > 1 and policy in ("static_hot", "lookahead"):
        return (f"cache placement {policy} is not yet supported for sharded groups (world size {world_size}); "
                f"use plan.cache auto or none, or train on one process")
    return None


def cache(graph: OpGraph, ctx: PassContext) -> PassResult:
    """Place packed groups on the device, in a cache, or on the host (see the module docstring)."""
    meta = plan_meta(graph)
    if not meta.groups:
        return PassResult(graph, False, ("no packed groups (run pack first)",))
    spec, device = ctx.spec, device_profile(ctx.target)
    budget = table_budget(graph, ctx)
    policy = spec.plan.cache
    if meta.world_size > 1:
        refusal = sharded_cache_refusal(policy, meta.world_size)
        if refusal is not None:
            raise ValueError(refusal)
        policy = "none"  # a rank's shard is on its device or, when it does not fit, on its host
    managed = frozenset(t.name for t in spec.tables if t.managed is not None)
    groups, notes = place(meta.groups, budget, device, policy, spec.training.batch_size,
                          spec.plan.window, ctx.profile, managed, step_lookups(graph), spec.training.epochs)
    if not device.overlaps and ctx.device_budget_bytes is None and any(g.placement != "device" for g in groups):
        groups = tuple(replace(g, placement="device", cache_rows=0, expected_hit_rate=1.0) for g in groups)
        notes.append(f"target {device.name}: host memory is the device and no budget was given, so every "
                     f"group stays resident (give --device-budget to plan cache placements)")
    notes.insert(0, f"table budget {format_bytes(budget)} on {device.name}; groups need "
                    f"{format_bytes(sum(g.bytes_per_rank for g in meta.groups))}"
                    + (f" per rank ({meta.world_size} ranks)" if meta.world_size > 1 else ""))
    if groups == meta.groups:
        return PassResult(graph, False, tuple(notes))
    g = graph.copy()
    g.graph["plan"] = replace(meta, groups=groups)
    return PassResult(g, True, tuple(notes))


def table_budget(graph: OpGraph, ctx: PassContext) -> int:
    """Device bytes left for tables and caches after dense state and one batch of activations."""
    device = device_profile(ctx.target)
    budget = ctx.device_budget_bytes if ctx.device_budget_bytes is not None else default_budget(device)
    local_batch = -(-ctx.spec.training.batch_size // plan_meta(graph).world_size)  # samples per rank
    fixed = dense_memory_bytes(graph, ctx.spec) + activation_bytes(graph, local_batch, ctx.spec.training.precision)
    return max(0, budget - fixed)


def place(groups: tuple[PackedGroup, ...], budget: int, device: DeviceProfile, policy: str,
          batch: int, window: int, profile: object, managed: frozenset[str] = frozenset(),
          step_ids: dict[str, int] | None = None, epochs: float = 1.0) -> tuple[tuple[PackedGroup, ...], list[str]]:
    """Placement of every group under `budget` bytes; returns the groups (input order) and notes.
    Groups holding `managed` tables are never static_hot (FAE's hot/cold batches reorder samples
    across the batches a managed map remaps in order). `step_ids`: a group's lookups per step
    beyond its samples' (sampled negatives, `cost.step_lookups`), in its window and its price.
    `epochs`: the run's, over which a lookahead group's traffic is priced."""
    order = sorted(groups, key=lambda g: (-g.bytes_per_rank, g.name))
    decided: dict[str, PackedGroup] = {}
    notes: list[str] = []
    remaining = budget
    for i, g in enumerate(order):
        rest = sum(x.bytes_per_rank for x in order[i + 1:])
        if g.bytes_per_rank + rest <= remaining:
            for x in order[i:]:
                decided[x.name] = replace(x, placement="device", cache_rows=0, expected_hit_rate=1.0)
            notes.append(f"{len(order) - i} group(s) fit on the device ({format_bytes(g.bytes_per_rank + rest)})")
            break
        share = remaining - min(rest, remaining // 2)
        chosen, why = _choose(g, share, device, policy, batch, window, profile,
                              any(t.table in managed for t in g.tables), (step_ids or {}).get(g.name, 0), epochs)
        decided[g.name] = chosen
        remaining -= chosen.cache_rows * g.row_bytes()
        notes.append(f"{g.name} ({format_bytes(g.bytes_per_rank)}) does not fit: {why}")
    return tuple(decided[g.name] for g in groups), notes


def expected_hit_rate(g: PackedGroup, profile: object) -> float:
    """Device hits per lookup of a group's placement at train time (lookahead fetches ahead: 1.0)."""
    info = PLACEMENTS[g.placement]
    if info.traffic == "window" or info.rows_on == "device":
        return 1.0
    if not info.cached:
        return 0.0
    return round(group_access(g, profile).hot_set_hit_rate(g.cache_rows), 6)


def lookahead_slots(g: PackedGroup, profile: object, batch: int, window: int, step_ids: int = 0) -> int:
    """The scratchpad a `lookahead` group needs: the distinct rows of W+1 batches at max_len ids a
    sample (a step's sampled negatives included) times `LOOKAHEAD_MARGIN`, at most the group's rows."""
    draws = batch * sum(f.max_len for f in g.fields) + step_ids
    return min(g.rows, ceil(group_access(g, profile).distinct(draws * (window + 1)) * LOOKAHEAD_MARGIN))


def _choose(g: PackedGroup, share: int, device: DeviceProfile, policy: str, batch: int, window: int,
            profile: object, managed: bool = False, step_ids: int = 0, epochs: float = 1.0) -> tuple[PackedGroup, str]:
    fit_rows = min(g.rows, max(0, share) // g.row_bytes())
    model = group_access(g, profile)
    need = lookahead_slots(g, profile, batch, window, step_ids)
    options = {
        "static_hot": replace(g, placement="static_hot", cache_rows=fit_rows,
                              expected_hit_rate=round(model.hot_set_hit_rate(fit_rows), 6)),
        "lookahead": replace(g, placement="lookahead", cache_rows=min(need, fit_rows), expected_hit_rate=1.0),
        "host": replace(g, placement="host", cache_rows=0, expected_hit_rate=0.0),
    }
    source = access_source(g, profile)
    feasible = [p for p in POLICY_ORDER if (p != "lookahead" or need <= fit_rows) and not (managed and p == "static_hot")]
    if policy == "none":
        return options["host"], "cache policy none -> host"
    if policy == "lookahead" and need > fit_rows:
        raise ValueError(
            f"group {g.name}: the lookahead window ({window} batches of {batch}) needs a scratchpad of "
            f"{need:,} rows ({format_bytes(need * g.row_bytes())}) but {fit_rows:,} rows fit in the device "
            f"budget left for it ({format_bytes(max(share, 0))}); raise the device budget, shorten "
            f"plan.window, or use cache: auto or static_hot")
    if policy == "static_hot" and managed:
        raise ValueError(f"group {g.name} holds managed tables, which static_hot cannot follow (its hot/cold "
                         "batches reorder samples); use cache: auto, lookahead or none")
    if policy in ("static_hot", "lookahead"):
        pick = options[policy]
        if pick.cache_rows < 1:
            return options["host"], f"forced {policy}, but no device rows are left for a cache -> host"
        return pick, f"forced {policy}, {pick.cache_rows:,} cache rows ({source})"
    costs = {p: group_step_seconds(options[p], device, batch, window, profile, step_ids, epochs) for p in feasible}
    best = min(feasible, key=lambda p: (costs[p], POLICY_ORDER.index(p)))
    priced = ", ".join(f"{p} {costs[p] * 1e3:.3f} ms" for p in feasible)
    pick = options[best]
    if pick.placement != "host" and pick.cache_rows < 1:
        return options["host"], f"auto -> {best} has no device rows left for a cache -> host ({priced})"
    return pick, (f"auto -> {best} with {pick.cache_rows:,} cache rows, hit rate "
                  f"{pick.expected_hit_rate:.3f} ({source}; per-step cost {priced})")
