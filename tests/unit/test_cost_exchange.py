"""A lookahead scratchpad's exchange on the host (`Scratchpad.exchange` with `NextUseFirst`: the
window's row-map lookups, the ranking of the resident rows it does not pin, fetches and
write-backs), run on a worker thread beside the step: measured by `flowrec calibrate` per slot
(`exchange_ns_per_slot`, `flowrec.measure.ops.exchange_ns_per_slot`) and priced with staging
(`cost.exchange_seconds`). No timing is asserted."""
from __future__ import annotations

import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowrec.measure import ops
from flowrec.planner.calibration import ProfileError, profile_document, profile_fields
from flowrec.planner.cost import device_profile, group_step_seconds
from flowrec.planner.manager import make_plan
from flowrec.spec import spec_from_dict


def _profile(tmp_path: Path, name: str, **measured) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "fit"), **measured}, "test",
                                                "2026-01-01T00:00:00Z")))
    return str(path)


def _spec(cache: str):
    return spec_from_dict({
        "name": "exchange_cost",
        "features": [{"name": "d", "type": "dense"},
                     {"name": "big", "type": "categorical", "hash_buckets": 2_000_000, "dim": 16},
                     {"name": "wide", "type": "categorical", "hash_buckets": 3_000_000, "dim": 1, "tags": ["wide"]}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}],
        "heads": [{"name": "h", "input": "m"}],
        "training": {"batch_size": 4096},
        "plan": {"cache": cache, "window": 4},
    })


def test_lookahead_slots_are_priced_with_staging_at_the_measured_cost(tmp_path: Path):
    ns = random.uniform(50.0, 400.0)
    spec = _spec("lookahead")
    before = make_plan(spec, target=_profile(tmp_path, "a.json"), device_budget="48MiB")
    after = make_plan(spec, target=_profile(tmp_path, "b.json", exchange_ns_per_slot=(ns, "trace")),
                      device_budget="48MiB")
    slots = sum(g.cache_rows for g in after.meta.groups if g.placement == "lookahead")
    assert slots > 1000 and [g.cache_rows for g in after.meta.groups] == [g.cache_rows for g in before.meta.groups]
    added = dict(after.cost.stage_ms)["staging"] - dict(before.cost.stage_ms)["staging"]
    assert added == pytest.approx(slots * ns * 1e-6, rel=1e-6, abs=3e-6)
    assert after.cost.step_ms_overlap - before.cost.step_ms_overlap == pytest.approx(added, abs=3e-6)  # the CPU
    for stage in ("sparse", "dense", "backward"):
        assert dict(after.cost.stage_ms)[stage] == dict(before.cost.stage_ms)[stage]


def test_static_hot_and_resident_plans_pay_nothing(tmp_path: Path):
    for cache, budget in (("static_hot", "48MiB"), ("auto", None)):
        spec = _spec(cache)
        plain = make_plan(spec, target=_profile(tmp_path, "a.json"), device_budget=budget).cost
        measured = make_plan(spec, target=_profile(tmp_path, "b.json", exchange_ns_per_slot=(300.0, "trace")),
                             device_budget=budget).cost
        assert (plain.stage_ms, plain.step_ms_overlap) == (measured.stage_ms, measured.step_ms_overlap)


def test_the_cache_pass_weighs_the_exchange_of_a_lookahead_group_only(tmp_path: Path):
    """`group_step_seconds` (what the cache pass compares placements by) adds the exchange to a
    lookahead group's cost, slots x the measured cost, and nothing to a static_hot one's."""
    ns = random.uniform(50.0, 400.0)
    spec = _spec("lookahead")
    plan = make_plan(spec, target=_profile(tmp_path, "a.json"), device_budget="48MiB")
    plain = device_profile(_profile(tmp_path, "a.json"))
    measured = device_profile(_profile(tmp_path, "b.json", exchange_ns_per_slot=(ns, "trace")))
    batch, window = spec.training.batch_size, spec.plan.window
    for g in plan.meta.groups:
        for placement in ("lookahead", "static_hot"):
            group = replace(g, placement=placement, cache_rows=g.cache_rows or 5000)
            added = (group_step_seconds(group, measured, batch, window, None)
                     - group_step_seconds(group, plain, batch, window, None))
            want = group.cache_rows * ns * 1e-9 if placement == "lookahead" else 0.0
            assert added == pytest.approx(want, rel=1e-9, abs=1e-12)


def test_exchange_ns_per_slot_is_a_profile_field_refused_when_negative():
    assert profile_fields({"base": "cpu", "measured": {"exchange_ns_per_slot": {"value": 120.0}}},
                          "p.json") == {"exchange_ns_per_slot": 120.0}
    with pytest.raises(ProfileError, match="exchange_ns_per_slot"):
        profile_fields({"base": "cpu", "measured": {"exchange_ns_per_slot": {"value": -1.0}}}, "p.json")


def test_the_measurement_runs_the_runtimes_scratchpad_past_its_fill_beside_probes(monkeypatch):
    """The exchange alone through `measure`; what it adds to GEMMs on the run's compute threads
    (`flowrec.data.cores.run_threads`) per exchange done beside them, over the capacity."""
    monkeypatch.setattr(ops, "EXCHANGE_TABLE_ROWS", 1 << 16)
    monkeypatch.setattr(ops, "EXCHANGE_TRACE", (12, 3000, 2))
    monkeypatch.setattr(ops, "EXCHANGE_PROBE", 96)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    timed = []

    def measure(runs):
        for run in runs:
            for _ in range(5):
                run()
            timed.append(5)
        return [0.002] * len(runs)

    threads = torch.get_num_threads()
    ns, details = ops.exchange_ns_per_slot(measure, torch.device("cpu"), probe_seconds=0.02)
    assert timed == [5] and details["ms_per_exchange_alone"] == 2.0
    assert details["window_rows"] < details["capacity"] <= 1.25 * details["window_rows"] * 1.2
    assert 0 < details["rows_fetched_per_exchange"] < details["window_rows"]  # past the fill, evicting
    assert details["compute_threads"] == 1 and torch.get_num_threads() == threads  # restored
    assert len(details["rounds_ms_alone_beside_exchanges"]) == ops.EXCHANGE_ROUNDS
    assert all(done > 0 for _, _, done in details["rounds_ms_alone_beside_exchanges"])
    assert ns * details["capacity"] * 1e-6 == pytest.approx(details["ms_added_per_exchange"], abs=1e-3)
