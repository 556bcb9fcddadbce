"""Training with mlp dropout / norms: seeded, bitwise equal on resume, eval deterministic, and
dropout and layer norm equal under micro-batching (batch norm is per micro-batch:
test_mlp_regularize)."""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict

BATCH = 48


def regularised_spec(seed: int, bottom: dict, towers: dict):
    return spec_from_dict({
        "name": "reg",
        "features": [
            {"name": "x0", "type": "dense", "transform": "log1p"},
            {"name": "x1", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 200, "dim": 4},
            {"name": "item", "type": "categorical", "hash_buckets": 300, "dim": 4},
        ],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [16, 8], **bottom},
            {"name": "t1", "kind": "mlp", "inputs": ["bottom"], "layers": [8], **towers},
            {"name": "t2", "kind": "mlp", "inputs": ["bottom"], "layers": [8], **towers},
        ],
        "heads": [{"name": "a", "input": "t1"}, {"name": "b", "input": "t2", "label": "b"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": seed},
    })


def staged(spec, plan, seed: int, steps: int) -> list:
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.2))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        return [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]


def fresh(spec, plan):
    model = lower(plan, spec, "cpu").double()
    opt = spec.dense_optimizer
    return model, make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))


def test_dropout_and_batch_norm_resume_bitwise():
    seed = random.randrange(1 << 30)
    spec = regularised_spec(seed % 1000, {"norm": "batch", "dropout": 0.3}, {"norm": "layer", "dropout": 0.2})
    plan = make_plan(spec, target="cpu")
    assert any(plan.graph.nodes[n]["op"].kind == "packed_mlp" for n in plan.graph)
    batches = staged(spec, plan, seed, 6)
    whole, whole_opt = fresh(spec, plan)
    for b in batches:
        train_step(whole, whole_opt, b, micro_batches=2)
    first, first_opt = fresh(spec, plan)
    for b in batches[:3]:
        train_step(first, first_opt, b, micro_batches=2)
    resumed, resumed_opt = fresh(spec, plan)
    torch.manual_seed(seed)  # the process RNG plays no part in the masks
    resumed.load_state_dict(first.state_dict())
    resumed_opt.load_state_dict(first_opt.state_dict())
    for b in batches[3:]:
        train_step(resumed, resumed_opt, b, micro_batches=2)
    assert int(resumed.noise_steps) == 6
    for (name, a), (_, b) in zip(whole.state_dict().items(), resumed.state_dict().items()):
        assert torch.equal(a, b), f"seed {seed}: {name} differs after resume"
    other, other_opt = fresh(spec, plan)
    other.noise_seed += 1  # another training seed draws other masks
    for b in batches:
        train_step(other, other_opt, b, micro_batches=2)
    assert not torch.equal(other.state_dict()["ops.bottom.layers.0.weight"],
                           whole.state_dict()["ops.bottom.layers.0.weight"])


def test_eval_is_deterministic_and_uses_running_statistics():
    seed = random.randrange(1 << 30)
    spec = regularised_spec(seed % 1000, {"norm": "batch", "dropout": 0.5}, {"dropout": 0.5})
    plan = make_plan(spec, target="cpu")
    batches = staged(spec, plan, seed, 3)
    model, opt = fresh(spec, plan)
    for b in batches[:2]:
        train_step(model, opt, b)
    model.eval()
    with torch.no_grad():
        one, two = model(batches[2]), model(batches[2])
    assert torch.equal(one, two)
    model.train()
    with torch.no_grad():
        model.reseed_noise()
        noisy = model(batches[2])
    assert not torch.equal(noisy, one), "training mode drops units"


def test_layer_norm_and_dropout_micro_batches_equal_full_batch():
    seed = random.randrange(1 << 30)
    spec = regularised_spec(seed % 1000, {"norm": "layer", "dropout": 0.3}, {"norm": "layer", "dropout": 0.2})
    plan = make_plan(spec, target="cpu")
    batches = staged(spec, plan, seed, 4)
    full, full_opt = fresh(spec, plan)
    micro, micro_opt = fresh(spec, plan)
    for b in batches:
        train_step(full, full_opt, b, micro_batches=1)
        train_step(micro, micro_opt, b, micro_batches=3)
    for (name, a), (_, b) in zip(full.state_dict().items(), micro.state_dict().items()):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-6, msg=lambda m: f"seed {seed}: {name}: {m}")
