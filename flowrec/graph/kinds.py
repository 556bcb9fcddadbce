"""The three tables every layer reads: op kinds, optimizers and placements.

One row per op kind, optimizer and placement, with every fact the planner, the verifier, the cost
model, lowering, the training step and the reference model need about it. Nothing else in
flowrec lists kind, optimizer or placement names; a test checks that the operator registry, the
runtime's placement modules and the JSON Schemas agree with these tables.

Example:
    >>> OP_KINDS["mlp"].stage, OP_KINDS["mlp"].inputs
    ('dense', 'flat')
    >>> PLACEMENTS["static_hot"].cached, OPTIMIZERS["rowwise_adagrad"].state_per_row
    (True, 1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["source", "sparse", "dense", "loss"]
InputConvention = Literal["none", "args", "flat", "stacked", "attention", "sequence"]
CostClass = Literal["input", "sparse", "dense"]


@dataclass(frozen=True)
class KindInfo:
    """Facts about one op kind.

    Args:
        name: the kind, as in `Op.kind` and the operator registry.
        stage: the pipeline stage the `interleave` pass gives its nodes.
        role: ``source`` (graph inputs, no input edges), ``sparse`` (embedding work),
            ``dense`` (a dense operator lowered into the dense forward) or ``loss``.
        inputs: how the lowered operator takes its input slots: ``none`` (not called by the dense
            forward), ``args`` (one tensor per slot), ``flat`` (slots flattened and concatenated
            into one (B, In) tensor), ``stacked`` (per-member flat inputs stacked into (K, B, In):
            packed MLPs), ``attention`` (query, sequence and the sequence's valid mask),
            ``sequence`` (a sequence and its valid mask).
        cost: the cost model's class: ``input`` (staged, no compute), ``sparse`` (lookups and
            their fused update), ``dense`` (GEMM-like compute with dense parameters).
        gathers: a node with many flat inputs may have them assembled by one column gather.
        named_outputs: the attribute listing the names of its outputs (consumers take one by
            name: a slot with that one field), or None for one unnamed output.
        packs: the `pack` pass may pack its same-shape sub-networks into one batched kernel (attr
            ``packed``): the experts of a mixture.
        sequence_slot: the input slot that is a pooling-none sequence (B, L, D), whose valid
            positions (B, L) the lowered operator also takes; None when it reads no sequence.
    """

    name: str
    stage: str
    role: Role
    inputs: InputConvention
    cost: CostClass
    gathers: bool = False
    named_outputs: str | None = None
    packs: bool = False
    sequence_slot: int | None = None


OP_KINDS: dict[str, KindInfo] = {k.name: k for k in (
    KindInfo("dense_input", "staging", "source", "none", "input"),  # dense columns -> (B, n_dense)
    KindInfo("sparse_input", "transfer", "source", "none", "sparse"),  # ids + offsets of a feature / group
    KindInfo("label_input", "staging", "source", "none", "input"),  # labels (B, n_tasks)
    KindInfo("embedding_lookup", "sparse", "sparse", "none", "sparse"),  # one feature's lookup (B, L, D)
    KindInfo("pooling", "sparse", "sparse", "none", "sparse"),  # bag reduction (B, D)
    KindInfo("packed_embedding", "sparse", "sparse", "none", "sparse"),  # every field of a group (B, F, D)
    KindInfo("mlp", "dense", "dense", "flat", "dense", gathers=True),
    KindInfo("packed_mlp", "dense", "dense", "stacked", "dense", named_outputs="members"),  # same-shape MLPs
    KindInfo("dot", "dense", "dense", "args", "dense"),
    KindInfo("fm", "dense", "dense", "args", "dense"),
    KindInfo("cross", "dense", "dense", "flat", "dense", gathers=True),
    KindInfo("target_attention", "dense", "dense", "attention", "dense", sequence_slot=1),  # DIN
    KindInfo("self_attention", "dense", "dense", "sequence", "dense", sequence_slot=0),  # transformer encoder
    KindInfo("similarity", "dense", "dense", "args", "dense"),  # dot / cosine of two towers
    KindInfo("linear", "dense", "dense", "args", "dense", gathers=True),
    KindInfo("concat", "dense", "dense", "args", "dense", gathers=True),
    KindInfo("head", "dense", "dense", "flat", "dense", gathers=True),  # one logit per task
    KindInfo("loss", "backward", "loss", "none", "dense"),
    KindInfo("moe", "dense", "dense", "flat", "dense", gathers=True, named_outputs="heads", packs=True),  # MMoE
    KindInfo("ple", "dense", "dense", "flat", "dense", gathers=True, named_outputs="heads", packs=True),  # CGC levels
    KindInfo("custom", "dense", "dense", "flat", "dense", gathers=True),  # a user's nn.Module by class path
)}


# Per-layer options of mlp / packed_mlp nodes (attrs present only when the spec sets them): MLPs
# pack together only when these are equal, and the plan report lists the nodes that set them.
MLP_LAYER_OPTIONS = ("norm", "dropout")


@dataclass(frozen=True)
class OptimizerInfo:
    """Facts about one optimizer.

    Args:
        name: as in the spec's `optimizer.sparse.name` / `optimizer.dense.name`.
        sparse: usable for embedding tables (fused row-wise update on the unique rows).
        dense: usable for dense parameters (torch.optim).
        state_per_elem: sparse state elements per embedding element (fp32).
        state_per_row: sparse state scalars per row (fp32).
        dense_state_copies: dense state kept per dense parameter, as copies of it.
    """

    name: str
    sparse: bool
    dense: bool
    state_per_elem: int
    state_per_row: int
    dense_state_copies: int


OPTIMIZERS: dict[str, OptimizerInfo] = {o.name: o for o in (
    OptimizerInfo("sgd", sparse=True, dense=True, state_per_elem=0, state_per_row=0, dense_state_copies=0),
    OptimizerInfo("adagrad", sparse=True, dense=True, state_per_elem=1, state_per_row=0, dense_state_copies=1),
    OptimizerInfo("rowwise_adagrad", sparse=True, dense=False, state_per_elem=0, state_per_row=1,
                  dense_state_copies=1),
    # lazy adam on tables: exp_avg and exp_avg_sq per element, a step count per row
    OptimizerInfo("adam", sparse=True, dense=True, state_per_elem=2, state_per_row=1, dense_state_copies=2),
)}


@dataclass(frozen=True)
class PlacementInfo:
    """Facts about one placement of a packed group.

    Args:
        name: as in `PackedGroup.placement`.
        rows_on: where the group's master table lives: ``device`` or ``host``.
        cached: keeps `cache_rows` rows of it on the device.
        traffic: the cost model's row-traffic rule: ``misses`` (pooled rows of the lookups that
            miss the device, share 1 - hit rate, travel to the device and their gradients back),
            ``hot_cold`` (FAE: the distinct cold rows of cold batches travel in and their
            gradients back; hot rows updated between hot/cold switches are written back:
            `flowrec.planner.fae_traffic`) or ``window`` (rows new to the lookahead window travel,
            with their optimizer state, in and out: ScratchPipe).
        trains_only: its schedule of row movement exists only while training; scoring reads the
            master table instead (`flowrec.planner.contract.scoring_plan`).
    """

    name: str
    rows_on: Literal["device", "host"]
    cached: bool
    traffic: Literal["misses", "hot_cold", "window"]
    trains_only: bool

    @property
    def host_side(self) -> bool:
        """Its ids stay on the host and it is looked up beside the device groups (K-interleaving)."""
        return self.rows_on == "host"


PLACEMENTS: dict[str, PlacementInfo] = {p.name: p for p in (
    PlacementInfo("device", rows_on="device", cached=False, traffic="misses", trains_only=False),
    PlacementInfo("static_hot", rows_on="host", cached=True, traffic="hot_cold", trains_only=True),  # FAE
    PlacementInfo("lookahead", rows_on="host", cached=True, traffic="window", trains_only=True),  # ScratchPipe
    PlacementInfo("host", rows_on="host", cached=False, traffic="misses", trains_only=False),
)}


HORIZON_WINDOWS = 3  # lookahead caches: the batches after the window whose rows the data stage
# attaches (this many windows), by which the scratchpad chooses its victims and the planner prices
# the rows it keeps between reads (`flowrec.planner.access.retained_fetches`)

FAE_SAMPLE_RATE = 0.05  # static_hot: FAE's profiling sample at the start of training, 5 % of the rows ...
HOT_SAMPLE_ROWS = 20_000  # ... and at least this many (all of a small dataset). A run's planner
# samples the same rows (`flowrec.runs.plan.sampled_access_profile`: this rate, the same seed), so it
# prices the hot set the runtime will hold; a smaller sample with the same seed is part of FAE's


def hot_sample_rate(total_rows: int) -> float:
    """The share of the training rows FAE's profiling step counts to pick a static hot set.

    Example:
        >>> hot_sample_rate(100_000), hot_sample_rate(1_000_000)
        (0.2, 0.05)
    """
    return min(1.0, max(FAE_SAMPLE_RATE, HOT_SAMPLE_ROWS / max(total_rows, 1)))
