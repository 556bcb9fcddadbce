"""Smoke test of tools/bench_train.py --quick (with one CPU-bound competitor process beside it): it
runs and writes a complete JSON (no timing asserted)."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
RATIOS = ("flowrec_vs_plain_dlrm", "flowrec_vs_torchrec_dlrm", "flowrec_vs_plain_wide1000",
          "flowrec_vs_torchrec_wide1000")


def test_bench_train_quick_writes_figures(tmp_path):
    out = tmp_path / "train.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = run_bounded([sys.executable, "tools/bench_train.py", "--quick", "--models", "dlrm",
                        "--precisions", "fp32", "--competitors", "1", "--compile", "--eager-twin", "--json", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["device"] == "cpu" and doc["quick"] is True and doc["competitors"] == 1
    assert set(RATIOS) <= set(doc["ratios"])
    figs = doc["models"]["dlrm"]["precisions"]["fp32"]
    for name in ("flowrec", "plain"):
        assert figs[name]["ms_per_step"] > 0 and figs[name]["samples_per_s"] > 0
        assert 0.0 <= figs[name]["auc"] <= 1.0
    assert doc["ratios"]["flowrec_vs_plain_dlrm"] > 0
    assert doc["ratios"]["flowrec_vs_plain_wide1000"] is None  # not run
    assert (doc["ratios"]["flowrec_vs_torchrec_dlrm"] is None) == (figs["torchrec"] is None)
    assert "flowrec" in proc.stdout and "plain" in proc.stdout
    # the compiled dense stage beside the eager one, and the stage profile
    assert "dense stage compiled (inductor" in figs["flowrec"]["note"] and figs["flowrec"]["setup_s"] > 0
    assert figs["flowrec_eager"]["ms_per_step"] > 0 and doc["ratios"]["compiled_vs_eager_dlrm"] > 0
    stages = figs["flowrec"]["profile_ms"]
    assert set(stages) == {"sparse_lookup", "dense_forward_loss", "dense_backward", "sparse_backward_update",
                           "dense_optimizer", "step"}
    assert stages["step"] >= max(v for k, v in stages.items() if k != "step") > 0


def test_torchrec_wide_model_is_the_specs_model():
    """The stock TorchRec wide & deep of the benchmark (run where torchrec imports): its layers have
    the widths of flowrec's lowered wide_1000 (every wide field, every deep column, the spec's
    layers), and a few steps on staged batches train it (finite losses, scores for every row)."""
    pytest.importorskip("torchrec")
    sys.path.insert(0, str(REPO / "tools"))
    import bench_train as bt
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.lowering import LoweredModel
    from flowrec.spec import load_spec

    spec = bt.capped_spec(load_spec(REPO / bt.MODELS["wide1000"]), 500, 64)
    plan = make_plan(spec, target="cpu")
    system = bt.torchrec_wide_system(plan, spec, "fp32")
    wide, deep, *layers = bt.stock_wide_dense(spec)
    assert len(wide) + len(deep) == len(spec.sparse_features) and not set(wide) & set(deep)
    shapes = lambda params: sorted(tuple(p.shape) for p in params)  # noqa: E731
    flowrec_shapes = shapes(LoweredModel(plan, spec, "cpu", 0, tables=False).dense_parameters())
    assert shapes(p for layer in layers for p in layer.parameters()) == flowrec_shapes
    assert max(flowrec_shapes)[1] > 10_000  # the deep layer over every deep column
    batches = bt.staged_batches(spec, plan, 64 * 3, 1, 64, lookahead=1)
    losses = [system.step(system.prepare(b)) for b in batches]
    assert all(0 < loss < 10 for loss in losses)
    scores = system.predict(system.prepare(batches[0]))
    assert scores.shape == (64, 1) and torch.isfinite(scores).all()


def test_bench_train_isolated_runs_each_system_in_its_own_process(tmp_path):
    """`--isolate 2 --host-allocator as-run`: every system in processes of its own, two rounds, the
    allocator each process ran under recorded (flowrec tuned, plain glibc's own), the figure the
    median of the rounds; `as-run` without `--isolate` is refused."""
    out = tmp_path / "iso.json"
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor")}
    proc = run_bounded([sys.executable, "tools/bench_train.py", "--quick", "--models", "dlrm",
                        "--precisions", "fp32", "--systems", "flowrec,plain", "--isolate", "2",
                        "--host-allocator", "as-run", "--profile-steps", "0", "--json", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout_s=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["isolate"] == {"rounds": 2, "allocators": {"flowrec": "flowrec", "plain": "default"}}
    figs = doc["models"]["dlrm"]["precisions"]["fp32"]
    assert figs["torchrec"] is None and set(figs) == {"flowrec", "plain", "torchrec"}
    for name, tuned in (("flowrec", True), ("plain", False)):
        fig = figs[name]
        assert len(fig["rounds_ms"]) == 2 and min(fig["rounds_ms"]) <= fig["ms_per_step"] <= max(fig["rounds_ms"])
        assert fig["host_allocator_tuned"] is tuned
        assert len(fig["rounds_auc"]) == 2 and 0.0 < fig["auc"] < 1.0
    assert doc["ratios"]["flowrec_vs_plain_dlrm"] == round(figs["plain"]["ms_per_step"] / figs["flowrec"]["ms_per_step"], 3)
    assert proc.stderr.count("[round ") == 4  # one progress line per process
    refused = run_bounded([sys.executable, "tools/bench_train.py", "--quick", "--host-allocator", "as-run"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout_s=120)
    assert refused.returncode == 2 and "--isolate" in refused.stderr


def test_an_isolated_systems_failed_process_is_recorded_not_fatal():
    """A system's process that the kernel killed (as the out-of-memory killer does) or that exited
    with an error fails its round with the reason; one that succeeds gives None."""
    sys.path.insert(0, str(REPO / "tools"))
    import bench_train as bt

    killed = bt.child_failure([sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    assert killed["returncode"] == -9 and "out of memory" in killed["reason"]
    failed = bt.child_failure([sys.executable, "-c", "import sys; sys.exit('no tables: 3')"])
    assert failed["returncode"] == 1 and failed["reason"] == "exit status 1" and "no tables: 3" in failed["stderr_tail"]
    assert bt.child_failure([sys.executable, "-c", "pass"]) is None
