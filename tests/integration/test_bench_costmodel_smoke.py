"""Smoke test of tools/bench_costmodel.py: one spec with a given profile, on one process and on 2
ranks (`--nproc 2`): it runs, lists the spec, and its measured step comes from the robust timing
rule over every timed step of its runs (a short step gets a further run; no timing asserted)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flowrec.planner.calibration import profile_document

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("nproc", [1, 2])
def test_bench_costmodel_lists_the_spec_with_its_robust_step(tmp_path, nproc):
    profile = tmp_path / "profile.json"  # datasheet constants, no calibration (quick)
    profile.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "given")}, "test", "now")))
    out = tmp_path / "cost.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "tools/bench_costmodel.py", "--specs", "movielens.yaml", "--steps", "3", "--runs", "2",
                           "--profile", str(profile), "--nproc", str(nproc), "--json", str(out)],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["nproc"] == nproc and [r["spec"] for r in doc["specs"]] == ["movielens.yaml"]
    row = doc["specs"][0]
    assert "error" not in row, row
    runs = row["measured_runs"]  # a short step: a second run (a new process) of more steps, pooled
    assert row["world_size"] == nproc and len(runs) == 2 and runs[0]["steps"] == 3 and runs[1]["steps"] >= 3
    assert row["steps"] == sum(r["steps"] for r in runs) and len(row["measured_rounds_ms"]) == 3
    spread = (max(r["step_ms"] for r in runs) - min(r["step_ms"] for r in runs)) / row["measured_step_ms"]
    assert row["measured_run_spread"] == pytest.approx(spread) and doc["ratios"]["costmodel_max_run_spread"] == spread
    assert row["measured_method"] in ("clean", "extrapolated") and 0 <= row["measured_clean_steps"] <= row["steps"]
    assert 0 < row["measured_step_ms"] <= row["measured_step_ms_mean"] * row["steps"]  # a step of the run at most
    assert row["step_error"] == row["predicted_step_ms"] / row["measured_step_ms"] - 1
    assert (row["predicted_exchange_ms"] > 0) == (nproc > 1)
    assert doc["ratios"]["costmodel_max_step_error"] == abs(row["step_error"])
