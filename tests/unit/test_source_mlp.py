"""An MLP that takes a permutation gather of whole sources (a wide model's concat of fields of
several packed groups) runs as one GEMM per source with permuted weight columns
(`MLP.forward_sources`): logits and every gradient equal the gathered forward's (float64 1e-12,
float32 allclose), the parameters and state keys are the same, and the concat is not built."""
from __future__ import annotations

import copy
import random

import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.lowering import lower
from flowrec.spec import spec_from_dict
from operators.dense import MLP

BATCH = 40


def wide_spec(seed: int, through_concat: bool):
    rng = random.Random(seed)
    cats = [{"name": f"c{i}", "type": "categorical", "hash_buckets": rng.randrange(5, 400),
             "dim": rng.choice((2, 4, 8)), "tags": ["deep"]} for i in range(9)]
    deep = {"name": "deep", "kind": "mlp", "layers": [16, 8], "dropout": 0.2}
    modules = [{"name": "deep_in", "kind": "concat", "inputs": ["@dense", "@deep"]}, {**deep, "inputs": ["deep_in"]}] \
        if through_concat else [{**deep, "inputs": ["@dense", "@deep"]}]
    return spec_from_dict({
        "name": "wide_fields",
        "features": [{"name": f"x{i}", "type": "dense", "transform": "log1p"} for i in range(2)] + cats,
        "modules": modules,
        "heads": [{"name": "ctr", "input": "deep", "task": "binary", "loss": "bce"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": seed},
    })


def permuted_spec(through_concat: bool):
    """(seed, spec, plan) of a fresh random wide spec whose deep fields do not already lie in their
    packed order: one whose MLP input is a permutation of whole sources of two or more packed groups
    (some draws are in order already, need no gather or pack into one group: drawn again)."""
    node = "deep_in" if through_concat else "deep"
    for _ in range(50):
        seed = random.randrange(1 << 30)
        spec = wide_spec(seed % 10_000, through_concat)
        plan = make_plan(spec, target="cpu")
        gather = lower(plan, spec, "meta").gathers.get(node)
        if gather is not None and gather.inverse is not None and len(plan.meta.groups) >= 2:
            return seed, spec, plan  # a permutation across groups (else it was drawn again)
    raise AssertionError("no random wide spec with permuted fields in 50 draws")


def batch_of(spec, plan, seed: int, dtype: torch.dtype):
    table = synth_table(spec, BATCH, SynthConfig(seed=seed, alpha=1.2))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 1)), opts, 0, 0, plan.meta.groups) as it:
        b = next(iter(it))
    b.dense.copy_(b.dense * 3 + 0.5)
    return b.dense.to(dtype), b.labels.to(dtype), b


def run(model, dense, labels, batch):
    model.zero_grad(set_to_none=True)
    model.reseed_noise()
    emb = {g: e.detach().requires_grad_(True) for g, e in model.embed(batch).items()}
    logits = model.dense_forward(dense, emb, {})
    model.loss(logits, labels).backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), {**grads, **{g: e.grad for g, e in emb.items()}}


@pytest.mark.parametrize("through_concat", [True, False])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_source_mlp_equals_the_gathered_forward(through_concat, dtype, tol):
    seed, spec, plan = permuted_spec(through_concat)
    fused = lower(plan, spec, "cpu").to(dtype)
    assert fused.source_mlps == {"deep": "deep_in" if through_concat else "deep"}, f"seed {seed}"
    assert fused.skipped == (frozenset({"deep_in"}) if through_concat else frozenset())
    owner = fused.gathers[fused.source_mlps["deep"]]
    assert owner.inverse is not None and len(plan.meta.groups) >= 2, f"seed {seed}: no permutation to test"
    gathered = copy.deepcopy(fused)
    gathered.fuse_sources = False  # as op calibration runs it: every module on its gathered input
    assert list(fused.state_dict()) == list(gathered.state_dict())
    dense, labels, batch = batch_of(spec, plan, seed, dtype)
    logits, grads = run(fused, dense, labels, batch)
    ref_logits, ref_grads = run(gathered, dense, labels, batch)
    assert ref_logits.std() > 0
    torch.testing.assert_close(logits, ref_logits, rtol=tol, atol=tol, msg=f"seed {seed}")
    assert set(grads) == set(ref_grads)
    for name, g in ref_grads.items():
        assert g.abs().sum() > 0, name
        torch.testing.assert_close(grads[name], g, rtol=tol, atol=tol, msg=f"seed {seed}: {name}")


def test_forward_sources_with_a_permutation_and_in_order():
    g = torch.Generator().manual_seed(random.randrange(1 << 30))
    mlp = MLP(9, [5, 3]).double()
    parts = [torch.randn(6, 2, generator=g, dtype=torch.float64), torch.randn(6, 1, 7, generator=g, dtype=torch.float64)]
    flat = torch.cat([parts[0], parts[1].flatten(1)], 1)
    perm = torch.randperm(9, generator=g)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(9)
    torch.testing.assert_close(mlp.forward_sources(parts, inverse), mlp(flat[:, perm]), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(mlp.forward_sources(parts), mlp(flat), rtol=1e-12, atol=1e-12)
    assert not torch.allclose(mlp.forward_sources(parts, inverse), mlp(flat))  # the permutation matters


def test_op_calibration_captures_every_module_of_a_source_mlp_model():
    from flowrec.measure.step import _captured_inputs

    seed, spec, plan = permuted_spec(True)
    model = lower(plan, spec, "cpu")
    dense, labels, batch = batch_of(spec, plan, seed, torch.float32)
    captured = _captured_inputs(model, spec, batch, ["deep_in", "deep"])
    assert set(captured) == {"deep_in", "deep"} and model.fuse_sources  # restored
    assert captured["deep"][0].shape[1] == model.ops["deep"].layers[0].in_features
