"""Daily incremental training: `split_by` a timestamp column, `train --init-from RUN` (parent's
parameters and encoder, recorded in run.json), and refusals as one line with exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.dataset as ds
import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app

SPEC = """
name: inc_test
features:
  - {name: ts, type: dense}
  - {name: user, type: categorical, vocab: 400, dim: 8}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.05}
training: {batch_size: 64, epochs: 1, seed: 0}
"""
runner = CliRunner()


def _raw(path: Path, rows: int, seed: int, start: int) -> Path:
    rng = np.random.default_rng(seed)
    user = rng.zipf(1.2, rows) % 300
    pd.DataFrame({"ts": start + rng.permutation(rows), "user": [f"u{u}" for u in user],
                  "label": (user % 2 == 0).astype(int)}).to_csv(path, index=False)
    return path


def _convert(raw: Path, out: Path, spec: Path, *extra: str):
    return runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "-q", *extra])


def _train(spec: Path, out: Path, data: Path, *extra: str):
    return runner.invoke(app, ["train", str(spec), "--data", str(data), "--eval-data", str(data), "--out", str(out),
                               "--quiet", "--device", "cpu", *extra])


@pytest.fixture(scope="module")
def day1(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("inc")
    spec = root / "spec.yaml"
    spec.write_text(SPEC)
    assert _convert(_raw(root / "day1.csv", 2000, 0, 0), root / "d1", spec).exit_code == 0
    run = _train(spec, root / "run1", root / "d1")
    assert run.exit_code == 0, run.output
    return {"root": root, "spec": spec, "run1": root / "run1"}


def test_split_by_puts_the_newest_rows_in_test(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "data: {format: csv, path: x, options: {split_by: ts, test_fraction: 0.25}}\n")
    made = _convert(_raw(tmp_path / "raw.csv", 1000, 3, 10_000), tmp_path / "d", spec)
    assert made.exit_code == 0, made.output
    train = ds.dataset(tmp_path / "d" / "train", format="parquet").to_table().column("ts").to_numpy()
    test = ds.dataset(tmp_path / "d" / "test", format="parquet").to_table().column("ts").to_numpy()
    assert len(test) == 250 and len(train) == 750
    assert train.max() < test.min() == 10_750
    meta = json.loads((tmp_path / "d" / "test" / "_flowrec.json").read_text())
    assert meta["split"]["split_by"] == "ts" and meta["split"]["cutoff"] == 10_750


def test_split_by_a_missing_column_is_one_line(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "data: {format: csv, path: x, options: {split_by: when, test_fraction: 0.25}}\n")
    made = _convert(_raw(tmp_path / "raw.csv", 100, 3, 0), tmp_path / "d", spec)
    assert made.exit_code == 2 and "split_by: column 'when'" in made.stderr and not (tmp_path / "d").exists()


def test_split_by_rows_without_a_time_are_malformed_rows_not_training_rows(tmp_path):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "data: {format: csv, path: x, options: {split_by: ts, test_fraction: 0.25}}\n")
    raw = pd.read_csv(_raw(tmp_path / "raw.csv", 1000, 3, 10_000))
    raw.loc[[5, 700], "ts"] = None
    raw.to_csv(tmp_path / "raw.csv", index=False)
    refused = _convert(tmp_path / "raw.csv", tmp_path / "d", spec)
    lines = refused.stderr.strip().splitlines()
    assert refused.exit_code == 2 and len(lines) == 1, refused.output
    assert "raw.csv:7: no time in column ts" in lines[0] and not (tmp_path / "d").exists()
    skipped = _convert(tmp_path / "raw.csv", tmp_path / "d", spec, "--on-error", "skip")
    assert skipped.exit_code == 0 and "skipped 2 malformed rows" in skipped.stderr, skipped.output
    train = ds.dataset(tmp_path / "d" / "train", format="parquet").to_table().column("ts").to_numpy()
    test = ds.dataset(tmp_path / "d" / "test", format="parquet").to_table().column("ts").to_numpy()
    assert len(train) + len(test) == 998 and np.isfinite(train).all()


def test_split_by_a_column_of_text_times_orders_them_as_text(tmp_path):
    """Taobao's time_stamp ('2017-05-06 00:00:00') under split_by was read as a number: every row
    was malformed ('non-numeric value', use --on-error skip), so no split by time was possible."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "data: {format: csv, path: x, options: {split_by: when, test_fraction: 0.25}}\n")
    raw = pd.read_csv(_raw(tmp_path / "raw.csv", 400, 3, 0))
    raw["when"] = [f"2017-05-{6 + t // 100:02d} {t % 24:02d}:00:{t % 60:02d}" for t in raw["ts"]]
    raw.loc[7, "when"] = None
    raw.to_csv(tmp_path / "raw.csv", index=False)
    made = _convert(tmp_path / "raw.csv", tmp_path / "d", spec, "--on-error", "skip")
    assert made.exit_code == 0 and "skipped 1 malformed row " in made.stderr, made.output
    meta = json.loads((tmp_path / "d" / "test" / "_flowrec.json").read_text())
    assert meta["split"]["split_by"] == "when" and meta["split"]["cutoff"] == "2017-05-09 00:00:00"
    ts = {side: ds.dataset(tmp_path / "d" / side, format="parquet").to_table().column("ts").to_numpy()
          for side in ("train", "test")}
    kept = raw.drop(index=7)
    assert sorted(ts["test"]) == sorted(kept.loc[kept["when"] >= "2017-05-09 00:00:00", "ts"])
    assert len(ts["test"]) + len(ts["train"]) == 399 and ts["train"].max() < 300 <= ts["test"].min()


def _tables(run: Path) -> torch.Tensor:
    state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    return next(v for k, v in state.items() if k.endswith(".weight") and k.startswith("embeddings"))


def test_init_from_continues_the_parent_and_records_it(day1):
    root, spec = day1["root"], day1["spec"]
    made = _convert(_raw(root / "day2.csv", 300, 1, 2000), root / "d2", spec, "--encoder-from", str(day1["run1"]))
    assert made.exit_code == 0, made.output
    run = _train(spec, root / "run2", root / "d2", "--init-from", str(day1["run1"]), "--max-steps", "1")
    assert run.exit_code == 0, run.output
    fresh = _train(spec, root / "fresh", root / "d2", "--max-steps", "1", "--seed", "7")
    assert fresh.exit_code == 0, fresh.output
    parent, child, scratch = _tables(day1["run1"]), _tables(root / "run2"), _tables(root / "fresh")
    same_rows = (child == parent).all(dim=1).float().mean().item()  # rows the one step did not touch
    assert same_rows > 0.5 and (scratch == parent).all(dim=1).float().mean().item() < 0.01
    recorded = json.loads((root / "run2" / "run.json").read_text())
    assert recorded["init_from"] == str(day1["run1"]) and recorded["fresh_optimizer"] is False
    parent_encoder = json.loads((day1["run1"] / "encoder" / "encoder.json").read_text())
    child_encoder = json.loads((root / "run2" / "encoder" / "encoder.json").read_text())
    assert child_encoder["fingerprint"] == parent_encoder["fingerprint"]


def test_fresh_optimizer_keeps_parameters_and_resets_the_sparse_state(day1):
    root, spec = day1["root"], day1["spec"]
    made = _convert(_raw(root / "day2b.csv", 300, 1, 2000), root / "d2b", spec, "--encoder-from", str(day1["run1"]))
    assert made.exit_code == 0, made.output
    run = _train(spec, root / "run2b", root / "d2b", "--init-from", str(day1["run1"]), "--fresh-optimizer",
                 "--max-steps", "1")
    assert run.exit_code == 0, run.output
    state = torch.load(root / "run2b" / "checkpoint.pt", weights_only=True)["model"]
    parent = torch.load(day1["run1"] / "checkpoint.pt", weights_only=True)["model"]
    key = next(k for k in state if k.startswith("embeddings") and k.endswith(".state"))
    assert (state[key] != 0).sum() < (parent[key] != 0).sum()  # only the rows of one batch have state


def test_init_from_refusals_are_one_line(day1, tmp_path):
    root, spec = day1["root"], day1["spec"]
    assert _convert(_raw(tmp_path / "own.csv", 300, 2, 2000), tmp_path / "own", spec).exit_code == 0
    cases = {
        "another_encoder": (_train(spec, tmp_path / "r1", tmp_path / "own", "--init-from", str(day1["run1"])),
                            "another encoder"),
        "no_parent": (_train(spec, tmp_path / "r2", tmp_path / "own", "--init-from", str(tmp_path / "none")),
                      "--init-from: no checkpoint at"),
        "fresh_alone": (_train(spec, tmp_path / "r3", tmp_path / "own", "--fresh-optimizer"),
                        "--fresh-optimizer applies to --init-from"),
    }
    for name, (result, fragment) in cases.items():
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and fragment in errors[0], (name, result.output)


LOOP = """
  eval_every: 2
  schedule: {warmup_steps: 0, decay: linear}
  early_stopping: {metric: auc, patience: 1, min_delta: 1.0}
"""


def test_init_from_starts_a_loop_of_its_own(day1, tmp_path):
    """A run started from another has its own early stopping and schedule: the parent's early
    stopping state made the child of an early-stopped run stop at step 0 (training nothing, naming
    a best/ it never wrote), and the parent's schedule length decayed the child's learning rate
    over the parent's epochs instead of its own."""
    from flowrec.runtime.run_log import read_records

    spec = tmp_path / "loop.yaml"
    spec.write_text(SPEC.replace("training: {batch_size: 64, epochs: 1, seed: 0}",
                                 "training:\n  batch_size: 64\n  epochs: 1\n  seed: 0" + LOOP))
    data = day1["root"] / "d1"  # 2,000 rows: 32 steps an epoch
    parent = _train(spec, tmp_path / "parent", data, "--epochs", "30")
    assert parent.exit_code == 0, parent.output
    end = [r for r in read_records(tmp_path / "parent" / "metrics.jsonl") if r["event"] == "end"][-1]
    assert end["stopped_early"] and end["step"] == 4  # no evaluation beats the first by 1.0 AUC
    child = _train(spec, tmp_path / "child", data, "--init-from", str(tmp_path / "parent"), "--epochs", "2")
    assert child.exit_code == 0, child.output
    records = read_records(tmp_path / "child" / "metrics.jsonl")
    end = [r for r in records if r["event"] == "end"][-1]
    assert end["stopped_early"] and end["step"] == 4 and end["best_step"] == 2
    assert (tmp_path / "child" / "best" / "checkpoint.pt").is_file()
    lr = {r["step"]: r["lr_dense"] for r in records if r["event"] == "train"}
    assert lr[4] == pytest.approx(0.01 * (1 - 3 / 64), rel=1e-12)  # over the child's 2 epochs, not 30


def test_split_by_a_column_of_one_time_says_so_not_change_split_seed(tmp_path):
    """Avazu's sample (one hour, 14102100, in every row) under split_by: hour left the train side
    empty, and the line said 'change test_fraction or split_seed', neither of which can help."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC + "data: {format: csv, path: x, options: {split_by: hour, test_fraction: 0.2}}\n")
    raw = pd.read_csv(_raw(tmp_path / "raw.csv", 100, 3, 0)).assign(hour=14102100)
    raw.to_csv(tmp_path / "raw.csv", index=False)
    made = _convert(tmp_path / "raw.csv", tmp_path / "d", spec)
    line = made.stderr.strip()
    assert made.exit_code == 2 and "\n" not in line, made.output
    assert "every row's hour is at or after the cutoff 14102100 " in line and "split_seed" not in line, line
    assert not (tmp_path / "d").exists() and not any(p.name.startswith(".d.partial") for p in tmp_path.iterdir())
