"""Messages a user walk found misleading: text labels, counts of one, close column names."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pytest

from package_flow import invoke

CTR = """
name: ctr_walk
features:
  - {name: user_id, type: categorical, vocab: 60, dim: 8}
  - {name: price, type: dense}
modules:
  - {name: top, kind: mlp, inputs: [user_id, price], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary}
data: {format: csv, label: clk}
training: {batch_size: 64, epochs: 1, seed: 0}
"""


def _clicks(rng: np.random.Generator, n: int, label) -> pd.DataFrame:
    return pd.DataFrame({"user_id": rng.zipf(1.5, n) % 50, "price": rng.gamma(2.0, 3.0, n), "clk": label})


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_a_text_label_column_says_to_map_it_to_numbers_not_to_skip_rows(tmp_path, policy):
    rng = np.random.default_rng()
    n = int(rng.integers(50, 400))
    labels = np.where(rng.random(n) < 0.15, "yes", "no")
    labels[rng.choice(n, 2, replace=False)] = ["yes", "no"]  # both texts: 50 rows were all "no" once in 3,400
    rows = _clicks(rng, n, labels)
    rows.to_csv(tmp_path / "train.csv", index=False)
    (tmp_path / "spec.yaml").write_text(CTR)
    result = invoke(["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "data", "--spec",
                     tmp_path / "spec.yaml", "--on-error", policy])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert lines[0].startswith(f"error: {tmp_path / 'train.csv'}: label column clk holds text"), lines[0]  # which file
    assert "0 or 1" in lines[0] and "map({'no': 0, 'yes': 1})" in lines[0], lines[0]
    assert "--on-error" not in lines[0] and "malformed" not in lines[0], lines[0]
    assert not (tmp_path / "data").exists()


def test_one_text_label_among_numbers_is_still_a_malformed_row_to_skip(tmp_path):
    rng = np.random.default_rng()
    n = int(rng.integers(50, 400))
    labels = (rng.random(n) < 0.2).astype(int).astype(str)
    labels[int(rng.integers(0, n))] = "yes"
    _clicks(rng, n, labels).to_csv(tmp_path / "train.csv", index=False)
    (tmp_path / "spec.yaml").write_text(CTR)
    result = invoke(["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "data", "--spec",
                     tmp_path / "spec.yaml"])
    assert result.exit_code == 2 and "non-numeric value 'yes' in column clk" in result.output, result.output
    assert "--on-error skip" in result.output


def test_ratings_under_a_binary_head_say_to_make_a_0_1_column_not_to_skip_rows(tmp_path):
    """A binary head over a 1-5 rating column said 'use --on-error skip to skip such rows', which
    drops every rating but the 1s; it now asks whether they are ratings or counts and says how to
    make a 0/1 column or which task reads the values. A skip still skips as asked."""
    rng = np.random.default_rng()
    n = int(rng.integers(50, 400))
    ratings = np.minimum(rng.zipf(1.6, n), 5)
    ratings[rng.choice(n, 2, replace=False)] = [1, 4]
    _clicks(rng, n, ratings).to_csv(tmp_path / "train.csv", index=False)
    (tmp_path / "spec.yaml").write_text(CTR)
    result = invoke(["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "data", "--spec",
                     tmp_path / "spec.yaml"])
    assert result.exit_code == 2 and "ratings or counts?" in result.output, result.output
    assert "df['clk'] >= 4" in result.output and "task: regression" in result.output
    assert "--on-error skip" not in result.output
    skipped = invoke(["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "skipped", "--spec",
                      tmp_path / "spec.yaml", "--on-error", "skip"])
    assert skipped.exit_code == 0, skipped.output
    import pyarrow.parquet as pq

    assert pq.read_table(tmp_path / "skipped").num_rows == int((ratings == 1).sum())


SEQ = """
name: close_walk
features:
  - {name: userid, type: categorical, vocab: 60, dim: 8}
  - {name: cate_id, type: categorical, vocab: 60, dim: 8}
  - {name: price, type: dense}
modules:
  - {name: top, kind: mlp, inputs: [userid, cate_id, price], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary}
data: {format: csv, label: clk}
"""


def test_a_missing_column_is_guessed_only_from_a_really_close_name(tmp_path):
    """'cate_id' missing where the input has 'item_id' (ratio 0.71: it was 'is 'cate_id' the input's
    'item_id'?'); 'user_id' for 'userid' is still guessed."""
    from flowrec.serving.predict import close_columns

    rng = np.random.default_rng()
    n = int(rng.integers(20, 200))
    pd.DataFrame({"user_id": rng.zipf(1.5, n) % 50, "item_id": rng.zipf(1.3, n) % 50,
                  "price": rng.gamma(2.0, 3.0, n), "clk": (rng.random(n) < 0.2).astype(int)}
                 ).to_csv(tmp_path / "train.csv", index=False)
    (tmp_path / "spec.yaml").write_text(SEQ)
    result = invoke(["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "data", "--spec",
                     tmp_path / "spec.yaml"])
    assert result.exit_code == 2, result.output
    assert "is 'userid' the input's 'user_id'" in result.output, result.output
    assert "'item_id' (read by" not in result.output, result.output
    said = close_columns(["cate_id", "userid"], ["item_id", "user_id", "rating"])
    assert said == " (the rows have 'user_id': rename it to 'userid'?)", said


def test_a_count_of_one_reads_in_the_singular(tmp_path):
    """'every training label of head ctr (column clk) ... is 0 (1 rows)': counts of one said 'rows'."""
    from types import SimpleNamespace

    from flowrec.cli.predict_cmd import nonfinite_note, zero_note
    from flowrec.runtime.session import label_warnings
    from flowrec.spec.load import load_spec

    rng = np.random.default_rng()
    (tmp_path / "spec.yaml").write_text(CTR)
    _clicks(rng, 1, 0).to_csv(tmp_path / "one.csv", index=False)
    result = invoke(["data", "convert", "csv", tmp_path / "one.csv", tmp_path / "data", "--spec",
                     tmp_path / "spec.yaml", "-q"])
    assert result.exit_code == 0, result.output
    (line,) = label_warnings(load_spec(tmp_path / "spec.yaml"), SimpleNamespace(path=tmp_path / "data"))
    assert "is 0 (1 row): it can only learn to predict 0" in line, line
    inspected = invoke(["data", "inspect", tmp_path / "data"])
    assert inspected.exit_code == 0 and ": 1 row in 1 partition (spec" in inspected.output, inspected.output
    many = int(rng.integers(2, 5000))
    assert nonfinite_note(1, 1, 0).startswith("1 of 1 row has a score"), nonfinite_note(1, 1, 0)
    assert nonfinite_note(2, many, 0).startswith(f"2 of {many:,} rows have a score")
    assert zero_note(1, 1, 0).startswith("1 of 1 row has an all-zero query vector"), zero_note(1, 1, 0)
    rows = _clicks(rng, 1, 1)
    rows["price"] = "inf"  # its one row malformed
    rows.to_csv(tmp_path / "bad.csv", index=False)
    result = invoke(["data", "convert", "csv", tmp_path / "bad.csv", tmp_path / "bad", "--spec",
                     tmp_path / "spec.yaml", "--on-error", "skip"])
    assert result.exit_code == 2 and "its one row was malformed" in result.output, result.output


EVAL_NAN = '''
import torch
from torch import nn


class EvalNan(nn.Module):
    """Finite while training; NaN in evaluation on the rows whose first input is above `above`."""
    def __init__(self, in_features, above):
        super().__init__()
        self.proj = nn.Linear(in_features, 3)
        self.above = above

    def forward(self, x):
        h = self.proj(x)
        if self.training:
            return h
        return torch.where(x[:, :1] > self.above, torch.full_like(h, float("nan")), h)
'''


def _write_evalnan_spec(tmp_path, above: float, seed: int) -> None:
    """spec.yaml (and its class file) of a custom module returning NaN for rows whose x0 > `above`."""
    import yaml

    (tmp_path / "evalnan.py").write_text(EVAL_NAN)
    doc = {"name": "evalnan",
           "features": [{"name": "x0", "type": "dense"}, {"name": "x1", "type": "dense"},
                        {"name": "user", "type": "categorical", "hash_buckets": 300, "dim": 8}],
           "modules": [{"name": "mine", "kind": "custom", "class": f"{tmp_path / 'evalnan.py'}:EvalNan",
                        "inputs": ["@dense", "@sparse"], "params": {"in_features": 10, "above": above}},
                       {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}],
           "training": {"batch_size": 64, "seed": seed}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))


def test_nan_evaluation_scores_name_the_custom_module_that_returned_them(tmp_path):
    """'the model scored NaN for some of the N evaluation rows (a parameter or an input beyond
    float32)' named no module, where training's non-finite loss names it (non_finite_outputs)."""
    rng = np.random.default_rng()
    above = float(rng.uniform(-0.3, 0.3))  # 40 N(0, 1) evaluation rows, some above it and some not
    _write_evalnan_spec(tmp_path, above, int(rng.integers(1 << 20)))
    rows = int(rng.integers(200, 400))
    result = invoke(["train", tmp_path / "spec.yaml", "--rows", rows, "--out", tmp_path / "run", "-q",
                     "--device", "cpu"])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if "scored NaN" in x]
    assert f"(custom module 'mine' ({tmp_path / 'evalnan.py'}:EvalNan) returned non-finite values for " in line, line
    result = invoke(["eval", tmp_path / "run"])
    (again,) = [x for x in result.output.splitlines() if "scored NaN" in x]
    assert "custom module 'mine'" in again, again
    count = again.split("returned non-finite values for ")[1].split(" rows")[0]
    bad, of = (int(n.replace(",", "")) for n in count.split(" of "))
    assert 0 < bad < of, again  # the rows above `above`, not all
    assert invoke(["export", tmp_path / "run", tmp_path / "pkg"]).exit_code == 0
    n = int(rng.integers(20, 200))
    pd.DataFrame({"x0": above + rng.gamma(2.0, 1.0, n) * rng.choice([-1, 1], n), "x1": rng.normal(0, 3, n), "user": rng.zipf(1.5, n) % 300}
                 ).to_csv(tmp_path / "rows.csv", index=False)
    result = invoke(["predict", tmp_path / "pkg", tmp_path / "rows.csv", "--format", "csv", "--out",
                     tmp_path / "scores.parquet"])
    assert result.exit_code == 0, result.output
    (note,) = [x for x in result.output.splitlines() if "not a finite number" in x]
    assert f"or custom module 'mine' ({tmp_path / 'evalnan.py'}:EvalNan) returning NaN" in note, note


def test_python_api_warns_of_nan_scores_and_of_one_class_labels(tmp_path):
    """`flowrec.load(run).evaluate()` and `flowrec.train()` gave NaN metrics without a word where
    `flowrec eval` and `flowrec train` name the custom module that scored NaN (and say why a one-class
    evaluation leaves AUC undefined): the API now warns the same lines."""
    import warnings

    import flowrec

    rng = np.random.default_rng()
    above = float(rng.uniform(-0.3, 0.3))  # 40 N(0, 1) evaluation rows, some above it and some not
    _write_evalnan_spec(tmp_path, above, int(rng.integers(1 << 20)))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flowrec.train(tmp_path / "spec.yaml", rows=int(rng.integers(200, 400)), out=tmp_path / "run", device="cpu")
    (line,) = [str(w.message) for w in caught if "scored NaN" in str(w.message)]
    assert "custom module 'mine'" in line and line.endswith("(NaN in the returned metrics)"), line
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = flowrec.load(tmp_path / "run", device="cpu").evaluate()
    assert np.isnan(metrics["ctr"]["logloss"])
    (line,) = [w for w in caught if "scored NaN" in str(w.message)]
    assert "custom module 'mine'" in str(line.message) and line.filename == __file__, (line.filename, str(line.message))


def test_one_class_lines_say_how_the_caller_shows_an_undefined_metric():
    from flowrec.runtime.evaluation.undefined import PYTHON, undefined_notes

    ones = {"ctr": {"auc": float("nan"), "pr_auc": 0.9, "logloss": 0.3, "samples": 7}}
    (table,) = undefined_notes(ones)
    (python,) = undefined_notes(ones, PYTHON)
    assert table.startswith("ctr: every evaluation label is 1 (7 rows): auc is undefined")
    assert table.endswith("('-' in the table, null in JSON)") and python.endswith("(NaN in the returned metrics)")
