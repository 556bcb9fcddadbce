"""tools/bench_first_layer.py: both layouts of the first layer compute the same layer (the column-major
arm is a real alternative, not a cheaper wrong one), its sources are wide_1000's, and the smoke run
writes its figures."""
from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import bench_first_layer as bench  # noqa: E402


def test_the_column_major_layer_is_the_row_major_one_on_fresh_skewed_operands(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(random.randint(0, 10**6))
    widths = [random.randint(1, 4), 4 * random.randint(2, 6), 8 * random.randint(1, 4)]
    fields = ([(0, 1)] * widths[0] + [(1, 4)] * (widths[1] // 4) + [(2, 8)] * (widths[2] // 8))
    inverse = bench.inverse_order(widths, fields, gen)
    assert sorted(inverse.tolist()) == list(range(sum(widths)))  # a permutation of the input's columns
    assert inverse.tolist() != list(range(sum(widths)))  # fields of three sources interleaved
    doc = bench.measure(widths, inverse, random.randint(40, 90), random.randint(5, 20), 2, gen)
    assert doc["max_abs_diff"]["y"] < 1e-4 and doc["max_abs_diff"]["input_grads"] < 1e-4
    assert doc["max_abs_diff"]["weight_grad"] < 1e-3
    assert doc["row_major_cpu_ms"] > 0 and doc["column_major_cpu_ms"] > 0


def test_the_sources_are_the_deep_mlp_inputs_of_wide_1000() -> None:
    from flowrec.spec import load_spec

    spec = load_spec(REPO / "specs" / "wide_1000.yaml")
    widths, fields = bench.source_widths(REPO / "specs" / "wide_1000.yaml")
    deep = [f for f in spec.features if hasattr(f, "table") and "deep" in (f.tags or ())]
    dims = {t.name: t.dim for t in spec.tables}
    assert sum(widths) == 4 + sum(dims[f.table] for f in deep)
    assert len(fields) == 4 + len(deep) and len(widths) > 3


def test_the_smoke_run_writes_its_figures(tmp_path: Path) -> None:
    out = tmp_path / "first_layer.json"
    bench.main(["--quick", "--json", str(out)])
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "first_layer" and doc["quick"] is True
    assert doc["in"] == sum(doc["source_widths"]) and set(doc["rounds_cpu_ms"]) == {"row_major", "column_major"}
    assert len(doc["rounds_cpu_ms"]["row_major"]) == doc["rounds"]
