"""An epoch's start as the trainer runs it (a new batch pipeline per epoch: the wait for its first
batch, its first steps beside the pipeline's start, its close), measured by `flowrec calibrate` on
the trainer's own epoch path (`epoch_start_us`, `epoch_single_us`: `flowrec.measure.step.epoch_seconds`)
and priced in the throughput, spread over the epoch's batches (`cost.epoch_start_seconds`); a
one-batch epoch is priced by its own measurement, never as a share of a longer epoch's start. What
the start's slowed steps move the typical step of an epoch of n batches by (`epoch_lean_us`, from the
same epochs' steps by position) is in the one-process step (`cost.epoch_lean_seconds`), never in
the throughput a second time. No timing is asserted."""
from __future__ import annotations

import json
import math
import statistics
import random
from dataclasses import replace
from pathlib import Path

import pytest

from flowrec.measure.step import with_batch
from flowrec.planner.calibration import ProfileError, profile_document, profile_fields
from flowrec.planner.cost import DEVICES, epoch_start_seconds
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec


def _profile(tmp_path: Path, name: str, **measured) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "fit"), **measured}, "test",
                                                "2026-01-01T00:00:00Z")))
    return str(path)


def test_an_epochs_start_is_spread_over_its_batches_and_a_one_batch_epoch_is_its_own():
    start, single = random.uniform(1e3, 2e4), random.uniform(1e2, 1e4)
    cpu = replace(DEVICES["cpu"], epoch_start_us=start, epoch_single_us=single)
    batches = random.randint(2, 400)
    assert epoch_start_seconds(cpu, float(batches)) == pytest.approx(start * 1e-6 / batches)
    assert epoch_start_seconds(cpu, 1.0) == pytest.approx(single * 1e-6)  # not start / 1
    assert epoch_start_seconds(cpu, 0.4) == pytest.approx(single * 1e-6)  # one shorter batch: still an epoch of one
    assert epoch_start_seconds(cpu, batches + 0.25) == pytest.approx(start * 1e-6 / (batches + 1))  # the last kept
    assert epoch_start_seconds(cpu, None) == 0.0  # the data's rows unknown
    assert epoch_start_seconds(DEVICES["cpu"], float(batches)) == 0.0  # not measured


def test_the_epoch_constants_are_profile_fields_that_may_be_nil(tmp_path: Path):
    doc = profile_document("cpu", {"epoch_start_us": (0.0, "none"), "epoch_single_us": (812.5, "one")}, "t", "now")
    assert profile_fields(doc, "p.json") == {"epoch_start_us": 0.0, "epoch_single_us": 812.5}
    bad = profile_document("cpu", {"epoch_start_us": (1.0, "x")}, "t", "now")
    bad["measured"]["epoch_start_us"]["value"] = -3.0
    with pytest.raises(ProfileError, match="p.json: measured epoch_start_us must be a positive number"):
        profile_fields(bad, "p.json")


@pytest.mark.parametrize("rows_per_batch", [8.0, 1.0, 3.5])
def test_the_epoch_start_is_in_the_throughput_never_in_the_step(tmp_path: Path, repo, rows_per_batch):
    spec = with_batch(load_spec(repo / "specs" / "movielens.yaml"), random.choice((256, 1024)))
    batch = spec.training.batch_size
    start, single = random.uniform(2e3, 2e4), random.uniform(5e2, 5e3)
    rate = random.choice((1.0, 0.25))
    access = {"samples": int(rows_per_batch * batch * rate), "sample_rate": rate}
    plain = make_plan(spec, target=_profile(tmp_path, "a.json"), profile=access).cost
    priced = make_plan(spec, target=_profile(tmp_path, "b.json", epoch_start_us=(start, "epochs"),
                                              epoch_single_us=(single, "one")), profile=access).cost
    assert priced.step_ms_overlap == plain.step_ms_overlap and priced.stage_ms == plain.stage_ms
    count = math.ceil(rows_per_batch)
    share_s = (single if count == 1 else start / count) * 1e-6
    assert priced.samples_per_s == pytest.approx(batch / (plain.step_ms_overlap * 1e-3 + share_s), rel=1e-5)
    assert priced.samples_per_s < plain.samples_per_s
    unknown = make_plan(spec, target=_profile(tmp_path, "c.json", epoch_start_us=(start, "epochs"),
                                               epoch_single_us=(single, "one"))).cost
    assert unknown.samples_per_s == plain.samples_per_s == pytest.approx(batch / (plain.step_ms_overlap * 1e-3), rel=1e-5)


def test_the_calibrations_staging_is_the_trainers(tmp_path: Path, repo):
    import torch

    from flowrec.graph.plan_io import plan_json
    from flowrec.measure.step import trainer_options
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.trainer import Trainer, TrainConfig

    for name, budget in (("movielens.yaml", None), ("dlrm_criteo.yaml", "64MiB")):
        spec = with_batch(load_spec(repo / "specs" / name), 256)
        if budget:
            spec = replace(spec, plan=replace(spec.plan, cache="lookahead"))
        plan = make_plan(spec, target="cpu", device_budget=budget)
        model = lower(plan, spec, torch.device("cpu"))
        try:
            trainer = Trainer(spec, plan, model, TrainConfig(out_dir=tmp_path / name, progress=False,
                                                             tensorboard=False), plan_json(plan))
            assert trainer_options(spec, plan) == trainer.staging()
        finally:
            model.close()


def test_epoch_seconds_times_the_trainers_epochs_beside_one_long_epoch(repo):
    import torch

    from flowrec.measure.step import epoch_seconds

    spec = with_batch(load_spec(repo / "specs" / "movielens.yaml"), 64)
    plan = make_plan(spec, target="cpu")
    batches, epochs = 3, 2
    whole, steady, by_position = epoch_seconds(plan, spec, torch.device("cpu"), batches, epochs)
    assert len(whole) == epochs and len(steady) == batches * epochs
    assert [len(p) for p in by_position] == [epochs] * batches
    for epoch in range(epochs):  # an epoch's round holds its steps
        assert whole[epoch].wall > sum(p[epoch].wall for p in by_position)
    assert all(0 < r.wall < 60 and 0 <= r.waited <= r.wall for r in whole + steady)


def test_the_calibrated_start_is_the_epoch_beyond_its_steady_steps_and_long_steps_skip_it(monkeypatch):
    """`_epoch_start_us`: the timing rule over whole epochs less as many steady steps (at least 0),
    an epoch of EPOCH_BATCHES batches and a one-batch epoch apart; nothing run for a long step."""
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.robust import Round

    step_ms, extra_ms = random.uniform(1.0, 9.0), {8: random.uniform(3.0, 20.0), 1: random.uniform(0.5, 6.0)}
    calls = []

    def fake(plan, spec, device, batches, epochs):
        calls.append((batches, epochs))
        whole = [Round((batches * step_ms + extra_ms[batches]) * 1e-3)] * epochs
        return whole, [Round(step_ms * 1e-3)] * (batches * epochs), [[Round(step_ms * 1e-3)] * epochs] * batches

    monkeypatch.setattr(calibrate_spec, "epoch_seconds", fake)
    (start, single), details = calibrate_spec._epoch_start_us(None, None, None, step_ms)
    assert calls == [(calibrate_spec.EPOCH_BATCHES, calibrate_spec.EPOCH_ROUNDS[0]), (1, calibrate_spec.EPOCH_ROUNDS[1])]
    assert start == pytest.approx(extra_ms[8] * 1e3) and single == pytest.approx(extra_ms[1] * 1e3)
    assert details["batches_8"]["step_ms_by_position"] == pytest.approx([step_ms] * 8)
    extra_ms.update({8: -2.0, 1: -0.5})  # epochs faster than the steady steps: noise, not a saving
    calls.clear()
    assert calibrate_spec._epoch_start_us(None, None, None, step_ms)[0] == (0.0, 0.0)
    calls.clear()
    (start, single), details = calibrate_spec._epoch_start_us(None, None, None, calibrate_spec.EPOCH_MAX_STEP_MS + 1)
    assert (start, single) == (0.0, 0.0) and calls == [] and "not_measured" in details


def _lean(count: int = 8) -> list[float]:
    """A random falling lean by an epoch's length (us): a short epoch's start weighs most."""
    return sorted((random.uniform(5.0, 600.0) for _ in range(count)), reverse=True)


def test_an_epochs_lean_is_its_lengths_own_and_a_longer_epoch_scales_the_last():
    from flowrec.planner.cost import epoch_lean_seconds

    lean = _lean()
    cpu = replace(DEVICES["cpu"], epoch_lean_us=tuple(lean))
    for n in range(1, 9):
        assert epoch_lean_seconds(cpu, float(n)) == pytest.approx(lean[n - 1] * 1e-6)
    assert epoch_lean_seconds(cpu, 2.25) == pytest.approx(lean[2] * 1e-6)  # the last, shorter batch kept
    assert epoch_lean_seconds(cpu, 0.5) == pytest.approx(lean[0] * 1e-6)
    longer = random.randint(9, 500)
    assert epoch_lean_seconds(cpu, float(longer)) == pytest.approx(lean[7] * 8 / longer * 1e-6)
    assert epoch_lean_seconds(cpu, None) == 0.0  # the data's rows unknown
    assert epoch_lean_seconds(DEVICES["cpu"], 8.0) == 0.0  # not measured


def test_the_lean_is_a_profile_vector_of_eight_non_negative_numbers(tmp_path: Path):
    from flowrec.measure.spec import EPOCH_BATCHES
    from flowrec.planner.calibration import VECTORS
    from flowrec.planner.cost import device_profile

    assert VECTORS["epoch_lean_us"] == EPOCH_BATCHES  # one value per length the calibration measures
    lean = _lean()
    lean[-1] = 0.0  # an epoch whose start moves nothing: 0, allowed
    path = _profile(tmp_path, "p.json", epoch_lean_us=(lean, "positions"))
    assert device_profile(path).epoch_lean_us == tuple(lean)
    for bad in (lean[:7], [*lean[:7], -1.0], [*lean[:7], float("inf")], [*lean[:7], True], 3.0):
        doc = profile_document("cpu", {"epoch_lean_us": (bad, "x")}, "t", "now")
        with pytest.raises(ProfileError, match="p.json: measured epoch_lean_us must be 8 finite non-negative numbers"):
            profile_fields(doc, "p.json")
    assert device_profile(_profile(tmp_path, "old.json")).epoch_lean_us == ()  # an older profile: none


@pytest.mark.parametrize("rows_per_batch", [8.0, 3.5, 40.0])
def test_the_lean_is_in_the_one_process_step_never_in_the_throughput(tmp_path: Path, repo, rows_per_batch):
    spec = with_batch(load_spec(repo / "specs" / "movielens.yaml"), random.choice((256, 1024)))
    batch, lean, start = spec.training.batch_size, _lean(), random.uniform(2e3, 2e4)
    rate = random.choice((1.0, 0.25))
    access = {"samples": int(rows_per_batch * batch * rate), "sample_rate": rate}
    start_only = {"epoch_start_us": (start, "epochs"), "epoch_single_us": (start / 3, "one")}
    plain = make_plan(spec, target=_profile(tmp_path, "a.json", **start_only), profile=access).cost
    priced = make_plan(spec, target=_profile(tmp_path, "b.json", **start_only, epoch_lean_us=(lean, "positions")),
                       profile=access).cost
    count = math.ceil(rows_per_batch)
    lean_ms = (lean[count - 1] if count <= 8 else lean[7] * 8 / count) * 1e-3
    assert lean_ms > 0 and priced.step_ms_overlap == pytest.approx(plain.step_ms_overlap + lean_ms, abs=1e-5)
    assert priced.samples_per_s == plain.samples_per_s  # the whole start is already in the throughput
    assert priced.step_ms_serial == pytest.approx(plain.step_ms_serial + lean_ms, abs=1e-5)  # the step, both ways
    assert priced.stage_ms == plain.stage_ms  # in no stage
    unknown = make_plan(spec, target=_profile(tmp_path, "c.json", epoch_lean_us=(lean, "positions"))).cost
    assert unknown.step_ms_overlap == make_plan(spec, target=_profile(tmp_path, "d.json")).cost.step_ms_overlap
    ranks = [make_plan(spec, target=_profile(tmp_path, name, **extra), profile=access, world_size=2).cost
             for name, extra in (("e.json", {}), ("f.json", {"epoch_lean_us": (lean, "positions")}))]
    assert ranks[0].step_ms_overlap == ranks[1].step_ms_overlap  # one process only


def test_the_calibrated_lean_is_the_epochs_first_positions_beyond_their_second_half(monkeypatch):
    """`epoch_lean_us`: for n = 1 .. 8, the timing rule over positions 0 .. n-1 of the measured
    epochs (n = 1: the one-batch epochs' steps) less the timing rule over positions 4 .. 7; at
    least 0; recorded beside the epoch's start, from the same epochs."""
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.robust import Round

    step_ms = random.uniform(1.0, 9.0)
    slow = [random.uniform(1.5, 3.0), random.uniform(0.2, 1.0), random.uniform(0.0, 0.3)]  # ms, positions 0-2

    def rounds(extra_ms: float, count: int) -> list:  # skewed, never constant: a median must pick
        return [Round((step_ms + extra_ms + random.expovariate(1 / 0.05 / step_ms)) * 1e-3) for _ in range(count)]

    def fake(plan, spec, device, batches, epochs):
        by_position = [rounds(slow[p] if p < len(slow) and batches > 1 else (slow[0] + 0.5 if batches == 1 else 0.0),
                              epochs) for p in range(batches)]
        whole = [Round(sum(p[e].wall for p in by_position) + 5e-3) for e in range(epochs)]
        return whole, rounds(0.0, batches * epochs), by_position

    seen = {}
    real = calibrate_spec.epoch_lean_us

    def keep(by_position, single):
        seen["args"] = (by_position, single)
        return real(by_position, single)

    monkeypatch.setattr(calibrate_spec, "epoch_seconds", fake)
    monkeypatch.setattr(calibrate_spec, "epoch_lean_us", keep)
    _, details = calibrate_spec._epoch_start_us(None, None, None, step_ms)
    by_position, single = seen["args"]
    assert len(by_position) == calibrate_spec.EPOCH_BATCHES and len(single) == calibrate_spec.EPOCH_ROUNDS[1]
    mid = statistics.median(r.wall for p in by_position[4:] for r in p)
    expected = [max(0.0, statistics.median(r.wall for r in single) - mid) * 1e6]
    expected += [max(0.0, statistics.median(r.wall for p in by_position[:n] for r in p) - mid) * 1e6 for n in range(2, 9)]
    assert details["lean_us"] == pytest.approx(expected)
    assert details["lean_us"][0] > details["lean_us"][1] > details["lean_us"][7] >= 0  # a short epoch leans most
    assert calibrate_spec._epoch_start_us(None, None, None, calibrate_spec.EPOCH_MAX_STEP_MS + 1)[1].get("lean_us") is None
