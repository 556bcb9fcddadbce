"""The interleave pass: stages for every op, micro-batches, prefetch, group order; purity."""
from __future__ import annotations

import pickle
from dataclasses import replace

from flowrec.graph.build import build_graph
from flowrec.graph.types import STAGES, PassContext
from flowrec.graph.verify import verify
from flowrec.planner.cost import DEVICES, predict
from flowrec.planner.manager import make_plan
from flowrec.planner.passes.cache import cache, table_budget
from flowrec.planner.passes.interleave import MICRO_BATCH_CHOICES, interleave
from flowrec.planner.passes.pack import pack
from flowrec.spec import load_spec, spec_from_dict
from flowrec.testing.specs import tiny_spec


def prepared(spec, target="cpu", budget=None):
    ctx = PassContext(spec=spec, target=target, device_budget_bytes=budget)
    g = pack(build_graph(spec), ctx).graph
    return cache(g, ctx).graph, ctx


def run(spec, target="cpu", budget=None):
    g, ctx = prepared(spec, target, budget)
    before = pickle.dumps((list(g.nodes(data=True)), dict(g.graph)))
    r = interleave(g, ctx)
    assert pickle.dumps((list(g.nodes(data=True)), dict(g.graph))) == before
    assert verify(r.graph) == []
    again = interleave(r.graph, ctx)
    assert not again.modified and again.graph is r.graph
    return r


def test_every_op_gets_a_stage():
    r = run(tiny_spec())
    assert r.modified
    g = r.graph
    stages = {n: g.nodes[n]["op"].stage for n in g}
    assert set(stages.values()) <= set(STAGES) and None not in stages.values()
    assert stages["input_dense"] == "staging" and stages["ids_g1_d4"] == "transfer"
    assert stages["emb_g1_d4"] == "sparse" and stages["inter"] == "dense" and stages["loss"] == "backward"


def test_micro_batches_cpu_hint_and_auto():
    assert run(tiny_spec()).graph.graph["plan"].micro_batches == 1  # cpu: nothing to overlap
    assert run(tiny_spec(micro_batches=4)).graph.graph["plan"].micro_batches == 4
    meta = run(tiny_spec(prefetch=5), target="h100").graph.graph["plan"]
    assert meta.micro_batches in MICRO_BATCH_CHOICES and meta.prefetch == 5


def test_a_micro_batch_hint_above_the_batch_size_is_capped_and_the_plan_runs():
    """`plan.micro_batches: 4096` at batch 2: the plan said 4096 micro-batches and priced 4096
    dense passes (and 0 B of activations) while training splits the batch into 2, and `flowrec
    train --plan` refused the planner's own plan ("micro_batches must be between 1 and the batch
    size")."""
    from flowrec.planner.contract import check_plan
    from flowrec.testing.specs import TINY

    doc = {**TINY, "training": {"batch_size": 2}, "plan": {"micro_batches": 4096}}
    spec = spec_from_dict(doc)
    meta = run(spec).graph.graph["plan"]
    assert meta.micro_batches == 2
    for world in (1, 3):
        plan = make_plan(spec, target="cpu", world_size=world)
        assert plan.meta.micro_batches == 2 and check_plan(plan, spec, world) == []
        assert plan.cost.micro_batches == 2 and dict(plan.cost.memory)["activations"] > 0
    assert run(spec_from_dict({**doc, "plan": {"micro_batches": 2}})).graph.graph["plan"].micro_batches == 2


def test_a_retrieval_model_plans_the_one_micro_batch_it_trains_in(repo):
    """Training runs a retrieval head's softmax over the whole batch, in one micro-batch
    (`flowrec.runtime.step`), whatever the plan says: the plan chose 8 on h100 for a large batch
    and priced a step 8x shorter than training's, and took a hint of 2 as is."""
    import yaml

    doc = yaml.safe_load((repo / "specs" / "two_tower_movielens.yaml").read_text())
    doc.pop("data")
    doc["training"]["batch_size"] = 65536
    for target, hint in (("h100", "auto"), ("cpu", 2), ("a100", 4)):
        spec = spec_from_dict({**doc, "plan": {"micro_batches": hint}})
        plan = make_plan(spec, target=target)
        assert plan.meta.micro_batches == 1 and plan.cost.micro_batches == 1, (target, hint)
    plain = {**doc, "heads": [{"name": "ctr", "input": "score"}], "plan": {"micro_batches": 2}}
    assert make_plan(spec_from_dict(plain), target="cpu").meta.micro_batches == 2  # other heads keep the hint


def test_group_order_puts_host_traffic_first():
    spec = tiny_spec(cache="none")
    g, _ = prepared(spec, "h100")
    groups = g.graph["plan"].groups
    large, small = max(groups, key=lambda x: x.bytes), min(groups, key=lambda x: x.bytes)
    roomy = run(spec, "h100").graph.graph["plan"]
    assert roomy.group_order == (large.name, small.name)  # all on device: largest first
    tight = run(spec, "h100", budget=_fixed(spec) + large.bytes + small.bytes - 1).graph.graph["plan"]
    placements = {x.name: x.placement for x in tight.groups}
    assert placements == {large.name: "host", small.name: "device"}
    assert tight.group_order[0] == large.name


def _fixed(spec):
    g, ctx = prepared(spec, "h100")
    return 10**15 - table_budget(g, replace(ctx, device_budget_bytes=10**15))


def test_auto_micro_batches_when_sparse_work_is_heavy(repo):
    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    spec = replace(spec, plan=replace(spec.plan, cache="none"))
    plan = make_plan(spec, target="a100", device_budget="1GiB")
    assert plan.meta.groups[0].placement == "host"
    assert plan.meta.micro_batches > 1
    single = predict(plan.graph, spec, DEVICES["a100"], micro_batches=1)
    assert plan.cost.step_ms_overlap < single.step_ms_overlap
    roomy = make_plan(replace(spec, plan=replace(spec.plan, cache="auto")), target="a100")
    assert roomy.meta.micro_batches == 1  # staging-bound: splitting the batch buys nothing
