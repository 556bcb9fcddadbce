"""Runs, round 9: the full load of a finished run on request, a finished run's `--nproc N` resume
told before any rank starts, and resume / eval of damaged and moved runs (one test per defect;
each fails on the code before its fix)."""
from __future__ import annotations

import json
import random
from pathlib import Path

from typer.testing import CliRunner

from flowrec.cli import app

runner = CliRunner()


def _spec(tmp_path: Path) -> Path:
    """A spec of small tables, fresh sizes and seed each time."""
    rng = random.Random()
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny_runs9\n"
        "features:\n  - {name: price, type: dense}\n"
        f"  - {{name: user, type: categorical, hash_buckets: {rng.randint(50, 400)}, dim: 4}}\n"
        f"  - {{name: item, type: categorical, hash_buckets: {rng.randint(20, 90)}, dim: 4}}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: ['@dense', '@sparse'], layers: [8]}\n"
        "heads:\n  - {name: ctr, input: top, task: binary, loss: bce}\n"
        f"training: {{batch_size: {rng.choice([16, 32])}, epochs: 1, seed: {rng.randint(0, 10**6)}}}\n")
    return path


def _train(spec: Path, run: Path, *extra: str) -> None:
    done = runner.invoke(app, ["train", str(spec), "--out", str(run), "-q", "--device", "cpu",
                               "--rows", str(random.randint(150, 400)), *extra])
    assert done.exit_code == 0, done.output


def _resume(spec: Path, run: Path, *extra: str, env: dict | None = None):
    return runner.invoke(app, ["train", str(spec), "--resume", str(run), "--json", *extra], env=env)


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_the_full_load_of_a_finished_run_can_be_asked_for_and_says_the_same(tmp_path: Path, monkeypatch) -> None:
    """tools/bench_resume.py times a finished run told from its checkpoint against the run loaded
    whole, which nothing could ask for (only a test's monkeypatch); FLOWREC_RESUME_FULL_LOAD=1 loads
    it (its tables loaded once), with the same line and --json document."""
    from flowrec.runtime.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run, "--epochs", str(random.randint(1, 3)))
    told = _resume(spec, run)
    loads = []
    load_state = Trainer.load_state
    monkeypatch.setattr(Trainer, "load_state", lambda self, *a, **k: (loads.append(1), load_state(self, *a, **k))[1])
    loaded = _resume(spec, run, env={"FLOWREC_RESUME_FULL_LOAD": "1"})
    assert told.exit_code == loaded.exit_code == 0, (told.output, loaded.output)
    assert loads == [1], loaded.output
    assert _last_line(loaded) == _last_line(told) and "is finished" in _last_line(told)
    assert json.loads(loaded.stdout) == json.loads(told.stdout)
    again = _resume(spec, run, env={"FLOWREC_RESUME_FULL_LOAD": "0"})
    assert again.exit_code == 0 and loads == [1] and _last_line(again) == _last_line(told)


def test_a_bad_full_load_switch_is_one_line_before_anything_is_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    value = random.choice(["yes", "true", "2", "on", "x" * random.randint(1, 5)])
    result = runner.invoke(app, ["train", str(spec), "--out", str(run), "--device", "cpu", "--rows", "100"],
                           env={"FLOWREC_RESUME_FULL_LOAD": value})
    assert result.exit_code == 2, result.output
    assert _last_line(result).startswith("error: FLOWREC_RESUME_FULL_LOAD") and repr(value) in _last_line(result)
    assert "Traceback" not in result.output and not run.exists()
