"""`flowrec eval RUN --group-by F` with a feature gAUC cannot group by (unknown, dense, multi-hot,
a sequence) loaded the whole run (a checkpoint of GBs) before refusing it; it is refused in one
line from the run's spec.json, before the checkpoint is read."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.serving import trained as trained_module

SPEC = """\
name: grouped
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 500, dim: 8}
  - {name: item, type: categorical, table: items}
  - {name: genres, type: categorical, hash_buckets: 30, dim: 8, max_len: 4, pooling: mean}
  - {name: history, type: sequence, table: items, max_len: 5, pooling: mean}
tables:
  - {name: items, hash_buckets: 800, dim: 8}
modules:
  - {name: deep, kind: mlp, inputs: ["@sparse", "@dense"], layers: [16]}
heads:
  - {name: ctr, input: deep, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.001}
  sparse: {name: adagrad, lr: 0.05}
training: {batch_size: 128, epochs: 1, seed: 0, precision: fp32}
"""
runner = CliRunner()


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("grouped")
    (work / "spec.yaml").write_text(SPEC)
    seed = str(random.randrange(1 << 30))  # fresh Zipf-skewed synthetic rows each time
    done = runner.invoke(app, ["train", str(work / "spec.yaml"), "--rows", "900", "--seed", seed,
                               "--out", str(work / "run"), "-q"])
    assert done.exit_code == 0, done.output
    return work / "run"


@pytest.fixture
def loads(monkeypatch) -> list[Path]:
    calls: list[Path] = []
    load = trained_module.load_trained

    def counted(run, *args, **kwargs):
        calls.append(Path(run))
        return load(run, *args, **kwargs)

    monkeypatch.setattr(trained_module, "load_trained", counted)
    return calls


@pytest.mark.parametrize("feature, why", [("nosuch", "has no feature 'nosuch'"), ("usr", "did you mean 'user'"),
                                          ("price", "'price' is a dense feature"),
                                          ("genres", "'genres' is a multi-hot categorical feature of up to 4"),
                                          ("history", "'history' is a sequence of up to 5")])
def test_a_feature_gauc_cannot_group_by_is_one_line_before_the_checkpoint_is_read(run, loads, feature, why):
    for where in (run, run / "checkpoint.pt"):
        done = runner.invoke(app, ["eval", str(where), "--group-by", feature, "--json", "-"])
        assert done.exit_code == 2, done.output
        lines = done.output.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: --group-by") and why in lines[0], done.output
        assert "user, item" in lines[0]  # the features it can group by
    assert loads == []


@pytest.mark.parametrize("feature", ["user", "item"])
def test_a_one_id_categorical_feature_still_groups(run, loads, feature):
    done = runner.invoke(app, ["eval", str(run), "--group-by", feature, "--json", "-"])
    assert done.exit_code == 0, done.output
    assert 0.0 <= json.loads(done.stdout)["ctr"]["gauc"] <= 1.0
    assert loads == [run]
