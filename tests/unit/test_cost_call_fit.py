"""A collective call's price at another call count (`flowrec calibrate --nproc N`, issue 28 item 2).

One lumped price per call (`rank_step_call_us`: the calibrated plan's sharded step beyond its
one-process step and bytes, over its calls) is right at the call count it was fitted at; a plan
of the spec under another budget (a small group replicated: one call a step instead of four) was
priced by proportion. Where two plans of the spec have different call counts, calibration steps
both and fits a part per step and a part per call (`flowrec.measure.concurrent.call_fit`), and the
cost model prices a plan's exchange by the fit (`flowrec.planner.cost.step_call_fit`). Fake rounds
only: no timing is asserted; the two-process test starts real ranks."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flowrec.measure.concurrent import (SHARDED_BLOCKS, call_fit, in_step_call, measure_ranks, other_layout,
                                        rank_constants, two_plan_fit)
from flowrec.planner.calibration import COLLECTIVE, ZERO_OK, profile_document, profile_fields
from flowrec.planner.cost import DEVICES, step_call_fit, step_collectives
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec

LINK = {"collective_gbps": (2.0, "fit"), "collective_us": (150.0, "fit"), "collective_world_size": (2, "n")}


def _profile(tmp_path: Path, name: str, **measured) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile_document("cpu", {**LINK, **measured}, "test", "2026-01-01T00:00:00Z")))
    return str(path)


def _rounds(rng: random.Random, ms: float, steps: int) -> list[list[float]]:
    """Clean rounds whose timing-rule estimate is `ms` (its median: an odd count around it)."""
    spread = [ms * (1 + rng.uniform(0.01, 0.2)) for _ in range(steps // 2)]
    return [[ms, 0.0]] + [[x, 0.0] for x in spread] + [[2 * ms - x, 0.0] for x in spread]


def test_two_plans_of_different_call_counts_give_the_part_per_step_and_the_part_per_call():
    rng = random.Random()
    fixed_us, per_call_us = rng.uniform(500.0, 4000.0), rng.uniform(300.0, 2000.0)
    unsharded_ms = rng.uniform(2.0, 40.0)
    plans = [(6, rng.uniform(0.1, 5.0)), (3, rng.uniform(0.1, 5.0))]  # (calls, exchange bytes' ms)
    steps = rng.randrange(5, 15) * 2 + 1
    ranks = []
    for _ in range(2):  # the slower rank of each step is the one the rule takes: both alike here
        rank = {}
        for key, (calls, bytes_ms) in zip(("sharded_steps_ms", "other_sharded_steps_ms"), plans):
            rank[key] = _rounds(rng, unsharded_ms + bytes_ms + (fixed_us + calls * per_call_us) * 1e-3, steps)
        ranks.append(rank)
    details = {"live_ms": 1e3, "skew": {"slowest_per_step_ms": unsharded_ms}}
    first = in_step_call(ranks, details, *plans[0], floor_us=100.0)
    second, fit = two_plan_fit(ranks, details, first, ("budget", *plans[1]), 100.0)
    assert (second["calls"], second["device_budget"]) == (3, "budget")
    assert fit["how"] == "exact" and fit["calls"] == [6, 3]
    assert fit["fixed_us"] == pytest.approx(fixed_us, rel=1e-6)
    assert fit["per_call_us"] == pytest.approx(per_call_us, rel=1e-6)
    # the lumped price reproduces its own plan only: at 3 calls it is off by the fixed part's share
    lumped = first["call_us"]
    assert lumped == pytest.approx(per_call_us + fixed_us / 6, rel=1e-6)
    assert 3 * lumped - (fixed_us + 3 * per_call_us) == pytest.approx(-fixed_us / 2, rel=1e-6)
    # either plan not stepped (one rank, managed tables, no other layout): no fit
    assert two_plan_fit([{k: v for k, v in r.items() if k != "other_sharded_steps_ms"} for r in ranks],
                        details, first, ("budget", *plans[1]), 100.0) is None
    assert two_plan_fit(ranks, details, first, None, 100.0) is None
    assert two_plan_fit(ranks, details, None, ("budget", *plans[1]), 100.0) is None


def test_a_fit_beyond_its_bounds_keeps_the_idle_call_and_no_negative_fixed_part():
    def plan(rest_ms: float, calls: int) -> dict:
        return {"sharded_step_ms": 10.0 + rest_ms + 0.5, "unsharded_step_ms": 10.0, "bytes_ms": 0.5, "calls": calls}

    # more calls, less time: a call at the idle call, the fixed part the plans' mean rest
    low = call_fit(plan(3.0, 6), plan(4.0, 3), floor_us=200.0)
    assert low["per_call_us"] == 200.0 and low["how"] == "per call at the idle call"
    assert low["fixed_us"] == pytest.approx(((3000.0 - 1200.0) + (4000.0 - 600.0)) / 2)
    # a negative fixed part: the calls alone, least squares through zero
    steep = call_fit(plan(9.0, 6), plan(3.0, 3), floor_us=100.0)
    assert steep["fixed_us"] == 0.0 and steep["how"].startswith("calls alone")
    assert steep["per_call_us"] == pytest.approx((9000.0 * 6 + 3000.0 * 3) / (36 + 9))
    with pytest.raises(ValueError, match="no per-call part"):
        call_fit(plan(3.0, 6), plan(4.0, 6))


def test_a_plan_of_other_calls_is_priced_by_the_fit_not_by_proportion(tmp_path: Path, repo):
    """The fit's part per step once a step and its part per call for each call, for ranks only;
    a profile without the fit prices as before (the lumped price per call)."""
    spec = load_spec(repo / "specs" / "movielens.yaml")
    rng = random.Random()
    fixed_us, per_call_us = rng.uniform(1000.0, 4000.0), rng.uniform(300.0, 900.0)
    lumped_us = per_call_us + fixed_us / 6  # what the 6-call plan's calibration gives as one price
    ranks = {"rank_compute_scale": (1.2, "ranks"), "rank_collective_us": (400.0, "ranks"),
             "rank_step_call_us": (lumped_us, "steps")}
    lumped = _profile(tmp_path, "lumped.json", **ranks)
    fitted = _profile(tmp_path, "fitted.json", **ranks, rank_step_fixed_us=(fixed_us, "fit"),
                      rank_step_per_call_us=(per_call_us, "fit"))
    for budget, calls in (("64MiB", 6), (None, 3)):  # row-wise (4 calls) vs replicated (1) embeddings
        old = make_plan(spec, target=lumped, world_size=2, device_budget=budget)
        new = make_plan(spec, target=fitted, world_size=2, device_budget=budget)
        assert step_collectives(new.graph, spec)[0] == calls
        assert new.cost.stage_ms == old.cost.stage_ms
        moved = new.cost.exchange_ms - old.cost.exchange_ms
        assert moved == pytest.approx((fixed_us + calls * per_call_us - calls * lumped_us) * 1e-3, abs=2e-6)
        assert new.cost.step_ms_overlap - old.cost.step_ms_overlap == pytest.approx(moved, abs=4e-6)
        if calls == 6:  # the calibrated plan: both price it alike
            assert moved == pytest.approx(0.0, abs=2e-6)
        else:  # the other plan: by proportion it lost half the fixed part
            assert moved == pytest.approx(fixed_us / 2 * 1e-3, abs=2e-6)
    one, one_fitted = (make_plan(spec, target=p).cost for p in (lumped, fitted))
    assert (one.step_ms_overlap, one.exchange_ms) == (one_fitted.step_ms_overlap, one_fitted.exchange_ms)
    gpu = DEVICES["a100"]
    assert step_call_fit(gpu.__class__(**{**gpu.__dict__, "rank_step_per_call_us": 500.0}), 2) is None
    assert step_call_fit(DEVICES["cpu"], 2) is None


def test_the_fit_is_a_profile_constant_of_nproc_calibration():
    fields = profile_fields({"base": "cpu", "measured": {"rank_step_fixed_us": {"value": 0.0},
                                                         "rank_step_per_call_us": {"value": 512.5}}}, "p.json")
    assert fields == {"rank_step_fixed_us": 0.0, "rank_step_per_call_us": 512.5}
    assert {"rank_step_fixed_us", "rank_step_per_call_us"} <= COLLECTIVE
    assert "rank_step_fixed_us" in ZERO_OK and "rank_step_per_call_us" not in ZERO_OK


def test_the_second_layout_is_the_first_budget_that_shards_the_spec_with_other_calls(tmp_path: Path, repo):
    profile = _profile(tmp_path, "p.json")
    movielens = load_spec(repo / "specs" / "movielens.yaml")
    budget, calls, bytes_ms = other_layout(movielens, profile, 2, "64MiB", 6)
    assert (budget, calls) == (None, 3) and bytes_ms > 0  # the default budget: its group replicated
    budget, calls, _ = other_layout(movielens, profile, 2, None, 3)
    assert (budget, calls) == ("16MiB", 6)  # calibrated at the default: a small budget, row-wise
    dlrm = load_spec(repo / "specs" / "dlrm_criteo.yaml")  # tables too large to replicate under any budget
    assert other_layout(dlrm, profile, 2, "64MiB", 6) is None


def test_two_processes_step_two_layouts_and_fit_them(repo, tmp_path: Path):
    spec = repo / "specs" / "movielens.yaml"
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(profile_document("cpu", {}, "test", "2026-01-01T00:00:00Z")))
    results = measure_ranks(spec, profile, 2, 64, 3, timeout_s=300, device_budget="16MiB",
                            other={"device_budget": None})
    assert len(results) == 2
    for r in results:
        for key in ("sharded_steps_ms", "other_sharded_steps_ms"):  # stepped twice, in turn, each time in blocks
            n = len(r[key])  # of 2, more while too few are clean or too few seconds timed, SHARDED_BLOCKS at most
            assert n % 2 == 0 and 4 <= n <= 2 * SHARDED_BLOCKS * 2
        assert len(r["other_sharded_steps_ms"]) == len(results[0]["other_sharded_steps_ms"])
        assert all(0 < wall < 60e3 and 0 <= waited <= wall for wall, waited in r["other_sharded_steps_ms"])
    details = rank_constants(results, 1.0, 100.0)[3]
    first = in_step_call(results, details, 6, 0.1, floor_us=1.0)
    second, fit = two_plan_fit(results, details, first, (None, 3, 0.2), 1.0)
    assert second["sharded_step_ms"] > 0 and fit["calls"] == [6, 3]
    assert fit["per_call_us"] >= 1.0 and fit["fixed_us"] >= 0.0


def test_only_an_exact_fit_becomes_profile_constants():
    """Two plans whose steps differ by more than their calls explain (fewer calls, no cheaper) keep
    the lumped price: a fit beyond its bounds stays in the details only."""
    from flowrec.measure.concurrent import fitted_constants

    def plan(rest_ms: float, calls: int) -> dict:
        return {"sharded_step_ms": 4.0 + rest_ms, "unsharded_step_ms": 4.0, "bytes_ms": 0.0, "calls": calls}

    rng = random.Random()
    fixed, per_call = rng.uniform(1.0, 9.0), rng.uniform(0.3, 1.0)
    exact = call_fit(plan(fixed + 6 * per_call, 6), plan(fixed + 3 * per_call, 3), floor_us=100.0)
    constants = fitted_constants(exact, "two plans")
    assert constants["rank_step_fixed_us"][0] == pytest.approx(fixed * 1e3)
    assert constants["rank_step_per_call_us"][0] == pytest.approx(per_call * 1e3)
    assert all(how.startswith("two plans: the part per") for _, how in constants.values())
    slower = call_fit(plan(11.0, 10), plan(11.0 + rng.uniform(0.5, 3.0), 7), floor_us=180.0)  # fewer calls, slower
    assert slower["how"] == "per call at the idle call" and fitted_constants(slower, "two plans") == {}
    steep = call_fit(plan(9.0, 6), plan(3.0, 3), floor_us=100.0)
    assert steep["how"] != "exact" and fitted_constants(steep, "two plans") == {}
