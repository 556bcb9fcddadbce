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

from dataclasses import dataclass, field, replace
from typing import Any, Literal

import networkx as nx

from flowrec.graph.kinds import OPTIMIZERS
from flowrec.spec.model import ModelSpec

OpGraph = nx.DiGraph
AccessProfile = dict[str, Any]  # a `flowrec data profile` document (format flowrec-access-profile)

Sharding = Literal["row_wise", "replicated"]
Placement = Literal["device", "static_hot", "lookahead", "host"]  # the rows of `kinds.PLACEMENTS`
Stage = Literal["staging", "transfer", "sparse", "dense", "backward"]
STAGES: tuple[str, ...] = ("staging", "transfer", "sparse", "dense", "backward")

# Bytes per element of the storage dtypes.
DTYPE_BYTES: dict[str, int] = {"fp32": 4, "fp16": 2, "bf16": 2, "fp64": 8}

@dataclass(frozen=True)
class Op:
    """One operator node of the graph.

    Args:
        name: node id, unique in the graph.
        kind: one of `flowrec.graph.kinds.OP_KINDS`.
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
        sharding: how the table spreads over the ranks (set by the `shard` pass): ``row_wise``
            (packed row r on rank r mod shards, at local row r div shards) or ``replicated``
            (every rank holds every row; row gradients are all-reduced).
        shards: ranks the rows are spread over (1: the whole table on each rank that holds it).
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
    sharding: Sharding = "row_wise"
    shards: int = 1

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
        opt = OPTIMIZERS[self.optimizer[0]]
        return self.dim * DTYPE_BYTES[self.dtype] + self.dim * opt.state_per_elem * 4 + opt.state_per_row * 4

    @property
    def bytes(self) -> int:
        return self.rows * self.row_bytes()

    @property
    def rows_per_rank(self) -> int:
        """Rows on the busiest rank: ceil(rows / shards) for row-wise sharding."""
        return -(-self.rows // self.shards)

    @property
    def bytes_per_rank(self) -> int:
        """Bytes of rows and optimizer state on the busiest rank."""
        return self.rows_per_rank * self.row_bytes()


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
    world_size: int = 1  # ranks the plan runs on (set by the `shard` pass)


@dataclass(frozen=True)
class PassContext:
    """What a pass may read besides the graph: the spec and the planning options.

    Args:
        spec: the typed model (a `flowrec.spec.model.ModelSpec`).
        target: cost-model device profile name (cpu, a100, h100).
        device_budget_bytes: device memory the plan may use (None: target memory minus a reserve).
        profile: an access profile document (`flowrec data profile`), or None for the Zipf model.
        packing: pack tables / dense ops (None: the spec's `plan.packing` hint).
        world_size: ranks the plan is for (one process per GPU or CPU worker).

    Example:
        >>> ctx = PassContext(spec=None, target="cpu")
        >>> ctx.device_budget_bytes is None
        True
    """

    spec: ModelSpec
    target: str = "cpu"
    device_budget_bytes: int | None = None
    profile: AccessProfile | None = None
    packing: bool | None = None
    world_size: int = 1


@dataclass(frozen=True)
class PassResult:
    """A pass's output: the new graph (never the input object), whether it changed, and why."""

    graph: OpGraph
    modified: bool
    notes: tuple[str, ...] = ()


ACCESS_NONE = "none (Zipf model per table)"  # CostPrediction.access_profile without an access profile
ACCESS_SAMPLED = "sampled: "  # how an access_profile sampled from the training data opens (`access_description`)


@dataclass(frozen=True)
class CostPrediction:
    """Predicted cost of one training step (made by `flowrec.planner.cost.predict`).

    Args:
        target: device profile name.
        batch_size: samples per step.
        micro_batches: micro-batches per step used for the overlapped time.
        stage_ms: (stage, milliseconds) for staging, transfer, sparse, dense, backward.
        step_ms_serial: every stage back to back (and the epoch's lean below, in no stage).
        step_ms_overlap: with prefetch (staging hidden) and D-interleaving over micro-batches: the
            typical step; one process on data of known length also holds what its epochs' starts
            move the typical step by (a calibrated profile's `epoch_lean_us`: `cost.epoch_lean_seconds`).
        samples_per_s: batch_size / the mean step: step_ms_overlap less that lean, plus the step's
            share of its epoch's start (a calibrated profile's `epoch_start_us` or `epoch_single_us` over the
            epoch's batches, where both are known: `cost.epoch_start_seconds`).
        h2d_bytes_per_step: host -> device bytes (ids, offsets, dense, labels, rows).
        memory: (part, bytes) of the peak device memory of one rank, in `MEMORY_PARTS` order (`maps`:
            the managed tables' maps, where the host is the device: `cost.managed_map_bytes`).
        peak_memory_bytes: their sum.
        world_size: ranks; stage times, bytes and memory are per rank.
        exchange_bytes_per_step: bytes one rank sends per step over the interconnect (embedding
            ids, rows and row gradients of sharded groups, replicated groups' and the dense
            all-reduce).
        exchange_ms: their time on the target's interconnect.
        group_exchange_bytes: (group, bytes one rank sends per step for it).
        constants: where the device constants come from: "datasheet NAME", or "calibrated FILE
            (created TIME)" for a profile measured by `flowrec calibrate`.
        access_profile: what cache traffic and hit rates were predicted from: "none (Zipf model
            per table)", "given FILE (N sampled rows)" or "sampled N rows ..." at the start of a run.
    """

    target: str
    batch_size: int
    micro_batches: int
    stage_ms: tuple[tuple[str, float], ...]
    step_ms_serial: float
    step_ms_overlap: float
    samples_per_s: float
    h2d_bytes_per_step: int
    memory: tuple[tuple[str, int], ...]
    peak_memory_bytes: int
    world_size: int = 1
    exchange_bytes_per_step: int = 0
    exchange_ms: float = 0.0
    group_exchange_bytes: tuple[tuple[str, int], ...] = ()
    constants: str = "datasheet"
    access_profile: str = ACCESS_NONE


MEMORY_PARTS: tuple[str, ...] = ("tables", "caches", "activations", "dense", "exchange", "maps")  # CostPrediction.memory order


@dataclass(frozen=True)
class Plan:
    """The planner's result: the one record `flowrec plan` shows, `flowrec train` runs unchanged
    and a run folder stores (`plan.json`, JSON both ways: `flowrec.graph.plan_io`).

    The plan-level decisions live once, on the graph (``graph.graph["plan"]``, a `PlanMeta`);
    `meta` reads them there and `with_meta` makes a new plan with other decisions.

    Args:
        spec_name: name of the planned spec.
        stage: last pipeline stage run (built, packed, cached, interleaved).
        target: cost-model device profile used.
        graph: the final operator graph (do not mutate).
        cost: the cost model's prediction for these decisions.
        device_budget_bytes: the device memory budget the cache pass used.
        spec_fingerprint: `flowrec.graph.plan_io.model_fingerprint` of the planned spec: a plan
            runs only with a spec of the same model.
    """

    spec_name: str
    stage: str
    target: str
    graph: OpGraph
    cost: CostPrediction | None
    device_budget_bytes: int = 0
    spec_fingerprint: str = ""

    @property
    def meta(self) -> PlanMeta:
        """Groups, group order, micro-batches, prefetch and pass records."""
        return self.graph.graph.get("plan", PlanMeta())

    def with_meta(self, meta: PlanMeta) -> "Plan":
        """The same plan with other decisions (a new graph object; this plan is unchanged)."""
        graph = self.graph.copy()
        graph.graph["plan"] = meta
        return replace(self, graph=graph)
