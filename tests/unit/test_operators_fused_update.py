"""The fused CPU sparse update equals a plainly written reference and the unfused torch path.

Fresh random Zipf-skewed batches with repeated ids, empty bags, sum and mean bags, dims 1 to 300,
every optimizer (with and without weight decay), several steps so Adam's per-row step counts
differ. float64: bitwise equal to the plain reference (sequential sums in casting order, every
operation rounded on its own) and to reduce-then-update; float32: allclose. Against the torch
path (whose CPU sqrt and pow are not correctly rounded, and which fuses multiply-adds): allclose.
"""
from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators.casting import Casting, casted_row_grads, compute_casting
from operators.embedding import mean_bag_flags
from operators.sparse_optim import make_optimizer
from operators.random_batches import random_batch

OPTIMIZERS = [
    ("sgd", 0.5, ()),
    ("sgd", 0.5, (("weight_decay", 0.01),)),
    ("adagrad", 0.3, (("initial_accumulator_value", 0.1),)),
    ("adagrad", 0.3, (("weight_decay", 0.02), ("eps", 1e-6))),
    ("rowwise_adagrad", 0.3, (("eps", 1e-6),)),
    ("rowwise_adagrad", 0.3, (("weight_decay", 0.02),)),
    ("adam", 0.05, (("beta1", 0.8),)),
    ("adam", 0.05, (("weight_decay", 0.01), ("beta2", 0.99))),
]
DTYPES = [torch.float64, torch.float32]
STEPS = 3


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))


def _group(dim: int, optimizer) -> PackedGroup:
    tables = (TableSlot("a", 60, 0), TableSlot("one", 1, 60), TableSlot("b", 400, 61))
    fields = (GroupField("fa", "a", 1, "sum"), GroupField("fone", "one", 3, "mean"),
              GroupField("fb", "b", 6, "sum"), GroupField("fm", "b", 4, "mean"),
              GroupField("fseq", "a", 3, "none"))
    return PackedGroup("g", dim, "fp64", optimizer, tables, fields)


def _batches(group: PackedGroup, dtype: torch.dtype, gen: torch.Generator, steps: int = STEPS):
    """(grad_out, casting) per step: Zipf ids (alpha 1.1), 30% empty pooled bags."""
    out = []
    for _ in range(steps):
        batch = random_batch(group, 40, gen, empty_prob=0.3)
        casting = compute_casting(batch.ids, batch.offsets, mean_bag_flags(group))
        grad_out = torch.randn(casting.num_bags, group.dim, generator=gen, dtype=dtype)  # (NB, D)
        out.append((grad_out, casting))
    return out


def _reference_update(name: str, lr: float, params: dict, weight: np.ndarray, state: np.ndarray,
                      grad_out: np.ndarray, casting: Casting) -> None:
    """The documented formulas, one row at a time, every operation rounded on its own."""
    t_ = weight.dtype.type
    lr, eps, decay = t_(lr), t_(params.get("eps", 0.0)), t_(params.get("weight_decay", 0.0))
    b1, b2 = params.get("beta1", 0.9), params.get("beta2", 0.999)
    offsets = casting.unique_offsets.tolist()
    bags = casting.sorted_bags.tolist()
    scale = None if casting.sorted_scale is None else casting.sorted_scale.numpy().astype(t_)
    for u, row in enumerate(casting.unique_ids.tolist()):
        g = np.zeros(weight.shape[1], dtype=weight.dtype)
        for p in range(offsets[u], offsets[u + 1]):
            g = g + (grad_out[bags[p]] if scale is None else grad_out[bags[p]] * scale[p])
        w, s = weight[row], state[row]
        if decay:
            g = g + decay * w
        if name == "sgd":
            w[:] = w - lr * g
        elif name == "adagrad":
            s[:] = s + g * g
            w[:] = w - (lr * g) / (np.sqrt(s) + eps)
        elif name == "rowwise_adagrad":
            total = t_(0)
            for x in g:
                total = total + x * x
            s[0] = s[0] + total / t_(len(g))
            w[:] = w - (lr * g) / (np.sqrt(s[0]) + eps)
        else:
            dim = len(g)
            s[2 * dim] = s[2 * dim] + t_(1)
            step = float(s[2 * dim])
            bc1 = t_(1) - t_(math.pow(b1, step))
            bc2_sqrt = np.sqrt(t_(1) - t_(math.pow(b2, step)))
            m = s[:dim] + t_(1 - b1) * (g - s[:dim])
            v = s[dim:2 * dim] * t_(b2) + (t_(1 - b2) * g) * g
            s[:dim], s[dim:2 * dim] = m, v
            w[:] = w - (lr * m) / ((np.sqrt(v) / bc2_sqrt + eps) * bc1)


def _tables(opt, group: PackedGroup, dtype: torch.dtype, gen: torch.Generator):
    weight = torch.randn(group.rows, group.dim, generator=gen, dtype=dtype)  # (R, D)
    state = opt.initial_state(group.rows, group.dim, dtype)
    if state.shape[1]:
        state.add_(torch.rand(state.shape, generator=gen, dtype=dtype))
        if opt.name == "adam":
            state[:, -1] = torch.randint(0, 5, (group.rows,), generator=gen).to(dtype)
    return weight, state


def _assert_same(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype, rtol: float = 1e-5) -> None:
    if dtype == torch.float64:
        assert torch.equal(actual, expected), (actual - expected).abs().max()
    else:
        # float32: the fused loop and the reference sum a row's gradients in different orders; a
        # near-zero weight after cancelling terms of size ~1 keeps an absolute error of a few 1e-6
        # (seen once at 1.7e-6 with atol 1e-6); a wrong update moves rows by about lr times a gradient
        torch.testing.assert_close(actual, expected, rtol=rtol, atol=1e-5)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o[0] + str(len(o[2])))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("dim", [1, 16, 67, 300])
def test_fused_update_equals_plain_reference(optimizer, dtype, dim):
    gen = _seed()
    group = _group(dim, optimizer)
    opt = make_optimizer(optimizer)
    weight, state = _tables(opt, group, dtype, gen)
    start = weight.clone()
    ref_w, ref_s = weight.numpy().copy(), state.numpy().copy()
    for grad_out, casting in _batches(group, dtype, gen):
        assert casting.counts.max() > 1 and casting.sorted_scale is not None
        opt.casted_step(weight, state, grad_out, casting)
        _reference_update(optimizer[0], optimizer[1], opt.params, ref_w, ref_s, grad_out.numpy(), casting)
    assert not torch.equal(weight, start)
    _assert_same(weight, torch.from_numpy(ref_w), dtype)
    _assert_same(state, torch.from_numpy(ref_s), dtype)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: o[0] + str(len(o[2])))
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_reduce_then_update_and_the_torch_path(optimizer, dtype):
    gen = _seed()
    group = _group(16, optimizer)
    opt = make_optimizer(optimizer)
    weight, state = _tables(opt, group, dtype, gen)
    split_w, split_s = weight.clone(), state.clone()
    torch_w, torch_s = weight.clone(), state.clone()
    for grad_out, casting in _batches(group, dtype, gen):
        opt.casted_step(weight, state, grad_out, casting)
        grads = casted_row_grads(grad_out, casting)  # (U, D)
        opt.step(split_w, split_s, casting.unique_ids, grads)
        opt.torch_step(torch_w, torch_s, casting.unique_ids, grads)
    _assert_same(weight, split_w, dtype)
    _assert_same(state, split_s, dtype)
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(weight, torch_w, rtol=rtol, atol=rtol)
    torch.testing.assert_close(state, torch_s, rtol=rtol, atol=rtol)


def test_only_the_batch_rows_change_and_renamed_rows_are_honoured():
    gen = _seed()
    optimizer = ("adam", 0.05, ())
    group = _group(8, optimizer)
    opt = make_optimizer(optimizer)
    weight, state = _tables(opt, group, torch.float64, gen)
    grad_out, casting = _batches(group, torch.float64, gen, 1)[0]
    slots = torch.randperm(group.rows, generator=gen)[:casting.unique_ids.numel()]  # (U,)
    renamed = Casting(slots, casting.counts, casting.unique_offsets, casting.sorted_bags,
                      casting.sorted_scale, casting.num_bags)
    before_w, before_s = weight.clone(), state.clone()
    opt.casted_step(weight, state, grad_out, renamed)
    changed = (weight != before_w).any(dim=1)
    assert set(changed.nonzero().squeeze(1).tolist()) <= set(slots.tolist())
    assert changed.sum() > 0.9 * slots.numel()
    assert torch.equal(state[slots, -1], before_s[slots, -1] + 1)
    assert torch.equal(state[~changed, -1], before_s[~changed, -1])


def test_a_batch_without_ids_changes_nothing():
    opt = make_optimizer(("rowwise_adagrad", 0.1, ()))
    weight, state = torch.randn(10, 4, dtype=torch.float64), opt.initial_state(10, 4, torch.float64)
    casting = compute_casting(torch.empty(0, dtype=torch.long), torch.zeros(4, dtype=torch.long))
    before = weight.clone()
    opt.casted_step(weight, state, torch.randn(3, 4, dtype=torch.float64), casting)
    assert torch.equal(weight, before) and not state.any()


@pytest.mark.parametrize("table_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", ["adagrad", "rowwise_adagrad", "adam"])
def test_half_tables_match_the_torch_path(table_dtype, name):
    gen = _seed()
    optimizer = (name, 0.05, ())
    group = _group(16, optimizer)
    opt = make_optimizer(optimizer)
    weight = torch.randn(group.rows, group.dim, generator=gen).to(table_dtype)  # (R, D)
    state = opt.initial_state(group.rows, group.dim, torch.float32)
    torch_w, torch_s = weight.clone(), state.clone()
    for grad_out, casting in _batches(group, torch.float32, gen):
        opt.casted_step(weight, state, grad_out, casting)
        opt.torch_step(torch_w, torch_s, casting.unique_ids, casted_row_grads(grad_out, casting))
    assert weight.dtype == table_dtype and not torch.equal(weight, torch.zeros_like(weight))
    torch.testing.assert_close(weight.float(), torch_w.float(), rtol=1e-2, atol=1e-2)
    torch.testing.assert_close(state, torch_s, rtol=1e-4, atol=1e-5)


def test_result_does_not_depend_on_the_thread_count():
    gen = _seed()
    optimizer = ("rowwise_adagrad", 0.3, ())
    group = _group(16, optimizer)
    opt = make_optimizer(optimizer)
    weight, state = _tables(opt, group, torch.float64, gen)
    batches = _batches(group, torch.float64, gen)
    results = []
    threads = torch.get_num_threads()
    try:
        for count in (1, max(2, threads)):
            torch.set_num_threads(count)
            w, s = weight.clone(), state.clone()
            for grad_out, casting in batches:
                opt.casted_step(w, s, grad_out, casting)
            results.append((w, s))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@pytest.mark.parametrize("name", ["adagrad", "adam"])
def test_long_chunks_on_a_strided_table_equal_the_reference(name):
    """Chunks of hundreds of unique rows (the prefetching path) on a table whose rows are views
    into a wider array (row stride > dim): bitwise the plain reference, the rest untouched."""
    gen = _seed()
    optimizer = (name, 0.1, ())
    group = PackedGroup("g", 6, "fp64", optimizer, (TableSlot("a", 5000, 0),),
                        (GroupField("fa", "a", 4, "sum"), GroupField("fm", "a", 3, "mean")))
    opt = make_optimizer(optimizer)
    wide = torch.randn(group.rows, group.dim + 3, generator=gen, dtype=torch.float64)
    weight = wide[:, :group.dim]  # (R, D), row stride D + 3
    state = opt.initial_state(group.rows, group.dim, torch.float64)
    state.add_(torch.rand(state.shape, generator=gen, dtype=torch.float64))
    batch = random_batch(group, 3000, gen, empty_prob=0.1)
    casting = compute_casting(batch.ids, batch.offsets, mean_bag_flags(group))
    grad_out = torch.randn(casting.num_bags, group.dim, generator=gen, dtype=torch.float64)
    assert casting.unique_ids.numel() > 64 * torch.get_num_threads()
    ref_w, ref_s = weight.numpy().copy(), state.numpy().copy()
    _reference_update(name, 0.1, dict(opt.params), ref_w, ref_s, grad_out.numpy(), casting)
    padding = wide[:, group.dim:].clone()
    opt.casted_step(weight, state, grad_out, casting)
    assert torch.equal(weight, torch.from_numpy(ref_w)) and torch.equal(state, torch.from_numpy(ref_s))
    assert torch.equal(wide[:, group.dim:], padding)
