"""Does a plan fit the memory it runs in? The planner's peak estimate against a limit.

The need of a plan is the cost model's peak device memory (`CostPrediction.peak_memory_bytes`:
device-resident tables, caches, one micro-batch of activations, dense parameters with their
gradients and optimizer state, exchange buffers); where the host's memory *is* the device (the
cpu target, a run on the CPU) the rows the plan leaves on the host count too. Its contributors are
the same terms by packed group and by dense node, largest first.

The limit is the caller's: `flowrec plan` compares with the plan's device budget on a GPU target
and with this machine's available host memory on a host target; a run compares with the memory
of the device it runs on (`flowrec.runs.start`). Host memory is shared by the ranks of one
machine, so both commands take the same rule, `host_share`: each of N local ranks may use an
N-th of the available host memory (`flowrec train --nproc N` and a torchrun launch: N =
LOCAL_WORLD_SIZE; `flowrec plan --world-size W`: `--local-ranks`, else LOCAL_WORLD_SIZE, else W,
all ranks on this machine as `--nproc W` runs them). `host_fit` is that check for a plan whose
device is the host; `host_misfit` takes the share for the rows a GPU plan keeps on the host. A plan is refused only when its need exceeds
the limit by more than `FIT_MARGIN`: the estimate stayed below the measured peak of every run
measured (so a need above the limit cannot fit), and the margin keeps a plan near its limit,
whose estimate might over-count, from being refused on the estimate alone.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.planner.manager import make_plan
    >>> misfit(make_plan(load_spec("specs/dlrm_criteo.yaml")), 64 * 2**30, "device budget") is None
    True
"""
from __future__ import annotations

from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import Plan
from flowrec.planner.cost import SPARSE_KINDS, device_profile, growing_activations
from flowrec.spec.units import format_bytes

# Measured with tools/bench_peak_memory.py (bench/results/peak_memory_cpu.json, a CPU run of 3
# steps; peak = VmHWM over the resident memory before `flowrec.train`): the estimate was 0.56 ..
# 0.92 of the measured peak (din_taobao 409 / 730 MiB, dlrm_criteo 2,231 / 2,414 MiB, a 16-expert
# MMoE 1,125 / 1,743 MiB, dlrm_criteo at batch 65,536 2,737 / 3,667 MiB): it leaves out the
# process's fixed cost (threads, allocator, data) and temporaries, and never exceeded the real
# peak. So an estimate above the limit is a run that cannot fit; the margin of 10% (the estimate
# may over-count activations torch frees early in a model unlike these) keeps a plan near its
# limit from being refused on the estimate alone: such a run may still fail with torch's
# out-of-memory error (exit 3) rather than be refused while it might fit.
FIT_MARGIN = 1.1
SHOWN = 3  # contributors named in the one line


def host_is_device(plan: Plan) -> bool:
    """True where the plan's device memory is host memory (the cpu target: nothing overlaps, as in
    the cache pass's rule)."""
    return not device_profile(plan.target).overlaps


def plan_need(plan: Plan, host_is_device: bool) -> tuple[int, list[tuple[str, int]]]:
    """(bytes, contributors) of the memory `plan` needs on its device (with `host_is_device`, the
    host rows too); contributors are (what, bytes), largest first, and sum to the bytes; `what`
    holds a ``{}`` where its size goes."""
    if plan.cost is None:
        return 0, []
    parts: list[tuple[str, int]] = []
    groups = plan.meta.groups
    memory = dict(plan.cost.memory)
    tables = [(g, g.bytes_per_rank) for g in groups if host_is_device or PLACEMENTS[g.placement].rows_on == "device"]
    parts += _spread(memory.get("tables", 0) + (_host_rows(plan) if host_is_device else 0),
                     [(f"group {g.name} ({_members(g)}): {{}} of embedding rows with optimizer state", b) for g, b in tables])
    parts += _spread(memory.get("caches", 0),
                     [(f"group {g.name}: {{}} of cache ({g.cache_rows:,} rows)", g.cache_rows * g.row_bytes())
                      for g in groups if PLACEMENTS[g.placement].cached])
    parts += _spread(memory.get("dense", 0), _dense_nodes(plan))
    local = -(-plan.cost.batch_size // plan.meta.world_size) // max(1, plan.cost.micro_batches)
    parts.append((f"activations: {{}} for {local:,} samples kept for backward{_growing(plan, local)}",
                  memory.get("activations", 0)))
    if "exchange" in memory:
        parts.append(("exchange buffers: {}", memory["exchange"]))
    if "maps" in memory:
        parts.append(("managed maps: {} of free rows and ids (40 bytes per row of capacity, twice)", memory["maps"]))
    parts = sorted((p for p in parts if p[1] > 0), key=lambda p: (-p[1], p[0]))
    return sum(b for _, b in parts), parts


def _growing(plan: Plan, batch: int) -> str:
    """", with <what>" for the activation term that grows fastest at `batch` samples
    (`cost.growing_activations`: an attention mask, a retrieval head's logits), else ""."""
    terms = growing_activations(plan.graph, batch)
    return f", with {max(terms)[1]}" if terms else ""


def misfit(plan: Plan, limit_bytes: int, limit_name: str, host_is_device: bool = False) -> str | None:
    """The one line saying that `plan` needs more than `limit_bytes` (`limit_name`, e.g. "host
    memory available") times `FIT_MARGIN`, naming its largest contributors; None when it fits."""
    need, parts = plan_need(plan, host_is_device)
    if need <= limit_bytes * FIT_MARGIN:
        return None
    shown = "; ".join(what.format(format_bytes(b)) for what, b in parts[:SHOWN])
    return (f"plan {plan.spec_name} needs about {format_bytes(need)} at its peak, more than the "
            f"{format_bytes(limit_bytes)} of {limit_name} (largest: {shown})")


def host_misfit(plan: Plan, limit_bytes: int, limit_name: str) -> str | None:
    """The one line saying that the rows a device plan keeps on the host (host and cache
    placements: their whole tables) need more than `limit_bytes` of host memory times
    `FIT_MARGIN`; None when they fit."""
    hosted = sorted(((g.name, g.bytes_per_rank) for g in plan.meta.groups
                     if PLACEMENTS[g.placement].rows_on == "host"), key=lambda p: (-p[1], p[0]))
    need = sum(b for _, b in hosted)
    if need <= limit_bytes * FIT_MARGIN:
        return None
    shown = "; ".join(f"group {name}: {format_bytes(b)}" for name, b in hosted[:SHOWN])
    return (f"plan {plan.spec_name} keeps about {format_bytes(need)} of embedding rows on the host, more than "
            f"the {format_bytes(limit_bytes)} of {limit_name} (largest: {shown})")


def host_share(available_bytes: int, local_ranks: int) -> tuple[int, str]:
    """The host memory one of `local_ranks` processes of this machine may use, and its name in a
    line: an equal share of the available bytes (every rank holds its own tables, activations and
    buffers, all in the same memory). The one rule of `flowrec plan` and `flowrec train`.

    Args:
        available_bytes: host memory available to this process (`flowrec.data.hostmemory`).
        local_ranks: ranks that share it (1: a single process; below 1 counts as 1).

    Returns:
        (bytes per rank, e.g. "host memory available to each of 2 ranks on this machine (31.0 GiB in all)").

    Example:
        >>> host_share(8 * 2**30, 4)
        (2147483648, 'host memory available to each of 4 ranks on this machine (8.0 GiB in all)')
    """
    ranks = max(1, int(local_ranks))
    if ranks == 1:
        return available_bytes, "host memory available on this machine"
    return (available_bytes // ranks, f"host memory available to each of {ranks} ranks on this machine "
                                      f"({format_bytes(available_bytes)} in all)")


def host_fit(plan: Plan, available_bytes: int, local_ranks: int) -> str | None:
    """`misfit` of a plan whose device is the host against one rank's `host_share` (host rows
    counted): the check of `flowrec plan` on a host target and of a CPU run, rank or not."""
    limit, name = host_share(available_bytes, local_ranks)
    return misfit(plan, limit, name, host_is_device=True)


def _spread(total: int, items: list[tuple[str, int]]) -> list[tuple[str, int]]:
    """`items` scaled to sum to `total` (the cost model's figure), or one line when there are none."""
    weight = sum(b for _, b in items)
    if total <= 0:
        return []
    if weight <= 0:
        return [(items[0][0] if items else "other: {}", total)]
    scaled = [(what, total * b // weight) for what, b in items]
    scaled[0] = (scaled[0][0], scaled[0][1] + total - sum(b for _, b in scaled))
    return scaled


def _host_rows(plan: Plan) -> int:
    """Bytes of the rows the plan keeps on the host (host and cache placements)."""
    return sum(g.bytes_per_rank for g in plan.meta.groups if PLACEMENTS[g.placement].rows_on == "host")


def _members(group) -> str:
    names = [t.table for t in group.tables]
    return f"tables {', '.join(names[:3])}" + (f" and {len(names) - 3} more" if len(names) > 3 else "")


def _dense_nodes(plan: Plan) -> list[tuple[str, int]]:
    """(module node, bytes of its parameters and buffers) of every dense node with either."""
    out = []
    for node in plan.graph:
        op = plan.graph.nodes[node]["op"]
        held = int(op.attr("buffer_bytes", 0))
        if op.kind not in SPARSE_KINDS and op.param_bytes + held > 0:
            out.append((f"module {node}: {{}} of dense parameters{', buffers' if held else ''}, gradients and "
                        "optimizer state", op.param_bytes + held))
    return out

