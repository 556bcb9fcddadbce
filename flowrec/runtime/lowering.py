"""Lowering: a `Plan` becomes torch modules and a forward that follows the plan graph.

One `PackedEmbeddingBag` per packed group (placement `device`: on the compute device; `host`: in
host memory, gathered on the host, rows travel to the device and gradients come back), one
operator from the registry per dense node (mlp, packed_mlp, dot, fm, cross, target_attention,
self_attention, linear, concat, head, ...), and the loss. The forward walks the dense nodes in topological order,
assembling each node's inputs from its edge slots (fields of a packed embedding output, columns
of the dense input, members of a packed MLP, whole module outputs).

Example:
    >>> model = lower(plan, spec, device="cpu")  # doctest: +SKIP
    >>> emb = model.embed(batch)                 # {group: (B, S, D)}  # doctest: +SKIP
    >>> logits = model.dense_forward(batch.dense, emb, model.sequence_masks(batch))  # (B, n_heads)  # doctest: +SKIP
"""
from __future__ import annotations

import math
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import networkx as nx
import torch
from torch import nn

from flowrec.data.batches import Batch
from flowrec.graph.edges import Slot, input_slots
from flowrec.graph.kinds import OP_KINDS, PLACEMENTS
from flowrec.graph.types import Op, PackedGroup, Plan
from flowrec.runtime.managed_state import managed_state
from flowrec.runtime.messages import first_line, out_of_memory
from flowrec.runtime.placement import group_embedding
from flowrec.runtime.retrieval import bind
from flowrec.spec.model import DRY_RUN_KINDS, FrozenMapping, ModelSpec, thaw
from operators import registry
from operators.dense import concat_flat, flat_rows
from operators.device import CompiledCall, runtime_for
from operators.custom import CustomModule
from operators.custom_code import CustomModuleError, ExitAttempt, UserCodeRefused, exits_refused
from operators.regularize import GhostBatchNorm, SeededDropout

GATHER_MIN_SLOTS = 4  # from this many input slots on, one gather replaces per-slot slices + cat
NOISE_MIX = 1_000_003  # a prime mixing (model seed, step, dropout layer) into one dropout seed


class GroupAllocationError(RuntimeError):
    """Memory for a packed group's table could not be allocated.

    Args:
        group: the group being built.
        reason: the allocator's message (first line).
    """

    def __init__(self, group: PackedGroup, reason: str) -> None:
        super().__init__(f"group {group.name}: {reason}")
        self.group, self.reason = group, reason


@dataclass(frozen=True)
class FlatGather:
    """A node's flattened, concatenated inputs as one column gather over whole sources.

    Per-field slices of a (B, S, D) lookup each cost a full-size zero tensor in the backward;
    one `index_select` over the concatenated sources costs one scatter of the selected columns.

    Args:
        sources: source nodes in order (dense input, packed lookups, module outputs).
        index: columns of cat(sources flattened) in the node's input order, None when that is
            every column in order.  # (In,) int64
        inverse: where each column of cat(sources flattened) goes in the node's input, when
            `index` is a permutation of them (None otherwise, or when `index` is None).  # (In,) int64
    """

    sources: tuple[str, ...]
    index: torch.Tensor | None
    inverse: torch.Tensor | None = None


class OpModules(nn.ModuleDict):
    """The dense operators by graph node name. A spec's module and head names may hold '.', which
    torch refuses in a module's name (a traceback building the model of a head `ctr.v1`): such a
    name is kept with '~' for each '.' ('~' is in no spec name), so `ops["ctr.v1"]` is its
    operator and its parameters are `ops.ctr~v1.*`; every other name is its own key.

    Example:
        >>> ops = OpModules({"head_ctr.v1": nn.Linear(2, 1)})
        >>> "head_ctr.v1" in ops, list(ops.keys())
        (True, ['head_ctr~v1'])
    """

    @staticmethod
    def key(name: str) -> str:
        return name.replace(".", "~")

    def __getitem__(self, name: str) -> nn.Module:
        return super().__getitem__(self.key(name))

    def __setitem__(self, name: str, module: nn.Module) -> None:
        super().__setitem__(self.key(name), module)

    def __delitem__(self, name: str) -> None:
        super().__delitem__(self.key(name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and super().__contains__(self.key(name))


@dataclass(frozen=True)
class NodeStep:
    """One dense node to run: its name, kind and input slots."""

    name: str
    kind: str
    slots: tuple[Slot, ...]
    members: tuple[str, ...] = ()
    member_ports: tuple[tuple[int, int], ...] = ()


class LoweredModel(nn.Module):
    """The trainable model of a plan.

    Args:
        plan: the interleaved plan (graph, groups, stages).
        spec: the spec it was planned from.
        device: compute device.
        seed: model seed (packed tables and dense init).
        tables: build the packed tables (False: the dense part only, for models that bring
            their own lookups, e.g. `flowrec.measure.reference`; the dense init is the same).
        world: the ranks of a distributed run (`distributed.World`; None: one process). Each
            group is then built as the plan shards it (this rank's rows of a row-wise group) and
            `embed` takes this rank's slice of the global batch.
    """

    def __init__(self, plan: Plan, spec: ModelSpec, device: torch.device | str = "cpu", seed: int = 0,
                 tables: bool = True, world: Any = None):
        super().__init__()
        self.device = torch.device(device)
        self.world = world
        self.groups: tuple[PackedGroup, ...] = tuple(plan.meta.groups)
        self.group_order = tuple(plan.meta.group_order) or tuple(g.name for g in self.groups)
        self.group_map = {g.name: g for g in self.groups}
        self.host_side = frozenset(g.name for g in self.groups if PLACEMENTS[g.placement].host_side)
        self.interleave = True  # K-interleaving of host-side and device lookups (see `embed`)
        self._executor: ThreadPoolExecutor | None = None
        self.compiled: CompiledCall | None = None  # the compiled dense stage (`compile_dense`)
        with torch.random.fork_rng(devices=[]):  # seeded init without touching the process's RNG
            torch.manual_seed(seed)
            self.embeddings = nn.ModuleDict(_embeddings(self.groups, seed, self.device, world) if tables else {})
            self._build_dense(plan.graph, spec)
        self._bind_noise(seed)
        self.retrieval = bind(plan.graph, self.group_map, spec, self.steps, self.head_nodes)
        self.managed = managed_state(spec, self.groups, seed, world) if tables else None  # the maps go with the tables

    def load_state_dict(self, *args: Any, **kwargs: Any) -> Any:
        """nn.Module's, where a custom module's own load code (`set_extra_state`,
        `_load_from_state_dict`) may not end the process: `--resume`, `--init-from`, `eval` and
        `export` ended with status 0 and no word. Such an attempt is a `UserCodeRefused` whose
        message names the module, its class file and the method (`state_failure`)."""
        from operators.custom import state_failure

        try:
            with exits_refused():
                return super().load_state_dict(*args, **kwargs)
        except ExitAttempt as exc:
            raise UserCodeRefused(state_failure(exc, self) or f"a custom module's load code {exc}") from None

    def _build_dense(self, graph: nx.DiGraph, spec: ModelSpec) -> None:
        """The registry operators of the dense nodes, in topological order, and the loss."""
        self.emb_node = {graph.nodes[n]["op"].attr("group"): n for n in graph.nodes
                         if graph.nodes[n]["op"].kind == "packed_embedding"}
        self.node_group = {n: g for g, n in self.emb_node.items()}
        self.dense_node = next((n for n in graph.nodes if graph.nodes[n]["op"].kind == "dense_input"), None)
        self.dense_columns = graph.nodes[self.dense_node]["op"].attr("columns", ()) if self.dense_node else ()
        self.steps: list[NodeStep] = []
        ops = {}
        for name in nx.lexicographical_topological_sort(graph):
            op: Op = graph.nodes[name]["op"]
            if OP_KINDS[op.kind].role != "dense":
                continue
            slots = tuple(input_slots(graph, name))
            config = dict(op.attrs)
            written = next((m for m in spec.modules if m.name == name), None) if op.kind in DRY_RUN_KINDS else None
            if written is not None:  # the user's params as written: a plan's attrs hold mappings as pairs
                config["params"] = thaw(written.param("params", FrozenMapping()))
            try:
                ops[name] = registry.create(op.kind, config, [s.shape for s in slots])
            except CustomModuleError as exc:  # two custom modules may share a class: name the one at fault
                raise CustomModuleError(f"module {name!r}: {exc}") from None
            if isinstance(ops[name], CustomModule):
                ops[name].label = name  # named in an error its forward raises (custom_failure)
            self.steps.append(NodeStep(name, op.kind, slots, tuple(op.attr("members", ())),
                                       tuple(op.attr("member_ports", ()))))
        self.ops = OpModules(ops)
        self.packed_members = {step.name: tuple(graph.nodes[step.name]["op"].attr(named))
                               for step in self.steps if (named := OP_KINDS[step.kind].named_outputs)}
        self.gathers = self._gathers()
        self.source_mlps, self.skipped = _source_mlps(graph, self.steps, self.gathers, self.ops)
        self.fuse_sources = True  # False: every module called on its gathered input (op calibration)
        loss_name = next(n for n in graph.nodes if graph.nodes[n]["op"].kind == "loss")
        loss_op: Op = graph.nodes[loss_name]["op"]
        self.head_nodes = [s.source for s in input_slots(graph, loss_name)
                           if graph.nodes[s.source]["op"].kind == "head"]
        self.head_names = tuple(loss_op.attr("heads", ()))
        self.loss = registry.create("loss", dict(loss_op.attrs), [])
        self.tasks = tuple(graph.nodes[h]["op"].attr("task", "binary") for h in self.head_nodes)
        self.head_widths = tuple(graph.nodes[h]["op"].attr("out", 1) for h in self.head_nodes)
        self.ops.to(self.device)
        self.loss.to(self.device)

    def _bind_noise(self, seed: int) -> None:
        """Dropout layers are reseeded every step from (seed, steps taken); the step count is a
        buffer of the model's state (only when it has dropout), so a checkpoint carries it. Over
        several ranks, batch norm layers sum their statistics over the ranks."""
        self.noise = [m for m in self.ops.modules() if isinstance(m, SeededDropout)]
        self.noise_seed = seed
        self.custom = any(isinstance(m, CustomModule) for m in self.ops.modules())
        # custom modules that cannot train on a batch of one row (batch norm): such a batch is skipped
        self.one_row_refusers = tuple(m for m in self.ops.modules() if isinstance(m, CustomModule) and m.one_row)
        if self.world is not None:  # batch norm by the global batch's statistics
            from flowrec.runtime.distributed.data_parallel import sum_over_ranks

            for module in self.ops.modules():
                if isinstance(module, GhostBatchNorm):
                    module.reduce = sum_over_ranks
        if self.noise:
            self.register_buffer("noise_steps", torch.zeros((), dtype=torch.int64))

    def reseed_noise(self, first_row: int = 0) -> None:
        """Seed every dropout layer for the next training step and count the step (`first_row`:
        this rank's first row of the global batch, so its masks are the one-process masks)."""
        if not self.noise:
            return
        base = self.noise_seed * NOISE_MIX + int(self.noise_steps)
        for i, module in enumerate(self.noise):
            module.reseed((base * NOISE_MIX + i) % (1 << 63), first_row)
        self.noise_steps += 1

    def seed_custom(self, step: int, rank: int = 0) -> None:
        """Seed torch's process generator for training step `step` (0-based) of rank `rank`, when
        the model has custom modules: a user's module may draw from it (`nn.Dropout`, `torch.rand`),
        and an unseeded generator starts anywhere in a new process (torch seeds it at random), so
        two runs of one seed, or a run and its resumed copy, would draw other numbers. Seeded from
        (seed, step, rank) they draw the same at every step, whatever ran before. flowrec's own
        dropout never reads this generator (`reseed_noise`). The device runtime seeds the host's
        generator and the device's (`DeviceRuntime.seed`), not `torch.manual_seed`'s every
        accelerator type: that cost a 1.4 ms step 0.12 ms on a CPU-only build."""
        if self.custom:
            self.seed_process(step, rank)

    def seed_process(self, step: int, rank: int = 0) -> None:
        """Seed torch's process generators (the host's and the device's) for training step `step` of
        rank `rank`, from the model's seed: `seed_custom` at every step of a model with custom
        modules, and the trainer once as a new run starts, so that what a checkpoint records of them
        is the run's, not whatever a process happened to start with."""
        runtime_for(self.device).seed(((self.noise_seed * NOISE_MIX + step) * NOISE_MIX + rank) % (1 << 63))

    def dense_parameters(self) -> list[nn.Parameter]:
        """Parameters trained by torch.optim (packed tables are updated in their backward)."""
        return [p for p in self.parameters() if p.requires_grad]

    def embed(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Packed lookups of every group, in the plan's group order.  # {group: (B, S, D)}

        K-interleaving: with `interleave` on and both host-side groups (host, static_hot,
        lookahead: host gathers, cache exchanges) and device groups, the host-side groups are
        looked up on a worker thread while this thread gathers the device groups.
        """
        if self.world is not None:  # every group's exchanges together, on every rank
            from flowrec.runtime.distributed.model import embed_all

            return embed_all(self, batch, self.interleave)
        side = [n for n in self.group_order if n in self.host_side]
        if not (self.interleave and side and len(side) < len(self.group_order)):
            return {name: self._lookup(name, batch) for name in self.group_order}
        grad = torch.is_grad_enabled()
        pending = self._pool().submit(self._lookups, side, batch, grad)
        out = {name: self._lookup(name, batch) for name in self.group_order if name not in side}
        out.update(pending.result())
        return {name: out[name] for name in self.group_order}

    def _lookups(self, names: list[str], batch: Batch, grad: bool) -> dict[str, torch.Tensor]:
        with torch.set_grad_enabled(grad):  # grad mode is per thread
            return {name: self._lookup(name, batch) for name in names}

    def _lookup(self, name: str, batch: Batch) -> torch.Tensor:
        module = self.embeddings[name]
        ids = batch.groups[name]
        if getattr(module, "takes_group_ids", False):  # caches read the staged lookahead rows
            return module.forward_group(ids).to(self.device, non_blocking=True)
        table_dev = module.weight.device
        emb = module(ids.ids.to(table_dev, non_blocking=True),
                     ids.offsets.to(table_dev, non_blocking=True), ids.casting)
        return emb.to(self.device, non_blocking=True) if table_dev != self.device else emb

    def _pool(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(1, thread_name_prefix="flowrec-k-interleave")
        return self._executor

    def set_interleave(self, on: bool) -> None:
        """Overlap (K-interleaving here, threaded cache exchanges in the modules) or run sequentially."""
        self.interleave = on
        for module in self.embeddings.values():
            if hasattr(module, "interleave"):
                module.interleave = on

    def close(self) -> None:
        """Stop the K-interleaving worker and the embedding modules' own workers; drop the
        compiled dense stage."""
        self.compiled = None
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        for module in self.embeddings.values():
            close = getattr(module, "close", None)
            if close is not None:
                close()
        if self.managed is not None:
            self.managed.close()

    def assigned(self, device: torch.device) -> None:
        """After a lowering on the meta device was assigned a checkpoint's tensors on `device`
        (`load_state_dict(assign=True)`: `flowrec.serving.trained.load_trained` with mmap): the
        constants the lowering made from the plan, which no state holds (the column gathers'
        indices), are made on `device` too. Left on meta, a permuted gather read garbage in eager
        scoring and failed `flowrec export` (wide_1000: "found at least two devices, cpu and meta")."""
        self.device = torch.device(device)
        self.gathers = self._gathers()

    def compile_dense(self, on: bool = True) -> CompiledCall | None:
        """Run the training dense stage compiled (`torch.compile` through the device runtime,
        eager where compiling fails) or eagerly (`on` False). Evaluation (no grad) stays eager:
        its shapes and graphs differ and it runs too rarely to repay a compile. One process only
        (DDP wraps the eager forward)."""
        self.compiled = runtime_for(self.device).compile(self._dense_eager) if on and self.world is None else None
        return self.compiled

    def dense_forward(self, dense: torch.Tensor, emb: dict[str, torch.Tensor],
                      masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """Dense stage: every dense node in topological order (compiled when `compile_dense`
        was asked for and grad is on).

        Args:
            dense: dense features.  # (B, n_dense)
            emb: packed lookups.  # {group: (B, S, D)}
            masks: valid positions per target-attention node (`sequence_masks`).  # {node: (B, L)}

        Returns:
            Logits, one column per head (one per class of a multiclass head).  # (B, sum of head widths)
        """
        if self.compiled is not None and torch.is_grad_enabled():
            return self.compiled(dense, emb, masks)
        return self._dense_eager(dense, emb, masks)

    def _dense_eager(self, dense: torch.Tensor, emb: dict[str, torch.Tensor],
                     masks: dict[str, torch.Tensor]) -> torch.Tensor:
        values: dict[str, torch.Tensor] = {}
        for step in self.steps:
            op = self.ops[step.name]
            if step.name in self.skipped and self.fuse_sources:  # its one reader takes its sources
                continue
            if step.name in self.source_mlps and self.fuse_sources:
                gather = self.gathers[self.source_mlps[step.name]]
                values[step.name] = op.forward_sources(self._sources(gather, dense, emb, values), gather.inverse)
                continue
            if step.name in self.gathers:
                values[step.name] = op(self._gathered(self.gathers[step.name], dense, emb, values))
                continue
            inputs = [self._slot_value(s, dense, emb, values) for s in step.slots]
            values[step.name] = CALLS[OP_KINDS[step.kind].inputs](op, step, inputs, masks)
        return torch.cat([_at_least_fp32(values[h]).flatten(1) for h in self.head_nodes], dim=1)

    def run_step(self, step: NodeStep, inputs: list[torch.Tensor], masks: dict[str, torch.Tensor]) -> torch.Tensor:
        """One dense node on its assembled inputs, by its kind's input convention."""
        return CALLS[OP_KINDS[step.kind].inputs](self.ops[step.name], step, inputs, masks)

    def _slot_value(self, slot: Slot, dense: torch.Tensor, emb: dict[str, torch.Tensor],
                    values: dict[str, torch.Tensor]) -> torch.Tensor:
        if slot.source == self.dense_node:
            if tuple(slot.fields) == tuple(self.dense_columns) or not slot.fields:
                return dense
            idx = [self.dense_columns.index(f) for f in slot.fields]
            return dense[:, idx]
        if slot.source in self.node_group:
            group = self.node_group[slot.source]
            return _select_fields(emb[group], self.group_map[group], slot.fields)
        value = values[slot.source]
        if slot.fields and slot.source in self.packed_members:  # one named output (member, head)
            return value[:, self.packed_members[slot.source].index(slot.fields[0])]  # (B, Out)
        return value

    def _gathers(self) -> dict[str, FlatGather]:
        """The column gathers of the dense nodes that take one, on the model's device."""
        return {step.name: gather for step in self.steps if OP_KINDS[step.kind].gathers
                and len(step.slots) >= GATHER_MIN_SLOTS
                for gather in [self._flat_gather(step)] if gather is not None}

    def _flat_gather(self, step: NodeStep) -> FlatGather | None:
        """The column gather of a node's flat inputs (None when a slot is not a plain column set)."""
        sources: dict[str, int] = {}  # source -> first column in the concatenation
        width = 0
        columns = []
        for slot in step.slots:
            if slot.source == self.dense_node:
                full = len(self.dense_columns)
                cols = [self.dense_columns.index(f) for f in slot.fields] if slot.fields else range(full)
            elif slot.source in self.node_group:
                group = self.group_map[self.node_group[slot.source]]
                full = group.bags_per_sample * group.dim
                bags = group.field_bags()
                cols = [c for f in slot.fields for c in range(bags[f].start * group.dim, bags[f].stop * group.dim)] \
                    if slot.fields else range(full)
            elif not slot.fields and slot.shape:
                full = math.prod(int(d) for d in slot.shape)
                cols = range(full)
            else:
                return None
            if slot.source not in sources:
                sources[slot.source] = width
                width += full
            columns.extend(sources[slot.source] + c for c in cols)
        if columns == list(range(width)):
            return FlatGather(tuple(sources), None)
        index = torch.tensor(columns, dtype=torch.int64, device=self.device)
        inverse = None
        if sorted(columns) == list(range(width)):  # a permutation: each source column used once
            inverse = torch.empty_like(index)
            inverse[index] = torch.arange(width, device=self.device)
        return FlatGather(tuple(sources), index, inverse)

    def _sources(self, gather: FlatGather, dense: torch.Tensor, emb: dict[str, torch.Tensor],
                 values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
        """The whole sources of a `FlatGather`, in its order, as they are (B, ...)."""
        parts = []
        for source in gather.sources:
            if source == self.dense_node:
                parts.append(dense)
            elif source in self.node_group:
                parts.append(emb[self.node_group[source]])
            else:
                parts.append(values[source])
        return parts

    def _gathered(self, gather: FlatGather, dense: torch.Tensor, emb: dict[str, torch.Tensor],
                  values: dict[str, torch.Tensor]) -> torch.Tensor:
        """A node's flat input assembled by its `FlatGather`.  # (B, In)"""
        flat = concat_flat(self._sources(gather, dense, emb, values))  # (B, sum of source widths)
        if gather.index is None:
            return flat
        index = gather.index  # (a `.to(device)` even of its own device exports that device: serving moves it)
        return flat.index_select(1, index if index.device == flat.device else index.to(flat.device))

    def sequence_masks(self, batch: Batch) -> dict[str, torch.Tensor]:
        """Valid positions of each sequence-reading node's sequence: its non-empty bags."""
        masks = {}
        for step in self.steps:
            seq_slot = OP_KINDS[step.kind].sequence_slot
            if seq_slot is None:
                continue
            slot = step.slots[seq_slot]
            group_name = self.node_group[slot.source]
            group = self.group_map[group_name]
            offsets = batch.groups[group_name].offsets
            lengths = (offsets[1:] - offsets[:-1]).view(-1, group.bags_per_sample)[: batch.size]  # (B, S): no drawn items
            bags = group.field_bags()[slot.fields[0]]
            masks[step.name] = (lengths[:, bags] > 0).to(self.device, non_blocking=True)  # (B, L)
        return masks

    def forward(self, batch: Batch) -> torch.Tensor:
        dense = batch.dense.to(self.device, non_blocking=True)
        return self.dense_forward(dense, self.embed(batch), self.sequence_masks(batch))


def _source_mlps(graph: nx.DiGraph, steps: list[NodeStep], gathers: dict[str, FlatGather],
                 ops: nn.ModuleDict) -> tuple[dict[str, str], frozenset[str]]:
    """MLPs that take their gathered input as its whole sources ({mlp: node whose gather it
    takes}), and the concat nodes they make unnecessary.

    An MLP's first layer is linear in its input, so a permutation of the input's columns is a
    permutation of the layer's weight columns (`MLP.forward_sources`): the (B, In) gather and its
    scatter in the backward (the largest copies of a wide model's step) become a gather of the
    (Out, In) weight. Taken: an MLP whose own input is a permutation gather, or whose one input is
    a concat node's permutation gather read by nothing else.
    """
    kinds = {step.name: step for step in steps}
    fused: dict[str, str] = {}
    skipped = set()
    for step in steps:
        if step.kind != "mlp" or not hasattr(ops[step.name], "forward_sources"):
            continue
        if step.name in gathers:
            owner = step.name
        elif (len(step.slots) == 1 and not step.slots[0].fields and step.slots[0].source in gathers
              and kinds.get(step.slots[0].source, step).kind == "concat"
              and graph.out_degree(step.slots[0].source) == 1):
            owner = step.slots[0].source
            skipped.add(owner)
        else:
            continue
        gather = gathers[owner]
        if gather.index is None or gather.inverse is not None:
            fused[step.name] = owner
        else:
            skipped.discard(owner)
    return fused, frozenset(skipped)


def _select_fields(out: torch.Tensor, group: PackedGroup, fields: tuple[str, ...]) -> torch.Tensor:
    """The bags of `fields` from a packed lookup.  # (B, S_sel, D)"""
    if not fields:
        return out
    bags = group.field_bags()
    slices = [bags[f] for f in fields]
    runs = [[slices[0].start, slices[0].stop]]  # the bags as runs of adjacent ones
    for s in slices[1:]:
        if s.start == runs[-1][1]:
            runs[-1][1] = s.stop
        else:
            runs.append([s.start, s.stop])
    if len(runs) == 1:  # contiguous: a view
        return out[:, runs[0][0]:runs[0][1]]
    if torch.compiler.is_exporting():  # the runs side by side: an index of the bags (`torch.arange`) is
        # exported on the traced device
        return torch.cat([out[:, start:stop] for start, stop in runs], dim=1)
    # training: one gather, whose backward is one scatter (a cat of R runs backs out R slices, each
    # into zeros of the whole width)
    index = torch.cat([torch.arange(start, stop) for start, stop in runs]).to(out.device)
    return out.index_select(1, index)


def _embeddings(groups: tuple[PackedGroup, ...], seed: int, device: torch.device,
                world: Any = None) -> dict[str, nn.Module]:
    """One embedding module per group for its placement (and its sharding over `world`'s ranks).
    Raises GroupAllocationError naming the group."""
    if world is not None:
        from flowrec.runtime.distributed.model import sharded_embeddings

        return sharded_embeddings(groups, seed, device, world)
    out = {}
    for g in groups:
        try:
            out[g.name] = group_embedding(g, seed, device)
        except (torch.OutOfMemoryError, MemoryError, RuntimeError) as exc:
            if not out_of_memory(exc):
                raise
            raise GroupAllocationError(g, first_line(exc)) from None
    return out


def _call_args(op: nn.Module, step: NodeStep, inputs: list[torch.Tensor], masks: dict[str, torch.Tensor]):
    return op(*inputs)


def _call_flat(op: nn.Module, step: NodeStep, inputs: list[torch.Tensor], masks: dict[str, torch.Tensor]):
    return op(concat_flat(inputs))  # (B, In)


def _call_stacked(op: nn.Module, step: NodeStep, inputs: list[torch.Tensor], masks: dict[str, torch.Tensor]):
    stacked = torch.stack([concat_flat(inputs[a:b]) for a, b in step.member_ports])  # (K, B, In)
    return op(stacked).transpose(0, 1)  # (B, K, Out)


def _call_attention(op: nn.Module, step: NodeStep, inputs: list[torch.Tensor], masks: dict[str, torch.Tensor]):
    query, seq = inputs[0], inputs[1]  # (B, ...), (B, L, D)
    return op(flat_rows(query), seq, masks[step.name])


def _call_sequence(op: nn.Module, step: NodeStep, inputs: list[torch.Tensor], masks: dict[str, torch.Tensor]):
    return op(inputs[0], masks[step.name], *[flat_rows(x) for x in inputs[1:]])  # (B, L, D), (B, L) [, (B, D)]


# How a dense operator takes its inputs, by the input convention of its kind (`kinds.OP_KINDS`).
CALLS = {"args": _call_args, "flat": _call_flat, "stacked": _call_stacked, "attention": _call_attention,
         "sequence": _call_sequence}


def lower(plan: Plan, spec: ModelSpec, device: torch.device | str = "cpu", seed: int | None = None,
          world: Any = None) -> LoweredModel:
    """Build the trainable model of `plan` on `device` (seed: the spec's training seed by default;
    `world`: this rank's part of a distributed run)."""
    return LoweredModel(plan, spec, device, spec.training.seed if seed is None else seed, world=world)


def _at_least_fp32(x: torch.Tensor) -> torch.Tensor:
    """Logits in fp32 (bf16 autocast outputs) or wider (a float64 model keeps float64)."""
    return x if x.dtype in (torch.float32, torch.float64) else x.float()  # (`.float()` exports a device check)
