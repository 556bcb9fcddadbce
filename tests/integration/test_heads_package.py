"""Heads with a sample weight, a task space and a multiclass task, from raw CSV to `predict`:
`data convert` carries the weight column, `train` and `eval --json` report each head's metrics
(accuracy@k for the multiclass head, the conversion head on clicked rows only), and the package
scores one probability per binary head and one per class of the multiclass head."""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from package_flow import train_and_export

CLASSES = 4
SPEC = f"""
name: heads_pkg
features:
  - {{name: price, type: dense, transform: standardize}}
  - {{name: user, type: categorical, vocab: 60, dim: 8}}
  - {{name: city, type: categorical, hash_buckets: 50, dim: 8}}
modules:
  - {{name: bottom, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16]}}
  - {{name: ctr_tower, kind: mlp, inputs: [bottom], layers: [8]}}
  - {{name: cvr_tower, kind: mlp, inputs: [bottom], layers: [8]}}
heads:
  - {{name: click, input: ctr_tower, label: click}}
  - {{name: conversion, input: cvr_tower, label: conv, sample_weight: w, trained_where: {{label: click, equals: 1}}}}
  - {{name: segment, input: bottom, task: multiclass, num_classes: {CLASSES}, label: segment, weight: 0.5}}
optimizer:
  dense: {{name: adam, lr: 0.01}}
  sparse: {{name: adam, lr: 0.05}}
training: {{batch_size: 128, epochs: 2, seed: 0}}
"""
runner = CliRunner()


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    user = rng.zipf(1.3, rows) % 80
    price = rng.lognormal(2.0, 1.0, rows)
    logit = np.where(user % 3 == 0, 1.5, -1.0) - 0.1 * price
    click = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    conv = click * (rng.random(rows) < 0.4).astype(int)
    return pd.DataFrame({"price": price, "user": [f"u{u}" for u in user], "city": rng.integers(0, 500, rows),
                         "click": click, "conv": conv, "segment": user % CLASSES,
                         "w": rng.uniform(0.5, 2.0, rows)})


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = tmp_path_factory.mktemp("headspkg")
    return train_and_export(root, SPEC, raw_rows(2000, 0))


def test_eval_json_reports_each_head(run):
    scored = runner.invoke(app, ["eval", str(run / "run"), "--data", str(run / "data"), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    metrics = json.loads(scored.stdout)
    raw = raw_rows(2000, 0)
    assert metrics["click"]["samples"] == 2000 and 0.5 < metrics["click"]["auc"] <= 1.0
    assert metrics["conversion"]["samples"] == int(raw["click"].sum())
    segment = metrics["segment"]
    assert segment["samples"] == 2000 and segment["k"] == min(5, CLASSES - 1)  # never every class
    assert segment["accuracy"] > 1.0 / CLASSES + 0.1  # the segment follows the user id
    assert segment["accuracy"] < segment["accuracy_at_k"] <= 1.0


def test_predict_gives_per_head_outputs(run):
    from flowrec.serving.predict import load_model

    model = load_model(run / "pkg")
    scores = model.predict(raw_rows(300, 1).drop(columns=["click", "conv", "segment", "w"]))
    assert list(scores.columns) == ["click", "conversion", "segment"] and len(scores) == 300
    assert scores["click"].between(0, 1).all() and scores["conversion"].between(0, 1).all()
    classes = np.stack(scores["segment"].to_numpy())
    assert classes.shape == (300, CLASSES)
    np.testing.assert_allclose(classes.sum(axis=1), 1.0, rtol=1e-5)


@pytest.mark.parametrize("suffix", [".csv", ".tsv"])
def test_text_scores_of_a_multiclass_head_are_refused_naming_the_head_not_a_keep_column(run, tmp_path, suffix):
    """A multiclass head's scores are a list a row; `--out scores.csv` was refused at the first chunk
    as `--keep segment: ...` though the user gave no --keep, so the message sent them to a flag they
    never used."""
    raw = tmp_path / "rows.csv"
    raw_rows(50, 3).drop(columns=["click", "conv", "segment", "w"]).to_csv(raw, index=False)
    out = tmp_path / f"scores{suffix}"
    result = runner.invoke(app, ["predict", str(run / "pkg"), str(raw), "--format", "csv", "--out", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert "head segment" in result.output and "--keep" not in result.output
    assert len(result.output.strip().splitlines()) == 1 and not out.exists()
