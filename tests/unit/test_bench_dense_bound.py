"""tools/bench_dense_bound.py: the bound a machine's GEMMs put on any system's ratio, against
TorchRec and, where a bench_train run has it, against the plain model (whose tables may be capped
to fit memory: the cap is carried beside the bound, since it shortens the plain step)."""
from __future__ import annotations

import importlib.util
import json
import random
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))
_spec = importlib.util.spec_from_file_location("bench_dense_bound", REPO / "tools" / "bench_dense_bound.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def _train(path: Path, flowrec: float, torchrec: float, plain: float | None, cap: int | None) -> Path:
    figs = {"flowrec": {"ms_per_step": flowrec}, "torchrec": {"ms_per_step": torchrec}}
    if plain is not None:
        figs["plain"] = {"ms_per_step": plain}
    path.write_text(json.dumps({"models": {"wide1000": {"plain_tables_capped_at": cap,
                                                        "precisions": {"fp32": figs}}}}))
    return path


def test_the_plain_models_bound_and_cap_are_reported_beside_torchrecs(tmp_path):
    rng = random.Random()
    bound_ms, flowrec, torchrec, plain = (rng.uniform(900, 1200), rng.uniform(1200, 1500),
                                          rng.uniform(2500, 3000), rng.uniform(7000, 9000))
    cap = rng.randrange(100_000, 2_000_000)
    bounds = [{"model": "wide1000", "precision": "fp32", "dense_bound_ms": bound_ms},
              {"model": "wide1000", "precision": "bf16", "dense_bound_ms": bound_ms * 6}]
    rows = bench.ratio_bounds(bounds, [_train(tmp_path / "t.json", flowrec, torchrec, plain, cap)])
    assert len(rows) == 1 and rows[0]["precision"] == "fp32"  # no bf16 figures in the run: no row
    row = rows[0]
    assert abs(row["ratio_bound"] - torchrec / bound_ms) < 1e-3
    assert abs(row["measured_plain_ratio"] - plain / flowrec) < 1e-3
    assert abs(row["plain_ratio_bound"] - plain / bound_ms) < 1e-3
    assert row["plain_tables_capped_at"] == cap


def test_a_run_without_the_plain_model_has_no_plain_bound(tmp_path):
    bounds = [{"model": "wide1000", "precision": "fp32", "dense_bound_ms": 1000.0}]
    row = bench.ratio_bounds(bounds, [_train(tmp_path / "t.json", 1300.0, 2700.0, None, None)])[0]
    assert row["ratio_bound"] == 2.7
    assert "plain_ratio_bound" not in row and "plain_ms" not in row
