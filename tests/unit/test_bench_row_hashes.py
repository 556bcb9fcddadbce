"""tools/bench_row_hashes.py: on fresh skewed rows with list columns (and a share of text items
Python writes escaped), both variants give the same row hashes and the JSON holds each variant's
times (no timing is asserted: the machine is shared)."""
from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np

from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]


def test_the_benchmark_writes_both_variants_times_for_the_same_hashes(tmp_path: Path):
    out = tmp_path / "hashes.json"
    rows = int(np.random.default_rng().integers(300, 900))
    done = run_bounded([sys.executable, str(REPO / "tools" / "bench_row_hashes.py"), "--json", str(out),
                        "--rows", str(rows), "--rounds", "2", "--odd-share", "0.2"],
                       capture_output=True, text=True, timeout_s=300, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["rows"] == rows and result["same_hashes"] is True and result["list_items"] > rows
    for kind in ("cpu_s", "wall_s"):
        assert set(result[kind]) == {"python_texts", "value_texts"}
        for times in result[kind].values():
            assert math.isfinite(times["median"]) and times["median"] >= times["min"] > 0
    bad = run_bounded([sys.executable, str(REPO / "tools" / "bench_row_hashes.py"), "--json", str(out),
                       "--odd-share", "2"], capture_output=True, text=True, timeout_s=120, cwd=tmp_path)
    assert bad.returncode == 2 and "--odd-share" in bad.stderr
