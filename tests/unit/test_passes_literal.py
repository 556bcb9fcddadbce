"""Each pass on a small literal graph: the before-graph and the expected after-graph written out
node by node (kind and input slots), plus the decisions the pass records."""
from __future__ import annotations

from dataclasses import replace

from flowrec.graph.build import build_graph
from flowrec.graph.edges import input_slots
from flowrec.graph.types import PassContext
from flowrec.planner.passes.cache import cache
from flowrec.planner.passes.interleave import interleave
from flowrec.planner.passes.pack import pack
from flowrec.spec.load import spec_from_dict

SPEC = spec_from_dict({
    "name": "literal",
    "features": [{"name": "x", "type": "dense"},
                 {"name": "u", "type": "categorical", "hash_buckets": 100, "dim": 4},
                 {"name": "i", "type": "categorical", "hash_buckets": 50, "dim": 4},
                 {"name": "c", "type": "categorical", "vocab": 10, "dim": 2}],
    "modules": [{"name": "tower_a", "kind": "mlp", "inputs": ["@dense", "u"], "layers": [8]},
                {"name": "tower_b", "kind": "mlp", "inputs": ["@dense", "i"], "layers": [8]},
                {"name": "top", "kind": "concat", "inputs": ["tower_a", "tower_b", "c"]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.1}},
    "training": {"batch_size": 64},
})

BUILT = {
    "input_dense": ("dense_input", ()),
    "input_labels": ("label_input", ()),
    "ids_u": ("sparse_input", ()),
    "lookup_u": ("embedding_lookup", (("ids_u", ()),)),
    "pool_u": ("pooling", (("lookup_u", ()),)),
    "ids_i": ("sparse_input", ()),
    "lookup_i": ("embedding_lookup", (("ids_i", ()),)),
    "pool_i": ("pooling", (("lookup_i", ()),)),
    "ids_c": ("sparse_input", ()),
    "lookup_c": ("embedding_lookup", (("ids_c", ()),)),
    "pool_c": ("pooling", (("lookup_c", ()),)),
    "tower_a": ("mlp", (("input_dense", ("x",)), ("pool_u", ()))),
    "tower_b": ("mlp", (("input_dense", ("x",)), ("pool_i", ()))),
    "top": ("concat", (("tower_a", ()), ("tower_b", ()), ("pool_c", ()))),
    "head_ctr": ("head", (("top", ()),)),
    "loss": ("loss", (("head_ctr", ()), ("input_labels", ()))),
}

PACKED = {  # u and i share (dim 4, fp32, rowwise_adagrad): one packed table; the towers: one packed MLP
    "input_dense": ("dense_input", ()),
    "input_labels": ("label_input", ()),
    "ids_g0_d2": ("sparse_input", ()),
    "emb_g0_d2": ("packed_embedding", (("ids_g0_d2", ()),)),
    "ids_g1_d4": ("sparse_input", ()),
    "emb_g1_d4": ("packed_embedding", (("ids_g1_d4", ()),)),
    "packed_tower_a_x2": ("packed_mlp", (("input_dense", ("x",)), ("emb_g1_d4", ("u",)),
                                         ("input_dense", ("x",)), ("emb_g1_d4", ("i",)))),
    "top": ("concat", (("packed_tower_a_x2", ("tower_a",)), ("packed_tower_a_x2", ("tower_b",)),
                       ("emb_g0_d2", ("c",)))),
    "head_ctr": ("head", (("top", ()),)),
    "loss": ("loss", (("head_ctr", ()), ("input_labels", ()))),
}

STAGES = {"input_dense": "staging", "input_labels": "staging", "ids_g0_d2": "transfer", "ids_g1_d4": "transfer",
          "emb_g0_d2": "sparse", "emb_g1_d4": "sparse", "packed_tower_a_x2": "dense", "top": "dense",
          "head_ctr": "dense", "loss": "backward"}


def literal(graph) -> dict:
    return {n: (graph.nodes[n]["op"].kind, tuple((s.source, s.fields) for s in input_slots(graph, n)))
            for n in graph}


def ctx(**kw) -> PassContext:
    return PassContext(spec=SPEC, **kw)


def test_build_gives_the_literal_graph():
    assert literal(build_graph(SPEC)) == BUILT


def test_pack_literal():
    result = pack(build_graph(SPEC), ctx())
    assert result.modified and literal(result.graph) == PACKED
    groups = {g.name: [(t.table, t.rows, t.row_offset) for t in g.tables] for g in result.graph.graph["plan"].groups}
    assert groups == {"g0_d2": [("c", 11, 0)], "g1_d4": [("u", 100, 0), ("i", 50, 100)]}


def test_cache_literal_places_under_the_budget():
    packed = pack(build_graph(SPEC), ctx()).graph
    roomy = cache(packed, ctx(target="h100"))
    assert literal(roomy.graph) == PACKED  # placements only: the graph's nodes do not change
    assert [(g.name, g.placement) for g in roomy.graph.graph["plan"].groups] == [("g0_d2", "device"),
                                                                                 ("g1_d4", "device")]
    tight = cache(packed, ctx(target="h100", device_budget_bytes=1))  # no room: every group on the host
    assert [(g.name, g.placement, g.cache_rows) for g in tight.graph.graph["plan"].groups] == [
        ("g0_d2", "host", 0), ("g1_d4", "host", 0)]
    assert any("no device rows left" in n or "-> host" in n for n in tight.notes)


def test_interleave_literal_assigns_stages_and_order():
    packed = pack(build_graph(SPEC), ctx()).graph
    placed = cache(packed, ctx(target="h100")).graph
    result = interleave(placed, ctx(target="h100"))
    assert literal(result.graph) == PACKED
    assert {n: result.graph.nodes[n]["op"].stage for n in result.graph} == STAGES
    meta = result.graph.graph["plan"]
    assert meta.group_order == ("g1_d4", "g0_d2") and meta.micro_batches == 1  # 64 samples: nothing to split
    host = placed.copy()
    host.graph["plan"] = replace(meta, groups=tuple(replace(g, placement="host") if g.name == "g0_d2" else g
                                                    for g in placed.graph["plan"].groups))
    assert interleave(host, ctx(target="h100")).graph.graph["plan"].group_order == ("g0_d2", "g1_d4")
