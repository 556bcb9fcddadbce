"""`truncate: first | last`: which ids a raw list longer than max_len keeps.

The encoder's rule against a plain-Python reference on random ragged lists with missing
elements; conversion and the raw-row path of scoring (`load_encoder(...).encode`, what
`flowrec predict` runs) give the same ids; the data hash changes only for `last`; validation
refuses a bad value with its path.
"""
from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data.convert import convert
from flowrec.data.encode import truncated_lists
from flowrec.data.encoder_record import load_encoder, read_record, record_of_dataset, write_record
from flowrec.data.layout import DataError, check_spec, data_hash, read_meta
from flowrec.spec import spec_from_dict
from flowrec.spec.load import to_dict
from flowrec.spec.validate import validate_document


def reference(lists: list, rows: list, max_len: int, truncate: str) -> list:
    """Plain Python: per sample, the rows of its present elements, then the first or last max_len."""
    out, k = [], 0
    for items in lists:
        present = []
        for value in items or []:
            if value is not None:
                present.append(rows[k])
            k += 1
        out.append(present[:max_len] if truncate == "first" else present[max(0, len(present) - max_len):])
    return out


@pytest.mark.parametrize("truncate", ["first", "last"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_truncated_lists_equal_the_reference(truncate, seed):
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.5, 400) - 1, 40)  # skewed: many short and empty, some long
    lists = [[None if rng.random() < 0.2 else f"v{int(x)}" for x in rng.zipf(1.3, n)] for n in lengths]
    lists[3] = None  # a missing list
    values = pa.array(lists, pa.list_(pa.string()))
    flat = values.flatten()
    rows = rng.integers(1, 1000, len(flat))
    keep = flat.is_valid().to_numpy(zero_copy_only=False)
    for max_len in (1, 3, 7):
        got = truncated_lists(values, rows, keep, max_len, truncate).to_pylist()
        assert got == reference(lists, rows.tolist(), max_len, truncate)
    long = [r for r in reference(lists, rows.tolist(), 1000, "first") if len(r) > 3]
    assert long and any(r[:3] != r[-3:] for r in long)  # the two rules differ on this data


def spec_doc(truncate: str | None = None, max_len: int = 4) -> dict:
    clicks = {"name": "clicks", "type": "sequence", "table": "items", "max_len": max_len, "pooling": "mean"}
    if truncate is not None:
        clicks["truncate"] = truncate
    return {"name": "trunc", "features": [{"name": "item", "type": "categorical", "table": "items"}, clicks],
            "tables": [{"name": "items", "vocab": 200, "dim": 4}],
            "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
            "heads": [{"name": "h", "input": "m"}],
            "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}}


def raw_frame(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.5, rows) - 1, 12)
    clicks = ["^".join("" if rng.random() < 0.15 else str(int(v) % 150) for v in rng.zipf(1.3, n)) for n in lengths]
    return pd.DataFrame({"item": rng.zipf(1.3, rows) % 150, "clicks": clicks,
                         "label": rng.integers(0, 2, rows)})


def test_conversion_and_raw_row_scoring_keep_the_last_ids(tmp_path):
    spec = spec_from_dict(spec_doc("last"))
    raw = raw_frame(600, 0)
    src = tmp_path / "raw.csv"
    raw.to_csv(src, index=False)
    convert(spec, "csv", [src], tmp_path / "data")
    converted = pq.read_table(tmp_path / "data").column("clicks").to_pylist()
    assert read_meta(tmp_path / "data").encoding["clicks"]["truncate"] == "last"
    encoder = load_encoder(record_of_dataset(tmp_path / "data"), spec)  # as `flowrec predict --encoder-from`
    scored = encoder.encode(pa.Table.from_pandas(raw.drop(columns="label"), preserve_index=False), labels=False)
    assert scored.column("clicks").to_pylist() == converted
    rows = {v: i + 1 for i, v in enumerate(encoder.vocabs["items"].to_pylist())}  # row 0: unknown
    for text, ids in zip(raw["clicks"], converted):
        present = [s for s in (text.split("^") if isinstance(text, str) else []) if s != ""]  # "": missing
        assert ids == [rows.get(s, 0) for s in present][-4:]
    assert any(len([s for s in str(t).split("^") if s]) > 4 for t in raw["clicks"])
    record = record_of_dataset(tmp_path / "data")
    assert record.features["clicks"]["truncate"] == "last"
    write_record(record, tmp_path / "pkg_encoder")  # what a run and an export package keep
    packaged = load_encoder(read_record(tmp_path / "pkg_encoder"), spec)
    assert packaged.encode(pa.Table.from_pandas(raw, preserve_index=False), labels=False).column(
        "clicks").to_pylist() == converted
    first = spec_from_dict(spec_doc("first"))
    with pytest.raises(DataError, match="data hash"):  # data of one rule never trains with the other
        check_spec(read_meta(tmp_path / "data"), first)


def test_data_hash_changes_only_for_last():
    plain, first, last = (spec_from_dict(spec_doc(t)) for t in (None, "first", "last"))
    assert data_hash(plain) == data_hash(first) != data_hash(last)
    assert "truncate" not in json.dumps(to_dict(first)) and to_dict(last)["features"][1]["truncate"] == "last"
    assert spec_from_dict(to_dict(last)) == last


@pytest.mark.parametrize("value", ["newest", 1, True])
def test_validate_refuses_a_bad_value_with_its_path(value):
    issues = validate_document(spec_doc(value))
    assert [i.path for i in issues] == ["features[1].truncate"], issues
    assert "first, last" in issues[0].message
    assert validate_document(spec_doc("last")) == []


@pytest.mark.parametrize("truncate", [None, "last"])
def test_a_short_history_feature_is_refused_unless_it_keeps_the_last_items(truncate):
    doc = spec_doc(truncate)
    doc["features"][1]["name"] = "history"
    doc["data"] = {"format": "movielens", "path": "ml", "options": {"sequence": {"max_len": 10}}}
    paths = [i.path for i in validate_document(doc)]
    assert paths == ([] if truncate == "last" else ["features[1].max_len"])


def test_truncate_on_a_one_id_feature_is_refused():
    doc = spec_doc()
    doc["features"][0]["truncate"] = "last"
    assert [i.path for i in validate_document(doc)] == ["features[0].truncate"]
    doc["features"][0]["max_len"] = 3  # a multi-hot bag: a list
    assert validate_document(doc) == []
