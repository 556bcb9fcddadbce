"""Smoke test of tools/bench_dist.py --quick: two gloo ranks run and the JSON holds the ratios the
scale-out issue asks for (counted bytes are exact counts, so their ratios are checked; no timing)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_dist_quick_writes_ratios(tmp_path):
    out = tmp_path / "dist.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = run_bounded([sys.executable, "tools/bench_dist.py", "--quick", "--json", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout_s=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["world_1"]["bytes_sent_per_rank_step"] == 0  # one rank sends nothing
    parts = doc["world_2"]["parts_per_rank_step"]
    assert parts["rows"] == parts["grads"] > 0 and parts["ids"] > 0  # fp32 rows out, fp32 grads back
    ratios = doc["ratios"]
    assert 0 < ratios["dist_bytes_vs_torchrec_rw"] < 0.5  # deduplication on Zipf-skewed ids
    assert 0.8 < ratios["dist_bytes_predicted_vs_counted"] < 1.2
