"""Graph verifier: every structural invariant of an `OpGraph`, all problems at once.

Checks: nodes carry an `Op` named like the node, of a kind in `OP_KINDS`; the graph is acyclic;
input ports run 0..n-1; every slot's shape agrees with its source's output (per source kind) and
every op's output shape follows its kind's rule (`flowrec.graph.shapes`); every table is looked
up and owned by exactly one node; every feature is consumed; every node reaches the loss.

Example:
    >>> from flowrec.spec import load_spec
    >>> from flowrec.graph.build import build_graph
    >>> verify(build_graph(load_spec("specs/dlrm_criteo.yaml")))
    []
"""
from __future__ import annotations

from typing import Callable

import networkx as nx

from flowrec.graph.edges import Slot, input_slots
from flowrec.graph.shapes import ShapeError, sizing
from flowrec.graph.kinds import OP_KINDS
from flowrec.graph.types import Op, OpGraph

LOSS_NODE = "loss"


class GraphError(ValueError):
    """A graph that breaks invariants; `problems` lists every one."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__(f"{len(problems)} graph problem(s):\n" + "\n".join(f"  {p}" for p in problems))


def check(graph: OpGraph) -> None:
    """Raise `GraphError` with every problem `verify` finds."""
    problems = verify(graph)
    if problems:
        raise GraphError(problems)


def verify(graph: OpGraph) -> list[str]:
    """Every invariant violation of the graph, as readable lines (empty when it is sound)."""
    problems = _node_records(graph)
    if problems:
        return problems
    if not nx.is_directed_acyclic_graph(graph):
        return [f"cycle: {' -> '.join(str(u) for u, _ in nx.find_cycle(graph))}"]
    for node in graph:
        problems += _node_shapes(graph, node)
    problems += _tables(graph) + _features(graph) + _reach_loss(graph)
    return problems


def _node_records(graph: OpGraph) -> list[str]:
    out = []
    for node, data in graph.nodes(data=True):
        op = data.get("op")
        if not isinstance(op, Op):
            out.append(f"{node}: no Op record")
        elif op.name != node:
            out.append(f"{node}: Op is named {op.name!r}")
        elif op.kind not in OP_KINDS:
            out.append(f"{node}: unknown op kind {op.kind!r} (known: {', '.join(OP_KINDS)})")
    return out


def _node_shapes(graph: OpGraph, node: str) -> list[str]:
    op: Op = graph.nodes[node]["op"]
    slots = input_slots(graph, node)
    out = []
    if [s.port for s in slots] != list(range(len(slots))):
        out.append(f"{node}: input ports {[s.port for s in slots]} are not 0..{len(slots) - 1}")
    for slot in slots:
        expected = _slot_shape(graph.nodes[slot.source]["op"], slot)
        if expected != slot.shape:
            out.append(f"{slot.source} -> {node} port {slot.port}: shape {slot.shape} != {expected}")
    try:
        got = sizing(op.kind, dict(op.attrs), [s.shape for s in slots]).out
    except (ShapeError, KeyError, TypeError) as exc:
        return out + [f"{node} ({op.kind}): {exc}"]
    if ("B", *got) != tuple(op.out_shape):
        out.append(f"{node} ({op.kind}): out_shape {op.out_shape} != {('B', *got)}")
    return out


def _slot_shape(src: Op, slot: Slot) -> tuple[int, ...] | str:
    """The shape a slot must have given its source op (a message when the fields are bad)."""
    rule = SLOT_RULES.get(src.kind)
    if rule is None:
        return tuple(src.out_shape[1:]) if not slot.fields else f"no fields on {src.kind} outputs"
    return rule(src, slot.fields)


def _dense_slot(src: Op, fields: tuple[str, ...]) -> tuple[int, ...] | str:
    unknown = set(fields) - set(src.attr("columns"))
    return f"unknown columns {sorted(unknown)}" if unknown or not fields else (len(fields),)


def _packed_slot(src: Op, fields: tuple[str, ...]) -> tuple[int, ...] | str:
    members = {f: (length, pooling) for f, _, length, pooling in src.attr("fields")}
    if not fields or any(f not in members for f in fields):
        return f"fields {list(fields)} not all in {src.name}"
    dim = src.attr("dim")
    if len(fields) == 1:
        length, pooling = members[fields[0]]
        return (length, dim) if pooling == "none" else (dim,)
    if any(members[f][1] == "none" for f in fields):
        return "a sequence field must be its own slot"
    return (len(fields), dim)


def _named_slot(src: Op, fields: tuple[str, ...]) -> tuple[int, ...] | str:
    """A slot of an op with named outputs (`KindInfo.named_outputs`): the whole output, or one."""
    if not fields:
        return tuple(src.out_shape[1:])
    names = src.attr(OP_KINDS[src.kind].named_outputs)
    if len(fields) != 1 or fields[0] not in names:
        return f"takes one output of {tuple(names)}, got {list(fields)}"
    return tuple(src.out_shape[2:])


SLOT_RULES: dict[str, Callable[[Op, tuple[str, ...]], tuple[int, ...] | str]] = {
    "dense_input": _dense_slot,
    "packed_embedding": _packed_slot,
    **{kind: _named_slot for kind, info in OP_KINDS.items() if info.named_outputs},
}


def _tables(graph: OpGraph) -> list[str]:
    owners: dict[str, list[str]] = {}
    for node, data in graph.nodes(data=True):
        op = data["op"]
        if op.kind == "embedding_lookup":
            owners.setdefault(op.attr("table"), [])
            if op.attr("owns_table"):
                owners[op.attr("table")].append(node)
        elif op.kind == "packed_embedding":
            for table, _, _ in op.attr("tables"):
                owners.setdefault(table, []).append(node)
    out = [f"table {t}: owned by {len(o)} nodes {o}" for t, o in owners.items() if len(o) != 1]
    out += [f"table {t}: never looked up" for t in graph.graph.get("tables", ()) if t not in owners]
    return out


def _features(graph: OpGraph) -> list[str]:
    used: set[str] = set()
    for src, _, data in graph.edges(data=True):
        kind = graph.nodes[src]["op"].kind
        if kind in ("dense_input", "packed_embedding"):
            used.update(data.get("fields", ()))
        elif kind in ("embedding_lookup", "pooling"):
            used.add(graph.nodes[src]["op"].attr("feature"))
    return [f"feature {f}: never consumed" for f in graph.graph.get("features", ()) if f not in used]


def _reach_loss(graph: OpGraph) -> list[str]:
    if LOSS_NODE not in graph:
        return ["no loss node"]
    reach = nx.ancestors(graph, LOSS_NODE) | {LOSS_NODE}
    return [f"{n}: does not reach the loss" for n in graph if n not in reach]
