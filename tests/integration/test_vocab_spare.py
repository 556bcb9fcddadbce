"""Spare vocabulary rows (`vocab_spare`): new values fill them in order of first appearance when data
is encoded with a run's encoder; the extended encoder is accepted by `--init-from` and recorded in
the child run; the spare rows train; exhaustion goes to row 0 and is reported; a spec without
spare rows behaves as before."""
from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app

SPEC = """
name: spare_test
features:
  - {{name: x, type: dense}}
  - {{name: user, type: categorical, vocab: 10, {spare}dim: 4}}
modules:
  - {{name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [8]}}
heads:
  - {{name: ctr, input: top, task: binary, loss: bce}}
optimizer:
  dense: {{name: adam, lr: 0.01}}
  sparse: {{name: adam, lr: 0.05}}
training: {{batch_size: 8, epochs: 1, seed: 0}}
"""
runner = CliRunner()
OLD_USERS = [f"u{i}" for i in range(10)]


def _csv(path: Path, users: list[str]) -> Path:
    pd.DataFrame({"x": range(len(users)), "user": users,
                  "label": [i % 2 for i in range(len(users))]}).to_csv(path, index=False)
    return path


def _convert(raw: Path, out: Path, spec: Path, *extra: str):
    return runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "-q", *extra])


def _train(spec: Path, out: Path, data: Path, *extra: str):
    return runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(out), "--quiet",
                               "--device", "cpu", *extra])


def _ids(data: Path) -> list[int]:
    return pq.read_table(data).column("user").to_pylist()


def _vocab(data: Path) -> list[str]:
    return pq.read_table(data / "_vocab" / "user.parquet").column("value").to_pylist()


def _fingerprint(folder: Path) -> str:
    if (folder / "encoder" / "encoder.json").is_file():
        return json.loads((folder / "encoder" / "encoder.json").read_text())["fingerprint"]
    return json.loads((folder / "_flowrec.json").read_text())["source"]["encoder"]["fingerprint"]


def _table(run: Path) -> torch.Tensor:
    state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    return next(v for k, v in state.items() if k.startswith("embeddings") and k.endswith(".weight"))


def _setup(root: Path, spare: str) -> dict[str, Path]:
    spec = root / "spec.yaml"
    spec.write_text(SPEC.format(spare=spare))
    assert _convert(_csv(root / "day1.csv", OLD_USERS * 4), root / "d1", spec).exit_code == 0
    run = _train(spec, root / "run1", root / "d1")
    assert run.exit_code == 0, run.output
    return {"root": root, "spec": spec, "run1": root / "run1"}


@pytest.fixture(scope="module")
def day1(tmp_path_factory) -> dict[str, Path]:
    return _setup(tmp_path_factory.mktemp("spare"), "vocab_spare: 5, ")


def test_the_table_has_its_spare_rows_from_the_first_run(day1):
    assert _table(day1["run1"]).shape[0] == 10 + 1 + 5


def test_new_values_fill_spare_rows_in_order_of_first_appearance(day1):
    root = day1["root"]
    raw = _csv(root / "order.csv", ["u3", "n2", "u1", "n1", "n2", "n3", "u9", "n1"])
    made = _convert(raw, root / "d_order", day1["spec"], "--encoder-from", str(day1["run1"]))
    assert made.exit_code == 0, made.output
    assert "table user: 3 new values in spare rows (rows 11..13; 2 free rows left)" in made.stdout
    assert _vocab(root / "d_order") == OLD_USERS + ["n2", "n1", "n3"]
    assert _ids(root / "d_order") == [4, 11, 2, 12, 11, 13, 10, 12]


def test_exhausted_spare_rows_send_the_rest_to_row_0_and_say_so(day1):
    root = day1["root"]
    raw = _csv(root / "many.csv", ["n6", "n5", "n4", "n3", "n2", "n1", "n0", "n1", "u0"])
    made = _convert(raw, root / "d_many", day1["spec"], "--encoder-from", str(day1["run1"]))
    assert made.exit_code == 0, made.output
    assert "5 new values in spare rows (rows 11..15; 0 free rows left)" in made.stdout
    assert "spare rows exhausted: 2 more new values (3 occurrences) went to row 0" in made.stdout
    assert _ids(root / "d_many") == [11, 12, 13, 14, 15, 0, 0, 0, 1]


@pytest.fixture(scope="module")
def day2(day1) -> dict[str, Path]:
    root, spec = day1["root"], day1["spec"]
    raw = _csv(root / "day2.csv", ["u3", "n2", "u1", "n1"] * 6)
    assert _convert(raw, root / "d2", spec, "--encoder-from", str(day1["run1"])).exit_code == 0
    run = _train(spec, root / "run2", root / "d2", "--init-from", str(day1["run1"]))
    assert run.exit_code == 0, run.output
    return dict(day1, d2=root / "d2", run2=root / "run2")


def test_init_from_accepts_the_extension_records_it_and_trains_the_spare_rows(day2):
    assert _fingerprint(day2["d2"]) != _fingerprint(day2["run1"])
    assert _fingerprint(day2["run2"]) == _fingerprint(day2["d2"])
    child_vocab = pq.read_table(day2["run2"] / "encoder" / "vocab" / "user.parquet").column("value").to_pylist()
    assert child_vocab == OLD_USERS + ["n2", "n1"]
    parent, child = _table(day2["run1"]), _table(day2["run2"])
    assert not torch.equal(child[11], parent[11]) and not torch.equal(child[12], parent[12])
    assert torch.equal(child[13:], parent[13:])  # still free: never looked up
    evaluated = runner.invoke(app, ["eval", str(day2["run1"]), "--data", str(day2["d2"]), "--json", "-",
                                    "--device", "cpu"])
    assert evaluated.exit_code == 0, evaluated.output  # the parent may score the extended data


def test_the_child_encoder_extends_further_for_the_next_day(day2):
    root, spec = day2["root"], day2["spec"]
    raw = _csv(root / "day3.csv", ["n9", "n1", "u0", "n2"] * 2)
    assert _convert(raw, root / "d3", spec, "--encoder-from", str(day2["run2"])).exit_code == 0
    assert _vocab(root / "d3") == OLD_USERS + ["n2", "n1", "n9"]
    run = _train(spec, root / "run3", root / "d3", "--init-from", str(day2["run2"]), "--max-steps", "1")
    assert run.exit_code == 0, run.output


def test_an_extension_of_another_branch_is_refused(day2, tmp_path):
    spec = day2["spec"]
    raw = _csv(tmp_path / "other.csv", ["n7", "u1"] * 4)  # run1 extended with n7 in row 11: run2 has n2 there
    assert _convert(raw, tmp_path / "other", spec, "--encoder-from", str(day2["run1"])).exit_code == 0
    refused = _train(spec, tmp_path / "r", tmp_path / "other", "--init-from", str(day2["run2"]))
    errors = [line for line in refused.stderr.splitlines() if line.startswith("error:")]
    assert refused.exit_code == 2 and len(errors) == 1, refused.output
    assert "feature 'user' differs in its vocabulary (not the model's vocabulary extended" in errors[0]


def test_a_different_encoder_is_still_refused_with_one_line(day1, tmp_path):
    spec = day1["spec"]
    assert _convert(_csv(tmp_path / "own.csv", ["n1", "u2", "u3"] * 5), tmp_path / "own", spec).exit_code == 0
    result = _train(spec, tmp_path / "r", tmp_path / "own", "--init-from", str(day1["run1"]))
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "feature 'user' differs in its vocabulary" in errors[0] and not (tmp_path / "r" / "checkpoint.pt").exists()


def test_no_grow_keeps_the_run_encoder(day1, tmp_path):
    raw = _csv(tmp_path / "day2.csv", ["u3", "n2", "u1"])
    made = _convert(raw, tmp_path / "d", day1["spec"], "--encoder-from", str(day1["run1"]), "--no-grow")
    assert made.exit_code == 0, made.output
    assert "spare rows" not in made.stdout and _ids(tmp_path / "d") == [4, 0, 2]
    assert _fingerprint(tmp_path / "d") == _fingerprint(day1["run1"])


def test_without_vocab_spare_new_values_go_to_row_0_as_before(tmp_path):
    plain = _setup(tmp_path, "")
    assert _table(plain["run1"]).shape[0] == 11
    raw = _csv(tmp_path / "day2.csv", ["u3", "n2", "u1", "n1"] * 4)
    made = _convert(raw, tmp_path / "d2", plain["spec"], "--encoder-from", str(plain["run1"]))
    assert made.exit_code == 0 and "spare rows" not in made.stdout
    assert _ids(tmp_path / "d2")[:4] == [4, 0, 2, 0] and _vocab(tmp_path / "d2") == OLD_USERS
    assert _fingerprint(tmp_path / "d2") == _fingerprint(plain["run1"])
    encoder = json.loads((plain["run1"] / "encoder" / "encoder.json").read_text())
    assert "spare" not in encoder["features"]["user"]


def test_the_encoder_of_a_synthetic_run_cannot_encode_raw_rows(day1, tmp_path):
    run = runner.invoke(app, ["train", str(day1["spec"]), "--rows", "64", "--out", str(tmp_path / "synth"),
                              "--quiet", "--device", "cpu"])
    assert run.exit_code == 0, run.output
    made = _convert(_csv(tmp_path / "raw.csv", ["u1"] * 4), tmp_path / "d", day1["spec"], "--encoder-from",
                    str(tmp_path / "synth"))
    errors = [line for line in made.stderr.splitlines() if line.startswith("error:")]
    assert made.exit_code == 2 and len(errors) == 1, made.output
    # refused as a synthetic run's encoder (cbfaa32), before its tables' missing vocabularies
    assert "holds the encoder of synthetic data" in errors[0] and "--encoder-from" in errors[0]
    assert not (tmp_path / "d").exists()
