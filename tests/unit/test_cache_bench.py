"""tools/bench_cache.py --quick runs and reports every figure (smoke test; no timing assertions)."""
from __future__ import annotations

import importlib.util
import json

import pytest


@pytest.mark.slow
def test_bench_cache_quick(repo, tmp_path):
    spec = importlib.util.spec_from_file_location("bench_cache", repo / "tools" / "bench_cache.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "cache.json"
    result = bench.main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["bytes_per_sample"]) == {"device", "host", "static_hot", "lookahead", "lru", "belady"}
    assert {"lookahead_vs_lru_bytes", "lookahead_vs_belady_bytes"} <= set(result["ratios"])
    assert result["hit_rate"]["lookahead"] == 1.0
    assert result["row_bytes_per_sample"]["lookahead"] >= result["row_bytes_per_sample"]["belady"]
    assert "device" in result
