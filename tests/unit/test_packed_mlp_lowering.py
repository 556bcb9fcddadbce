"""Packed MLPs whose members take several input slots (issue 25's defect) lower and train.

Two families of same-shape MLPs over ``["@sparse", price]`` (two slots per member) once built a
packed bias of K = 4 members instead of 2 and died in `PackedMLP.forward`. The packed model must
equal the unpacked one carrying the same weights, forward and gradients.
"""
from __future__ import annotations

import random
from dataclasses import replace

import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.edges import input_slots
from flowrec.planner.manager import make_plan
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict

BATCH = 64


def two_families(packing: bool):
    """The issue's minimal spec: a1/a2 over two slots each, b1/b2 over them, one head."""
    return spec_from_dict({
        "name": "families",
        "features": [
            {"name": "user_id", "type": "categorical", "hash_buckets": 200, "dim": 8},
            {"name": "item_id", "type": "categorical", "hash_buckets": 300, "dim": 8},
            {"name": "price", "type": "dense"},
        ],
        "modules": [
            {"name": "a1", "kind": "mlp", "inputs": ["@sparse", "price"], "layers": [32]},
            {"name": "a2", "kind": "mlp", "inputs": ["@sparse", "price"], "layers": [32]},
            {"name": "b1", "kind": "mlp", "inputs": ["a1"], "layers": [16]},
            {"name": "b2", "kind": "mlp", "inputs": ["a2"], "layers": [16]},
            {"name": "out", "kind": "concat", "inputs": ["b1", "b2"]},
        ],
        "heads": [{"name": "click", "input": "out"}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.05}, "sparse": {"name": "sgd", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": 3},
        "plan": {"packing": packing},
    })


def batches(spec, plan, seed: int, n: int) -> list:
    table = synth_table(spec, BATCH * n, SynthConfig(seed=seed, alpha=1.2))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        return [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]


def test_packed_members_with_two_slots_each_have_k_members():
    plan = make_plan(two_families(True), target="cpu")
    g = plan.graph
    packed = sorted(n for n in g if g.nodes[n]["op"].kind == "packed_mlp")
    assert packed == ["packed_a1_x2", "packed_b1_x2"]
    assert g.nodes["packed_a1_x2"]["op"].attr("member_ports") == ((0, 2), (2, 4))
    assert len(input_slots(g, "packed_a1_x2")) == 4
    model = lower(plan, two_families(True), "cpu")
    op = model.ops["packed_a1_x2"]
    assert [tuple(b.shape) for b in op.biases] == [(2, 1, 32)]
    assert [tuple(w.shape) for w in op.weights] == [(2, 17, 32)]  # 2 fields x 8 + price


def test_packed_families_train_and_equal_unpacked():
    seed = random.randrange(1 << 30)
    spec_p, spec_u = two_families(True), two_families(False)
    plan_p, plan_u = make_plan(spec_p, target="cpu"), make_plan(spec_u, target="cpu")
    assert not any(plan_u.graph.nodes[n]["op"].kind == "packed_mlp" for n in plan_u.graph)
    packed, unpacked = lower(plan_p, spec_p, "cpu").double(), lower(plan_u, spec_u, "cpu").double()
    assert [g.name for g in plan_p.meta.groups] == ["g0_d8"]
    # one packed table in the packed plan, two unpacked: compare through the dense part only
    data = batches(spec_p, plan_p, seed, 3)
    emb = {"g0_d8": packed.embed(data[0])["g0_d8"].detach().requires_grad_(True)}
    copy_packed_into_unpacked_dense(packed, unpacked)
    dense = data[0].dense
    out_p = packed.dense_forward(dense, emb, {})
    emb_u = emb["g0_d8"].detach().clone().requires_grad_(True)
    out_u = unpacked_forward(unpacked, plan_u, dense, emb_u)
    torch.testing.assert_close(out_p, out_u, rtol=1e-12, atol=1e-12)
    out_p.sum().backward()
    out_u.sum().backward()
    torch.testing.assert_close(emb["g0_d8"].grad, emb_u.grad, rtol=1e-12, atol=1e-12)
    opt = make_dense_optimizer(packed, "sgd", 0.05, {})
    losses = [train_step(packed, opt, b) for b in data]
    assert all(torch.isfinite(torch.tensor(losses))), f"seed {seed}: {losses}"


def copy_packed_into_unpacked_dense(packed, unpacked) -> None:
    """Per-member MLP weights and every other dense operator's parameters, packed -> unpacked."""
    with torch.no_grad():
        for step in packed.steps:
            op = packed.ops[step.name]
            if step.kind != "packed_mlp":
                for a, b in zip(op.parameters(), unpacked.ops[step.name].parameters()):
                    b.copy_(a)
                continue
            for k, member in enumerate(step.members):
                for layer, w, b in zip(unpacked.ops[member].layers, op.weights, op.biases):
                    layer.weight.copy_(w[k].t())
                    layer.bias.copy_(b[k, 0])


def unpacked_forward(unpacked, plan_u, dense: torch.Tensor, fields: torch.Tensor) -> torch.Tensor:
    """The unpacked model's dense forward on the packed lookup's fields (user_id, item_id)."""
    groups = {g.name: g for g in plan_u.meta.groups}
    emb = {}
    for name, group in groups.items():
        feature = group.fields[0].feature
        emb[name] = fields[:, ["user_id", "item_id"].index(feature)].unsqueeze(1)  # (B, 1, D)
    return unpacked.dense_forward(dense, emb, {})
