"""tools/profile_step.py: a window of `flowrec train`'s steps profiled op by op (CPU here)."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tools"))

import profile_step  # noqa: E402


def test_the_window_holds_the_steps_asked_and_the_step_s_operators(tmp_path, capsys):
    out = tmp_path / "prof.json"
    assert profile_step.main([str(REPO / "specs" / "custom_module.yaml"), "--steps", "3", "--warmup", "2",
                              "--rows", "8192", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["profiled_steps"] == 3 and len(doc["step_ms_profiled"]) == 3
    assert all(ms > 0 for ms in doc["step_ms_profiled"])
    names = {op["name"] for op in doc["ops"]}
    assert "_CastedEmbeddingBag" in names and "_CastedEmbeddingBagBackward" in names  # the packed lookup
    mm = [op for op in doc["ops"] if op["name"] in ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")]
    assert mm and all(op["calls_per_step"] >= 1 for op in mm)  # the MLPs' GEMMs, every step
    lookups = [op for op in doc["ops"] if op["name"] == "_CastedEmbeddingBag"]
    assert sum(op["calls_per_step"] for op in lookups) == pytest.approx(1.0)  # one packed group, once a step
    cpu = [op["self_cpu_ms_per_step"] for op in doc["ops"]]
    assert cpu == sorted(cpu, reverse=True)
    assert "custom_module" in capsys.readouterr().out or doc["spec"].endswith("custom_module.yaml")


def test_a_device_budget_profiles_the_cached_placement_and_removes_the_temporary_folder(tmp_path, monkeypatch):
    """`--device-budget 1MiB --cache static_hot`: the run is planned as `flowrec train` plans it with
    them (the group behind a hot-row cache, its counters in the JSON), and the tool's temporary
    folder is gone afterwards (it was left behind before)."""
    temp = tmp_path / "t"
    temp.mkdir()
    monkeypatch.setattr(profile_step.tempfile, "tempdir", str(temp))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    out = tmp_path / "prof.json"
    argv = [str(REPO / "specs" / "custom_module.yaml"), "--steps", "2", "--warmup", "1", "--rows", "8192",
            "--json", str(out)]
    assert profile_step.main([*argv, "--device-budget", "1MiB", "--cache", "static_hot"]) == 0
    doc = json.loads(out.read_text())
    assert doc["device_budget"] == "1MiB" and doc["cache"] == "static_hot"
    cached = doc["cache_counters"]
    assert cached and all(c["lookups"] > 0 and 0 <= c["hit_rate"] < 1 for c in cached.values()), cached
    assert list(temp.glob("flowrec-profile-*")) == []
    assert profile_step.main(argv) == 0  # no budget: resident, no cache counters
    assert json.loads(out.read_text())["cache_counters"] == {}

def test_a_run_that_ends_before_the_window_is_refused(monkeypatch):
    """A run that stops early (early stopping, a stop callback) leaves no full window: refused, named."""
    class _Result:
        steps = 2

    class _Run:
        result = _Result()

    def short_train(spec, *, on_step, **kwargs):
        for step in (1, 2):
            on_step(step)
        return _Run()

    monkeypatch.setattr(profile_step.api, "train", short_train)
    with pytest.raises(SystemExit, match="ended after 2 steps, before the profiled window"):
        profile_step.main([str(REPO / "specs" / "custom_module.yaml"), "--steps", "4", "--warmup", "2"])


@pytest.mark.parametrize("argv", [["--steps", "0"], ["--warmup", "-1"], ["--rows", "0"]])
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        profile_step.main([str(REPO / "specs" / "custom_module.yaml"), *argv])
    assert "must be >= 1" in capsys.readouterr().err


def test_a_device_budget_that_is_no_size_is_refused(capsys):
    with pytest.raises(SystemExit):
        profile_step.main([str(REPO / "specs" / "custom_module.yaml"), "--device-budget", "lots"])
    assert "--device-budget: 'lots' is not a size" in capsys.readouterr().err


def test_a_missing_spec_and_a_missing_gpu_are_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        profile_step.main([str(tmp_path / "missing.yaml")])
    assert "no spec file" in capsys.readouterr().err
    if not profile_step.torch.cuda.is_available():
        with pytest.raises(SystemExit):
            profile_step.main([str(REPO / "specs" / "custom_module.yaml"), "--device", "cuda"])
        assert "no CUDA device" in capsys.readouterr().err
