"""Pass manager and make_plan: stages, verification, failure reports; plans of every spec in specs/."""
from __future__ import annotations

import json

import jsonschema
import pytest

from flowrec.graph.build import build_graph
from flowrec.graph.types import PassContext, PassResult
from flowrec.graph.verify import verify
from flowrec.planner.manager import PIPELINE, STAGES, PassFailure, PassManager, load_profile, make_plan
from flowrec.graph.plan_io import plan_document, plan_json
from flowrec.planner.report import text_report
from flowrec.spec import load_spec
from flowrec.testing.specs import tiny_spec


def test_run_until_each_stage():
    spec = tiny_spec()
    for i, stage in enumerate(STAGES):
        plan = make_plan(spec, until=stage, verify_passes=True)
        assert plan.stage == stage
        assert [p.name for p in plan.meta.passes] == [name for name, _, _ in PIPELINE[:i]]
    with pytest.raises(ValueError, match="unknown stage"):
        make_plan(spec, until="lowered")


def test_failing_pass_is_named_with_history():
    def broken(graph, ctx):
        g = graph.copy()
        g.remove_node("loss")
        return PassResult(g, True)

    def raising(graph, ctx):
        raise RuntimeError("boom")

    spec = tiny_spec()
    ctx = PassContext(spec=spec)
    manager = PassManager(pipeline=PIPELINE[:1] + (("broken", "broken", broken),), verify=True)
    with pytest.raises(PassFailure) as err:
        manager.run_until(build_graph(spec), ctx, "broken")
    assert err.value.name == "broken" and err.value.done == ("pack",) and "no loss node" in str(err.value)
    manager = PassManager(pipeline=PIPELINE[:2] + (("raising", "raising", raising),))
    with pytest.raises(PassFailure, match=r"pass 'raising' failed \(passes before it: pack, shard\): "
                                          r"RuntimeError: boom"):
        manager.run_until(build_graph(spec), ctx, "raising")


def spec_files(repo):
    return sorted((repo / "specs").glob("*.yaml"))


def test_every_spec_plans_validates_and_is_deterministic(repo):
    schema = json.loads((repo / "schemas" / "plan.schema.json").read_text())
    validator = jsonschema.Draft202012Validator(schema)
    assert spec_files(repo)
    for path in spec_files(repo):
        spec = load_spec(path)
        plan = make_plan(spec, verify_passes=True)
        assert verify(plan.graph) == []
        validator.validate(plan_document(plan))
        assert plan_json(plan) == plan_json(make_plan(load_spec(path)))
        assert text_report(plan)[0].startswith(f"plan {spec.name}")


def test_wide_1000_groups(repo):
    path = repo / "specs" / "wide_1000.yaml"
    if not path.exists():
        pytest.skip("specs/wide_1000.yaml not in the tree")
    spec = load_spec(path)
    plan = make_plan(spec)
    keys = {(t.dim, spec.table_optimizer(t).name) for t in spec.tables}
    assert len(plan.meta.groups) <= len(keys)
    assert sum(len(g.fields) for g in plan.meta.groups) == len(spec.sparse_features)


def test_plan_with_profile_and_budget(tmp_path):
    spec = tiny_spec()
    profile = {"format": "flowrec-access-profile", "version": 1,
               "tables": {"shared": {"rows": 31, "accesses": 100, "distinct": 20, "hot_cdf": [[3, 0.9]]}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    plan = make_plan(spec, profile=load_profile(path), device_budget="1GiB", target="a100")
    assert plan.device_budget_bytes == 2**30
    assert plan.cost.access_profile.startswith(f"given {path}")
    path.write_text(json.dumps({"format": "other"}))
    with pytest.raises(ValueError, match="flowrec-access-profile"):
        load_profile(path)
    with pytest.raises(TypeError, match="load_profile"):  # planning reads no files
        make_plan(spec, profile=path)


def test_a_profile_of_another_spec_is_refused_naming_both(tmp_path):
    """A profile counting none of the spec's tables (written for another spec) planned with every
    table priced by the Zipf model while the plan said 'access profile: given FILE'; now one line.
    A profile counting some of them is read (the others are priced by the Zipf model, as before)."""
    spec = tiny_spec()
    doc = {"format": "flowrec-access-profile", "version": 1, "spec": "criteo",
           "tables": {"C1": {"rows": 31, "accesses": 100, "distinct": 20, "hot_cdf": [[3, 0.9]]}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    assert load_profile(path)["tables"].keys() == {"C1"}  # without a spec: read as before
    with pytest.raises(ValueError) as err:
        load_profile(path, spec)
    assert "(of spec 'criteo') counts none of the tables of spec" in str(err.value) and "shared" in str(err.value)
    assert str(path) in str(err.value) and "\n" not in str(err.value)
    doc["tables"]["shared"] = doc["tables"].pop("C1")
    path.write_text(json.dumps(doc))
    assert make_plan(spec, profile=load_profile(path, spec)).cost.access_profile.startswith(f"given {path}")


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["tables"]["shared"].__setitem__("unseen", []), "unseen must be an object"),
    (lambda d: d["tables"]["shared"].__setitem__("unseen", {"share": "x", "rows": 3}), "unseen.share"),
    (lambda d: d["tables"]["shared"].__setitem__("unseen", {"share": float("nan"), "rows": 3}),
     "NaN is not a JSON number"),  # refused as the file is read, on its line
    (lambda d: d["tables"]["shared"].__setitem__("unseen", {"share": 0.2, "rows": -5}), "unseen.rows"),
    (lambda d: d["tables"]["shared"].__setitem__("hit_cdf", 5), "hit_cdf"),
    (lambda d: d["tables"]["shared"].__setitem__("hot_cdf", [[3, 1.7]]), "hot_cdf"),
    (lambda d: d["tables"]["shared"].__setitem__("accesses", True), "accesses"),
    (lambda d: d.__setitem__("tables", []), "tables must be an object"),
    (lambda d: d.__setitem__("samples", "x"), "samples"),
    (lambda d: d.__setitem__("sample_rate", 0), "sample_rate"),
])
def test_a_profile_with_bad_figures_is_refused_naming_the_field(tmp_path, edit, field):
    doc = {"format": "flowrec-access-profile", "version": 1, "samples": 50, "sample_rate": 0.5,
           "tables": {"shared": {"rows": 31, "accesses": 100, "distinct": 20, "hot_cdf": [[3, 0.9], [20, 1.0]],
                                 "hit_cdf": [[3, 0.8], [20, 0.9]], "unseen": {"share": 0.1, "rows": 5.0}}}}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(doc))
    assert load_profile(path)["tables"]["shared"]["unseen"]["share"] == 0.1  # the good one is read
    edit(doc)
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match=field) as err:
        load_profile(path)
    assert str(path) in str(err.value) and "flowrec data profile" in str(err.value)
