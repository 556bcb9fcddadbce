"""The plan as a JSON document, both ways: `plan_document` / `plan_json` and `plan_from_document`.

The document (schemas/plan.schema.json) holds everything the runtime needs to run a plan without
planning again: every node with its kind, attributes and input slots, every packed group with its
tables, fields and placement, the schedule (micro-batches, prefetch, group order), the pass
records and the cost prediction. `plan_from_document(plan_document(p))` equals `p`, and its JSON
text is byte-identical (tested for every spec in specs/).

Output is deterministic: no timestamps, stable ordering, sorted keys.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.planner.manager import make_plan
    >>> plan = make_plan(load_spec("specs/movielens.yaml"))
    >>> plan_json(plan_from_document(plan_document(plan))) == plan_json(plan)
    True
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from typing import Any

import networkx as nx

from flowrec.graph.edges import Slot, input_slots, set_inputs
from flowrec.graph.shapes import expert_count
from flowrec.graph.types import (
    MEMORY_PARTS,
    STAGES,
    CostPrediction,
    GroupField,
    Op,
    PackedGroup,
    PassRecord,
    Plan,
    PlanMeta,
    TableSlot,
)
from flowrec.spec.load import to_dict
from flowrec.spec.model import ModelSpec, identity_doc
from flowrec.version import __version__

PLAN_FORMAT = "flowrec-plan"
PLAN_VERSION = 1  # the plan format's number (`version`); the flowrec that wrote a plan is `flowrec_version`
WRITER = "flowrec_version"  # the key of the writing flowrec's version (absent: a flowrec before plans recorded it)
NOT_RECORDED = "not recorded"  # cost provenance of a plan written before plans recorded it
FINGERPRINT_TRAINING = ("batch_size", "precision")  # training settings that shape the plan


def model_fingerprint(spec: ModelSpec) -> str:
    """A hash of what a plan depends on: features, tables, modules, heads, optimizers, batch size
    and precision (not the name, data binding, planning hints, seed or epochs, nor what a custom
    module's dry run measured of its memory: `identity_doc`)."""
    doc = identity_doc(to_dict(spec))
    model = {k: doc.get(k) for k in ("features", "tables", "modules", "heads", "optimizer")}
    model["training"] = {k: doc["training"].get(k) for k in FINGERPRINT_TRAINING}
    text = json.dumps(model, sort_keys=True, separators=(",", ":"))
    return "sha256:" + hashlib.sha256(text.encode("utf-8")).hexdigest()[:16]


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
        "sharding": g.sharding,
        "shards": g.shards,
        "bytes_per_rank": g.bytes_per_rank,
        "tables": [{"table": t.table, "rows": t.rows, "row_offset": t.row_offset} for t in g.tables],
        "features": [
            {"feature": f.feature, "table": f.table, "max_len": f.max_len, "pooling": f.pooling,
             "bags": [bags[f.feature].start, bags[f.feature].stop]}
            for f in g.fields
        ],
    }


def _jsonable(value: Any) -> Any:
    """Op attribute values as JSON: tuples become lists (`_frozen` undoes it)."""
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    return value


def _frozen(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def node_documents(plan: Plan) -> list[dict[str, Any]]:
    out = []
    for node in plan.graph:
        op: Op = plan.graph.nodes[node]["op"]
        out.append({
            "name": node,
            "kind": op.kind,
            "stage": op.stage,
            "dtype": op.dtype,
            "out_shape": list(op.out_shape),
            "out_bytes": op.out_bytes,
            "flops_per_sample": op.flops,
            "param_bytes": op.param_bytes,
            "attrs": [[k, _jsonable(v)] for k, v in op.attrs],
            "inputs": [{"port": s.port, "source": s.source, "fields": list(s.fields), "shape": list(s.shape)}
                       for s in input_slots(plan.graph, node)],
        })
    return out


def dense_packing(plan: Plan) -> list[dict[str, Any]]:
    ops = [plan.graph.nodes[n]["op"] for n in plan.graph]
    return [{"node": op.name, "members": list(op.attr("members")), "layers": list(op.attr("layers")),
             "in_features": op.attr("in_features")} for op in ops if op.kind == "packed_mlp"]


def packed_experts(plan: Plan) -> list[dict[str, Any]]:
    """The mixtures whose experts run as one batched kernel (the `pack` pass's ``packed``)."""
    ops = [plan.graph.nodes[n]["op"] for n in plan.graph]
    return [{"node": op.name, "experts": expert_count(dict(op.attrs)), "layers": list(op.attr("expert_layers")),
             "in_features": op.attr("in_features")} for op in ops if op.attr("packed")]


def stage_members(plan: Plan) -> dict[str, list[str]]:
    stages: dict[str, list[str]] = {s: [] for s in STAGES}
    for node in plan.graph:
        stage = plan.graph.nodes[node]["op"].stage
        if stage is not None:
            stages[stage].append(node)
    return stages


def cost_document(c: CostPrediction) -> dict[str, Any]:
    return {
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
        "world_size": c.world_size,
        "exchange_bytes_per_step": c.exchange_bytes_per_step,
        "exchange_ms": c.exchange_ms,
        "group_exchange_bytes": dict(c.group_exchange_bytes),
        "constants": c.constants,
        "access_profile": c.access_profile,
    }


def plan_document(plan: Plan) -> dict[str, Any]:
    """The plan as a JSON-able document (validates against schemas/plan.schema.json)."""
    meta = plan.meta
    return {
        "format": PLAN_FORMAT,
        "version": PLAN_VERSION,
        WRITER: __version__,
        "spec": plan.spec_name,
        "spec_fingerprint": plan.spec_fingerprint,
        "stage": plan.stage,
        "target": plan.target,
        "device_budget_bytes": plan.device_budget_bytes,
        "tables": list(plan.graph.graph.get("tables", ())),
        "features": list(plan.graph.graph.get("features", ())),
        "groups": [group_document(g) for g in meta.groups],
        "group_order": list(meta.group_order),
        "micro_batches": meta.micro_batches,
        "prefetch": meta.prefetch,
        "world_size": meta.world_size,
        "dense_packing": dense_packing(plan),
        "stages": stage_members(plan),
        "nodes": node_documents(plan),
        "passes": [{"name": p.name, "modified": p.modified, "notes": list(p.notes)} for p in meta.passes],
        "cost": cost_document(plan.cost) if plan.cost is not None else None,
    }


def plan_json(plan: Plan) -> str:
    """Canonical JSON text of the plan document (sorted keys, trailing newline)."""
    return json.dumps(plan_document(plan), indent=2, sort_keys=True) + "\n"


def _group(doc: dict[str, Any]) -> PackedGroup:
    opt = doc["optimizer"]
    return PackedGroup(
        name=doc["name"], dim=doc["dim"], dtype=doc["dtype"],
        optimizer=(opt["name"], opt["lr"], tuple(sorted(opt["params"].items()))),
        tables=tuple(TableSlot(t["table"], t["rows"], t["row_offset"]) for t in doc["tables"]),
        fields=tuple(GroupField(f["feature"], f["table"], f["max_len"], f["pooling"]) for f in doc["features"]),
        placement=doc["placement"], cache_rows=doc["cache_rows"], expected_hit_rate=doc["expected_hit_rate"],
        sharding=doc["sharding"], shards=doc["shards"],
    )


def _op(doc: dict[str, Any]) -> Op:
    return Op(name=doc["name"], kind=doc["kind"], out_shape=tuple(doc["out_shape"]), dtype=doc["dtype"],
              param_bytes=doc["param_bytes"], flops=doc["flops_per_sample"], out_bytes=doc["out_bytes"],
              attrs=tuple((k, _frozen(v)) for k, v in doc["attrs"]), stage=doc["stage"])


def _cost(doc: dict[str, Any] | None) -> CostPrediction | None:
    if doc is None:
        return None
    return CostPrediction(
        target=doc["target"], batch_size=doc["batch_size"], micro_batches=doc["micro_batches"],
        stage_ms=tuple((s, doc["stage_ms"][s]) for s in STAGES),
        step_ms_serial=doc["step_ms_serial"], step_ms_overlap=doc["step_ms_overlap"],
        samples_per_s=doc["samples_per_s"], h2d_bytes_per_step=doc["h2d_bytes_per_step"],
        memory=tuple((p, doc["memory_bytes"][p]) for p in MEMORY_PARTS if p in doc["memory_bytes"]),
        peak_memory_bytes=doc["peak_memory_bytes"],
        world_size=doc["world_size"], exchange_bytes_per_step=doc["exchange_bytes_per_step"],
        exchange_ms=doc["exchange_ms"],
        group_exchange_bytes=tuple((g, b) for g, b in doc["group_exchange_bytes"].items()),
        constants=doc.get("constants", NOT_RECORDED), access_profile=doc.get("access_profile", NOT_RECORDED),
    )


def plan_from_document(doc: dict[str, Any]) -> Plan:
    """The `Plan` of a document that validates against schemas/plan.schema.json.

    Structural consistency with a spec is the planner's check (`flowrec.planner.contract`).
    """
    graph: nx.DiGraph = nx.DiGraph(name=doc["spec"], tables=tuple(doc["tables"]), features=tuple(doc["features"]))
    for node in doc["nodes"]:
        graph.add_node(node["name"], op=_op(node))
    for node in doc["nodes"]:
        set_inputs(graph, node["name"], [Slot(s["port"], s["source"], tuple(s["fields"]), tuple(s["shape"]))
                                         for s in node["inputs"]])
    graph.graph["plan"] = PlanMeta(
        groups=tuple(_group(g) for g in doc["groups"]),
        micro_batches=doc["micro_batches"], prefetch=doc["prefetch"],
        group_order=tuple(doc["group_order"]),
        passes=tuple(PassRecord(p["name"], p["modified"], tuple(p["notes"])) for p in doc["passes"]),
        world_size=doc["world_size"],
    )
    return Plan(spec_name=doc["spec"], stage=doc["stage"], target=doc["target"], graph=graph,
                cost=_cost(doc["cost"]), device_budget_bytes=doc["device_budget_bytes"],
                spec_fingerprint=doc["spec_fingerprint"])


def with_class_files(plan: Plan, spec: ModelSpec) -> Plan:
    """`plan` whose custom modules import the class `spec` names (`absolute_class_files`): a run of
    before 2026-12-06 recorded a relative `file.py` in its plan, which imported only from the folder
    training ran in."""
    classes = {m.name: m.param("class") for m in spec.modules if m.kind == "custom"}
    stale = [n for n, d in plan.graph.nodes(data=True)
             if n in classes and d["op"].kind == "custom" and d["op"].attr("class") != classes[n]]
    if not stale:
        return plan
    graph = plan.graph.copy()
    for name in stale:
        op = graph.nodes[name]["op"]
        attrs = dict(op.attrs)
        attrs["class"] = classes[name]
        graph.nodes[name]["op"] = dataclasses.replace(op, attrs=tuple(sorted(attrs.items())))
    return dataclasses.replace(plan, graph=graph)


def with_spec_class_files(plan: Plan, spec: ModelSpec) -> Plan:
    """A saved plan (`train --plan`) of a flowrec of before 2026-12-06, whose custom modules name a
    relative `file.py` as written (`blocks.py:X`), for `spec`, whose class files are absolute
    (`flowrec.spec.class_paths.absolute_class_files`): where the plan's files, found in the working
    folder, are the spec's, the plan names the spec's paths and bears its fingerprint; any other plan
    is returned as it is (the contract's check says what differs)."""
    from flowrec.spec.class_paths import found_class_file

    if plan.spec_fingerprint == model_fingerprint(spec):
        return plan
    written = {n: d["op"].attr("class") for n, d in plan.graph.nodes(data=True) if d["op"].kind == "custom"}
    modules = []
    for module in spec.modules:
        path = written.get(module.name)
        if module.kind == "custom" and isinstance(path, str) and path != module.param("class") \
                and found_class_file(path) == module.param("class"):
            module = module.with_param("class", path)
        modules.append(module)
    if model_fingerprint(dataclasses.replace(spec, modules=tuple(modules))) != plan.spec_fingerprint:
        return plan
    return dataclasses.replace(with_class_files(plan, spec), spec_fingerprint=model_fingerprint(spec))
