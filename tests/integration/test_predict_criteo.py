"""`flowrec predict` on Criteo TSV rows with and without the label column (Criteo's test files are
the train layout minus the label): the same rows score the same, their AUC equals `flowrec eval` on
the rows converted with `--encoder-from`, and a file of another layout is one line with exit 2."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.run_log import auc

SPEC = """
name: criteo_predict
features:
  - {name: I1, type: dense, transform: log1p}
  - {name: I2, type: dense, transform: log1p}
  - {name: C1, type: categorical, hash_buckets: 64, dim: 8}
  - {name: C2, type: categorical, vocab: 40, dim: 8}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 2, seed: 0}
data: {format: criteo_tsv, path: unused}
"""
runner = CliRunner()


def _rows(n: int, seed: int) -> list[list[str]]:
    """Criteo-layout rows (label, I1..I13, C1..C26) whose label follows C1, C2 and I1."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        c1, c2, i1 = int(rng.zipf(1.3)) % 90, int(rng.zipf(1.4)) % 60, int(rng.integers(0, 50))
        p = 1 / (1 + np.exp(-((c1 % 3 == 0) * 1.5 + (c2 % 2) - 0.03 * i1)))
        ints = [str(i1), "" if rng.random() < 0.2 else str(int(rng.integers(0, 9)))] + ["1"] * 11
        cats = [f"{c1:08x}", f"{c2:08x}"] + ["" for _ in range(24)]
        out.append([str(int(rng.random() < p))] + ints + cats)
    return out


def _write(path: Path, rows: list[list[str]], label: bool = True) -> Path:
    path.write_text("".join("\t".join(r if label else r[1:]) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def criteo(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("criteo_predict")
    spec = root / "spec.yaml"
    spec.write_text(SPEC)
    made = runner.invoke(app, ["data", "convert", "criteo", str(_write(root / "train.tsv", _rows(3000, 0))),
                               str(root / "data"), "--spec", str(spec), "-q"])
    assert made.exit_code == 0, made.output
    run = runner.invoke(app, ["train", str(spec), "--data", str(root / "data"), "--out", str(root / "run"),
                              "--quiet", "--device", "cpu"])
    assert run.exit_code == 0, run.output
    exported = runner.invoke(app, ["export", str(root / "run"), str(root / "pkg")])
    assert exported.exit_code == 0, exported.output
    new = _rows(800, 1)
    return {"root": root, "spec": spec, "run": root / "run", "pkg": root / "pkg", "labels": [int(r[0]) for r in new],
            "with_label": _write(root / "day.tsv", new), "without_label": _write(root / "test.txt", new, False)}


def _predict(pkg: Path, raw: Path, out: Path, *extra: str):
    return runner.invoke(app, ["predict", str(pkg), str(raw), "--out", str(out), "-q", *extra])


def test_rows_without_the_label_score_as_the_same_rows_with_it(criteo):
    root = criteo["root"]
    plain = _predict(criteo["pkg"], criteo["without_label"], root / "test_scores.parquet")
    assert plain.exit_code == 0, plain.output
    labelled = _predict(criteo["pkg"], criteo["with_label"], root / "day_scores.parquet", "--keep", "label")
    assert labelled.exit_code == 0, labelled.output
    without = pq.read_table(root / "test_scores.parquet").to_pandas()
    with_label = pq.read_table(root / "day_scores.parquet").to_pandas()
    assert list(without.columns) == ["ctr"] and len(without) == 800
    np.testing.assert_array_equal(without["ctr"].to_numpy(), with_label["ctr"].to_numpy())
    assert with_label["label"].astype(int).tolist() == criteo["labels"]

    made = runner.invoke(app, ["data", "convert", "criteo", str(criteo["with_label"]), str(root / "day"),
                               "--spec", str(criteo["spec"]), "--encoder-from", str(criteo["run"]), "-q"])
    assert made.exit_code == 0, made.output
    scored = runner.invoke(app, ["eval", str(criteo["run"]), "--data", str(root / "day"), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    expected = json.loads(scored.stdout)["ctr"]["auc"]
    assert auc(np.array(criteo["labels"], float), without["ctr"].to_numpy()) == pytest.approx(expected, abs=1e-6)


def test_a_label_column_asked_for_from_a_test_file_is_one_line(criteo, tmp_path):
    result = _predict(criteo["pkg"], criteo["without_label"], tmp_path / "s.parquet", "--keep", "label")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1 and "--keep label: no such column" in errors[0]
    assert not (tmp_path / "s.parquet").exists()


def test_another_layout_is_one_line_and_mixed_rows_are_malformed(criteo, tmp_path):
    short = tmp_path / "short.tsv"
    short.write_text("1\t2\t3\n")
    result = _predict(criteo["pkg"], short, tmp_path / "s.parquet")
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.exit_code == 2 and len(errors) == 1, result.output
    assert "line 1 has 3 tab-separated fields; Criteo rows have 40 (label first) or 39" in errors[0]
    rows = _rows(5, 2)
    mixed = tmp_path / "mixed.txt"
    mixed.write_text("".join("\t".join(r[1:]) + "\n" for r in rows[:3]) + "\t".join(rows[3]) + "\n")
    result = _predict(criteo["pkg"], mixed, tmp_path / "m.parquet")
    assert result.exit_code == 2 and "mixed.txt:4: wrong field count (40, expected 39)" in result.stderr
    skipped = _predict(criteo["pkg"], mixed, tmp_path / "m.parquet", "--on-error", "skip")
    assert skipped.exit_code == 0 and pq.read_table(tmp_path / "m.parquet").num_rows == 3


def test_blank_lines_before_the_first_row_are_skipped_as_convert_skips_them(criteo, tmp_path):
    """The layout was read from line 1 even when blank: a file starting with a blank line (or CRLF
    one) was refused as 'line 1 has 0 tab-separated fields', though convert reads it; an empty or
    all-blank file said the same instead of that it holds no rows."""
    rows = _rows(20, 3)
    body = "".join("\t".join(r[1:]) + "\n" for r in rows)
    (tmp_path / "plain.txt").write_text(body)
    (tmp_path / "blank.txt").write_bytes(b"\n\r\n" + body.encode())
    plain = _predict(criteo["pkg"], tmp_path / "plain.txt", tmp_path / "plain.parquet")
    blank = _predict(criteo["pkg"], tmp_path / "blank.txt", tmp_path / "blank.parquet")
    assert plain.exit_code == 0 and blank.exit_code == 0, blank.output
    np.testing.assert_array_equal(pq.read_table(tmp_path / "blank.parquet")["ctr"].to_numpy(),
                                  pq.read_table(tmp_path / "plain.parquet")["ctr"].to_numpy())
    (tmp_path / "short.txt").write_text("\n\n1\t2\t3\n")
    short = _predict(criteo["pkg"], tmp_path / "short.txt", tmp_path / "s.parquet")
    assert short.exit_code == 2 and "short.txt: line 3 has 3 tab-separated fields" in short.stderr
    for name, text in (("empty.txt", ""), ("blanks.txt", "\n\r\n\n")):
        (tmp_path / name).write_text(text)
        result = _predict(criteo["pkg"], tmp_path / name, tmp_path / "e.parquet")
        errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
        assert result.exit_code == 2 and len(errors) == 1 and f"{name} holds no rows" in errors[0], result.output
        assert not (tmp_path / "e.parquet").exists()


def test_rows_whose_label_is_empty_score_as_the_labelled_rows(criteo, tmp_path):
    """Scoring ignores the label, but a row with an empty label field (a day whose clicks are not
    known yet) was refused as 'missing value in required column label'; now it scores as the
    labelled row, and its kept label is missing."""
    rows = _rows(30, 4)
    unlabelled = [r.copy() for r in rows]
    for r in unlabelled[::3]:
        r[0] = ""
    labelled = _predict(criteo["pkg"], _write(tmp_path / "day.tsv", rows), tmp_path / "a.parquet")
    blank = _predict(criteo["pkg"], _write(tmp_path / "blank.tsv", unlabelled), tmp_path / "b.parquet",
                     "--keep", "label")
    assert labelled.exit_code == 0 and blank.exit_code == 0, blank.output
    scores = pq.read_table(tmp_path / "b.parquet").to_pandas()
    np.testing.assert_array_equal(scores["ctr"].to_numpy(), pq.read_table(tmp_path / "a.parquet")["ctr"].to_numpy())
    assert scores["label"].isna().tolist() == [i % 3 == 0 for i in range(30)]
    made = runner.invoke(app, ["data", "convert", "criteo", str(tmp_path / "blank.tsv"), str(tmp_path / "ds"),
                               "--spec", str(criteo["spec"]), "-q"])
    assert made.exit_code == 2 and "blank.tsv:1: missing value in required column label" in made.stderr
