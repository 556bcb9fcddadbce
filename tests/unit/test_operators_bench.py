"""Smoke test of tools/bench_ops.py --quick: every variant runs and the report is complete (no timing asserts)."""
from __future__ import annotations

import json
import sys

import pytest

from flowrec.testing.processes import run_bounded


@pytest.mark.slow
def test_bench_quick_writes_report(repo, tmp_path):
    out = tmp_path / "bench.json"
    proc = run_bounded([sys.executable, "-W", "ignore", str(repo / "tools" / "bench_ops.py"),
                        "--quick", "--json", str(out), "--device", "cpu"],
                       capture_output=True, text=True, timeout_s=300, cwd=repo)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    assert set(report["ratios"]) == {"packed_vs_dense_grad_f26", "packed_vs_floor_f26",
                                     "packed_vs_sparse_f1000", "packed_vs_floor_f1000",
                                     "unfused_vs_floor_f26", "unfused_vs_floor_f1000"}
    assert report["fused_cpu_kernel"].startswith("numba ")
    assert all(v > 0 for v in report["ratios"].values())
    assert report["device"].startswith("cpu")
    assert {"platform", "cpu_count", "torch", "cpu_capability"} <= set(report["machine"])
    for case in report["cases"].values():
        assert set(case["median_ms"]) >= {"per_field_dense_adagrad", "per_field_sparse_adagrad",
                                          "flowrec_packed_adagrad", "gather_floor",
                                          "flowrec_packed_adagrad_unfused"}
    assert "criteo26" in proc.stdout and "wide1000" in proc.stdout
