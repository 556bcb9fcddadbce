"""Ranks sharing a host's cores (`flowrec train --nproc N` on the CPU): the cost model prices a rank's
compute, staging and collective calls by what `flowrec calibrate --nproc N` measured with N
processes stepping at once (`flowrec.measure.concurrent`); one rank and a device with its own host
are priced as before. No timing is asserted."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from flowrec.measure.concurrent import SHARDED_BLOCKS, STEPS_RANGE, measure_ranks, phase_steps, rank_constants
from flowrec.planner import exchange
from flowrec.planner.calibration import ProfileError, profile_document, profile_fields
from flowrec.planner.cost import DEVICES, device_profile, shared_cores
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec

LINK = {"collective_gbps": (2.0, "fit"), "collective_us": (150.0, "fit"), "collective_world_size": (2, "n")}


def _profile(tmp_path: Path, name: str, **measured) -> str:
    path = tmp_path / name
    path.write_text(json.dumps(profile_document("cpu", {**LINK, **measured}, "test", "2026-01-01T00:00:00Z")))
    return str(path)


@pytest.fixture
def dlrm(repo):
    return load_spec(repo / "specs" / "dlrm_criteo.yaml")


def test_ranks_sharing_the_cores_pay_the_measured_compute_staging_and_calls(tmp_path: Path, dlrm):
    scale, rate, call_us = random.uniform(1.1, 1.8), random.uniform(1e7, 1e8), random.uniform(500.0, 4000.0)
    alone = make_plan(dlrm, target=_profile(tmp_path, "alone.json"), world_size=2).cost
    shared = make_plan(dlrm, target=_profile(tmp_path, "shared.json", rank_compute_scale=(scale, "ranks"),
                                             rank_staging_values_per_s=(rate, "ranks"),
                                             rank_collective_us=(call_us, "ranks")), world_size=2).cost
    before, after = dict(alone.stage_ms), dict(shared.stage_ms)
    for stage in ("sparse", "dense", "backward"):
        assert after[stage] == pytest.approx(before[stage] * scale, rel=1e-6)
    staged_values = before["staging"] * 1e-3 * DEVICES["cpu"].staging_values_per_s
    assert after["staging"] == pytest.approx(staged_values / rate * 1e3, rel=1e-6)
    per_call_ms = (call_us - 150.0) * 1e-3
    calls = (shared.exchange_ms - alone.exchange_ms) / per_call_ms
    # exchange_ms is rounded to 1e-6 ms: the difference of two is within 1e-6 ms of the exact one (2e-6: float slack)
    assert calls == pytest.approx(round(calls), abs=2e-6 / per_call_ms) and round(calls) >= 2  # every call at the measured cost
    # nothing overlaps the exchange: the step is every stage and the exchange in turn
    assert shared.step_ms_overlap == pytest.approx(sum(after.values()) + shared.exchange_ms, rel=1e-6)
    assert alone.step_ms_overlap < sum(before.values()) + alone.exchange_ms


def test_one_rank_and_a_device_with_its_own_host_keep_one_processs_costs(tmp_path: Path, dlrm):
    measured = {"rank_compute_scale": (1.5, "ranks"), "rank_staging_values_per_s": (1e7, "ranks"),
                "rank_collective_us": (3000.0, "ranks")}
    one = make_plan(dlrm, target=_profile(tmp_path, "a.json")).cost
    same = make_plan(dlrm, target=_profile(tmp_path, "b.json", **measured)).cost
    assert (one.stage_ms, one.step_ms_overlap) == (same.stage_ms, same.step_ms_overlap)
    gpu = DEVICES["a100"]
    assert shared_cores(gpu.__class__(**{**gpu.__dict__, "rank_compute_scale": 1.5}), 2) == (
        1.0, gpu.staging_values_per_s, None)
    assert shared_cores(device_profile(_profile(tmp_path, "c.json", **measured)), 1)[0] == 1.0


def test_shared_core_constants_are_profile_fields_checked_as_the_others():
    fields = profile_fields({"base": "cpu", "measured": {"rank_compute_scale": {"value": 1.3},
                                                         "rank_collective_us": {"value": 900.0}}}, "p.json")
    assert fields == {"rank_compute_scale": 1.3, "rank_collective_us": 900.0}
    for key in ("rank_compute_scale", "rank_staging_values_per_s", "rank_collective_us"):
        with pytest.raises(ProfileError, match=f"measured {key} must be a positive number"):
            profile_fields({"base": "cpu", "measured": {key: {"value": 0.0}}}, "p.json")


def test_the_constants_are_the_slowest_processes_over_the_price_alone():
    ranks = [{"staged_ms": 8.0, "live_ms": 9.5, "call_us": 700.0}, {"staged_ms": 9.0, "live_ms": 9.2, "call_us": 2100.0}]
    scale, rate, call_us, details = rank_constants(ranks, 6.0, 3000.0)
    assert scale == pytest.approx(1.5) and call_us == 2100.0
    assert rate == pytest.approx(3000.0 / 0.5e-3) and details["added_ms_per_batch"] == pytest.approx(0.5)
    slower_live = rank_constants([{"staged_ms": 9.0, "live_ms": 8.0, "call_us": 1.0}], 6.0, 3000.0)
    assert slower_live[1] == pytest.approx(3000.0 / 1e-6)  # staging that adds nothing measurable
    with pytest.raises(ValueError, match="positive price"):
        rank_constants(ranks, 0.0, 3000.0)


def test_each_phase_is_about_a_second_within_its_step_bounds():
    low, high = STEPS_RANGE
    assert phase_steps(1000.0) == low and phase_steps(0.01) == high and phase_steps(50.0) == 20


def test_two_processes_step_the_spec_at_once(repo, tmp_path: Path):
    spec = repo / "specs" / "movielens.yaml"
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(profile_document("cpu", {}, "test", "2026-01-01T00:00:00Z")))
    results = measure_ranks(spec, profile, 2, 64, 3, timeout_s=240)
    assert len(results) == 2
    for r in results:
        assert 0 < r["staged_ms"] < 60e3 and 0 < r["live_ms"] < 60e3 and 0 < r["call_us"] < 60e6
        assert 0 < r["meet_us"] < 60e6  # the call where the ranks meet, kept beside the priced one
        assert r["values_per_batch"] > 64  # ids and dense values of one batch of 64 samples
        assert len(r["live_steps_ms"]) == 3 and len(r["live_meets_us"]) == 3  # every live step, gathered
        assert all(0 < wall < 60e3 and 0 <= waited <= wall for wall, waited in r["live_steps_ms"])
        # the world-size plan's real step with its collectives, every step gathered
        # blocks of 3 while too few are clean or too few seconds are timed, at most SHARDED_BLOCKS
        assert len(r["sharded_steps_ms"]) % 3 == 0 and 3 <= len(r["sharded_steps_ms"]) <= SHARDED_BLOCKS * 3
        assert len(r["sharded_steps_ms"]) == len(results[0]["sharded_steps_ms"])  # every rank as many
        assert all(0 < wall < 60e3 and 0 <= waited <= wall for wall, waited in r["sharded_steps_ms"])
    details = rank_constants(results, 1.0, 100.0)[3]
    assert details["skew"]["steps"] == 3 and details["skew_ms"] == pytest.approx(
        max(0.0, details["skew"]["slowest_per_step_ms"] - details["skew"]["slowest_rank_ms"]))
    from flowrec.measure.concurrent import in_step_call

    call = in_step_call(results, details, 6, 0.1, floor_us=1.0)
    assert call["call_us"] >= 1.0 and call["unsharded_step_ms"] == details["skew"]["slowest_per_step_ms"]


@pytest.mark.parametrize("name, extra", [("movielens", exchange.AGREEMENT_CALLS),
                                         ("two_tower_movielens", exchange.AGREEMENT_CALLS + exchange.GATHER_CALLS)])
def test_a_ranks_step_counts_the_loss_agreement_and_an_in_batch_gather(tmp_path: Path, repo, name, extra):
    spec = load_spec(repo / "specs" / f"{name}.yaml")
    costs = []
    for i, us in enumerate((100.0, 1100.0)):
        path = tmp_path / f"{i}.json"
        path.write_text(json.dumps(profile_document("cpu", {**LINK, "collective_us": (us, "fit")}, "t", "2026-01-01")))
        costs.append(make_plan(spec, target=str(path), world_size=2))
    calls = (costs[1].cost.exchange_ms - costs[0].cost.exchange_ms) / 1.0  # ms per 1000 us more per call
    groups = sum(exchange.collectives(g) for g in costs[0].meta.groups)
    params = sum(costs[0].graph.nodes[n]["op"].param_bytes for n in costs[0].graph)
    assert calls == pytest.approx(groups + 1 + params // exchange.DDP_BUCKET_BYTES + extra, abs=1e-6)


def test_the_priced_call_is_the_one_after_the_ranks_meet():
    """The wait for the slower rank (the first call after a step) is not priced per call: the
    second call, of ranks already together, is `rank_collective_us`."""
    from flowrec.measure.concurrent import meet_then_call

    now = [0.0]
    waits = iter([0.0042, 0.0003])  # a peer 4.2 ms behind, then a call of 0.3 ms

    def collective() -> None:
        now[0] += next(waits)

    meet_s, call_s = meet_then_call(collective, lambda: now[0])
    assert meet_s == pytest.approx(0.0042) and call_s == pytest.approx(0.0003)


def _estimate_ms(rounds) -> float:
    from flowrec.measure import robust

    return robust.estimate(robust.Round(w, q) for w, q in rounds).seconds


def test_the_skew_is_the_slowest_rank_of_each_step_beyond_the_slowest_ranks_own_step():
    """E[max over ranks of a step] against max over ranks of their typical step, by the timing rule
    on both sides (as the benchmark measures a run's step: the slowest rank's round of each step)."""
    from flowrec.measure.concurrent import rank_skew_ms

    rng = random.Random()
    steps = 81
    ranks = [[[rng.lognormvariate(1.0, 0.4), 0.0] for _ in range(steps)] for _ in range(rng.choice((2, 3)))]
    # independent ranks' steps: the slowest of each step is slower than any one rank's median (equal
    # where, at the slower rank's median step and every step of it below, the other rank was faster
    # still: 2 ranks of 41 steps, 32 draws of 1e6; of 81 steps, none of 1e6 and about 2^-20 of that)
    assert rank_skew_ms(ranks)[0] > 0
    ranks[0][rng.randrange(steps)][1] = 1e9  # rounds another process delayed: not clean, left out
    ranks[-1][rng.randrange(steps)][1] = 1e9
    skew, details = rank_skew_ms(ranks)
    slowest = [max(step, key=lambda wq: wq[0]) for step in zip(*ranks)]
    expected = _estimate_ms(slowest) - max(_estimate_ms(r) for r in ranks)
    assert skew == pytest.approx(max(expected, 0.0)) and details["steps"] == steps
    assert rank_skew_ms([[[2.0, 0.0]] * 5, [[2.0, 0.0]] * 5])[0] == 0.0  # ranks in step: nothing
    assert rank_skew_ms([[[2.0, 0.0]] * 5, [[2.0, 0.0]] * 7])[1]["steps"] == 5  # the steps both have
    with pytest.raises(ValueError, match="two ranks"):
        rank_skew_ms([[[1.0, 0.0]]])


def test_the_calibrated_skew_is_a_profile_constant_with_its_how():
    ranks = [{"staged_ms": 2.0, "live_ms": 2.5, "call_us": 300.0, "live_steps_ms": [[3.0, 0.0], [2.0, 0.0], [2.0, 0.0]],
              "live_meets_us": [100.0, 900.0, 700.0]},
             {"staged_ms": 2.0, "live_ms": 2.0, "call_us": 300.0, "live_steps_ms": [[2.0, 0.0], [3.0, 0.0], [2.0, 0.0]],
              "live_meets_us": [800.0, 200.0, 600.0]}]
    details = rank_constants(ranks, 2.0, 100.0)[3]
    assert details["skew_ms"] == pytest.approx(3.0 - 2.0)  # per step 3, 3, 2: median 3; each rank's median 2
    assert details["last_meet_us"] == 200.0  # per step the rank that came last: 100, 200, 600
    assert "skew_ms" not in rank_constants([{k: v for k, v in r.items() if k != "live_steps_ms"} for r in ranks],
                                           2.0, 100.0)[3]
    fields = profile_fields({"base": "cpu", "measured": {"rank_skew_us": {"value": 0.0}}}, "p.json")
    assert fields == {"rank_skew_us": 0.0}  # ranks in step measure no skew


def test_the_skew_is_priced_once_a_step_for_ranks_never_for_one_process(tmp_path: Path, dlrm):
    skew_us, call_us = random.uniform(200.0, 5000.0), random.uniform(300.0, 3000.0)
    ranks = {"rank_compute_scale": (1.2, "ranks"), "rank_collective_us": (call_us, "ranks")}
    without = make_plan(dlrm, target=_profile(tmp_path, "a.json", **ranks), world_size=2).cost
    skewed = make_plan(dlrm, target=_profile(tmp_path, "b.json", **ranks, rank_skew_us=(skew_us, "ranks")),
                       world_size=2).cost
    # once per step, whatever the step's calls (their count is above 2), in the exchange the ranks meet in
    assert skewed.exchange_ms - without.exchange_ms == pytest.approx(skew_us * 1e-3, abs=2e-6)
    assert skewed.step_ms_overlap - without.step_ms_overlap == pytest.approx(skew_us * 1e-3, abs=2e-6)
    assert skewed.stage_ms == without.stage_ms
    one = make_plan(dlrm, target=_profile(tmp_path, "c.json", **ranks)).cost
    one_skewed = make_plan(dlrm, target=_profile(tmp_path, "d.json", **ranks, rank_skew_us=(skew_us, "r"))).cost
    assert (one.step_ms_overlap, one.exchange_ms) == (one_skewed.step_ms_overlap, one_skewed.exchange_ms)


def test_a_call_inside_the_ranks_steps_is_the_sharded_step_beyond_the_one_process_step_per_call():
    """The slowest rank of each sharded step (the run's rule) less the one-process step of each step
    and the exchange's bytes, per call of the plan; never below the idle call."""
    from flowrec.measure.concurrent import in_step_call, slowest_per_step_ms, step_call_us

    rng = random.Random()
    steps = rng.randrange(12, 40)
    ranks = [{"sharded_steps_ms": [[rng.lognormvariate(2.3, 0.3), 0.0] for _ in range(steps)]} for _ in range(2)]
    ranks[1]["sharded_steps_ms"][rng.randrange(steps)][1] = 1e9  # a round another process delayed: left out
    slowest = [max(step, key=lambda wq: wq[0]) for step in zip(*(r["sharded_steps_ms"] for r in ranks))]
    assert slowest_per_step_ms([r["sharded_steps_ms"] for r in ranks])[0] == pytest.approx(_estimate_ms(slowest))
    unsharded, bytes_ms, calls = rng.uniform(1.0, 4.0), rng.uniform(0.1, 1.0), rng.choice((3, 6, 10))
    details = {"live_ms": 99.0, "skew": {"slowest_per_step_ms": unsharded}}  # the slowest of each step, not the typical
    call = in_step_call(ranks, details, calls, bytes_ms, floor_us=50.0)
    expected = (_estimate_ms(slowest) - unsharded - bytes_ms) * 1e3 / calls
    assert call["call_us"] == pytest.approx(expected) and expected > 50.0
    assert (call["calls"], call["unsharded_step_ms"]) == (calls, unsharded)
    assert in_step_call(ranks, {"live_ms": unsharded}, calls, bytes_ms)["call_us"] == pytest.approx(expected)
    assert step_call_us(3.0, 4.0, 0.5, 6, floor_us=180.0) == 180.0  # a sharded step no slower: the idle call
    assert in_step_call(ranks[:1], details, calls, bytes_ms) is None  # one rank: nothing measured
    assert in_step_call([{}, {}], details, calls, bytes_ms) is None  # no sharded steps (managed tables)
    with pytest.raises(ValueError, match="without collective calls"):
        step_call_us(3.0, 1.0, 0.5, 0)


def test_the_call_measured_inside_the_steps_prices_every_call_of_ranks(tmp_path: Path, dlrm):
    """`rank_step_call_us` replaces the idle call after a step (`rank_collective_us`) for each of
    the plan's calls, for ranks only; a profile without it prices as before."""
    from flowrec.planner.cost import step_call_us, step_collectives

    idle_us, in_step_us = random.uniform(300.0, 600.0), random.uniform(1000.0, 3500.0)
    ranks = {"rank_compute_scale": (1.2, "ranks"), "rank_collective_us": (idle_us, "ranks")}
    idle = make_plan(dlrm, target=_profile(tmp_path, "a.json", **ranks), world_size=2)
    in_step = make_plan(dlrm, target=_profile(tmp_path, "b.json", **ranks, rank_step_call_us=(in_step_us, "steps")),
                        world_size=2)
    calls, sent = step_collectives(in_step.graph, dlrm)
    assert calls >= 4 and sent == pytest.approx(in_step.cost.exchange_bytes_per_step, abs=1.0)
    assert in_step.cost.exchange_ms - idle.cost.exchange_ms == pytest.approx(calls * (in_step_us - idle_us) * 1e-3,
                                                                             abs=2e-6)
    assert in_step.cost.stage_ms == idle.cost.stage_ms
    one = make_plan(dlrm, target=_profile(tmp_path, "c.json", **ranks)).cost
    one_in_step = make_plan(dlrm, target=_profile(tmp_path, "d.json", **ranks, rank_step_call_us=(in_step_us, "s"))).cost
    assert (one.step_ms_overlap, one.exchange_ms) == (one_in_step.step_ms_overlap, one_in_step.exchange_ms)
    assert step_collectives(make_plan(dlrm).graph, dlrm) == (0, 0.0)
    gpu = DEVICES["a100"]
    assert step_call_us(gpu.__class__(**{**gpu.__dict__, "rank_step_call_us": 900.0}), 2, None) is None
    fields = profile_fields({"base": "cpu", "measured": {"rank_step_call_us": {"value": 1234.5}}}, "p.json")
    assert fields == {"rank_step_call_us": 1234.5}


def test_the_ranks_step_more_blocks_while_the_slowest_of_each_step_has_too_few_clean_rounds():
    """A busy machine's rounds (each waited for cores) would be taken less their wait, which for
    ranks waiting on each other in every call is not what a run shows: more blocks of steps, up
    to MORE_BLOCKS, decided alike on every rank from the same gathered rounds."""
    from flowrec.measure import robust
    from flowrec.measure.concurrent import MORE_BLOCKS, more_sharded_steps

    rng = random.Random()
    steps = rng.randrange(10, 40)

    def rounds(clean: int, n: int) -> list[list[float]]:  # steps long enough that one block passes SHARDED_SECONDS
        out = [[rng.uniform(200.0, 300.0), rng.uniform(30.0, 60.0)] for _ in range(n)]
        for i in rng.sample(range(n), clean):
            out[i][1] = 0.0
        return out

    busy = [rounds(0, steps), rounds(0, steps)]
    assert more_sharded_steps(busy, steps)
    quiet = [rounds(steps, steps), rounds(steps, steps)]
    assert not more_sharded_steps(quiet, steps)
    few = [rounds(robust.MIN_CLEAN - 1, steps), rounds(steps, steps)]  # the slowest of a step is either rank's
    slowest_clean = sum(max(a, b, key=lambda wq: wq[0])[1] == 0.0 for a, b in zip(*few))
    assert more_sharded_steps(few, steps) == (slowest_clean < robust.MIN_CLEAN)
    assert not more_sharded_steps([rounds(0, MORE_BLOCKS * steps)] * 2, steps)  # at most MORE_BLOCKS blocks


def test_a_short_steps_sharded_steps_go_on_until_they_have_taken_sharded_seconds():
    """Round 59: movielens's 2-rank steps spread 5-22 ms around 10 and 40 of them priced its
    exchange 0.12-0.15 high; a layout now steps blocks until its slowest rank of each step has
    taken SHARDED_SECONDS (clean rounds or not), up to `sharded_limit` steps, sized so that steps
    no shorter than the one-process step reach it."""
    from flowrec.measure.concurrent import (MORE_BLOCKS, SHARDED_BLOCKS, SHARDED_SECONDS, more_sharded_steps,
                                            sharded_limit)

    rng = random.Random()
    steps = rng.randrange(10, 40)
    step_ms = rng.uniform(3.0, 20.0)
    limit = sharded_limit(steps, step_ms)
    assert limit % steps == 0 and MORE_BLOCKS * steps <= limit <= SHARDED_BLOCKS * steps
    assert limit * step_ms >= SHARDED_SECONDS * 1e3 or limit == SHARDED_BLOCKS * steps
    taken = 0
    ranks: list[list[list[float]]] = [[], []]
    while True:  # as `sharded_steps` goes on, block by block, every step clean
        for r in ranks:
            r += [[rng.uniform(0.5, 1.5) * step_ms, 0.0] for _ in range(steps)]
        taken += steps
        if not more_sharded_steps(ranks, steps, limit):
            break
    slowest = sum(max(a[0], b[0]) for a, b in zip(*ranks))
    assert taken <= limit
    assert slowest >= SHARDED_SECONDS * 1e3 or taken == limit  # stopped at the seconds or at the limit
    assert slowest - max(max(a[0], b[0]) for a, b in zip(*(r[-steps:] for r in ranks))) * steps < SHARDED_SECONDS * 1e3
    long = [[[SHARDED_SECONDS * 1e3 / steps + 1.0, 0.0]] * steps] * 2  # one block passes the seconds: no more
    assert not more_sharded_steps(long, steps, limit)
