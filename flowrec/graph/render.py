"""Render an operator graph: hand-written DOT and SVG text, PNG through matplotlib (lazy import).

Layout for SVG/PNG: layers are the topological generations, boxes coloured by stage, packed
groups labelled with their member count. Output is deterministic for a given graph.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.graph.build import build_graph
    >>> to_dot(build_graph(load_spec("specs/dlrm_criteo.yaml"))).startswith("digraph")
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from xml.sax.saxutils import escape

import networkx as nx

from flowrec.graph.types import STAGES, OpGraph

STAGE_COLORS: dict[str, str] = {  # fill colours, hex RGB
    "staging": "#e3f2fd",
    "transfer": "#fff3e0",
    "sparse": "#e8f5e9",
    "dense": "#f3e5f5",
    "backward": "#ffebee",
    "": "#f5f5f5",  # no stage assigned yet
}
PACKED_STROKE = "#d32f2f"  # outline of packed ops
BOX_W, BOX_H = 190, 40  # px
GAP_X, GAP_Y = 20, 50  # px
MAX_PER_LAYER = 12  # boxes drawn per layer; the rest are summarised in one box


def label(graph: OpGraph, node: str) -> str:
    """Display label: name, kind and, for packed ops, the member count."""
    op = graph.nodes[node]["op"]
    if op.kind == "packed_embedding":
        return f"{op.attr('group')}: {len(op.attr('fields'))} fields, {len(op.attr('tables'))} tables"
    if op.kind == "packed_mlp":
        return f"{node}: {len(op.attr('members'))} MLPs"
    return f"{node} ({op.kind})"


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
    """A laid-out node: top-left corner, label, fill colour, packed flag."""

    node: str
    x: int
    y: int
    text: str
    fill: str
    packed: bool


def layout(graph: OpGraph) -> tuple[list[Box], list[tuple[str, str]], int, int]:
    """Boxes per topological generation (at most MAX_PER_LAYER each), edges and canvas size."""
    index = {n: i for i, n in enumerate(graph)}
    boxes: list[Box] = []
    placed: dict[str, str] = {}  # node -> box id drawn for it
    for depth, layer in enumerate(nx.topological_generations(graph)):
        layer = sorted(layer, key=index.__getitem__)
        shown, hidden = layer[:MAX_PER_LAYER], layer[MAX_PER_LAYER:]
        y = GAP_Y + depth * (BOX_H + GAP_Y)
        for i, node in enumerate(shown):
            stage = graph.nodes[node]["op"].stage or ""
            boxes.append(Box(node, GAP_X + i * (BOX_W + GAP_X), y, label(graph, node), STAGE_COLORS[stage],
                             _packed(graph, node)))
            placed[node] = node
        if hidden:
            more = f"+{len(hidden)} more"
            boxes.append(Box(more + f"@{depth}", GAP_X + len(shown) * (BOX_W + GAP_X), y,
                             f"{more} ({graph.nodes[hidden[0]]['op'].kind} ...)", STAGE_COLORS[""], False))
            placed.update({n: more + f"@{depth}" for n in hidden})
    edges = sorted({(placed[u], placed[v]) for u, v in graph.edges()})
    width = max((b.x + BOX_W for b in boxes), default=0) + GAP_X
    height = max((b.y + BOX_H for b in boxes), default=0) + GAP_Y
    return boxes, edges, width, height


def to_svg(graph: OpGraph) -> str:
    """Standalone SVG text (no graphviz needed)."""
    boxes, edges, width, height = layout(graph)
    at = {b.node: b for b in boxes}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="Helvetica, Arial, sans-serif" font-size="11">',
           f"<title>{escape(str(graph.graph.get('name', 'plan')))}</title>",
           '<defs><marker id="arrow" markerWidth="8" markerHeight="8" refX="8" refY="4" orient="auto">'
           '<path d="M0,0 L8,4 L0,8 z" fill="#616161"/></marker></defs>']
    for u, v in edges:
        a, b = at[u], at[v]
        out.append(f'<line x1="{a.x + BOX_W // 2}" y1="{a.y + BOX_H}" x2="{b.x + BOX_W // 2}" y2="{b.y}" '
                   'stroke="#9e9e9e" marker-end="url(#arrow)"/>')
    for b in boxes:
        stroke = f'stroke="{PACKED_STROKE}" stroke-width="2"' if b.packed else 'stroke="#616161"'
        out.append(f'<g><rect x="{b.x}" y="{b.y}" width="{BOX_W}" height="{BOX_H}" rx="6" fill="{b.fill}" {stroke}/>'
                   f'<text x="{b.x + BOX_W // 2}" y="{b.y + BOX_H // 2 + 4}" text-anchor="middle">'
                   f"{escape(b.text[:34])}</text><title>{escape(b.text)}</title></g>")
    out.append("</svg>")
    return "\n".join(out) + "\n"


def to_png(graph: OpGraph, path: str | Path) -> None:
    """Draw the SVG layout with matplotlib (imported here, only when a PNG is asked for)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import FancyBboxPatch

    boxes, edges, width, height = layout(graph)
    at = {b.node: b for b in boxes}
    fig, ax = plt.subplots(figsize=(max(4, width / 100), max(3, height / 100)), dpi=100)
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.axis("off")
    for u, v in edges:
        a, b = at[u], at[v]
        ax.annotate("", xy=(b.x + BOX_W / 2, b.y), xytext=(a.x + BOX_W / 2, a.y + BOX_H),
                    arrowprops={"arrowstyle": "->", "color": "#9e9e9e"})
    for b in boxes:
        ax.add_patch(FancyBboxPatch((b.x, b.y), BOX_W, BOX_H, boxstyle="round,pad=0,rounding_size=6",
                                    facecolor=b.fill, edgecolor=PACKED_STROKE if b.packed else "#616161",
                                    linewidth=2 if b.packed else 1))
        ax.text(b.x + BOX_W / 2, b.y + BOX_H / 2, b.text[:34], ha="center", va="center", fontsize=7)
    fig.savefig(str(path), metadata={"Software": None})
    plt.close(fig)
