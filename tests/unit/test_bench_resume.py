"""tools/bench_resume.py on a tiny spec, one round: the JSON it writes holds each command's medians
(positive, finite), and the two resumes printed the same line, the finished run's (no timing is
asserted)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_resume.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_resume", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_resume_benchmark_writes_each_commands_figures_and_one_line(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    buckets = [int(b) for b in rng.integers(20, 400, 3)]
    spec = {"name": "bench_resume_tiny", "features": [{"name": "d", "type": "dense", "transform": "log1p"}] + [
        {"name": f"c{i}", "type": "categorical", "hash_buckets": b, "dim": 4} for i, b in enumerate(buckets)],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 32, "seed": int(rng.integers(0, 10**6))}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "figures" / "resume.json"
    rows, epochs = int(rng.integers(64, 200)), int(rng.integers(1, 3))
    _tool().main(["--spec", str(tmp_path / "spec.json"), "--rows", str(rows), "--epochs", str(epochs),
                  "--rounds", "1", "--out", str(out)])
    figures = json.loads(out.read_text())
    assert figures["spec"] == "bench_resume_tiny" and figures["rows"] == rows and figures["rounds"] == 1
    assert figures["same_line_and_document"] is True and figures["checkpoint_bytes"] > 0
    assert "is finished" in figures["lines"]["resume"] and f"epoch {epochs} of {epochs}" in figures["lines"]["resume"]
    assert set(figures["median"]) == {"resume_checkpoint", "resume_full_load", "eval"}
    for name, median in figures["median"].items():
        assert set(median) == {"wall_s", "cpu_s", "peak_rss_mib"}, name
        assert all(math.isfinite(v) and v > 0 for v in median.values()), (name, median)
        assert len(figures["runs"][name]) == 1
    assert set(figures["ratios"]) == {f"full_load_vs_checkpoint_{k}" for k in ("wall_s", "cpu_s", "peak_rss_mib")}
    assert len(figures["machine"]["load_average"]) == 3
