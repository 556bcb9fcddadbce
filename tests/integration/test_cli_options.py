"""Options that every command shares or mirrors: --version, -q, plan --cache, train --profile;
and that evaluation being skipped is said, not silent."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec import __version__
from flowrec.cli import app

runner = CliRunner()

SPEC = """
name: opts
features:
  - {name: d1, type: dense}
  - {name: user, type: categorical, hash_buckets: 300, dim: 8}
  - {name: item, type: categorical, hash_buckets: 900, dim: 8}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", user, item], layers: [8]}
heads:
  - {name: ctr, input: top}
optimizer: {dense: {name: adam, lr: 0.01}, sparse: {name: adagrad, lr: 0.1}}
training: {batch_size: 128, epochs: 1}
"""


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "opts.yaml"
    path.write_text(SPEC)
    return path


def test_version() -> None:
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"flowrec {__version__}"


def test_plan_cache_sets_the_policy_and_refuses_unknown_ones(spec: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["plan", str(spec), "--cache", "none", "--device-budget", "40KiB",
                                 "--json", str(out), "-q"])
    assert result.exit_code == 0, result.output
    assert result.stdout == ""  # -q: only the file
    placements = {g["placement"] for g in json.loads(out.read_text())["groups"]}
    assert placements == {"host"}  # auto would place it static_hot with this budget
    bad = runner.invoke(app, ["plan", str(spec), "--cache", "lookahed"])
    assert bad.exit_code == 2 and "--cache must be one of auto, none, static_hot, lookahead" in bad.output


def test_train_profile_reaches_the_planner_and_quiet_commands(spec: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "2000", "--out", str(data), "-q"])
    assert made.exit_code == 0 and made.stdout == ""
    prof = tmp_path / "prof.json"
    profiled = runner.invoke(app, ["data", "profile", str(spec), str(data), "--sample-rate", "1.0",
                                   "--json", str(prof), "-q"])
    assert profiled.exit_code == 0 and profiled.stdout == ""
    run = tmp_path / "run"
    trained = runner.invoke(app, ["train", str(spec), "--data", str(data), "--profile", str(prof), "--out", str(run),
                                  "--max-steps", "3", "-q"])
    assert trained.exit_code == 0, trained.output
    assert json.loads((run / "run.json").read_text())["profile"] == str(prof)
    assert "no evaluation set" in trained.output  # the data has no test split: said, not silent
    broken = tmp_path / "broken.json"
    broken.write_text("{}")
    refused = runner.invoke(app, ["train", str(spec), "--data", str(data), "--profile", str(broken),
                                  "--out", str(tmp_path / "run2"), "-q"])
    assert refused.exit_code == 2 and "not a flowrec-access-profile" in refused.output
    exported = runner.invoke(app, ["export", str(run), str(tmp_path / "pkg"), "-q"])
    assert exported.exit_code == 0 and exported.stdout == ""
    scored = runner.invoke(app, ["eval", str(run), "--data", str(data), "-q", "--json", str(tmp_path / "m.json")])
    assert scored.exit_code == 0 and scored.stdout == ""
    assert json.loads((tmp_path / "m.json").read_text())["ctr"]["samples"] == 2000


def test_early_stopping_without_evaluations_is_refused(spec: Path, tmp_path: Path) -> None:
    path = tmp_path / "es.yaml"
    path.write_text(SPEC.replace("training: {batch_size: 128, epochs: 1}",
                                 "training: {batch_size: 128, epochs: 1, early_stopping: {metric: auc}}"))
    result = runner.invoke(app, ["train", str(path), "--rows", "500", "--out", str(tmp_path / "r"), "-q"])
    assert result.exit_code == 2 and "needs evaluations during training" in result.output
    assert not (tmp_path / "r" / "checkpoint.pt").exists()


def test_missing_tensorboard_is_one_line(spec: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrec.runtime import run_log as metrics

    monkeypatch.setattr(metrics, "tensorboard_available", lambda: False)
    result = runner.invoke(app, ["train", str(spec), "--rows", "300", "--out", str(tmp_path / "r"), "-q"])
    assert result.exit_code == 0, result.output
    lines = [line for line in result.output.splitlines() if "TensorBoard" in line]
    assert lines == ["TensorBoard is not installed: metrics go to metrics.jsonl only "
                     "(pip install 'flowrec[tensorboard]' to also log them for TensorBoard)"]


def test_tensorboard_tags_of_log_records() -> None:
    from flowrec.runtime.run_log import tensorboard_scalars

    train = {"event": "train", "step": 3, "epoch": 0, "loss": 0.5, "lr_dense": 0.1, "lr_sparse": 0.2,
             "skipped": True}
    assert dict(tensorboard_scalars(train)) == {"train/loss": 0.5, "train/lr_dense": 0.1, "train/lr_sparse": 0.2}
    evaluation = {"event": "eval", "step": 3, "final": False,
                  "metrics": {"ctr": {"auc": 0.7, "gauc": None, "samples": 10}, "dwell": {"mse": 2.0}}}
    assert dict(tensorboard_scalars(evaluation)) == {"eval/ctr/auc": 0.7, "eval/dwell/mse": 2.0}


def test_training_on_the_train_part_of_a_split_names_its_test_part(spec: Path, tmp_path: Path) -> None:
    """`--data DIR/train` of a converted split said 'the data has no test split ...; give
    --eval-data DIR to evaluate', while DIR/test lay beside it: it names that folder, and DIR for
    both parts. A dataset without a test part beside it is said as before."""
    import numpy as np

    rng = np.random.default_rng()
    n = int(rng.integers(300, 600))
    rows = "".join(f"{rng.lognormal():.4f},u{int(rng.zipf(1.3))},i{int(rng.zipf(1.2))},{int(rng.random() < 0.25)}\n"
                   for _ in range(n))
    (tmp_path / "rows.csv").write_text("d1,user,item,label\n" + rows)
    data = tmp_path / "split"
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "rows.csv"), str(data), "--spec", str(spec),
                               "--test-fraction", "0.2", "-q"])
    assert made.exit_code == 0, made.output
    trained = runner.invoke(app, ["train", str(spec), "--data", str(data / "train"), "--out", str(tmp_path / "r1"),
                                  "--max-steps", "2", "-q"])
    assert trained.exit_code == 0, trained.output
    assert (f"evaluation is skipped; give --eval-data {data / 'test'} (the test part beside {data / 'train'}), "
            f"or --data {data} for both parts") in " ".join(trained.output.split()), trained.output
    (data / "test").rename(tmp_path / "elsewhere")
    alone = runner.invoke(app, ["train", str(spec), "--data", str(data / "train"), "--out", str(tmp_path / "r2"),
                                "--max-steps", "2", "-q"])
    assert alone.exit_code == 0 and "give --eval-data DIR to evaluate" in alone.output, alone.output
