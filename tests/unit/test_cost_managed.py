"""Managed tables' own work in the trainer's step (`Trainer._step`: the reset of the rows an
eviction pass freed and the replay of the data stage's map steps on the model's maps), which
`train_step` (every other step measurement of calibration) leaves out: measured by `flowrec
calibrate` per managed lookup (`managed_ns_per_id`) and priced with staging
(`cost.managed_seconds`): what that work adds to steps run as the trainer runs them (the
replay on its own thread), not its time alone. No timing is asserted."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from flowrec.measure.step import WARMUP_STEPS as WARMUP, managed_step_seconds, with_batch
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


def test_managed_step_seconds_runs_the_resets_and_the_replay_of_every_batch(managed, repo, monkeypatch):
    """Steps with the managed tables' work as the trainer runs it (resets, train_step, the replay
    queued on its thread) and the same steps without, in alternating blocks: every batch's resets
    and replay once, in batch order (a replay checks the map's clock), and the replay queue
    emptied after each block with, so that no replay runs into a block without."""
    from flowrec.runtime import managed_state

    events = []
    for name in ("before_step", "after_step", "sync"):
        original = getattr(managed_state.ManagedState, name)

        def wrapped(self, *args, _original=original, _name=name):
            if _name != "sync" or self._replays:
                events.append((_name, args[-1].index if args else None))
            return _original(self, *args)

        monkeypatch.setattr(managed_state.ManagedState, name, wrapped)
    spec = with_batch(managed, 64)
    plan = make_plan(spec)
    steps, blocks = random.randint(3, 5), random.randint(2, 3)
    with_, without, lookups = managed_step_seconds(plan, spec, torch.device("cpu"), steps, blocks)
    assert len(with_) == len(without) == steps * blocks and lookups == 128.0
    assert all(r.wall > 0 for r in with_ + without)
    resets = [i for name, i in events if name == "before_step"]
    assert resets == [i for name, i in events if name == "after_step"]  # each batch reset, then queued
    assert resets == sorted(resets) and len(set(resets)) == len(resets) == WARMUP + steps * blocks
    assert [name for name, _ in events].count("sync") >= blocks  # emptied after each block with
    plain = load_spec(repo / "specs" / "movielens.yaml")
    assert managed_step_seconds(make_plan(with_batch(plain, 64)), with_batch(plain, 64), torch.device("cpu"), 3
                                ) == ([], [], 0.0)


def test_the_managed_term_is_what_the_work_adds_to_the_steps_not_its_time_alone(managed, monkeypatch):
    """managed_ns_per_id = (steps with the managed work - the same steps without) per lookup, by the
    timing rule, at least 0: a replay that a free core hides adds nothing (round 19: 1.8 ms a batch
    alone priced managed_movielens +0.11 .. +0.38 over its runs). The blocks are sized as the
    staging rate's for the step measured."""
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.robust import Round

    plan = make_plan(with_batch(managed, 64))
    lookups = random.uniform(500, 3000)
    for added in (random.uniform(0.2, 1.5), -random.uniform(0.1, 0.5)):
        base = random.uniform(5.0, 15.0)
        seen = []

        def fake(plan_, spec_, device, steps, blocks, base=base, added=added):
            seen.append((steps, blocks))
            without = [Round((base + i / 100) * 1e-3) for i in range(steps * blocks)]
            with_ = [Round((base + added + i / 100) * 1e-3) for i in range(steps * blocks)]
            return with_, without, lookups

        monkeypatch.setattr(calibrate_spec, "managed_step_seconds", fake)
        step_ms = random.uniform(3.0, 40.0)
        ns, details = calibrate_spec._managed_ns_per_id(managed, None, plan, step_ms)
        blocks, steps = calibrate_spec.staging_plan(step_ms)
        assert seen == [(steps, blocks)]
        assert ns == pytest.approx(max(0.0, added) * 1e-3 / lookups * 1e9, rel=1e-6)
        assert details["ms_per_batch"] == pytest.approx(max(0.0, added), abs=1e-9)
        assert details["with_ms"] - details["without_ms"] == pytest.approx(added, rel=1e-6)


def test_the_managed_maps_free_rows_and_ids_are_priced_where_the_host_is_the_device(managed, repo):
    """A managed table's map holds its sorted free rows, 8 bytes per row of capacity (every row is
    free at the start), and its ids' entries, 32 bytes per id (the plan left these out: a full
    table's are 4 times its free list), in the model's maps and the data stage's copy. They are
    the `maps` part where the host is the device, in the peak and in the need."""
    from dataclasses import replace

    import numpy as np

    from flowrec.data.managed import ManagedMap
    from flowrec.planner.cost import FREE_ROW_BYTES, ID_BYTES, MAP_COPIES
    from flowrec.planner.fit import plan_need
    from flowrec.spec.model import ManagedSpec

    full = ManagedMap(ManagedSpec(rows=300, every_steps=3))  # its arrays' bytes per id, measured
    for step in range(6):
        full.step(np.random.default_rng(step).integers(1, 201, 400))  # 0: the missing id
    held = full.entries()
    assert len(held.keys) == 200 and (held.row >= 0).all()  # every id holds a row
    assert sum(a.nbytes for a in (held.keys, held.row, held.count, held.last)) == 200 * ID_BYTES
    assert full.free.nbytes == 100 * FREE_ROW_BYTES

    def maps(spec, **kw):
        return dict(make_plan(spec, **kw).cost.memory).get("maps", 0)

    rows = sum(t.managed.rows for t in managed.tables if t.managed is not None)
    plan = make_plan(managed)
    assert dict(plan.cost.memory)["maps"] == rows * (FREE_ROW_BYTES + ID_BYTES) * MAP_COPIES == rows * 80
    need, parts = plan_need(plan, host_is_device=True)
    assert need == plan.cost.peak_memory_bytes == sum(b for _, b in plan.cost.memory)
    assert [b for what, b in parts if what.startswith("managed maps")] == [rows * 80]
    users = next(t for t in managed.tables if t.name == "users")
    bigger = replace(managed, tables=tuple(replace(t, managed=replace(t.managed, rows=t.managed.rows + 1000))
                                           if t is users else t for t in managed.tables))
    assert maps(bigger) - maps(managed) == 1000 * 80
    # owner ranks (every managed table in 4 virtual shards): a rank of 2 holds 2 shards of each
    owned = sum(2 * -(-t.managed.rows // 4) for t in managed.tables if t.managed is not None)
    assert all(t.managed.shards == 4 for t in managed.tables if t.managed is not None)
    assert maps(managed, world_size=2) == owned * 80
    assert maps(managed, target="h100") == 0  # host memory, not the device's
    assert maps(load_spec(repo / "specs" / "movielens.yaml")) == 0
