"""Raw readers given hostile forms of real inputs: each test names what was read wrong before its
fix (a traceback, a silent wrong value, a lost file) and fails on the code before it."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import DataError
from flowrec.data.sources import read_libsvm


@pytest.mark.parametrize("twice", ["categorical", "dense"])
def test_a_libsvm_index_given_twice_in_a_row_is_a_malformed_row(tmp_path: Path, twice: str):
    """`1:7 1:7` was the id '7^7' of a one-hot column, and `3:0.1 3:0.9` the value 0.9, without a
    word (svmlight's indices are unique in a row; scikit-learn refuses such a file); a row whose two
    indices give one dense column took the last. Each is a malformed row naming the index."""
    rng = np.random.default_rng()
    fmap = tmp_path / "map.txt"
    fmap.write_text("1 user\n2 item\n3 price\n4 price\n")
    lines = [f"{int(rng.random() < 0.2)} 1:{rng.zipf(1.4) % 500} 2:{rng.zipf(1.2) % 90} 3:{rng.lognormal():.4f}"
             for _ in range(int(rng.integers(20, 60)))]
    bad = int(rng.integers(0, len(lines)))
    label, user, item, price = lines[bad].split()
    lines[bad] = " ".join([label, user, user, item, price] if twice == "categorical" else
                          [label, user, item, price, f"3:{rng.lognormal():.4f}"])
    other = (bad + 1) % len(lines)
    lines[other] += f" 4:{rng.lognormal():.4f}"  # a second index of the dense column price
    path = tmp_path / "rows.libsvm"
    path.write_text("\n".join(lines) + "\n")
    options = {"feature_map": str(fmap)}
    with pytest.raises(DataError, match=rf":{min(bad, other) + 1}: "):
        list(read_libsvm(path, options, ErrorLog("fail", str(path)), {"price"}))
    log = ErrorLog("skip", str(path))
    rows = [t for t in read_libsvm(path, options, log, {"price"})]
    kept = sum(t.num_rows for t in rows)
    assert kept == len(lines) - 2 and log.count == 2
    reasons = {e.line: e.reason for e in log.examples}
    assert ("1 of column user" if twice == "categorical" else "3 of column price") + " twice in the row" in reasons[bad + 1]
    assert reasons[other + 1].startswith("indices 3 and 4 both give the dense column price")
    users = [u for t in rows for u in t.column("user").to_pylist()]
    assert not any("^" in u for u in users)


def test_a_libsvm_row_giving_a_one_hot_feature_two_indices_is_malformed(tmp_path: Path):
    """A feature map naming one column for several indices (libfm's field given twice alike) joins a
    row's indices with '^' for a multi-hot feature; a one-hot feature encoded the text '7^9' as one
    id, without a word. Such a row is malformed for a one-hot feature and read as before for a
    multi-hot one."""
    import pyarrow.parquet as pq

    from flowrec.data.convert import convert
    from flowrec.spec import spec_from_dict

    def spec(**user):
        return spec_from_dict({
            "name": "svm", "features": [{"name": "user", "type": "categorical", "hash_buckets": 997, "dim": 4, **user},
                                        {"name": "price", "type": "dense"}],
            "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse", "@dense"], "layers": [4]}],
            "heads": [{"name": "h", "input": "m"}],
            "data": {"format": "libsvm", "options": {"feature_map": str(tmp_path / "map.txt")}},
            "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})

    rng = np.random.default_rng()
    (tmp_path / "map.txt").write_text("\n".join(f"{i} user" for i in range(1, 50)) + "\n50 price\n")
    n = int(rng.integers(20, 60))
    lines = [f"{int(rng.random() < 0.2)} {rng.zipf(1.3) % 49 + 1}:1 50:{rng.lognormal():.4f}" for _ in range(n)]
    bad = int(rng.integers(0, n))
    label, user, price = lines[bad].split()
    other = int(user.split(":")[0]) % 49 + 1  # another index of the same column
    lines[bad] = f"{label} {user} {other}:1 {price}"
    path = tmp_path / "rows.libsvm"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=rf"rows.libsvm:{bad + 1}: 2 indices .* give the column user of the one-hot"):
        convert(spec(), "libsvm", [path], tmp_path / "a")
    report = convert(spec(), "libsvm", [path], tmp_path / "b", on_error="skip")
    assert report.rows == n - 1 and report.errors == 1
    report = convert(spec(max_len=2), "libsvm", [path], tmp_path / "c")
    assert report.rows == n
    ids = pq.read_table(tmp_path / "c").column("user").to_pylist()
    assert len(ids[bad]) == 2 and all(len(row) == 1 for i, row in enumerate(ids) if i != bad)


def test_predict_refuses_a_libsvm_row_giving_a_one_hot_feature_two_indices(tmp_path: Path):
    """`flowrec predict PKG rows.libsvm` scored a row whose two indices map to a one-hot feature's
    column as the id '7^9', which no training row had, without a word; it is a malformed row, as
    in `data convert` (--on-error fail: exit 2 naming the line, nothing written; skip: the others)."""
    import pyarrow.parquet as pq

    from package_flow import invoke

    rng = np.random.default_rng()
    (tmp_path / "map.txt").write_text("\n".join(f"{i} user" for i in range(1, 50)) + "\n50 price\n")
    (tmp_path / "spec.yaml").write_text(
        "name: svm\nfeatures:\n  - {name: user, type: categorical, hash_buckets: 97, dim: 4}\n"
        "  - {name: price, type: dense}\nmodules:\n  - {name: m, kind: mlp, inputs: ['@sparse', '@dense'], layers: [4]}\n"
        "heads:\n  - {name: h, input: m}\ndata: {format: libsvm, options: {feature_map: map.txt}}\n"
        "optimizer: {dense: {name: adam, lr: 0.01}, sparse: {name: sgd, lr: 0.1}}\ntraining: {batch_size: 16}\n")

    def rows(n: int) -> list[str]:
        return [f"{int(rng.random() < 0.2)} {rng.zipf(1.3) % 49 + 1}:1 50:{rng.lognormal():.4f}" for _ in range(n)]

    (tmp_path / "train.libsvm").write_text("\n".join(rows(200)) + "\n")
    for args in (["data", "convert", "libsvm", tmp_path / "train.libsvm", tmp_path / "data", "--spec",
                  tmp_path / "spec.yaml", "-q"],
                 ["train", tmp_path / "spec.yaml", "--data", tmp_path / "data", "--out", tmp_path / "run",
                  "--max-steps", "2", "-q", "--device", "cpu"],
                 ["export", tmp_path / "run", tmp_path / "pkg"]):
        assert invoke(args).exit_code == 0, args[0]
    scored = rows(int(rng.integers(10, 30)))
    bad = int(rng.integers(0, len(scored)))
    label, user, price = scored[bad].split()
    scored[bad] = f"{label} {user} {int(user.split(':')[0]) % 49 + 1}:1 {price}"
    (tmp_path / "rows.libsvm").write_text("\n".join(scored) + "\n")
    out = tmp_path / "scores.parquet"
    refused = invoke(["predict", tmp_path / "pkg", tmp_path / "rows.libsvm", "--out", out, "-q"])
    assert refused.exit_code == 2 and f"rows.libsvm:{bad + 1}: 2 indices" in refused.output and not out.exists()
    skipped = invoke(["predict", tmp_path / "pkg", tmp_path / "rows.libsvm", "--out", out, "-q", "--on-error", "skip"])
    assert skipped.exit_code == 0 and pq.read_table(out).num_rows == len(scored) - 1


def _svm_spec():
    from flowrec.spec import spec_from_dict

    return spec_from_dict({
        "name": "svm", "features": [{"name": "user", "type": "categorical", "hash_buckets": 997, "dim": 4},
                                    {"name": "price", "type": "dense"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse", "@dense"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}], "data": {"format": "libsvm", "options": {"fields": ["user", "price"]}},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})


BAD_TOKENS = {  # a row of the columns user, price (by position) -> the start of what its line says
    "empty_index": ("1 :7 2:1", "token ':7' has an empty index ("),  # was the id ''
    "empty_value": ("1 5: 2:1", "token '5:' has an empty value ("),  # was the id 5
    "empty_both": ("1 : 2:1", "token ':' has an empty index and an empty value ("),
    "text_value": ("1 5:x 2:1", "token '5:x' has the value 'x', not a number ("),  # was the id 5
    "negative_index": ("1 -3:1 2:1", "token '-3:1' has the index '-3': an index written as a number is a whole"),
    "fraction_index": ("1 5.5:1 2:1", "token '5.5:1' has the index '5.5': an index written as a number"),
    "empty_index_libfm": ("1 0::1 2:1", "token '0::1' has an empty index ("),  # was 'more tokens than fields'
    "three_colons": ("1 0:5:1:1 2:1", "token '0:5:1:1' has 3 colons ("),
    "field_past": ("1 7:5:1 2:1", "token '7:5:1' gives the field 7, past the 2 of the fields option"),
    "field_unknown": ("1 usr:5:1 2:1", "token 'usr:5:1' gives the field 'usr', which names no column"),  # was dropped
    "label_text": ("yes 5:1 2:1", "label 'yes' is not a number (a libsvm row is: label index:value"),
    "dense_text": ("1 5:1 2:abc", "token '2:abc' has the value 'abc', not a number, for the dense column price"),
    "dense_underscore": ("1 5:1 2:1_000", "token '2:1_000' has the value '1_000', not a number"),  # was 1000
    "qid_empty": ("1 qid: 5:1 2:1", "token 'qid:' is a query id that is no whole number"),  # was skipped
}


@pytest.mark.parametrize("case", sorted(BAD_TOKENS))
def test_a_libsvm_token_of_another_form_is_a_malformed_row_naming_it(tmp_path: Path, case: str):
    """`1 :7 3:1` gave the user the id '' and `1 5: 3:1` (or `5:x`) the id 5, a negative or
    fractional index was an id, a libfm field naming no column was dropped, without a word; a
    field past `fields` said 'more tokens than fields', a text label or dense value Python's 'could
    not convert string to float'. Each is a malformed row naming the file, line and token (and
    what a token looks like, where its form is wrong); `data convert` writes nothing, and skipping
    drops that row alone."""
    from flowrec.data.convert import convert

    row, reason = BAD_TOKENS[case]
    rng = np.random.default_rng()
    lines = [f"{int(rng.random() < 0.3)} {rng.zipf(1.3) % 90}:1 2:{rng.lognormal():.4f}"
             for _ in range(int(rng.integers(5, 40)))]
    bad = int(rng.integers(0, len(lines) + 1))
    lines.insert(bad, row)
    path = tmp_path / "rows.libsvm"
    path.write_text("\n".join(lines) + "\n")
    options = {"fields": ["user", "price"]}
    with pytest.raises(DataError) as info:
        list(read_libsvm(path, options, ErrorLog("fail", str(path)), {"price"}))
    line = str(info.value)
    assert line.startswith(f"malformed row at {path}:{bad + 1}: {reason}") and "\n" not in line
    if "(" in reason[-1:]:
        assert "a libsvm token is index:value, e.g. 5:1" in line
    out = tmp_path / "out"
    with pytest.raises(DataError, match=f"rows.libsvm:{bad + 1}: "):
        convert(_svm_spec(), "libsvm", [path], out)
    assert not out.exists()
    report = convert(_svm_spec(), "libsvm", [path], out, on_error="skip")
    assert report.rows == len(lines) - 1 and report.errors == 1


def test_libsvm_forms_the_format_allows_read_as_plain_rows(tmp_path: Path):
    """Tabs between tokens, a comment after a row, a `+1` label, index 0 (svmlight's zero-based
    files), a text index (libfm's `user:u12:1`) and an index past 64 bits (kept as text, as a CSV
    keeps such an id) are rows, read as their plain forms are."""
    plain = ["1 5:1 2:0.5", "0 7:1 2:1.5", "1 0:1 2:2", "0 u12:1 2:3", "1 99999999999999999999999:1 2:4"]
    forms = ["1\t5:1\t2:0.5", "0 7:1 2:1.5 # seen twice", "+1 0:1 2:2e0", "0 0:u12:1 1:2:3",
             "1  99999999999999999999999:1.0 2:4"]
    tables = []
    for name, rows in (("plain", plain), ("forms", forms)):
        path = tmp_path / f"{name}.libsvm"
        path.write_text("\n".join(rows) + "\n")
        tables.append(pa.concat_tables(read_libsvm(path, {"fields": ["user", "price"]}, ErrorLog("fail", str(path)),
                                                   {"price"})))
    assert tables[0].equals(tables[1])
    assert tables[0].column("user").to_pylist() == ["5", "7", "0", "u12", "99999999999999999999999"]


def test_a_feature_map_giving_an_index_two_columns_is_one_line_naming_both(tmp_path: Path):
    """`3 user` and, later, `3 price` in a feature map read every index 3 as price (the last line's),
    without a word. It is one line naming the map, both lines and both columns, and nothing is
    read; a line repeated as it was (the same column) is no conflict."""
    rng = np.random.default_rng()
    n = int(rng.integers(4, 30))
    names = [("user", "price")[i % 2] for i in range(n)]
    map_lines = [f"{i + 1} {name}" for i, name in enumerate(names)]
    first = int(rng.integers(0, n))
    other = "price" if names[first] == "user" else "user"
    again = map_lines + [map_lines[first]] + [f"{first + 1} {other}"]
    (tmp_path / "map.txt").write_text("\n".join(again) + "\n")
    path = tmp_path / "rows.libsvm"
    path.write_text("1 1:1\n")
    with pytest.raises(DataError) as info:
        list(read_libsvm(path, {"feature_map": str(tmp_path / "map.txt")}, ErrorLog("fail", str(path)), {"price"}))
    assert str(info.value) == (f"feature map {tmp_path / 'map.txt'}:{n + 2}: index '{first + 1}' is given the column "
                               f"'{other}', and the column '{names[first]}' on line {first + 1} (an index is one column)")
    (tmp_path / "map.txt").write_text("\n".join(map_lines + [map_lines[first]]) + "\n")
    rows = pa.concat_tables(read_libsvm(path, {"feature_map": str(tmp_path / "map.txt")}, ErrorLog("fail", str(path)),
                                        {"price"}))
    assert rows.column("user").to_pylist() == ["1"]
