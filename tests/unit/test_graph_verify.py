"""The verifier finds every broken invariant, all at once; `check` raises with them."""
from __future__ import annotations

from dataclasses import replace

import pytest

from flowrec.graph.build import build_graph
from flowrec.graph.edges import Slot, input_slots, set_inputs
from flowrec.graph.types import Op
from flowrec.graph.verify import GraphError, check, verify
from flowrec.testing.specs import tiny_spec


@pytest.fixture
def graph():
    return build_graph(tiny_spec())


def test_sound_graph(graph):
    assert verify(graph) == []
    check(graph)


def test_cycle(graph):
    graph.add_edge("loss", "input_dense", port=0, slots=(Slot(0, "loss", (), ()),), fields=())
    assert any(p.startswith("cycle") for p in verify(graph))


def test_wrong_out_shape(graph):
    op = graph.nodes["bot"]["op"]
    graph.nodes["bot"]["op"] = replace(op, out_shape=("B", 5))
    problems = verify(graph)
    assert any("bot (mlp): out_shape" in p for p in problems)
    assert any("bot -> " in p and "shape (4,) != (5,)" in p for p in problems)


def test_unknown_kind_and_missing_record(graph):
    graph.nodes["bot"]["op"] = replace(graph.nodes["bot"]["op"], kind="bogus")
    graph.add_node("stray")
    problems = verify(graph)
    assert any("unknown op kind 'bogus'" in p for p in problems)
    assert "stray: no Op record" in problems


def test_unused_feature_and_unreached_node(graph):
    slots = [s for s in input_slots(graph, "inter") if s.source != "pool_b"]
    set_inputs(graph, "inter", slots)
    problems = verify(graph)
    assert "pool_b: does not reach the loss" in problems
    assert any(p.startswith("inter (dot): out_shape") for p in problems)  # one field fewer


def test_dense_column_never_consumed(graph):
    set_inputs(graph, "bot", [Slot(0, "input_dense", ("d1",), (1,))])
    problems = verify(graph)
    assert "feature d2: never consumed" in problems


def test_table_owned_twice(graph):
    op = graph.nodes["lookup_q"]["op"]
    attrs = tuple((k, True if k == "owns_table" else v) for k, v in op.attrs)
    graph.nodes["lookup_q"]["op"] = replace(op, attrs=attrs)
    assert any(p.startswith("table shared: owned by 2") for p in verify(graph))


def test_check_raises_with_all_problems(graph):
    graph.nodes["bot"]["op"] = replace(graph.nodes["bot"]["op"], out_shape=("B", 5))
    graph.add_node("orphan", op=Op("orphan", "concat", ("B", 0)))
    with pytest.raises(GraphError) as err:
        check(graph)
    assert len(err.value.problems) >= 3
    assert "orphan: does not reach the loss" in err.value.problems
