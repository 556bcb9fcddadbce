"""The `moe` kind (MMoE): a plain-PyTorch reference, packed experts equal unpacked ones, one expert
equals the shared-bottom model, named outputs in specs, plans and validation."""
from __future__ import annotations

import copy
import random
from dataclasses import replace

import pytest
import torch
from torch import nn

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.types import PassContext
from flowrec.graph.verify import verify
from flowrec.graph.build import build_graph
from flowrec.planner.manager import make_plan
from flowrec.planner.passes.pack import pack
from flowrec.planner.report import text_report
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict
from flowrec.spec.validate import validate_document
from operators import registry
from operators.moe import PLE, MMoE

BATCH = 48
STEPS = 20


def skewed(*shape: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.2)
    return mag * torch.sign(torch.randn(*shape, generator=gen, dtype=torch.float64))


class PlainMMoE(nn.Module):
    """MMoE as one writes it in PyTorch: a list of expert MLPs, a softmax gate per head."""

    def __init__(self, ours: MMoE):
        super().__init__()
        experts = ours.experts
        self.experts = nn.ModuleList()
        for k in range(ours.num_experts):
            layers = []
            for w, b in zip(experts.weights, experts.biases):
                linear = nn.Linear(w.shape[1], w.shape[2], dtype=torch.float64)
                with torch.no_grad():
                    linear.weight.copy_(w[k].t())
                    linear.bias.copy_(b[k, 0])
                layers += [linear, nn.ReLU()]
            self.experts.append(nn.Sequential(*layers))
        self.gates = copy.deepcopy(ours.gates)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        outs = torch.stack([e(x) for e in self.experts], dim=1)  # (B, E, D)
        heads = []
        for gate in self.gates:
            w = torch.softmax(gate.out(gate.hidden(x)), dim=1)  # (B, E)
            heads.append((w.unsqueeze(2) * outs).sum(dim=1))
        return torch.stack(heads, dim=1)


def test_packed_mmoe_equals_plain_pytorch_forward_and_gradients():
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    ours = MMoE(7, experts=4, expert_layers=[12, 6], gate_layers=[5], heads=["a", "b", "c"], packed=True).double()
    ref = PlainMMoE(ours)
    x = skewed(33, 7, seed=seed).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    out, out_ref = ours(x), ref(x_ref)
    torch.testing.assert_close(out, out_ref, msg=lambda m: f"seed {seed}: {m}")
    (out * skewed(*out.shape, seed=seed + 1)).sum().backward()
    (out_ref * skewed(*out.shape, seed=seed + 1)).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad)
    for k, expert in enumerate(ref.experts):
        torch.testing.assert_close(ours.experts.weights[0].grad[k], expert[0].weight.grad.t())
    for a, b in zip(ours.gates.parameters(), ref.gates.parameters()):
        torch.testing.assert_close(a.grad, b.grad)


def moe_doc(seed: int, packing: bool, experts: int = 3) -> dict:
    return {
        "name": "moe",
        "features": [
            {"name": "x0", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 300, "dim": 8},
            {"name": "item", "type": "categorical", "hash_buckets": 500, "dim": 8},
        ],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [16]},
            {"name": "experts", "kind": "moe", "inputs": ["bottom"], "experts": experts, "expert_layers": [12, 8],
             "gate_layers": [6], "heads": ["click", "like"]},
            {"name": "like_tower", "kind": "mlp", "inputs": ["experts.like"], "layers": [4]},
        ],
        "heads": [{"name": "click", "input": "experts.click", "label": "click"},
                  {"name": "like", "input": "like_tower", "label": "like"}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.05}, "sparse": {"name": "sgd", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": seed},
        "plan": {"packing": packing},
    }


def staged(spec, plan, seed: int, steps: int) -> list:
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.3))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        return [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]


def trained(spec, plan, batches, init=None):
    model = lower(plan, spec, "cpu").double()
    if init is not None:
        init(model)
    opt = make_dense_optimizer(model, "sgd", 0.05, {})
    for b in batches:
        train_step(model, opt, b)
    return model


def copy_unpacked_into_packed(unpacked, packed) -> None:
    """Everything but the tables' packing is named alike; the experts stack into (E, In, Out)."""
    with torch.no_grad():
        for name, module in unpacked.embeddings.items():
            packed.embeddings[name].weight.copy_(module.weight)
        ours = dict(packed.ops.named_parameters())
        for name, p in unpacked.ops.named_parameters():
            if name in ours:
                ours[name].copy_(p)
        src, dst = unpacked.ops["experts"].experts.mlps, packed.ops["experts"].experts
        for i, (w, b) in enumerate(zip(dst.weights, dst.biases)):
            w.copy_(torch.stack([m.layers[i].weight.t() for m in src]))
            b.copy_(torch.stack([m.layers[i].bias.unsqueeze(0) for m in src]))


def test_packed_experts_train_as_unpacked_experts():
    seed = random.randrange(1 << 30)
    spec_p, spec_u = spec_from_dict(moe_doc(seed % 1000, True)), spec_from_dict(moe_doc(seed % 1000, False))
    plan_p, plan_u = make_plan(spec_p, target="cpu"), make_plan(spec_u, target="cpu")
    assert plan_p.graph.nodes["experts"]["op"].attr("packed") is True
    assert plan_u.graph.nodes["experts"]["op"].attr("packed") is None
    assert [g.name for g in plan_p.meta.groups] == ["g0_d8"]  # both tables in one group: compare dense only
    plan_u = plan_u.with_meta(replace(plan_u.meta, groups=plan_p.meta.groups,
                                      group_order=plan_p.meta.group_order))
    plan_u = replace(plan_u, graph=_with_group(plan_u.graph, plan_p.graph))
    batches = staged(spec_p, plan_p, seed, STEPS)
    unpacked = trained(spec_u, plan_u, [])
    packed = trained(spec_p, plan_p, batches, lambda m: copy_unpacked_into_packed(unpacked, m))
    unpacked = trained(spec_u, plan_u, batches)
    with torch.no_grad():
        for b in batches[:2]:
            torch.testing.assert_close(packed(b), unpacked(b), msg=lambda m: f"seed {seed}: {m}")
    src = unpacked.ops["experts"].experts.mlps
    for i, w in enumerate(packed.ops["experts"].experts.weights):
        torch.testing.assert_close(w, torch.stack([m.layers[i].weight.t() for m in src]).detach(),
                                   rtol=1e-9, atol=1e-11)


def _with_group(unpacked_graph, packed_graph):
    """The unpacked plan's graph with the packed plan's embedding nodes (same tables, one group)."""
    g = packed_graph.copy()
    for node in ("experts", "like_tower", "bottom", "head_click", "head_like"):
        g.nodes[node]["op"] = unpacked_graph.nodes[node]["op"]
    return g


def test_one_expert_with_its_constant_gate_is_the_shared_bottom_model():
    seed = random.randrange(1 << 30)
    moe = moe_doc(seed % 1000, True, experts=1)
    shared = copy.deepcopy(moe)
    shared["modules"][1] = {"name": "experts", "kind": "mlp", "inputs": ["bottom"], "layers": [12, 8]}
    shared["modules"][2]["inputs"] = ["experts"]
    shared["heads"][0]["input"] = "experts"
    spec_m, spec_s = spec_from_dict(moe), spec_from_dict(shared)
    plan_m, plan_s = make_plan(spec_m, target="cpu"), make_plan(spec_s, target="cpu")
    batches = staged(spec_m, plan_m, seed, STEPS)
    base = lower(plan_s, spec_s, "cpu").double()

    def same_start(model) -> None:
        with torch.no_grad():
            model.load_state_dict({k: v for k, v in base.state_dict().items() if not k.startswith("ops.experts")},
                                  strict=False)
            for ours, theirs in zip(model.ops["experts"].experts.mlps[0].layers, base.ops["experts"].layers):
                ours.load_state_dict(theirs.state_dict())

    mixture = trained(spec_m, _unpacked(plan_m), batches, same_start)
    bottom = trained(spec_s, plan_s, batches, lambda m: m.load_state_dict(base.state_dict()))
    with torch.no_grad():
        torch.testing.assert_close(mixture(batches[0]), bottom(batches[0]), msg=lambda m: f"seed {seed}: {m}")
    for ours, theirs in zip(mixture.ops["experts"].experts.mlps[0].layers, bottom.ops["experts"].layers):
        torch.testing.assert_close(ours.weight, theirs.weight, rtol=1e-9, atol=1e-11)
    gate = mixture.ops["experts"].gates[0].out.weight
    assert gate.grad is not None and torch.all(gate.grad == 0), "a one-expert gate is constant"


def _unpacked(plan):
    """A plan whose one-expert mixture is not packed (a single expert is never packed)."""
    assert plan.graph.nodes["experts"]["op"].attr("packed") is None
    return plan


def test_pack_marks_experts_once_and_the_plan_shows_it():
    spec = spec_from_dict(moe_doc(0, True))
    first = pack(build_graph(spec), PassContext(spec=spec))
    assert verify(first.graph) == []
    again = pack(first.graph, PassContext(spec=spec))
    assert not again.modified
    assert any("experts: 3 experts" in n for n in first.notes)
    report = "\n".join(text_report(make_plan(spec, target="cpu")))
    assert "dense packing: experts = 3 experts (layers [12, 8]) in one kernel" in report
    plan = make_plan(spec, target="cpu")
    assert plan.graph.nodes["experts"]["op"].out_shape == ("B", 2, 8)
    assert plan.graph.nodes["head_click"]["op"].attr("in_features") == 8


def test_named_outputs_are_checked_with_every_error():
    doc = moe_doc(0, True)
    doc["modules"][2]["inputs"] = ["experts.lik"]
    doc["heads"][0]["input"] = "experts.clik"
    doc["modules"][0]["layers"] = []
    issues = {i.path: i.message for i in validate_document(doc)}
    assert "no output 'lik'" in issues["modules[2].inputs[0]"]
    assert "no output 'clik'" in issues["heads[0].input"]
    assert "modules[0].layers" in issues


def plain_expert(packed, k: int) -> nn.Sequential:
    """Expert k of a `PackedMLP` as nn.Linear + ReLU layers."""
    layers = []
    for w, b in zip(packed.weights, packed.biases):
        linear = nn.Linear(w.shape[1], w.shape[2], dtype=torch.float64)
        with torch.no_grad():
            linear.weight.copy_(w[k].t())
            linear.bias.copy_(b[k, 0])
        layers += [linear, nn.ReLU()]
    return nn.Sequential(*layers)


def plain_ple(ours: PLE, x: torch.Tensor) -> torch.Tensor:
    """PLE written out level by level (experts: each head's own, then the shared ones)."""
    heads, task, shared = ours.heads, ours.task, ours.shared
    xs, xshared = [x] * heads, x
    for level, packed in enumerate(ours.experts):
        experts = [plain_expert(packed, k) for k in range(heads * task + shared)]
        own = [[experts[h * task + t](xs[h]) for t in range(task)] for h in range(heads)]
        common = [experts[heads * task + s](xshared) for s in range(shared)]
        new = []
        for h in range(heads):
            gate = ours.task_gates[level][h]
            w = torch.softmax(gate.out(gate.hidden(xs[h])), dim=1)
            new.append(sum(w[:, i:i + 1] * e for i, e in enumerate(own[h] + common)))
        if level < len(ours.shared_gates):
            gate = ours.shared_gates[level]
            w = torch.softmax(gate.out(gate.hidden(xshared)), dim=1)
            every = [e for h in range(heads) for e in own[h]] + common
            xshared = sum(w[:, i:i + 1] * e for i, e in enumerate(every))
        xs = new
    return torch.stack(xs, dim=1)


def test_packed_ple_equals_plain_pytorch_forward_and_gradients():
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    ours = PLE(7, levels=2, shared_experts=2, task_experts=2, expert_layers=[10, 6], gate_layers=[4],
               heads=["a", "b", "c"], packed=True).double()
    x = skewed(29, 7, seed=seed).requires_grad_(True)
    x_ref = x.detach().clone().requires_grad_(True)
    out = ours(x)
    ref = plain_ple(ours, x_ref)
    torch.testing.assert_close(out, ref, msg=lambda m: f"seed {seed}: {m}")
    weights = skewed(*out.shape, seed=seed + 1)
    (out * weights).sum().backward()
    (ref * weights).sum().backward()
    torch.testing.assert_close(x.grad, x_ref.grad, msg=lambda m: f"seed {seed}: {m}")


def test_unpacked_ple_equals_packed():
    torch.manual_seed(3)
    packed = PLE(5, levels=2, shared_experts=1, task_experts=2, expert_layers=[6], gate_layers=[],
                 heads=["a", "b"], packed=True).double()
    unpacked = PLE(5, levels=2, shared_experts=1, task_experts=2, expert_layers=[6], gate_layers=[],
                   heads=["a", "b"], packed=False).double()
    with torch.no_grad():
        for p_level, u_level in zip(packed.experts, unpacked.experts):
            for k, mlp in enumerate(u_level.mlps):
                mlp.layers[0].weight.copy_(p_level.weights[0][k].t())
                mlp.layers[0].bias.copy_(p_level.biases[0][k, 0])
        unpacked.task_gates.load_state_dict(packed.task_gates.state_dict())
        unpacked.shared_gates.load_state_dict(packed.shared_gates.state_dict())
    x = skewed(11, 5, seed=4)
    torch.testing.assert_close(unpacked(x), packed(x))


def whole_output_doc(kind: str, inputs: list[str], dim: int) -> dict:
    return {
        "name": "whole", "features": [{"name": f"c{i}", "type": "categorical", "vocab": 9, "dim": dim} for i in (0, 1)],
        "modules": [{"name": "e", "kind": "moe", "inputs": ["@sparse"], "experts": 2, "expert_layers": [2],
                     "heads": ["a", "b"]},
                    {"name": "x", "kind": kind, "inputs": inputs}],
        "heads": [{"name": "h", "input": "x"}],
    }


@pytest.mark.parametrize("kind", ["dot", "fm"])
def test_a_whole_mixture_output_is_one_field_of_a_dot_or_fm(kind):
    """The module name alone reads all outputs, flattened: one field of 2 heads x 2 = 4 values, as
    `flowrec validate` counts it. The graph took the (2, 2) output as 2 fields of dim 2, so a spec
    that validated failed in `flowrec plan` ("interaction inputs need one common dim")."""
    doc = whole_output_doc(kind, ["e", "c1", "c0"], 4)
    assert validate_document(doc) == []
    plan = make_plan(spec_from_dict(doc), target="cpu", verify_passes=True)
    op = plan.graph.nodes["x"]["op"]
    assert (op.attr("num_fields"), op.attr("dim"), op.attr("flat_ports")) == (3, 4, (0,))
    assert op.out_shape == ("B", 3 if kind == "dot" else 1)
    mixed, c1, c0 = torch.randn(5, 2, 2), torch.randn(5, 4), torch.randn(5, 4)
    fields = torch.stack([mixed.reshape(5, 4), c1, c0], dim=1)  # (B, 3, 4)
    gram = fields @ fields.transpose(1, 2)
    pairs = torch.stack([gram[:, 0, 1], gram[:, 0, 2], gram[:, 1, 2]], dim=1)
    want = pairs if kind == "dot" else pairs.sum(dim=1, keepdim=True)
    got = registry.create(kind, dict(op.attrs), [(2, 2), (4,), (4,)])(mixed, c1, c0)
    torch.testing.assert_close(got, want)
    # the outputs' own dim is not the field dim: refused alike by validate and the graph
    narrow = whole_output_doc(kind, ["e", "c1", "c0"], 2)
    assert [i.path for i in validate_document(narrow)] == ["modules[1].inputs"]
    with pytest.raises(ValueError):
        make_plan(spec_from_dict(narrow), target="cpu")
