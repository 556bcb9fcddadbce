"""Render an operator graph: hand-written DOT and SVG text, PNG through matplotlib (lazy import).

SVG and PNG share one layered layout (`layout`): layers are the topological generations; an edge
that skips layers gets a virtual point in each layer it crosses, in a lane between that layer's
boxes, so no edge runs through a box; boxes and lanes are ordered within each layer by barycenter
sweeps (the order with the fewest crossings is kept) and placed by an order-preserving least-squares
fit to their neighbours. Edges leave the bottom of the source and enter the top of the target. A
title line and a legend of stage colours head the drawing. Output is deterministic.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.graph.build import build_graph
    >>> to_dot(build_graph(load_spec("specs/dlrm_criteo.yaml"))).startswith("digraph")
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, NamedTuple, Union
from xml.sax.saxutils import escape

import networkx as nx

from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import STAGES, OpGraph, PackedGroup, Plan
from flowrec.spec.units import counted

STAGE_COLORS: dict[str, str] = {  # fill colours, hex RGB
    "staging": "#e3f2fd",
    "transfer": "#fff3e0",
    "sparse": "#e8f5e9",
    "dense": "#f3e5f5",
    "backward": "#ffebee",
    "": "#f5f5f5",  # no stage assigned yet
}
PACKED_STROKE = "#d32f2f"  # outline of packed ops
BOX_STROKE = "#616161"  # outline of other ops
EDGE_COLOR = "#8a8a8a"
DETAIL_COLOR = "#555555"  # second text line of a box
FONT_PX, SMALL_PX, TITLE_PX = 11, 9, 13  # px
CHAR_W = 6.2  # px per character at FONT_PX (DejaVu Sans measures at most 6.0)
BOX_H = 42  # px
MIN_BOX_W, MAX_BOX_W = 120, 230  # px
GAP_X, GAP_Y = 20, 60  # px between boxes in a layer, between layers
LANE_W, LANE_GAP = 6, 10  # px: width of an edge's lane through a layer, gap between two lanes
MARGIN = 20  # px around the drawing
HEADER_H = 78  # px: title line and legend above the first layer
MAX_PER_LAYER = 12  # boxes drawn per layer; the rest are summarised in one box
SWEEPS = 4  # barycenter ordering sweeps (each one down and one up)
FIT_ROUNDS = 4  # coordinate fitting rounds (each one down and one up)

Source = Union[OpGraph, Plan]


def label(graph: OpGraph, node: str) -> str:
    """Display label: name, kind and, for packed ops, the member count."""
    op = graph.nodes[node]["op"]
    if op.kind == "packed_embedding":
        return f"{op.attr('group')}: {len(op.attr('fields'))} fields, {len(op.attr('tables'))} tables"
    if op.kind == "packed_mlp":
        return f"{node}: {len(op.attr('members'))} MLPs"
    return f"{node} ({op.kind})"


def detail(graph: OpGraph, node: str) -> str:
    """Second box line: dim, dtype and placement of a packed embedding; the stage of other ops."""
    op = graph.nodes[node]["op"]
    if op.kind != "packed_embedding":
        return op.stage or "no stage"
    group = _groups(graph).get(op.attr("group"))
    if group is None:
        return f"dim {op.attr('dim')} · not placed yet"
    return f"dim {group.dim} {group.dtype} · {_placement(group)}"


def _groups(graph: OpGraph) -> dict[str, PackedGroup]:
    meta = graph.graph.get("plan")
    return {g.name: g for g in meta.groups} if meta is not None else {}


def _placement(group: PackedGroup) -> str:
    shards = f" · {group.sharding} x{group.shards}" if group.shards > 1 else (
        " · replicated" if group.sharding == "replicated" else "")
    if PLACEMENTS[group.placement].cached:
        return f"{group.placement}, {_count(group.cache_rows)} rows cached{shards}"
    return group.placement + shards


def _count(n: int) -> str:
    if n < 10_000:
        return str(n)
    return f"{n / 1e3:.0f}k" if n < 1_000_000 else f"{n / 1e6:.1f}M"


def _packed(graph: OpGraph, node: str) -> bool:
    return graph.nodes[node]["op"].kind in ("packed_embedding", "packed_mlp")


def to_dot(graph: OpGraph) -> str:
    """DOT text: one cluster per stage (unassigned ops outside clusters), packed ops highlighted."""
    def q(s: str) -> str:
        return '"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"'

    lines = [f"digraph {q(graph.graph.get('name', 'plan'))} {{", "  rankdir=TB;",
             '  node [shape=box, style="rounded,filled", fontname="Helvetica"];']
    by_stage: dict[str, list[str]] = {}
    for node in graph:
        by_stage.setdefault(graph.nodes[node]["op"].stage or "", []).append(node)

    def node_line(node: str, indent: str) -> str:
        stage = graph.nodes[node]["op"].stage or ""
        extra = f", color={q(PACKED_STROKE)}, penwidth=2" if _packed(graph, node) else ""
        return f"{indent}{q(node)} [label={q(label(graph, node))}, fillcolor={q(STAGE_COLORS[stage])}{extra}];"

    for stage in STAGES:
        if stage in by_stage:
            lines += [f"  subgraph {q('cluster_' + stage)} {{", f"    label={q(stage)};"]
            lines += [node_line(n, "    ") for n in by_stage[stage]]
            lines.append("  }")
    lines += [node_line(n, "  ") for n in by_stage.get("", [])]
    for u, v, data in graph.edges(data=True):
        fields = data.get("fields", ())
        tag = f" [label={q(f'{len(fields)} fields')}]" if len(fields) > 1 else ""
        lines.append(f"  {q(u)} -> {q(v)}{tag};")
    lines.append("}")
    return "\n".join(lines) + "\n"


@dataclass(frozen=True)
class Box:
    """A laid-out node (or a summary of a layer's surplus nodes): top-left corner and size in px."""

    node: str
    x: int
    y: int
    text: str
    fill: str
    packed: bool
    detail: str = ""
    w: int = MAX_BOX_W
    h: int = BOX_H


@dataclass(frozen=True)
class Edge:
    """A routed edge: points from the source's bottom to the target's top, in px.

    Consecutive points either share x (a run down a lane between a layer's boxes) or lie on the
    two borders of the gap between adjacent layers (drawn as an S-curve inside their bounding box).
    """

    source: str
    target: str
    points: tuple[tuple[int, int], ...]
    tip: str = ""  # hover text


class Layout(NamedTuple):
    """Boxes, routed edges and the canvas size (px) of a drawing."""

    boxes: list[Box]
    edges: list[Edge]
    width: int
    height: int


class LegendEntry(NamedTuple):
    """One legend swatch: left x (px), text, fill and outline colours."""

    x: int
    text: str
    fill: str
    stroke: str


def _graph(source: Source) -> OpGraph:
    return source.graph if isinstance(source, Plan) else source


def _clip(text: str, width_px: float, char_w: float) -> str:
    n = int(width_px / char_w)
    return text if len(text) <= n else text[: n - 1] + "…"


def _box_width(text: str, sub: str) -> int:
    need = max(len(text) * CHAR_W, len(sub) * CHAR_W * SMALL_PX / FONT_PX) + 16
    return 2 * (int(min(max(need, MIN_BOX_W), MAX_BOX_W)) // 2)


def _layer_boxes(graph: OpGraph) -> tuple[list[list[Box]], dict[str, str]]:
    """Unplaced boxes per topological generation and the box id drawn for each node."""
    index = {n: i for i, n in enumerate(graph)}
    layers: list[list[Box]] = []
    placed: dict[str, str] = {}
    for depth, layer in enumerate(nx.topological_generations(graph)):
        layer = sorted(layer, key=index.__getitem__)
        shown, hidden = layer[:MAX_PER_LAYER], layer[MAX_PER_LAYER:]
        boxes = []
        for node in shown:
            text, sub = label(graph, node), detail(graph, node)
            stage = graph.nodes[node]["op"].stage or ""
            boxes.append(Box(node, 0, 0, text, STAGE_COLORS[stage], _packed(graph, node), sub,
                             _box_width(text, sub)))
            placed[node] = node
        if hidden:
            more = f"+{len(hidden)} more"
            text = f"{more} ({graph.nodes[hidden[0]]['op'].kind} ...)"
            boxes.append(Box(f"{more}@{depth}", 0, 0, text, STAGE_COLORS[""], False, "summarised",
                             _box_width(text, "")))
            placed.update({n: f"{more}@{depth}" for n in hidden})
        layers.append(boxes)
    return layers, placed


class _Grid:
    """Layer membership of boxes and lanes (virtual points of long edges) during layout."""

    def __init__(self, layers: list[list[Box]], edges: list[tuple[str, str]]) -> None:
        self.order: list[list[str]] = [[b.node for b in layer] for layer in layers]
        self.width: dict[str, int] = {b.node: b.w for layer in layers for b in layer}
        depth = {n: d for d, layer in enumerate(self.order) for n in layer}
        self.chains: dict[tuple[str, str], list[str]] = {}
        self.lanes: set[str] = set()
        self.down: dict[str, list[str]] = {n: [] for n in self.width}  # neighbours one layer up
        self.up: dict[str, list[str]] = {n: [] for n in self.width}  # neighbours one layer down
        for u, v in edges:
            chain = [u]
            for d in range(depth[u] + 1, depth[v]):
                lane = f"{u}\u2192{v}@{d}"
                self.order[d].append(lane)
                self.width[lane] = LANE_W
                self.lanes.add(lane)
                self.down[lane], self.up[lane] = [], []
                chain.append(lane)
            chain.append(v)
            for a, b in zip(chain, chain[1:]):
                self.up[a].append(b)
                self.down[b].append(a)
            self.chains[(u, v)] = chain


def _crossings(order: list[list[str]], down: dict[str, list[str]]) -> int:
    total = 0
    for above, layer in zip(order, order[1:]):
        pos_a = {n: i for i, n in enumerate(above)}
        segs = [(pos_a[a], i) for i, b in enumerate(layer) for a in down[b]]
        total += sum(1 for k, (a1, b1) in enumerate(segs) for a2, b2 in segs[k + 1:]
                     if (a1 - a2) * (b1 - b2) < 0)
    return total


def _barycenter_sort(layer: list[str], ref: list[str], nbrs: dict[str, list[str]]) -> None:
    pos = {n: i for i, n in enumerate(ref)}
    cur = {n: i for i, n in enumerate(layer)}

    def key(n: str) -> tuple[float, int]:
        ps = [pos[m] for m in nbrs[n]]
        return (sum(ps) / len(ps) if ps else cur[n] * len(ref) / max(len(layer), 1), cur[n])

    layer.sort(key=key)


def _order(grid: _Grid) -> None:
    """Barycenter sweeps down and up; keep the order with the fewest crossings (first one on ties)."""
    order = grid.order
    best, best_n = [list(layer) for layer in order], _crossings(order, grid.down)
    for _ in range(SWEEPS):
        for d in range(1, len(order)):
            _barycenter_sort(order[d], order[d - 1], grid.down)
        for d in range(len(order) - 2, -1, -1):
            _barycenter_sort(order[d], order[d + 1], grid.up)
        n = _crossings(order, grid.down)
        if n < best_n:
            best, best_n = [list(layer) for layer in order], n
    grid.order = best


def _fit(desired: list[float], seps: list[float]) -> list[float]:
    """Least-squares positions closest to `desired` with x[i+1] - x[i] >= seps[i] (pool adjacent violators)."""
    offsets = [0.0]
    for s in seps:
        offsets.append(offsets[-1] + s)
    blocks: list[list[float]] = []  # [sum, count]
    for d, off in zip(desired, offsets):
        blocks.append([d - off, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            s, c = blocks.pop()
            blocks[-1][0] += s
            blocks[-1][1] += c
    values = [s / c for s, c in blocks for _ in range(int(c))]
    return [v + off for v, off in zip(values, offsets)]


def _place(grid: _Grid) -> dict[str, float]:
    """Centre x of every box and lane: packed from the left, then fitted to neighbours."""
    def sep(a: str, b: str) -> float:
        gap = LANE_GAP if a in grid.lanes or b in grid.lanes else GAP_X
        return (grid.width[a] + grid.width[b]) / 2 + gap

    x: dict[str, float] = {}
    for layer in grid.order:
        x.update(zip(layer, _fit([0.0] * len(layer), [sep(a, b) for a, b in zip(layer, layer[1:])])))

    def fit_layer(layer: list[str], nbrs: Mapping[str, list[str]]) -> None:
        want = [sum(x[m] for m in nbrs[n]) / len(nbrs[n]) if nbrs[n] else x[n] for n in layer]
        x.update(zip(layer, _fit(want, [sep(a, b) for a, b in zip(layer, layer[1:])])))

    # last rounds straighten long edges: a lane follows the other lanes of its edge, a box stays put
    both = {n: [n] for n in grid.width}
    both.update({lane: chain[1:-1] for chain in grid.chains.values() for lane in chain[1:-1]})
    for _ in range(FIT_ROUNDS):
        for layer in grid.order[1:]:
            fit_layer(layer, grid.down)
        for layer in reversed(grid.order[:-1]):
            fit_layer(layer, grid.up)
    for _ in range(FIT_ROUNDS):
        for layer in grid.order:
            fit_layer(layer, both)
    return x


def _ports(items: list[tuple[float, str]], left: int, w: int) -> dict[str, int]:
    """Spread attachment points along a box side, ordered by the x of the other end."""
    items = sorted(items)
    return {key: left + round(w * (i + 1) / (len(items) + 1)) for i, (_, key) in enumerate(items)}


def _route(grid: _Grid, at: dict[str, Box], lane_x: dict[str, int], lane_y: dict[str, int],
           tips: dict[tuple[str, str], str]) -> list[Edge]:
    def mid(item: str) -> float:
        return at[item].x + at[item].w / 2 if item in at else lane_x[item]

    outs: dict[str, list[tuple[float, str]]] = {}
    ins: dict[str, list[tuple[float, str]]] = {}
    for (u, v), chain in grid.chains.items():
        outs.setdefault(u, []).append((mid(chain[1]), v))
        ins.setdefault(v, []).append((mid(chain[-2]), u))
    out_x = {(u, v): px for u, items in outs.items() for v, px in _ports(items, at[u].x, at[u].w).items()}
    in_x = {(u, v): px for v, items in ins.items() for u, px in _ports(items, at[v].x, at[v].w).items()}
    edges = []
    for (u, v), chain in grid.chains.items():
        points = [(out_x[(u, v)], at[u].y + BOX_H)]
        for lane in chain[1:-1]:
            points += [(lane_x[lane], lane_y[lane]), (lane_x[lane], lane_y[lane] + BOX_H)]
        points.append((in_x[(u, v)], at[v].y))
        edges.append(Edge(u, v, tuple(points), tips[(u, v)]))
    return edges


def _tips(graph: OpGraph, placed: dict[str, str]) -> dict[tuple[str, str], str]:
    fields: dict[tuple[str, str], int] = {}
    for u, v, data in graph.edges(data=True):
        key = (placed[u], placed[v])
        fields[key] = fields.get(key, 0) + len(data.get("fields", ()))
    return {k: f"{k[0]} → {k[1]}" + (f": {n} fields" if n > 1 else "") for k, n in sorted(fields.items())}


def layout(source: Source) -> Layout:
    """Boxes per topological generation (at most MAX_PER_LAYER each), routed edges and canvas size.

    Args:
        source: an operator graph or a plan (its graph is drawn).
    """
    graph = _graph(source)
    layers, placed = _layer_boxes(graph)
    tips = _tips(graph, placed)
    grid = _Grid(layers, list(tips))
    _order(grid)
    x = _place(grid)
    shift = MARGIN - min((x[n] - grid.width[n] / 2 for layer in grid.order for n in layer), default=0.0)
    spec = {b.node: b for layer in layers for b in layer}
    boxes: list[Box] = []
    lane_x: dict[str, int] = {}
    lane_y: dict[str, int] = {}
    for depth, layer in enumerate(grid.order):
        y = HEADER_H + depth * (BOX_H + GAP_Y)
        for item in layer:
            if item in spec:
                b = spec[item]
                boxes.append(Box(b.node, round(x[item] + shift - b.w / 2), y, b.text, b.fill, b.packed,
                                 b.detail, b.w))
            else:
                lane_x[item], lane_y[item] = round(x[item] + shift), y
    at = {b.node: b for b in boxes}
    edges = _route(grid, at, lane_x, lane_y, tips)
    width = max([b.x + b.w for b in boxes] + list(lane_x.values()) + [_legend_width(graph)]) + MARGIN
    height = max((b.y + b.h for b in boxes), default=HEADER_H) + MARGIN
    return Layout(boxes, edges, width, height)


def title(source: Source) -> str:
    """Title line: spec name, plan stage, target and predicted step time (when given a plan), groups."""
    graph = _graph(source)
    parts = [str(graph.graph.get("name", "plan"))]
    if isinstance(source, Plan):
        parts[0] = source.spec_name
        parts += [f"stage {source.stage}", f"target {source.target}"]
        cost = source.cost
        if cost is not None and hasattr(cost, "step_ms_overlap"):
            parts.append(f"predicted step {cost.step_ms_overlap:.2f} ms ({cost.samples_per_s:,.0f} samples/s)")
    meta = graph.graph.get("plan")
    parts.append(f"{graph.number_of_nodes()} ops")
    if meta is not None:
        parts += [counted(len(meta.groups), "packed group"), counted(meta.micro_batches, "micro-batch")]
        if meta.world_size > 1:
            parts.append(f"{meta.world_size} ranks ({sum(g.sharding == 'row_wise' for g in meta.groups)} "
                         f"row-wise, {sum(g.sharding == 'replicated' for g in meta.groups)} replicated)")
    return " · ".join(parts)


def legend(graph: OpGraph) -> list[LegendEntry]:
    """Stage colours present in the graph (in pipeline order), then the packed-op outline."""
    present = {graph.nodes[n]["op"].stage or "" for n in graph}
    names = [s for s in STAGES if s in present] + ([""] if "" in present else [])
    entries, x = [], MARGIN
    for name in names:
        text = f"stage: {name}" if name else "no stage"
        entries.append(LegendEntry(x, text, STAGE_COLORS[name], BOX_STROKE))
        x += _legend_step(text)
    entries.append(LegendEntry(x, "packed op (red outline)", "#ffffff", PACKED_STROKE))
    return entries


def _legend_step(text: str) -> int:
    return 14 + 6 + round(len(text) * CHAR_W) + 18


def _legend_width(graph: OpGraph) -> int:
    last = legend(graph)[-1]
    return last.x + _legend_step(last.text)


LEGEND_Y = 44  # px: top of the legend swatches
TITLE_Y = 26  # px: baseline of the title


def _path_d(points: tuple[tuple[int, int], ...]) -> str:
    d = [f"M{points[0][0]},{points[0][1]}"]
    for (x1, y1), (x2, y2) in zip(points, points[1:]):
        if x1 == x2:
            d.append(f"L{x2},{y2}")
        else:
            ym = (y1 + y2) / 2
            d.append(f"C{x1},{ym:g} {x2},{ym:g} {x2},{y2}")
    return " ".join(d)


def to_svg(source: Source) -> str:
    """Standalone SVG text (no graphviz needed) of a graph or a plan."""
    graph = _graph(source)
    boxes, edges, width, height = layout(source)
    heading = title(source)
    width = max(width, round(len(heading) * CHAR_W * TITLE_PX / FONT_PX) + 2 * MARGIN)
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="{FONT_PX}">',
           f"<title>{escape(str(graph.graph.get('name', 'plan')))}</title>",
           '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" orient="auto" '
           f'markerUnits="userSpaceOnUse"><path d="M0,0 L8,4 L0,8 z" fill="{BOX_STROKE}"/></marker></defs>',
           f'<rect width="{width}" height="{height}" fill="#ffffff"/>',
           f'<text class="title" x="{MARGIN}" y="{TITLE_Y}" font-size="{TITLE_PX}" font-weight="bold">'
           f"{escape(heading)}</text>"]
    for e in legend(graph):
        out.append(f'<g class="legend"><rect x="{e.x}" y="{LEGEND_Y}" width="14" height="14" rx="3" '
                   f'fill="{e.fill}" stroke="{e.stroke}"/><text x="{e.x + 20}" y="{LEGEND_Y + 11}">'
                   f"{escape(e.text)}</text></g>")
    out.append(f'<g class="edges" fill="none" stroke="{EDGE_COLOR}" stroke-width="1.2">')
    for e in edges:
        out.append(f'<path class="edge" d="{_path_d(e.points)}" marker-end="url(#arrow)">'
                   f"<title>{escape(e.tip)}</title></path>")
    out.append("</g>")
    for b in boxes:
        stroke = f'stroke="{PACKED_STROKE}" stroke-width="2"' if b.packed else f'stroke="{BOX_STROKE}"'
        cx = b.x + b.w // 2
        out.append(f'<g class="node"><rect x="{b.x}" y="{b.y}" width="{b.w}" height="{b.h}" rx="6" '
                   f'fill="{b.fill}" {stroke}/><text x="{cx}" y="{b.y + 18}" text-anchor="middle">'
                   f"{escape(_clip(b.text, b.w - 12, CHAR_W))}"
                   f'<tspan x="{cx}" y="{b.y + 33}" font-size="{SMALL_PX}" fill="{DETAIL_COLOR}">'
                   f"{escape(_clip(b.detail, b.w - 12, CHAR_W * SMALL_PX / FONT_PX))}</tspan></text>"
                   f"<title>{escape(b.text)}\n{escape(b.detail)}</title></g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(source: Source, path: str | Path) -> None:
    """Draw the SVG layout with matplotlib (imported here, only when a PNG is asked for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch, PathPatch, Polygon, Rectangle
    from matplotlib.path import Path as MplPath

    graph = _graph(source)
    boxes, edges, width, height = layout(source)
    heading = title(source)
    width = max(width, round(len(heading) * CHAR_W * TITLE_PX / FONT_PX) + 2 * MARGIN)
    pt = 72 / 100  # points per px at dpi 100
    fig = plt.figure(figsize=(width / 100, height / 100), dpi=100)
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    ax.text(MARGIN, TITLE_Y, heading, fontsize=TITLE_PX * pt, fontweight="bold", va="baseline")
    for e in legend(graph):
        ax.add_patch(Rectangle((e.x, LEGEND_Y), 14, 14, facecolor=e.fill, edgecolor=e.stroke))
        ax.text(e.x + 20, LEGEND_Y + 11, e.text, fontsize=FONT_PX * pt, va="baseline")
    for e in edges:
        verts, codes = [e.points[0]], [MplPath.MOVETO]
        for (x1, y1), (x2, y2) in zip(e.points, e.points[1:]):
            if x1 == x2:
                verts.append((x2, y2))
                codes.append(MplPath.LINETO)
            else:
                ym = (y1 + y2) / 2
                verts += [(x1, ym), (x2, ym), (x2, y2)]
                codes += [MplPath.CURVE4] * 3
        ax.add_patch(PathPatch(MplPath(verts, codes), fill=False, edgecolor=EDGE_COLOR, linewidth=1.2 * pt))
        tx, ty = e.points[-1]
        ax.add_patch(Polygon([(tx - 4, ty - 8), (tx + 4, ty - 8), (tx, ty)], facecolor=BOX_STROKE,
                             edgecolor="none"))
    for b in boxes:
        ax.add_patch(FancyBboxPatch((b.x, b.y), b.w, b.h, boxstyle="round,pad=0,rounding_size=6",
                                    facecolor=b.fill, edgecolor=PACKED_STROKE if b.packed else BOX_STROKE,
                                    linewidth=2 * pt if b.packed else pt))
        cx = b.x + b.w / 2
        ax.text(cx, b.y + 18, _clip(b.text, b.w - 12, CHAR_W), ha="center", va="baseline",
                fontsize=FONT_PX * pt)
        ax.text(cx, b.y + 33, _clip(b.detail, b.w - 12, CHAR_W * SMALL_PX / FONT_PX), ha="center",
                va="baseline", fontsize=SMALL_PX * pt, color=DETAIL_COLOR)
    fig.savefig(str(path), dpi=2 * 100, metadata={"Software": None})  # 2x for legibility
    plt.close(fig)
