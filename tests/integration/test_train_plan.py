"""`flowrec train --plan`: a saved, edited plan runs exactly; the run folder's plan.json is the plan
that ran; eval, export and resume read the stored plan instead of planning again."""
from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint

SPEC = """
name: plan_edit
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 3000, dim: 8}
  - {name: item, type: categorical, hash_buckets: 2000, dim: 8}
  - {name: cat, type: categorical, vocab: 40, dim: 4}
  - {name: hist, type: sequence, vocab: 500, dim: 4, max_len: 4, pooling: sum}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense"], layers: [8]}
  - {name: top, kind: mlp, inputs: [bottom, user, item, cat, hist], layers: [16]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 128, epochs: 1, seed: 5}
"""

runner = CliRunner()


def _placements(doc: dict) -> dict[str, tuple[str, int]]:
    return {g["name"]: (g["placement"], g["cache_rows"]) for g in doc["groups"]}


def test_edited_plan_trains_as_written_and_is_stored(tmp_path: Path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    planned = runner.invoke(app, ["plan", str(spec), "--device-budget", "40KiB", "--json", str(tmp_path / "p.json")])
    assert planned.exit_code == 0, planned.output
    doc = json.loads((tmp_path / "p.json").read_text())
    first, second = doc["groups"][0]["name"], doc["groups"][1]["name"]
    doc["groups"][0].update(placement="host", cache_rows=0)
    doc["groups"][1].update(placement="static_hot", cache_rows=50)
    (tmp_path / "p.json").write_text(json.dumps(doc))

    run = tmp_path / "run"
    args = ["train", str(spec), "--plan", str(tmp_path / "p.json"), "--rows", "1500", "--out", str(run), "--quiet"]
    trained = runner.invoke(app, args)
    assert trained.exit_code == 0, trained.output
    ran = json.loads((run / "plan.json").read_text())
    assert _placements(ran)[first] == ("host", 0) and _placements(ran)[second] == ("static_hot", 50)
    assert ran["passes"][-1]["name"] == "edit"
    assert json.loads(load_checkpoint(run)["plan"]) == ran

    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "600", "--out", str(data)]).exit_code == 0
    scored = runner.invoke(app, ["eval", str(run), "--data", str(data), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    assert 0.0 < json.loads(scored.stdout)["ctr"]["auc"] < 1.0
    exported = runner.invoke(app, ["export", str(run), str(tmp_path / "pkg")])
    assert exported.exit_code == 0, exported.output
    served = json.loads((tmp_path / "pkg" / "plan.json").read_text())
    assert _placements(served)[first] == ("host", 0)


def test_plan_and_budget_together_and_foreign_plans_are_refused(tmp_path: Path, repo: Path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    other = tmp_path / "other.json"
    assert runner.invoke(app, ["plan", str(repo / "specs" / "movielens.yaml"), "--json", str(other)]).exit_code == 0
    foreign = runner.invoke(app, ["train", str(spec), "--plan", str(other), "--out", str(tmp_path / "r1")])
    assert foreign.exit_code == 2 and "different model" in foreign.stderr and "Traceback" not in foreign.output
    both = runner.invoke(app, ["train", str(spec), "--plan", str(other), "--device-budget", "1MiB",
                               "--out", str(tmp_path / "r2")])
    assert both.exit_code == 2 and "--device-budget and --plan" in both.stderr
    assert not (tmp_path / "r1" / "checkpoint.pt").exists()
    # --target beside --plan was ignored without a word (the run's plan priced for the plan's target)
    both = runner.invoke(app, ["train", str(spec), "--plan", str(other), "--target", "h100",
                               "--out", str(tmp_path / "r3")])
    assert both.exit_code == 2 and "--target and --plan" in both.stderr, both.output
    assert not (tmp_path / "r3" / "checkpoint.pt").exists()
    # so was --cache (the plan's groups kept their placements)
    both = runner.invoke(app, ["train", str(spec), "--plan", str(other), "--cache", "lookahead",
                               "--out", str(tmp_path / "r4")])
    assert both.exit_code == 2 and "--cache and --plan" in both.stderr, both.output
    assert not (tmp_path / "r4" / "checkpoint.pt").exists()


def test_flags_that_make_a_plan_are_refused_where_a_run_trains_a_stored_one(tmp_path: Path):
    """--resume (from a checkpoint) trains the run's plan and --init-from the parent's: --plan,
    --device-budget, --cache, --profile and --target were ignored without a word (--resume even said
    '--device-budget 1MiB overrides the run's default'); now one line naming them, exit 2. A flag
    given on --resume as recorded is no change."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC)
    run = tmp_path / "run"
    base = ["train", str(spec), "--rows", "600", "--quiet"]
    assert runner.invoke(app, [*base, "--cache", "none", "--out", str(run)]).exit_code == 0
    plan = (run / "plan.json").read_bytes()
    child = runner.invoke(app, [*base, "--init-from", str(run), "--device-budget", "1MiB", "--cache", "lookahead",
                                "--out", str(tmp_path / "child")])
    assert child.exit_code == 2, child.output
    assert child.stderr.splitlines() == [f"error: --init-from {run} trains that run's plan: --device-budget, --cache "
                                         "would not change it; leave them out, or start a new run without --init-from"]
    assert not (tmp_path / "child").exists()
    again = runner.invoke(app, [*base, "--resume", str(run), "--epochs", "2", "--target", "h100"])
    assert again.exit_code == 2 and "--resume continues the run with the plan it was trained with" in again.stderr
    assert "--target would not change it" in again.stderr, again.output
    same = runner.invoke(app, [*base, "--resume", str(run), "--epochs", "2", "--cache", "none"])  # as recorded
    assert same.exit_code == 0, same.output
    assert (run / "plan.json").read_bytes() == plan
