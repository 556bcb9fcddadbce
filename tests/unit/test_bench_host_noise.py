"""tools/bench_host_noise.py: a perfect cost model replayed on a recorded trace of a spec's step
gives errors that come from the host's speed alone: none on a steady host, the level ratio where
the calibration and the run fall in different spells; the stored trace rebuilds the recorded one."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_host_noise", REPO / "tools" / "bench_host_noise.py")
noise = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_host_noise", noise)  # its dataclass looks its module up
_spec.loader.exec_module(noise)


def _trace(levels: list[tuple[float, float]], seed: int, jitter: float = 0.0) -> "noise.Trace":
    """Back-to-back steps: for each (seconds, step ms) level, steps of about that time (±jitter)."""
    rng = random.Random(seed)
    starts, steps, at = [], [], rng.uniform(0, 100)
    for seconds, ms in levels:
        end = at + seconds
        while at < end:
            s = ms / 1e3 * (1 + rng.uniform(-jitter, jitter))
            starts.append(at)
            steps.append(s)
            at += s + rng.uniform(0, 2e-5)
    return noise.Trace(starts, steps)


def test_a_steady_host_gives_a_perfect_model_no_error():
    ms = random.Random(3).uniform(2.0, 20.0)
    trace = _trace([(120.0, ms)], seed=1)
    method = noise.Method(cal_s=3.0, run_s=1.0, lag_s=40.0, pairs=5, specs=19)
    rounds = noise.perfect_model_rounds(trace, method, 30, random.Random(0))
    assert len(rounds) == 30 and all(len(r) == 19 for r in rounds)
    summary = noise.floor_summary(rounds, 0.10)
    assert summary["worst_error_median"] == 0.0 and summary["worst_within_goal_share"] == 1.0
    assert summary["specs_within_goal_median"] == 19


def test_a_calibration_and_run_in_different_spells_miss_by_the_spells_ratio():
    base = random.Random(5).uniform(3.0, 9.0)
    slow = random.Random(6).uniform(1.2, 1.4)  # the host's slower spell, as a step-time factor
    levels = [(50.0, base), (50.0, base * slow)] * 4
    trace = _trace(levels, seed=2)
    across = noise.Method(cal_s=1.0, run_s=1.0, lag_s=50.0, pairs=1, specs=40)  # the run in the other spell
    errors = [e for r in noise.perfect_model_rounds(trace, across, 20, random.Random(1)) for e in r]
    off = [e for e in errors if abs(e - (slow - 1)) < 0.01 or abs(e - (1 / slow - 1)) < 0.01]
    assert len(off) >= 0.9 * len(errors)  # all but the windows that straddle a spell's edge
    assert max(abs(e) for e in errors) == pytest.approx(slow - 1, abs=0.01)
    same = noise.Method(cal_s=1.0, run_s=1.0, lag_s=100.0, pairs=1, specs=40)  # the run in the same spell again
    errors = [e for r in noise.perfect_model_rounds(trace, same, 20, random.Random(1)) for e in r]
    assert max(abs(e) for e in errors) < 1e-9
    summary = noise.floor_summary(noise.perfect_model_rounds(trace, across, 50, random.Random(2)), 0.10)
    assert summary["worst_within_goal_share"] == 0.0 and summary["worst_error_median"] > 0.15


def test_more_pairs_lower_the_floor_on_a_host_whose_spells_vary():
    rng = random.Random(9)
    levels = [(rng.uniform(3.0, 20.0), 8.0 * rng.uniform(0.85, 1.2)) for _ in range(120)]
    trace = _trace(levels, seed=3, jitter=0.05)
    one = noise.Method(cal_s=3.0, run_s=1.0, lag_s=50.0, pairs=1, specs=19)
    many = noise.Method(cal_s=3.0, run_s=1.0, lag_s=50.0, pairs=15, specs=19)
    a = noise.floor_summary(noise.perfect_model_rounds(trace, one, 200, random.Random(0)), 0.10)
    b = noise.floor_summary(noise.perfect_model_rounds(trace, many, 200, random.Random(0)), 0.10)
    assert a["spec_error_abs_median"] > 0.02  # the spells do move a single pair
    assert b["spec_error_abs_median"] < a["spec_error_abs_median"]
    assert b["worst_error_median"] < a["worst_error_median"]


def test_a_bracketed_pair_cancels_a_steady_drift_a_run_after_takes_whole():
    """run, calibrate, run (`bench_costmodel --bracket`): on a host slowing steadily, a run 30 s
    after the calibration misses by the drift over those 30 s; the mean of runs 30 s before and
    after meets the calibration's own spell (a perfect model's error is left at about none)."""
    rng = random.Random()
    base, per_s = rng.uniform(4.0, 8.0), rng.uniform(0.002, 0.004)  # step ms, and its rise per second
    trace = _trace([(0.1, base * (1 + per_s * i / 10)) for i in range(3000)], seed=4)  # 300 s of 0.1 s levels
    after = noise.Method(cal_s=1.0, run_s=1.0, lag_s=30.0, pairs=1, specs=20)
    bracketed = noise.Method(cal_s=1.0, run_s=1.0, lag_s=30.0, pairs=1, specs=20, lead_s=30.0)
    plain = [e for r in noise.perfect_model_rounds(trace, after, 10, random.Random(1)) for e in r]
    both = [e for r in noise.perfect_model_rounds(trace, bracketed, 10, random.Random(1)) for e in r]
    drift = 30.0 * per_s * base  # ms the step rises over the lag ...
    assert all(e < -0.5 * drift / (base * 2) for e in plain)  # ... which a run after the calibration takes whole
    assert max(abs(e) for e in both) < 0.1 * min(abs(e) for e in plain)
    assert "7 pairs, bracketed" in noise.VARIANTS and noise.VARIANTS["7 pairs, bracketed"]["lead_s"] > 0


def test_the_stored_trace_rebuilds_the_recorded_windows():
    rng = random.Random(11)
    starts, steps, at = [], [], 0.0
    for i in range(5000):
        s = rng.uniform(0.002, 0.02)
        starts.append(at)
        steps.append(s)
        at += s + (rng.uniform(0.005, 0.2) if rng.random() < 0.01 else rng.uniform(0, 3e-5))  # a few long pauses
    trace = noise.Trace(starts, steps)
    doc = json.loads(json.dumps(noise.compact(trace)))
    assert 0 < len(doc["long_gaps"]) < 200
    back = noise.load_trace(doc)
    assert len(back.seconds) == 5000
    assert max(abs(a - b) for a, b in zip(back.starts, trace.starts)) < 5000 * 5e-5
    for begin in (0.0, 3.3, 17.0, 40.0):
        assert back.window(begin, 2.0) == pytest.approx(trace.window(begin, 2.0), abs=1e-5)


def test_bad_traces_and_too_short_ones_are_refused():
    with pytest.raises(ValueError, match="at least one"):
        noise.Trace([], [])
    with pytest.raises(ValueError, match="positive"):
        noise.Trace([0.0, 1.0], [0.5, 0.0])
    short = _trace([(20.0, 5.0)], seed=4)
    with pytest.raises(ValueError, match="shorter than a pair"):
        noise.perfect_model_rounds(short, noise.Method(3.0, 1.0, 50.0, 5, 19), 1, random.Random(0))
    slow = _trace([(200.0, 900.0)], seed=4)  # 0.9 s steps: a 1 s window holds one or two
    with pytest.raises(ValueError, match="too slow"):
        noise.perfect_model_rounds(slow, noise.Method(3.0, 1.0, 50.0, 5, 19), 1, random.Random(0))


def test_a_saved_trace_is_simulated_again_without_recording(tmp_path, capsys):
    levels = [(30.0, 6.0), (30.0, 7.5)] * 3
    trace = _trace(levels, seed=7)
    saved = tmp_path / "saved.json"
    saved.write_text(json.dumps({"recorded": {"spec": "x.yaml", "step_ms_median": 6.7},
                                 "trace": noise.compact(trace)}))
    out = tmp_path / "again.json"
    assert noise.main(["--trace", str(saved), "--json", str(out), "--trials", "40", "--lag", "30",
                       "--cal-seconds", "1", "--run-seconds", "1", "--pairs", "1", "--specs", "5"]) == 0
    doc = json.loads(out.read_text())
    given = doc["floors"]["as given"]
    assert given["method"] == {"cal_s": 1.0, "run_s": 1.0, "lag_s": 30.0, "pairs": 1, "specs": 5, "lead_s": 0.0}
    assert given["worst_error_median"] == pytest.approx(0.25, abs=0.02)  # 7.5 / 6 - 1, every round
    assert set(doc["floors"]) == {"as given", *noise.VARIANTS}
    assert doc["windowed_spread"]["10s"]["max_over_min"] == pytest.approx(1.25, abs=0.01)
    assert "x.yaml" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        noise.main(["--trace", str(saved), "--json", str(out), "--pairs", "0"])
