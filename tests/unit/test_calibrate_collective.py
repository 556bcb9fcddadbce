"""Collective calibration: the fit recovers known constants, a measured link prices sharded plans
within a node, bad profile values are one line, and two real gloo processes give a usable fit."""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import pytest

from flowrec.planner import exchange
from flowrec.planner.calibration import ProfileError, profile_document, profile_fields
from flowrec.planner.cost import DEVICES, device_link, device_profile
from flowrec.planner.manager import make_plan
from flowrec.measure.collective import (OPS, SIZES, CollectiveError, fit_collectives,
                                                  measure_collectives, sent_bytes)
from flowrec.spec import load_spec

NO_HANG_S = 120  # far above a loaded machine's start-up and kill, far below a hang


def _points(world: int, gbps: float, us: float, noise: float = 0.0, seed: int = 0) -> dict[str, float]:
    rng = random.Random(seed)
    return {f"{op}/{size}": (us * 1e-6 + sent_bytes(op, size, world) / (gbps * 1e9)) * (1 + rng.uniform(-noise, noise))
            for op in OPS for size in SIZES}


@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_fit_recovers_bandwidth_and_call_cost(world):
    fit = fit_collectives(world, "gloo", _points(world, 1.7, 230.0))
    assert fit.gbps == pytest.approx(1.7, rel=1e-6) and fit.us == pytest.approx(230.0, rel=1e-6)
    noisy = fit_collectives(world, "gloo", _points(world, 1.7, 230.0, noise=0.05, seed=world))
    assert noisy.gbps == pytest.approx(1.7, rel=0.1) and noisy.us == pytest.approx(230.0, rel=0.25)


def test_bytes_sent_are_counted_as_the_planner_counts_them():
    assert sent_bytes("all_to_all", 1 << 20, 4) == 0.75 * (1 << 20)
    assert sent_bytes("all_reduce", 1 << 20, 4) == 1.5 * (1 << 20)
    assert sent_bytes("all_reduce", 1000, 2) == 2 * exchange.remote_share(2) * 1000


def test_times_that_do_not_grow_with_the_bytes_are_refused():
    flat = {f"{op}/{size}": 1e-3 for op in OPS for size in SIZES}
    with pytest.raises(CollectiveError, match="do not grow with the bytes sent"):
        fit_collectives(2, "gloo", flat)


def _profile(tmp_path: Path, **measured) -> str:
    path = tmp_path / "p.json"
    path.write_text(json.dumps(profile_document("cpu", measured, "test", "2026-01-01T00:00:00Z")))
    return str(path)


def test_a_measured_link_prices_sharded_plans_within_a_node(tmp_path: Path, repo):
    path = _profile(tmp_path, collective_gbps=(3.0, "fit"), collective_us=(100.0, "fit"),
                    collective_world_size=(2, "n"))
    device = device_profile(path)
    link = device_link(device, 2)
    assert (link.gbps, link.latency_us) == (3.0, 100.0) and "measured collectives (2 processes)" in link.name
    assert device_link(device, exchange.GPUS_PER_NODE + 1) == exchange.link_for("cpu", exchange.GPUS_PER_NODE + 1)
    assert device_link(DEVICES["cpu"], 2) == exchange.link_for("cpu", 2)
    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    measured = make_plan(spec, target=path, world_size=2)
    datasheet = make_plan(spec, target="cpu", world_size=2)
    fast, slow = measured.cost.exchange_ms / 1e3, datasheet.cost.exchange_ms / 1e3  # seconds
    gloo = exchange.INTERCONNECTS["gloo_loopback"]
    # both plans move the same bytes in the same calls: solve t = bytes / gbps + calls x us for both
    a = [[1 / 3e9, 100e-6], [1 / (gloo.gbps * 1e9), gloo.latency_us * 1e-6]]
    det = a[0][0] * a[1][1] - a[0][1] * a[1][0]
    sent = (fast * a[1][1] - slow * a[0][1]) / det
    calls = (a[0][0] * slow - a[1][0] * fast) / det
    assert fast < slow and sent > 1e5 and calls == pytest.approx(round(calls), abs=1e-3) and round(calls) >= 5
    notes = " ".join(n for r in measured.meta.passes for n in r.notes)
    assert "measured collectives (2 processes) (3 GB/s per rank, 100 us per collective)" in notes


@pytest.mark.parametrize("key, value, words", [
    ("collective_gbps", 0.0, "must be a positive number"),
    ("collective_gbps", -1.5, "must be a positive number"),
    ("collective_world_size", 2.5, "must be a whole number"),
    ("collective_us", "fast", "must be a positive number"),
])
def test_bad_collective_constants_are_one_line(key, value, words):
    with pytest.raises(ProfileError, match=words):
        profile_fields({"base": "cpu", "measured": {key: {"value": value}}}, "p.json")


def test_two_gloo_processes_give_a_usable_fit():
    fit = measure_collectives(2, "cpu")
    assert fit.backend == "gloo" and fit.world_size == 2
    assert math.isfinite(fit.gbps) and fit.gbps > 0 and math.isfinite(fit.us) and fit.us >= 0  # any load
    assert set(fit.points) == {f"{op}/{size}" for op in OPS for size in SIZES}
    largest, smallest = (fit.points[f"all_reduce/{SIZES[i]}"] for i in (-1, 0))
    assert largest > smallest


def test_processes_that_do_not_finish_in_time_are_killed_and_named():
    started = time.monotonic()
    with pytest.raises(CollectiveError, match="no result within 0.5 s"):
        measure_collectives(2, "cpu", timeout_s=0.5)
    assert time.monotonic() - started < NO_HANG_S  # killed, not waited for
