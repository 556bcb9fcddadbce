"""Head options: weight, sample_weight, trained_where and multiclass, against hand-written losses.

The reference trains flowrec's unpacked reference model (per-table `nn.EmbeddingBag`) with a loss
written out here in plain PyTorch (per-row BCE / softmax cross-entropy, times the sample weight and
the task-space mask, over the batch size); flowrec trains with its packed tables and `Loss`.
"""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from torch.nn import functional as F

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.evaluation.evaluate import evaluate
from flowrec.runtime.lowering import lower
from flowrec.measure.reference import ReferenceModel, reference_optimizers
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict
from flowrec.spec.validate import validate_document
from operators.losses import Loss

BATCH = 64
STEPS = 20
CLASSES = 5


def heads_doc(seed: int) -> dict:
    return {
        "name": "heads",
        "features": [
            {"name": "x0", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 300, "dim": 8},
            {"name": "item", "type": "categorical", "hash_buckets": 500, "dim": 8},
        ],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [16]},
            {"name": "t1", "kind": "mlp", "inputs": ["bottom"], "layers": [8]},
            {"name": "t2", "kind": "mlp", "inputs": ["bottom"], "layers": [8]},
        ],
        "heads": [
            {"name": "click", "input": "t1", "label": "click", "weight": 0.7},
            {"name": "conv", "input": "t2", "label": "conv", "sample_weight": "w",
             "trained_where": {"label": "click", "equals": 1}},
            {"name": "genre", "input": "bottom", "task": "multiclass", "num_classes": CLASSES,
             "label": "genre", "weight": 0.5},
        ],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.1}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": BATCH, "seed": seed},
    }


def staged(spec, plan, seed: int, steps: int) -> list:
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.3))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        return [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]


def hand_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The heads' loss written out: labels (B, 4) = click, conv, genre, w."""
    click, conv, genre, w = labels.unbind(1)
    n = labels.shape[0]
    first = F.binary_cross_entropy_with_logits(logits[:, 0], click, reduction="sum") / n
    mask = (click == 1).double()
    second = (F.binary_cross_entropy_with_logits(logits[:, 1], conv, reduction="none") * mask * w).sum() / n
    log_p = torch.log_softmax(logits[:, 2:], dim=1)
    third = -log_p.gather(1, genre.long().unsqueeze(1)).sum() / n
    return 0.7 * first + second + 0.5 * third


def test_label_tensor_holds_labels_then_sample_weights():
    spec = spec_from_dict(heads_doc(0))
    plan = make_plan(spec, target="cpu")
    batch = staged(spec, plan, 1, 1)[0]
    assert batch.labels.shape == (BATCH, 4)
    click, conv, genre, w = batch.labels.unbind(1)
    assert set(click.tolist()) == {0.0, 1.0} and set(genre.tolist()) <= set(range(CLASSES))
    assert len(set(genre.tolist())) > 2 and bool((w > 0).all()) and len(set(w.tolist())) > 10
    loss = plan.graph.nodes["loss"]["op"]
    assert loss.attr("widths") == (1, 1, CLASSES)
    assert loss.attr("sample_weights") == (-1, 3, -1) and loss.attr("masks") == ((-1, 0.0), (0, 1.0), (-1, 0.0))
    assert plan.graph.nodes["head_genre"]["op"].out_shape == ("B", CLASSES)


def test_loss_equals_the_hand_written_loss():
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    logits = torch.randn(50, 2 + CLASSES, generator=gen, dtype=torch.float64) * 3
    labels = torch.stack([torch.randint(0, 2, (50,), generator=gen).double(),
                          torch.randint(0, 2, (50,), generator=gen).double(),
                          torch.randint(0, CLASSES, (50,), generator=gen).double(),
                          torch.rand(50, generator=gen, dtype=torch.float64) * 3], dim=1)
    loss = Loss(["bce", "bce", "softmax_ce"], [0.7, 1.0, 0.5], [1, 1, CLASSES], [-1, 3, -1],
                [(-1, 0.0), (0, 1.0), (-1, 0.0)])
    torch.testing.assert_close(loss(logits, labels), hand_loss(logits, labels))
    rows = labels[:, 0] == 1  # the conversion head learns nothing from rows outside its space
    a = logits.clone().requires_grad_(True)
    loss(a, labels).backward()
    assert torch.all(a.grad[~rows, 1] == 0) and torch.any(a.grad[rows, 1] != 0)


def test_training_equals_reference_with_the_hand_written_loss():
    seed = random.randrange(1 << 30)
    spec = spec_from_dict(heads_doc(seed % 1000))
    plan = make_plan(spec, target="cpu")
    batches = staged(spec, plan, seed, STEPS)
    model = lower(plan, spec, "cpu").double()
    optimizer = make_dense_optimizer(model, "sgd", 0.1, {})
    ref = ReferenceModel(plan, spec).double()
    ref_opts = reference_optimizers(ref, spec)
    for batch in batches:
        ours = train_step(model, optimizer, batch)
        for opt in ref_opts:
            opt.zero_grad(set_to_none=True)
        theirs = hand_loss(ref(batch), batch.labels)
        theirs.backward()
        for opt in ref_opts:
            opt.step()
        assert ours == pytest.approx(float(theirs.detach()), rel=1e-9), f"seed {seed}"
    ref_params = dict(ref.dense_model.ops.named_parameters())
    for name, p in model.ops.named_parameters():
        torch.testing.assert_close(p, ref_params[name].detach(), rtol=1e-7, atol=1e-9,
                                   msg=lambda m: f"seed {seed}: {name}: {m}")
    for group in model.groups:
        for slot in group.tables:
            torch.testing.assert_close(model.embeddings[group.name].table_rows(slot.table),
                                       ref.table(slot.table).weight.detach(), rtol=1e-7, atol=1e-9)


def test_evaluation_reports_each_task_on_its_task_space():
    spec = spec_from_dict(heads_doc(2))
    plan = make_plan(spec, target="cpu")
    batches = staged(spec, plan, 3, 4)
    model = lower(plan, spec, "cpu").double()
    metrics = evaluate(model, batches)
    clicked = int(sum((b.labels[:, 0] == 1).sum() for b in batches))
    assert metrics["click"]["samples"] == 4 * BATCH and metrics["conv"]["samples"] == clicked < 4 * BATCH
    genre = metrics["genre"]
    assert set(genre) == {"accuracy", "accuracy_at_k", "logloss", "k", "classes", "auc", "samples"}
    assert 0.5 < genre["auc"] <= 1.0  # the class follows the hidden logit (synthetic labels)
    assert 0.0 <= genre["accuracy"] <= genre["accuracy_at_k"] <= 1.0 and genre["k"] == min(5, CLASSES - 1)
    assert genre["logloss"] > 0
    # counts are integers (eval --json -, train --json and metrics.jsonl wrote k 4.0, classes 3.0)
    assert type(genre["k"]) is int and type(genre["classes"]) is int and type(genre["samples"]) is int


def test_macro_auc_is_the_mean_one_vs_rest_auc():
    from flowrec.runtime.evaluation.classes import MulticlassAccumulator
    from flowrec.runtime.run_log import auc

    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    labels = torch.randint(0, 3, (200,), generator=gen).numpy()
    probs = torch.softmax(torch.randn(200, 3, generator=gen) + 2 * F.one_hot(torch.from_numpy(labels), 3), 1)
    acc = MulticlassAccumulator()
    acc.update(labels[:90], probs[:90].numpy())
    acc.update(labels[90:], probs[90:].numpy())
    expected = sum(auc((labels == c).astype(float), probs[:, c].numpy()) for c in range(3)) / 3
    assert acc.result()["auc"] == pytest.approx(expected, abs=1e-12)


def test_tied_class_probabilities_count_as_argmax_breaks_them():
    """A model whose logits are all equal (its input all zeros: dead ReLUs) scored accuracy 1.0, and
    a label whose probability underflowed to 0 beside others of 0 counted among the top k: ties
    counted for the label. Now they count as numpy's argmax (and a stable sort) break them: the
    lower class index first."""
    from flowrec.runtime.evaluation.classes import MulticlassAccumulator

    gen = np.random.default_rng(random.randrange(1 << 30))
    labels = gen.integers(0, 6, 300)
    probs = np.round(gen.dirichlet(np.ones(6) * 0.3, 300), 2)  # many ties, zeros among them
    probs[:50] = 1 / 6  # all equal
    acc = MulticlassAccumulator(k=3)
    acc.update(labels, probs)
    order = np.argsort(-probs, axis=1, kind="stable")
    assert acc.result()["accuracy"] == (probs.argmax(axis=1) == labels).mean()
    assert acc.result()["accuracy_at_k"] == (order[:, :3] == labels[:, None]).any(axis=1).mean()
    assert acc.result()["accuracy"] < 1


@pytest.mark.parametrize("change,where,says", [
    ({"loss": "softmax_ce"}, "heads[0].loss", "multiclass"),
    ({"task": "multiclass"}, "heads[0].num_classes", "needs num_classes"),
    ({"num_classes": 3}, "heads[0].num_classes", "only a multiclass head"),
    ({"trained_where": {"label": "nope", "equals": 1}}, "heads[0].trained_where.label", "another head"),
    ({"trained_where": {"label": "click", "equals": 1}}, "heads[0].trained_where.label", "another head"),
    ({"trained_where": {"label": "conv"}}, "heads[0].trained_where", "equals"),
])
def test_bad_head_options_are_reported_with_their_path(change, where, says):
    doc = heads_doc(0)
    doc["heads"][0].update(change)
    doc["heads"][1]["input"] = "nowhere"  # a second error, reported with the first
    issues = validate_document(doc)
    text = "\n".join(str(i) for i in issues)
    assert any(i.path == where and says in i.message for i in issues), text
    assert any(i.path == "heads[1].input" for i in issues), text
