"""A retrieval run through export and predict: the package's query tower, items and index give
each user the same top-k items as the trained model's exact full-catalogue scores.

MovieLens 100K, specs/two_tower_movielens.yaml trained 40 steps through the CLI; exported with
the exact (torch) search and, when faiss is installed, with a faiss flat index."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
import yaml
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource
from flowrec.data.encoder_record import read_vocab
from flowrec.runtime.retrieval import catalogue_vectors
from flowrec.serving.retrieval_index import faiss_module
from operators.retrieval import pair_scores, towers

K = 10
USERS = [1, 2, 7, 42, 99, 500, 943]


@pytest.fixture(scope="module")
def run(tmp_path_factory, repo=Path(__file__).resolve().parents[2]):
    from tests.conftest import SHARED_DATA

    data = SHARED_DATA / "movielens-100k"
    if not (data / "u.data").is_file():
        pytest.skip(f"MovieLens 100K not found at {data}")
    root = tmp_path_factory.mktemp("retrieval")
    doc = yaml.safe_load((repo / "specs" / "two_tower_movielens.yaml").read_text())
    doc["data"]["path"] = str(data)
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    result = CliRunner().invoke(app, ["train", str(root / "spec.yaml"), "--out", str(root / "run"), "--quiet",
                                      "--device", "cpu", "--max-steps", "40"])
    assert result.exit_code == 0, result.output
    return root


def reference_top_k(run_dir: Path, users: list[int]) -> tuple[list[list[str]], np.ndarray]:
    """The trained model's own exact top-k: query vectors of the users' rows through the lowered
    model and the staged-batch path, scored against every catalogue item's vector."""
    from flowrec import api
    from flowrec.data.encoder_record import load_encoder

    loaded = api.load(run_dir, device="cpu")
    model, spec, record = loaded.trained.model, loaded.spec, loaded.trained.encoder
    raw = pa.table({"user_id": [str(u) for u in users], "item_id": pa.nulls(len(users), pa.string())})
    encoded = load_encoder(record, spec).encode(raw, labels=False)
    encoded = encoded.append_column("label", pa.array(np.zeros(len(users), np.float32)))
    opts = StagingOptions(batch_size=len(users), shuffle=False, workers=1)
    with iterate_batches(spec, MemorySource([encoded]), opts, groups=model.groups) as it:
        batch = next(iter(it))
    model.eval()
    with torch.no_grad():
        query, _ = towers(model(batch))
        scores = pair_scores(query, catalogue_vectors(model, model.retrieval), "dot", 1.0)
        best = torch.topk(scores, K, dim=1)
    vocab = read_vocab(Path(record.vocab_files["item_id"])).to_pylist()
    # MovieLens's item ids are integers: the package gives them as ints (the vocabulary holds text)
    return [[int(vocab[r]) for r in row] for row in best.indices.tolist()], best.values.numpy()


@pytest.mark.parametrize("index", ["exact", "faiss"])
def test_predict_top_k_equals_the_models_exact_top_k(run, tmp_path, index):
    if index == "faiss" and faiss_module() is None:
        pytest.skip("faiss-cpu not installed (the ann extra)")
    runner = CliRunner()
    pkg = tmp_path / "pkg"
    result = runner.invoke(app, ["export", str(run / "run"), str(pkg), "--index", index])
    assert result.exit_code == 0, result.output
    manifest = json.loads((pkg / "manifest.json").read_text())
    entry = manifest["retrieval"]
    assert entry["index"]["kind"] == ("faiss_flat_ip" if index == "faiss" else "exact")
    assert (entry["metric"], entry["items"], entry["dim"]) == ("dot", 1682, 32)
    assert (pkg / "items.faiss").is_file() == (index == "faiss") and "items.parquet" in manifest["files"]
    pd.DataFrame({"user_id": USERS}).to_csv(tmp_path / "users.csv", index=False)
    result = runner.invoke(app, ["predict", str(pkg), str(tmp_path / "users.csv"), "--format", "csv",
                                 "--top-k", str(K), "--out", str(tmp_path / "recs.parquet"), "--keep", "user_id"])
    assert result.exit_code == 0, result.output
    recs = pd.read_parquet(tmp_path / "recs.parquet")
    assert [int(u) for u in recs["user_id"]] == USERS and all(len(r) == K for r in recs["items"])
    items, scores = reference_top_k(run / "run", USERS)
    got_scores = np.stack(recs["scores"].to_list())
    np.testing.assert_allclose(got_scores, scores, rtol=1e-5, atol=1e-6)
    for got, want in zip(recs["items"], items):
        assert set(got) == set(want)  # the same items (order can swap only between equal scores)
    assert len({tuple(r) for r in recs["items"]}) > 1  # users get different lists


def test_recommendations_of_a_dataframe_keep_its_index(run, tmp_path):
    """A DataFrame's recommendations carry its index (as `predict`'s scores), so they align on it."""
    from flowrec.serving.predict import load_model

    result = CliRunner().invoke(app, ["export", str(run / "run"), str(tmp_path / "pkg")])
    assert result.exit_code == 0, result.output
    model = load_model(tmp_path / "pkg")
    users = pd.DataFrame({"user_id": [str(u) for u in USERS]}, index=[70 + 3 * i for i in range(len(USERS))])
    recs = model.recommend(users, 3)
    assert recs.index.equals(users.index)
    alone = model.recommend(users.iloc[[2]], 3)
    assert alone.index.tolist() == [users.index[2]] and alone["items"].iloc[0] == recs["items"].loc[users.index[2]]


def test_a_mismatched_index_is_refused(run, tmp_path):
    from flowrec.serving.predict import load_model

    pkg = tmp_path / "pkg"
    assert CliRunner().invoke(app, ["export", str(run / "run"), str(pkg), "--index", "exact"]).exit_code == 0
    model = load_model(pkg)
    with pytest.raises(ValueError, match="retrieval package"):
        model.predict(pd.DataFrame({"user_id": [1]}))
    manifest = json.loads((pkg / "manifest.json").read_text())
    manifest["retrieval"]["metric"] = "cosine"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="metric 'cosine' is not the model's"):
        load_model(pkg)
    manifest["retrieval"]["metric"] = "dot"
    manifest["retrieval"]["index"]["kind"] = "hnsw"
    (pkg / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match="index kind 'hnsw'"):
        load_model(pkg)
