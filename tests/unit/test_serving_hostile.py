"""Hostile and careless input to the serving and evaluation of the newer heads: a retrieval package
whose manifest or items were tampered with is refused with one line (its manifest is not
digest-checked, so every retrieval field is checked against the spec and the items), never a
traceback or silently different scores; `flowrec eval` options that cannot apply are refused.

One two-tower run on synthetic data (exclude_seen, grouped by user), exported with the exact search."""
from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from flowrec.data.layout import DataError
from flowrec.serving.predict import load_model
from package_flow import invoke

SPECS = Path(__file__).parents[2] / "specs"
USERS = pd.DataFrame({"user_id": ["1", "2", "3", "99999", "abc"]})


def _two_tower(exclude_seen: bool) -> dict[str, Any]:
    doc = yaml.safe_load((SPECS / "two_tower_movielens.yaml").read_text())
    doc.pop("data")
    doc["heads"][0]["exclude_seen"] = exclude_seen
    doc["training"].update(batch_size=256, epochs=1)
    return doc


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """Runs `seen` (exclude_seen) and `plain` on converted rows, `synthetic` on synthetic data; `pkg`
    and `synthetic_pkg` their exports."""
    root = tmp_path_factory.mktemp("serving_hostile")
    rng = np.random.default_rng(0)
    rows = pd.DataFrame({"user_id": rng.integers(1, 944, 3000), "item_id": rng.zipf(1.3, 3000) % 1682 + 1,
                         "label": 1})
    rows.to_csv(root / "rows.csv", index=False)
    for name, exclude in (("seen", True), ("plain", False)):
        (root / f"{name}.yaml").write_text(yaml.safe_dump(_two_tower(exclude)))
    result = invoke(["data", "convert", "csv", root / "rows.csv", root / "data", "--spec", root / "seen.yaml",
                      "--test-fraction", "0.2"])
    assert result.exit_code == 0, result.output
    for name, data in (("seen", ["--data", root / "data"]), ("plain", ["--data", root / "data"]),
                       ("synthetic", ["--rows", "1000"])):
        spec = root / ("plain.yaml" if name == "synthetic" else f"{name}.yaml")
        result = invoke(["train", spec, *data, "--out", root / name, "-q", "--device", "cpu"])
        assert result.exit_code == 0, result.output
    for run, pkg in (("seen", "pkg"), ("synthetic", "synthetic_pkg")):
        result = invoke(["export", root / run, root / pkg, "--index", "exact", "-q"])
        assert result.exit_code == 0, result.output
    return root


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _tampered(made: Path, tmp_path: Path, manifest: Callable[[dict], Any] | None = None,
              items: Callable[[pa.Table], pa.Table] | None = None) -> Path:
    """A copy of the package with its manifest and / or items changed (the items' digest recorded
    again, as a hostile package would)."""
    pkg = tmp_path / "pkg"
    shutil.copytree(made / "pkg", pkg)
    doc = json.loads((pkg / "manifest.json").read_text())
    if items is not None:
        pq.write_table(items(pq.read_table(pkg / "items.parquet")), pkg / "items.parquet")
        doc["files"]["items.parquet"] = _sha(pkg / "items.parquet")
    if manifest is not None:
        manifest(doc)
    (pkg / "manifest.json").write_text(json.dumps(doc))
    return pkg


def _refused(pkg: Path, tmp_path: Path, says: str) -> None:
    with pytest.raises(ValueError, match=None) as caught:
        load_model(pkg)
    assert says in str(caught.value) and "\n" not in str(caught.value), caught.value
    raw, out = tmp_path / "users.csv", tmp_path / "recs.parquet"
    USERS.to_csv(raw, index=False)
    result = invoke(["predict", pkg, raw, "--format", "csv", "--top-k", "3", "--out", out, "-q"])
    assert result.exit_code == 2 and says in result.output, result.output
    assert not out.exists()


def _entry(change: Callable[[dict], Any]) -> Callable[[dict], Any]:
    return lambda doc: change(doc["retrieval"])


@pytest.mark.parametrize("change, says", [
    (lambda doc: doc.update(retrieval="faiss"), "manifest.json: retrieval must be a mapping"),  # its schema
    (lambda doc: doc.update(retrieval=None), "manifest.json: retrieval must be a mapping"),  # its schema
    (lambda doc: doc.pop("retrieval"), "the manifest lacks a retrieval entry and its spec has a retrieval head"),
    (_entry(lambda e: e.update(temperature=0)), "the index's temperature 0 is not the model's (1.0)"),
    (_entry(lambda e: e.update(temperature=-1.0)), "the index's temperature -1.0 is not the model's (1.0)"),
    (_entry(lambda e: e.update(temperature=10)), "the index's temperature 10 is not the model's (1.0)"),
    (_entry(lambda e: e.pop("temperature")), "the index's temperature None is not the model's (1.0)"),
    (_entry(lambda e: e.update(item_feature="user_id")), "the index's item_feature 'user_id' is not the model's"),
    (_entry(lambda e: e.pop("dim")), "records no item count, dimension or index"),
    (_entry(lambda e: e.update(dim="32")), "records no item count, dimension or index"),
    (_entry(lambda e: e.update(items=0)), "records no item count, dimension or index"),
    (_entry(lambda e: e.pop("index")), "records no item count, dimension or index"),
    (_entry(lambda e: e.update(index="faiss")), "records no item count, dimension or index"),
    (_entry(lambda e: e.update(items=e["items"] + 1)), "the manifest records"),
])
def test_a_tampered_retrieval_manifest_is_refused(made, tmp_path, change, says):
    _refused(_tampered(made, tmp_path, manifest=change), tmp_path, says)


def _column(name: str, values: pa.Array) -> Callable[[pa.Table], pa.Table]:
    return lambda t: t.set_column(t.column_names.index(name), name, values)


def _vectors(first: list[float] | None, dim: int = 32, kind: pa.DataType = pa.float32()) -> Callable:
    def change(t: pa.Table) -> pa.Table:
        rows = [list(v) for v in t.column("vector").to_pylist()]
        rows[0] = first
        return _column("vector", pa.array(rows, pa.list_(kind)))(t)
    return change


@pytest.mark.parametrize("change, says", [
    (_vectors([float("nan")] * 32), "item vectors hold values that are not finite float32 numbers"),
    (_vectors([float("inf")] * 32), "item vectors hold values that are not finite float32 numbers"),
    (_vectors([1e300] * 32, kind=pa.float64()), "item vectors hold values that are not finite float32 numbers"),
    (_vectors([0.5] * 31), "vectors of lengths"),
    (_vectors(None), "vectors of lengths"),
    (lambda t: _column("vector", pa.array([["a"]] * t.num_rows))(t), "not lists of numbers"),
    (lambda t: _column("vector", pa.array([{"a": 1}] * t.num_rows))(t), "not lists of numbers"),
    (lambda t: t.drop_columns(["item"]), "is not an items file of item and vector columns"),
    (lambda t: t.drop_columns(["vector"]), "is not an items file of item and vector columns"),
    (lambda t: _column("item", pa.array([f"i{r % 7}" for r in range(t.num_rows)]))(t), "the item ids are not distinct"),
])
def test_tampered_items_are_refused(made, tmp_path, change, says):
    _refused(_tampered(made, tmp_path, items=change), tmp_path, says)


def test_an_untouched_package_recommends_the_same_items_as_an_unread_index_file_changes_nothing(made, tmp_path):
    """The index file is never parsed (rebuilt from the checked vectors): a package whose index entry
    names another file scores exactly as the original."""
    pkg = _tampered(made, tmp_path, manifest=_entry(lambda e: e["index"].update(file="../../etc/passwd")))
    ours, theirs = load_model(made / "pkg").recommend(USERS, 5), load_model(pkg).recommend(USERS, 5)
    assert ours["items"].map(list).tolist() == theirs["items"].map(list).tolist()
    assert np.array_equal(np.stack(ours["scores"]), np.stack(theirs["scores"]))


def test_a_table_row_without_a_raw_item_id_is_never_recommended(made):
    """The training rows hold fewer items than the spec's vocab of 1,682: the free rows are in the
    catalogue without a raw id, and predict recommended them as None."""
    items = pq.read_table(made / "pkg" / "items.parquet")
    named = set(items.column("item").drop_null().to_pylist())
    assert items.column("item").null_count > 0 and named  # the case itself
    recs = load_model(made / "pkg").recommend(USERS, items.num_rows)
    for row, scores in zip(recs["items"], recs["scores"]):
        assert set(row) == named and len(row) == len(named)  # every named item, nothing else
        assert (np.diff(scores) <= 0).all()


def test_evaluation_ranks_the_items_predict_recommends(made, tmp_path):
    """The data hold fewer items than the vocab of 1,682: training's evaluation and `flowrec eval`
    ranked every table row, the rows no raw id was fitted to among them, so hr@K and mrr were lower
    than for the items predict serves. Now both equal a count by hand over predict's full top K."""
    pkg = tmp_path / "pkg"
    assert invoke(["export", made / "plain", pkg, "--index", "exact", "-q"]).exit_code == 0
    items = pq.read_table(pkg / "items.parquet").column("item")
    assert items.null_count > 0  # the case itself
    vocab = {t: pq.read_table(made / "plain" / "encoder" / "vocab" / f"{t}.parquet").column("value").to_pylist()
             for t in ("user_id", "item_id")}
    test = pq.read_table(made / "data" / "test").to_pandas()
    raw = {f: [vocab[f][r - 1] if r > 0 else None for r in test[f]] for f in ("user_id", "item_id")}
    users = pd.DataFrame({"user_id": [u if u is not None else "no such user" for u in raw["user_id"]]})
    recs = load_model(pkg).recommend(users, len(items) - items.null_count)
    ranks = []
    for row, scores, positive in zip(recs["items"], recs["scores"], raw["item_id"]):
        row = [str(item) for item in row]  # MovieLens items come back as ints (6aab487b), the vocabulary holds text
        scores = np.asarray(scores)
        ranks.append(int((scores >= scores[list(row).index(positive)]).sum()) - 1 if positive in row else None)
    hand = {"hr@10": np.mean([r is not None and r < 10 for r in ranks]),
            "hr@100": np.mean([r is not None and r < 100 for r in ranks]),
            "mrr": np.mean([1 / (r + 1) if r is not None else 0.0 for r in ranks])}
    out = tmp_path / "eval.json"
    assert invoke(["eval", made / "plain", "--data", made / "data" / "test", "--json", out, "-q"]).exit_code == 0
    evaluated = json.loads(out.read_text())["retrieve"]
    final = [json.loads(line) for line in (made / "plain" / "metrics.jsonl").read_text().splitlines()]
    trained = next(r for r in final if r.get("event") == "eval" and r.get("final"))["metrics"]["retrieve"]
    for name, value in hand.items():
        assert evaluated[name] == pytest.approx(value, abs=1.5 / len(ranks)), name
        assert trained[name] == pytest.approx(value, abs=1.5 / len(ranks)), name


def test_a_top_k_beyond_the_catalogue_says_what_was_written(made, tmp_path):
    """--top-k 5000 over a catalogue of fewer items wrote every item a row and said 'the top 5000'."""
    items = pq.read_table(made / "pkg" / "items.parquet").column("item")
    named = len(items) - items.null_count
    raw, out = tmp_path / "users.csv", tmp_path / "recs.parquet"
    USERS.to_csv(raw, index=False)
    result = invoke(["predict", made / "pkg", raw, "--format", "csv", "--top-k", "5000", "--out", out, "-q"])
    assert result.exit_code == 0, result.output
    assert {len(row) for row in pq.read_table(out).column("items").to_pylist()} == {named}
    assert f"of all {named:,} items" in result.output and f"catalogue holds {named:,}" in result.output
    assert "top 5000" not in result.output


def test_user_ids_written_as_floats_are_said(made, tmp_path):
    """Users of a CSV pandas wrote from a float column (a missing id: "12.0") were all unknown to a
    package trained on "12": every row got the unknown user's items, without a word."""
    raw, out = tmp_path / "users.csv", tmp_path / "recs.parquet"
    pd.DataFrame({"user_id": [float(i) for i in range(1, 40)] + [None]}).to_csv(raw, index=False)
    assert "1.0" in raw.read_text()
    result = invoke(["predict", made / "pkg", raw, "--format", "csv", "--top-k", "3", "--out", out, "-q"])
    assert result.exit_code == 0, result.output
    (line,) = [x for x in result.output.splitlines() if x.startswith("warning: column user_id: ")]
    assert "39 of 39 ids are not in the vocabulary of feature user_id" in line and "as floats" in line
    USERS.to_csv(raw, index=False)  # ids of the training rows' form: no such line
    result = invoke(["predict", made / "pkg", raw, "--format", "csv", "--top-k", "3", "--out", out, "-q",
                      "--overwrite"])
    assert result.exit_code == 0 and "warning: column user_id" not in result.output, result.output
    model = load_model(made / "pkg")  # in Python, a UserWarning of the call
    with pytest.warns(UserWarning, match="column user_id: 3 of 3 ids are not in the vocabulary"):
        model.recommend(pd.DataFrame({"user_id": ["1.0", "2.0", "3.0"]}), 3)
    assert model.unseen_ids().counts["user_id"][1] == 3


def test_a_kept_id_column_of_integers_in_one_file_and_floats_in_another_is_written(made, tmp_path):
    """A Parquet folder whose user ids pandas wrote as int64 in one file and as floats in another (a
    missing id) is read; --keep user_id then stopped on the scores file's writer ('Table schema does
    not match schema used to create file', a page of text)."""
    raw, out = tmp_path / "users", tmp_path / "recs.parquet"
    raw.mkdir()
    pd.DataFrame({"user_id": [1, 2, 3]}).to_parquet(raw / "a.parquet")
    pd.DataFrame({"user_id": [4.0, None]}).to_parquet(raw / "b.parquet")
    result = invoke(["predict", made / "pkg", raw, "--format", "parquet", "--top-k", "3", "--out", out, "-q",
                      "--keep", "user_id"])
    assert result.exit_code == 0, result.output
    kept = pq.read_table(out).column("user_id")
    assert kept.type == pa.int64() and kept.to_pylist() == [1, 2, 3, 4, None]


@pytest.mark.parametrize("column", ["items", "scores"])
def test_keeping_a_column_top_k_writes_names_what_it_holds(made, tmp_path, column):
    """--keep items with --top-k said the column held 'the head's scores'."""
    raw, out = tmp_path / "users.csv", tmp_path / "recs.parquet"
    USERS.to_csv(raw, index=False)
    result = invoke(["predict", made / "pkg", raw, "--format", "csv", "--top-k", "3", "--out", out,
                      "--keep", column])
    assert result.exit_code == 2 and result.output.count("error:") == 1
    assert "top K items and their scores" in result.output and "head's scores" not in result.output
    assert not out.exists()


def test_raw_rows_for_a_package_of_a_run_on_synthetic_data_are_refused(made, tmp_path):
    """Its vocabulary tables have no raw values: encoding raw rows failed with a KeyError."""
    model = load_model(made / "synthetic_pkg")
    with pytest.raises(DataError, match="has no vocabulary for its tables"):
        model.recommend(USERS, 3)
    raw, out = tmp_path / "users.csv", tmp_path / "recs.parquet"
    USERS.to_csv(raw, index=False)
    result = invoke(["predict", made / "synthetic_pkg", raw, "--format", "csv", "--top-k", "3", "--out", out])
    assert result.exit_code == 2 and "raw rows cannot be encoded" in result.output
    assert not out.exists()


@pytest.mark.parametrize("run, noted", [("synthetic", True), ("seen", False)])
def test_export_notes_a_package_that_cannot_encode_raw_rows(made, tmp_path, run, noted):
    """Export of a run on synthetic rows said nothing, and predict on its package then refused raw rows."""
    result = invoke(["export", made / run, tmp_path / "pkg", "--index", "exact", "-q"])
    assert result.exit_code == 0, result.output
    assert ("note: " in result.output and "no vocabulary for its tables ['item_id', 'user_id']" in result.output
            and "refuses raw rows" in result.output) is noted, result.output
    assert load_model(tmp_path / "pkg").raw_columns()  # written either way


def test_eval_refuses_grouping_exclude_seen_by_the_item_id(made):
    data = made / "data" / "test"
    result = invoke(["eval", made / "seen", "--data", data, "--group-by", "item_id"])
    assert result.exit_code == 2
    assert "cannot group by 'item_id' with exclude_seen: it is the item id" in result.output


def test_eval_refuses_seen_for_a_run_without_exclude_seen(made):
    data = made / "data" / "test"
    result = invoke(["eval", made / "plain", "--data", data, "--seen", made / "data" / "train"])
    assert result.exit_code == 2
    assert "--seen applies to a retrieval head with exclude_seen: true" in result.output
    assert result.output.count("error:") == 1
    assert invoke(["eval", made / "seen", "--data", data, "--seen", made / "data" / "train", "-q"]).exit_code == 0


def test_eval_of_a_split_dataset_names_its_test_part(made):
    """`--data DIR` of a split dataset (what `flowrec train --data` takes) names DIR/test, instead of
    calling DIR not a dataset and asking for a conversion."""
    result = invoke(["eval", made / "plain", "--data", made / "data"])
    assert result.exit_code == 2 and result.output.count("error:") == 1
    assert "is a split dataset" in result.output and str(made / "data" / "test") in result.output
    assert "convert it first" not in result.output


def test_export_refuses_an_index_a_run_cannot_have(made, tmp_path):
    spec = tmp_path / "ranker.yaml"
    doc = _two_tower(False)
    doc["heads"][0] = {"name": "click", "input": "score"}  # the towers as a pointwise ranker: no catalogue
    spec.write_text(yaml.safe_dump(doc))
    assert invoke(["train", spec, "--rows", "500", "--out", tmp_path / "run", "-q", "--device", "cpu"]).exit_code == 0
    for index, says in (("faiss", "index 'faiss': only a run with a retrieval head has an item index"),
                        ("exact", "index 'exact': only a run with a retrieval head has an item index"),
                        ("hnsw", "--index must be one of auto, exact, faiss, not 'hnsw'")):
        result = invoke(["export", tmp_path / "run", tmp_path / "pkg", "--index", index])
        assert result.exit_code == 2 and says in result.output, result.output
        assert not (tmp_path / "pkg").exists()
    assert invoke(["export", tmp_path / "run", tmp_path / "pkg", "-q"]).exit_code == 0
    result = invoke(["export", made / "seen", tmp_path / "pkg2", "--index", "hnsw"])
    assert result.exit_code == 2 and "--index must be one of auto, exact, faiss, not 'hnsw'" in result.output


MANAGED = {
    "name": "hostile_managed",
    "features": [{"name": "user", "type": "categorical", "table": "users"},
                 {"name": "item", "type": "categorical", "hash_buckets": 100, "dim": 8}],
    "tables": [{"name": "users", "dim": 8, "managed": {"rows": 50, "every_steps": 5}}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [8]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
    "training": {"batch_size": 32},
}


@pytest.fixture(scope="module")
def managed_pkg(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("managed_hostile")
    (root / "spec.yaml").write_text(yaml.safe_dump(MANAGED))
    assert invoke(["train", root / "spec.yaml", "--rows", "400", "--out", root / "run", "-q",
                    "--device", "cpu"]).exit_code == 0
    assert invoke(["export", root / "run", root / "pkg", "-q"]).exit_code == 0
    return root / "pkg"


def _tampered_map(managed_pkg: Path, tmp_path: Path, table: pa.Table, listed: bool) -> Path:
    pkg = tmp_path / "pkg"
    shutil.copytree(managed_pkg, pkg)
    pq.write_table(table, pkg / "managed" / "users.parquet")
    doc = json.loads((pkg / "manifest.json").read_text())
    if listed:
        doc["files"]["managed/users.parquet"] = _sha(pkg / "managed" / "users.parquet")
    else:
        doc["files"].pop("managed/users.parquet")
    (pkg / "manifest.json").write_text(json.dumps(doc))
    return pkg


def test_a_managed_map_left_out_of_the_manifest_is_refused(managed_pkg, tmp_path):
    """Its digest was never checked: a changed map (every id on row 0) loaded and scored."""
    original = pq.read_table(managed_pkg / "managed" / "users.parquet")
    zeros = pa.table({"key": original.column("key"), "row": pa.array([0] * original.num_rows, pa.int64())})
    with pytest.raises(ValueError, match="managed/users.parquet is not among the files its manifest records"):
        load_model(_tampered_map(managed_pkg, tmp_path, zeros, listed=False))


def test_a_managed_map_of_text_keys_is_refused(managed_pkg, tmp_path):
    original = pq.read_table(managed_pkg / "managed" / "users.parquet")
    text = pa.table({"key": pa.array([str(k) for k in original.column("key").to_pylist()]),
                     "row": original.column("row")})
    with pytest.raises(ValueError, match="the map of managed table 'users' is missing or damaged"):
        load_model(_tampered_map(managed_pkg, tmp_path, text, listed=True))
    assert load_model(managed_pkg).predict(pd.DataFrame({"user": ["1", "2"], "item": ["4", "5"]})).shape == (2, 1)


@pytest.mark.parametrize("how", ["null_row", "null_key", "uint64_keys", "row_twice"])
def test_a_managed_map_no_export_writes_is_refused(managed_pkg, tmp_path, how):
    """A map with its digest recorded again: a null row (read as NaN, cast to a garbage row), uint64
    ids (searched as floats beside the int64 hashes) or two ids on one row loaded and scored."""
    original = pq.read_table(managed_pkg / "managed" / "users.parquet")
    keys, rows = original.column("key").to_numpy(), original.column("row").to_numpy()
    assert len(keys) > 2 and bool((keys > 0).any())
    if how == "null_row":
        table = pa.table({"key": keys, "row": pa.array([None, *rows[1:].tolist()], pa.int64())})
    elif how == "null_key":
        table = pa.table({"key": pa.array([*keys[:-1].tolist(), None], pa.int64()), "row": rows})
    elif how == "uint64_keys":  # the positive ids only: sorted as uint64 too
        positive = keys > 0
        table = pa.table({"key": pa.array(keys[positive].astype(np.uint64)), "row": rows[positive]})
    else:
        twice = rows.copy()
        twice[1] = twice[0]
        table = pa.table({"key": keys, "row": twice})
    with pytest.raises(ValueError, match="the map of managed table 'users' is (missing or damaged|damaged)"):
        load_model(_tampered_map(managed_pkg, tmp_path, table, listed=True))


LISTS = {
    "name": "hostile_lists",
    "features": [{"name": "user", "type": "categorical", "hash_buckets": 100, "dim": 8},
                 {"name": "tags", "type": "categorical", "hash_buckets": 50, "dim": 8, "max_len": 3,
                  "pooling": "mean", "truncate": "last"}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [8]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
    "training": {"batch_size": 32},
}


def test_raw_id_columns_of_the_wrong_shape_are_one_line_naming_the_column(tmp_path):
    """Nested lists, structs or a list for a one-id feature (pandas or Parquet) were Arrow's cast
    error naming no column (the API raised ArrowNotImplementedError); pandas categories and lists of
    ids still score, and `truncate: last` keeps the last ids of a long list."""
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(LISTS))
    assert invoke(["train", tmp_path / "spec.yaml", "--rows", "300", "--out", tmp_path / "run", "-q",
                    "--device", "cpu", "--max-steps", "3"]).exit_code == 0
    assert invoke(["export", tmp_path / "run", tmp_path / "pkg", "-q"]).exit_code == 0
    model = load_model(tmp_path / "pkg")
    good = model.predict(pd.DataFrame({"user": ["a", "b"], "tags": [["x", "y", "z", "w"], ["q"]]}))
    assert good.shape == (2, 1)
    same = model.predict(pd.DataFrame({"user": pd.Categorical(["a", "b"]), "tags": ["y^z^w", "q"]}))
    assert np.array_equal(good["ctr"].to_numpy(), same["ctr"].to_numpy())  # the last 3 of 4, as text
    for frame, says in (({"user": ["a", "b"], "tags": [[["x"]], []]}, "column tags holds list<item: list"),
                        ({"user": ["a", "b"], "tags": [{"k": 1}, {"k": 2}]}, "column tags holds struct"),
                        ({"user": [["a"], ["b"]], "tags": ["x", "y"]}, "column user holds list<item: string>, "
                                                                      "not one id per row"),
                        ({"user": ["a", "b"], "tags": [["x"], "y^z"]}, "Conversion failed for column tags")):
        with pytest.raises(DataError, match=says.replace("[", r"\[")):
            model.predict(pd.DataFrame(frame))
    pq.write_table(pa.table({"user": pa.array([["a"], ["b"]]), "tags": ["x", "y"]}), tmp_path / "raw.parquet")
    result = invoke(["predict", tmp_path / "pkg", tmp_path / "raw.parquet", "--format", "parquet",
                      "--out", tmp_path / "scores.parquet"])
    assert result.exit_code == 2 and "column user holds list<element: string>, not one id per row" in result.output
    assert not (tmp_path / "scores.parquet").exists()


def test_float_ids_of_a_dataframe_that_may_be_rounded_are_refused_nullable_integers_score(managed_pkg):
    """`pd.Series([2**60 + 1, None])` is float64 in pandas: the id was rounded to 2**60 before flowrec
    saw it, and predict scored the wrong id without a word (a fraction, 2.5, scored as the id '2.5').
    Now such a column is one line naming pandas' nullable Int64 / UInt64, which score big ids and
    missing values as their text does."""
    model = load_model(managed_pkg)
    for user, item, says in (([2**60 + 1, None], ["1", "2"], r"column user: id 1152921504606846976\.0 at row 0"),
                             (["a", "b"], [3, 2.5], r"column item: id 2\.5 at row 1"),
                             (["a", "b"], [float("inf"), 1], r"column item: id inf at row 0"),
                             # float32 holds whole numbers exactly only below 2**24
                             (["a", "b"], pd.Series([1, 2**24 + 1], dtype="float32"),
                              r"column item: id 16777216\.0 at row 1 \(0-based\) is a float of magnitude 2\*\*24")):
        with pytest.raises(DataError, match=says + r".*nullable integer dtype, dtype=\"Int64\""):
            model.predict(pd.DataFrame({"user": user, "item": item}))
    with pytest.raises(DataError, match=r"column user: id 1152921504606846976\.0 at row 1 \(0-based\) is a float "
                                        r"of magnitude 2\*\*53.*nullable dtype \"Int64\""):  # a Parquet file's rows
        model.predict(pa.table({"user": pa.array([3.0, 2.0**60 + 1]), "item": ["1", "2"]}))
    big = [2**60 + 1, None, 2**63 - 1, 7]
    exact = model.predict(pd.DataFrame({"user": pd.Series(big, dtype="Int64"),
                                        "item": pd.Series([2**64 - 1, 3, None, 2**53 + 1], dtype="UInt64")}))
    text = model.predict(pd.DataFrame({"user": [None if u is None else str(u) for u in big],
                                       "item": [str(2**64 - 1), "3", None, str(2**53 + 1)]}))
    assert exact.shape == (4, 1) and np.array_equal(exact["ctr"].to_numpy(), text["ctr"].to_numpy())
    assert not np.array_equal(exact["ctr"].to_numpy(), model.predict(pd.DataFrame(
        {"user": [str(2**60), None, str(2**63), "7"], "item": [str(2**64), "3", None, str(2**53)]}))["ctr"].to_numpy())


def test_a_dataframe_naming_a_column_twice_is_one_line(managed_pkg):
    """pd.DataFrame(..., columns=["user", "item", "item"]) raised pyarrow's ValueError 'Duplicate
    column names found' from predict, not the DataError its docstring promises for bad rows."""
    model = load_model(managed_pkg)
    with pytest.raises(DataError, match="the rows name column 'item' twice: drop or rename one"):
        model.predict(pd.DataFrame([["a", "1", "2"]], columns=["user", "item", "item"]))


def test_a_head_beside_a_retrieval_head_is_served_with_the_top_k(tmp_path):
    """A binary head trained beside the retrieval head (an auxiliary task) was evaluated, but the
    package held the query tower alone and export said so in a note: the head could never be
    scored. Now the package holds a second program for it, and predict --top-k writes its score of
    each row (the row's own item) beside the row's items: the trained model's score, exactly."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.evaluation.scores import head_columns
    from flowrec.serving.trained import load_trained

    doc = _two_tower(False)
    doc["modules"] += [{"name": "ctr", "kind": "mlp", "inputs": ["user_id", "item_id"], "layers": [8]}]
    doc["heads"].append({"name": "click", "input": "ctr", "label": "click"})
    spec = tmp_path / "aux.yaml"
    spec.write_text(yaml.safe_dump(doc))
    rng = np.random.default_rng(1)
    users, items = rng.integers(1, 200, 1200), rng.zipf(1.3, 1200) % 300 + 1
    rows = pd.DataFrame({"user_id": users, "item_id": items, "label": 1, "click": (users + items) % 3 == 0})
    rows["click"] = rows["click"].astype(int)
    rows.to_csv(tmp_path / "rows.csv", index=False)
    rows.head(50).to_csv(tmp_path / "new.csv", index=False)
    for args in (["data", "convert", "csv", tmp_path / "rows.csv", tmp_path / "data", "--spec", spec,
                  "--test-fraction", "0.2", "-q"],
                 ["train", spec, "--data", tmp_path / "data", "--out", tmp_path / "run", "-q", "--device", "cpu"],
                 ["data", "convert", "csv", tmp_path / "new.csv", tmp_path / "new", "--spec", spec,
                  "--encoder-from", tmp_path / "run", "-q"]):
        result = invoke(args)
        assert result.exit_code == 0, result.output
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    final = next(r["metrics"] for r in records if r.get("event") == "eval" and r.get("final"))
    assert 0 < final["click"]["auc"] < 1 and 0 <= final["retrieve"]["hr@10"] <= 1, final
    result = invoke(["export", tmp_path / "run", tmp_path / "pkg", "--index", "exact"])
    assert result.exit_code == 0, result.output
    assert "note:" not in result.output, result.output
    out = tmp_path / "recs.parquet"
    result = invoke(["predict", tmp_path / "pkg", tmp_path / "new.csv", "--format", "csv", "--top-k", "5",
                      "--out", out, "--keep", "user_id", "-q"])
    assert result.exit_code == 0, result.output
    recs = pq.read_table(out).to_pandas()
    assert list(recs.columns) == ["items", "scores", "click", "user_id"] and len(recs) == 50
    trained = load_trained(tmp_path / "run", "cpu", scoring_plan)
    encoded = pq.read_table(tmp_path / "new")
    column = head_columns(trained.model.head_widths)[1]
    with iterate_batches(trained.spec, MemorySource([encoded]), StagingOptions(batch_size=64, shuffle=False,
                                                                               lookahead=0),
                         0, 0, trained.model.groups) as batches, torch.no_grad():
        reference = np.concatenate([torch.sigmoid(trained.model.eval()(b)[:, column])[:, 0].numpy()
                                    for b in batches])
    assert len(np.unique(reference)) > 5  # the rows' items move the score
    np.testing.assert_allclose(recs["click"].to_numpy(), reference, rtol=0, atol=1e-6)
    result = invoke(["predict", tmp_path / "pkg", tmp_path / "new.csv", "--format", "csv", "--top-k", "5",
                      "--out", tmp_path / "again.parquet", "--keep", "click", "-q"])
    assert result.exit_code == 2 and "--keep click: the scores file already has a column click" in result.output
    for change in (lambda e: e["heads"].update(names=["nope"]), lambda e: e["heads"].update(file="model.pt2"),
                   lambda e: e.update(heads="heads.pt2")):
        pkg = tmp_path / "edited"
        shutil.rmtree(pkg, ignore_errors=True)
        shutil.copytree(tmp_path / "pkg", pkg)
        manifest = json.loads((pkg / "manifest.json").read_text())
        change(manifest["retrieval"])
        (pkg / "manifest.json").write_text(json.dumps(manifest))
        with pytest.raises(ValueError, match="the manifest's retrieval heads entry does not name the heads beside"):
            load_model(pkg)


def test_a_misspelled_column_names_the_column_the_rows_have(managed_pkg, tmp_path):
    """A frame with `userid` (or `User`) for the model's `user` said only that the rows lack
    ['user']; now it names the close column the rows have, in the API and `flowrec predict` alike."""
    model = load_model(managed_pkg)
    for frame, says in (({"userid": ["1"], "item": ["4"]}, "(the rows have 'userid': rename it to 'user'?)"),
                        ({"User": ["1"], "ITEM": ["4"], "label": [1]},
                         "(the rows have 'User', 'ITEM': rename them to 'user', 'item'?)")):
        with pytest.raises(DataError) as caught:
            model.predict(pd.DataFrame(frame))
        assert str(caught.value).endswith(says), caught.value
    pd.DataFrame({"usr": ["1"], "item": ["4"]}).to_csv(tmp_path / "raw.csv", index=False)
    result = invoke(["predict", managed_pkg, tmp_path / "raw.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
    assert result.exit_code == 2 and "(the rows have 'usr': rename it to 'user'?)" in result.output, result.output
    with pytest.raises(DataError) as caught:  # no close column: no guess
        model.predict(pd.DataFrame({"item": ["4"], "label": [1]}))
    assert "rename" not in str(caught.value)


def test_recommend_refuses_a_k_that_is_no_count_of_items(made):
    """`recommend(rows, k)` with k=-1, 2.5, True or None raised torch's topk errors (naming no k), and
    k=0 returned empty lists; now each is one ValueError naming k, and numpy's integers count."""
    model = load_model(made / "pkg")
    for k in (0, -1, 2.5, True, None, "3"):
        with pytest.raises(ValueError, match=r"^k must be a whole number of items, at least 1, not "):
            model.recommend(USERS, k)
    assert model.recommend(USERS, np.int64(3))["items"].map(len).tolist() == [3] * len(USERS)


def test_a_loaded_model_shows_in_one_short_line(managed_pkg, made):
    """A notebook cell ending in `model` printed the dataclass's repr (spec, manifest, encoder and
    program: 6,000+ characters); now the package, spec, heads and the raw columns predict reads."""
    assert repr(load_model(managed_pkg)) == (f"LoadedModel({str(managed_pkg)!r}, spec='hostile_managed', "
                                             "heads=['ctr'], raw_columns=['user', 'item'])")
    assert repr(load_model(made / "pkg")).endswith("heads=['retrieve'], raw_columns=['user_id'], retrieval)")
    # the repr said columns=[...], but a LoadedModel has no .columns: its key names the method that gives them
    assert load_model(managed_pkg).raw_columns() == ['user', 'item']


def test_a_package_under_the_home_folder_loads_by_its_tilde_path(managed_pkg, monkeypatch):
    """`load_model("~/pkg")` said '~/pkg is not a flowrec model package (no readable manifest.json)'
    for a package that is there (pandas expands '~'); now it loads."""
    monkeypatch.setenv("HOME", str(managed_pkg.parent))
    assert load_model("~/pkg").path == managed_pkg


def test_a_file_of_a_package_names_the_package_folder(managed_pkg):
    """`load_model("pkg/model.pt2")` said 'not a flowrec model package (... cannot read
    pkg/model.pt2/manifest.json: Not a directory)'; now the line names the folder to give."""
    for name in ("model.pt2", "manifest.json"):
        with pytest.raises(ValueError) as caught:
            load_model(managed_pkg / name)
        assert str(caught.value) == (f"{managed_pkg / name} is a file of a model package; give the "
                                     f"package's folder, {managed_pkg}")
    assert load_model(managed_pkg).path == managed_pkg


def test_an_id_column_mixing_text_and_numbers_names_a_mend_that_keeps_missing_values(managed_pkg):
    """An object column of ints and text (a `concat` of frames) was Arrow's 'Expected bytes, got a
    'int' object'; the line now names `.astype("string")`, which scores as the ids' text does and
    keeps a missing id missing (`.astype(str)` made it the id 'nan')."""
    model = load_model(managed_pkg)
    mixed = pd.DataFrame({"user": [1, "2", None], "item": ["4", "5", "6"]})
    with pytest.raises(DataError, match=r"column user mixes text and numbers: make it text with "
                                        r"\.astype\(\"string\"\), which keeps missing values missing"):
        model.predict(mixed)
    mended = model.predict(mixed.assign(user=mixed["user"].astype("string")))["ctr"].to_numpy()
    text = model.predict(pd.DataFrame({"user": ["1", "2", None], "item": ["4", "5", "6"]}))["ctr"].to_numpy()
    assert np.array_equal(mended, text)


@pytest.mark.parametrize("column, values, says", [
    ("user", [pd.Timestamp("2021-03-04 05:06"), "2", None], "column user mixes text and dates or times: make it text"),
    ("user", [1 + 2j, 3j, 2j], r"column user holds complex numbers \(complex128\): an id is an integer or text"),
    ("user", ["1", 2, b"3"], "column user mixes text and bytes and numbers: make it text"),
], ids=["timestamp", "complex", "bytes"])
def test_an_id_column_arrow_cannot_read_names_what_it_holds(managed_pkg, column: str, values: list, says: str):
    """An id column of text and pandas Timestamps was told it "mixes text and numbers", and one of
    complex numbers was Arrow's bare "Unsupported numpy type 15": the line names what it holds."""
    rows = pd.DataFrame({"user": ["1", "2", "3"], "item": ["4", "5", "6"]}).assign(**{column: values})
    with pytest.raises(DataError, match=says):
        load_model(managed_pkg).predict(rows)


def test_raw_rows_for_a_synthetic_runs_standardized_feature_are_refused(tmp_path):
    """A run on synthetic rows (drawn standardized: no mean or std) of a spec of hashed tables and a
    standardize feature exported, and predict of raw rows was a KeyError traceback ('price')."""
    spec = {"name": "syn", "features": [{"name": "price", "type": "dense", "transform": "standardize"},
                                        {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
            "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
            "heads": [{"name": "ctr", "input": "top"}], "training": {"batch_size": 64}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec))
    assert invoke(["train", tmp_path / "s.yaml", "--rows", "200", "--out", tmp_path / "run", "-q",
                    "--device", "cpu"]).exit_code == 0
    assert invoke(["export", tmp_path / "run", tmp_path / "pkg", "-q"]).exit_code == 0
    rows = pd.DataFrame({"price": [1.5, 2.0], "user": ["a", "b"]})
    says = r"has no mean and std for its standardized features \['price'\]"
    with pytest.raises(DataError, match=says):
        load_model(tmp_path / "pkg").predict(rows)
    rows.to_csv(tmp_path / "rows.csv", index=False)
    result = invoke(["predict", tmp_path / "pkg", tmp_path / "rows.csv", "--format", "csv",
                      "--out", tmp_path / "scores.parquet"])
    assert result.exit_code == 2 and re.search(says, result.output) and result.output.count("error:") == 1
    assert not (tmp_path / "scores.parquet").exists()


@pytest.mark.parametrize("sep", [None, ";", "|"])
def test_the_separator_note_reads_a_spec_with_data_options(sep):
    """predict of rows lacking columns, for a package whose spec has data.options (ple_movielens:
    test_fraction, split_seed), raised AttributeError ('tuple' object has no attribute 'get': a
    loaded spec keeps its options as (key, value) pairs) where it should name the missing columns."""
    from flowrec.serving.predict import separator_note
    from flowrec.spec.load import spec_from_dict

    doc = yaml.safe_load((SPECS / "ple_movielens.yaml").read_text())
    if sep is not None:
        doc["data"]["options"]["sep"] = sep
    spec = spec_from_dict(doc)
    assert spec.data.options  # the case that failed: options present
    assert separator_note(["user_id", "item_id"], ["age"], spec) == ""  # no separator in the header
    reads = repr(sep or ",")
    note = separator_note(["user_id\tage\trating"], ["user_id", "age"], spec)
    assert note == (f"; the header looks tab-separated, where the package reads {reads}-separated text: "
                    f"write the rows with {reads}")
