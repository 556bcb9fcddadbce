"""The plan as a contract: load a saved (possibly hand-edited) plan, check it against its spec,
price its decisions, and the planner's rule for scoring a trained plan.

A user saves a plan (`flowrec plan SPEC --json p.json`), edits decisions — a group's `placement`
or `cache_rows`, `micro_batches`, `prefetch`, `group_order`, node stages — and trains exactly that
(`flowrec train SPEC --plan p.json`). What may not change is the model: the nodes, their kinds,
attributes and inputs, and the packed groups' tables and fields must be those the planner makes
from the spec; a plan for another spec is refused.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.graph.plan_io import plan_document
    >>> from flowrec.planner.manager import PassFailure, make_plan
    >>> spec = load_spec("specs/movielens.yaml")
    >>> check_plan(plan_from_document(plan_document(make_plan(spec))), spec)
    []
"""
from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

from flowrec.graph.edges import input_slots
from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.plan_io import (NOT_RECORDED, PLAN_VERSION, WRITER, model_fingerprint, plan_document,
                                   plan_from_document, with_spec_class_files)
from flowrec.graph.types import ACCESS_NONE, STAGES, Op, PackedGroup, PassRecord, Plan
from flowrec.planner.cost import access_description, device_profile, predict
from flowrec.planner.manager import GIVEN_AS, PassFailure, make_plan
from flowrec.planner.passes.cache import expected_hit_rate
from flowrec.spec.json_doc import version_problem
from flowrec.spec.json_scan import scan_json
from flowrec.spec.model import DRY_RUN_KINDS, MEASURED_PARAMS, ModelSpec
from flowrec.spec.schemas import PLAN_SCHEMA, load_schema
from flowrec.version import __version__

MAX_PLAN_BYTES = 256 * 2**20  # a plan of 1,000 fields is under 1 MiB
MAX_PLAN_DEPTH = 32  # a plan nests 6 levels deep
GROUP_DECISIONS = ("placement", "cache_rows", "expected_hit_rate", "sharding", "shards")  # editable per group
GROUP_DERIVED = ("rows", "row_bytes", "bytes", "bags_per_sample", "bytes_per_rank")  # written from its tables
NODE_FIELDS = {"flops": "flops_per_sample"}  # an Op field's name in the plan document, where it differs
NODE_FIGURES = ("flops", "param_bytes", "out_bytes")  # a node's figures, which another flowrec may count otherwise
OTHER_WRITER = "version"  # the pass record of a plan another flowrec wrote (`load_plan`)
EDITABLE = ("a group's placement, cache_rows, sharding and shards, micro_batches, prefetch, group_order and "
            "a node's stage")


class PlanError(ValueError):
    """A plan file that cannot be read, or a plan that does not fit its spec (one line)."""


def read_plan_document(path: Path) -> dict[str, Any]:
    """A plan document from a file, validated against schemas/plan.schema.json.

    Raises:
        PlanError: unreadable, not JSON, not a flowrec plan, or schema errors (the first few).
    """
    if Path(path).is_dir():  # a run folder or a model package holds its plan as plan.json
        inner = Path(path) / "plan.json"
        raise PlanError(f"{path} is a folder, not a plan file: "
                        + (f"give the plan it holds, {inner}" if inner.is_file()
                           else "give the output of `flowrec plan SPEC --json FILE`"))
    try:
        size = Path(path).stat().st_size
        if size > MAX_PLAN_BYTES:
            raise PlanError(f"{path}: {size:,} bytes is too large for a plan (at most {MAX_PLAN_BYTES:,})")
        text = Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark allowed, as in a spec (an editor's)
    except OSError as exc:  # its strerror, as every other file's line: not "(FileNotFoundError: [Errno 2] ...)"
        raise PlanError(f"{path}: cannot read the plan: {exc.strerror or exc}") from None
    except UnicodeDecodeError:
        raise PlanError(f"{path}: not UTF-8 text; not a plan") from None
    scan = scan_json(text, MAX_PLAN_DEPTH)
    if scan.too_deep is not None:
        raise PlanError(f"{path}: line {scan.too_deep}: nested deeper than {MAX_PLAN_DEPTH} levels; not a plan")
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlanError(f"{path}: not JSON (line {exc.lineno}, column {exc.colno}: {exc.msg})") from None
    if scan.problems:
        raise PlanError(f"{path}: {scan.problems[0]}")
    return check_plan_document(doc, str(path))


def check_plan_document(doc: Any, where: str) -> dict[str, Any]:
    """`doc` if it is a plan document of this version, else a PlanError naming the first problems."""
    if not isinstance(doc, dict) or doc.get("format") != "flowrec-plan":
        raise PlanError(f"{where}: not a flowrec plan (expected the output of `flowrec plan SPEC --json`)")
    if problem := version_problem(doc.get("version"), PLAN_VERSION):  # the schema said "version: 1 was
        raise PlanError(f"{where}: plan format {problem}; plan again")  # expected" of "1"
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(load_schema(PLAN_SCHEMA)).iter_errors(doc), key=lambda e: list(e.absolute_path))
    if errors:
        shown = "; ".join(f"{'.'.join(map(str, e.absolute_path)) or '(top)'}: {e.message}" for e in errors[:3])
        more = f" (and {len(errors) - 3} more)" if len(errors) > 3 else ""
        writer = doc.get(WRITER)
        other = (f"; it was written by flowrec {writer:.40}, this is flowrec {__version__}: plan again with this one"
                 if isinstance(writer, str) and writer != __version__ else "")
        raise PlanError(f"{where}: not a valid flowrec plan: {shown}{more}{other}")
    return doc


def _structure(plan: Plan) -> dict[str, Any]:
    """What the spec determines: nodes (every field but the stage: kinds, attributes, shapes, dtype,
    bytes and flops) and their inputs; group layouts; the names of its tables and features."""
    g = plan.graph
    nodes = {n: {**{f.name: getattr(g.nodes[n]["op"], f.name) for f in fields(Op) if f.name != "stage"},
                 "inputs": tuple(input_slots(g, n))} for n in g}
    groups = {x.name: replace(x, **{k: PackedGroup.__dataclass_fields__[k].default for k in GROUP_DECISIONS})
              for x in plan.meta.groups}
    return {"nodes": nodes, "groups": groups, "tables": tuple(g.graph.get("tables", ())),
            "features": tuple(g.graph.get("features", ()))}


def _first_difference(mine: dict[str, Any], reference: dict[str, Any], what: str) -> str | None:
    if set(mine) != set(reference):
        extra = sorted(set(mine) - set(reference))
        missing = sorted(set(reference) - set(mine))
        parts = ([f"unknown {what} {', '.join(extra[:3])}"] if extra else []) + \
                ([f"missing {what} {', '.join(missing[:3])}"] if missing else [])
        return "; ".join(parts)
    for name in reference:
        if mine[name] != reference[name]:
            if isinstance(mine[name], dict):  # a node: name the field
                key = next(k for k in reference[name] if mine[name][k] != reference[name][k])
                return (f"{what} {name}: {NODE_FIELDS.get(key, key)} differs from what the spec defines "
                        f"(edit {EDITABLE})")
            return f"{what} {name} differs from what the spec defines"
    return None


def derived_edits(doc: dict[str, Any], plan: Plan, own: Plan, profile: dict[str, Any] | None = None) -> list[str]:
    """Edits of what a plan document writes from its other fields and never reads back: a group's
    rows, bytes and bags (from its tables and features), its `expected_hit_rate` (the cost model's
    prediction for its placement and cache rows), `stages` (from the nodes' stage) and
    `dense_packing` (from the nodes). An edited group's `rows` (or hit rate) was recomputed without
    a word, so the plan that ran was not the plan the user wrote; such an edit is refused, naming
    the field and what can be edited (`EDITABLE`). A value the planner wrote (`own`'s) is no edit:
    it went stale with an edit that is read (a group's sharding moves its bytes_per_rank, its
    placement its hit rate, a node's stage the `stages` lists). A static_hot group's hit rate in a
    plan priced from an access profile (`flowrec plan --profile`), which is not at hand here, is
    taken as written."""
    again, planned = plan_document(plan), plan_document(own)
    owned = {g["name"]: g for g in planned["groups"]}
    profiled = plan.cost is not None and plan.cost.access_profile not in (ACCESS_NONE, NOT_RECORDED)
    for mine, ours, group in zip(doc["groups"], again["groups"], plan.meta.groups):
        theirs = owned.get(ours["name"], ours)
        for key in GROUP_DERIVED:
            if mine[key] not in (ours[key], theirs[key]):
                return [f"group {ours['name']}: {key} {mine[key]!r} is not what its tables give ({ours[key]!r}); "
                        f"{', '.join(GROUP_DERIVED)} follow from the spec and cannot be edited (edit {EDITABLE})"]
        info = PLACEMENTS.get(group.placement)
        rate = expected_hit_rate(group, profile) if info is not None else None
        by_profile = profiled and info is not None and info.cached and info.traffic != "window" \
            and info.rows_on != "device"  # the profile's hit rate (`expected_hit_rate`)
        if rate is not None and not by_profile and mine["expected_hit_rate"] not in (rate, theirs["expected_hit_rate"]):
            return [f"group {ours['name']}: expected_hit_rate {mine['expected_hit_rate']!r} is not the cost "
                    f"model's for its placement {group.placement} and {group.cache_rows:,} cache rows ({rate!r}); "
                    f"it is a prediction and cannot be edited (edit {EDITABLE}): set it to {rate!r} to run the "
                    "plan's decisions as written, or plan again"]
        for field, given, wrote in zip(mine["features"], ours["features"], theirs["features"]):
            if field["bags"] not in (given["bags"], wrote["bags"]):
                return [f"group {ours['name']}: feature {given['feature']}: bags {field['bags']!r} are not what the "
                        f"group's features give ({given['bags']!r}) and cannot be edited (edit {EDITABLE})"]
    stages = [{s: sorted(m) for s, m in d["stages"].items()} for d in (doc, again, planned)]
    if stages[0] not in stages[1:]:
        return [f"stages does not list the nodes by their stage; it is written from the nodes and cannot be "
                f"edited (edit {EDITABLE})"]
    if doc["dense_packing"] not in (again["dense_packing"], planned["dense_packing"]):
        return [f"dense_packing is written from the nodes and cannot be edited (edit {EDITABLE})"]
    return []


def planner_plan(plan: Plan, spec: ModelSpec, profile: dict[str, Any] | None = None) -> Plan:
    """The planner's own plan for `plan`'s target, budget and world size (what an edit is compared with)."""
    return make_plan(spec, target=plan.target, device_budget=plan.device_budget_bytes, profile=profile,
                     world_size=plan.meta.world_size)


def check_plan(plan: Plan, spec: ModelSpec, world_size: int = 1, own: Plan | None = None) -> list[str]:
    """Problems that keep `plan` from running with `spec` on `world_size` ranks (empty when it can run).

    The model must be the spec's (fingerprint and structure); decisions must be runnable:
    known placements, cache rows within the group for cache placements, a valid schedule.
    """
    if plan.spec_fingerprint != model_fingerprint(spec):
        return [f"the plan was made for spec {plan.spec_name!r} with a different model (features, tables, "
                f"modules, heads, optimizers, batch size or precision differ from {spec.name!r}); "
                f"plan again with `flowrec plan SPEC --json`"]
    problems = []
    if plan.meta.world_size != world_size:
        problems.append(f"the plan is for {plan.meta.world_size} rank(s) and this run has {world_size}; plan "
                        f"again with --world-size {world_size}")
    if plan.stage != "interleaved":
        problems.append(f"the plan stops at stage {plan.stage!r}; only a full plan (stage interleaved) can run")
    reference = _structure(own if own is not None else planner_plan(plan, spec))
    mine = _structure(plan)
    for what in ("nodes", "groups"):
        diff = _first_difference(mine[what], reference[what], what[:-1])
        if diff:
            problems.append(diff)
    problems += [f"{key} differs from what the spec defines (its {key}' names, in order; edit {EDITABLE})"
                 for key in ("tables", "features") if mine[key] != reference[key]]
    problems += _decision_problems(plan, spec)
    return problems


def _decision_problems(plan: Plan, spec: ModelSpec) -> list[str]:
    meta, out = plan.meta, []
    for g in meta.groups:
        info = PLACEMENTS.get(g.placement)
        if info is None:
            out.append(f"group {g.name}: unknown placement {g.placement!r} (known: {', '.join(PLACEMENTS)})")
        elif info.cached and not 1 <= g.cache_rows <= g.rows:
            out.append(f"group {g.name}: placement {g.placement} needs cache_rows between 1 and {g.rows:,}, "
                       f"not {g.cache_rows:,}")
        elif not info.cached and g.cache_rows != 0:
            out.append(f"group {g.name}: placement {g.placement} keeps no cache; cache_rows must be 0")
        if (g.sharding, g.shards) not in (("row_wise", meta.world_size), ("replicated", 1)) and \
                not (meta.world_size == 1 and g.shards == 1):
            out.append(f"group {g.name}: sharding {g.sharding} over {g.shards} shard(s) does not fit world size "
                       f"{meta.world_size} (row_wise: shards = world size; replicated: 1)")
        if meta.world_size > 1 and info is not None and info.cached:
            out.append(f"group {g.name}: cache placement {g.placement} is not yet supported for sharded groups")
    if not 1 <= meta.micro_batches <= spec.training.batch_size:
        out.append(f"micro_batches must be between 1 and the batch size {spec.training.batch_size}")
    if meta.prefetch < 0:  # 0 .. 1024 as in the spec's plan.prefetch (the transfer queue holds at least one)
        out.append("prefetch must be at least 0")
    if meta.group_order and sorted(meta.group_order) != sorted(g.name for g in meta.groups):
        out.append("group_order must name every group once")
    bad = [n for n in plan.graph if plan.graph.nodes[n]["op"].stage not in STAGES]
    if bad:
        out.append(f"node {bad[0]}: stage must be one of {', '.join(STAGES)}")
    return out


def priced(plan: Plan, spec: ModelSpec, profile: dict[str, Any] | None = None, own: Plan | None = None) -> Plan:
    """`plan` with the cost model's prediction for its own decisions, and a pass record that lists
    where they differ from the planner's (`own`, made here when not given; an edited plan says what
    was edited)."""
    own = own if own is not None else planner_plan(plan, spec, profile)
    notes = [f"group {g.name}: placement {g.placement}, {g.cache_rows:,} cache rows (planner: {o.placement}, "
             f"{o.cache_rows:,})" for g, o in zip(plan.meta.groups, own.meta.groups)
             if (g.placement, g.cache_rows) != (o.placement, o.cache_rows)]
    notes += [f"group {g.name}: sharding {g.sharding} over {g.shards} shard(s) (planner: {o.sharding} over "
              f"{o.shards})" for g, o in zip(plan.meta.groups, own.meta.groups)
              if (g.sharding, g.shards) != (o.sharding, o.shards)]
    for key in ("micro_batches", "prefetch", "group_order"):
        if getattr(plan.meta, key) != getattr(own.meta, key):
            notes.append(f"{key} {getattr(plan.meta, key)} (planner: {getattr(own.meta, key)})")
    stage = {n: own.graph.nodes[n]["op"].stage for n in own.graph}
    notes += [f"node {n}: stage {plan.graph.nodes[n]['op'].stage} (planner: {stage[n]})" for n in plan.graph
              if n in stage and plan.graph.nodes[n]["op"].stage != stage[n]]
    groups = tuple(replace(g, expected_hit_rate=expected_hit_rate(g, profile)) for g in plan.meta.groups)
    meta = replace(plan.meta, groups=groups)
    if notes and not any(p.name == "edit" for p in meta.passes):
        meta = replace(meta, passes=meta.passes + (PassRecord("edit", True, tuple(notes)),))
    edited = plan.with_meta(meta)
    cost = predict(edited.graph, spec, device_profile(plan.target), micro_batches=meta.micro_batches,
                   profile=profile, access=access_description(profile, (profile or {}).get(GIVEN_AS)))
    return replace(edited, cost=cost)


def load_plan(path: Path, spec: ModelSpec, profile: dict[str, Any] | None = None, world_size: int = 1) -> Plan:
    """The plan in `path`, checked against `spec` and `world_size` and priced. Raises PlanError (one line).

    A plan another flowrec wrote (its `flowrec_version` another, or none: written before plans
    recorded it) is checked for what makes it usable: its model (nodes, their kinds, attributes,
    shapes and inputs, the groups' tables and fields) must be the spec's and its decisions
    runnable. What it derived or predicted (a group's rows, bytes and expected_hit_rate, the
    nodes' FLOPs and bytes, `stages`) is this flowrec's, not refused as an edit: that flowrec's
    models may differ. A pass record (`OTHER_WRITER`) says so, and `flowrec train` shows it."""
    doc = read_plan_document(path)
    plan = with_spec_class_files(plan_from_document(doc), spec)  # an older plan's relative class files
    try:  # the plan is priced for its target: one the planner would take for the default ('' included)
        device_profile(plan.target)
    except ValueError as exc:
        raise PlanError(f"{path}: target: {exc}") from None
    own = None
    if plan.spec_fingerprint == model_fingerprint(spec):  # planned once, for the check and the pricing
        try:
            own = planner_plan(plan, spec, profile)
        except (ValueError, PassFailure) as exc:
            raise PlanError(f"{path}: the planner cannot plan this spec for the plan's target and budget: "
                            f"{exc}") from None
    if own is not None:
        plan = _with_measured(plan, own)
    writer = doc.get(WRITER)
    other = writer != __version__
    if other and own is not None:
        plan = _with_own_figures(plan, own, writer)
    elif not other and other_writer(plan) is not None:  # this flowrec's plan of one another wrote: it is this one's now
        plan = plan.with_meta(replace(plan.meta, passes=tuple(p for p in plan.meta.passes if p.name != OTHER_WRITER)))
    problems = check_plan(plan, spec, world_size, own) or ([] if other else derived_edits(doc, plan, own, profile))
    if problems:
        raise PlanError(f"{path}: " + "; ".join(problems))
    return priced(plan, spec, profile, own)


def _with_measured(plan: Plan, own: Plan) -> Plan:
    """`plan` with the planner's node of each custom module whose plan was made without what the
    dry run measures of its memory (`MEASURED_PARAMS`: a plan saved by a flowrec of before
    2026-12-06) and is otherwise the planner's node: those measurements and the figures that
    follow from them (`param_bytes`) are no edit."""
    graph = None
    for name in plan.graph:
        op, ours = plan.graph.nodes[name]["op"], own.graph.nodes[name]["op"] if name in own.graph else None
        if ours is None or op.kind not in DRY_RUN_KINDS or any(k in dict(op.attrs) for k in MEASURED_PARAMS):
            continue
        unmeasured = tuple((k, v) for k, v in ours.attrs if k not in MEASURED_PARAMS)
        if replace(ours, attrs=unmeasured, **{f: getattr(op, f) for f in NODE_FIGURES}, stage=op.stage) == op:
            graph = plan.graph.copy() if graph is None else graph
            graph.nodes[name]["op"] = replace(ours, stage=op.stage)
    return plan if graph is None else replace(plan, graph=graph)


def other_writer(plan: Plan) -> str | None:
    """The line of `load_plan`'s pass record of a plan another flowrec wrote, or None."""
    return next((p.notes[0] for p in plan.meta.passes if p.name == OTHER_WRITER and p.notes), None)


def _with_own_figures(plan: Plan, own: Plan, writer: Any) -> Plan:
    """`plan` (written by the flowrec of version `writer`) with this flowrec's figures of each node
    whose model is the planner's (its kind, attributes, shapes, dtype and inputs), and a pass record
    saying so; a node of another model is left as written, for `check_plan` to name."""
    graph = plan.graph.copy()
    for name in graph:
        if name not in own.graph:
            continue
        op, ours = graph.nodes[name]["op"], own.graph.nodes[name]["op"]
        same = all(getattr(op, f.name) == getattr(ours, f.name) for f in fields(Op)
                   if f.name not in (*NODE_FIGURES, "stage"))
        if same and input_slots(plan.graph, name) == input_slots(own.graph, name):
            graph.nodes[name]["op"] = replace(op, **{f: getattr(ours, f) for f in NODE_FIGURES})
    who = f"flowrec {writer}" if isinstance(writer, str) else "a flowrec before plans recorded their writer"
    note = (f"written by {who}, not this flowrec {__version__}: its decisions are used as written, its "
            "figures (rows, bytes, expected hit rates, FLOPs, stages) are this flowrec's")
    meta = plan.meta
    meta = replace(meta, passes=tuple(p for p in meta.passes if p.name != OTHER_WRITER)
                   + (PassRecord(OTHER_WRITER, True, (note,)),))
    graph.graph["plan"] = meta
    return replace(plan, graph=graph)


def scoring_plan(plan: Plan) -> Plan:
    """The plan a trained model is scored and exported with: the same model and layout, with every
    cache placement (a training-time schedule of row movement) read from its host master table."""
    groups = tuple(replace(g, placement="host", cache_rows=0, expected_hit_rate=0.0)
                   if PLACEMENTS[g.placement].trains_only else g for g in plan.meta.groups)
    if groups == plan.meta.groups:
        return plan
    notes = tuple(f"group {g.name}: {g.placement} -> host for scoring" for g in plan.meta.groups
                  if PLACEMENTS[g.placement].trains_only)
    meta = replace(plan.meta, groups=groups, passes=plan.meta.passes + (PassRecord("score", True, notes),))
    return plan.with_meta(meta)


def resharded(plan: Plan, spec: ModelSpec, world_size: int) -> Plan:
    """`plan` for another number of ranks: the `shard` pass run again on its groups (every other
    decision kept), priced, with a `reshard` pass record saying from which world size. This is how
    a run saved on W ranks continues on W' (its rows are mapped by the modulo rule on loading).

    Raises:
        PlanError: the plan cannot run on `world_size` ranks (e.g. a cache placement on several).
    """
    from flowrec.graph.types import PassContext
    from flowrec.planner.passes.shard import shard

    before = plan.meta.world_size
    ctx = PassContext(spec=spec, target=plan.target, device_budget_bytes=plan.device_budget_bytes,
                      world_size=world_size)
    graph = shard(plan.graph, ctx).graph
    meta = graph.graph["plan"]
    record = PassRecord("reshard", True, (f"{before} rank(s); now sharded for {world_size}",))
    problems = [p for p in _decision_problems(plan.with_meta(meta), spec) if "not yet supported" in p]
    if problems:
        raise PlanError(f"the run's plan cannot continue on {world_size} ranks: {problems[0]}")
    moved = plan.with_meta(replace(meta, passes=meta.passes + (record,)))
    cost = predict(moved.graph, spec, device_profile(plan.target), micro_batches=meta.micro_batches)
    return replace(moved, cost=cost)
