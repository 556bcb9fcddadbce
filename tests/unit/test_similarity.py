"""`similarity` equals a hand-written dot / cosine over a temperature (forward and gradients), is
wired through spec checks, graph, shapes and cost, and a two-tower model trains like a plain
PyTorch two-tower model with the same weights."""
from __future__ import annotations

import copy

import pytest
import torch

from operators import registry

SPEC = {
    "name": "sim",
    "features": [{"name": "user", "type": "categorical", "vocab": 40, "dim": 8},
                 {"name": "item", "type": "categorical", "vocab": 60, "dim": 8},
                 {"name": "tag", "type": "categorical", "vocab": 10, "dim": 4}],
    "modules": [{"name": "ut", "kind": "mlp", "inputs": ["user"], "layers": [6]},
                {"name": "it", "kind": "mlp", "inputs": ["item", "tag"], "layers": [6]},
                {"name": "score", "kind": "similarity", "inputs": ["ut", "it"], "metric": "cosine",
                 "temperature": 0.2}],
    "heads": [{"name": "ctr", "input": "score"}],
    "optimizer": {"dense": {"name": "sgd", "lr": 0.1}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 64, "seed": 0},
}


def skewed(rows: int, dim: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scale = torch.rand(rows, 1, generator=gen, dtype=torch.float64) ** 4 * 50 + 1e-3  # norms over 4 decades
    return torch.randn(rows, dim, generator=gen, dtype=torch.float64) * scale + 0.3


@pytest.mark.parametrize("metric,temperature", [("dot", 1.0), ("dot", 0.05), ("cosine", 1.0), ("cosine", 0.07)])
def test_equals_the_hand_written_similarity(metric, temperature):
    op = registry.create("similarity", {"metric": metric, "temperature": temperature}, [(7,), (7,)])
    q, i = skewed(50, 7, 1).requires_grad_(), skewed(50, 7, 2).requires_grad_()
    q2, i2 = q.detach().clone().requires_grad_(), i.detach().clone().requires_grad_()
    got = op(q, i)
    if metric == "cosine":
        want = torch.stack([(a @ b) / (a.norm() * b.norm()) for a, b in zip(q2, i2)]) / temperature
    else:
        want = torch.stack([a @ b for a, b in zip(q2, i2)]) / temperature
    assert got.shape == (50, 1)
    torch.testing.assert_close(got[:, 0], want, rtol=1e-12, atol=1e-12)
    weights = torch.randn(50, dtype=torch.float64)
    (got[:, 0] * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(q.grad, q2.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(i.grad, i2.grad, rtol=1e-10, atol=1e-12)


def test_field_slices_are_flattened():
    op = registry.create("similarity", {}, [(1, 4), (1, 4)])
    packed = skewed(9, 8, 3).view(9, 2, 4)
    torch.testing.assert_close(op(packed[:, 0:1], packed[:, 1:2])[:, 0], (packed[:, 0] * packed[:, 1]).sum(1))


def test_graph_shape_and_cost():
    from flowrec.graph.build import build_graph
    from flowrec.graph.verify import verify
    from flowrec.planner.op_work import op_work
    from flowrec.spec.load import spec_from_dict

    graph = build_graph(spec_from_dict(SPEC))
    assert verify(graph) == []
    op = graph.nodes["score"]["op"]
    assert op.out_shape == ("B", 1) and dict(op.attrs)["metric"] == "cosine"
    cosine = op_work(op, 128, 2)
    doc = copy.deepcopy(SPEC)
    doc["modules"][2]["metric"] = "dot"
    dot = op_work(build_graph(spec_from_dict(doc)).nodes["score"]["op"], 128, 2)
    assert 0 < sum(dot.forward.elementwise) < sum(cosine.forward.elementwise)


@pytest.mark.parametrize("temperature,refused", [(1e-30, True), (5e-5, True), (1e-4, False), (1e6, False)])
def test_a_temperature_too_small_to_train_is_refused_naming_the_field(temperature, refused):
    """1e-30 validated, then training stopped at step 1 on a loss of inf: the lower bound (as the
    upper one) is a validation error naming the field."""
    from flowrec.spec.validate import validate_document

    doc = copy.deepcopy(SPEC)
    doc["modules"][2]["temperature"] = temperature
    issues = [str(i) for i in validate_document(doc)]
    assert bool(issues) == refused, issues
    assert all("modules[2].temperature" in i for i in issues), issues


def test_invalid_similarities_are_reported_together_with_their_paths():
    from flowrec.spec.validate import validate_document

    doc = copy.deepcopy(SPEC)
    doc["modules"][2].update(metric="l2", temperature=0)
    doc["modules"][1]["layers"] = [5]
    text = "\n".join(str(i) for i in validate_document(doc))
    assert "modules[2].metric" in text and "modules[2].temperature" in text, text
    doc = copy.deepcopy(SPEC)
    doc["modules"][1]["layers"] = [5]
    doc["modules"][0]["layers"] = [0]
    text = "\n".join(str(i) for i in validate_document(doc))
    assert "modules[0].layers" in text, text
    doc = copy.deepcopy(SPEC)
    doc["modules"][1]["layers"] = [5]
    doc["heads"][0]["task"] = "bogus"
    text = "\n".join(str(i) for i in validate_document(doc))
    assert "similarity needs two vectors of one width" in text and "modules[2].inputs" in text, text
    assert "heads[0].task" in text, text
    doc = copy.deepcopy(SPEC)
    doc["modules"][2]["inputs"] = ["ut", "it", "tag"]
    text = "\n".join(str(i) for i in validate_document(doc))
    assert "similarity needs exactly two inputs" in text, text


def test_two_tower_trains_like_plain_pytorch():
    """20 SGD steps of the lowered model == the same towers and similarity written by hand."""
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.lowering import lower
    from flowrec.spec.load import spec_from_dict

    spec = spec_from_dict(SPEC)
    model = lower(make_plan(spec), spec, "cpu").double()
    ut, it, head = model.ops["ut"], model.ops["it"], model.ops["head_ctr"]
    assert type(model.ops["score"]).__name__ == "Similarity"
    gen = torch.Generator().manual_seed(5)
    tables = {name: torch.randn(rows, dim, generator=gen, dtype=torch.float64) * 0.3
              for name, rows, dim in (("user", 41, 8), ("item", 61, 8), ("tag", 11, 4))}
    users = torch.randint(0, 41, (20, 64), generator=gen)
    items = (torch.rand(20, 64, generator=gen) ** 3 * 61).long()
    tags = items % 11
    labels = ((users + items) % 3 == 0).double()
    ref = {k: v.clone().requires_grad_() for k, v in tables.items()}
    ref_params = [p.detach().clone().requires_grad_() for p in (*ut.parameters(), *it.parameters(), *head.parameters())]
    mine_params = [*ut.parameters(), *it.parameters(), *head.parameters()]
    mine_tables = {k: v.clone().requires_grad_() for k, v in tables.items()}
    for step in range(20):
        for params, emb, plain in ((mine_params, mine_tables, False), (ref_params, ref, True)):
            u = emb["user"][users[step]]
            x = torch.cat([emb["item"][items[step]], emb["tag"][tags[step]]], dim=1)
            if plain:
                w1, b1, w2, b2, w3, b3 = params
                uq = torch.relu(u @ w1.T + b1)
                iv = torch.relu(x @ w2.T + b2)
                s = (uq / uq.norm(dim=1, keepdim=True).clamp(min=1e-12) * iv
                     / iv.norm(dim=1, keepdim=True).clamp(min=1e-12)).sum(1, keepdim=True) / 0.2
                logit = (s @ w3.T + b3)[:, 0]
            else:
                logit = head(model.ops["score"](ut(u), it(x)))[:, 0]
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logit, labels[step])
            grads = torch.autograd.grad(loss, [*params, *emb.values()])
            with torch.no_grad():
                for p, g in zip([*params, *emb.values()], grads):
                    p -= 0.1 * g
    for a, b in zip(mine_params, ref_params):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
    assert not torch.allclose(mine_tables["item"], tables["item"])
