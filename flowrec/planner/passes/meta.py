"""Helpers shared by the passes: the plan meta of a graph and a canonical node order."""
from __future__ import annotations

import networkx as nx

from flowrec.graph.types import OpGraph, PlanMeta


def plan_meta(graph: OpGraph) -> PlanMeta:
    """The plan decisions carried on the graph (`graph.graph["plan"]`), empty before packing."""
    return graph.graph.get("plan", PlanMeta())


def reorder(graph: OpGraph) -> OpGraph:
    """A copy with nodes in stable topological order (insertion order breaks ties)."""
    index = {n: i for i, n in enumerate(graph)}
    order = list(nx.lexicographical_topological_sort(graph, key=index.__getitem__))
    rank = {n: i for i, n in enumerate(order)}
    out = nx.DiGraph()
    out.graph.update(graph.graph)
    out.add_nodes_from((n, graph.nodes[n]) for n in order)
    edges = sorted(graph.edges(data=True), key=lambda e: (rank[e[1]], e[2]["port"]))
    out.add_edges_from(edges)
    return out
