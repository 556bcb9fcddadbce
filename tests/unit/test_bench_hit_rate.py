"""tools/bench_hit_rate.py: on fresh skewed synthetic data, the planner's corrected static_hot hit
rate is within a few points of what FAE's hot set gives on the whole data at every cache size,
where the sample's own shares (the model before the correction) are far off once the cache holds
every row the sample saw."""
from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import numpy as np
import pytest

from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_hit_rate", REPO / "tools" / "bench_hit_rate.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_hit_rate", bench)
_spec.loader.exec_module(bench)

DOC = {
    "name": "hit",
    "features": [{"name": f"c{i}", "type": "categorical", "hash_buckets": v, "dim": 8}
                 for i, v in enumerate([100, 3_000, 80_000, 300_000])],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [8]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"seed": int(np.random.default_rng().integers(1 << 30))},
}


def test_corrected_hit_rates_follow_the_whole_data_and_the_sampled_ones_do_not():
    spec = spec_from_dict(DOC)
    table = synth_table(spec, 120_000, SynthConfig(seed=spec.training.seed))
    result = bench.compare(spec, MemorySource(split_table(table, 3)), 16_000)  # FAE's: 20,000 (1/6)
    assert result["fae_sample_rate"] > result["planner_sample_rate"]
    (group,) = result["groups"]
    assert group["distinct_fae_sample"] > group["distinct_planner_sample"]
    assert abs(group["findable_predicted"] - group["distinct_fae_sample"]) <= 0.05 * group["distinct_fae_sample"]
    assert group["max_error_corrected"] <= 0.03, group["caches"]
    assert group["max_error_sampled"] > 0.08  # the old model: every row the sample saw, and only those
    whole = group["caches"][-1]
    assert whole["cache_rows"] == group["rows"] and whole["sampled"] == 1.0 and whole["measured"] < 0.95


def test_a_runs_own_sample_is_faes_and_leaves_nothing_to_extrapolate():
    spec = spec_from_dict(DOC)
    table = synth_table(spec, 120_000, SynthConfig(seed=spec.training.seed))
    result = bench.compare(spec, MemorySource(split_table(table, 3)), None)  # 'run': FAE's rate, 20,000 rows (1/6)
    assert result["planner_sample_rate"] == result["fae_sample_rate"]
    (group,) = result["groups"]
    assert group["distinct_planner_sample"] == group["distinct_fae_sample"] == group["findable_predicted"]
    assert group["max_error_corrected"] <= 0.02, group["caches"]
    whole = [c for c in group["caches"] if c["cache_rows"] >= group["distinct_fae_sample"]]
    assert whole and all(abs(c["corrected"] - c["measured"]) <= 0.008 for c in whole), whole


def test_sample_sizes_are_run_or_positive_rows():
    assert bench.sample_sizes("run,5_000, 20000") == [None, 5_000, 20_000]
    for bad in ("0", "-5", "lots", "run,"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.sample_sizes(bad)
