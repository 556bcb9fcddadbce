"""Per-table embedding L2 (`tables[].l2`): inside the fused sparse update, on the rows a step touches.

Reference: plain PyTorch, one `nn.EmbeddingBag` per table and the L2 written as a loss term,
l2 / 2 * sum of the squared rows the batch looks up (each unique row once), trained by torch.optim.
The cache placements (lookahead, static_hot, host) must equal device-resident tables with it.
"""
from __future__ import annotations

import random
from dataclasses import replace

import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.packing import group_layout
from flowrec.planner.manager import make_plan
from flowrec.runtime.caches import HostEmbedding, LookaheadEmbedding, StaticHotEmbedding, hottest_rows
from flowrec.runtime.lowering import lower
from flowrec.measure.reference import ReferenceModel
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict
from flowrec.testing.caches import (CPU, assert_same, head_weights, loss_of, train_cached, train_reference,
                                    window_rows)

BATCH = 64
STEPS = 20
L2 = 0.05


def l2_doc(seed: int, optimizer: str = "adagrad") -> dict:
    return {
        "name": "l2",
        "features": [
            {"name": "x0", "type": "dense"},
            {"name": "user", "type": "categorical", "table": "users"},
            {"name": "item", "type": "categorical", "table": "items"},
            {"name": "recent", "type": "sequence", "table": "items", "max_len": 4, "pooling": "mean"},
        ],
        "tables": [{"name": "users", "hash_buckets": 200, "dim": 8},
                   {"name": "items", "hash_buckets": 400, "dim": 8, "l2": L2}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.05}, "sparse": {"name": optimizer, "lr": 0.1}},
        "training": {"batch_size": BATCH, "seed": seed},
    }


def staged(spec, plan, seed: int, steps: int, window: int = 1) -> list:
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.3))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=window, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        return [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]


def test_l2_tables_form_their_own_group_with_weight_decay():
    spec = spec_from_dict(l2_doc(0))
    groups = {g.tables[0].table: g for g in group_layout(spec)}
    assert len(groups) == 2
    assert dict(groups["items"].optimizer[2]).get("weight_decay") == pytest.approx(L2)
    assert "weight_decay" not in dict(groups["users"].optimizer[2])


@pytest.mark.parametrize("optimizer", ["sgd", "adagrad"])
def test_training_with_table_l2_equals_the_loss_term_reference(optimizer):
    seed = random.randrange(1 << 30)
    spec = spec_from_dict(l2_doc(seed % 1000, optimizer))
    plan = make_plan(spec, target="cpu")
    batches = staged(spec, plan, seed, STEPS)
    model = lower(plan, spec, "cpu").double()
    dense_opt = make_dense_optimizer(model, "sgd", 0.05, {})
    ref = ReferenceModel(plan, spec).double()
    opts = [torch.optim.SGD(ref.dense_parameters(), lr=0.05),
            torch.optim.SGD(ref.table_parameters(), lr=0.1) if optimizer == "sgd"
            else torch.optim.Adagrad(ref.table_parameters(), lr=0.1, eps=1e-10)]
    for batch in batches:
        train_step(model, dense_opt, batch)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        fields = ref.field_inputs(batch)
        loss = ref.dense_model.loss(ref.dense_model.dense_forward(batch.dense, ref.embed(batch, fields), {}),
                                    batch.labels)
        touched = torch.unique(torch.cat([ids for group in ref.groups for f, (ids, _) in
                                          zip(group.fields, fields[group.name]) if f.table == "items"]))
        loss = loss + L2 / 2 * ref.table("items").weight[touched].square().sum()
        loss.backward()
        for opt in opts:
            opt.step()
    for group in model.groups:
        for slot in group.tables:
            torch.testing.assert_close(model.embeddings[group.name].table_rows(slot.table),
                                       ref.table(slot.table).weight.detach(), rtol=1e-9, atol=1e-11,
                                       msg=lambda m: f"seed {seed}: {slot.table}: {m}")


@pytest.mark.parametrize("placement", ["lookahead", "static_hot", "host"])
def test_cache_placements_with_l2_equal_device_tables(placement):
    spec = spec_from_dict(l2_doc(1))
    plan = make_plan(spec, target="cpu")
    group = next(replace(g, dtype="fp64") for g in group_layout(spec) if g.tables[0].table == "items")
    batches = staged(spec, plan, 5, 12, window=3)
    expected = train_reference(group, batches)
    if placement == "host":
        module = HostEmbedding(group, seed=3, device=CPU)
        w = head_weights(group)
        for batch in batches:
            g = batch.groups[group.name]
            loss_of(module(g.ids, g.offsets, g.casting), w).backward()
        assert_same((module.weight, module.state), expected, "fp64")
        return
    if placement == "lookahead":
        need = window_rows(batches, group.name)
        assert need < group.rows  # evictions happen
        module = LookaheadEmbedding(replace(group, cache_rows=need), seed=3, device=CPU)
    else:
        counts = torch.bincount(torch.cat([b.groups[group.name].ids for b in batches]), minlength=group.rows)
        module = StaticHotEmbedding(replace(group, cache_rows=group.rows // 4), seed=3, device=CPU)
        module.set_hot_rows(hottest_rows(counts, group.rows // 4))
    assert_same(train_cached(module, group, batches), expected, "fp64")
    close = getattr(module, "close", None)
    if close is not None:
        close()
