"""build_graph: nodes, shapes, selectors, table ownership, determinism (tiny literal specs)."""
from __future__ import annotations

import copy
from typing import Any

import pytest

from flowrec.graph.build import build_graph
from flowrec.graph.edges import input_shapes, input_slots
from flowrec.graph.kinds import OP_KINDS
from flowrec.graph.verify import verify
from flowrec.spec.load import spec_from_dict
from flowrec.spec.model import ModelSpec
from flowrec.testing.specs import TINY, tiny_spec

def test_nodes_and_shapes():
    g = build_graph(tiny_spec())
    assert set(g.graph["features"]) == {f["name"] for f in TINY["features"]}
    assert {g.nodes[n]["op"].kind for n in g} <= set(OP_KINDS)
    assert g.nodes["lookup_hist"]["op"].out_shape == ("B", 5, 4)
    assert "pool_hist" not in g  # pooling none feeds target attention directly
    assert g.nodes["pool_c"]["op"].out_shape == ("B", 4)
    assert g.nodes["pool_c"]["op"].attr("mode") == "mean"
    assert g.nodes["att"]["op"].out_shape == ("B", 4)
    # dot over bot + a, b, c + att = 5 fields of dim 4 -> 10 pairs
    assert g.nodes["inter"]["op"].attr("num_fields") == 5
    assert g.nodes["inter"]["op"].out_shape == ("B", 10)
    assert g.nodes["top"]["op"].attr("in_features") == 14
    assert g.nodes["final"]["op"].out_shape == ("B", 5)
    assert g.nodes["loss"]["op"].out_shape == ("B",)
    assert verify(g) == []


def test_selectors_resolve_to_ordered_slots():
    g = build_graph(tiny_spec())
    slots = input_slots(g, "inter")
    assert [s.source for s in slots] == ["bot", "pool_a", "pool_b", "pool_c", "att"]
    assert [s.port for s in slots] == [0, 1, 2, 3, 4]
    wide = input_slots(g, "wide")
    assert [(s.source, s.fields) for s in wide] == [("pool_w", ()), ("input_dense", ("d1",))]
    assert input_shapes(g, "bot") == [(2,)]
    assert g.edges["input_dense", "bot"]["fields"] == ("d1", "d2")
    att = input_slots(g, "att")
    assert [(s.source, s.shape) for s in att] == [("pool_q", (4,)), ("lookup_hist", (5, 4))]



def test_a_tag_selector_gives_its_dense_features_first_as_one_field_then_sparse_ones_in_spec_order():
    """docs/spec.md: `@<tag>` is the tagged dense features concatenated into one field, then the
    tagged sparse features in spec order (what a hand-written model must concatenate)."""
    spec = spec_from_dict({
        "name": "tags",
        "features": [{"name": "s1", "type": "categorical", "vocab": 5, "dim": 2, "tags": ["x"]},
                     {"name": "d1", "type": "dense", "tags": ["x"]},
                     {"name": "s2", "type": "categorical", "vocab": 5, "dim": 2, "tags": ["x"]},
                     {"name": "d2", "type": "dense"},
                     {"name": "d3", "type": "dense", "tags": ["x"]}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@x", "d2"], "layers": [2]}],
        "heads": [{"name": "h", "input": "m"}],
    })
    g = build_graph(spec)
    assert [(s.source, s.fields) for s in input_slots(g, "m")] == [
        ("input_dense", ("d1", "d3")), ("pool_s1", ()), ("pool_s2", ()), ("input_dense", ("d2",))]

def test_table_bytes_counted_once_per_table():
    g = build_graph(tiny_spec())
    owners = [n for n in g if g.nodes[n]["op"].kind == "embedding_lookup" and g.nodes[n]["op"].attr("owns_table")]
    assert sorted(owners) == ["lookup_a", "lookup_b", "lookup_c", "lookup_w"]
    assert g.nodes["lookup_c"]["op"].param_bytes == 31 * 4 * 4  # vocab 30 + missing row, dim 4, fp32
    assert g.nodes["lookup_q"]["op"].param_bytes == 0
    assert g.nodes["lookup_q"]["op"].attr("table") == "shared"


def test_flops_and_params_of_mlp():
    op = build_graph(tiny_spec()).nodes["bot"]["op"]
    assert op.flops == 2 * (2 * 8 + 8 * 4)
    assert op.param_bytes == 4 * ((2 * 8 + 8) + (8 * 4 + 4))


def test_deterministic():
    a, b = build_graph(tiny_spec()), build_graph(tiny_spec())
    assert list(a.nodes(data=True)) == list(b.nodes(data=True))
    assert list(a.edges(data=True)) == list(b.edges(data=True))


def test_unknown_input_raises():
    doc = copy.deepcopy(TINY)
    doc["modules"][0]["inputs"] = ["nope"]
    with pytest.raises(ValueError, match="nope"):
        build_graph(spec_from_dict(doc))


def test_dlrm_example(repo):
    from flowrec.spec import load_spec

    g = build_graph(load_spec(repo / "specs" / "dlrm_criteo.yaml"))
    assert g.nodes["interaction"]["op"].out_shape == ("B", 27 * 26 // 2)
    assert sum(1 for n in g if g.nodes[n]["op"].kind == "embedding_lookup") == 26
    assert verify(g) == []
