"""Converters on the real files in ../shared/data and on small malformed files; the data CLI."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.convert import convert
from flowrec.data.layout import DataError, read_meta
from flowrec.spec import load_spec, spec_from_dict

OPT = {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}


def small_spec(features, heads=None, data=None):
    doc = {"name": "t", "features": features,
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
           "heads": heads or [{"name": "h", "input": "m"}], "optimizer": OPT}
    if data:
        doc["data"] = data
    return spec_from_dict(doc)


def criteo_spec(repo):
    return load_spec(repo / "specs" / "dlrm_criteo.yaml")


def test_criteo_rows_missing_and_deterministic(shared_data, repo, tmp_path):
    src = shared_data / "criteo" / "criteo_kaggle_head1000.tsv"
    spec = criteo_spec(repo)
    r1 = convert(spec, "criteo", [src], tmp_path / "a", rows_per_file=300)
    convert(spec, "criteo", [src], tmp_path / "b")
    assert r1.rows == 1000 and r1.files == 4 and r1.errors == 0
    a, b = pq.read_table(tmp_path / "a"), pq.read_table(tmp_path / "b")
    assert a.equals(b)
    raw = [line.rstrip("\n").split("\t") for line in src.read_text().splitlines()]
    c20_missing = np.array([r[14 + 19] == "" for r in raw])
    assert c20_missing.any()
    assert ((a.column("C20").to_numpy() == 0) == c20_missing).all()
    i12 = np.array([float(r[12]) if r[12] else np.nan for r in raw])
    expect = np.log1p(np.maximum(np.nan_to_num(i12, nan=0.0), 0))
    assert np.allclose(a.column("I12").to_numpy(), expect, atol=1e-6)
    assert a.column("label").to_numpy().tolist() == [float(r[0]) for r in raw]
    assert read_meta(tmp_path / "a").rows == 1000


def test_criteo_malformed_lines_skip_and_fail(repo, tmp_path):
    good = "\t".join(["1"] + ["3"] * 13 + ["abcd"] * 26)
    lines = [good, "0\t1\t2", good.replace("1\t3", "1\tx", 1), good,
             good.replace("abcd", "ab\xffcd", 1), good]
    path = tmp_path / "bad.tsv"
    path.write_bytes("\n".join(lines).replace("\xff", "").encode() .replace(b"abcd", b"ab\xffcd", 1)
                     .replace(b"ab\xffcd", b"abcd", 0) + b"\n")
    data = bytearray("\n".join(lines[:4]).encode() + b"\n")
    data += good.replace("abcd", "ab", 1).encode().replace(b"\tab\t", b"\tab\xff\t", 1) + b"\n"
    data += good.encode() + b"\n"
    path.write_bytes(bytes(data))
    spec = criteo_spec(repo)
    report = convert(spec, "criteo", [path], tmp_path / "out", on_error="skip")
    assert report.rows == 3 and report.errors == 3
    where = sorted((int(e.split(":")[1]), e) for e in report.error_examples)
    assert [w for w, _ in where] == [2, 3, 5]
    assert "field count" in where[0][1] and "non-numeric" in where[1][1] and "UTF-8" in where[2][1]
    with pytest.raises(DataError, match=r"bad.tsv:2"):
        convert(spec, "criteo", [path], tmp_path / "out2", on_error="fail")


def test_avazu_and_taobao_csv(shared_data, tmp_path):
    spec = small_spec([{"name": n, "type": "categorical", "hash_buckets": 1000, "dim": 4}
                       for n in ("site_id", "app_id", "device_model", "C14")] + [
        {"name": "hour", "type": "dense", "transform": "standardize"}])
    r = convert(spec, "avazu", [shared_data / "avazu" / "avazu_sample100.csv"], tmp_path / "av")
    t = pq.read_table(tmp_path / "av")
    assert r.rows == 100 and t.column("label").to_numpy().sum() >= 0
    assert abs(t.column("hour").to_numpy().mean()) < 1e-4
    assert read_meta(tmp_path / "av").dense["hour"]["std"] > 0
    tb = small_spec([
        {"name": "adgroup_id", "type": "categorical", "vocab": 100, "dim": 4, "min_freq": 2},
        {"name": "click_sequence", "type": "sequence", "hash_buckets": 500, "dim": 4, "max_len": 5,
         "pooling": "mean"},
        {"name": "price", "type": "dense", "transform": "log1p"}],
        data={"format": "csv", "path": "x", "label": "clk", "options": {"sequence_sep": "^"}})
    src = shared_data / "taobao" / "taobao_ad_tiny_train.csv"
    r = convert(tb, "csv", [src], tmp_path / "tb")
    t = pq.read_table(tmp_path / "tb")
    assert r.rows == 100
    seqs = t.column("click_sequence").to_pylist()
    raw = [line.split(",")[-1] for line in src.read_text().splitlines()[1:]]
    assert [len(s) for s in seqs] == [min(len([v for v in x.split("^") if v]), 5) for x in raw]
    vocab = pq.read_table(tmp_path / "tb" / "_vocab" / "adgroup_id.parquet").column("value").to_pylist()
    ids = t.column("adgroup_id").to_numpy()
    assert ((ids > 0) == np.isin([line.split(",")[3] for line in src.read_text().splitlines()[1:]], vocab)).all()


def test_movielens_columns_and_split(shared_data, tmp_path):
    from flowrec.data.sources import read_movielens
    from flowrec.data.error_log import ErrorLog

    (table,) = list(read_movielens(shared_data / "movielens-100k", {}, ErrorLog(), set()))
    assert table.column_names == ["user_id", "item_id", "rating", "timestamp", "age", "gender",
                                  "occupation", "zip_code", "genres", "release_year", "label", "rating_5",
                                  "__line__"]
    assert table.num_rows == 100_000
    assert table.column("label").to_numpy().tolist() == (table.column("rating").to_numpy() >= 4).tolist()
    assert table.column("rating_5").to_numpy().tolist() == (table.column("rating").to_numpy() == 5).tolist()
    assert "Animation" in table.column("genres")[0].as_py() or table.column("genres")[0].as_py()
    spec = small_spec([{"name": "user_id", "type": "categorical", "vocab": 943, "dim": 4},
                       {"name": "genres", "type": "sequence", "vocab": 19, "dim": 4, "max_len": 6}],
                      data={"format": "movielens", "path": "x", "options": {"test_fraction": 0.2,
                                                                           "split_seed": 1}})
    r = convert(spec, "movielens", [shared_data / "movielens-100k"], tmp_path / "ml")
    assert r.split["train"] + r.split["test"] == 100_000 and 0.18 < r.split["test"] / 1e5 < 0.22
    assert read_meta(tmp_path / "ml" / "test").split["test_fraction"] == 0.2


def test_libsvm_positions_and_errors(tmp_path):
    path = tmp_path / "x.svm"
    path.write_text("1 3:1 7:0.5\n0 4:1 9:2.0\n1 4:1\n0 5:1 7:abc\n1 a\n")
    spec = small_spec([{"name": "f0", "type": "categorical", "hash_buckets": 100, "dim": 4},
                       {"name": "f1", "type": "dense"}],
                      data={"format": "libsvm", "path": "x", "options": {"fields": ["f0", "f1"]}})
    r = convert(spec, "libsvm", [path], tmp_path / "o", on_error="skip")
    t = pq.read_table(tmp_path / "o")
    assert r.rows == 3 and r.errors == 2
    assert t.column("f1").to_pylist() == [0.5, 2.0, 0.0]
    assert [int(e.split(":")[1]) for e in r.error_examples] == [4, 5]


def test_cli_convert_synth_inspect_profile(shared_data, repo, tmp_path):
    runner = CliRunner()
    spec = str(repo / "specs" / "dlrm_criteo.yaml")
    src = str(shared_data / "criteo" / "criteo_kaggle_head1000.tsv")
    res = runner.invoke(app, ["data", "convert", "criteo", src, str(tmp_path / "c"), "--spec", spec, "-q"])
    assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["data", "inspect", str(tmp_path / "c")])
    assert res.exit_code == 0 and "1,000 rows" in res.output and "C26" in res.output
    res = runner.invoke(app, ["data", "synth", spec, "--rows", "3000", "--out", str(tmp_path / "s")])
    assert res.exit_code == 0, res.output
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["data", "profile", spec, str(tmp_path / "s"), "--budget", "64KiB",
                              "--sample-rate", "0.5", "--json", str(out), "--png", str(tmp_path / "p.png")])
    assert res.exit_code == 0, res.output
    prof = json.loads(out.read_text())
    assert prof["format"] == "flowrec-access-profile" and prof["version"] == 1
    assert set(prof["tables"]) == {f"C{i}" for i in range(1, 27)}
    assert prof["budget"]["hot_sample_fraction"] <= 1.0 and (tmp_path / "p.png").stat().st_size > 1000
    for t in prof["tables"].values():  # the counted rows and the unseen ones share every access
        assert t["hit_cdf"][-1][1] + t["unseen"]["share"] == pytest.approx(1.0)
    assert max(t["unseen"]["share"] for t in prof["tables"].values()) > 0.05  # wide tables: half a sample misses
    assert "of all accesses (est.)" in res.output
    for bad in (["data", "inspect", str(tmp_path / "nope")],
                ["data", "convert", "criteo", str(tmp_path / "nope.tsv"), str(tmp_path / "o"), "--spec", spec],
                ["data", "convert", "parquetx", src, str(tmp_path / "o"), "--spec", spec]):
        res = runner.invoke(app, bad)
        assert res.exit_code == 2 and "Traceback" not in res.output, bad
    other = tmp_path / "other.yaml"
    other.write_text(Path(spec).read_text().replace("hash_buckets: 1461", "hash_buckets: 1462"))
    res = runner.invoke(app, ["data", "profile", str(other), str(tmp_path / "s")])
    assert res.exit_code == 2 and "data hash" in res.output


NONFINITE_SPEC = """
name: nonfinite
features:
  - {name: d1, type: dense, transform: none, fill: -1.0}
  - {name: c1, type: categorical, hash_buckets: 100, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [4]}
heads:
  - {name: ctr, input: top}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: sgd, lr: 0.1}
"""


def test_dense_nan_is_filled_and_inf_is_a_malformed_row(tmp_path):
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(NONFINITE_SPEC)
    spec = load_spec(spec_path)
    raw = tmp_path / "x.csv"
    raw.write_text("label,d1,c1\n1,0.5,a\n0,nan,b\n1,-inf,c\n0,,d\n")
    with pytest.raises(DataError, match=r"x.csv:4: non-finite value '-inf' in column d1"):
        convert(spec, "csv", [raw], tmp_path / "fail")
    report = convert(spec, "csv", [raw], tmp_path / "skip", on_error="skip")
    assert report.rows == 3 and report.errors == 1
    values = pq.read_table(next((tmp_path / "skip").glob("*.parquet"))).column("d1").to_pylist()
    assert values == [0.5, -1.0, -1.0]  # nan and empty are missing values: the feature's fill


@pytest.mark.parametrize("sep", [";", "\t", "|"])
def test_a_file_of_another_separator_names_the_option_that_reads_it(tmp_path, sep):
    """A header that splits into the spec's columns by another separator: the error says which
    data.options.sep to set, and with it the file converts."""
    rng = np.random.default_rng(7)
    lines = [sep.join(["user", "price", "label"])]
    lines += [sep.join([f"u{rng.zipf(1.5) % 40}", f"{rng.lognormal():.4f}", str(int(rng.random() < 0.3))])
              for _ in range(50)]
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    feats = [{"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4},
             {"name": "price", "type": "dense"}]
    with pytest.raises(DataError, match="set data.options.sep: ") as caught:
        convert(small_spec(feats, data={"format": "csv", "label": "label"}), "csv", [tmp_path / "rows.csv"],
                tmp_path / "a")
    shown = '"\\t"' if sep == "\t" else f"'{sep}'"
    assert str(caught.value).endswith(f"set data.options.sep: {shown} in the spec")
    report = convert(small_spec(feats, data={"format": "csv", "label": "label", "options": {"sep": sep}}), "csv",
                     [tmp_path / "rows.csv"], tmp_path / "b")
    assert report.rows == 50 and report.errors == 0


def test_missing_columns_of_a_comma_file_still_say_map_them(tmp_path):
    (tmp_path / "rows.csv").write_text("id,clk\n1,0\n2,1\n")
    feats = [{"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}]
    with pytest.raises(DataError, match="map them with data.columns"):
        convert(small_spec(feats, data={"format": "csv", "label": "clk"}), "csv", [tmp_path / "rows.csv"],
                tmp_path / "a")


def test_a_vocab_too_small_for_the_data_is_a_warning_and_a_fitting_one_is_not(tmp_path):
    """Values beyond a table's vocab size all share row 0: conversion says which table, how many
    values and what share of its occurrences (the CLI on stderr); min_freq's rare values do not count."""
    rng = np.random.default_rng(11)
    users = rng.zipf(1.4, 3000) % 500
    lines = ["id,user,label"] + [f"{i},u{u},{int(rng.random() < 0.4)}" for i, u in enumerate(users)]  # rows of
    # their own (a row alike in every column is a copy: a warning of its own)
    (tmp_path / "rows.csv").write_text("\n".join(lines) + "\n")
    data = {"format": "csv", "label": "label"}

    def spec(vocab, min_freq=1):
        return small_spec([{"name": "user", "type": "categorical", "vocab": vocab, "dim": 4, "min_freq": min_freq}],
                          data=data)

    distinct = len(set(users.tolist()))
    small = convert(spec(20), "csv", [tmp_path / "rows.csv"], tmp_path / "a")
    assert len(small.warnings) == 1 and small.warnings[0].startswith(
        f"table 'user' (vocab 20) keeps 20 of {distinct:,} distinct values; the other {distinct - 20:,}")
    assert convert(spec(distinct), "csv", [tmp_path / "rows.csv"], tmp_path / "b").warnings == ()
    frequent = sum(1 for c in np.unique(users, return_counts=True)[1] if c >= 40)
    assert convert(spec(frequent, 40), "csv", [tmp_path / "rows.csv"], tmp_path / "c").warnings == ()
    path = tmp_path / "spec.yaml"
    import yaml
    path.write_text(yaml.safe_dump({"name": "t", "features": [{"name": "user", "type": "categorical", "vocab": 20,
                                                                 "dim": 4}],
                                    "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
                                    "heads": [{"name": "h", "input": "m"}], "optimizer": OPT, "data": data}))
    result = CliRunner().invoke(app, ["data", "convert", "csv", str(tmp_path / "rows.csv"), str(tmp_path / "d"),
                                      "--spec", str(path), "-q"])
    assert result.exit_code == 0, result.output
    assert [line for line in result.stderr.splitlines() if line.startswith("warning: ")] == \
        [f"warning: {small.warnings[0]}"]


def _raw_rows(rng: np.random.Generator, rows: int):
    import pandas as pd

    price = rng.lognormal(1.0, 1.0, rows)
    price[::17] = np.nan  # missing
    return pd.DataFrame({"user": [f"u{u}" for u in rng.zipf(1.5, rows) % 300], "city": rng.zipf(1.3, rows) % 50,
                         "price": price, "label": (rng.random(rows) < 0.3).astype(int)})


RAW_FEATURES = [{"name": "user", "type": "categorical", "hash_buckets": 97, "dim": 4},
                {"name": "city", "type": "categorical", "vocab": 30, "dim": 4},
                {"name": "price", "type": "dense", "transform": "log1p"}]


def test_raw_parquet_converts_as_the_same_rows_in_csv(tmp_path):
    """`data convert parquet`: a file and a Hive-partitioned folder of raw rows encode bitwise as the
    same rows written as CSV (NaN read as CSV's empty field: missing)."""
    rng = np.random.default_rng(5)
    df = _raw_rows(rng, 3000)
    df.to_csv(tmp_path / "rows.csv", index=False, na_rep="")
    df.to_parquet(tmp_path / "rows.parquet", row_group_size=700)
    spec = small_spec(RAW_FEATURES, data={"format": "csv", "label": "label"})
    convert(spec, "csv", [tmp_path / "rows.csv"], tmp_path / "from_csv")
    report = convert(spec, "parquet", [tmp_path / "rows.parquet"], tmp_path / "from_parquet")
    assert report.rows == 3000 and report.errors == 0
    expect = pq.read_table(tmp_path / "from_csv")
    assert pq.read_table(tmp_path / "from_parquet").equals(expect)
    folder = tmp_path / "table"
    for part, rows in (("a", df.iloc[:1200]), ("b", df.iloc[1200:])):
        (folder / f"day={part}").mkdir(parents=True)
        rows.to_parquet(folder / f"day={part}" / "part-0.parquet")
    (folder / "_SUCCESS").write_text("")
    convert(spec, "parquet", [folder], tmp_path / "from_folder")
    got = pq.read_table(tmp_path / "from_folder")
    assert got.equals(expect), "a folder of parts reads as one file"


def test_raw_parquet_huge_numbers_encode_as_their_csv_text(tmp_path):
    """Float ids beyond int64 (inf) were cast to int64 for their string form and all became one id,
    INT64_MIN; an int64 dense value beyond 2**53 failed the whole input ("not in range"). Both now
    encode as the same rows written as CSV text (float ids of 2**53 or more are refused:
    test_raw_parquet_float_ids_that_may_be_rounded_are_refused)."""
    import pandas as pd

    df = pd.DataFrame({"user": ["a", "b", "c", "d", "e"], "city": [2.0 ** 53 - 1, 2.5, np.inf, 3.0, -(2.0 ** 53 - 1)],
                       "price": np.array([2 ** 62, 1, -(2 ** 60), 0, 5], np.int64), "label": [0, 1, 1, 0, 1]})
    df.to_parquet(tmp_path / "rows.parquet")
    (tmp_path / "rows.csv").write_text("user,city,price,label\na,9007199254740991,4611686018427387904,0\nb,2.5,1,1\n"
                                       "c,inf,-1152921504606846976,1\nd,3,0,0\ne,-9007199254740991,5,1\n")
    spec = small_spec(RAW_FEATURES, data={"format": "csv", "label": "label"})
    convert(spec, "csv", [tmp_path / "rows.csv"], tmp_path / "from_csv")
    report = convert(spec, "parquet", [tmp_path / "rows.parquet"], tmp_path / "from_parquet")
    assert report.rows == 5 and report.errors == 0
    got = pq.read_table(tmp_path / "from_parquet")
    assert len(set(got.column("city").to_pylist())) == 5
    assert got.equals(pq.read_table(tmp_path / "from_csv"))


def test_raw_parquet_id_columns_of_structs_or_nested_lists_are_one_line(tmp_path):
    """A Parquet id column of structs (or lists of lists) was a traceback from Arrow's cast to text
    ('Unsupported cast from struct<a: int64> to utf8'), and bytes that are not UTF-8 a line naming
    neither file nor column; now each is one line naming both, as predict says it."""
    import pandas as pd

    spec = small_spec(RAW_FEATURES, data={"format": "csv", "label": "label"})
    for i, (city, says) in enumerate((([{"a": 1}, {"a": 2}], r"holds struct<a: int64>, not one id per row"),
                                      ([[["x"]], [["y"]]], r"holds list<element: list<element: string>>"),
                                      ([b"\xff\xfe", b"ok"], r"holds bytes that are not UTF-8 text"))):
        pd.DataFrame({"user": ["a", "b"], "city": city, "price": [1.0, 2.0], "label": [0, 1]}).to_parquet(
            tmp_path / f"rows{i}.parquet")
        with pytest.raises(DataError, match=rf"rows{i}\.parquet: column city {says}"):
            convert(spec, "parquet", [tmp_path / f"rows{i}.parquet"], tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()


def test_raw_parquet_float_ids_that_may_be_rounded_are_refused(tmp_path):
    """pandas writes an integer id column with a missing value as float64: 2**60 + 1 was already
    2**60 in the Parquet file, and conversion encoded the float's text, another user's id, without
    a word. Now a float id of 2**53 or more (float32: 2**24) is one line naming the file, the column,
    its row and nullable Int64; the same ids as Int64 convert as their text does."""
    import pandas as pd

    spec = small_spec(RAW_FEATURES, data={"format": "csv", "label": "label"})
    for i, city in enumerate((pd.Series([3, None, 2**60 + 1], dtype="float64"),
                              pd.Series([3, 2**24 + 1, 1], dtype="float32"))):
        pd.DataFrame({"user": ["a", "b", "c"], "city": city, "price": [1.0, 2.0, 3.0],
                      "label": [0, 1, 1]}).to_parquet(tmp_path / f"rows{i}.parquet")
        with pytest.raises(DataError, match=rf"rows{i}.parquet: column city: id \d+\.0 at row {3 - i} \(1-based\) is "
                                            r"a float of magnitude 2\*\*(53|24) or more.*nullable dtype \"Int64\""):
            convert(spec, "parquet", [tmp_path / f"rows{i}.parquet"], tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()
    pd.DataFrame({"user": ["a", "b", "c"], "city": pd.Series([3, None, 2**60 + 1], dtype="Int64"),
                  "price": [1.0, 2.0, 3.0], "label": [0, 1, 1]}).to_parquet(tmp_path / "exact.parquet")
    (tmp_path / "exact.csv").write_text(f"user,city,price,label\na,3,1,0\nb,,2,1\nc,{2**60 + 1},3,1\n")
    convert(spec, "parquet", [tmp_path / "exact.parquet"], tmp_path / "from_parquet")
    convert(spec, "csv", [tmp_path / "exact.csv"], tmp_path / "from_csv")
    assert pq.read_table(tmp_path / "from_parquet").equals(pq.read_table(tmp_path / "from_csv"))


def test_raw_parquet_bad_numbers_are_malformed_rows_and_wrong_types_one_line(tmp_path):
    import pandas as pd

    df = _raw_rows(np.random.default_rng(6), 200)
    df.loc[[3, 50], "price"] = [np.inf, 1e300]
    df.to_parquet(tmp_path / "rows.parquet")
    spec = small_spec(RAW_FEATURES, data={"format": "csv", "label": "label"})
    with pytest.raises(DataError, match="non-finite value inf in column price"):
        convert(spec, "parquet", [tmp_path / "rows.parquet"], tmp_path / "a")
    report = convert(spec, "parquet", [tmp_path / "rows.parquet"], tmp_path / "b", on_error="skip")
    assert report.rows == 198 and report.errors == 2
    assert any("value beyond float32" in e for e in report.error_examples)
    pd.DataFrame({"user": ["a", "b"], "city": [1, 2], "price": [[1.0], [2.0]], "label": [0, 1]}).to_parquet(
        tmp_path / "lists.parquet")
    with pytest.raises(DataError, match="column price holds list<element: double> values; a label or dense"):
        convert(spec, "parquet", [tmp_path / "lists.parquet"], tmp_path / "c")
    (tmp_path / "not.parquet").write_text("user,label\na,1\n")
    with pytest.raises(DataError, match="cannot read .*not.parquet as Parquet"):
        convert(spec, "parquet", [tmp_path / "not.parquet"], tmp_path / "d")
    assert not (tmp_path / "c").exists() and not (tmp_path / "d").exists()


def test_a_header_naming_a_column_twice_is_one_line_through_the_cli(tmp_path):
    """It was a KeyError traceback from pyarrow; which of the two columns is meant is unknowable."""
    (tmp_path / "rows.csv").write_text("user,label,user\nu1,0,x\nu2,1,y\n")
    spec = small_spec([{"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
                      data={"format": "csv", "label": "label"})
    with pytest.raises(DataError, match=r"rows.csv: the header names column 'user' twice \(columns 1 and 3\)"):
        convert(spec, "csv", [tmp_path / "rows.csv"], tmp_path / "a")
    import yaml
    (tmp_path / "s.yaml").write_text(yaml.safe_dump({
        "name": "t", "features": [{"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}], "optimizer": OPT, "data": {"format": "csv", "label": "label"}}))
    result = CliRunner().invoke(app, ["data", "convert", "csv", str(tmp_path / "rows.csv"), str(tmp_path / "b"),
                                      "--spec", str(tmp_path / "s.yaml"), "-q"])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.stderr.strip().splitlines()[-1].endswith("the header names column 'user' twice (columns 1 and 3): "
                                                           "rename one")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize("encoding", ["latin-1", "cp1252", "utf-16"])
def test_a_csv_in_another_encoding_reads_with_data_options_encoding(tmp_path, encoding):
    """data.options.encoding transcodes the text (header included) to UTF-8: the dataset equals the
    UTF-8 file's; without it a non-UTF-8 value is a malformed row that names the option."""
    rng = np.random.default_rng(len(encoding))
    towns = ["Zürich", "Málaga", "Besançon", "Nîmes", "Tromsø", "Köln"]
    lines = ["ville,prix,label"] + [f"{towns[rng.zipf(1.5) % 6]},{rng.lognormal():.3f},{int(rng.random() < 0.4)}"
                                    for _ in range(300)]
    text = "\n".join(lines) + "\n"
    (tmp_path / "utf8.csv").write_text(text, encoding="utf-8")
    (tmp_path / "other.csv").write_bytes(text.encode(encoding))
    feats = [{"name": "town", "type": "categorical", "vocab": 8, "dim": 4}, {"name": "price", "type": "dense"}]
    data = {"format": "csv", "label": "label", "columns": {"town": "ville", "price": "prix"}}
    convert(small_spec(feats, data=data), "csv", [tmp_path / "utf8.csv"], tmp_path / "a")
    convert(small_spec(feats, data={**data, "options": {"encoding": encoding}}), "csv", [tmp_path / "other.csv"],
            tmp_path / "b")
    assert pq.read_table(tmp_path / "b").equals(pq.read_table(tmp_path / "a"))
    if encoding != "utf-16":  # UTF-16's header itself is not UTF-8: one line about the header
        with pytest.raises(DataError, match="invalid UTF-8 in column ville; another encoding\\? set data.options.encoding"):
            convert(small_spec(feats, data=data), "csv", [tmp_path / "other.csv"], tmp_path / "c")
    else:  # told as UTF-16 by its byte-order mark, where latin-1 (the usual suggestion) reads it as garbage
        with pytest.raises(DataError, match="the header is not valid UTF-8 .*UTF-16 byte-order mark: set data.options.encoding: utf-16"):
            convert(small_spec(feats, data=data), "csv", [tmp_path / "other.csv"], tmp_path / "c")
    with pytest.raises(DataError, match="unknown text encoding 'klingon'"):
        convert(small_spec(feats, data={**data, "options": {"encoding": "klingon"}}), "csv",
                [tmp_path / "other.csv"], tmp_path / "d")


@pytest.mark.parametrize("header", ["bom", "quoted", "utf-16", "blank_lines"])
def test_a_header_with_a_byte_order_mark_or_quotes_still_reads_its_ids_as_text(tmp_path, header):
    """The header was split by hand, so a UTF-8 byte order mark, quoted names or UTF-16's two-byte
    newline (big-endian) gave names that were not the columns pyarrow read: those columns' types were inferred,
    and ids "007", "7" and "7.0" encoded as one row. Each header now gives the plain file's dataset.
    So did blank lines before the header (pyarrow skips them, the header's reader read a blank name)."""
    rows = "007,1,0.5,007\n7,0,1.5,7\n7.0,1,2,7.0\n8,0,3,8\n"  # first and last columns: ids
    plain = "user,label,price,item\n" + rows
    (tmp_path / "plain.csv").write_text(plain)
    options = {"utf-16": {"encoding": "utf-16"}}.get(header, {})
    content = {"bom": b"\xef\xbb\xbf" + plain.encode(),
               "quoted": ('"user","label","price","item"\n' + rows).encode(),
               "utf-16": b"\xfe\xff" + plain.encode("utf-16-be"),  # big-endian: newline b"\0\n"
               "blank_lines": b"\n\r\n" + plain.encode()}[header]
    (tmp_path / "other.csv").write_bytes(content)
    feats = [{"name": "user", "type": "categorical", "hash_buckets": 1000, "dim": 4},
             {"name": "item", "type": "categorical", "hash_buckets": 1000, "dim": 4}, {"name": "price", "type": "dense"}]
    data = {"format": "csv", "label": "label"}
    convert(small_spec(feats, data=data), "csv", [tmp_path / "plain.csv"], tmp_path / "a")
    convert(small_spec(feats, data={**data, "options": options}), "csv", [tmp_path / "other.csv"], tmp_path / "b")
    a = pq.read_table(tmp_path / "a")
    assert len(set(a.column("user").to_pylist())) == len(set(a.column("item").to_pylist())) == 4  # distinct ids
    assert pq.read_table(tmp_path / "b").equals(a)


@pytest.mark.parametrize("suffix", [".gz", ".bz2", ".GZ"])
def test_a_compressed_csv_reads_as_the_plain_file_when_a_later_block_holds_text(tmp_path, suffix):
    """The header of a compressed file was read from its compressed bytes, so its columns were not
    read as text: a categorical column of digits whose later block held a word failed the whole
    input. Compressed and plain now give the same dataset (small blocks put the word in a later one).
    An upper-case extension (ROWS.CSV.GZ) was not decompressed at all: 'not valid UTF-8'."""
    import bz2
    import gzip

    rng = np.random.default_rng(3)
    lines = ["user,city,label"] + [f"{rng.zipf(1.4) % 900},{rng.integers(0, 40)},{int(rng.random() < 0.3)}"
                                   for _ in range(4000)] + ["anonymous,Oslo,1", ",,0"]
    text = ("\n".join(lines) + "\n").encode()
    (tmp_path / "rows.csv").write_bytes(text)
    (tmp_path / f"rows.csv{suffix}").write_bytes((gzip.compress if suffix.lower() == ".gz" else bz2.compress)(text))
    feats = [{"name": "user", "type": "categorical", "hash_buckets": 512, "dim": 4},
             {"name": "city", "type": "categorical", "vocab": 64, "dim": 4}]
    spec = small_spec(feats, data={"format": "csv", "label": "label", "options": {"chunk_bytes": 4096}})
    plain = convert(spec, "csv", [tmp_path / "rows.csv"], tmp_path / "a")
    packed = convert(spec, "csv", [tmp_path / f"rows.csv{suffix}"], tmp_path / "b")
    assert plain.rows == packed.rows == 4002
    assert pq.read_table(tmp_path / "b").equals(pq.read_table(tmp_path / "a"))


def test_compressed_libsvm_and_criteo_test_files_read_as_plain(tmp_path, shared_data):
    import gzip

    from flowrec.data.sources import criteo_has_label

    rng = np.random.default_rng(4)
    lines = [f"{int(rng.random() < 0.5)} 0:{rng.lognormal():.4f} 1:{rng.zipf(1.5) % 50}" for _ in range(200)]
    (tmp_path / "t.libsvm").write_text("\n".join(lines) + "\n")
    (tmp_path / "t.libsvm.gz").write_bytes(gzip.compress((tmp_path / "t.libsvm").read_bytes()))
    spec = small_spec([{"name": "x", "type": "dense"}, {"name": "c", "type": "categorical", "hash_buckets": 64,
                                                         "dim": 4}],
                      data={"format": "libsvm", "label": "label", "options": {"fields": ["x", "c"]}})
    convert(spec, "libsvm", [tmp_path / "t.libsvm"], tmp_path / "a")
    convert(spec, "libsvm", [tmp_path / "t.libsvm.gz"], tmp_path / "b")
    assert pq.read_table(tmp_path / "b").equals(pq.read_table(tmp_path / "a"))
    src = shared_data / "criteo" / "criteo_kaggle_head1000.tsv"
    if not src.is_file():
        pytest.skip("Criteo head not in ../shared/data")
    test_rows = "".join(line.split("\t", 1)[1] for line in src.read_text().splitlines(keepends=True)[:50])
    (tmp_path / "test.txt.gz").write_bytes(gzip.compress(test_rows.encode()))
    (tmp_path / "day.tsv.gz").write_bytes(gzip.compress(src.read_bytes()))
    assert criteo_has_label(tmp_path / "test.txt.gz") is False and criteo_has_label(tmp_path / "day.tsv.gz") is True


def test_a_libsvm_feature_map_beside_the_spec_is_read_from_the_specs_folder(tmp_path, monkeypatch):
    """data.options.feature_map was read from the working folder while data.path is read from the
    spec's: `flowrec data convert libsvm /x/t.libsvm out --spec /x/s.yaml` run elsewhere said
    'cannot read feature map fmap.txt'. Now a relative map beside the spec is found, from anywhere
    (and training on the spec's bound libsvm data reads it too); the rows equal a run from /x."""
    import random

    import yaml

    rng = random.Random()
    project, elsewhere = tmp_path / "x", tmp_path / "elsewhere"
    project.mkdir()
    elsewhere.mkdir()
    (project / "fmap.txt").write_text("".join(f"{i} user\n" for i in range(1, 41)) +
                                      "".join(f"{i} item\n" for i in range(41, 66)) + "66 price\n")
    (project / "t.libsvm").write_text("".join(
        f"{rng.randrange(2)} {1 + int(rng.paretovariate(1.2)) % 40}:1 {41 + rng.randrange(25)}:1 66:{rng.random() * 9:.3f}\n"
        for _ in range(120)))
    doc = {"name": "ls", "features": [{"name": "price", "type": "dense"},
                                      {"name": "user", "type": "categorical", "hash_buckets": 50, "dim": 4},
                                      {"name": "item", "type": "categorical", "hash_buckets": 30, "dim": 4}],
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "h", "input": "m"}], "optimizer": OPT,
           "data": {"format": "libsvm", "path": "t.libsvm", "options": {"feature_map": "fmap.txt"}}}
    (project / "s.yaml").write_text(yaml.safe_dump(doc))
    runner = CliRunner()
    monkeypatch.chdir(elsewhere)
    result = runner.invoke(app, ["data", "convert", "libsvm", str(project / "t.libsvm"), str(tmp_path / "a"),
                                 "--spec", str(project / "s.yaml"), "-q"])
    assert result.exit_code == 0, result.output
    monkeypatch.chdir(project)
    result = runner.invoke(app, ["data", "convert", "libsvm", "t.libsvm", str(tmp_path / "b"), "--spec", "s.yaml", "-q"])
    assert result.exit_code == 0, result.output
    a, b = pq.read_table(tmp_path / "a"), pq.read_table(tmp_path / "b")
    assert a.num_rows == 120 and a.equals(b) and len(set(a.column("user").to_pylist())) > 3
    monkeypatch.chdir(elsewhere)
    from flowrec.runtime.session import bound_dataset

    folder = bound_dataset(load_spec(project / "s.yaml"), project / "s.yaml", tmp_path / "run", lambda _: None)
    assert pq.read_table(folder).num_rows == 120


def test_encoder_from_reads_libsvm_rows_with_the_encoders_feature_map(tmp_path, monkeypatch):
    """`data convert libsvm day2.libsvm OUT --spec s.yaml --encoder-from RUN` read day 2 with the
    feature map beside the spec, though the encoder records the map its ids were read with: a map
    edited since (or another project's) put each index in another column without a word. Now the
    encoder's map reads the rows, as `flowrec predict` reads a package's."""
    import random

    import yaml

    rng = random.Random()
    (tmp_path / "fmap.txt").write_text("".join(f"{i} user\n" for i in range(1, 41)) +
                                       "".join(f"{i} item\n" for i in range(41, 66)))
    for day in ("d1", "d2"):
        (tmp_path / f"{day}.libsvm").write_text("".join(
            f"{rng.randrange(2)} {1 + rng.randrange(40)}:1 {41 + rng.randrange(25)}:1\n" for _ in range(100)))
    doc = {"name": "ls", "features": [{"name": "user", "type": "categorical", "hash_buckets": 50, "dim": 4},
                                      {"name": "item", "type": "categorical", "hash_buckets": 30, "dim": 4}],
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
           "heads": [{"name": "h", "input": "m"}], "optimizer": OPT,
           "data": {"format": "libsvm", "options": {"feature_map": "fmap.txt"}}}
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()

    def run(*args):
        result = runner.invoke(app, ["data", "convert", "libsvm", *args, "--spec", "s.yaml", "-q"])
        assert result.exit_code == 0, result.output

    run("d1.libsvm", "a")
    run("d2.libsvm", "expected", "--encoder-from", "a")
    (tmp_path / "fmap.txt").write_text("".join(f"{i} item\n" for i in range(1, 41)) +  # edited since
                                       "".join(f"{i} user\n" for i in range(41, 66)))
    run("d2.libsvm", "b", "--encoder-from", "a")
    expected, b = pq.read_table(tmp_path / "expected"), pq.read_table(tmp_path / "b")
    assert expected.num_rows == 100 and expected.equals(b)
