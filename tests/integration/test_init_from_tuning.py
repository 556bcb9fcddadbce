"""Fine-tuning with `train --init-from RUN`: a spec that differs from RUN's in training settings
alone (learning rates, optimizer hyper-parameters and kinds, dropout, batch size) starts from RUN's
weights; one that changes the weights' layout is refused in one line naming what differs."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app

SPEC = """
name: tune_test
features:
  - {name: price, type: dense}
  - {name: user, type: categorical, vocab: 400, dim: 8}
  - {name: item, type: categorical, vocab: 300, dim: 8}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16, 8], dropout: <DROP>}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: <DENSE>, lr: <LR_DENSE>, beta1: <BETA1>}
  sparse: {name: <SPARSE>, lr: <LR_SPARSE>}
training: {batch_size: <BATCH>, epochs: 1, seed: 3}
"""
BASE = {"DROP": "0.1", "DENSE": "adam", "LR_DENSE": "0.01", "BETA1": "0.9", "LR_SPARSE": "0.05", "BATCH": "64",
        "SPARSE": "rowwise_adagrad"}
runner = CliRunner()


def _spec(path: Path, **changes: str) -> Path:
    text = SPEC
    for key, value in {**BASE, **changes}.items():
        text = text.replace(f"<{key}>", value)
    if "sgd" in text:
        text = text.replace(", beta1: 0.9", "").replace(", beta1: 0.8", "")
    path.write_text(text)
    return path


def _train(spec: Path, out: Path, data: Path, *extra: str):
    return runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(out), "--quiet",
                               "--device", "cpu", *extra])


@pytest.fixture(scope="module")
def parent(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tune")
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rows = 1500
    user, item = rng.zipf(1.3, rows) % 350, rng.zipf(1.6, rows) % 250
    pd.DataFrame({"price": rng.lognormal(2.0, 1.0, rows), "user": [f"u{u}" for u in user],
                  "item": [f"i{i}" for i in item], "label": ((user + item) % 3 == 0).astype(int)}
                 ).to_csv(root / "raw.csv", index=False)
    spec = _spec(root / "spec.yaml")
    made = runner.invoke(app, ["data", "convert", "csv", str(root / "raw.csv"), str(root / "d"), "--spec", str(spec),
                               "-q"])
    assert made.exit_code == 0, made.output
    run = _train(spec, root / "run", root / "d")
    assert run.exit_code == 0, run.output
    return {"root": root, "run": root / "run", "data": root / "d"}


def test_init_from_with_a_lower_lr_and_other_dropout_starts_from_the_runs_weights(parent, tmp_path, monkeypatch):
    from flowrec.runtime.run_log import read_records
    from flowrec.runtime.trainer import Trainer

    started: list[dict] = []
    fit = Trainer.fit

    def watched(self, *args, **kwargs):
        started.append({k: v.detach().clone() for k, v in self.model.state_dict().items()})
        return fit(self, *args, **kwargs)

    monkeypatch.setattr(Trainer, "fit", watched)
    spec = _spec(tmp_path / "tune.yaml", LR_DENSE="0.005", LR_SPARSE="0.025", DROP="0.3", BETA1="0.8", BATCH="32")
    child = _train(spec, tmp_path / "child", parent["data"], "--init-from", str(parent["run"]), "--max-steps", "3")
    assert child.exit_code == 0, child.output
    assert "lr" in child.stderr and "dropout" in child.stderr  # the note names the settings that differ
    saved = torch.load(parent["run"] / "checkpoint.pt", weights_only=True)
    assert len(started) == 1 and set(started[0]) <= set(saved["model"])
    for key, value in started[0].items():  # the first step starts from the run's weights, exactly
        assert torch.equal(value, saved["model"][key]), key
    records = [r for r in read_records(tmp_path / "child" / "metrics.jsonl") if r["event"] == "train"]
    assert records and all(r["lr_dense"] == 0.005 and r["lr_sparse"] == 0.025 for r in records)
    mine = torch.load(tmp_path / "child" / "checkpoint.pt", weights_only=True)
    groups = mine["dense_optimizer"]["param_groups"]
    assert all(g["betas"][0] == 0.8 for g in groups)  # the spec's hyper-parameters, not the run's 0.9
    steps = {float(s["step"]) for s in mine["dense_optimizer"]["state"].values()}
    trained = {float(s["step"]) for s in saved["dense_optimizer"]["state"].values()}
    assert steps == {t + 3 for t in trained}  # the run's adam state carried on


def test_init_from_with_another_optimizer_kind_starts_its_state_fresh_and_says_so(parent, tmp_path):
    """The dense optimizer's kind changed, and the dropout gone (the run's model held a dropout step
    count, the new one none: it was refused as 'model missing noise_steps' the other way round)."""
    spec = _spec(tmp_path / "sgd.yaml", DENSE="sgd", DROP="0", SPARSE="adagrad")
    child = _train(spec, tmp_path / "child", parent["data"], "--init-from", str(parent["run"]), "--max-steps", "1")
    assert child.exit_code == 0, child.output
    notes = [line for line in child.stderr.splitlines() if "starts fresh" in line]
    assert len(notes) == 1 and "sgd in the spec, adam in the run" in notes[0], child.output
    assert "table 'item' is adagrad in the spec, rowwise_adagrad in the run" in notes[0], notes[0]
    assert "noise_steps" not in torch.load(tmp_path / "child" / "checkpoint.pt", weights_only=True)["model"]


def test_init_from_a_run_without_dropout_with_dropout_trains(parent, tmp_path):
    plain = _spec(tmp_path / "plain.yaml", DROP="0")
    run = _train(plain, tmp_path / "plain", parent["data"], "--max-steps", "2")
    assert run.exit_code == 0, run.output
    spec = _spec(tmp_path / "drop.yaml", DROP="0.25", LR_DENSE="0.002")
    child = _train(spec, tmp_path / "child", parent["data"], "--init-from", str(tmp_path / "plain"), "--max-steps", "2")
    assert child.exit_code == 0, child.output
    state = torch.load(tmp_path / "child" / "checkpoint.pt", weights_only=True)["model"]
    assert int(state["noise_steps"]) == 2  # its own dropout steps


@pytest.mark.parametrize("change,named", [({"SPEC_DIM": "16"}, "dim"), ({"LAYERS": "[16, 4]"}, "layers")])
def test_init_from_with_another_layout_is_still_refused_naming_it(parent, tmp_path, change, named):
    spec = _spec(tmp_path / "other.yaml", LR_DENSE="0.005")
    text = spec.read_text()
    if "SPEC_DIM" in change:
        text = text.replace("vocab: 300, dim: 8", "vocab: 300, dim: 16")
    else:
        text = text.replace("layers: [16, 8]", "layers: [16, 4]")
    spec.write_text(text)
    refused = _train(spec, tmp_path / "child", parent["data"], "--init-from", str(parent["run"]))
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.exit_code == 2 and len(errors) == 1 and named in errors[0], refused.output
    assert "differs from the one the run" in errors[0] and not (tmp_path / "child" / "checkpoint.pt").exists()


def test_init_from_with_other_settings_is_planned_with_the_runs_plan_flags(parent, tmp_path):
    """A run started with --device-budget and --cache (flags refused with --init-from) is planned
    anew for a spec of other training settings as it was planned: with the same budget and cache,
    not the defaults (its tables went from the host to the device)."""
    import json

    spec = _spec(tmp_path / "spec.yaml")
    run = _train(spec, tmp_path / "small", parent["data"], "--max-steps", "2", "--device-budget", "4KiB",
                 "--cache", "static_hot")
    assert run.exit_code == 0, run.output
    tuned = _spec(tmp_path / "tuned.yaml", LR_DENSE="0.003", BATCH="48")
    child = _train(tuned, tmp_path / "child", parent["data"], "--init-from", str(tmp_path / "small"), "--max-steps", "2")
    assert child.exit_code == 0, child.output

    def placements(folder: Path) -> list:
        return [(g["name"], g["placement"]) for g in json.loads((folder / "plan.json").read_text())["groups"]]

    assert placements(tmp_path / "child") == placements(tmp_path / "small") and \
        {p for _, p in placements(tmp_path / "small")} == {"host"}


BLOCK = '''import torch
class Blk(torch.nn.Module):
    def __init__(self, in_features, out_features):
        super().__init__()
        self.lin = torch.nn.Linear(in_features, out_features)
    def forward(self, x):
        return torch.relu(self.lin(x)) * <SCALE>
'''
CUSTOM = """
name: tune_custom
features:
  - {name: price, type: dense}
  - {name: user, type: categorical, hash_buckets: 500, dim: 8}
modules:
  - {name: mine, kind: custom, class: "<FILE>:Blk", inputs: ["@dense", "@sparse"], params: {in_features: 9, out_features: 6}}
  - {name: top, kind: mlp, inputs: [mine], layers: [4]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: <LR>}
  sparse: {name: rowwise_adagrad, lr: 0.05}
training: {batch_size: 64, epochs: 1, seed: <SEED>}
"""


def test_init_from_with_a_lower_lr_after_the_class_file_moved_starts_from_the_run(tmp_path):
    """A run's custom class file moved (the same content under another path) was known as the same
    model by --resume and by --init-from of an unchanged spec, but --init-from with a lower lr
    named the class path as a model change and refused; now the lr is the only difference noted."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    scale, seed = f"{rng.uniform(0.5, 2.0):.4f}", str(int(rng.integers(1 << 20)))
    (tmp_path / "old").mkdir(), (tmp_path / "new").mkdir()
    (tmp_path / "old" / "blk.py").write_text(BLOCK.replace("<SCALE>", scale))

    def spec(name: str, where: str, lr: str) -> Path:
        path = tmp_path / name
        path.write_text(CUSTOM.replace("<FILE>", str(tmp_path / where / "blk.py")).replace("<LR>", lr)
                        .replace("<SEED>", seed))
        return path

    rows = str(int(rng.integers(300, 600)))
    done = runner.invoke(app, ["train", str(spec("a.yaml", "old", "0.01")), "--rows", rows, "--out",
                               str(tmp_path / "run"), "--quiet", "--device", "cpu"])
    assert done.exit_code == 0, done.output
    (tmp_path / "old" / "blk.py").rename(tmp_path / "new" / "blk.py")
    tuned = runner.invoke(app, ["train", str(spec("b.yaml", "new", "0.002")), "--rows", rows, "--init-from",
                                str(tmp_path / "run"), "--out", str(tmp_path / "tuned"), "--device", "cpu"])
    assert tuned.exit_code == 0, tuned.output
    (moved,) = [line for line in tuned.output.splitlines() if "has the content of" in line]
    assert str(tmp_path / "new" / "blk.py") in moved and str(tmp_path / "old" / "blk.py") in moved, moved
    (changed,) = [line for line in tuned.output.splitlines() if "training settings differ" in line]
    assert "optimizer.dense.lr 0.01 in the run, 0.002 in the spec" in changed and ".class" not in changed, changed
    # another content under the new path is another model, refused naming the class file
    (tmp_path / "new" / "blk.py").write_text(BLOCK.replace("<SCALE>", f"{float(scale) + 1:.4f}"))
    other = runner.invoke(app, ["train", str(spec("b.yaml", "new", "0.002")), "--rows", rows, "--init-from",
                                str(tmp_path / "run"), "--out", str(tmp_path / "other"), "--device", "cpu"])
    assert other.exit_code == 2 and "modules[mine].class" in other.output, other.output
    assert not (tmp_path / "other").exists()
