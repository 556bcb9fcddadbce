"""Input slots of an op and how they are stored on the graph's edges.

An op's inputs are an ordered list of *slots*. A slot names its source node, the fields it takes
from that source (``()`` = the whole output; dense column names from ``input_dense``; feature
names from a ``packed_embedding``; member names from a ``packed_mlp``) and its per-sample shape.
A `networkx.DiGraph` holds one edge per (source, consumer) pair, so every edge keeps the slots
it feeds: edge attributes ``port`` (first port, keeps input order), ``slots`` (tuple of
`Slot`) and ``fields`` (all fields it carries, in port order).

Example:
    >>> import networkx as nx
    >>> g = nx.DiGraph()
    >>> g.add_nodes_from(["a", "b", "mlp"])
    >>> set_inputs(g, "mlp", [Slot(0, "a", (), (4,)), Slot(1, "b", (), (2,))])
    >>> [s.source for s in input_slots(g, "mlp")]
    ['a', 'b']
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import networkx as nx


@dataclass(frozen=True)
class Slot:
    """One input of an op: `port` in the op's input order, `source` node, `fields`, `shape`."""

    port: int
    source: str
    fields: tuple[str, ...]
    shape: tuple[int, ...]  # per sample, e.g. (F, D)


def input_slots(graph: nx.DiGraph, node: str) -> list[Slot]:
    """The node's input slots in port order."""
    slots = [s for data in graph.pred[node].values() for s in data.get("slots", ())]
    return sorted(slots, key=lambda s: s.port)


def set_inputs(graph: nx.DiGraph, node: str, slots: list[Slot]) -> None:
    """Replace the node's in-edges by edges feeding `slots` (ports renumbered 0..n-1 in order).

    Only for graphs the caller owns (a pass's working copy or a graph being built).
    """
    graph.remove_edges_from([(u, node) for u in graph.pred[node]])
    by_source: dict[str, list[Slot]] = {}
    for port, slot in enumerate(sorted(slots, key=lambda s: s.port)):
        by_source.setdefault(slot.source, []).append(replace(slot, port=port))
    for source, mine in by_source.items():
        fields = tuple(f for s in mine for f in s.fields)
        graph.add_edge(source, node, port=mine[0].port, slots=tuple(mine), fields=fields)


def input_shapes(graph: nx.DiGraph, node: str) -> list[tuple[int, ...]]:
    """Per-sample shapes of the node's inputs in port order (what `operators.create` takes)."""
    return [s.shape for s in input_slots(graph, node)]
