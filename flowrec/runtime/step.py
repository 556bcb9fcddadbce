"""One training step following the plan's stages: sparse lookups, dense (micro-batched), backward.

The sparse stage looks up every packed group once for the whole batch. The dense stage runs in
`micro_batches` slices (D-interleaving); their gradients with respect to the lookups are
accumulated, and one casted backward per group then applies the fused sparse optimizer, so the
update equals the full-batch update (micro-batching preserves semantics). Dense parameters are
updated by torch.optim once per step.

Example:
    >>> loss = train_step(model, optimizer, batch, micro_batches=2)  # doctest: +SKIP
"""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import replace
from typing import Any

import torch

from flowrec.data.batches import Batch, rank_slice
from flowrec.runtime.lowering import LoweredModel
from flowrec.runtime.retrieval import candidates, embed_step, head_items, item_labels
from operators.lowp import autocast_bf16

DEFAULT_LOOKAHEAD = 1  # staging lookahead window of a run (>= 1: the casting index is built in the data stage)


def autocast_context(device: torch.device, precision: str):
    """bf16 autocast for the dense stage when the plan asks for it, else a no-op. On a CPU without
    bf16 matrix kernels its matrix products run as fp32 products of bf16 values
    (`operators.lowp`: bf16's rounding at fp32's speed, where torch's own would be emulated)."""
    if precision != "bf16":
        return nullcontext()
    return autocast_bf16(device)


def train_step(model: LoweredModel, optimizer: torch.optim.Optimizer, batch: Batch,
               micro_batches: int = 1, precision: str = "fp32", clip_grad_norm: float | None = None,
               parallel: Any = None) -> float:
    """Run one step on `batch`; returns the batch loss (mean over samples, weighted over heads).

    `clip_grad_norm` clips the global L2 norm of the dense parameters' gradients before the dense
    update (embedding rows are updated by their fused optimizer in the backward, unclipped).
    `parallel` (a `distributed.DenseParallel`, several ranks): `batch` is this rank's slice of a
    global batch, the dense forward runs through DDP, and the loss is this rank's share of the
    global batch's mean, agreed over the ranks (the returned loss is the global one). Every rank
    then runs the same micro-batches, some possibly empty.
    """
    optimizer.zero_grad(set_to_none=True)
    model.reseed_noise(0 if parallel is None else parallel.first_row(batch.samples_in_step))  # dropout masks
    dense = batch.dense.to(model.device, non_blocking=True)
    binding = getattr(model, "retrieval", None)
    labels = item_labels(binding, batch, batch.labels).to(model.device, non_blocking=True)
    masks = model.sequence_masks(batch)
    batch, emb, negatives, neg_rows = embed_step(model, binding, batch)  # sparse stage: {group: (B, S, D)}
    size = dense.shape[0]
    chunks = max(1, micro_batches) if parallel is not None else max(1, min(micro_batches, size))
    if getattr(model, "one_row_refusers", ()):  # a custom module that cannot train on one row: no such micro-batch
        chunks = max(1, min(chunks, min(_shares(parallel, batch.samples_in_step, size)) // 2))
    if binding is not None:  # in-batch negatives are the whole batch: one softmax, one chunk
        chunks = 1
    if chunks == 1:
        with autocast_context(model.device, precision):
            logits = _dense(model, parallel, dense, emb, masks, True)  # (B, n_heads)
            cands = candidates(model, binding, negatives, neg_rows)
            if parallel is not None and binding is not None and not binding.sampled:  # every rank's items
                cands = replace(cands, batch=parallel.gather_items(*head_items(model, binding, logits, labels)))
        loss = _loss(model, parallel, logits, labels, batch.samples_in_step, 1.0, cands)
        loss.backward()
        _dense_update(optimizer, clip_grad_norm)
        return _reported(parallel, loss)
    leaves = {g: e.detach().requires_grad_(True) for g, e in emb.items()}
    bounds = torch.linspace(0, size, chunks + 1).round().long().tolist()
    total = 0.0
    for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
        if hi <= lo and parallel is None:
            continue
        part = {g: e[lo:hi] for g, e in leaves.items()}
        part_masks = {k: m[lo:hi] for k, m in masks.items()}
        with autocast_context(model.device, precision):
            logits = _dense(model, parallel, dense[lo:hi], part, part_masks, i == chunks - 1)
        loss = _loss(model, parallel, logits, labels[lo:hi], batch.samples_in_step, (hi - lo) / max(size, 1))
        loss.backward()
        total += _reported(parallel, loss)
    torch.autograd.backward([emb[g] for g in leaves], [leaves[g].grad for g in leaves])
    _dense_update(optimizer, clip_grad_norm)
    return total


def one_row_skip(model: Any, batch: Batch, parallel: Any = None) -> int:
    """The rows of `batch` to skip rather than train: all of them where `model` holds a custom
    module that cannot train on one row (`LoweredModel.one_row_refusers`: batch norm) and the batch,
    or with several ranks any rank's share of the global batch, holds one row (every rank decides
    alike from the global batch's size, and all skip the step together); else 0. Deterministic:
    a resumed run skips the same batches."""
    return batch.samples_in_step if gives_one_row(model, batch.samples_in_step, batch.size, parallel) else 0


def gives_one_row(model: Any, global_size: int, size: int, parallel: Any = None) -> bool:
    """A batch of `global_size` rows (`size` of them this process's) gives a custom module of
    `model` that cannot train on one row one row: in one process, or as some rank's share."""
    return bool(getattr(model, "one_row_refusers", ())) and 1 in _shares(parallel, global_size, size)


def _shares(parallel: Any, global_size: int, size: int) -> list[int]:
    """The rows each rank trains of a global batch of `global_size` (none empty, at least one),
    or [size] in one process."""
    if parallel is None:
        return [size]
    world = parallel.world.size
    return [hi - lo for lo, hi in (rank_slice(global_size, world, r) for r in range(world)) if hi > lo] or [0]


def _dense(model: LoweredModel, parallel: Any, dense: torch.Tensor, emb: dict[str, torch.Tensor],
           masks: dict[str, torch.Tensor], sync: bool) -> torch.Tensor:
    """Logits of the dense stage: the model's own, or through DDP (`sync`: all-reduce this
    backward's gradients).  # (B, n_heads)"""
    if parallel is None:
        return model.dense_forward(dense, emb, masks)
    return parallel.forward(dense, emb, masks, sync)


def _loss(model: LoweredModel, parallel: Any, logits: torch.Tensor, labels: torch.Tensor,
          global_size: int, share: float, cands: Any = None) -> torch.Tensor:
    """The loss to differentiate: a micro-batch's `share` of the batch mean in one process; a
    rank's samples' share of the global batch's mean with several (`cands`: a retrieval head's
    candidates, `flowrec.runtime.retrieval.candidates`)."""
    if parallel is None:
        return model.loss(logits, labels, cands) * share
    return parallel.loss(logits, labels, global_size, cands)


def _reported(parallel: Any, loss: torch.Tensor) -> float:
    """The loss to report: this process's, or the one the ranks agreed on (global)."""
    return float(loss.detach()) if parallel is None else parallel.last.loss


def _dense_update(optimizer: torch.optim.Optimizer, clip_grad_norm: float | None) -> None:
    """Clip the dense gradients' global norm when asked, then step the dense optimizer."""
    if clip_grad_norm is not None:
        params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        torch.nn.utils.clip_grad_norm_(params, clip_grad_norm)
    optimizer.step()


def make_dense_optimizer(model: LoweredModel, name: str, lr: float, params: dict[str, float]) -> torch.optim.Optimizer:
    """torch.optim optimizer of the dense parameters from the spec's dense optimizer.

    Fused (one multi-tensor kernel for every parameter, `fused=True`) where torch has the fused
    kernel for the parameters' device and dtype, else torch's default implementation: the same
    update rule, one step of per-tensor element-wise ops less per parameter.
    """
    dense = model.dense_parameters() or [torch.nn.Parameter(torch.zeros(0))]  # towers of embeddings alone
    wd = params.get("weight_decay", 0.0)
    if name == "adam":
        return _fused_if_possible(torch.optim.Adam, dense, lr=lr, betas=(params.get("beta1", 0.9), params.get("beta2", 0.999)),
                                  eps=params.get("eps", 1e-8), weight_decay=wd)
    if name == "adagrad":
        return _fused_if_possible(torch.optim.Adagrad, dense, lr=lr, eps=params.get("eps", 1e-10), weight_decay=wd,
                                  initial_accumulator_value=params.get("initial_accumulator_value", 0.0))
    if name == "sgd":
        return _fused_if_possible(torch.optim.SGD, dense, lr=lr, momentum=params.get("momentum", 0.0), weight_decay=wd)
    raise ValueError(f"dense optimizer {name!r} is not supported (use adam, adagrad or sgd)")


def _fused_if_possible(kind: type, params: list, **options: Any) -> torch.optim.Optimizer:
    """`kind(params, fused=True, ...)` where torch supports it for these parameters, else unfused;
    on the CPU, small parameter sets step on one thread (`one_thread_steps`). Support is probed by
    a step of a one-element parameter of each device and dtype (`_fused_steps`): torch checks some
    (Adagrad's fused kernel on CUDA) only at the first step, not when the optimizer is made."""
    optimizer = None
    if (params and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)
            and all(_fused_steps(kind, device, dtype) for device, dtype in {(p.device, p.dtype) for p in params})):
        try:
            optimizer = kind(params, fused=True, **options)
        except (RuntimeError, TypeError, ValueError):  # no fused kernel for this device / dtype / torch
            pass
    optimizer = optimizer or kind(params, **options)
    if all(p.device.type == "cpu" for p in params) and sum(p.numel() for p in params) <= ONE_THREAD_MAX_ELEMENTS:
        one_thread_steps(optimizer)
    return optimizer


_FUSED_STEPS: dict[tuple[type, torch.device, torch.dtype], bool] = {}


def _fused_steps(kind: type, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether `kind(..., fused=True)` makes and steps a parameter of `device` and `dtype` (once per
    optimizer class, device and dtype; a zero learning rate on a throwaway parameter)."""
    key = (kind, device, dtype)
    if key not in _FUSED_STEPS:
        probe = torch.nn.Parameter(torch.zeros(1, device=device, dtype=dtype))
        probe.grad = torch.zeros_like(probe)
        try:
            kind([probe], lr=0.0, fused=True).step()
            _FUSED_STEPS[key] = True
        except (RuntimeError, TypeError, ValueError):
            _FUSED_STEPS[key] = False
    return _FUSED_STEPS[key]


ONE_THREAD_MAX_ELEMENTS = 1 << 20  # parameters: up to this many, a CPU optimizer step runs on one thread


def one_thread_steps(optimizer: torch.optim.Optimizer) -> None:
    """Run every `optimizer.step()` with one intra-op thread, then restore the count.

    A dense update of a small model is well under a millisecond of element-wise work on one core,
    split into a parallel region per tensor. With two threads on a machine whose cores are shared,
    every region waits for a thread that is not running: fused Adam over DLRM's 0.5 M dense
    parameters took 0.16 ms at best and 92 ms at the median with two threads beside other
    processes, 0.22 ms at the median with one. Element-wise updates do not depend on the thread
    count: the parameters are bitwise the same.
    """
    saved: list[int] = []

    def pre(opt: Any, args: Any, kwargs: Any) -> None:
        saved.append(torch.get_num_threads())
        torch.set_num_threads(1)

    def post(opt: Any, args: Any, kwargs: Any) -> None:
        torch.set_num_threads(saved.pop())

    optimizer.register_step_pre_hook(pre)
    optimizer.register_step_post_hook(post)
