"""tools/bench_lookahead_fetches.py: on fresh skewed synthetic data, the runtime's scratchpad (the
data stage's windows and horizon, `NextUseFirst`) fetches about what the planner prices, and well
below the window-only model's price once it has spare slots."""
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
_spec = importlib.util.spec_from_file_location("bench_lookahead_fetches", REPO / "tools" / "bench_lookahead_fetches.py")
bench = importlib.util.module_from_spec(_spec)
sys.modules.setdefault("bench_lookahead_fetches", bench)
_spec.loader.exec_module(bench)

DOC = {
    "name": "fetches",
    "features": [{"name": f"c{i}", "type": "categorical", "hash_buckets": v, "dim": 4}
                 for i, v in enumerate([300, 8_000, 50_000, 200_000])]
    + [{"name": "hist", "type": "sequence", "hash_buckets": 30_000, "dim": 8, "max_len": 6, "pooling": "mean"}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 256, "seed": int(np.random.default_rng().integers(1 << 30))},
    "plan": {"window": 4},
}


def test_the_scratchpads_fetches_are_priced_and_the_window_alone_over_prices():
    spec = spec_from_dict(DOC)
    table = synth_table(spec, 16_384, SynthConfig(seed=spec.training.seed))
    result = bench.measure(spec, MemorySource(split_table(table, 3)), [1.0, 2.0])
    assert result["batches"] == 64
    assert len(result["groups"]) == 2  # dim 4 and dim 8 (a list field: fewer ids than max_len)
    for g in result["groups"]:
        assert g["counted"]
        plan, larger = g["sizes"]
        assert larger["cache_rows"] > plan["cache_rows"]
        assert larger["measured"] < plan["measured"]  # spare slots keep rows between reads
        for s in g["sizes"]:
            assert s["priced_error"] == pytest.approx(0.0, abs=0.15), g
            assert s["window_error"] > 0.2, g  # the model before Round 23


def test_spares_are_multiples_of_the_plans_scratchpad():
    assert bench.spares_of("1,2.5") == [1.0, 2.5]
    for bad in ("0.5", "x", "nan", "inf", "-1"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench.spares_of(bad)
