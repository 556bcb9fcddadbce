"""The `shard` pass and the per-rank cost model: row-wise or replicated per group, bytes per rank,
exchange bytes against a hand count, idempotence, and refusals."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import jsonschema
import pytest

from flowrec.graph.build import build_graph
from flowrec.graph.plan_io import plan_document, plan_from_document, plan_json
from flowrec.graph.types import PassContext
from flowrec.planner import exchange
from flowrec.planner.contract import check_plan
from flowrec.planner.manager import make_plan
from flowrec.planner.passes.pack import pack
from flowrec.planner.passes.shard import shard
from flowrec.spec import load_spec
from flowrec.spec.schemas import load_schema

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def wide():
    return load_spec(REPO / "specs" / "wide_1000.yaml")


def test_wide_1000_on_64_h100s_has_bytes_per_rank_for_every_group(wide):
    plan = make_plan(wide, target="h100", world_size=64)
    doc = json.loads(plan_json(plan))
    jsonschema.validate(doc, load_schema("plan"))
    assert doc["world_size"] == 64 and doc["cost"]["world_size"] == 64
    for g in doc["groups"]:
        shards = 64 if g["sharding"] == "row_wise" else 1
        assert g["shards"] == shards
        assert g["bytes_per_rank"] == -(-g["rows"] // shards) * g["row_bytes"]
    shardings = {g["sharding"] for g in doc["groups"]}
    assert shardings == {"row_wise", "replicated"}  # the dim-1 group is tiny: replicated
    tiny = min(plan.meta.groups, key=lambda g: g.bytes)
    assert tiny.sharding == "replicated"
    note = next(n for n in next(p for p in plan.meta.passes if p.name == "shard").notes if n.startswith(tiny.name))
    assert "all-reduce cheaper" in note
    assert plan_json(plan_from_document(doc)) == plan_json(plan)
    assert check_plan(plan_from_document(doc), wide, world_size=64) == []
    assert "is for 64 rank(s) and this run has 1" in check_plan(plan, wide)[0]


def test_exchange_bytes_match_a_hand_count(repo: Path):
    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    plan = make_plan(spec, target="h100", world_size=8)
    (group,) = plan.meta.groups
    assert (group.sharding, group.shards) == ("row_wise", 8)
    sent = dict(plan.cost.group_exchange_bytes)[group.name]
    from flowrec.planner.cost import group_access

    per_rank = 4096 // 8
    distinct = group_access(group, None).distinct(per_rank * 26)
    by_hand = distinct * 7 / 8 * (8 + 16 * 4 + 16 * 4) + 8 * 8  # ids, fp32 rows, fp32 grads; counts
    assert sent == int(by_hand)
    dense = plan.cost.exchange_bytes_per_step - sent
    params = sum(plan.graph.nodes[n]["op"].param_bytes for n in plan.graph
                 if plan.graph.nodes[n]["op"].kind in ("mlp", "head", "linear", "cross", "packed_mlp"))
    assert dense == int(2 * 7 / 8 * params)
    one = make_plan(spec, target="h100")
    assert one.cost.exchange_bytes_per_step == 0 and one.cost.world_size == 1
    assert plan.cost.peak_memory_bytes < one.cost.peak_memory_bytes  # an eighth of the table per rank


def test_shard_pass_is_idempotent_and_honest(wide):
    ctx = PassContext(spec=wide, target="h100", world_size=16)
    packed = pack(build_graph(wide), ctx).graph
    first = shard(packed, ctx)
    assert first.modified
    again = shard(first.graph, ctx)
    assert not again.modified and again.graph.graph["plan"] == first.graph.graph["plan"]
    single = shard(packed, replace(ctx, world_size=1))
    assert not single.modified  # world size 1: the layout the pack pass made
    with pytest.raises(ValueError, match="at least 1"):
        shard(packed, replace(ctx, world_size=0))


def test_more_ranks_less_memory_and_link_changes_across_nodes(wide):
    mem = {w: make_plan(wide, target="h100", world_size=w).cost for w in (8, 64, 512)}
    assert mem[8].peak_memory_bytes > mem[64].peak_memory_bytes > mem[512].peak_memory_bytes
    assert exchange.link_for("h100", 8).gbps > exchange.link_for("h100", 64).gbps


def test_cache_placements_are_refused_for_sharded_groups(repo: Path):
    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    forced = replace(spec, plan=replace(spec.plan, cache="lookahead"))
    with pytest.raises(Exception, match="not yet supported for sharded groups"):
        make_plan(forced, target="h100", world_size=4, device_budget="256MiB")
    tight = make_plan(spec, target="h100", world_size=4, device_budget="256MiB")
    assert [g.placement for g in tight.meta.groups] == ["host"]  # a shard that does not fit: its host
    doc = plan_document(make_plan(spec, target="h100", world_size=4))
    doc["groups"][0].update(placement="static_hot", cache_rows=10)
    assert any("not yet supported for sharded groups" in p
               for p in check_plan(plan_from_document(doc), spec, world_size=4))


def test_a_model_without_tables_is_planned_for_the_world_size_asked():
    """A dense-only model has no packed groups: the shard pass returned before recording the
    world size, so `flowrec plan --world-size 3` made a plan for 1 rank that `--nproc 3` then
    refused ("the plan is for 1 rank(s) and this run has 3")."""
    from flowrec.spec import spec_from_dict

    spec = spec_from_dict({"name": "dense_only", "features": [{"name": "d", "type": "dense"}],
                           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense"], "layers": [2]}],
                           "heads": [{"name": "h", "input": "m"}]})
    for world in (1, 3):
        plan = make_plan(spec, target="cpu", world_size=world)
        assert plan.meta.world_size == plan.cost.world_size == world and plan.meta.groups == ()
        assert check_plan(plan_from_document(json.loads(plan_json(plan))), spec, world) == []
        ctx = PassContext(spec=spec, target="cpu", world_size=world)
        once = shard(pack(build_graph(spec), ctx).graph, ctx)
        assert once.modified == (world > 1) and not shard(once.graph, ctx).modified
