"""A SASRec-style retrieval package (an attention encoder over the history is the whole query
tower) asked for items of rows whose history is empty: their query vector is all zeros, every item
scores 0 and their top-k items are arbitrary. `flowrec predict --top-k` said nothing; now it counts
them and names the first, and `LoadedModel.recommend` counts them (`zero_queries`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.serving.predict import load_model
from package_flow import train_and_export

SPEC = """
name: seq_recommend
features:
  - {name: item_id, type: categorical, table: items}
  - {name: history, type: sequence, table: items, max_len: 6, pooling: none, truncate: last}
tables:
  - {name: items, vocab: 60, dim: 8}
modules:
  - {name: encoder, kind: self_attention, inputs: [history], num_heads: 1, num_layers: 1, causal: true,
     output: last}
  - {name: score, kind: similarity, inputs: [encoder, item_id], metric: dot}
heads:
  - {name: next_item, input: score, task: retrieval, negatives: {kind: in_batch}, top_k: [5]}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 1, seed: 0}
"""


def _rows(rows: int, seed: int, empty_every: int = 0) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.5, rows), 9)  # skewed lengths, none empty
    if empty_every:
        lengths[::empty_every] = 0
    history = ["^".join(str(v) for v in rng.zipf(1.3, n) % 50 + 1) for n in lengths]
    return pd.DataFrame({"item_id": rng.zipf(1.3, rows) % 50 + 1, "history": history, "label": 1,
                         "user": np.arange(rows)})


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return train_and_export(tmp_path_factory.mktemp("seqrec"), SPEC, _rows(800, 0))


def test_rows_with_an_empty_history_are_counted_and_named(root, tmp_path):
    raw = _rows(40, 1, empty_every=7)  # rows 0, 7, 14, ... have no history
    empty = int((raw["history"] == "").sum())
    model = load_model(root / "pkg")
    recs = model.recommend(raw.drop(columns=["label"]), 5)
    assert model.zero_queries == empty and model.first_zero_query == 0
    assert np.all(np.stack(recs["scores"])[raw["history"] == ""] == 0)
    assert np.any(np.stack(recs["scores"])[raw["history"] != ""] != 0)
    (tmp_path / "later.csv").write_text(raw.iloc[1:].drop(columns=["label"]).to_csv(index=False))
    result = CliRunner().invoke(app, ["predict", str(root / "pkg"), str(tmp_path / "later.csv"), "--format", "csv",
                                      "--top-k", "5", "--out", str(tmp_path / "recs.parquet"), "--keep", "user", "-q"])
    assert result.exit_code == 0, result.output
    assert (f"warning: {empty - 1} of 39 rows have an all-zero query vector (e.g. an empty history, or ids the "
            "model holds no row for; the first is row 6 of the output, from 0)") in result.stderr
    written = pq.read_table(tmp_path / "recs.parquet").to_pandas()
    assert str(written["user"].iloc[6]) == "7" and len(written) == 39


def test_no_warning_when_every_row_has_a_history(root, tmp_path):
    (tmp_path / "users.csv").write_text(_rows(30, 2).drop(columns=["label"]).to_csv(index=False))
    result = CliRunner().invoke(app, ["predict", str(root / "pkg"), str(tmp_path / "users.csv"), "--format", "csv",
                                      "--top-k", "5", "--out", str(tmp_path / "recs.parquet"), "-q"])
    assert result.exit_code == 0, result.output
    assert "all-zero query" not in result.stderr
