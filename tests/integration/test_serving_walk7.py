"""What a user walking the serving flow (export, predict, load_model, recommend) found: retrieval
items in the type the training rows wrote them."""
from __future__ import annotations


import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.serving.predict import load_model
from package_flow import TWO_TOWER, invoke, ratings, train_and_export

@pytest.mark.parametrize("kind", ["integers", "text"])
def test_recommended_items_come_back_in_the_type_the_training_rows_wrote(tmp_path, kind):
    rng = np.random.default_rng()
    ids = rng.choice(np.arange(100, 100_000), 30, replace=False)
    items = ids if kind == "integers" else np.array([f"m{i:06d}" for i in ids])
    rows = ratings(rng, items)
    root = train_and_export(tmp_path, TWO_TOWER, rows)
    users = pd.DataFrame({"user_id": rng.choice(rows["user_id"].unique(), 4)})
    got = load_model(root / "pkg").recommend(users, 3)
    firsts = [row[0] for row in got["items"]]
    assert all(type(i) is (int if kind == "integers" else str) for row in got["items"] for i in row), firsts
    joined = pd.DataFrame({"item_id": firsts}).merge(rows.drop_duplicates("item_id"), on="item_id")
    assert len(joined) == len(firsts)  # each recommended item joins back to the rows' own item column
    (root / "users.csv").write_text(users.to_csv(index=False))
    result = invoke(["predict", root / "pkg", root / "users.csv", "--format", "csv", "--top-k", 3,
                     "--out", root / "recs.parquet"])
    assert result.exit_code == 0, result.output
    written = pq.read_table(root / "recs.parquet").schema.field("items").type.value_type
    assert written == (pa.int64() if kind == "integers" else pa.string())


RANKING = """
name: rank_walk
features:
  - {name: user_id, type: categorical, vocab: 60, dim: 8}
  - {name: item_id, type: categorical, vocab: 40, dim: 8}
modules:
  - {name: top, kind: mlp, inputs: [user_id, item_id], layers: [8]}
heads:
  - {name: like, input: top, task: binary}
data: {format: csv, label: label}
training: {batch_size: 64, epochs: 1, seed: 0}
"""


def test_asking_a_ranking_package_for_items_says_what_it_scores_in_the_words_of_each_way(tmp_path):
    """recommend on a package of no retrieval head said '--top-k needs ...' to a Python caller, and
    neither said what the package does score."""
    import re

    rng = np.random.default_rng()
    rows = ratings(rng, rng.choice(np.arange(1, 500), 20, replace=False))
    rows["label"] = (rng.random(len(rows)) < 0.3).astype(int)
    root = train_and_export(tmp_path, RANKING, rows)
    model = load_model(root / "pkg")
    with pytest.raises(ValueError) as caught:
        model.recommend(rows[["user_id"]].head(3), 2)
    said = str(caught.value)
    assert "its heads like score rows: model.predict(rows)" in said and "--top-k" not in said, said
    (root / "users.csv").write_text(rows[["user_id", "item_id"]].head(5).to_csv(index=False))
    result = invoke(["predict", root / "pkg", root / "users.csv", "--format", "csv", "--top-k", 2,
                     "--out", root / "recs.parquet"])
    assert result.exit_code == 2 and re.search(r"its heads like score rows\): --top-k needs a package of a "
                                               r"retrieval run; leave --top-k out", result.output), result.output
    assert not (root / "recs.parquet").exists()


@pytest.mark.parametrize("policy", ["fail", "skip"])
def test_keeping_a_text_label_column_says_to_map_it_not_to_skip_rows(tmp_path, policy):
    """predict --keep label of a CSV whose label holds no/yes: each row was malformed, with the hint
    to skip them, which skipped every row."""
    rng = np.random.default_rng()
    rows = ratings(rng, rng.choice(np.arange(1, 500), 20, replace=False))
    rows["label"] = (rng.random(len(rows)) < 0.3).astype(int)
    root = train_and_export(tmp_path, RANKING, rows)
    scored = rows.head(int(rng.integers(5, 50))).assign(label=lambda d: np.where(d["label"] == 1, "yes", "no"))
    (root / "new.csv").write_text(scored.to_csv(index=False))
    result = invoke(["predict", root / "pkg", root / "new.csv", "--format", "csv", "--keep", "label",
                     "--out", root / "scores.parquet", "--on-error", policy])
    assert result.exit_code == 2, result.output
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: --keep label: label column label holds text"), line
    assert "a binary head's label must be 0 or 1; map it before scoring" in line and "--on-error" not in line, line
    assert not (root / "scores.parquet").exists()
