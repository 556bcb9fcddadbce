"""Managed tables' own work in the trainer's step (`Trainer._step`: the reset of the rows an
eviction pass freed and the replay of the data stage's map steps on the model's maps), which
`train_step` (every other step measurement of calibration) leaves out: measured by `flowrec
calibrate` per managed lookup (`managed_ns_per_id`) and priced with staging
(`cost.managed_seconds`). No timing is asserted."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from flowrec.measure.step import managed_step_seconds, with_batch
from flowrec.planner.calibration import ProfileError, profile_document, profile_fields
from flowrec.planner.cost import device_profile, managed_lookups
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec


def _profile(tmp_path: Path, name: str, **measured) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "fit"), **measured}, "test",
                                                "2026-01-01T00:00:00Z")))
    return str(path)


@pytest.fixture
def managed(repo):
    return load_spec(repo / "specs" / "managed_movielens.yaml")


def test_managed_lookups_are_priced_with_staging_at_the_measured_cost(tmp_path: Path, managed):
    ns = random.uniform(50.0, 500.0)
    batch = random.choice((256, 1024, 3000))
    spec = with_batch(managed, batch)
    before = make_plan(spec, target=_profile(tmp_path, "a.json")).cost
    after = make_plan(spec, target=_profile(tmp_path, "b.json", managed_ns_per_id=(ns, "replay"))).cost
    lookups = batch * 2  # user_id and item_id: one managed lookup each per sample
    added = dict(after.stage_ms)["staging"] - dict(before.stage_ms)["staging"]
    assert added == pytest.approx(lookups * ns * 1e-6, abs=3e-6)
    assert after.step_ms_overlap - before.step_ms_overlap == pytest.approx(added, abs=3e-6)  # the CPU: on the step
    for stage in ("sparse", "dense", "backward"):
        assert dict(after.stage_ms)[stage] == dict(before.stage_ms)[stage]


def test_a_spec_without_managed_tables_pays_nothing(tmp_path: Path, repo):
    spec = load_spec(repo / "specs" / "movielens.yaml")
    plain = make_plan(spec, target=_profile(tmp_path, "a.json")).cost
    measured = make_plan(spec, target=_profile(tmp_path, "b.json", managed_ns_per_id=(400.0, "replay"))).cost
    assert (plain.stage_ms, plain.step_ms_overlap) == (measured.stage_ms, measured.step_ms_overlap)
    assert managed_lookups(make_plan(spec).graph, spec, 1024) == 0.0


def test_managed_lookups_follow_the_access_profile(managed):
    graph = make_plan(managed).graph
    assert managed_lookups(graph, managed, 100) == 200.0
    profile = {"samples": 10, "sample_rate": 1.0, "tables": {"users": {"accesses": 10}, "items": {"accesses": 25}}}
    assert managed_lookups(graph, managed, 100, profile) == pytest.approx(100 * (1.0 + 2.5))


def test_managed_ns_per_id_is_a_profile_field_not_named_when_absent(tmp_path: Path):
    assert profile_fields({"base": "cpu", "measured": {"managed_ns_per_id": {"value": 210.0}}},
                          "p.json") == {"managed_ns_per_id": 210.0}
    with pytest.raises(ProfileError, match="measured managed_ns_per_id must be a positive number"):
        profile_fields({"base": "cpu", "measured": {"managed_ns_per_id": {"value": -1.0}}}, "p.json")
    # a spec without managed tables measures none: the plan does not list it as a datasheet constant
    note = device_profile(_profile(tmp_path, "c.json")).source.split("datasheet or derived: ")[1]
    assert "managed_ns_per_id" not in note and "staging_values_per_s" in note


def test_managed_step_seconds_runs_the_resets_and_the_replay_of_every_batch(managed, repo):
    spec = with_batch(managed, 64)
    plan = make_plan(spec)
    steps = random.randint(4, 7)
    rounds, lookups = managed_step_seconds(plan, spec, torch.device("cpu"), steps)
    assert len(rounds) == steps and lookups == 128.0
    assert all(r.wall > 0 for r in rounds)
    plain = load_spec(repo / "specs" / "movielens.yaml")
    assert managed_step_seconds(make_plan(with_batch(plain, 64)), with_batch(plain, 64), torch.device("cpu"), 3) == ([], 0.0)
