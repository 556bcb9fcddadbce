"""Messages a user walk found misleading: text labels, counts of one, close column names."""
from __future__ import annotations

from pathlib import Path

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
    rows = _clicks(rng, n, np.where(rng.random(n) < 0.15, "yes", "no"))
    rows.to_csv(tmp_path / "train.csv", index=False)
    (tmp_path / "spec.yaml").write_text(CTR)
    result = invoke(["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "data", "--spec",
                     tmp_path / "spec.yaml", "--on-error", policy])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "label column clk holds text" in lines[0] and "0 or 1" in lines[0], lines[0]
    assert "map({'no': 0, 'yes': 1})" in lines[0], lines[0]
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
