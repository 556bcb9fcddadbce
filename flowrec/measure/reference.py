"""The unpacked reference model: what a user writes in plain PyTorch, with flowrec's exact init.

One `nn.EmbeddingBag` per logical table (shared tables shared), looked up field by field
(packed ids of a `Batch` are unpacked by subtracting the table's row offset), with autograd
gradients (dense by default, `sparse=True` optional), and the SAME dense part as flowrec: a
`LoweredModel` built without packed tables (so its dense init is flowrec's) whose
`dense_forward` consumes the lookups. Every table starts from `init_table_rows`, as flowrec's
packed tables do, so the two models are equal at step 0 and train to allclose parameters.

Training is torch.optim on everything: `reference_optimizers` gives the spec's dense optimizer
for the dense part and, for the tables, the torch.optim form of the spec's sparse optimizer
(sgd, adagrad) or `TorchRowwiseAdagrad` below (it has no torch.optim form); `plain=True` gives what
simple CTR libraries do instead: Adam on everything.

Example:
    >>> ref = ReferenceModel(plan, spec)  # doctest: +SKIP
    >>> optimizers = reference_optimizers(ref, spec)  # doctest: +SKIP
    >>> loss = reference_step(ref, optimizers, batch)  # doctest: +SKIP
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from torch import nn

from flowrec.data.batches import Batch
from flowrec.graph.types import PackedGroup, Plan
from flowrec.runtime.lowering import LoweredModel
from flowrec.runtime.step import autocast_context, make_dense_optimizer
from flowrec.spec.model import ModelSpec
from operators.embedding import init_table_rows


def bag_slots(group: PackedGroup, ids: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Bag position within its sample (s of bag b * S + s) of every id.  # (nnz,) int64"""
    lengths = offsets[1:] - offsets[:-1]  # (B * S,)
    bags = torch.arange(lengths.numel(), device=ids.device) % group.bags_per_sample
    return torch.repeat_interleave(bags, lengths, output_size=ids.numel())


def unpack_field(group: PackedGroup, field: str, ids: torch.Tensor, offsets: torch.Tensor,
                 slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The ids (table-local) and bag offsets of one field of a packed batch.

    Args:
        group: the packed layout.
        field: a feature of the group.
        ids: packed row ids.  # (nnz,) int64
        offsets: bag boundaries, bag = b * S + s.  # (B * S + 1,) int64
        slots: `bag_slots(group, ids, offsets)`, when already computed.

    Returns:
        (ids minus the table's row offset (n,), offsets of the field's B * width bags (B * width + 1,)).
    """
    spec = next(f for f in group.fields if f.feature == field)
    row_offset = group.row_offsets[spec.table]
    per_sample = group.bags_per_sample
    bags = group.field_bags()[field]
    lengths = (offsets[1:] - offsets[:-1]).view(-1, per_sample)  # (B, S)
    slot = bag_slots(group, ids, offsets) if slots is None else slots
    keep = (slot >= bags.start) & (slot < bags.stop)
    field_lengths = lengths[:, bags].reshape(-1)  # (B * width,)
    field_offsets = torch.zeros(field_lengths.numel() + 1, dtype=torch.int64, device=ids.device)
    torch.cumsum(field_lengths, 0, out=field_offsets[1:])
    return ids[keep] - row_offset, field_offsets


class ReferenceModel(nn.Module):
    """Per-table `nn.EmbeddingBag`s + flowrec's dense part, on the same `Batch` objects.

    Args:
        plan: the plan flowrec lowers (its groups say how the batch ids are packed).
        spec: the spec.
        device: compute device.
        seed: model seed (the same as flowrec's gives the same initial parameters).
        sparse: sparse gradients for the tables (`nn.EmbeddingBag(sparse=True)`).
        max_rows: optional cap on rows per table (ids wrap modulo the cap), for memory-bound
            baselines; None keeps flowrec's exact tables.

    Example:
        >>> ref = ReferenceModel(plan, spec, seed=0)  # doctest: +SKIP
        >>> ref(batch).shape  # doctest: +SKIP
        torch.Size([4096, 1])
    """

    def __init__(self, plan: Plan, spec: ModelSpec, device: torch.device | str = "cpu", seed: int | None = None,
                 sparse: bool = False, max_rows: int | None = None):
        super().__init__()
        seed = spec.training.seed if seed is None else seed
        self.dense_model = LoweredModel(plan, spec, device, seed, tables=False)
        self.device = self.dense_model.device
        self.groups = self.dense_model.groups
        self.max_rows = max_rows
        self.tables = nn.ModuleList()
        self.table_index: dict[str, int] = {}
        for group in self.groups:
            for slot in group.tables:
                rows = slot.rows if max_rows is None else min(slot.rows, max_rows)
                bag = nn.EmbeddingBag(rows, group.dim, mode="sum", sparse=sparse, device=self.device)
                with torch.no_grad():
                    bag.weight.copy_(init_table_rows(slot.table, slot.rows, group.dim, seed)[:rows])
                self.table_index[slot.table] = len(self.tables)
                self.tables.append(bag)

    def table(self, name: str) -> nn.EmbeddingBag:
        """The embedding bag of logical table `name`."""
        return self.tables[self.table_index[name]]

    def table_parameters(self) -> list[nn.Parameter]:
        return list(self.tables.parameters())

    def dense_parameters(self) -> list[nn.Parameter]:
        return self.dense_model.dense_parameters()

    def field_inputs(self, batch: Batch) -> dict[str, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Per-field (table-local ids, bag offsets) of a batch, as a per-field data loader gives them."""
        out = {}
        for group in self.groups:
            packed = batch.groups[group.name]
            ids, offsets = packed.ids.to(self.device), packed.offsets.to(self.device)
            slots = bag_slots(group, ids, offsets)
            out[group.name] = [unpack_field(group, f.feature, ids, offsets, slots) for f in group.fields]
        return out

    def embed(self, batch: Batch, fields: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None
              ) -> dict[str, torch.Tensor]:
        """Per-field lookups (of `fields`, default `field_inputs(batch)`), stacked per group.  # {group: (B, S, D)}"""
        fields = self.field_inputs(batch) if fields is None else fields
        out = {}
        for group in self.groups:
            size = batch.dense.shape[0]
            pooled_fields = []
            for field, (local, bag_offsets) in zip(group.fields, fields[group.name]):
                table = self.table(field.table)
                if self.max_rows is not None:
                    local = local % table.num_embeddings
                mode = "mean" if field.pooling == "mean" else "sum"
                pooled = nn.functional.embedding_bag(local, table.weight, bag_offsets, mode=mode,
                                                     sparse=table.sparse, include_last_offset=True)
                pooled_fields.append(pooled.view(size, -1, group.dim))  # (B, width, D)
            out[group.name] = torch.cat(pooled_fields, dim=1)
        return out

    def forward(self, batch: Batch) -> torch.Tensor:
        dense = batch.dense.to(self.device)
        return self.dense_model.dense_forward(dense, self.embed(batch), self.dense_model.sequence_masks(batch))


class TorchRowwiseAdagrad(torch.optim.Optimizer):
    """Row-wise Adagrad written out for dense gradients (FBGEMM's EXACT_ROWWISE_ADAGRAD).

    s_r += mean_d(g_rd^2); w_r -= lr g_r / (sqrt(s_r) + eps), for the rows that received gradient
    (an all-zero gradient row is left alone, as a fused optimizer never sees it).

    Example:
        >>> w = nn.Parameter(torch.ones(3, 2)); w.grad = torch.tensor([[1., 1.], [0., 0.], [2., 2.]])
        >>> TorchRowwiseAdagrad([w], lr=0.1).step(); w[1].tolist()
        [1.0, 1.0]
    """

    def __init__(self, params, lr: float, eps: float = 1e-8, initial_accumulator_value: float = 0.0):
        super().__init__(params, {"lr": lr, "eps": eps, "initial_accumulator_value": initial_accumulator_value})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "sum" not in state:
                    state["sum"] = torch.full((p.shape[0], 1), group["initial_accumulator_value"],
                                              dtype=p.dtype, device=p.device)
                grad = p.grad.to_dense() if p.grad.is_sparse else p.grad
                rows = grad.ne(0).any(dim=1).nonzero().squeeze(1)  # (U,)
                g = grad.index_select(0, rows)  # (U, D)
                s = state["sum"].index_select(0, rows).add_(g.square().mean(dim=1, keepdim=True))
                state["sum"].index_copy_(0, rows, s)
                p.index_add_(0, rows, g / (s.sqrt() + group["eps"]), alpha=-group["lr"])


def table_optimizer(model: ReferenceModel, spec: ModelSpec) -> torch.optim.Optimizer:
    """torch.optim form of the spec's sparse optimizer over the reference tables."""
    opt = spec.sparse_optimizer
    params = dict(opt.params)
    tables = model.table_parameters()
    if opt.name == "sgd":
        return torch.optim.SGD(tables, lr=opt.lr)
    if opt.name == "adagrad":
        return torch.optim.Adagrad(tables, lr=opt.lr, eps=params.get("eps", 1e-10),
                                   initial_accumulator_value=params.get("initial_accumulator_value", 0.0))
    if opt.name == "rowwise_adagrad":
        return TorchRowwiseAdagrad(tables, lr=opt.lr, eps=params.get("eps", 1e-8),
                              initial_accumulator_value=params.get("initial_accumulator_value", 0.0))
    raise ValueError(f"sparse optimizer {opt.name!r} has no reference form (use sgd, adagrad or rowwise_adagrad)")


def reference_optimizers(model: ReferenceModel, spec: ModelSpec, plain: bool = False) -> list[torch.optim.Optimizer]:
    """The reference's optimizers: the spec's (dense + table form), or Adam on everything (`plain`)."""
    dense = spec.dense_optimizer
    if plain:
        return [torch.optim.Adam(model.dense_parameters() + model.table_parameters(), lr=dense.lr)]
    return [make_dense_optimizer(model.dense_model, dense.name, dense.lr, dict(dense.params)),
            table_optimizer(model, spec)]


def reference_step(model: ReferenceModel, optimizers: list[torch.optim.Optimizer], batch: Batch,
                   precision: str = "fp32",
                   fields: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] | None = None) -> float:
    """One plain-PyTorch training step (autocast of the dense part for bf16); returns the loss.

    `fields`: the batch's `model.field_inputs(batch)` when prepared ahead (else unpacked here).
    """
    for opt in optimizers:
        opt.zero_grad(set_to_none=True)
    emb = model.embed(batch, fields)
    dense = batch.dense.to(model.device)
    labels = batch.labels.to(model.device)
    with autocast_context(model.device, precision):
        logits = model.dense_model.dense_forward(dense, emb, model.dense_model.sequence_masks(batch))
    loss = model.dense_model.loss(logits, labels)
    loss.backward()
    for opt in optimizers:
        opt.step()
    return float(loss.detach())
