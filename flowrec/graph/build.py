"""Build the operator graph of a spec: one node per operator, edges carry input slots.

Node names: ``input_dense``, ``input_labels``, ``ids_<feature>``, ``lookup_<feature>``,
``pool_<feature>``, one node per module (its own name), ``head_<head>`` and ``loss``. Nodes are
inserted in a deterministic order (inputs, features in spec order, modules in dependency order
with spec order breaking ties, heads, loss). Each node's ``"op"`` attribute is a frozen `Op`.

Example:
    >>> from flowrec.spec import load_spec
    >>> g = build_graph(load_spec("specs/dlrm_criteo.yaml"))
    >>> g.nodes["interaction"]["op"].out_shape
    ('B', 351)
"""
from __future__ import annotations

from dataclasses import replace
from math import prod
from typing import Any

import networkx as nx

from flowrec.graph.edges import Slot, input_slots, set_inputs
from flowrec.graph.kinds import OP_KINDS
from flowrec.graph.shapes import field_shapes, sizing
from flowrec.graph.types import DTYPE_BYTES, Op, OpGraph
from flowrec.spec.model import (
    SELECTOR_DENSE,
    SELECTOR_PREFIX,
    SELECTOR_SPARSE,
    DenseFeature,
    HeadSpec,
    ModelSpec,
    ModuleSpec,
    SparseFeature,
    TableSpec,
    split_output,
)

DENSE_NODE = "input_dense"
LABEL_NODE = "input_labels"
LOSS_NODE = "loss"
PARAM_BYTES = 4  # bytes per dense parameter (fp32 master weights)

# Defaults of module parameters the spec may leave out.
MODULE_DEFAULTS: dict[str, dict[str, Any]] = {
    "mlp": {"activation": "relu"},
    "cross": {"num_layers": 3, "low_rank": None},
    "linear": {"out": 1},
    "target_attention": {"hidden": (64, 32)},
    "similarity": {"metric": "dot", "temperature": 1.0},
    "self_attention": {"num_heads": 1, "num_layers": 1, "norm": "post", "causal": False, "positional": "learned",
                       "dropout": 0.0, "output": "last"},
    "moe": {"activation": "relu", "gate_layers": ()},
    "ple": {"activation": "relu", "gate_layers": (), "levels": 1, "shared_experts": 1},
}


def make_op(name: str, kind: str, out: tuple[int, ...], attrs: dict[str, Any], **kw: Any) -> Op:
    """An `Op` with batch-leading out_shape, sorted attrs and per-sample output bytes."""
    dtype = kw.pop("dtype", "fp32")
    return Op(
        name=name,
        kind=kind,
        out_shape=("B", *out),
        dtype=dtype,
        out_bytes=prod(out) * DTYPE_BYTES[dtype],
        attrs=tuple(sorted(attrs.items())),
        **kw,
    )


def build_graph(spec: ModelSpec) -> OpGraph:
    """Compile a spec into its operator graph (before any pass).

    Raises:
        ValueError: on references the spec validator should have rejected.
    """
    g, outputs = _sources(spec)
    for m in _module_order(spec):
        slots = _resolve(spec, m.inputs, outputs, g)
        _add_module(g, spec, m, slots)
        outputs[m.name] = Slot(0, m.name, (), g.nodes[m.name]["op"].out_shape[1:])
    _add_heads_and_loss(g, spec, outputs)
    return g


def _sources(spec: ModelSpec) -> tuple[OpGraph, dict[str, Slot]]:
    """The graph's inputs and feature lookups, and the output slot of every sparse feature."""
    used = {f.table for f in spec.sparse_features}
    g: OpGraph = nx.DiGraph(
        name=spec.name,
        tables=tuple(t.name for t in spec.tables if t.name in used),
        features=tuple(f.name for f in spec.features),
    )
    dense = spec.dense_features
    if dense:
        attrs = {"columns": tuple(f.name for f in dense),
                 "transforms": tuple((f.name, f.transform, f.fill) for f in dense)}
        g.add_node(DENSE_NODE, op=make_op(DENSE_NODE, "dense_input", (len(dense),), attrs))
    labels = {"heads": tuple(h.name for h in spec.heads), "labels": tuple(h.label or "" for h in spec.heads),
              **({"weights": weights} if (weights := _weight_columns(spec)) else {})}
    g.add_node(LABEL_NODE, op=make_op(LABEL_NODE, "label_input", sizing("label_input", labels, []).out, labels))
    outputs: dict[str, Slot] = {}
    owned: set[str] = set()
    tables = spec.table_map
    for f in spec.sparse_features:
        outputs[f.name] = _add_feature(g, spec, f, tables[f.table], owned)
    return g, outputs


def _add_heads_and_loss(g: OpGraph, spec: ModelSpec, outputs: dict[str, Slot]) -> None:
    precision = spec.training.precision
    scored_by_heads = []  # similarity modules a retrieval head scores itself
    for h in spec.heads:
        name = f"head_{h.name}"
        slot = _module_output(spec, h.input, outputs, g)
        if slot is None:
            raise ValueError(f"head {h.name}: unknown input module {h.input!r}")
        slots = [slot]
        attrs = {"task": h.task, "loss": h.loss, "weight": h.weight, "label": h.label or "",
                 "in_features": prod(slot.shape), **_head_options(h)}
        if h.retrieval is not None:  # the towers themselves: the loss scores every pair of the batch
            slots, more = _retrieval_head(g, spec, h, slot)
            attrs.update(more)
        size = sizing("head", attrs, [s.shape for s in slots])
        g.add_node(name, op=make_op(name, "head", size.out, attrs, dtype=precision,
                                    flops=size.flops, param_bytes=size.params * PARAM_BYTES))
        set_inputs(g, name, slots)
        if h.retrieval is not None:
            scored_by_heads.append(slot.source)
    for node in scored_by_heads:  # once every head reads its input: a head after it may read it too
        if not g.out_degree(node):  # the head scores the towers itself
            g.remove_node(node)
    widths = [g.nodes[f"head_{h.name}"]["op"].out_shape[1] for h in spec.heads]
    loss_slots = [Slot(i, f"head_{h.name}", (), (w,)) for i, (h, w) in enumerate(zip(spec.heads, widths))]
    loss_slots.append(Slot(len(loss_slots), LABEL_NODE, (), g.nodes[LABEL_NODE]["op"].out_shape[1:]))
    attrs = {"heads": tuple(h.name for h in spec.heads), "losses": tuple(h.loss for h in spec.heads),
             "weights": tuple(h.weight for h in spec.heads), **_loss_options(spec, widths, g)}
    size = sizing("loss", attrs, [s.shape for s in loss_slots])
    g.add_node(LOSS_NODE, op=make_op(LOSS_NODE, "loss", size.out, attrs, flops=size.flops))
    set_inputs(g, LOSS_NODE, loss_slots)


def _module_output(spec: ModelSpec, ref: str, outputs: dict[str, Slot], g: OpGraph) -> Slot | None:
    """The slot of a module's output, or of one named output ("experts.click": that head's
    (width,) part); None when `ref` names no module."""
    split = split_output(ref, {m.name: m.kind for m in spec.modules})
    if split is None or split[0] not in outputs:
        return None
    module, output = split
    if output is None:
        return outputs[module]
    shape = g.nodes[module]["op"].out_shape[2:]  # (B, n_outputs, width...) -> (width...)
    return Slot(0, module, (output,), shape)


def _weight_columns(spec: ModelSpec) -> tuple[str, ...]:
    """Sample-weight columns, each once in head order (after the head labels in the label tensor)."""
    return tuple(dict.fromkeys(h.sample_weight for h in spec.heads if h.sample_weight is not None))


def _head_options(h: HeadSpec) -> dict[str, Any]:
    """Head attributes beyond the defaults (absent when unused, so plans without them are unchanged)."""
    out: dict[str, Any] = {}
    if h.num_classes is not None:
        out["out"] = h.num_classes
    if h.sample_weight is not None:
        out["sample_weight"] = h.sample_weight
    if h.trained_where is not None:
        out["trained_where"] = (h.trained_where.label, h.trained_where.equals)
    return out


def _retrieval_head(g: OpGraph, spec: ModelSpec, h: HeadSpec, slot: Slot) -> tuple[list[Slot], dict[str, Any]]:
    """A retrieval head's input slots (the similarity's query and item towers) and attributes: its
    width (query then item vector), the similarity's metric and temperature, the item-id feature
    and the negatives."""
    sim = g.nodes[slot.source]["op"]
    towers = input_slots(g, slot.source)
    modules = {m.name: m for m in spec.modules}
    item_feature = _tower_feature(modules, {f.name for f in spec.features}, modules[slot.source].inputs[1])
    r = h.retrieval
    width = sum(prod(s.shape) for s in towers)
    return towers, {"out": width, "in_features": width, "metric": sim.attr("metric", "dot"),
                    "temperature": sim.attr("temperature", 1.0), "item_feature": item_feature,
                    "negatives": r.negatives.kind, "num_negatives": r.negatives.num,
                    "distribution": r.negatives.distribution, "logq_correction": r.logq_correction,
                    "top_k": r.top_k, **({"exclude_seen": True} if r.exclude_seen else {})}


def _tower_feature(modules: dict[str, ModuleSpec], features: set[str], token: str) -> str:
    """The one feature an item tower depends on (checked by `spec.retrieval_checks`)."""
    return token if token in features else _tower_feature(modules, features, modules[token].inputs[0])


def _loss_options(spec: ModelSpec, widths: list[int] | None = None, g: OpGraph | None = None) -> dict[str, Any]:
    """The loss's per-head logit widths, sample-weight columns and task-space masks, as columns of
    the label tensor (-1: none), and the retrieval head's softmax; each only when some head uses it."""
    out: dict[str, Any] = {}
    widths = widths if widths is not None else [h.width for h in spec.heads]
    if any(w != 1 for w in widths):
        out["widths"] = tuple(widths)
    for i, h in enumerate(spec.heads):
        if h.retrieval is not None and g is not None:
            op = g.nodes[f"head_{h.name}"]["op"]
            out["retrieval"] = (i, op.attr("metric"), op.attr("temperature"), h.retrieval.negatives.kind,
                                h.retrieval.logq_correction)
    weights = _weight_columns(spec)
    if weights:
        first = len(spec.heads)
        out["sample_weights"] = tuple(first + weights.index(h.sample_weight) if h.sample_weight else -1
                                      for h in spec.heads)
    default = spec.data.label if spec.data is not None else "label"
    column = {h.label or default: i for i, h in enumerate(spec.heads)}
    if any(h.trained_where is not None for h in spec.heads):
        out["masks"] = tuple((column[h.trained_where.label], h.trained_where.equals) if h.trained_where
                             else (-1, 0.0) for h in spec.heads)
    return out


def _add_feature(g: OpGraph, spec: ModelSpec, f: SparseFeature, table: TableSpec, owned: set[str]) -> Slot:
    """ids -> lookup (-> pooling); the first lookup of a table owns its parameters."""
    ids, lookup, pool = f"ids_{f.name}", f"lookup_{f.name}", f"pool_{f.name}"
    g.add_node(ids, op=make_op(ids, "sparse_input", (f.max_len,), {
        "bags": f.max_len, "feature": f.name, "table": f.table}))
    owns = f.table not in owned
    owned.add(f.table)
    attrs = {"feature": f.name, "table": f.table, "rows": table.rows, "dim": table.dim,
             "max_len": f.max_len, "pooling": f.pooling, "owns_table": owns,
             "optimizer": spec.table_optimizer(table).name}
    table_bytes = table.rows * table.dim * DTYPE_BYTES[table.dtype] if owns else 0
    size = sizing("embedding_lookup", attrs, [(f.max_len,)])
    g.add_node(lookup, op=make_op(lookup, "embedding_lookup", size.out, attrs, dtype=table.dtype,
                                  flops=size.flops, param_bytes=table_bytes))
    set_inputs(g, lookup, [Slot(0, ids, (), (f.max_len,))])
    if f.pooling == "none":
        return Slot(0, lookup, (), size.out)
    attrs = {"feature": f.name, "mode": f.pooling, "max_len": f.max_len, "dim": table.dim}
    psize = sizing("pooling", attrs, [size.out])
    g.add_node(pool, op=make_op(pool, "pooling", psize.out, attrs, dtype=table.dtype, flops=psize.flops))
    set_inputs(g, pool, [Slot(0, lookup, (), size.out)])
    return Slot(0, pool, (), psize.out)


def module_input_width(spec: ModelSpec, name: str) -> int:
    """The flat input width of module `name`, built from the features and the modules before it in
    dependency order (its own output width, e.g. a custom module's, need not be known yet)."""
    g, outputs = _sources(spec)
    for m in _module_order(spec):
        if m.name == name:
            return sum(prod(s.shape) for s in _resolve(spec, m.inputs, outputs, g))
        _add_module(g, spec, m, _resolve(spec, m.inputs, outputs, g))
        outputs[m.name] = Slot(0, m.name, (), g.nodes[m.name]["op"].out_shape[1:])
    raise ValueError(f"unknown module {name!r}")


def _module_order(spec: ModelSpec) -> list[ModuleSpec]:
    """Modules in dependency order, spec order breaking ties."""
    by_name = {m.name: m for m in spec.modules}
    kinds = {m.name: m.kind for m in spec.modules}
    deps = {m.name: [s[0] for i in m.inputs if (s := split_output(i, kinds)) is not None] for m in spec.modules}
    order: list[ModuleSpec] = []
    done: set[str] = set()
    while len(order) < len(spec.modules):
        ready = [m for m in spec.modules if m.name not in done and all(d in done for d in deps[m.name])]
        if not ready:
            raise ValueError("modules form a cycle: " + ", ".join(sorted(set(by_name) - done)))
        order.append(ready[0])
        done.add(ready[0].name)
    return order


def _resolve(spec: ModelSpec, inputs: tuple[str, ...], outputs: dict[str, Slot], g: OpGraph) -> list[Slot]:
    """Module inputs (names and selectors) -> slots in order."""
    slots: list[Slot] = []

    def dense_slot(names: tuple[str, ...]) -> None:
        if names:
            slots.append(Slot(len(slots), DENSE_NODE, names, (len(names),)))

    for ref in inputs:
        if ref == SELECTOR_DENSE:
            dense_slot(tuple(f.name for f in spec.dense_features))
        elif ref == SELECTOR_SPARSE:
            chosen = [f for f in spec.sparse_features if f.pooling != "none"]
            slots.extend([replace(outputs[f.name], port=len(slots) + i) for i, f in enumerate(chosen)])
        elif ref.startswith(SELECTOR_PREFIX):
            tag = ref[len(SELECTOR_PREFIX):]
            dense_slot(tuple(f.name for f in spec.dense_features if tag in f.tags))
            chosen = [f for f in spec.sparse_features if tag in f.tags]
            slots.extend([replace(outputs[f.name], port=len(slots) + i) for i, f in enumerate(chosen)])
        elif (slot := _module_output(spec, ref, outputs, g)) is not None:
            slots.append(replace(slot, port=len(slots)))
        elif ref in outputs:
            slots.append(replace(outputs[ref], port=len(slots)))
        elif any(isinstance(f, DenseFeature) and f.name == ref for f in spec.features):
            dense_slot((ref,))
        else:
            raise ValueError(f"unknown module input {ref!r}")
    return slots


def _add_module(g: OpGraph, spec: ModelSpec, m: ModuleSpec, slots: list[Slot]) -> None:
    if m.name in g:
        raise ValueError(f"module name {m.name!r} clashes with a built-in node")
    attrs: dict[str, Any] = {**MODULE_DEFAULTS.get(m.kind, {}), **dict(m.params)}
    for key in ("layers", "hidden"):
        if isinstance(attrs.get(key), int):
            attrs[key] = (attrs[key],)
        elif key in attrs:
            attrs[key] = tuple(attrs[key])
    attrs["in_features"] = sum(prod(s.shape) for s in slots)
    if m.kind in ("dot", "fm"):
        flat = tuple(s.port for s in slots if not s.fields and len(s.shape) > 1
                     and OP_KINDS[g.nodes[s.source]["op"].kind].named_outputs is not None)
        if flat:  # a module's whole output is one field of its width (docs/spec.md), also (H, D) of a moe
            attrs["flat_ports"] = flat
        shapes = field_shapes(attrs, [s.shape for s in slots])
        attrs["num_fields"] = sum(1 if len(s) == 1 else s[0] for s in shapes)
        attrs["dim"] = shapes[0][-1] if shapes else 0
    size = sizing(m.kind, attrs, [s.shape for s in slots])
    g.add_node(m.name, op=make_op(m.name, m.kind, size.out, attrs, dtype=spec.training.precision,
                                  flops=size.flops, param_bytes=size.params * PARAM_BYTES))
    set_inputs(g, m.name, slots)
