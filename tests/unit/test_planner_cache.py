"""The cache pass under several budgets and policies, hit rates from Zipf or a profile; access models."""
from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from flowrec.graph.build import build_graph
from flowrec.graph.types import PassContext
from flowrec.graph.verify import verify
from flowrec.planner.access import cdf_model, merge, zipf_model
from flowrec.planner.passes.cache import cache, table_budget
from flowrec.planner.passes.pack import pack
from flowrec.spec import load_spec
from flowrec.testing.specs import tiny_spec


def packed(spec, target="cpu", budget=None, profile=None):
    ctx = PassContext(spec=spec, target=target, device_budget_bytes=budget, profile=profile)
    return pack(build_graph(spec), ctx).graph, ctx


def run_cache(spec, budget=None, target="cpu", profile=None):
    g, ctx = packed(spec, target, budget, profile)
    before = pickle.dumps((list(g.nodes(data=True)), dict(g.graph)))
    r = cache(g, ctx)
    assert pickle.dumps((list(g.nodes(data=True)), dict(g.graph))) == before  # pure
    assert verify(r.graph) == []
    again = cache(r.graph, ctx)
    assert not again.modified and again.graph.graph["plan"] == r.graph.graph["plan"]
    return r, ctx


def fixed_bytes(spec, target="cpu"):
    g, ctx = packed(spec, target)
    return 10**15 - table_budget(g, replace(ctx, device_budget_bytes=10**15))


def groups_of(r):
    return {g.name: g for g in r.graph.graph["plan"].groups}


def test_everything_fits_is_no_change():
    r, _ = run_cache(tiny_spec())
    assert not r.modified  # groups start on the device: nothing to change, honestly reported
    assert all(g.placement == "device" and g.expected_hit_rate == 1.0 for g in groups_of(r).values())


def test_largest_group_leaves_device_first():
    spec = tiny_spec()
    total = sum(g.bytes for g in groups_of(run_cache(spec)[0]).values())
    r, _ = run_cache(spec, budget=fixed_bytes(spec) + total - 1)
    assert r.modified
    gs = groups_of(r)
    assert gs["g0_d1"].placement == "device"
    assert gs["g1_d4"].placement != "device"


@pytest.mark.parametrize("policy,placement", [("none", "host"), ("static_hot", "static_hot"),
                                              ("lookahead", "lookahead")])
def test_forced_policies(policy, placement):
    spec = tiny_spec(cache=policy)
    if policy == "lookahead":  # a window that does not fit is a planning error, not a silent miss
        with pytest.raises(ValueError, match=r"g1_d4: the lookahead window .* needs a scratchpad"):
            run_cache(spec, budget=fixed_bytes(spec) + 600)
        return
    big = groups_of(run_cache(spec, budget=fixed_bytes(spec) + 600)[0])["g1_d4"]
    assert big.placement == placement
    assert 0.0 <= big.expected_hit_rate <= 1.0
    assert big.cache_rows <= big.rows
    if placement == "host":
        assert big.cache_rows == 0 and big.expected_hit_rate == 0.0


def dlrm(repo):
    return load_spec(repo / "specs" / "dlrm_criteo.yaml")


def test_budgets_monotone_and_respected(repo):
    spec = replace(dlrm(repo), plan=replace(dlrm(repo).plan, cache="static_hot"))
    fixed = fixed_bytes(spec, "h100")
    last_rows, last_hit = -1, -1.0
    for gib in (0.25, 0.5, 1.0, 1.5, 2.0):
        budget = fixed + int(gib * 2**30)
        r, _ = run_cache(spec, budget=budget, target="h100")
        (g,) = groups_of(r).values()
        assert g.placement == "static_hot"
        assert g.cache_rows * g.row_bytes() <= budget - fixed
        assert g.cache_rows >= last_rows and g.expected_hit_rate >= last_hit
        last_rows, last_hit = g.cache_rows, g.expected_hit_rate
    r, _ = run_cache(spec, budget=fixed + 3 * 2**30, target="h100")
    assert next(iter(groups_of(r).values())).placement == "device"


def test_auto_on_gpu_picks_a_cache_and_lookahead_needs_room(repo):
    spec = dlrm(repo)
    fixed = fixed_bytes(spec, "h100")
    r, _ = run_cache(spec, budget=fixed + 2**30, target="h100")
    (g,) = groups_of(r).values()
    assert g.placement in ("static_hot", "lookahead")
    assert any("auto ->" in n for n in r.notes)
    tight, _ = run_cache(spec, budget=fixed + 2**20, target="h100")
    (t,) = groups_of(tight).values()
    assert t.placement != "lookahead"  # 1 MiB cannot hold a window's distinct rows


def test_profile_drives_hit_rate(repo):
    spec = replace(dlrm(repo), plan=replace(dlrm(repo).plan, cache="static_hot"))
    uniform = {"format": "flowrec-access-profile", "version": 1,
               "tables": {t.name: {"rows": t.rows, "accesses": t.rows, "distinct": t.rows,
                                   "hot_cdf": [[t.rows, 1.0]]} for t in spec.tables}}
    budget = fixed_bytes(spec, "h100") + 2**30
    zipf, _ = run_cache(spec, budget=budget, target="h100")
    flat, _ = run_cache(spec, budget=budget, target="h100", profile=uniform)
    (z,), (f,) = groups_of(zipf).values(), groups_of(flat).values()
    assert z.cache_rows == f.cache_rows
    assert f.expected_hit_rate == pytest.approx(f.cache_rows / f.rows, rel=1e-6)
    assert z.expected_hit_rate > f.expected_hit_rate
    assert any("(profile" in n for n in flat.notes)


def test_access_models():
    z = zipf_model(100_000)
    assert z.rows == pytest.approx(100_000)
    rates = [z.hit_rate(k) for k in (0, 10, 1000, 50_000, 100_000)]
    assert rates == sorted(rates) and rates[0] == 0.0 and rates[-1] == pytest.approx(1.0)
    assert z.distinct(10) <= 10 and z.distinct(10**9) == pytest.approx(100_000, rel=1e-3)
    c = cdf_model(100, [[10, 0.6], [50, 0.9]])
    assert c.hit_rate(5) == pytest.approx(0.3) and c.hit_rate(30) == pytest.approx(0.75)
    m = merge([(cdf_model(10, [[10, 1.0]]), 3.0), (cdf_model(30, [[30, 1.0]]), 1.0)])
    assert m.hit_rate(10) == pytest.approx(0.75)  # the denser table's rows come first


@pytest.mark.parametrize("policy", ["auto", "none", "static_hot", "lookahead"])
def test_placements_always_fit_the_budget(policy):
    from test_planner_pack import wide_spec

    base = wide_spec(120, seed=3)
    spec = replace(base, plan=replace(base.plan, cache=policy))
    g, ctx = packed(spec, "a100")
    total = sum(x.bytes for x in g.graph["plan"].groups)
    for fraction in (0.0, 0.05, 0.3, 0.7, 0.99, 1.5):
        budget_ctx = replace(ctx, device_budget_bytes=fixed_bytes(spec, "a100") + int(total * fraction))
        try:
            r = cache(g, budget_ctx)
        except ValueError as exc:  # forced lookahead whose window does not fit: a planning error
            assert policy == "lookahead" and "needs a scratchpad" in str(exc)
            continue
        groups = r.graph.graph["plan"].groups
        used = sum(x.bytes if x.placement == "device" else x.cache_rows * x.row_bytes() for x in groups)
        assert used <= table_budget(g, budget_ctx)
        assert sorted(x.name for x in groups) == sorted(x.name for x in g.graph["plan"].groups)
        if fraction >= 1:
            assert all(x.placement == "device" for x in groups)
