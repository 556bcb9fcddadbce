"""Smoke test of the staging benchmark (no timing assertions)."""
from __future__ import annotations

import json
import sys

import pytest

from flowrec.testing.processes import run_bounded


@pytest.mark.slow
def test_bench_staging_quick_writes_every_figure(repo, tmp_path):
    out = tmp_path / "bench.json"
    run_bounded([sys.executable, str(repo / "tools" / "bench_staging.py"), "--quick", "--rows", "30000",
                 "--json", str(out)], check=True, timeout_s=300)
    result = json.loads(out.read_text())
    assert {"staging", "staging_uncached", "staging_lookahead", "plain_loop", "plain_loop_kept"} <= set(
        result["samples_per_s"])
    assert all(v > 0 for v in result["samples_per_s"].values())
    assert {"staging_vs_plain", "uncached_vs_plain_reread"} <= set(result["ratios"])
    assert result["device"]["kind"] == "cpu"
    assert result["row_cache_bytes"] == 30000 * 160  # staging kept its rows (13 dense, 1 label, 26 int32 ids)
    isolated = result["isolated"]  # each loop in a fresh process: first epoch cold, the rest warm
    for loop in ["staging", "plain_loop_kept", "staging_uncached", "plain_loop"]:
        epochs = isolated["runs"][loop]
        assert len(epochs) == 1 and [e["samples"] for e in epochs[0]] == [30000] * 4
        assert isolated["samples_per_s"][loop]["warm"] > 0 and isolated["samples_per_s"][loop]["cold"] > 0
    assert set(isolated["ratios"]) == {f"{name}_{epochs}" for name in ["staging_vs_plain", "uncached_vs_plain_reread"]
                                       for epochs in ["cold", "warm"]}
