"""Runs, round 8: resuming a finished run, eval and export of a run (one test per defect; each
fails on the code before its fix)."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint import store as ckpt
from flowrec.testing.processes import run_bounded

runner = CliRunner()


def _spec(tmp_path: Path, early: bool = False) -> Path:
    """A spec of small tables (fresh sizes and seed each time); `early`: bound to a skewed CSV with a
    test split, evaluated every step, stopping at its second evaluation (no AUC beats the first by 1)."""
    rng = random.Random()
    buckets, seed = rng.randint(50, 400), rng.randint(0, 10**6)
    data, training = "", f"training: {{batch_size: {rng.choice([16, 32])}, epochs: 1, seed: {seed}}}\n"
    if early:
        rows = ["label,price,user"] + [f"{int(rng.random() < 0.2)},{rng.expovariate(0.5):.3f},"
                                       f"u{min(int(rng.paretovariate(1.2)), 60)}" for _ in range(rng.randint(240, 400))]
        (tmp_path / "raw.csv").write_text("\n".join(rows) + "\n")
        data = "data: {format: csv, path: raw.csv, label: label, options: {test_fraction: 0.25}}\n"
        training = training.replace("}\n", ", eval_every: 1, early_stopping: {metric: auc, patience: 1, "
                                           "min_delta: 1.0}}\n")
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny_runs8\n"
        "features:\n  - {name: price, type: dense}\n"
        f"  - {{name: user, type: categorical, {'vocab: 80' if early else f'hash_buckets: {buckets}'}, dim: 4}}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: ['@dense', '@sparse'], layers: [8]}\n"
        "heads:\n  - {name: ctr, input: top, task: binary, loss: bce}\n" + data + training)
    return path


def _train(spec: Path, run: Path, *extra: str) -> None:
    done = runner.invoke(app, ["train", str(spec), "--out", str(run), "-q", "--device", "cpu", *extra])
    assert done.exit_code == 0, done.output


def _resume(spec: Path, run: Path, *extra: str):
    return runner.invoke(app, ["train", str(spec), "--resume", str(run), "--json", *extra])


def _loaded_resume(spec: Path, run: Path, monkeypatch, *extra: str):
    """The resume as it was before: the run loaded (data, model, tables) before it is said finished."""
    import flowrec.runs.finished as finished

    with monkeypatch.context() as m:
        m.setattr(finished, "finished_run", lambda *_a, **_k: None)
        return _resume(spec, run, *extra)


def _never_built(monkeypatch) -> None:
    import flowrec.runs.start as start
    from flowrec.runtime.trainer import Trainer

    def never(*_a, **_k):
        raise AssertionError("the finished run's data and model were built, or its tables loaded")

    monkeypatch.setattr(start, "start_session", never)
    monkeypatch.setattr(Trainer, "load_state", never)


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("how", ["epochs", "max_steps", "early_stop"])
def test_a_finished_run_is_told_from_its_checkpoint_with_the_same_line_and_document(tmp_path: Path, monkeypatch,
                                                                                  how: str) -> None:
    """`train --resume RUN` of a finished run read its data, built its model and loaded every table
    (45-54 s on dlrm_criteo) to say "RUN is finished"; its checkpoint now says so, in the same line
    and --json document as the loaded run, and nothing is built."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path, early=how == "early_stop"), tmp_path / "run"
    extra = {"epochs": ["--rows", str(random.randint(150, 400)), "--epochs", str(random.randint(1, 3))],
             "max_steps": ["--rows", "600", "--max-steps", str(random.randint(1, 4))],
             "early_stop": ["--epochs", "4"]}[how]
    _train(spec, run, *extra)
    before = _loaded_resume(spec, run, monkeypatch)
    assert before.exit_code == 0, before.output
    _never_built(monkeypatch)
    now = _resume(spec, run)
    assert now.exit_code == 0, now.output
    assert _last_line(now) == _last_line(before)
    assert json.loads(now.stdout) == json.loads(before.stdout)
    assert json.loads(now.stdout)["finished"] is True and "building model" not in now.stderr
    said = {"epochs": "is finished", "max_steps": "--max-steps", "early_stop": "stopped early"}[how]
    assert said in _last_line(now), now.stderr


def _resaved(run: Path, edit) -> None:
    state = ckpt.load_checkpoint(run)
    state.pop("digest")
    edit(state)
    ckpt.save_checkpoint(run / "checkpoint.pt", state)


def _first_weight(state: dict) -> str:
    return next(k for k in state["model"] if k.endswith(".weight"))


def _reshape_optimizer_state(state: dict) -> None:
    entry = next(iter(state["dense_optimizer"]["state"].values()))
    key = next(k for k, v in entry.items() if isinstance(v, torch.Tensor) and v.dim())
    entry[key] = torch.rand(entry[key].numel() + 3)


DAMAGES = {
    "table_reshaped": lambda s: s["model"].update({_first_weight(s): torch.rand(3, 3)}),
    "table_retyped": lambda s: s["model"].update({_first_weight(s): s["model"][_first_weight(s)].double()}),
    "table_missing": lambda s: s["model"].pop(_first_weight(s)),
    "table_extra": lambda s: s["model"].update(extra=torch.rand(2)),
    "optimizer_state_reshaped": _reshape_optimizer_state,
    "optimizer_of_two_groups": lambda s: s["dense_optimizer"]["param_groups"].append(
        dict(s["dense_optimizer"]["param_groups"][0], params=[])),
    "optimizer_of_fewer_parameters": lambda s: s["dense_optimizer"]["param_groups"][0]["params"].pop(),
    "schedule_horizon": lambda s: s.update(schedule={"horizon_steps": -random.randint(1, 9)}),
}


@pytest.mark.parametrize("damage", sorted(DAMAGES))
def test_a_finished_run_whose_checkpoint_does_not_fit_gives_the_loaded_runs_line(tmp_path: Path, monkeypatch,
                                                                                 damage: str) -> None:
    """A finished run whose checkpoint does not fit the model (re-saved with a valid digest) is not
    said finished: the run is loaded and gives the line it gave before, exit 2."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run, "--rows", str(random.randint(150, 400)))
    _resaved(run, DAMAGES[damage])
    before = _loaded_resume(spec, run, monkeypatch)
    now = _resume(spec, run)
    assert before.exit_code == now.exit_code == 2, (before.output, now.output)
    assert _last_line(now) == _last_line(before) and _last_line(now).startswith("error: ")
    assert "is finished" not in now.output and "Traceback" not in now.output


def test_eval_and_resume_of_a_model_without_dropout_never_import_dynamo(tmp_path: Path, monkeypatch) -> None:
    """`flowrec eval RUN` and `--resume` imported torch._dynamo (3-6 s of a 20-40 s eval of dlrm_criteo
    on the 2-core VM) for nothing: `@torch.compiler.disable` on the dropout's mask, at import; the mask
    is wrapped when the first dropout is made, so a model without dropout never imports it."""
    import sys

    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run, "--rows", str(random.randint(150, 400)))
    code = ("import sys\n"
            "from flowrec.planner.contract import scoring_plan\n"
            "from flowrec.serving.trained import load_trained\n"
            "from flowrec.runs.finished import finished_run\n"
            "trained = load_trained(sys.argv[1], 'cpu', scoring_plan)\n"
            "print('torch._dynamo' in sys.modules)\n"
            "from operators.regularize import SeededDropout\n"
            "drop = SeededDropout(0.25)\n"
            "print('torch._dynamo' in sys.modules, SeededDropout._keep is not getattr(SeededDropout, '_keep_mask', None))\n")
    out = run_bounded([sys.executable, "-c", code, str(run)], capture_output=True, text=True, timeout_s=600)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["False", "True", "True"], out.stdout


@pytest.mark.parametrize("schedule", ["list", "text", "number"])
@pytest.mark.parametrize("further", [False, True])
def test_a_checkpoint_whose_schedule_record_is_not_a_dict_is_one_line(tmp_path: Path, monkeypatch, schedule: str,
                                                                      further: bool) -> None:
    """A checkpoint (re-saved with a valid digest) whose `schedule` is a list, a text or a number:
    `--resume` (of the finished run, or with --max-steps further) ended in a traceback
    ('list' object has no attribute 'get'); it is one line naming the file, exit 2."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run, "--rows", str(random.randint(150, 400)))
    value = {"list": [random.randint(1, 50)], "text": "x" * random.randint(1, 9),
             "number": random.randint(1, 10**6)}[schedule]
    _resaved(run, lambda s: s.update(schedule=value))
    result = _resume(spec, run, *(["--max-steps", "1000"] if further else []))
    assert result.exit_code == 2, result.output
    assert _last_line(result) == f"error: {run / 'checkpoint.pt'} is damaged: schedule is a {type(value).__name__}, " \
                                 f"not the schedule's record"
    assert "Traceback" not in result.output and isinstance(result.exception, SystemExit)


@pytest.mark.parametrize("damage", ["stopped_text", "best_text", "bad_evals_negative"])
def test_a_checkpoint_whose_early_stopping_state_has_wrong_types_is_one_line(tmp_path: Path, monkeypatch,
                                                                             damage: str) -> None:
    """A checkpoint (re-saved with a valid digest) whose early-stopping state holds a text or a negative
    count: `--resume` said a run whose `stopped` was "no" had stopped early (exit 0), and trained on
    with a text as `best` or a negative `bad_evals` into a traceback at its next evaluation; each is
    one line naming the file, exit 2."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path, early=True), tmp_path / "run"
    _train(spec, run, "--epochs", "4")
    edit = {"stopped_text": {"stopped": random.choice(["no", "false", "0"])},
            "best_text": {"best": "x" * random.randint(1, 5), "stopped": False},
            "bad_evals_negative": {"bad_evals": -random.randint(1, 9), "stopped": False}}[damage]
    _resaved(run, lambda s: s["early_stopping"].update(edit))
    result = _resume(spec, run)
    assert result.exit_code == 2, result.output
    assert _last_line(result) == f"error: {run / 'checkpoint.pt'} is damaged: early_stopping state is not one"
    assert "Traceback" not in result.output and "stopped early" not in result.output
