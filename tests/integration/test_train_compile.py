"""`flowrec train --compile`: the dense stage runs compiled (inductor) and the run ends with the
parameters of the eager run (allclose: fused kernels round differently); run.json records the
switch and a resumed run restores it. Compiling takes tens of seconds: e2e tier."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint import store as ckpt
from flowrec.runtime import lowering
from flowrec.testing.specs import run_spec

runner = CliRunner()


@pytest.fixture
def spec(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(run_spec())
    return path


def _train(spec: Path, *args: str):
    return runner.invoke(app, ["train", str(spec), "--rows", "400", "--quiet", "--seed", "5", *args])


def test_compiled_run_equals_eager_and_is_restored_on_resume(spec: Path, tmp_path: Path, monkeypatch):
    calls = []
    real = lowering.LoweredModel.compile_dense

    def counted(self, on=True):
        call = real(self, on)
        calls.append(call)
        return call

    monkeypatch.setattr(lowering.LoweredModel, "compile_dense", counted)
    compiled, eager = tmp_path / "compiled", tmp_path / "eager"
    assert _train(spec, "--out", str(eager), "--max-steps", "5").exit_code == 0
    assert calls == []  # opt-in
    result = _train(spec, "--out", str(compiled), "--max-steps", "5", "--compile")
    assert result.exit_code == 0, result.output
    assert len(calls) == 1 and calls[0].active and calls[0].calls == 5, calls[0].failure
    assert json.loads((compiled / "run.json").read_text())["compile"] is True
    a, b = ckpt.load_checkpoint(compiled)["model"], ckpt.load_checkpoint(eager)["model"]
    assert set(a) == set(b)
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-4, atol=1e-5, msg=name)
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(compiled), "--quiet", "--max-steps", "6"])
    assert resumed.exit_code == 0, resumed.output
    note = next(line for line in resumed.stderr.splitlines() if line.startswith("restored from run.json"))
    assert "--compile" in note and len(calls) == 2 and calls[1].active
