"""Plan reports as data: the text report lines (the JSON document: `flowrec.graph.plan_io`).

Only the CLI prints. Output is deterministic: no timestamps, stable ordering, sorted keys.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.planner.manager import make_plan
    >>> text_report(make_plan(load_spec("specs/dlrm_criteo.yaml")))[0].startswith("plan dlrm_criteo")
    True
"""
from __future__ import annotations

from typing import Any

from flowrec.graph.kinds import MLP_LAYER_OPTIONS
from flowrec.graph.plan_io import dense_packing, packed_experts, stage_members
from flowrec.graph.types import Plan
from flowrec.spec.model import ModelSpec
from flowrec.spec.units import format_bytes


UNCALIBRATED_HINT = " (not calibrated: `flowrec calibrate`, then --target FILE)"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(row: list[str]) -> str:
        return "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def managed_report(spec: ModelSpec, trained: dict[str, Any] | None = None, world_size: int = 1) -> list[str]:
    """One line per managed table of `spec`: its capacity (what the plan prices) and its map's rules
    (nothing for a spec without managed tables); with `trained` (a run's managed report, as
    `managed_lines` takes it), a second line per table: what its map holds and did; under
    `world_size` > 1 ranks, where its map lives (owner ranks of its virtual shards, or replicas)."""
    tables = (trained or {}).get("tables", {})
    managed = [t.managed for t in spec.tables if t.managed is not None]
    owners = world_size > 1 and bool(managed) and all(m.shards > 1 for m in managed)
    out = []
    for t in spec.tables:
        m = t.managed
        if m is None:
            continue
        rules = f"admit at {m.admit_min_count}, {m.evict}" + (f" (decay {m.decay:g})" if m.evict == "decayed_lfu" else "")
        rules += f" every {m.every_steps:,} steps" + (f", ttl {m.ttl_steps:,} steps" if m.ttl_steps else "")
        shards = f" in {m.shards:,} shards" if m.shards > 1 else ""
        out.append(f"managed table {t.name}: {m.rows:,} rows{shards}, priced at capacity; {rules}")
        if t.name in tables:
            out.append(f"  trained: {table_line(tables[t.name])}")
        if owners:
            owned = [len(range(w, m.shards, world_size)) for w in range(world_size)]
            line = (f"  under {world_size} ranks: rank w owns the shards s % {world_size} == w "
                    f"({', '.join(map(str, owned))} shards) and remaps their ids")
            if m.shards < world_size:
                idle = f"rank {m.shards}" if m.shards == world_size - 1 else f"ranks {m.shards} to {world_size - 1}"
                line += f"; {idle} own{'s' if m.shards == world_size - 1 else ''} none of its shards"
            out.append(line)
        elif world_size > 1 and m.shards > 1:
            out.append(f"  under {world_size} ranks: every rank holds a replica of the maps (a managed table "
                       "of one shard needs one); give every managed table shards > 1 for owner ranks")
    return out


def managed_lines(report: dict[str, Any] | None) -> list[str]:
    """Console lines of a run's managed report (`ManagedState.report`): one per table."""
    if not report:
        return []
    return [f"managed {table}: {table_line(r)}" for table, r in report["tables"].items()]


def table_line(r: dict[str, Any]) -> str:
    """One table of a managed report: occupancy, totals, default-row lookups (when counted)."""
    line = (f"{r['held']:,}/{r['rows']:,} rows held ({100 * r['held'] / max(r['rows'], 1):.1f}%), "
            f"{r['waiting']:,} ids waiting, {r['admitted']:,} admitted, {r['evicted']:,} evicted, "
            f"{r['expired']:,} expired")
    if isinstance(r.get("shards"), int) and r["shards"] > 1:
        line += f" (totals of {r['shards']:,} shards)"
    if r.get("lookups"):
        line += (f"; {r['default_lookups']:,} of {r['lookups']:,} trained lookups "
                 f"({100 * r['default_lookups'] / r['lookups']:.1f}%) read the default row")
    return line


def text_report(plan: Plan) -> list[str]:
    """Human-readable report lines: groups, dense packing, stages, cost, pass notes."""
    c = plan.cost
    lines = [f"plan {plan.spec_name}: stage {plan.stage}, target {plan.target}, "
             f"device budget {format_bytes(plan.device_budget_bytes)}", ""]
    world = plan.meta.world_size
    if world > 1:
        lines[0] += f", {world} ranks"
    if plan.meta.groups:
        header = ["group", "tables", "features", "rows", "dim", "bytes", "placement", "cache rows", "hit rate"]
        rows = [[g.name, str(len(g.tables)), str(len(g.fields)), f"{g.rows:,}", str(g.dim),
                 format_bytes(g.bytes), g.placement, f"{g.cache_rows:,}", f"{g.expected_hit_rate:.3f}"]
                for g in plan.meta.groups]
        if world > 1:
            sent = dict(c.group_exchange_bytes)
            header += ["sharding", "per rank", "sent/step"]
            for row, g in zip(rows, plan.meta.groups):
                row += [g.sharding, format_bytes(g.bytes_per_rank), format_bytes(sent.get(g.name, 0))]
        lines += ["packed groups:"] + _table(header, rows) + [""]
    for d in dense_packing(plan):
        lines.append(f"dense packing: {d['node']} = {', '.join(d['members'])} (layers {d['layers']})")
    for d in packed_experts(plan):
        lines.append(f"dense packing: {d['node']} = {d['experts']} experts (layers {d['layers']}) in one kernel")
    for node, options in regularised(plan):
        lines.append(f"regularised: {node} ({', '.join(f'{k} {v}' for k, v in options)})")
    for node, options in head_options(plan):
        lines.append(f"head {node}: " + ", ".join(options))
    stages = stage_members(plan)
    if any(stages.values()):
        lines += ["stages:"] + [f"  {s:<9} {len(n):>4} op(s)  {', '.join(n[:6])}{' ...' if len(n) > 6 else ''}"
                                for s, n in stages.items()]
    lines += [f"micro-batches {plan.meta.micro_batches}, prefetch {plan.meta.prefetch}"
              + (f", group order {', '.join(plan.meta.group_order[:6])}" if plan.meta.group_order else ""), ""]
    lines += [f"predicted on {c.target} (batch {c.batch_size}"
              + (f", {-(-c.batch_size // world)} per rank):" if world > 1 else "):")]
    lines += [f"  cost constants: {c.constants}" + (UNCALIBRATED_HINT if c.constants.startswith("datasheet") else ""),
              f"  access profile: {c.access_profile}"]
    lines += ["  " + ", ".join(f"{s} {t:.3f} ms" for s, t in c.stage_ms)]
    lines += [f"  step {c.step_ms_serial:.3f} ms serial, {c.step_ms_overlap:.3f} ms overlapped "
              f"-> {c.samples_per_s:,.0f} samples/s",
              *([f"  exchange {format_bytes(c.exchange_bytes_per_step)} sent per rank per step, "
                 f"{c.exchange_ms:.3f} ms (included above)"] if world > 1 else []),
              f"  host->device {format_bytes(c.h2d_bytes_per_step)} per step; peak device memory "
              f"{format_bytes(c.peak_memory_bytes)} ("
              + ", ".join(f"{k} {format_bytes(v)}" for k, v in c.memory) + ")", ""]
    for p in plan.meta.passes:
        lines.append(f"pass {p.name}: {'changed' if p.modified else 'no change'}")
        lines += [f"  {n}" for n in p.notes]
    return lines


def regularised(plan: Plan) -> list[tuple[str, tuple[tuple[str, Any], ...]]]:
    """(node, ((option, value), ...)) of every dense node with a norm or dropout."""
    out = []
    for node in plan.graph:
        op = plan.graph.nodes[node]["op"]
        options = tuple((k, op.attr(k)) for k in MLP_LAYER_OPTIONS if op.attr(k) not in (None, "none", 0, 0.0))
        if options:
            out.append((node, options))
    return out


def head_options(plan: Plan) -> list[tuple[str, list[str]]]:
    """(head node, option texts) of every head with classes, a sample weight or a task space."""
    out = []
    for node in plan.graph:
        op = plan.graph.nodes[node]["op"]
        if op.kind != "head":
            continue
        options = [f"{op.attr('out')} classes"] if op.attr("out") is not None else []
        if op.attr("task") == "retrieval":
            negatives = op.attr("negatives") + (f" ({op.attr('num_negatives')}, {op.attr('distribution')})"
                                                 if op.attr("negatives") == "sampled" else "")
            options = [f"retrieval of {op.attr('item_feature')}", f"{negatives} negatives",
                       f"{op.attr('metric')} / {op.attr('temperature'):g}"]
            options += ["logQ correction"] if op.attr("logq_correction") else []
        if op.attr("sample_weight") is not None:
            options.append(f"sample weight {op.attr('sample_weight')}")
        if op.attr("trained_where") is not None:
            label, value = op.attr("trained_where")
            options.append(f"trained where {label} == {value:g}")
        if options:
            out.append((node, options))
    return out
