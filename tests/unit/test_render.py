"""DOT and SVG rendering: well-formed, deterministic, stages and packed groups visible, edges routed
around boxes (a geometry check on the layout of every spec in specs/)."""
from __future__ import annotations

import sys
import xml.etree.ElementTree as ET

import pytest

from flowrec.graph.build import build_graph
from flowrec.render.drawing import GAP_X, MAX_BOX_W, MAX_PER_LAYER, Box, Layout, layout, to_dot, to_png, to_svg
from flowrec.planner.manager import make_plan
from flowrec.spec.load import load_spec
from flowrec.testing.processes import run_bounded
from flowrec.testing.specs import tiny_spec
from flowrec.testing.specs import wide_spec

SVG = "{http://www.w3.org/2000/svg}"


def node_texts(root: ET.Element) -> list[str | None]:
    """First text line of every box (title and legend texts excluded)."""
    return [t.text for g in root.iter(f"{SVG}g") if g.get("class") == "node" for t in g.iter(f"{SVG}text")]


def spec_paths(repo):
    paths = sorted((repo / "specs").glob("*.yaml"))
    assert paths
    return paths


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
    texts = node_texts(root)
    assert len(texts) == len(plan.graph)
    assert "g1_d4: 5 fields, 3 tables" in texts
    edges = [p for p in root.iter(f"{SVG}path") if p.get("class") == "edge"]
    assert len(edges) == plan.graph.number_of_edges()
    assert all(p.get("marker-end") == "url(#arrow)" for p in edges)


def test_wide_layers_are_summarised():
    g = build_graph(wide_spec(40))
    boxes, edges, width, height = layout(g)
    assert len(boxes) < len(g)
    assert any(b.text.startswith("+") for b in boxes)
    per_layer = max(sum(1 for b in boxes if b.y == y) for y in {b.y for b in boxes})
    assert per_layer == MAX_PER_LAYER + 1
    assert max(b.x for b in boxes) < 1.5 * (MAX_PER_LAYER + 1) * (MAX_BOX_W + GAP_X)  # px
    ET.fromstring(to_svg(g))


def test_title_legend_and_packed_group_details():
    plan = make_plan(tiny_spec())
    root = ET.fromstring(to_svg(plan))
    title = next(t.text for t in root.iter(f"{SVG}text") if t.get("class") == "title")
    assert title.startswith("tiny · stage interleaved · target ")
    assert "predicted step " in title and " ms " in title and "packed group" in title
    legend = [t.text for g in root.iter(f"{SVG}g") if g.get("class") == "legend" for t in g.iter(f"{SVG}text")]
    assert legend == [f"stage: {s}" for s in ("staging", "transfer", "sparse", "dense", "backward")] + [
        "packed op (red outline)"]
    details = [t.text for g in root.iter(f"{SVG}g") if g.get("class") == "node" for t in g.iter(f"{SVG}tspan")]
    group = plan.meta.groups[0]
    assert f"dim {group.dim} {group.dtype} · {group.placement}" in details
    assert "dense" in details and "backward" in details
    built = ET.fromstring(to_svg(build_graph(tiny_spec())))
    assert [t.text for g in built.iter(f"{SVG}g") if g.get("class") == "legend"
            for t in g.iter(f"{SVG}text")] == ["no stage", "packed op (red outline)"]


def overlaps(seg: tuple[tuple[int, int], tuple[int, int]], box: Box) -> bool:
    """Whether the bounding box of a segment (which holds its drawn curve) meets the box's interior."""
    (x1, y1), (x2, y2) = seg
    return (min(x1, x2) < box.x + box.w and max(x1, x2) > box.x
            and min(y1, y2) < box.y + box.h and max(y1, y2) > box.y)


def check_routes(lay: Layout) -> None:
    at = {b.node: b for b in lay.boxes}
    for e in lay.edges:
        src, dst = at[e.source], at[e.target]
        (x0, y0), (xn, yn) = e.points[0], e.points[-1]
        assert y0 == src.y + src.h and src.x < x0 < src.x + src.w, f"{e} leaves {src} not at its bottom"
        assert yn == dst.y and dst.x < xn < dst.x + dst.w, f"{e} enters {dst} not at its top"
        for seg in zip(e.points, e.points[1:]):
            (x1, y1), (x2, y2) = seg
            assert y2 > y1, f"{e} does not run downwards"
            hit = [b.node for b in lay.boxes if overlaps(seg, b)]
            assert hit == [], f"{e.source} -> {e.target}: segment {seg} passes through {hit}"
    assert 0 <= min(b.x for b in lay.boxes) and max(b.x + b.w for b in lay.boxes) <= lay.width
    assert max(b.y + b.h for b in lay.boxes) <= lay.height


def test_no_edge_passes_through_a_box_in_any_spec(repo):
    for path in spec_paths(repo):
        spec = load_spec(path)
        for graph in (make_plan(spec).graph, build_graph(spec)):
            check_routes(layout(graph))
    check_routes(layout(build_graph(wide_spec(40))))


def test_long_edges_bend_around_boxes_not_through_them(repo):
    lay = layout(make_plan(load_spec(repo / "specs" / "din_taobao.yaml")).graph)
    edge = {(e.source, e.target): e for e in lay.edges}
    assert len(edge[("input_labels", "loss")].points) > 2  # through lanes between the boxes
    assert len(edge[("emb_g0_d16", "deep")].points) > 2
    ports = sorted(e.points[-1][0] for e in lay.edges if e.target == "deep")
    assert len(set(ports)) == len(ports) == 3  # arrows spread along the top, never on one spot


def test_barycenter_ordering_removes_avoidable_crossings(repo):
    for name in ("din_taobao", "two_task", "wide_1000", "wide_deep", "dlrm_criteo"):
        lay = layout(make_plan(load_spec(repo / "specs" / f"{name}.yaml")).graph)
        bands: dict[tuple[int, int], list[tuple[int, int]]] = {}
        for e in lay.edges:
            for (x1, y1), (x2, y2) in zip(e.points, e.points[1:]):
                bands.setdefault((y1, y2), []).append((x1, x2))  # same band: same curve shape
        crossings = sum(1 for segs in bands.values() for i, a in enumerate(segs) for b in segs[i + 1:]
                        if (a[0] - b[0]) * (a[1] - b[1]) < 0)
        assert crossings == 0, name


def test_svg_is_deterministic_across_processes(repo):
    code = ("import sys; from flowrec.spec.load import load_spec; from flowrec.planner.manager import make_plan;"
            "from flowrec.render.drawing import to_svg;"
            f"sys.stdout.write(to_svg(make_plan(load_spec({str(repo / 'specs' / 'wide_deep.yaml')!r}))))")
    outs = [run_bounded([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout_s=120,
                        env={"PYTHONHASHSEED": seed, "PATH": ""}).stdout for seed in ("1", "2")]
    assert outs[0] == outs[1] and outs[0].startswith("<svg")


def test_wide_1000_renders_legibly(repo):
    """1,000 fields: every node labelled in full, routes clear, the same SVG twice (its speed is a
    benchmark's to show, never a test's: a busy machine would fail it)."""
    path = repo / "specs" / "wide_1000.yaml"
    if not path.exists():
        pytest.skip("specs/wide_1000.yaml not in the tree")
    plan = make_plan(load_spec(path))
    svg = to_svg(plan)
    assert svg == to_svg(plan)
    texts = node_texts(ET.fromstring(svg))
    assert len(texts) == len(plan.graph) and all(not t.endswith("…") for t in texts)
    check_routes(layout(plan))


def test_png_shares_the_layout_and_is_deterministic(tmp_path):
    pytest.importorskip("matplotlib")
    plan = make_plan(tiny_spec())
    a, b = tmp_path / "a.png", tmp_path / "b.png"
    to_png(plan, a)
    to_png(plan.graph, b)
    assert a.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    to_png(plan, b)
    assert a.read_bytes() == b.read_bytes()
