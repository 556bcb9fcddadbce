"""DOT and SVG rendering: well-formed, deterministic, stages and packed groups visible."""
from __future__ import annotations

import xml.etree.ElementTree as ET

from flowrec.graph.build import build_graph
from flowrec.graph.render import MAX_PER_LAYER, layout, to_dot, to_svg
from flowrec.planner.manager import make_plan
from test_graph_build import tiny_spec
from test_planner_pack import wide_spec

SVG = "{http://www.w3.org/2000/svg}"


def test_dot_clusters_and_packed_highlight():
    plan = make_plan(tiny_spec())
    dot = to_dot(plan.graph)
    assert dot.startswith('digraph "tiny" {') and dot.endswith("}\n")
    for stage in ("staging", "transfer", "sparse", "dense", "backward"):
        assert f'subgraph "cluster_{stage}"' in dot
    assert '"emb_g1_d4" [label="g1_d4: 5 fields, 3 tables"' in dot and "penwidth=2" in dot
    assert '"emb_g1_d4" -> "inter" [label="3 fields"];' in dot
    assert dot == to_dot(make_plan(tiny_spec()).graph)


def test_dot_before_stages_has_no_clusters():
    dot = to_dot(build_graph(tiny_spec()))
    assert "cluster_" not in dot and '"lookup_a" -> "pool_a";' in dot


def test_svg_is_xml_with_every_node_or_summary():
    plan = make_plan(tiny_spec())
    root = ET.fromstring(to_svg(plan.graph))
    texts = [t.text for t in root.iter(f"{SVG}text")]
    assert len(texts) == len(plan.graph)
    assert "g1_d4: 5 fields, 3 tables" in texts
    assert len(list(root.iter(f"{SVG}line"))) == plan.graph.number_of_edges()


def test_wide_layers_are_summarised():
    g = build_graph(wide_spec(40))
    boxes, edges, width, height = layout(g)
    assert len(boxes) < len(g)
    assert any(b.text.startswith("+") for b in boxes)
    assert max(b.x for b in boxes) < (MAX_PER_LAYER + 1) * 220
    ET.fromstring(to_svg(g))
