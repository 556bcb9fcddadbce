"""One run lifecycle (`flowrec.runs`): `flowrec train` and `flowrec.train` make the same plan
(the sampled access profile of the data included) and record the same run.json and encoder."""
from __future__ import annotations

import json
from pathlib import Path

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
