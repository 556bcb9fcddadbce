"""The pack pass: expected packed graph, invariants, purity, idempotence, honest flag."""
from __future__ import annotations

import copy
import pickle
import random

import pytest

from flowrec.graph.build import build_graph
from flowrec.graph.edges import input_slots
from flowrec.graph.types import PassContext
from flowrec.graph.verify import verify
from flowrec.planner.passes.pack import pack
from flowrec.spec.load import spec_from_dict
from flowrec.testing.specs import TINY, tiny_spec, wide_spec


def snapshot(g):
    return pickle.dumps((list(g.nodes(data=True)), list(g.edges(data=True)), dict(g.graph)))


def run(spec, **ctx):
    g = build_graph(spec)
    before = snapshot(g)
    result = pack(g, PassContext(spec=spec, **ctx))
    assert snapshot(g) == before, "pack mutated its input"
    assert result.graph is not g
    assert verify(result.graph) == []
    return result


def kinds(g):
    return sorted(g.nodes[n]["op"].kind for n in g)


def test_expected_packed_graph():
    r = run(tiny_spec())
    g = r.graph
    assert r.modified
    assert "embedding_lookup" not in kinds(g) and "pooling" not in kinds(g)
    groups = g.graph["plan"].groups
    assert [gr.name for gr in groups] == ["g0_d1", "g1_d4"]
    assert [f.feature for f in groups[1].fields] == ["a", "b", "c", "hist", "q"]
    emb = g.nodes["emb_g1_d4"]["op"]
    assert emb.out_shape == ("B", 1 + 1 + 1 + 5 + 1, 4)  # S = bags per sample
    assert emb.attr("rows") == 10 + 20 + 31
    # the pooled fields a, b, c merge into one (3, D) slot; target attention keeps its roles
    inter = input_slots(g, "inter")
    assert [(s.source, s.fields, s.shape) for s in inter] == [
        ("bot", (), (4,)), ("emb_g1_d4", ("a", "b", "c"), (3, 4)), ("att", (), (4,))]
    att = input_slots(g, "att")
    assert [(s.port, s.fields, s.shape) for s in att] == [(0, ("q",), (4,)), (1, ("hist",), (5, 4))]
    assert g.edges["emb_g1_d4", "att"]["fields"] == ("q", "hist")
    assert g.nodes["inter"]["op"].out_shape == ("B", 10)  # unchanged semantics


def test_two_towers_pack_into_one_mlp():
    g = run(tiny_spec()).graph
    packed = [n for n in g if g.nodes[n]["op"].kind == "packed_mlp"]
    assert packed == ["packed_t1_x2"]
    op = g.nodes["packed_t1_x2"]["op"]
    assert op.attr("members") == ("t1", "t2") and op.out_shape == ("B", 2, 4)
    assert "t1" not in g and "t2" not in g
    assert [(s.source, s.fields) for s in input_slots(g, "head_h2")] == [("packed_t1_x2", ("t2",))]
    assert [(s.source, s.fields) for s in input_slots(g, "final")][0] == ("packed_t1_x2", ("t1",))


def test_dependent_mlps_do_not_pack():
    doc = copy.deepcopy(TINY)
    doc["modules"][5]["layers"] = [8]  # t1: 8 -> 8
    doc["modules"][6]["inputs"] = ["t1"]  # t2: 8 -> 8, but depends on t1
    doc["modules"][6]["layers"] = [8]
    g = build_graph(spec_from_dict(doc))
    assert g.nodes["t1"]["op"].attr("in_features") == g.nodes["t2"]["op"].attr("in_features") == 8
    g = run(spec_from_dict(doc)).graph
    assert "packed_mlp" not in kinds(g)


def test_idempotent():
    spec = tiny_spec()
    first = run(spec)
    second = pack(first.graph, PassContext(spec=spec))
    assert not second.modified
    assert snapshot(second.graph) == snapshot(first.graph)


def test_packing_off_one_group_per_table():
    r = run(tiny_spec(packing=False))
    groups = r.graph.graph["plan"].groups
    assert sorted(len(gr.tables) for gr in groups) == [1, 1, 1, 1]
    assert sum(1 for n in r.graph if r.graph.nodes[n]["op"].kind == "packed_embedding") == 4
    assert "packed_mlp" not in kinds(r.graph)


@pytest.mark.parametrize("seed", [0, 1])
def test_pack_invariants_wide(seed):
    spec = wide_spec(300, seed)
    g = run(spec).graph
    groups = g.graph["plan"].groups
    keys = {(t.dim, spec.table_optimizer(t).name) for t in spec.tables}
    assert len(groups) <= len(keys)
    seen = [f.feature for gr in groups for f in gr.fields]
    assert sorted(seen) == sorted(f.name for f in spec.sparse_features)  # every field exactly once
    for gr in groups:
        offset = 0
        for slot in gr.tables:  # contiguous and disjoint row ranges
            assert slot.row_offset == offset
            offset += slot.rows
        assert offset == gr.rows == g.nodes[f"emb_{gr.name}"]["op"].attr("rows")
        assert len({(t.dim, t.dtype) for t in spec.tables if t.name in {s.table for s in gr.tables}}) == 1
    assert not pack(g, PassContext(spec=spec)).modified
