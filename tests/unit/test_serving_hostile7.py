"""Serving, seventh round: retrieval items in the type the training rows held them in, and load_model,
predict and recommend given hostile packages and rows."""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.serving.predict import load_model
from package_flow import TWO_TOWER, ratings, train_and_export

def _train_and_export(root: Path, rows: pd.DataFrame, fmt: str) -> Path:
    """The two-tower package of `rows` under `root` (`package_flow`); returns the training file."""
    train_and_export(root, TWO_TOWER, rows, fmt)
    return root / f"train.{fmt}"


CASES = {  # case -> (training file's format, the ids as the rows give them, the type recommend gives back)
    "csv integers": ("csv", lambda ids: ids, int),
    "parquet int64": ("parquet", lambda ids: ids.astype(np.int64), int),
    "parquet digit strings": ("parquet", lambda ids: ids.astype(str), str),
    "text ids": ("csv", lambda ids: np.array([f"m{i}" for i in ids]), str),
    "zero-padded ids": ("csv", lambda ids: np.array([f"{i:07d}" for i in ids]), str),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recommended_items_come_back_in_the_type_the_training_column_held(tmp_path, case):
    fmt, form, kind = CASES[case]
    rng = np.random.default_rng()
    items = form(rng.choice(np.arange(100, 100_000), 30, replace=False))
    file = _train_and_export(tmp_path, ratings(rng, items), fmt)
    # the user's own rows, read back (zero-padded ids as text: read_csv's numbers would drop the zeros)
    rows = pd.read_csv(file, dtype={"item_id": str} if kind is str else None) if fmt == "csv" else pd.read_parquet(file)
    users = pd.DataFrame({"user_id": rng.choice(rows["user_id"].unique(), 4)})
    got = load_model(tmp_path / "pkg").recommend(users, 3)
    assert all(type(i) is kind for row in got["items"] for i in row), got["items"].tolist()
    firsts = [row[0] for row in got["items"]]
    joined = pd.DataFrame({"item_id": firsts}).merge(rows.drop_duplicates("item_id"), on="item_id")
    assert len(joined) == len(firsts)  # each recommended item joins back to the rows' own item column
    users.to_csv(tmp_path / "users.csv", index=False)
    result = CliRunner().invoke(app, ["predict", str(tmp_path / "pkg"), str(tmp_path / "users.csv"), "--format",
                                      "csv", "--top-k", "3", "--out", str(tmp_path / "recs.parquet")])
    assert result.exit_code == 0, result.output
    written = pq.read_table(tmp_path / "recs.parquet").schema.field("items").type.value_type
    assert written == (pa.int64() if kind is int else pa.string())


@pytest.fixture(scope="module")
def digits_package(tmp_path_factory) -> Path:
    """A retrieval package trained on a Parquet file whose item column is text of digits."""
    root = tmp_path_factory.mktemp("digits")
    rng = np.random.default_rng()
    _train_and_export(root, ratings(rng, rng.choice(np.arange(100, 100_000), 30, replace=False).astype(str)),
                      "parquet")
    return root / "pkg"


def _forged(package: Path, out: Path, items=None, encoder=None) -> Path:
    """A copy of `package` with items.parquet's item column replaced (`items`: the column -> another)
    and encoder.json edited (`encoder`: the document, edited in place), its manifest's digests made
    anew, as a hostile package would have them."""
    shutil.copytree(package, out)
    if items is not None:
        table = pq.read_table(out / "items.parquet")
        pq.write_table(table.set_column(0, "item", items(table.column("item").combine_chunks())), out / "items.parquet")
    if encoder is not None:
        doc = json.loads((out / "encoder.json").read_text())
        encoder(doc)
        (out / "encoder.json").write_text(json.dumps(doc))
    manifest = json.loads((out / "manifest.json").read_text())
    manifest["files"] = {name: hashlib.sha256((out / name).read_bytes()).hexdigest() for name in manifest["files"]}
    (out / "manifest.json").write_text(json.dumps(manifest))
    return out


FORGERIES = {  # what a hostile package holds -> what load_model's line says of it
    "lists of ids": (lambda c: pa.array([[i] for i in range(len(c))]), None, "not item ids"),
    "float ids": (lambda c: pa.array(np.arange(len(c)) + 0.5), None, "not item ids"),
    "bytes": (lambda c: c.cast(pa.binary()), None, "not item ids"),
    "other ids": (lambda c: pa.array([v and f"x{v}" for v in c.to_pylist()]), None, "not the package's vocabulary"),
    "ids shifted a row": (lambda c: pa.concat_arrays([c[1:], c[:1]]), None, "not the package's vocabulary"),
    "the digits as ints": (lambda c: c.cast(pa.int64()), None, "where the training rows held the item column"),
    "a record of int ids": (None, lambda d: d["id_types"].update(item_id="int64"), "where the training rows held"),
}


@pytest.mark.parametrize("forgery", list(FORGERIES))
def test_a_package_whose_items_are_not_its_vocabularys_ids_is_refused_in_one_line(digits_package, tmp_path, forgery):
    items, encoder, said = FORGERIES[forgery]
    package = _forged(digits_package, tmp_path / "pkg", items, encoder)
    with pytest.raises(ValueError, match=said):
        load_model(package)
    pd.DataFrame({"user_id": [3, 7]}).to_csv(tmp_path / "users.csv", index=False)
    result = CliRunner().invoke(app, ["predict", str(package), str(tmp_path / "users.csv"), "--format", "csv",
                                      "--top-k", "2", "--out", str(tmp_path / "recs.parquet")])
    assert result.exit_code == 2 and isinstance(result.exception, SystemExit), (result.exception, result.output)
    assert "items.parquet" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "recs.parquet").exists()


def test_the_genuine_package_loads_and_its_dictionary_encoded_copy_too(digits_package, tmp_path):
    users = pd.DataFrame({"user_id": [3, 7]})
    want = load_model(digits_package).recommend(users, 3)
    copy = _forged(digits_package, tmp_path / "pkg", lambda c: c.dictionary_encode())
    assert load_model(copy).recommend(users, 3)["items"].tolist() == want["items"].tolist()


@pytest.mark.parametrize("name", ["spec.json", "items.parquet", "vocab/item_id.parquet"])
def test_a_package_file_that_is_a_link_to_itself_is_a_one_line_value_error(digits_package, tmp_path, name):
    package = tmp_path / "pkg"
    shutil.copytree(digits_package, package)
    (package / name).unlink()
    os.symlink(Path(name).name, package / name)  # a link loop: Path.resolve's RuntimeError escaped load_model
    with pytest.raises(ValueError, match="link loop"):
        load_model(package)


def test_a_run_continued_on_csv_rows_keeps_the_item_type_of_its_parquet_start(tmp_path):
    """A run started on a Parquet file of digit-string items and continued (--init-from) on a CSV
    day, converted with its encoder: CSV records no types, so the continued run's items were the
    guess, int64; the parent's record is kept, as its forms of ids are."""
    rng = np.random.default_rng()
    items = rng.choice(np.arange(100, 100_000), 30, replace=False).astype(str)
    _train_and_export(tmp_path, ratings(rng, items), "parquet")
    day = tmp_path / "day.csv"
    ratings(rng, items).to_csv(day, index=False)
    runner = CliRunner()
    for args in (["data", "convert", "csv", day, tmp_path / "day", "--spec", tmp_path / "spec.yaml", "-q",
                  "--encoder-from", tmp_path / "run"],
                 ["train", tmp_path / "spec.yaml", "--data", tmp_path / "day", "--out", tmp_path / "run2", "--quiet",
                  "--device", "cpu", "--init-from", tmp_path / "run"],
                 ["export", tmp_path / "run2", tmp_path / "pkg2"]):
        result = runner.invoke(app, [str(a) for a in args])
        assert result.exit_code == 0, (args[0], result.output)
    got = load_model(tmp_path / "pkg2").recommend(pd.DataFrame({"user_id": [3, 7]}), 3)
    assert all(type(i) is str and i in set(items) for row in got["items"] for i in row), got["items"].tolist()
