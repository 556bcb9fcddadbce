"""Plan reports as data: the JSON document (schemas/plan.schema.json) and the text report lines.

Only the CLI prints. Output is deterministic: no timestamps, stable ordering, sorted keys.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.planner.manager import make_plan
    >>> doc = plan_document(make_plan(load_spec("specs/dlrm_criteo.yaml")))
    >>> doc["groups"][0]["name"], len(doc["groups"][0]["features"])
    ('g0_d16', 26)
"""
from __future__ import annotations

import json
from typing import Any

from flowrec.graph.edges import input_slots
from flowrec.graph.types import STAGES, PackedGroup, Plan
from flowrec.spec.units import format_bytes

PLAN_FORMAT = "flowrec-plan"
PLAN_VERSION = 1


def group_document(g: PackedGroup) -> dict[str, Any]:
    bags = g.field_bags()
    name, lr, params = g.optimizer
    return {
        "name": g.name,
        "dim": g.dim,
        "dtype": g.dtype,
        "optimizer": {"name": name, "lr": lr, "params": dict(params)},
        "rows": g.rows,
        "row_bytes": g.row_bytes(),
        "bytes": g.bytes,
        "bags_per_sample": g.bags_per_sample,
        "placement": g.placement,
        "cache_rows": g.cache_rows,
        "expected_hit_rate": g.expected_hit_rate,
        "tables": [{"table": t.table, "rows": t.rows, "row_offset": t.row_offset} for t in g.tables],
        "features": [
            {"feature": f.feature, "table": f.table, "max_len": f.max_len, "pooling": f.pooling,
             "bags": [bags[f.feature].start, bags[f.feature].stop]}
            for f in g.fields
        ],
    }


def node_documents(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for node in plan.graph:
        op = plan.graph.nodes[node]["op"]
        out.append({
            "name": node,
            "kind": op.kind,
            "stage": op.stage,
            "out_shape": [d for d in op.out_shape],
            "flops_per_sample": op.flops,
            "param_bytes": op.param_bytes,
            "inputs": [{"port": s.port, "source": s.source, "fields": list(s.fields), "shape": list(s.shape)}
                       for s in input_slots(plan.graph, node)],
        })
    return out


def dense_packing(plan: Plan) -> list[dict[str, Any]]:
    ops = [plan.graph.nodes[n]["op"] for n in plan.graph]
    return [{"node": op.name, "members": list(op.attr("members")), "layers": list(op.attr("layers")),
             "in_features": op.attr("in_features")} for op in ops if op.kind == "packed_mlp"]


def stage_members(plan: Plan) -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {s: [] for s in STAGES}
    for node in plan.graph:
        stage = plan.graph.nodes[node]["op"].stage
        if stage is not None:
            stages[stage].append(node)
    return stages


def plan_document(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-able document (validates against schemas/plan.schema.json)."""
    c = plan.cost
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        "spec": plan.spec_name,
        "stage": plan.stage,
        "target": plan.target,
        "device_budget_bytes": plan.device_budget_bytes,
        "groups": [group_document(g) for g in plan.meta.groups],
        "group_order": list(plan.meta.group_order),
        "micro_batches": plan.meta.micro_batches,
        "prefetch": plan.meta.prefetch,
        "dense_packing": dense_packing(plan),
        "stages": stage_members(plan),
        "nodes": node_documents(plan),
        "passes": [{"name": p.name, "modified": p.modified, "notes": list(p.notes)} for p in plan.meta.passes],
        "cost": {
            "target": c.target,
            "batch_size": c.batch_size,
            "micro_batches": c.micro_batches,
            "stage_ms": dict(c.stage_ms),
            "step_ms_serial": c.step_ms_serial,
            "step_ms_overlap": c.step_ms_overlap,
            "samples_per_s": c.samples_per_s,
            "h2d_bytes_per_step": c.h2d_bytes_per_step,
            "memory_bytes": dict(c.memory),
            "peak_memory_bytes": c.peak_memory_bytes,
        },
    }


def plan_json(plan: Plan) -> str:
    """Canonical JSON text of the plan document (sorted keys, trailing newline)."""
    return json.dumps(plan_document(plan), indent=2, sort_keys=True) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]

    def fmt(row: list[str]) -> str:
        return "  ".join(str(x).ljust(w) for x, w in zip(row, widths)).rstrip()

    return [fmt(header), fmt(["-" * w for w in widths])] + [fmt(r) for r in rows]


def text_report(plan: Plan) -> list[str]:
    """Human-readable report lines: groups, dense packing, stages, cost, pass notes."""
    c = plan.cost
    lines = [f"plan {plan.spec_name}: stage {plan.stage}, target {plan.target}, "
             f"device budget {format_bytes(plan.device_budget_bytes)}", ""]
    if plan.meta.groups:
        rows = [[g.name, str(len(g.tables)), str(len(g.fields)), f"{g.rows:,}", str(g.dim),
                 format_bytes(g.bytes), g.placement, f"{g.cache_rows:,}", f"{g.expected_hit_rate:.3f}"]
                for g in plan.meta.groups]
        lines += ["packed groups:"] + _table(
            ["group", "tables", "features", "rows", "dim", "bytes", "placement", "cache rows", "hit rate"],
            rows) + [""]
    for d in dense_packing(plan):
        lines.append(f"dense packing: {d['node']} = {', '.join(d['members'])} (layers {d['layers']})")
    stages = stage_members(plan)
    if any(stages.values()):
        lines += ["stages:"] + [f"  {s:<9} {len(n):>4} op(s)  {', '.join(n[:6])}{' ...' if len(n) > 6 else ''}"
                                for s, n in stages.items()]
    lines += [f"micro-batches {plan.meta.micro_batches}, prefetch {plan.meta.prefetch}"
              + (f", group order {', '.join(plan.meta.group_order[:6])}" if plan.meta.group_order else ""), ""]
    lines += [f"predicted on {c.target} (batch {c.batch_size}):"]
    lines += ["  " + ", ".join(f"{s} {t:.3f} ms" for s, t in c.stage_ms)]
    lines += [f"  step {c.step_ms_serial:.3f} ms serial, {c.step_ms_overlap:.3f} ms overlapped "
              f"-> {c.samples_per_s:,.0f} samples/s",
              f"  host->device {format_bytes(c.h2d_bytes_per_step)} per step; peak device memory "
              f"{format_bytes(c.peak_memory_bytes)} ("
              + ", ".join(f"{k} {format_bytes(v)}" for k, v in c.memory) + ")", ""]
    for p in plan.meta.passes:
        lines.append(f"pass {p.name}: {'changed' if p.modified else 'no change'}")
        lines += [f"  {n}" for n in p.notes]
    return lines
