"""The `pack` pass (PICASSO packing): one lookup per packed table, one kernel per MLP family.

Needs: a built graph (per-feature ``ids_*`` / ``lookup_*`` / ``pool_*`` nodes) and the spec.

Changes:
    * every table group of `flowrec.graph.packing.group_layout` (tables with equal dim, dtype
      and optimizer; one group per table when packing is off) replaces the ids/lookup/pooling
      nodes of its fields by ``ids_<group>`` (sparse_input) -> ``emb_<group>`` (packed_embedding,
      out (B, S, D)); consumers take their fields through the edge's slots; runs of pooled
      fields of one group feeding one consumer merge into one (F, D) slot;
    * independent MLPs with equal layers, activation, norm, dropout and input width become one ``packed_mlp``
      node (attr ``members``) whose output (B, M, out) consumers slice by member name.

Afterwards: no ``embedding_lookup``/``pooling`` node is left, every field is in exactly one
group, row ranges are disjoint and contiguous, ``graph.graph["plan"].groups`` holds the layout,
and the verifier holds. A second run changes nothing.
"""
from __future__ import annotations

from dataclasses import replace

import networkx as nx

from flowrec.graph.build import make_op
from flowrec.graph.edges import Slot, input_slots, set_inputs
from flowrec.graph.kinds import MLP_LAYER_OPTIONS, OP_KINDS
from flowrec.graph.shapes import expert_count, sizing
from flowrec.graph.types import DTYPE_BYTES, OpGraph, PackedGroup, PassContext, PassResult
from flowrec.graph.packing import group_layout
from flowrec.planner.passes.meta import plan_meta, reorder
from flowrec.spec.units import format_bytes

MAX_NOTE_GROUPS = 12  # groups described one per line in the notes; the rest are counted


def pack(graph: OpGraph, ctx: PassContext) -> PassResult:
    """Pack embedding tables and independent same-shape MLPs (see the module docstring)."""
    g = graph.copy()
    packing = ctx.spec.plan.packing if ctx.packing is None else ctx.packing
    notes: list[str] = []
    if any(g.nodes[n]["op"].kind == "embedding_lookup" for n in g):
        groups = group_layout(ctx.spec, packing)
        _pack_groups(g, groups)
        g.graph["plan"] = replace(plan_meta(g), groups=groups)
        notes += _group_notes(groups, packing)
    if packing:
        notes += _pack_mlps(g) + _pack_experts(g)
    if not notes:
        return PassResult(graph, False, ("nothing left to pack",))
    return PassResult(reorder(g), True, tuple(notes))


def _pack_groups(g: OpGraph, groups: tuple[PackedGroup, ...]) -> None:
    """Add every group's ids/emb nodes, then rewrite each consumer's slots once.

    Each consumer is rewritten once for all groups (not once per group it reads): with packing
    off a concat of n fields reads n groups, and a rewrite per group cost O(n^2).
    """
    old: dict[str, tuple[str, str]] = {}  # replaced node -> (its group's emb node, feature)
    merge: dict[str, tuple[int, frozenset[str]]] = {}  # emb node -> (dim, pooled fields)
    for group in groups:
        emb = _add_group_nodes(g, group)
        for f in group.fields:
            old[f"lookup_{f.feature}"] = old[f"pool_{f.feature}"] = (emb, f.feature)
        merge[emb] = (group.dim, frozenset(f.feature for f in group.fields if f.pooling != "none"))
    consumers = {v for n in old if n in g for v in g.successors(n)} - set(old)
    for node in sorted(consumers):
        slots = [
            Slot(s.port, old[s.source][0], (old[s.source][1],), s.shape) if s.source in old else s
            for s in input_slots(g, node)
        ]
        set_inputs(g, node, slots if _keeps_slots(g.nodes[node]["op"]) else _merge_pooled(slots, merge))
    for group in groups:
        for f in group.fields:
            g.remove_nodes_from([f"ids_{f.feature}", f"lookup_{f.feature}", f"pool_{f.feature}"])


def _add_group_nodes(g: OpGraph, group: PackedGroup) -> str:
    """Add the group's ``ids_<group>`` -> ``emb_<group>`` nodes; returns the emb node."""
    ids, emb = f"ids_{group.name}", f"emb_{group.name}"
    bags = group.bags_per_sample
    fields = tuple((f.feature, f.table, f.max_len, f.pooling) for f in group.fields)
    g.add_node(ids, op=make_op(ids, "sparse_input", (bags,), {
        "bags": bags, "group": group.name, "fields": tuple(f.feature for f in group.fields)}))
    attrs = {
        "group": group.name, "dim": group.dim, "rows": group.rows, "fields": fields,
        "tables": tuple((t.table, t.rows, t.row_offset) for t in group.tables),
        "bags": bags, "optimizer": group.optimizer[0],
    }
    size = sizing("packed_embedding", attrs, [(bags,)])
    g.add_node(emb, op=make_op(emb, "packed_embedding", size.out, attrs, dtype=group.dtype,
                               flops=size.flops,
                               param_bytes=group.rows * group.dim * DTYPE_BYTES[group.dtype]))
    set_inputs(g, emb, [Slot(0, ids, (), (bags,))])
    return emb


def _keeps_slots(op) -> bool:
    """Nodes whose inputs are distinct vectors, one per slot, never merged into one (F, D) slot:
    a similarity's two towers, a retrieval head's query and item towers."""
    return op.kind == "similarity" or (op.kind == "head" and op.attr("task") == "retrieval")


def _merge_pooled(slots: list[Slot], merge: dict[str, tuple[int, frozenset[str]]]) -> list[Slot]:
    """Adjacent slots of pooled fields from one packed source become one (F, D) slot.

    `merge` maps each packed source (``emb_<group>``) to its group's (dim, pooled fields). One
    pass: a run's fields are joined once, so the time is linear in the slots, not quadratic.
    """
    runs: list[list[Slot]] = []  # per output slot: the input slots it merges, in order
    open_run = False  # whether runs[-1] starts with a slot of a packed source, its fields all pooled
    for s in slots:
        pooled = merge[s.source][1] if s.source in merge else None
        all_pooled = pooled is not None and pooled.issuperset(s.fields)
        if open_run and all_pooled and s.fields and s.source == runs[-1][0].source:
            runs[-1].append(s)
            continue
        runs.append([s])
        open_run = all_pooled
    return [run[0] if len(run) == 1 else _merged(run, merge[run[0].source][0]) for run in runs]


def _merged(run: list[Slot], dim: int) -> Slot:
    """One (F, D) slot of a run of slots, at the first one's port."""
    fields = tuple(f for s in run for f in s.fields)
    return Slot(run[0].port, run[0].source, fields, (len(fields), dim))


def _group_notes(groups: tuple[PackedGroup, ...], packing: bool) -> list[str]:
    lookups = sum(len(gr.fields) for gr in groups)
    tables = sum(len(gr.tables) for gr in groups)
    why = "equal (dim, dtype, optimizer)" if packing else "packing off: one group per table"
    notes = [f"embeddings: {lookups} lookups of {tables} tables -> {len(groups)} packed_embedding "
             f"node(s) ({why})"]
    for gr in groups[:MAX_NOTE_GROUPS]:
        opt = gr.optimizer[0]
        notes.append(f"  {gr.name}: {len(gr.tables)} table(s), {len(gr.fields)} field(s), "
                     f"{gr.rows:,} rows x dim {gr.dim} {gr.dtype} {opt}, {format_bytes(gr.bytes)}")
    if len(groups) > MAX_NOTE_GROUPS:
        notes.append(f"  ... and {len(groups) - MAX_NOTE_GROUPS} more group(s)")
    return notes


def _pack_mlps(g: OpGraph) -> list[str]:
    """Cluster independent MLPs with equal shapes; each cluster of 2+ becomes a packed_mlp."""
    buckets: dict[tuple, list[list[str]]] = {}
    for node in list(g):
        op = g.nodes[node]["op"]
        if op.kind != "mlp":
            continue
        key = (op.attr("layers"), op.attr("activation"), op.attr("in_features"), op.dtype,
               *(op.attr(k) for k in MLP_LAYER_OPTIONS))
        clusters = buckets.setdefault(key, [])
        related = nx.ancestors(g, node) | nx.descendants(g, node)
        home = next((c for c in clusters if not related & set(c)), None)
        if home is None:
            clusters.append([node])
        else:
            home.append(node)
    notes = []
    for key, clusters in buckets.items():
        for members in clusters:
            if len(members) > 1:
                name = _pack_mlp_cluster(g, members)
                notes.append(f"dense: {len(members)} independent MLPs {members} with layers "
                             f"{list(key[0])} on {key[2]} inputs -> {name} (one batched kernel)")
    return notes


def _pack_experts(g: OpGraph) -> list[str]:
    """The same-shape experts of each mixture (kinds that `pack`) become one batched kernel."""
    notes = []
    for node in list(g):
        op = g.nodes[node]["op"]
        if not OP_KINDS[op.kind].packs or op.attr("packed") or expert_count(dict(op.attrs)) < 2:
            continue
        attrs = dict(op.attrs)
        attrs["packed"] = True
        g.nodes[node]["op"] = replace(op, attrs=tuple(sorted(attrs.items())))
        notes.append(f"dense: {node}: {expert_count(attrs)} experts with layers {list(op.attr('expert_layers'))} "
                     f"-> one batched kernel" + (" per level" if op.attr("levels") else ""))
    return notes


def _pack_mlp_cluster(g: OpGraph, members: list[str]) -> str:
    first = g.nodes[members[0]]["op"]
    name = f"packed_{members[0]}_x{len(members)}"
    slots: list[Slot] = []
    ranges = []
    for m in members:
        mine = input_slots(g, m)
        ranges.append((len(slots), len(slots) + len(mine)))
        slots += [Slot(len(slots) + i, s.source, s.fields, s.shape) for i, s in enumerate(mine)]
    attrs = {"members": tuple(members), "member_ports": tuple(ranges), "layers": first.attr("layers"),
             "activation": first.attr("activation"), "in_features": first.attr("in_features"),
             **{k: first.attr(k) for k in MLP_LAYER_OPTIONS if first.attr(k) is not None}}
    size = sizing("packed_mlp", attrs, [s.shape for s in slots])
    g.add_node(name, op=make_op(name, "packed_mlp", size.out, attrs, dtype=first.dtype,
                                flops=size.flops, param_bytes=size.params * 4))
    set_inputs(g, name, slots)
    for m in members:
        for consumer in sorted(g.successors(m)):
            new = [Slot(s.port, name, (m,), s.shape) if s.source == m else s
                   for s in input_slots(g, consumer)]
            set_inputs(g, consumer, new)
    g.remove_nodes_from(members)
    return name
