"""tools/bench_dropout.py: both dropout masks timed on the same model and batches, alternating, and
a spec without dropout refused by name."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_dropout", REPO / "tools" / "bench_dropout.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_both_masks_are_timed_on_one_model():
    row = bench.compare("esmm_multitask", steps=2, batch=64)
    assert row["dropouts"] == 2 and row["batch"] == 64 and row["steps"] == 2
    assert row["compiled_mask_ms"] > 0 and row["tensor_ops_mask_ms"] > 0
    assert abs(row["tensor_ops_vs_compiled"] - row["tensor_ops_mask_ms"] / row["compiled_mask_ms"]) < 0.01


def test_a_spec_without_dropout_is_refused_by_name():
    with pytest.raises(SystemExit, match="movielens has no dropout"):
        bench.compare("movielens", steps=1, batch=64)
