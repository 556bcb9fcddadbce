"""The compiled dense stage (`LoweredModel.compile_dense`, inductor's CPU backend) equals the eager
one: logits and the gradients of every dense parameter and of the lookups (float32 allclose,
float64 to 1e-12), and training steps through it end with the eager run's parameters. Compiling
takes tens of seconds: thorough tier (the fallback is checked in test_compiled_fallback)."""
from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict

BATCH = 64


def dlrm_spec(seed: int):
    """A small DLRM: bottom MLP, pairwise dots with four skewed tables, top MLP over both."""
    cats = [{"name": f"c{i}", "type": "categorical", "hash_buckets": rows, "dim": 8}
            for i, rows in enumerate((50, 300, 1000, 7))]
    return spec_from_dict({
        "name": "small_dlrm",
        "features": [{"name": f"x{i}", "type": "dense", "transform": "log1p"} for i in range(3)] + cats,
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense"], "layers": [16, 8]},
            {"name": "interaction", "kind": "dot", "inputs": ["bottom", "@sparse"]},
            {"name": "top", "kind": "mlp", "inputs": ["interaction", "bottom"], "layers": [16, 8]},
        ],
        "heads": [{"name": "ctr", "input": "top", "task": "binary", "loss": "bce"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": seed},
    })


def staged(spec, plan, seed: int, steps: int, dtype: torch.dtype) -> list:
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.2))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        return [replace(b, dense=b.dense.to(dtype), labels=b.labels.to(dtype)) for b in it]


def forward_and_grads(model, batch):
    """Logits, and the gradients of the dense parameters and the lookups of one forward/backward."""
    model.zero_grad(set_to_none=True)
    emb = {g: e.detach().requires_grad_(True) for g, e in model.embed(batch).items()}
    logits = model.dense_forward(batch.dense, emb, model.sequence_masks(batch))
    model.loss(logits, batch.labels).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad and p.grad is not None}
    grads.update({f"emb.{g}": e.grad.clone() for g, e in emb.items()})
    return logits.detach(), grads


@pytest.mark.parametrize("dtype,rtol,atol", [(torch.float32, 1e-5, 1e-6), (torch.float64, 1e-12, 1e-12)])
def test_compiled_dense_equals_eager(dtype, rtol, atol):
    seed = random.randrange(1 << 30)
    spec = dlrm_spec(seed % 1000)
    plan = make_plan(spec, target="cpu")
    batches = staged(spec, plan, seed, 4, dtype)
    eager = lower(plan, spec, "cpu").to(dtype)
    compiled = copy.deepcopy(eager)
    call = compiled.compile_dense()
    logits, grads = forward_and_grads(eager, batches[0])
    c_logits, c_grads = forward_and_grads(compiled, batches[0])
    assert call.active and call.calls == 1, f"seed {seed}: the compiled code did not run ({call.failure})"
    assert logits.abs().sum() > 0
    torch.testing.assert_close(c_logits, logits, rtol=rtol, atol=atol, msg=f"seed {seed}: logits")
    assert set(c_grads) == set(grads) and len(grads) > 10
    for name, g in grads.items():
        assert g.abs().sum() > 0, f"{name}: zero gradient proves nothing"
        torch.testing.assert_close(c_grads[name], g, rtol=rtol, atol=atol, msg=f"seed {seed}: grad {name}")

    # training steps through the compiled stage end where the eager ones do
    eager_opt = make_dense_optimizer(eager, "adam", 0.01, {})
    compiled_opt = make_dense_optimizer(compiled, "adam", 0.01, {})
    for b in batches:
        loss = train_step(eager, eager_opt, b)
        c_loss = train_step(compiled, compiled_opt, b)
        assert abs(loss - c_loss) <= 10 * atol + rtol * abs(loss), f"seed {seed}: loss {c_loss} vs {loss}"
    assert call.calls == 1 + len(batches)
    eager_state, compiled_state = eager.state_dict(), compiled.state_dict()
    for name, value in eager_state.items():
        torch.testing.assert_close(compiled_state[name], value, rtol=100 * rtol, atol=100 * atol,
                                   msg=f"seed {seed}: {name} after training")
    with torch.no_grad():  # evaluation stays eager
        eager.dense_forward(batches[0].dense, eager.embed(batches[0]), {})
    assert call.calls == 1 + len(batches)
