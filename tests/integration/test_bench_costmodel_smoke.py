"""Smoke test of tools/bench_costmodel.py: one spec with a given profile, on one process and on 2
ranks (`--nproc 2`): it runs, lists the spec, and its measured step comes from the robust timing
rule over every timed step of its runs (a short step gets a further run; no timing asserted)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrec.planner.calibration import profile_document
from flowrec.testing.processes import communicate_bounded, descendants, kill_tree, run_bounded, running

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc", [1, 2])
def test_bench_costmodel_lists_the_spec_with_its_robust_step(tmp_path, nproc):
    profile = tmp_path / "profile.json"  # datasheet constants, no calibration (quick)
    profile.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "given")}, "test", "now")))
    out = tmp_path / "cost.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = run_bounded([sys.executable, "tools/bench_costmodel.py", "--specs", "movielens.yaml", "--steps", "3", "--runs", "2",
                        "--profile", str(profile), "--nproc", str(nproc), "--json", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["nproc"] == nproc and [r["spec"] for r in doc["specs"]] == ["movielens.yaml"]
    row = doc["specs"][0]
    assert "error" not in row, row
    runs = row["measured_runs"]  # a short step: a second run (a new process) of more steps, pooled
    assert row["world_size"] == nproc and len(runs) == 2 and runs[0]["steps"] == 3 and runs[1]["steps"] >= 3
    assert row["steps"] == sum(r["steps"] for r in runs) and len(row["measured_rounds_ms"]) == 3
    # by default every run's steps fit one epoch of its data (no batch twice: the regime calibration prices)
    assert doc["one_epoch"] is True and row["synth_rows"] > 8192
    assert all(row["batch"] * (r["steps"] + 2 + 1) <= row["synth_rows"] for r in runs)
    spread = (max(r["step_ms"] for r in runs) - min(r["step_ms"] for r in runs)) / row["measured_step_ms"]
    assert row["measured_run_spread"] == pytest.approx(spread) and doc["ratios"]["costmodel_max_run_spread"] == spread
    assert row["measured_method"] in ("clean", "extrapolated") and 0 <= row["measured_clean_steps"] <= row["steps"]
    assert 0 < row["measured_step_ms"] <= row["measured_step_ms_mean"] * row["steps"]  # a step of the run at most
    assert row["step_error"] == row["predicted_step_ms"] / row["measured_step_ms"] - 1
    assert (row["predicted_exchange_ms"] > 0) == (nproc > 1)
    assert doc["ratios"]["costmodel_max_step_error"] == abs(row["step_error"])


@pytest.mark.slow
def test_interleaved_pairs_each_run_after_a_calibration_of_its_own(tmp_path):
    """`--interleave --runs 2` on one short spec: calibrate, run, calibrate, run; each run judged
    against its own calibration's plan, the spec's error the median of the pairs' (no timing asserted)."""
    out = tmp_path / "cost.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = run_bounded([sys.executable, "tools/bench_costmodel.py", "--specs", "movielens.yaml", "--steps", "3",
                        "--runs", "2", "--interleave", "--threads", "1", "--json", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout_s=1200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    row, calibration = doc["specs"][0], doc["calibration"]["movielens.yaml"]
    assert doc["interleave"] is True and "error" not in row, row
    assert len(calibration["pairs"]) == 2 and all(p["seconds"] > 0 for p in calibration["pairs"])  # one per run
    runs = row["measured_runs"]
    assert len(runs) == 2 and row["pair_predicted_step_ms"] == [r["predicted_step_ms"] for r in runs]
    assert row["pair_step_errors"] == [r["step_error"] for r in runs]  # each run against its own plan
    assert all(r["steps"] >= 3 for r in runs)  # sized by its calibration's live step
    errors = row["pair_step_errors"]
    assert row["step_error"] == pytest.approx(sum(errors) / 2) and row["pair_error_spread"] == pytest.approx(
        max(errors) - min(errors))
    assert doc["ratios"]["costmodel_max_step_error"] == abs(row["step_error"])


def _hangup_default() -> None:
    signal.signal(signal.SIGHUP, signal.SIG_DFL)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_stopped_benchmark_removes_its_temporary_folder_and_stops_its_run(tmp_path, signum):
    """`kill` (SIGTERM) or a closed terminal (SIGHUP) while the benchmark's `flowrec train` runs:
    the run's process tree stopped, the benchmark's temporary folder (its synthetic data, profiles
    and runs: 16 GiB once left behind) removed, one line, exit 130, no result written. Python's
    default ended the benchmark at once, leaving both."""
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "given")}, "test", "now")))
    out, temp = tmp_path / "cost.json", tmp_path / "t"
    temp.mkdir()
    env = {**os.environ, "TMPDIR": str(temp)}
    proc = subprocess.Popen([sys.executable, "tools/bench_costmodel.py", "--specs", "movielens.yaml", "--steps",
                             "100000", "--runs", "1", "--profile", str(profile), "--json", str(out)],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_hangup_default)  # as from a terminal, even where the tests run under nohup
    below: list[int] = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:  # the data made, its run started
            below = descendants(proc.pid)
            if list(temp.glob("bench-cost-*/times")) and below:
                break
            time.sleep(0.2)
        assert proc.poll() is None and below, f"the benchmark's run did not start: {proc.poll()}"
        time.sleep(1.0)
        below = descendants(proc.pid)
        proc.send_signal(signum)
        _, err = communicate_bounded(proc, 120)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        for pid in below:
            if running(pid):
                kill_tree(pid)
    assert proc.returncode == 130, err[-3000:]
    assert f"stopped ({signal.Signals(signum).name})" in err and "temporary folders removed" in err, err[-3000:]
    assert list(temp.glob("bench-cost-*")) == [], "the benchmark's temporary folder was left behind"
    assert not out.exists()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(running(pid) for pid in below):
        time.sleep(0.2)
    assert [pid for pid in below if running(pid)] == [], "the benchmark's run was left running"
