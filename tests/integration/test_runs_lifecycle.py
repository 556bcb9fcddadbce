"""One run lifecycle (`flowrec.runs`): `flowrec train` and `flowrec.train` make the same plan
(the sampled access profile of the data included) and record the same run.json and encoder."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.graph.plan_io import plan_json
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec
from flowrec.testing.specs import run_spec

# a budget below the tables: the cache pass places them from the access profile of the data
SPEC = run_spec("lifecycle", batch_size=64, epochs=1).replace(
    "training: {batch_size: 64", "plan: {device_budget: 6KiB, cache: auto}\ntraining: {batch_size: 64")


def _data(tmp_path: Path, spec: Path) -> Path:
    out = tmp_path / "data"
    result = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", "3000", "--out", str(out),
                                      "--alpha", "1.4", "--seed", "3", "-q"])
    assert result.exit_code == 0, result.output
    return out


def test_cli_and_api_make_the_same_plan_and_run_record(tmp_path: Path) -> None:
    spec = tmp_path / "lifecycle.yaml"
    spec.write_text(SPEC)
    data = _data(tmp_path, spec)
    cli = CliRunner().invoke(app, ["train", str(spec), "--data", str(data), "--out", str(tmp_path / "cli"),
                                   "--max-steps", "4", "--seed", "11", "--eval-every", "0", "-q"])
    assert cli.exit_code == 0, cli.output
    run = flowrec.train(spec, data=data, out=tmp_path / "api", max_steps=4, seed=11, eval_every=0)
    assert run.result.steps == 4
    for name in ("plan.json", "run.json", "encoder/encoder.json"):
        a, b = (tmp_path / "cli" / name), (tmp_path / "api" / name)
        assert a.is_file() and b.is_file(), name
        assert json.loads(a.read_text()) == json.loads(b.read_text()), name
    plan = json.loads((tmp_path / "api" / "plan.json").read_text())
    # the plan was made from a sample of the data, not from the planner's Zipf model
    assert plan != json.loads(plan_json(make_plan(load_spec(spec), target="cpu")))
    recorded = json.loads((tmp_path / "api" / "run.json").read_text())
    assert recorded["data"] == str(data) and recorded["max_steps"] == 4 and recorded["seed"] == 11
    assert recorded["init_from"] is None and recorded["fresh_optimizer"] is False


def _trained_on_split_data(tmp_path: Path, monkeypatch) -> tuple[Path, Any]:
    """The spec and `flowrec train lifecycle.yaml --data d --out run` (3 steps, --json) run in
    `tmp_path` (the working folder after it) on a split synthetic dataset d/train, d/test."""
    spec = tmp_path / "lifecycle.yaml"
    spec.write_text(SPEC)
    for part, rows, seed in (("train", "600", "5"), ("test", "200", "6")):
        synth = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", rows, "--out", str(tmp_path / "d" / part),
                                         "--alpha", "1.4", "--seed", seed, "-q"])
        assert synth.exit_code == 0, synth.output
    monkeypatch.chdir(tmp_path)
    trained = CliRunner().invoke(app, ["train", "lifecycle.yaml", "--data", "d", "--out", "run", "--max-steps", "3",
                                       "--eval-every", "0", "--json", "-q"])
    assert trained.exit_code == 0, trained.output
    return spec, trained


def test_eval_without_data_scores_the_runs_test_part_from_any_folder(tmp_path: Path, monkeypatch) -> None:
    """A run trained on a split dataset named relative to the working folder: run.json records it
    absolute, `flowrec eval RUN` scores its test part (the same metrics as the run's final
    evaluation) from another folder, and --resume given the same relative path is no override."""
    spec, trained = _trained_on_split_data(tmp_path, monkeypatch)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["data"] == str((tmp_path / "d").resolve())
    final = json.loads(trained.stdout)["eval"]
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    scored = CliRunner().invoke(app, ["eval", str(tmp_path / "run"), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    metrics = json.loads(scored.stdout)
    assert set(metrics) == set(final) and final
    for head, values in final.items():
        assert 0.0 < values["auc"] < 1.0 and values["samples"] == 200
        assert {k: metrics[head][k] for k in ("auc", "logloss", "samples")} == \
            {k: values[k] for k in ("auc", "logloss", "samples")}
    monkeypatch.chdir(tmp_path)
    resumed = CliRunner().invoke(app, ["train", "lifecycle.yaml", "--data", "d", "--resume", "run", "--max-steps", "4"])
    assert resumed.exit_code == 0, resumed.output
    assert "--data d overrides" not in resumed.output and "--max-steps 4 overrides" in resumed.output


def test_a_run_whose_older_run_json_records_its_data_relative_is_named_so_from_another_folder(
        tmp_path: Path, monkeypatch) -> None:
    """run.json written before paths were recorded absolute (f803842) holds `"data": "d"`, relative
    to the folder train ran in. From another folder, eval, --resume and Run.evaluate said 'its data
    d is gone' or 'dataset directory not found: d', and export --dtype fp16 compared on random rows
    without a word; now one line says the path is relative to the folder the run was started
    from, and the command run from there works as the line says."""
    from flowrec.data.layout import DataError

    spec, trained = _trained_on_split_data(tmp_path, monkeypatch)
    record = tmp_path / "run" / "run.json"
    older = json.loads(record.read_text())
    older["data"] = "d"  # as a flowrec of before 2026-11-29 wrote it
    older.pop("train_rows", None)
    record.write_text(json.dumps(older, indent=2, sort_keys=True) + "\n")
    before = {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()}
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    for args in (["eval", str(tmp_path / "run")],
                 ["train", str(spec), "--resume", str(tmp_path / "run"), "--max-steps", "4"]):
        refused = CliRunner().invoke(app, args)
        assert refused.exit_code == 2, refused.output
        line = refused.output.strip()
        assert "\n" not in line and "relative to the folder the run was started from" in line, line
        assert "run the command from that folder" in line and "is gone" not in line, line
    try:
        flowrec.load(tmp_path / "run").evaluate()
    except DataError as exc:
        assert "relative to the folder the run was started from" in str(exc) and "data=" in str(exc)
    else:
        raise AssertionError("the run's relative data is not in this folder")
    assert {p.name: p.read_bytes() for p in (tmp_path / "run").iterdir() if p.is_file()} == before
    # export --dtype fp16 compared the scores on random rows instead, without a word
    exported = CliRunner().invoke(app, ["export", str(tmp_path / "run"), str(elsewhere / "pkg"), "--dtype", "fp16"])
    assert exported.exit_code == 0, exported.output
    assert "measured on random rows" in exported.output and "relative to the folder" in exported.output
    monkeypatch.chdir(tmp_path)  # where the line says to run it
    exported = CliRunner().invoke(app, ["export", "run", str(elsewhere / "pkg2"), "--dtype", "fp16"])
    assert exported.exit_code == 0 and "random rows" not in exported.output, exported.output
    scored = CliRunner().invoke(app, ["eval", "run", "--json", "-"])
    assert scored.exit_code == 0, scored.output
    final, metrics = json.loads(trained.stdout)["eval"], json.loads(scored.stdout)
    assert set(metrics) == set(final) and final
    for head, values in final.items():
        assert values["samples"] == 200
        assert {k: metrics[head][k] for k in ("auc", "logloss", "samples")} == \
            {k: values[k] for k in ("auc", "logloss", "samples")}


def test_eval_without_data_of_an_unsplit_run_says_to_give_data(tmp_path: Path) -> None:
    spec = tmp_path / "lifecycle.yaml"
    spec.write_text(SPEC)
    data = _data(tmp_path, spec)
    run = tmp_path / "run"
    trained = CliRunner().invoke(app, ["train", str(spec), "--data", str(data), "--out", str(run), "--max-steps", "2",
                                       "--eval-every", "0", "-q"])
    assert trained.exit_code == 0, trained.output
    scored = CliRunner().invoke(app, ["eval", str(run)])
    assert scored.exit_code == 2
    assert "has no test part" in scored.output and "--data DIR" in scored.output


def test_api_evaluate_without_data_scores_the_runs_evaluation_data(tmp_path: Path) -> None:
    """`Run.evaluate()` scores what `flowrec eval RUN` scores: the run's --eval-data here."""
    from flowrec.data.layout import DataError

    spec = tmp_path / "lifecycle.yaml"
    spec.write_text(SPEC)
    data = _data(tmp_path, spec)
    held = tmp_path / "held"
    synth = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", "300", "--out", str(held),
                                     "--alpha", "1.4", "--seed", "9", "-q"])
    assert synth.exit_code == 0, synth.output
    run = flowrec.train(spec, data=data, eval_data=held, out=tmp_path / "run", max_steps=3, eval_every=0)
    scored = flowrec.load(tmp_path / "run").evaluate()
    head = next(iter(run.metrics))
    assert scored[head]["samples"] == 300 and scored[head]["auc"] == run.metrics[head]["auc"]
    cli = CliRunner().invoke(app, ["eval", str(tmp_path / "run"), "--json", "-"])
    assert cli.exit_code == 0 and json.loads(cli.stdout)[head]["logloss"] == scored[head]["logloss"]
    unsaved = flowrec.train(spec, data=data, out=None, max_steps=2, eval_every=0)
    try:
        unsaved.evaluate()
    except DataError as exc:
        assert "data=" in str(exc)
    else:
        raise AssertionError("a run without a folder has no recorded evaluation data")


def test_a_run_whose_run_json_is_damaged_is_scored_with_data_and_exported(tmp_path: Path, monkeypatch) -> None:
    """flowrec eval RUN of a run whose run.json was damaged said only that the run cannot be
    resumed, and export --dtype fp16 stopped on it; now eval says to give --data (and scores it
    with --data), and export makes the package from the checkpoint, comparing on random rows with
    a word of why."""
    spec, trained = _trained_on_split_data(tmp_path, monkeypatch)
    (tmp_path / "run" / "run.json").write_text("{bad")
    refused = CliRunner().invoke(app, ["eval", "run"])
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip()
    assert "\n" not in line and "run.json is damaged" in line and line.endswith("give --data DIR"), line
    scored = CliRunner().invoke(app, ["eval", "run", "--data", "d/test", "--json", "-"])
    assert scored.exit_code == 0, scored.output
    final = json.loads(trained.stdout)["eval"]
    assert {h: v["auc"] for h, v in json.loads(scored.stdout).items()} == {h: v["auc"] for h, v in final.items()}
    exported = CliRunner().invoke(app, ["export", "run", "pkg", "--dtype", "fp16"])
    assert exported.exit_code == 0, exported.output
    assert "measured on random rows" in exported.output and "run.json, which names that data, is damaged" in \
        exported.output, exported.output
    assert (tmp_path / "pkg" / "manifest.json").is_file()
