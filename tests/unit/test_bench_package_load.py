"""tools/bench_package_load.py on a tiny spec, one round: the JSON it writes holds every variant's
medians, the export's steps' too, each a positive, finite number of seconds (no timing is asserted)."""
from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np

TOOL = Path(__file__).resolve().parents[2] / "tools" / "bench_package_load.py"


def _tool():
    spec = importlib.util.spec_from_file_location("bench_package_load", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_package_load_benchmark_writes_every_variants_figures(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    buckets = [int(b) for b in rng.integers(20, 400, 3)]
    spec = {"name": "bench_load_tiny", "features": [{"name": "d", "type": "dense", "transform": "log1p"}] + [
        {"name": f"c{i}", "type": "categorical", "hash_buckets": b, "dim": 4} for i, b in enumerate(buckets)],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 32}}
    (tmp_path / "spec.json").write_text(json.dumps(spec))
    out = tmp_path / "figures" / "load.json"
    before = Path(__file__).parent / "fixtures" / "package_v2"  # a package of another flowrec (format 2, 5 tables)
    _tool().main(["--spec", str(tmp_path / "spec.json"), "--rows", str(int(rng.integers(64, 200))), "--steps", "1",
                  "--rounds", "1", "--before", str(before), "--out", str(out)])
    figures = json.loads(out.read_text())
    assert figures["spec"] == "bench_load_tiny" and figures["fields"] == 3 and figures["same_graph"] is True
    assert set(figures["median"]) == {"torch_export_load", "load_program", "load_program_no_memo", "load_model",
                                      "load_model_samples_twice", "load_model_before", "first_predict"}
    graph = figures["graph"]  # one lookup for the 3 fields of one dim; one per field in the package of before
    assert graph["package"]["embedding_bags"] == 1 and graph["before"]["embedding_bags"] == 5
    assert graph["package"]["placeholders"] > 7 and graph["before"]["nodes"] > graph["before"]["placeholders"]
    for name, median in figures["median"].items():
        assert set(median) == {"wall_s", "cpu_s"}, name
        assert all(math.isfinite(v) and v > 0 for v in median.values()), (name, median)
        assert len(figures["runs"][name]) == 1
    assert figures["model_pt2_bytes"] > 0 and len(figures["machine"]["load_average"]) == 3
    export = figures["export"]  # the export's ServingModel (the tables agreed, or the tool stopped)
    assert set(export["median"]) == {"serving_copied", "serving_in_place"}
    for name, median in export["median"].items():
        assert all(math.isfinite(median[k]) and median[k] > 0 for k in ("wall_s", "cpu_s")), (name, median)
        assert len(export["runs"][name]) == 1
