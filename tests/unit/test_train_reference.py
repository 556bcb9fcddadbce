"""flowrec's packed, casted training equals the unpacked plain-PyTorch reference model.

Same init (per-table `init_table_rows`, the same dense init), same Zipf batches, several steps:
every table row and every dense parameter allclose (fp32) / tightly close (float64); micro-batched
steps equal full-batch steps.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.runtime.lowering import lower
from flowrec.measure.reference import ReferenceModel, TorchRowwiseAdagrad, reference_optimizers, reference_step
from flowrec.planner.manager import make_plan
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict

STEPS = 6
BATCH = 96


def make_spec(sparse_opt: str, seed: int, dense_opt: str = "adam", sparse_params: dict | None = None):
    """Shared tables, multi-hot sum and mean, a dim-1 wide table, dense features, two heads."""
    return spec_from_dict({
        "name": "ref",
        "features": [
            {"name": "x0", "type": "dense", "transform": "log1p"},
            {"name": "x1", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 300, "dim": 8},
            {"name": "item", "type": "categorical", "table": "items"},
            {"name": "recent", "type": "sequence", "table": "items", "max_len": 5, "pooling": "mean"},
            {"name": "liked", "type": "sequence", "table": "items", "max_len": 3, "pooling": "sum"},
            {"name": "genre", "type": "sequence", "vocab": 20, "dim": 8, "max_len": 4, "pooling": "sum"},
            {"name": "site", "type": "categorical", "hash_buckets": 40, "dim": 1, "tags": ["wide"]},
            {"name": "os", "type": "categorical", "hash_buckets": 7, "dim": 1, "tags": ["wide"]},
        ],
        "tables": [{"name": "items", "vocab": 500, "dim": 8}],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense"], "layers": [16, 8]},
            {"name": "inter", "kind": "dot", "inputs": ["bottom", "user", "item", "recent", "liked", "genre"]},
            {"name": "top", "kind": "mlp", "inputs": ["inter", "bottom"], "layers": [16]},
            {"name": "wide", "kind": "linear", "inputs": ["@wide"], "out": 1},
            {"name": "mix", "kind": "mlp", "inputs": ["site", "user", "@dense", "genre", "os", "item"],
             "layers": [8]},
            {"name": "out", "kind": "concat", "inputs": ["top", "wide", "mix"]},
        ],
        "heads": [{"name": "ctr", "input": "out"},
                  {"name": "score", "input": "top", "task": "regression", "loss": "mse", "label": "score"}],
        "optimizer": {"dense": {"name": dense_opt, "lr": 0.01},
                      "sparse": {"name": sparse_opt, "lr": 0.05, **(sparse_params or {})}},
        "training": {"batch_size": BATCH, "seed": seed},
    })


def staged(spec, seed: int, dtype: torch.dtype) -> list:
    table = synth_table(spec, BATCH * STEPS, SynthConfig(seed=seed, alpha=1.2))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    plan = make_plan(spec, target="cpu")
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        batches = list(it)
    return [replace(b, dense=b.dense.to(dtype), labels=b.labels.to(dtype)) for b in batches]


def flowrec_model(spec, dtype: torch.dtype):
    plan = make_plan(spec, target="cpu")
    model = lower(plan, spec, "cpu").to(dtype)
    opt = spec.dense_optimizer
    return plan, model, make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))


def assert_same(model, ref, rtol: float, atol: float) -> None:
    for group in model.groups:
        packed = model.embeddings[group.name]
        for slot in group.tables:
            torch.testing.assert_close(packed.table_rows(slot.table), ref.table(slot.table).weight.detach(),
                                       rtol=rtol, atol=atol, msg=lambda m: f"table {slot.table}: {m}")
    ours = dict(model.ops.named_parameters())
    for name, p in ref.dense_model.ops.named_parameters():
        torch.testing.assert_close(ours[name], p.detach(), rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("sparse_opt,dtype,tol,params", [
    # float32 checks the kernels' float32 arithmetic on a well-conditioned update: with a zero
    # initial accumulator, adagrad's first step of an element is lr * g / (|g| + eps), so a gradient
    # that cancels to ~eps in float32 (seen: 1.8e-10, summands ~1e-5) carries a relative error of a
    # few percent in ANY float32 implementation, and that element lands up to lr * that apart
    # (2.4e-4 at lr 0.05, CI seed 891435911). An accumulator starting at 0.1 (TensorFlow's default)
    # bounds the denominator away from 0; the zero-accumulator updates are checked in float64.
    ("rowwise_adagrad", torch.float32, (1e-3, 1e-4), {"initial_accumulator_value": 0.1}),
    ("adagrad", torch.float32, (1e-3, 1e-4), {"initial_accumulator_value": 0.1}),
    ("sgd", torch.float32, (1e-3, 1e-4), {}),
    ("sgd", torch.float64, (1e-6, 1e-7), {}),
    ("adagrad", torch.float64, (1e-6, 1e-7), {}),
    ("rowwise_adagrad", torch.float64, (1e-6, 1e-7), {}),
])
def test_packed_training_equals_reference(sparse_opt, dtype, tol, params):
    seed = random.randrange(1 << 30)
    spec = make_spec(sparse_opt, seed % 1000, sparse_params=params)
    batches = staged(spec, seed, dtype)
    plan, model, optimizer = flowrec_model(spec, dtype)
    ref = ReferenceModel(plan, spec).to(dtype)
    assert_same(model, ref, 0.0, 0.0)  # identical initial parameters
    optimizers = reference_optimizers(ref, spec)
    moved = False
    for batch in batches:
        before = model.embeddings[model.groups[0].name].weight.clone()
        loss = train_step(model, optimizer, batch)
        ref_loss = reference_step(ref, optimizers, batch)
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        moved = moved or not torch.equal(before, model.embeddings[model.groups[0].name].weight)
    assert moved, "the packed table never changed"
    try:
        assert_same(model, ref, *tol)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None


@pytest.mark.parametrize("chunks,dense_opt,sparse_opt,tol", [
    (2, "sgd", "sgd", (1e-7, 1e-9)),
    (3, "sgd", "sgd", (1e-7, 1e-9)),
    # Adam / (row-wise) Adagrad normalise near-zero gradient elements, so float64 rounding
    # differences of the chunked sums (1e-17) can grow to about 1e-7 after a few steps.
    (3, "adam", "rowwise_adagrad", (1e-5, 1e-6)),
])
def test_micro_batches_equal_full_batch(chunks, dense_opt, sparse_opt, tol):
    seed = random.randrange(1 << 30)
    spec = make_spec(sparse_opt, seed % 1000, dense_opt)
    batches = staged(spec, seed, torch.float64)
    _, full, full_opt = flowrec_model(spec, torch.float64)
    _, micro, micro_opt = flowrec_model(spec, torch.float64)
    for batch in batches:
        train_step(full, full_opt, batch, micro_batches=1)
        train_step(micro, micro_opt, batch, micro_batches=chunks)
    for (name, a), (_, b) in zip(full.state_dict().items(), micro.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=tol[0], atol=tol[1], msg=lambda m: f"{name}: {m}")


def test_rowwise_adagrad_reference_leaves_untouched_rows():
    w = torch.nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    start = w.detach().clone()
    w.grad = torch.zeros_like(w)
    w.grad[[1, 3]] = torch.randn(2, 3, dtype=torch.float64)
    TorchRowwiseAdagrad([w], lr=0.1).step()
    assert torch.equal(w[[0, 2, 4]], start[[0, 2, 4]])
    s = w.grad[1].square().mean()
    expected = start[1] - 0.1 * w.grad[1] / (s.sqrt() + 1e-8)
    torch.testing.assert_close(w[1].detach(), expected)
