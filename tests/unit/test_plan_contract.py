"""The plan as a contract: JSON both ways for every spec, checks against the spec, pricing of
edited decisions, the scoring rule, and the tables every layer reads."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from flowrec.graph.kinds import OP_KINDS, OPTIMIZERS, PLACEMENTS
from flowrec.graph.plan_io import model_fingerprint, plan_document, plan_from_document, plan_json
from flowrec.planner.contract import PlanError, check_plan, load_plan, priced, scoring_plan
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec
from flowrec.spec.schemas import load_schema

REPO = Path(__file__).resolve().parents[2]
SPECS = sorted((REPO / "specs").glob("*.yaml"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.stem)
def test_plan_round_trips_through_json(path: Path):
    plan = make_plan(load_spec(path), target="h100", device_budget="1GiB")
    doc = json.loads(plan_json(plan))
    jsonschema.validate(doc, load_schema("plan"))
    back = plan_from_document(doc)
    assert plan_json(back) == plan_json(plan)
    assert back.meta == plan.meta and back.cost == plan.cost
    assert back.spec_fingerprint == plan.spec_fingerprint == model_fingerprint(load_spec(path))
    assert [back.graph.nodes[n]["op"] for n in back.graph] == [plan.graph.nodes[n]["op"] for n in plan.graph]
    assert sorted(back.graph.edges(data=True)) == sorted(plan.graph.edges(data=True))
    assert check_plan(back, load_spec(path)) == []


def test_plan_carries_its_pass_records_once(repo: Path):
    plan = make_plan(load_spec(repo / "specs" / "dlrm_criteo.yaml"))
    assert [p.name for p in plan.meta.passes] == ["pack", "shard", "cache", "interleave"]
    assert plan.graph.graph["plan"] is plan.meta  # one record: the graph carries it, meta reads it


def _edit(tmp_path: Path, spec_path: Path, change, **plan_kw) -> Path:
    doc = plan_document(make_plan(load_spec(spec_path), **plan_kw))
    change(doc)
    out = tmp_path / "edited.json"
    out.write_text(json.dumps(doc))
    return out


def test_edited_placement_is_checked_priced_and_recorded(repo: Path, tmp_path: Path):
    spec_path = repo / "specs" / "dlrm_criteo.yaml"
    spec = load_spec(spec_path)

    def to_host(doc):
        doc["groups"][0].update(placement="host", cache_rows=0)

    path = _edit(tmp_path, spec_path, to_host, device_budget="512MiB")
    plan = load_plan(path, spec)
    group = plan.meta.groups[0]
    assert (group.placement, group.cache_rows, group.expected_hit_rate) == ("host", 0, 0.0)
    edit = plan.meta.passes[-1]
    assert edit.name == "edit" and "placement host" in edit.notes[0] and "planner: static_hot" in edit.notes[0]
    planned = make_plan(spec, device_budget="512MiB")
    assert plan.cost.h2d_bytes_per_step > planned.cost.h2d_bytes_per_step  # every pooled row travels now
    assert priced(plan, spec).meta.passes == plan.meta.passes  # pricing twice adds nothing


@pytest.mark.parametrize("change,message", [
    (lambda d: d["groups"][0].update(placement="static_hot", cache_rows=0), "needs cache_rows between 1 and"),
    (lambda d: d["groups"][0].update(placement="host", cache_rows=5), "keeps no cache"),
    (lambda d: d["groups"][0].update(placement="gpu"), "'gpu' is not one of"),
    (lambda d: d.update(micro_batches=0), "micro_batches"),
    (lambda d: d.update(micro_batches=10**6), "between 1 and the batch size"),
    # an edited prefetch of 10**9 loaded (the spec caps it at 1024): the loader would stage every batch ahead
    (lambda d: d.update(prefetch=10**9), "prefetch"),
    (lambda d: d.update(group_order=["nope"]), "group_order must name every group once"),
    (lambda d: d["nodes"][-2]["attrs"].append(["extra", 1]), "differs from what the spec defines"),
    (lambda d: d["groups"][0]["tables"][0].update(rows=7), "differs from what the spec defines"),
    (lambda d: d.update(spec_fingerprint="sha256:0"), "different model"),
    (lambda d: d.update(stage="packed"), "only a full plan"),
    (lambda d: d.pop("nodes"), "'nodes' is a required property"),
    (lambda d: d.update(format="something"), "not a flowrec plan"),
])
def test_bad_plans_are_one_line(repo: Path, tmp_path: Path, change, message):
    spec_path = repo / "specs" / "dlrm_criteo.yaml"
    path = _edit(tmp_path, spec_path, change)
    with pytest.raises(PlanError) as err:
        load_plan(path, load_spec(spec_path))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("change,field", [
    (lambda d: d["groups"][0].update(rows=d["groups"][0]["rows"] // 2), "rows"),
    (lambda d: d["groups"][0].update(bytes=1), "bytes"),
    (lambda d: d["groups"][0].update(bytes_per_rank=1), "bytes_per_rank"),
    (lambda d: d["groups"][0]["features"][0].update(bags=[0, 5]), "bags"),
    (lambda d: d["stages"].update(dense=[]), "stages"),
    (lambda d: d["dense_packing"].append({"node": "x", "members": ["a", "b"], "layers": [4], "in_features": 1}),
     "dense_packing"),
    (lambda d: d["nodes"][-1].update(flops_per_sample=5), "flops_per_sample"),
    (lambda d: d["nodes"][-1].update(dtype="bf16"), "dtype"),
    (lambda d: d.update(tables=d["tables"][:3]), "tables"),
    (lambda d: d.update(features=[]), "features"),
    (lambda d: d["groups"][0].update(expected_hit_rate=0.5), "expected_hit_rate"),  # was recomputed without a word
])
def test_an_edit_the_plan_would_not_honour_is_refused_naming_the_field(repo: Path, tmp_path: Path, change, field):
    """A group's rows halved in plan.json loaded and trained with the rows the tables give, without
    a word; a field written from others (or a node's bytes, flops or dtype) is refused naming it
    and what can be edited."""
    spec_path = repo / "specs" / "dlrm_criteo.yaml"
    path = _edit(tmp_path, spec_path, change)
    with pytest.raises(PlanError) as err:
        load_plan(path, load_spec(spec_path))
    assert f" {field} " in str(err.value) and "cannot be edited" in str(err.value) or \
        f" {field} differs from what the spec defines" in str(err.value), str(err.value)
    assert "edit a group's placement, cache_rows" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("spec_name, plan_kw, change, world_size", [
    ("din_taobao", {}, lambda d: d["nodes"][3].update(stage="dense"), 1),  # `stages` still the planner's
    ("dlrm_criteo", {"world_size": 2}, lambda d: d["groups"][0].update(sharding="replicated", shards=1), 2),
])
def test_an_edit_that_is_read_may_leave_what_it_moves_as_the_planner_wrote_it(repo: Path, tmp_path: Path, spec_name,
                                                                             plan_kw, change, world_size):
    """A node's stage or a group's sharding edited alone leaves `stages` or `bytes_per_rank` as the
    planner wrote them: that is no edit of theirs, and the plan loads with the edit it made."""
    spec_path = repo / "specs" / f"{spec_name}.yaml"
    path = _edit(tmp_path, spec_path, change, **plan_kw)
    edited = json.loads(path.read_text())
    plan = load_plan(path, load_spec(spec_path), world_size=world_size)
    assert plan_document(plan)["nodes"][3]["stage"] == edited["nodes"][3]["stage"]
    assert (plan.meta.groups[0].sharding, plan.meta.groups[0].shards) == (edited["groups"][0]["sharding"],
                                                                          edited["groups"][0]["shards"])
    (edit,) = [p for p in plan.meta.passes if p.name == "edit"]  # the edit pass lists it (it listed nothing)
    assert len(edit.notes) == 1 and ("node " in edit.notes[0] or "sharding replicated" in edit.notes[0]), edit.notes



def test_a_static_hot_groups_hit_rate_is_checked_and_a_profiled_plans_is_taken_as_written(repo: Path, tmp_path: Path):
    """The cost model's hit rate of a static_hot group: as written it loads (and a placement edit
    leaves the planner's, stale, which loads too); edited it is refused. A plan priced from an
    access profile (not at hand when training) is not refused for the profile's rate."""
    from dataclasses import replace as swap

    spec_path = repo / "specs" / "dlrm_criteo.yaml"
    spec = load_spec(spec_path)
    spec = swap(spec, plan=swap(spec.plan, cache="static_hot"))
    planned = make_plan(spec, device_budget="512MiB")
    hot = [i for i, g in enumerate(planned.meta.groups) if g.placement == "static_hot"]
    assert hot and 0 < planned.meta.groups[hot[0]].expected_hit_rate < 1  # the case itself
    doc = plan_document(planned)
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert load_plan(tmp_path / "p.json", spec).meta.groups[hot[0]].expected_hit_rate == \
        planned.meta.groups[hot[0]].expected_hit_rate
    doc["groups"][hot[0]]["cache_rows"] //= 2  # a decision: the planner's rate goes stale, is recomputed
    (tmp_path / "p.json").write_text(json.dumps(doc))
    halved = load_plan(tmp_path / "p.json", spec).meta.groups[hot[0]].expected_hit_rate
    assert halved < planned.meta.groups[hot[0]].expected_hit_rate
    doc["groups"][hot[0]]["expected_hit_rate"] = 0.999
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="expected_hit_rate 0.999 is not the cost model's") as refused:
        load_plan(tmp_path / "p.json", spec)
    # the rate the line names runs the plan's decisions as written
    doc["groups"][hot[0]]["expected_hit_rate"] = float(str(refused.value).split("set it to ")[1].split(" ")[0])
    (tmp_path / "p.json").write_text(json.dumps(doc))
    assert load_plan(tmp_path / "p.json", spec).meta.groups[hot[0]].expected_hit_rate == halved
    flat = {"format": "flowrec-access-profile", "version": 1,
            "tables": {t.name: {"rows": t.rows, "accesses": t.rows, "distinct": t.rows,
                                "hot_cdf": [[t.rows, 1.0]]} for t in spec.tables}}
    profiled = plan_document(make_plan(spec, device_budget="512MiB", profile=flat))
    assert [g["expected_hit_rate"] for g in profiled["groups"]] != [g.expected_hit_rate for g in planned.meta.groups]
    (tmp_path / "p.json").write_text(json.dumps(profiled))
    assert load_plan(tmp_path / "p.json", spec).meta.groups  # loads: the profile's rate is its own


def test_a_plan_another_flowrec_wrote_loads_with_this_flowrecs_figures(repo: Path, tmp_path: Path):
    """A static_hot plan whose hit rate a flowrec of another cost model predicted was refused as an
    edit ('it is a prediction and cannot be edited'), as plan.json recorded no writer: the user
    lost their decisions to a replan. Now a plan records its writer's version; one of another
    flowrec (or none recorded) loads with this flowrec's figures (hit rates, FLOPs), its decisions
    as written and a pass record saying so, and only what keeps it from running is refused."""
    from dataclasses import replace as swap

    from flowrec.graph.plan_io import WRITER
    from flowrec.planner.contract import other_writer
    from flowrec.version import __version__

    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    spec = swap(spec, plan=swap(spec.plan, cache="static_hot"))
    planned = make_plan(spec, device_budget="512MiB")
    doc = plan_document(planned)
    assert doc[WRITER] == __version__
    hot = next(i for i, g in enumerate(planned.meta.groups) if g.placement == "static_hot")
    rate = planned.meta.groups[hot].expected_hit_rate
    doc["groups"][hot]["cache_rows"] //= 2  # the user's decision
    doc["groups"][hot]["expected_hit_rate"] = 0.5  # that flowrec's model
    node = next(i for i, n in enumerate(doc["nodes"]) if n["flops_per_sample"] > 0)
    flops = doc["nodes"][node]["flops_per_sample"]
    doc["nodes"][node]["flops_per_sample"] = flops * 2 + 1
    for writer in ("0.0.1", None):
        older = {k: v for k, v in doc.items() if k != WRITER} | ({WRITER: writer} if writer else {})
        (tmp_path / "p.json").write_text(json.dumps(older))
        plan = load_plan(tmp_path / "p.json", spec)
        group = plan.meta.groups[hot]
        assert group.cache_rows == doc["groups"][hot]["cache_rows"] and 0 < group.expected_hit_rate < rate
        assert plan.graph.nodes[doc["nodes"][node]["name"]]["op"].flops == flops
        line = other_writer(plan)
        assert line is not None and (writer or "before plans recorded") in line and __version__ in line
        assert WRITER not in older or plan_document(plan)[WRITER] == __version__
    (tmp_path / "p.json").write_text(json.dumps(doc))  # this flowrec's own plan: an edited figure is refused
    with pytest.raises(PlanError, match="flops_per_sample differs"):
        load_plan(tmp_path / "p.json", spec)
    doc["nodes"][node]["flops_per_sample"] = flops
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="expected_hit_rate 0.5 is not the cost model's"):
        load_plan(tmp_path / "p.json", spec)
    (tmp_path / "p.json").write_text(json.dumps({**doc, WRITER: "9.0", "shards_by_rank": {}}))  # a newer flowrec's
    with pytest.raises(PlanError, match=r"shards_by_rank.*; it was written by flowrec 9\.0, this is flowrec "):
        load_plan(tmp_path / "p.json", spec)
    older = {k: v for k, v in doc.items() if k != WRITER}
    older["nodes"][node]["attrs"] = [["changed", 1]]  # another model: refused, naming the node
    (tmp_path / "p.json").write_text(json.dumps(older))
    with pytest.raises(PlanError, match=f"node {doc['nodes'][node]['name']}: attrs differs"):
        load_plan(tmp_path / "p.json", spec)


def test_unreadable_plan_files_are_one_line(repo: Path, tmp_path: Path):
    spec = load_spec(repo / "specs" / "movielens.yaml")
    for name, content in (("empty.json", b""), ("latin.json", b"\xff\xfe{"), ("list.json", b"[1, 2]"),
                          ("deep.json", b"[" * 100_000 + b"]" * 100_000), ("nan.json", b'{"format": NaN}')):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(PlanError):
            load_plan(tmp_path / name, spec)
    with pytest.raises(PlanError, match="cannot read"):
        load_plan(tmp_path / "missing.json", spec)
    with pytest.raises(PlanError, match="is a folder, not a plan file"):
        load_plan(tmp_path, spec)  # a folder


def test_a_plan_or_profile_saved_with_a_byte_order_mark_is_read(repo: Path, tmp_path: Path):
    """A plan edited in an editor that saves a UTF-8 byte-order mark (as the guide asks a user to edit
    one) was 'not JSON (line 1, column 1: Unexpected UTF-8 BOM (decode using utf-8-sig))', where a
    spec with one is read; so was an access profile."""
    from flowrec.planner.manager import load_profile

    spec = load_spec(repo / "specs" / "movielens.yaml")
    planned = make_plan(spec)
    (tmp_path / "p.json").write_bytes(b"\xef\xbb\xbf" + plan_json(planned).encode())
    assert load_plan(tmp_path / "p.json", spec).meta.groups == planned.meta.groups
    flat = {"format": "flowrec-access-profile", "version": 1,
            "tables": {t.name: {"rows": t.rows, "accesses": t.rows, "distinct": t.rows,
                                "hot_cdf": [[t.rows, 1.0]]} for t in spec.tables}}
    (tmp_path / "prof.json").write_bytes(b"\xef\xbb\xbf" + json.dumps(flat).encode())
    assert set(load_profile(tmp_path / "prof.json", spec)["tables"]) == {t.name for t in spec.tables}


def test_scoring_reads_cache_placements_from_the_host(repo: Path):
    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    plan = make_plan(spec, device_budget="512MiB")
    assert plan.meta.groups[0].placement == "static_hot"
    scored = scoring_plan(plan)
    assert scored.meta.groups[0].placement == "host" and scored.meta.passes[-1].name == "score"
    assert plan.meta.groups[0].placement == "static_hot"  # the trained plan is unchanged
    device = make_plan(spec)
    assert scoring_plan(device) is device


def test_cpu_without_budget_keeps_every_table_resident(repo: Path):
    spec = load_spec(repo / "specs" / "wide_1000.yaml")
    huge = replace(spec, tables=tuple(replace(t, rows=t.rows * 8) for t in spec.tables))
    plan = make_plan(huge, target="cpu")
    assert all(g.placement == "device" for g in plan.meta.groups)
    cache = next(p for p in plan.meta.passes if p.name == "cache")
    assert any("host memory is the device" in n for n in cache.notes)
    budgeted = make_plan(huge, target="cpu", device_budget="4GiB")
    assert any(g.placement != "device" for g in budgeted.meta.groups)


def test_tables_agree_with_schemas_registry_and_runtime():
    from operators import registry
    from flowrec.runtime.caches import CACHE_MODULES

    assert set(registry.known()) == set(OP_KINDS)
    assert set(CACHE_MODULES) == {n for n, p in PLACEMENTS.items() if p.rows_on == "host"}
    plan_schema = load_schema("plan")
    assert plan_schema["$defs"]["node"]["properties"]["kind"]["enum"] == list(OP_KINDS)
    assert plan_schema["$defs"]["group"]["properties"]["placement"]["enum"] == list(PLACEMENTS)
    spec_schema = load_schema("model-spec")["$defs"]
    assert set(spec_schema["sparse_optimizer"]["properties"]["name"]["enum"]) == \
        {n for n, o in OPTIMIZERS.items() if o.sparse}
    assert set(spec_schema["dense_optimizer"]["properties"]["name"]["enum"]) == {n for n, o in OPTIMIZERS.items() if o.dense}


def test_a_plan_the_planner_makes_from_any_plan_hint_loads_back(repo: Path, tmp_path: Path):
    """`plan.prefetch: 0` (0 .. 1024 in the spec) planned prefetch 0 and training ran it, but `flowrec
    train --plan` refused the planner's own plan ("prefetch must be at least 1"); so did a
    micro-batch hint above the batch size (capped by the planner now)."""
    from flowrec.spec import spec_from_dict
    from flowrec.spec.read import read_document

    doc = read_document(repo / "specs" / "movielens.yaml")
    doc.pop("data")
    for hint in ({"prefetch": 0}, {"prefetch": 1024}, {"micro_batches": 4096}):
        spec = spec_from_dict({**doc, "training": {**doc["training"], "batch_size": 8}, "plan": hint})
        path = tmp_path / "p.json"
        path.write_text(plan_json(make_plan(spec, target="cpu")))
        assert load_plan(path, spec).meta.prefetch == hint.get("prefetch", 2)


def test_a_plan_priced_from_a_profile_is_priced_from_it_again_by_train(repo: Path, tmp_path: Path):
    """`flowrec plan --profile P --json p.json` then `flowrec train --plan p.json` (which refuses
    --profile beside --plan) priced the plan again by the Zipf model: its step time and transfers
    differed from what plan printed (206.8 ms where plan said 229.7 for dlrm_criteo). Now the plan
    records the profile (its path and digest) and train prices it from that file; a file gone or
    changed since is one line saying so, and --profile is taken when it is that file."""
    from dataclasses import replace as swap

    from flowrec.planner.manager import load_profile
    from flowrec.runs.errors import RunError
    from flowrec.runs.plan import plan_for_run

    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    spec = swap(spec, plan=swap(spec.plan, cache="static_hot"))
    flat = {"format": "flowrec-access-profile", "version": 1,
            "tables": {t.name: {"rows": t.rows, "accesses": t.rows, "distinct": t.rows,
                                "hot_cdf": [[t.rows, 1.0]]} for t in spec.tables}}
    profile = tmp_path / "prof.json"
    profile.write_text(json.dumps(flat))
    planned = make_plan(spec, device_budget="512MiB", profile=load_profile(profile, spec), target="cpu")
    (tmp_path / "p.json").write_text(plan_json(planned))
    assert make_plan(spec, device_budget="512MiB", target="cpu").cost != planned.cost  # the case itself
    for given in (None, profile):
        plan, _ = plan_for_run(spec, "cpu", None, tmp_path / "p.json", profile=given)
        assert plan.cost == planned.cost
    other = tmp_path / "other.json"
    other.write_text(json.dumps(flat) + "\n")
    with pytest.raises(RunError, match="--profile and --plan both decide placements"):
        plan_for_run(spec, "cpu", None, tmp_path / "p.json", profile=other)
    profile.write_text(json.dumps(flat) + " ")
    with pytest.raises(RunError, match=r"was priced from the access profile .*prof\.json, whose bytes changed"):
        plan_for_run(spec, "cpu", None, tmp_path / "p.json")
    moved = tmp_path / "moved.json"  # the profile's bytes in another file: taken with --profile
    moved.write_text(json.dumps(flat))
    assert plan_for_run(spec, "cpu", None, tmp_path / "p.json", profile=moved)[0].cost.step_ms_serial == \
        planned.cost.step_ms_serial
    profile.unlink()
    with pytest.raises(RunError, match=r"prof\.json, which is gone; give that profile with --profile FILE"):
        plan_for_run(spec, "cpu", None, tmp_path / "p.json")


def test_a_plan_priced_for_another_device_says_so_when_train_loads_it(repo: Path, tmp_path: Path):
    """`flowrec plan --target h100 --json p.json` then `flowrec train --plan p.json` on CPU gave no
    word that the plan's figures are an H100's (only --report's 'predictions for target h100'). Now
    one status line says so; the plan is still trained (its placements), and a cpu plan says nothing."""
    from flowrec.runs.plan import plan_for_run

    spec = load_spec(repo / "specs" / "movielens.yaml")
    for target in ("h100", "cpu"):
        (tmp_path / f"{target}.json").write_text(plan_json(make_plan(spec, target=target)))
        said: list[str] = []
        plan, device = plan_for_run(spec, "cpu", None, tmp_path / f"{target}.json", said.append)
        assert plan.target == target and device.type == "cpu"
        warned = [line for line in said if "figures" in line]
        assert len(warned) == (target == "h100")
        assert all("for target h100, not this run's cpu device (target cpu)" in line for line in warned)


@pytest.mark.parametrize("target", ["", "nope"])
def test_a_plan_of_an_empty_or_unknown_target_is_one_line(repo: Path, tmp_path: Path, target: str):
    """A plan whose target was edited to "" was planned against the spec's default target (an empty
    name reads as none) and then priced for "": `flowrec train --plan` ended in a ValueError
    traceback (unknown target ''). Now the target is checked first: one PlanError line."""
    spec = load_spec(repo / "specs" / "movielens.yaml")
    doc = plan_document(make_plan(spec, target="cpu"))
    doc["target"] = target
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match=f"p.json: .*unknown target {target!r}"):
        load_plan(tmp_path / "p.json", spec)


def test_a_plan_whose_version_is_text_says_it_must_be_an_integer(repo: Path, tmp_path: Path):
    """A plan.json with "version": "1" said 'not a valid flowrec plan: version: 1 was expected',
    which reads as a contradiction; now the line says the version must be an integer."""
    spec = load_spec(repo / "specs" / "movielens.yaml")
    doc = plan_document(make_plan(spec, target="cpu"))
    doc["version"] = "1"
    (tmp_path / "p.json").write_text(json.dumps(doc))
    with pytest.raises(PlanError, match="plan format version must be an integer, not the text '1'"):
        load_plan(tmp_path / "p.json", spec)
