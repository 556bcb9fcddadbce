"""Whole models with cache placements train like the all-device model; the plan check keeps them."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrec.planner.contract import check_plan
from flowrec.planner.manager import make_plan
from flowrec.runtime.caches import StaticHotEmbedding, collect_counters, hottest_rows
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.testing.caches import cache_spec, staged, window_rows


def plan_with(spec, placement: str, cache_rows: dict[str, int]):
    plan = make_plan(spec, target="cpu")
    groups = tuple(replace(g, placement=placement, cache_rows=cache_rows.get(g.name, 0))
                   for g in plan.meta.groups)
    return plan.with_meta(replace(plan.meta, groups=groups))


def train(spec, plan, batches, micro_batches: int = 1, hot: bool = False):
    model = lower(plan, spec, "cpu")
    if hot:
        for name, module in model.embeddings.items():
            ids = torch.cat([b.groups[name].ids for b in batches])
            module.set_hot_rows(hottest_rows(torch.bincount(ids, minlength=module.group.rows),
                                             module.group.cache_rows))
    opt = make_dense_optimizer(model, "adam", 0.01, {})
    for batch in batches:
        train_step(model, opt, batch, micro_batches)
    return model


def tables(model):
    out = {}
    for name, module in model.embeddings.items():
        w, s = module.full_tables() if hasattr(module, "full_tables") else (module.weight, module.state)
        out[name] = (w.clone(), s.clone())
    return out


@pytest.mark.parametrize("placement,micro_batches", [("lookahead", 1), ("lookahead", 2), ("static_hot", 1),
                                                     ("host", 1)])
def test_cached_model_equals_device_model(placement, micro_batches):
    spec = cache_spec()
    batches = staged(spec, window=3)
    device_plan = plan_with(spec, "device", {})
    rows = {g.name: window_rows(batches, g.name) for g in device_plan.meta.groups}
    ref = train(spec, device_plan, batches, micro_batches)
    got = train(spec, plan_with(spec, placement, rows), batches, micro_batches, hot=placement == "static_hot")
    for name, (w, s) in tables(ref).items():
        torch.testing.assert_close(tables(got)[name][0], w, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(tables(got)[name][1], s, rtol=1e-6, atol=1e-7)
    for p, q in zip(ref.dense_parameters(), got.dense_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    counters = collect_counters(got)
    assert set(counters) == set(rows)
    if placement == "lookahead":
        assert all(c["hit_rate"] == 1.0 for c in counters.values())


def test_checkpoint_roundtrip_resumes_exactly():
    spec = cache_spec()
    batches = staged(spec, window=3)
    plan = plan_with(spec, "lookahead", {g.name: window_rows(batches, g.name)
                                         for g in make_plan(spec, target="cpu").meta.groups})
    first = train(spec, plan, batches[:7])
    resumed = lower(plan, spec, "cpu")
    resumed.load_state_dict(first.state_dict())
    opt = make_dense_optimizer(resumed, "adam", 0.01, {})
    ref_opt = make_dense_optimizer(first, "adam", 0.01, {})
    for batch in batches[7:]:
        train_step(first, ref_opt, batch)
        train_step(resumed, opt, batch)
    for name, (w, s) in tables(first).items():
        assert torch.equal(tables(resumed)[name][0], w) and torch.equal(tables(resumed)[name][1], s)


def test_plan_check_keeps_cache_placements_and_refuses_empty_caches():
    spec = cache_spec()
    first = make_plan(spec, target="cpu").meta.groups[0].name
    plan = plan_with(spec, "lookahead", {first: 100})
    problems = check_plan(plan, spec)
    placements = {g.name: g.placement for g in plan.meta.groups}
    assert placements[first] == "lookahead"
    assert all(p == "lookahead" for p in placements.values())
    assert any("needs cache_rows between 1 and" in p for p in problems) == (len(placements) > 1)
    runnable = plan_with(spec, "lookahead", {g.name: 100 for g in plan.meta.groups})
    assert check_plan(runnable, spec) == []
    model = lower(runnable, spec, "cpu")
    assert isinstance(model.embeddings, torch.nn.ModuleDict)
    assert not any(isinstance(m, StaticHotEmbedding) for m in model.embeddings.values())
