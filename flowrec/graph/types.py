"""Types of the operator graph and the plan: frozen records, one place.

An `OpGraph` is a `networkx.DiGraph` whose nodes are op names and carry their `Op` record under
the node attribute ``"op"``. Packed groups describe how logical tables are concatenated into one
packed table; the data stage, the operators and the runtime all read the same `PackedGroup`.

Example:
    >>> g = PackedGroup(name="g0", dim=16, dtype="fp32", optimizer=("adagrad", 0.01, ()),
    ...                 tables=(TableSlot("t", 10, 0),), fields=(GroupField("f", "t", 1, "sum"),))
    >>> g.rows
    10
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import networkx as nx

OpGraph = nx.DiGraph

Placement = Literal["device", "static_hot", "lookahead", "host"]
Stage = Literal["staging", "transfer", "sparse", "dense", "backward"]
STAGES: tuple[str, ...] = ("staging", "transfer", "sparse", "dense", "backward")

# Op kinds the planner emits. The operator registry (operators/) implements every one.
OP_KINDS: tuple[str, ...] = (
    "dense_input",  # dense columns -> (B, n_dense), transforms applied
    "sparse_input",  # ids + offsets of one feature (or a packed group after packing)
    "label_input",  # labels (B, n_tasks)
    "embedding_lookup",  # one feature's lookup in its table -> (B, L, D)
    "pooling",  # bag reduction (sum / mean) -> (B, D)
    "packed_embedding",  # one lookup for every field of a packed group -> (B, F, D)
    "mlp",
    "packed_mlp",  # several same-shape MLPs run as one batched kernel
    "dot",
    "fm",
    "cross",
    "target_attention",
    "linear",
    "concat",
    "head",  # projection to one logit per task
    "loss",
)

# Bytes per element of the storage dtypes.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}

# Optimizer state per row, as a multiple of the row's own elements (+ scalars per row).
OPTIMIZER_STATE: dict[str, tuple[int, int]] = {
    # name: (state elements per embedding element, state scalars per row)
    "sgd": (0, 0),
    "adagrad": (1, 0),
    "rowwise_adagrad": (0, 1),
    "adam": (2, 1),  # exp_avg, exp_avg_sq per element; step count per row (lazy adam)
}


@dataclass(frozen=True)
class Op:
    """One operator node of the graph.

    Args:
        name: node id, unique in the graph.
        kind: one of `OP_KINDS`.
        out_shape: output shape; "B" is the batch dimension.  # e.g. ("B", 26, 16)
        dtype: compute dtype of the output.
        param_bytes: bytes of parameters the op owns (tables included).
        flops: forward floating-point operations per sample.
        out_bytes: bytes of the output per sample.
        attrs: kind-specific settings as sorted (key, value) pairs.
        stage: pipeline stage, assigned by the `interleave` pass.
    """

    name: str
    kind: str
    out_shape: tuple[int | str, ...]
    dtype: str = "fp32"
    param_bytes: int = 0
    flops: int = 0
    out_bytes: int = 0
    attrs: tuple[tuple[str, Any], ...] = ()
    stage: str | None = None

    def attr(self, key: str, default: Any = None) -> Any:
        return dict(self.attrs).get(key, default)


@dataclass(frozen=True)
class TableSlot:
    """A logical table inside a packed table: packed rows [row_offset, row_offset + rows)."""

    table: str
    rows: int
    row_offset: int


@dataclass(frozen=True)
class GroupField:
    """One lookup (feature) of a packed group, in output order."""

    feature: str
    table: str
    max_len: int
    pooling: str  # sum | mean | none


@dataclass(frozen=True)
class PackedGroup:
    """Logical tables with the same (dim, dtype, optimizer) concatenated into one packed table.

    Args:
        name: group name, e.g. "g0_d16".
        dim: embedding dim of every member.
        dtype: storage dtype.
        optimizer: (name, lr, sorted params) of the sparse optimizer of every member.
        tables: member tables with their packed row offsets (disjoint, contiguous).
        fields: features looked up in this group, in the order of the (B, F, D) output.
        placement: where the packed table lives (set by the `cache` pass).
        cache_rows: device rows reserved for `static_hot` / `lookahead` placements.
        expected_hit_rate: the cache pass's estimate of device hits per lookup.
    """

    name: str
    dim: int
    dtype: str
    optimizer: tuple[str, float, tuple[tuple[str, float], ...]]
    tables: tuple[TableSlot, ...]
    fields: tuple[GroupField, ...]
    placement: Placement = "device"
    cache_rows: int = 0
    expected_hit_rate: float = 1.0

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    @property
    def row_offsets(self) -> dict[str, int]:
        return {t.table: t.row_offset for t in self.tables}

    @property
    def bags_per_sample(self) -> int:
        """Bags per sample: one per pooled field, `max_len` single-id bags per unpooled sequence."""
        return sum(f.max_len if f.pooling == "none" else 1 for f in self.fields)

    def field_bags(self) -> dict[str, slice]:
        """Each field's bag positions within a sample's bags (the S axis of the (B, S, D) output)."""
        out, start = {}, 0
        for f in self.fields:
            width = f.max_len if f.pooling == "none" else 1
            out[f.feature] = slice(start, start + width)
            start += width
        return out

    def row_bytes(self) -> int:
        """Bytes of one row including its optimizer state."""
        elem = DTYPE_BYTES[self.dtype]
        per_elem, per_row = OPTIMIZER_STATE[self.optimizer[0]]
        return self.dim * elem + self.dim * per_elem * 4 + per_row * 4

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes()


@dataclass(frozen=True)
class PassRecord:
    """What one pass did: its name, whether it changed the graph, and why (human-readable)."""

    name: str
    modified: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class PlanMeta:
    """Plan-level decisions carried beside the graph (graph.graph["plan"])."""

    groups: tuple[PackedGroup, ...] = ()
    micro_batches: int = 1
    prefetch: int = 2
    group_order: tuple[str, ...] = ()
    passes: tuple[PassRecord, ...] = field(default_factory=tuple)


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph: the spec and the planning options.

    Args:
        spec: the typed model (a `flowrec.spec.model.ModelSpec`).
        target: cost-model device profile name (cpu, a100, h100).
        device_budget_bytes: device memory the plan may use (None: target memory minus a reserve).
        profile: an access profile document (`flowrec data profile`), or None for the Zipf model.
        packing: pack tables / dense ops (None: the spec's `plan.packing` hint).

    Example:
        >>> ctx = PassContext(spec=None, target="cpu")
        >>> ctx.device_budget_bytes is None
        True
    """

    spec: Any
    target: str = "cpu"
    device_budget_bytes: int | None = None
    profile: Any = None
    packing: bool | None = None


@dataclass(frozen=True)
class PassResult:
    """A pass's output: the new graph (never the input object), whether it changed, and why."""

    graph: OpGraph
    modified: bool
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Plan:
    """The planner's result, what `flowrec plan` shows and `flowrec train` lowers.

    Args:
        spec_name: name of the planned spec.
        stage: last pipeline stage run (built, packed, cached, interleaved).
        target: cost-model device profile used.
        graph: the final operator graph (do not mutate).
        meta: groups, group order, micro-batches, prefetch and pass records.
        cost: the cost model's prediction (`flowrec.planner.cost.CostPrediction`).
        device_budget_bytes: the device memory budget the cache pass used.
    """

    spec_name: str
    stage: str
    target: str
    graph: OpGraph
    meta: PlanMeta
    cost: Any
    device_budget_bytes: int = 0
