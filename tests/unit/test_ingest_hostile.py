"""Raw data on its way in, as a hostile user gives it: the seeded train/test split, Parquet folders
whose files disagree, spec files that are not there. One test per defect (each fails on the code
before its fix)."""
from __future__ import annotations

import re
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from flowrec.data.convert import convert, split_mask
from flowrec.data.layout import DataError
from flowrec.testing.specs import csv_spec

SPLIT_SEEDS = (0, 1, 2, 7, 1 << 32, (1 << 64) - 1)  # split_seed's range is [0, 2^64)


def _spec(**data: object) -> object:
    return csv_spec("ingest", **data)


@pytest.mark.parametrize("seed", range(64))
def test_no_row_is_in_test_at_every_fraction_for_a_seed(seed: int) -> None:
    """Seed 0 (the default) drew 0 for row 0, so row 0 was a test row at any fraction above 0."""
    assert not split_mask(0, 1_000, 1e-9, seed).any()


@pytest.mark.parametrize("seed", SPLIT_SEEDS)
def test_every_seed_splits_off_its_fraction_of_rows_and_of_the_first_rows(seed: int) -> None:
    rows, fraction = 200_000, 0.2
    test = split_mask(0, rows, fraction, seed)
    spread = 5 * np.sqrt(rows * fraction * (1 - fraction))  # 5 sigma of a binomial count
    assert abs(int(test.sum()) - rows * fraction) < spread
    first = test[:1_000]  # the first rows of a file are rows like the others
    assert abs(int(first.sum()) - 200) < 5 * np.sqrt(1_000 * fraction * (1 - fraction))


def test_a_split_is_its_seeds_whatever_the_chunks_and_seeds_differ() -> None:
    whole = split_mask(0, 10_000, 0.3, 5)
    assert (np.concatenate([split_mask(0, 3_333, 0.3, 5), split_mask(3_333, 6_667, 0.3, 5)]) == whole).all()
    assert (split_mask(0, 10_000, 0.3, 5) == whole).all()
    assert (split_mask(0, 10_000, 0.3, 6) != whole).mean() > 0.3  # two uniform splits disagree on 42 %


def test_the_first_row_of_a_converted_file_is_not_always_a_test_row(tmp_path: Path) -> None:
    """`data convert --test-fraction 0.01`: the row written first went to test/ under the default seed."""
    import pyarrow.parquet as pq

    path = tmp_path / "rows.csv"
    path.write_text("price,user,clicked\n" + "".join(f"{i},u{i},{i % 2}\n" for i in range(1_000)), encoding="utf-8")
    convert(_spec(), "csv", [path], tmp_path / "out", options={"test_fraction": 0.01})
    prices = pq.read_table(tmp_path / "out" / "test").column("price").to_pylist()
    assert 0.0 not in prices and 0 < len(prices) < 30


def test_a_file_without_its_header_line_says_so_not_rename_a_column(tmp_path: Path) -> None:
    """A CSV whose header line is missing (the rows of a day cut with `tail -n +2`) was refused as
    'the header names column '0' twice: rename one', as if its first row were a header to edit."""
    path = tmp_path / "rows.csv"
    path.write_text("".join(f"{i % 2},u{i},{i % 2}\n" for i in range(1, 9)))
    with pytest.raises(DataError, match=r"rows\.csv: the header names column '1' twice.*a file without its header "
                                        r"line\? .*data\.options header: false and names") as caught:
        convert(_spec(), "csv", [path], tmp_path / "out")
    assert "rename one" not in str(caught.value)
    path.write_text("price,user,user\n1.5,u1,u1\n")
    with pytest.raises(DataError, match=r"names column 'user' twice \(columns 2 and 3\): rename one"):
        convert(_spec(), "csv", [path], tmp_path / "out")


@pytest.mark.parametrize("name", ["rows.csv.gz", "rows.tsv.gz"])
def test_a_gzip_bomb_without_line_breaks_is_one_line_without_reading_it_whole(tmp_path: Path, name: str) -> None:
    """64 MiB of one byte, 64 KiB gzipped: the CSV header and Criteo's first row were read as one
    line into memory (1 GiB took 2.2 GB and ended in a traceback, `_csv.Error: field larger than
    field limit`); now a line past the reader's block (16 MiB) is one line naming the file."""
    import gzip
    import tracemalloc

    from flowrec.data.sources import criteo_has_label

    path = tmp_path / name
    with gzip.open(path, "wb", compresslevel=1) as fh:
        for _ in range(64):
            fh.write(b"a" * (1 << 20))
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=rf"{name}: line 1 is longer than 16 MiB") as caught:
            if name.endswith(".tsv.gz"):
                criteo_has_label(path)
            else:
                convert(_spec(), "csv", [path], tmp_path / "out")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "\n" not in str(caught.value) and peak < 40 << 20, peak
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["rows.csv.zip", "rows.csv.xz", "rows.tar.gz"])
def test_an_archive_or_a_compression_pyarrow_does_not_read_is_named_as_such(tmp_path: Path, name: str) -> None:
    """A zip, xz or tar input was read as text: 'a row with the wrong field count is not valid UTF-8',
    or 'line 1 has 9 tab-separated fields' for a Criteo file in predict."""
    import lzma
    import tarfile
    import zipfile

    text = "price,user,clicked\n" + "".join(f"{i}.5,u{i},{i % 2}\n" for i in range(20))
    (tmp_path / "rows.csv").write_text(text)
    path = tmp_path / name
    if name.endswith(".zip"):
        with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
            z.write(tmp_path / "rows.csv", "rows.csv")
    elif name.endswith(".xz"):
        path.write_bytes(lzma.compress(text.encode()))
    else:
        with tarfile.open(path, "w:gz") as t:
            t.add(tmp_path / "rows.csv", "rows.csv")
    with pytest.raises(DataError, match=rf"{re.escape(name)} is .* which is not read: text inputs are read plain "
                                        r"or compressed as \.gz, \.bz2, \.zst or \.lz4"):
        convert(_spec(), "csv", [path], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_header_line_where_rows_are_expected_is_named_as_one(tmp_path: Path) -> None:
    """A Criteo file given a header line (or CSV files joined with their headers) was 'non-numeric
    value 'label' in column label', as if a row held a bad label."""
    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    row = "\t".join(["1"] + ["2"] * 13 + ["ab"] * 26)
    path = tmp_path / "day.tsv"
    path.write_text("\t".join(sources.CRITEO_COLUMNS) + "\n" + row + "\n")
    with pytest.raises(DataError, match=r"day\.tsv:1: non-numeric value 'label' in column label: a header line where "
                                        r"rows are expected"):
        list(sources.read_criteo(path, {}, ErrorLog("fail", str(path)), set()))
    path.write_text(row + "\n" + "yes" + row[1:] + "\n")
    with pytest.raises(DataError, match=r"day\.tsv:2: non-numeric value 'yes' in column label") as caught:
        list(sources.read_criteo(path, {}, ErrorLog("fail", str(path)), set()))
    assert "a header line" not in str(caught.value)
    path.write_text("price,user,clicked\n1.5,u1,1\nprice,user,clicked\n2.5,u2,0\n")
    with pytest.raises(DataError, match=r"day\.tsv:3: non-numeric value '.*' in column .*: a header line where"):
        convert(_spec(), "csv", [path], tmp_path / "out")


def _parquet_folder(folder: Path, files: dict[str, dict[str, object]]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name, columns in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.table(columns), folder / name)
    return folder


ROWS = {"price": [1.5, 2.5], "user": ["u1", "u2"], "clicked": [0, 1]}


@pytest.mark.parametrize("second,column", [
    ({"price": [3.5, 4.5], "clicked": [1, 0]}, "user"),  # a bound feature lacking: read as missing
    ({"price": [3.5, 4.5], "user": ["u3", "u4"]}, "clicked"),  # the label lacking
], ids=["feature", "label"])
def test_a_folder_file_lacking_a_bound_column_names_the_file_and_the_column(
        tmp_path: Path, second: dict[str, object], column: str) -> None:
    """A Parquet folder's second file without a column the spec binds converted, its rows' values
    filled in as missing (pyarrow takes the first file's schema)."""
    folder = _parquet_folder(tmp_path / "rows", {"a.parquet": ROWS, "b.parquet": second})
    where = re.escape(str(folder))
    with pytest.raises(DataError, match=f"^{where}/b\\.parquet: no column '{column}', which {where}/a\\.parquet has"):
        convert(_spec(), "parquet", [folder], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_folder_file_with_a_column_the_first_lacks_names_both(tmp_path: Path) -> None:
    """The first file without a bound column named only the folder; an extra column was dropped."""
    for name, first in (("user", {"price": [1.5], "clicked": [0]}), ("region", ROWS)):
        folder = _parquet_folder(tmp_path / name, {"a.parquet": first, "b.parquet": {**ROWS, "region": ["x", "y"]}})
        where = re.escape(str(folder))
        with pytest.raises(DataError, match=f"^{where}/a\\.parquet: no column '{name}', which {where}/b\\.parquet has"):
            convert(_spec(), "parquet", [folder], tmp_path / f"out_{name}")


@pytest.mark.parametrize("values", [[7, 8], [["u3"], ["u4"]]], ids=["integers", "lists"])
def test_a_folder_file_holding_a_column_with_another_type_names_the_file_and_the_column(
        tmp_path: Path, values: list[object]) -> None:
    """Integers after strings were cast to text silently; lists after strings were a traceback."""
    folder = _parquet_folder(tmp_path / "rows", {"a.parquet": ROWS, "b.parquet": {**ROWS, "user": values}})
    where = re.escape(str(folder))
    with pytest.raises(DataError, match=f"^{where}/b\\.parquet: column 'user' holds .* values, {where}/a\\.parquet"):
        convert(_spec(), "parquet", [folder], tmp_path / "out")


def test_a_folder_of_integer_ids_in_one_file_and_float_ids_in_another_is_read(tmp_path: Path) -> None:
    """pandas writes a day whose id column has a missing value as floats: a folder of such days
    (int64 in one file, double in the next) was refused ('a column holds one type in every file'),
    though 3 and 3.0 are the id "3"; now each file is read with its own type, as a label's is."""
    import pyarrow.parquet as pq

    mixed = _parquet_folder(tmp_path / "mixed", {"a.parquet": {**ROWS, "user": [3, 4]},
                                                 "b.parquet": {**ROWS, "user": [4.0, None]},
                                                 "c.parquet": {**ROWS, "user": pa.array([3, 5], pa.int32())}})
    whole = _parquet_folder(tmp_path / "whole", {"a.parquet": {**ROWS, "user": [3, 4]},
                                                 "b.parquet": {**ROWS, "user": [4, None]},
                                                 "c.parquet": {**ROWS, "user": [3, 5]}})
    for folder in (mixed, whole):
        assert convert(_spec(), "parquet", [folder], tmp_path / f"{folder.name}-out").rows == 6
    ids = [pq.read_table(tmp_path / f"{name}-out").column("user").to_pylist() for name in ("mixed", "whole")]
    assert ids[0] == ids[1] and ids[0][3] == 0 and ids[0][0] == ids[0][4] != ids[0][1] == ids[0][2]


def test_a_folder_of_text_ids_in_one_file_and_bytes_in_another_is_read_as_one_text(tmp_path: Path) -> None:
    """A writer without Parquet's UTF-8 mark (Hive, old Spark) leaves a text column as bytes: a
    folder of its days beside days written as text was refused ('holds binary values, ... string'),
    though a folder of bytes alone encodes to the same ids as the text; now each file is read with
    its own type. Bytes that are not UTF-8 are still refused in one line."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    days = [[f"u{k}" for k in rng.zipf(1.3, int(rng.integers(20, 60)))] for _ in range(4)]

    def rows(users: list[str], kind: pa.DataType) -> dict[str, object]:
        n = len(users)
        return {"price": rng.lognormal(0, 2, n).tolist(), "clicked": (np.arange(n) % 3 == 0).astype(int).tolist(),
                "user": pa.array([u.encode() for u in users] if "binary" in str(kind) else users, kind)}

    kinds = [pa.string(), pa.binary(), pa.large_binary(), pa.large_string()]
    mixed = _parquet_folder(tmp_path / "mixed", {f"d{i}.parquet": rows(users, kind)
                                                 for i, (users, kind) in enumerate(zip(days, kinds))})
    text = _parquet_folder(tmp_path / "text", {f"d{i}.parquet": {**pq.read_table(mixed / f"d{i}.parquet").to_pydict(),
                                                                 "user": users} for i, users in enumerate(days)})
    for folder in (mixed, text):
        assert convert(_spec(), "parquet", [folder], tmp_path / f"{folder.name}-out").rows == sum(map(len, days))
    encoded = [pq.read_table(tmp_path / f"{name}-out").column("user").to_pylist() for name in ("mixed", "text")]
    assert encoded[0] == encoded[1] and len(set(encoded[0])) > 1
    (mixed / "d1.parquet").unlink()
    _parquet_folder(mixed, {"d1.parquet": {**ROWS, "user": pa.array([b"\xff\xfe", b"u1"], pa.binary())}})
    with pytest.raises(DataError, match="holds bytes that are not UTF-8 text"):
        convert(_spec(), "parquet", [mixed], tmp_path / "bad-out")


def test_a_file_outside_the_partition_folders_names_the_partition_column(tmp_path: Path) -> None:
    """`day=1/a.parquet` beside a top-level `b.parquet`: b's rows had no day, silently."""
    folder = _parquet_folder(tmp_path / "rows", {"day=1/a.parquet": ROWS, "b.parquet": ROWS})
    with pytest.raises(DataError, match=f"^{re.escape(str(folder))}/b\\.parquet: no column 'day'"):
        convert(_spec(), "parquet", [folder], tmp_path / "out")


def test_a_partition_folder_named_with_an_underscore_is_read_and_other_such_folders_are_named(
        tmp_path: Path) -> None:
    """`raw/_day=1/a.parquet` (a Hive key `_day`) was skipped as Spark's `_SUCCESS` is, so the user
    read 'no rows converted from raw: it holds no data rows'; a `__line__=7/` key too, where a
    `__line__` column is refused. Files so named (`_SUCCESS`) are still not read."""
    import pyarrow.parquet as pq

    rows = {"price": [1.5, 2.5], "clicked": [0, 1]}
    keyed = _parquet_folder(tmp_path / "keyed", {"_day=1/a.parquet": rows, "_day=2/a.parquet": rows})
    (keyed / "_SUCCESS").write_text("")
    assert convert(_spec(columns={"user": "_day"}), "parquet", [keyed], tmp_path / "out").rows == 4
    users = pq.read_table(tmp_path / "out").column("user").to_pylist()
    assert users[0] == users[1] != users[2] == users[3]  # each row its folder's day
    line = _parquet_folder(tmp_path / "line", {"__line__=7/a.parquet": ROWS})
    with pytest.raises(DataError, match=f"^{re.escape(str(line))}/__line__=7: a partition folder of key '__line__'"):
        convert(_spec(), "parquet", [line], tmp_path / "out_line")
    temporary = _parquet_folder(tmp_path / "temporary", {"_temporary/0/a.parquet": ROWS})
    with pytest.raises(DataError, match=f"its folders {re.escape(str(temporary))}/_temporary were not read"):
        convert(_spec(), "parquet", [temporary], tmp_path / "out_temporary")


def test_predict_of_a_folder_of_underscore_folders_only_names_them(tmp_path: Path) -> None:
    """`flowrec predict PKG raw --format parquet` of a folder whose rows are all under `_tmp/` said
    'no rows to score in raw' alone, as if it held none; now the line names the folders not read."""
    import types

    from flowrec.cli.predict_cmd import _no_rows

    raw = _parquet_folder(tmp_path / "raw", {"_tmp/a.parquet": ROWS})
    line = _no_rows(raw, types.SimpleNamespace(count=0), "parquet")
    assert line.startswith(f"no rows to score in {raw}: its folders {raw / '_tmp'} were not read"), line
    (tmp_path / "none").mkdir()
    assert _no_rows(tmp_path / "none", types.SimpleNamespace(count=0), "parquet") == f"no rows to score in {tmp_path / 'none'}"


def test_folder_files_whose_types_keep_the_values_meaning_convert_as_one_file(tmp_path: Path) -> None:
    """Numbers of any type in a dense or label column (int64 beyond 2^53 in one file, double in the
    next), a column of nulls only, and a file without rows (whatever its columns) are read as the
    same rows in one file."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = _parquet_folder(tmp_path / "rows", {
        "a.parquet": {"price": pa.array([2 ** 60, 3], pa.int64()), "user": ["u1", "u2"], "clicked": [0, 1]},
        "b.parquet": {"price": [1.5, None], "user": pa.array([None, None], pa.null()), "clicked": [1.0, 0.0]},
        "c.parquet": {"price": pa.array([], pa.float64())},
    })
    _parquet_folder(tmp_path / "one", {"rows.parquet": {
        "price": [float(2 ** 60), 3.0, 1.5, None], "user": ["u1", "u2", None, None], "clicked": [0.0, 1.0, 1.0, 0.0]}})
    assert convert(_spec(), "parquet", [folder], tmp_path / "out").rows == 4
    convert(_spec(), "parquet", [tmp_path / "one" / "rows.parquet"], tmp_path / "expect")
    assert pq.read_table(tmp_path / "out").equals(pq.read_table(tmp_path / "expect"))


def _once(text: str, path: Path) -> bool:
    return text.count(str(path)) == 1 and text.count(path.name) == 1


def test_a_missing_spec_file_is_named_once(tmp_path: Path) -> None:
    """`flowrec validate nope.yaml` said `nope.yaml: cannot read nope.yaml: No such file or directory`
    (plan and train too; a folder given as the spec likewise)."""
    from flowrec.spec.errors import SpecError
    from flowrec.spec.files import validate_paths
    from flowrec.spec.load import load_spec

    missing, folder = tmp_path / "nope.yaml", tmp_path / "folder.yaml"
    folder.mkdir()
    (report,) = validate_paths([missing])
    lines = [f"{report.path}: {issue}" for issue in report.issues]  # as `flowrec validate` prints them
    assert len(lines) == 1 and _once(lines[0], missing), lines
    for path in (missing, folder):
        with pytest.raises(SpecError) as info:
            load_spec(path)
        (issue,) = info.value.issues
        assert _once(f"{path}: {issue}", path) and _once(str(info.value), path), str(info.value)


def test_a_missing_custom_class_file_at_an_absolute_path_is_named_once(tmp_path: Path) -> None:
    from flowrec.spec.class_paths import class_path_issues

    path = tmp_path / "blocks.py"
    (issue,) = class_path_issues({"modules": [{"kind": "custom", "class": f"{path}:Gate"}]})
    assert issue.path == "modules[0].class" and _once(issue.message, path), issue.message


def test_a_missing_device_profile_named_by_the_spec_is_named_once(tmp_path: Path) -> None:
    """`plan: {target: nope.json}` said `cannot read device profile nope.json: cannot read nope.json: ...`."""
    from flowrec.planner.manager import make_plan
    from flowrec.spec.load import spec_from_dict, to_dict

    path = tmp_path / "nope.json"
    spec = spec_from_dict({**to_dict(_spec()), "plan": {"target": str(path)}})
    with pytest.raises(ValueError) as info:
        make_plan(spec)
    assert _once(str(info.value), path) and "device profile" in str(info.value), str(info.value)


def test_bytes_ids_that_are_not_utf8_are_one_line_naming_the_value(tmp_path: Path) -> None:
    """A Parquet (or DataFrame) id column of bytes is read as UTF-8 text; bytes that are not UTF-8
    were pyarrow's 'Invalid UTF8 payload' naming nothing (a traceback from model.predict). Now a
    DataError names the value and its row, in convert and in predict's column check; bytes that
    are UTF-8 still read as their text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowrec.data.raw_ids import check_ids

    good = _parquet_folder(tmp_path / "good", {"a.parquet": {**ROWS, "user": [b"u1", b"u2"]}})
    convert(_spec(), "parquet", [good], tmp_path / "out_good")
    text = _parquet_folder(tmp_path / "text", {"a.parquet": ROWS})
    convert(_spec(), "parquet", [text], tmp_path / "out_text")
    assert pq.read_table(tmp_path / "out_good").equals(pq.read_table(tmp_path / "out_text"))
    bad = _parquet_folder(tmp_path / "bad", {"a.parquet": {**ROWS, "user": [b"u1", b"\xff\xfeu"]}})
    with pytest.raises(DataError, match=r"holds bytes that are not UTF-8 text \(b'\\xff\\xfeu' at row 1"):
        convert(_spec(), "parquet", [bad], tmp_path / "out_bad")
    for column in (pa.array([b"ok", None, b"\xc3("]), pa.array([[b"ok"], [b"\xc3("]])):
        with pytest.raises(DataError, match=r"^column user holds bytes that are not UTF-8 text \(b'\\xc3\(' at row"):
            check_ids(column, "user", multi=pa.types.is_list(column.type))
    check_ids(pa.array([b"ok", None, "é".encode()]), "user", multi=False)


@pytest.mark.parametrize("user", [[[1, 2], [3]], [{"a": 1}, {"a": 2}]], ids=["list", "struct"])
def test_a_parquet_id_column_of_lists_or_structs_for_a_one_id_feature_is_one_line_in_convert(
        tmp_path: Path, user: list) -> None:
    """`data convert parquet` of a file whose one-id feature's column holds lists (or structs)
    ended in a traceback (Arrow's 'Unsupported cast from list<element: int64> to utf8'), where
    `predict` of the same file said it in one line; now convert names the input and the column."""
    rows = _parquet_folder(tmp_path / "in", {"a.parquet": {**ROWS, "user": user}})
    with pytest.raises(DataError, match=r"in: column user holds (list|struct)<.*>, not one id per row$"):
        convert(_spec(), "parquet", [rows], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_link_loop_in_a_parquet_folder_is_one_line_not_every_file_read_41_times(tmp_path: Path) -> None:
    """A link `loop -> .` in a Parquet folder (raw rows, or an encoded dataset): pyarrow's discovery
    followed it down to the path length limit, so convert read every file 41 times (41x the rows),
    and with a second link (`up -> ..`) train, eval and data inspect ran without end, their memory
    growing (5 GB in 6 minutes), train deaf to SIGTERM. Now the link is named in one line."""
    from flowrec.data.dataset import parquet_files

    rows = _parquet_folder(tmp_path / "in", {"a.parquet": ROWS})
    (rows / "loop").symlink_to(".", target_is_directory=True)
    with pytest.raises(DataError, match=r"in/loop is a link back to a folder above it or already in the dataset"):
        convert(_spec(), "parquet", [rows], tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(DataError, match=r"in/loop is a link back"):
        parquet_files(rows)
    (rows / "loop").unlink()
    (tmp_path / "day").mkdir()
    (rows / "day").symlink_to(tmp_path / "day", target_is_directory=True)  # a link elsewhere is followed
    assert parquet_files(rows) == [str(rows / "a.parquet")]


@pytest.mark.parametrize("fmt", ["csv", "libsvm"])
def test_a_pipe_given_as_the_input_is_one_line_naming_it(tmp_path: Path, fmt: str) -> None:
    """`zcat day.gz | flowrec data convert csv /dev/stdin ...` (or `<(zcat ...)`) stopped with
    'cannot read /dev/stdin: lseek failed': the readers go back to the start of their input."""
    import os
    import threading

    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    pipe = tmp_path / "rows.csv"
    os.mkfifo(pipe)

    def write() -> None:  # a writer as a shell's pipe has one (a reader opening the pipe waits for it)
        try:
            with open(pipe, "w") as f:
                f.write("price,user,clicked\n1,a,1\n" if fmt == "csv" else "1 0:5\n")
        except OSError:
            pass

    threading.Thread(target=write, daemon=True).start()
    try:
        with pytest.raises(DataError, match=r"rows\.csv is not a regular file \(a pipe or a device\): .*write it to a file"):
            list(sources.reader(fmt)(pipe, {"fields": ["user"]}, ErrorLog("fail", str(pipe)), {"price", "clicked"}))
    finally:
        os.close(os.open(pipe, os.O_RDONLY | os.O_NONBLOCK))  # lets a writer still waiting go


@pytest.mark.parametrize("fmt", ["csv", "criteo", "avazu", "libsvm"])
def test_a_parquet_file_given_to_a_text_format_says_so(tmp_path: Path, fmt: str) -> None:
    """`flowrec predict PKG rows.parquet --format csv` (or `data convert csv` of one) read its bytes as
    rows: "wrong field count (1, expected 4): '%\\x02\\x18\\x02d1...'"; now one line names the format to use."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"price": [1.0, 2.0], "user": ["a", "b"], "clicked": [1, 0]}), path)
    with pytest.raises(DataError, match=rf"rows\.parquet is a Parquet file, not {fmt} text: read it with the parquet format"):
        list(sources.reader(fmt)(path, {"fields": ["user"]}, ErrorLog("skip", str(path)), {"price", "clicked"}))


@pytest.mark.parametrize("header, row", [("price,user,clicked,,", "{p},u{i},{c},,"),
                                         ("price,,user,clicked,", "{p},x,u{i},{c},y"),
                                         ("price,user,clicked,", "{p},u{i},{c},")])
def test_columns_of_no_name_are_unused_one_or_many(tmp_path: Path, header: str, row: str) -> None:
    """A header ending `a,b,,` (a spreadsheet's trailing separators) was refused as naming column ''
    twice ('rename one': there is no name to rename), where one such column was read. Now columns
    of no name are unused columns, however many: the rows equal those of the file without them."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    values = [(round(float(rng.random()), 3), int(rng.integers(50)), int(rng.integers(2))) for _ in range(300)]
    (tmp_path / "plain.csv").write_text("price,user,clicked\n" + "".join(f"{p},u{i},{c}\n" for p, i, c in values))
    (tmp_path / "rows.csv").write_text(header + "\n" + "".join(row.format(p=p, i=i, c=c) + "\n" for p, i, c in values))
    convert(_spec(), "csv", [tmp_path / "plain.csv"], tmp_path / "a")
    convert(_spec(), "csv", [tmp_path / "rows.csv"], tmp_path / "b")
    a, b = pq.read_table(tmp_path / "a"), pq.read_table(tmp_path / "b")
    assert a.num_rows == 300 and a.equals(b)


def test_svmlight_comments_are_skipped_not_malformed_rows(tmp_path: Path) -> None:
    """A libsvm file with svmlight's comments (scikit-learn's `dump_svmlight_file(comment=...)`
    writes '# Generated by ...' lines at its top; a row may end in '# ...') failed on its first
    line: "could not convert string to float: '#'". Now a comment is skipped, and the rows and their
    line numbers are those of the file without them."""
    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    rng = np.random.default_rng()
    rows = [f"{rng.integers(2)} 0:{rng.integers(9)} 1:{rng.random():.3f}" for _ in range(20)]
    plain = tmp_path / "plain.libsvm"
    plain.write_text("".join(f"{r}\n" for r in rows))
    commented = tmp_path / "c.libsvm"
    commented.write_text("# Generated by dump_svmlight_file\n#\n" + "".join(f"{r} # row {i}\n" for i, r in enumerate(rows)))

    def read(path: Path):
        tables = list(sources.reader("libsvm")(path, {"fields": ["user", "price"]}, ErrorLog("fail", str(path)),
                                               {"price"}))
        return {n: sum((t.column(n).to_pylist() for t in tables), []) for n in ("label", "user", "price", "__line__")}

    a, b = read(plain), read(commented)
    assert len(a["label"]) == 20 and {n: a[n] for n in ("label", "user", "price")} == \
        {n: b[n] for n in ("label", "user", "price")}
    assert b["__line__"] == [n + 2 for n in a["__line__"]]  # each row named by its own line of the file


@pytest.mark.parametrize("options", [{"fields": ["user", "item", "price"]}, {"feature_map": {"0": "price"}}])
def test_an_svmlight_query_id_is_no_feature(tmp_path: Path, options: dict) -> None:
    """svmlight's query id (`1 qid:3 0:2.5 ...`, as scikit-learn's dump_svmlight_file(query_id=...)
    writes it) took the first field's place by position (user 'qid', every field after it moved
    one on) or was 'unknown index qid' with a feature map; now it is no feature: the rows equal
    those of the file without it."""
    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    rng = np.random.default_rng()
    if "fields" in options:
        rows = [(f"{rng.integers(2)}", f"{rng.integers(9)}:1 {rng.integers(9)}:1 0:{rng.random():.3f}") for _ in range(20)]
    else:
        rows = [(f"{rng.integers(2)}", f"0:{rng.random():.3f}") for _ in range(20)]
    plain, with_qid = tmp_path / "plain.libsvm", tmp_path / "q.libsvm"
    plain.write_text("".join(f"{y} {x}\n" for y, x in rows))
    with_qid.write_text("".join(f"{y} qid:{i // 4} {x}\n" for i, (y, x) in enumerate(rows)))

    def read(path: Path):
        tables = list(sources.reader("libsvm")(path, dict(options), ErrorLog("fail", str(path)), {"price"}))
        return [t.drop_columns(["__line__"]) for t in tables]

    a, b = read(plain), read(with_qid)
    assert sum(t.num_rows for t in a) == 20 and a[0].equals(b[0])


def test_a_label_or_weight_column_the_input_lacks_is_named_where_the_spec_names_it(tmp_path: Path) -> None:
    """A head's misspelt label (`label: clicke` of a file's `clicked`) was told 'map it with
    data.columns: {clicke: clicked}', which validation refuses (data.columns maps features only);
    a label or sample-weight column the input lacks now names the spec's place to correct, and
    doing so converts."""
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    rng = np.random.default_rng()
    n = int(rng.integers(20, 60))
    path = tmp_path / "rows.csv"
    path.write_text("price,user,clicked\n" + "".join(
        f"{rng.lognormal():.3f},u{rng.zipf(1.4)},{int(i % 4 == 0)}\n" for i in range(n)))

    def spec(head: dict, label: str | None) -> object:
        doc = to_dict(_spec(**({"label": label} if label else {})))
        if label is None:
            doc["data"].pop("label")
        doc["heads"][0].update(head)
        return spec_from_dict(doc)

    cases = [({"label": "clicke"}, "clicked", r"is 'clicke' the input's 'clicked' \(read by no feature or label\)\? "
                                              r"correct heads\[0\]\.label: clicked$"),
             ({}, "clicke", r"correct data\.label: clicked$"),
             ({}, None, r"set data\.label \(default 'label'\) or the heads' label to the input's label column$"),
             ({"sample_weight": "weight"}, "clicked", r"set heads\[0\]\.sample_weight to the input's weight column$")]
    for i, (head, label, said) in enumerate(cases):
        with pytest.raises(DataError, match=said):
            convert(spec(head, label), "csv", [path], tmp_path / f"out{i}")
        assert not (tmp_path / f"out{i}").exists()
    assert convert(spec({"label": "clicked"}, "clicke"), "csv", [path], tmp_path / "fixed").rows == n


def test_a_dense_column_of_text_names_the_file_that_holds_it(tmp_path: Path) -> None:
    """A dense column mostly text in one of several inputs said 'column price holds text, not
    numbers (...)' naming no file (the data fuzz test found its label twin); the line names it."""
    rng = np.random.default_rng()
    good, bad = tmp_path / "a.csv", tmp_path / "b.csv"
    good.write_text("price,user,clicked\n" + "".join(f"{rng.lognormal():.3f},u{rng.zipf(1.4)},{i % 2}\n"
                                                     for i in range(int(rng.integers(5, 30)))))
    bad.write_text("price,user,clicked\n" + "".join(f"p{rng.zipf(1.4)},u{rng.zipf(1.4)},{i % 2}\n"
                                                    for i in range(int(rng.integers(5, 30)))))
    with pytest.raises(DataError, match=f"^{re.escape(str(bad))}: column price holds text, not numbers"):
        convert(_spec(), "csv", [good, bad], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_header_with_spaces_after_its_commas_says_so(tmp_path: Path) -> None:
    """`price, user, clicked` (a space after each comma, as people type it) named columns ' user'
    and ' clicked', and the line said only 'map them with data.columns'; now it says the names hold
    spaces and to write the file without them; nothing is written."""
    path = tmp_path / "rows.csv"
    path.write_text("price, user, clicked\n" + "".join(f"{i}.5, u{i}, {i % 2}\n" for i in range(20)))
    with pytest.raises(DataError, match=r"names hold spaces around them \(' user', ' clicked'\): write the file "
                                        r"without the spaces after its separators"):
        convert(_spec(), "csv", [path], tmp_path / "out")


def test_a_spec_name_close_to_a_column_the_input_has_names_that_column(tmp_path: Path) -> None:
    """A typo in a feature's or the label's name (`usr` for the input's `user`, `clicks` for
    `clicked`), or a data.columns mapping to a column the input lacks, said 'columns [...] not in
    the input (has [the first 12 columns]...); map them with data.columns': the input's column was
    not among those shown when the header had more than 12, and the line never named it. Now it
    names the input's close column and what to change; nothing is written."""
    rng = np.random.default_rng()
    extra = [f"x{i}" for i in range(14)]  # more than the 12 columns shown, the right ones last
    header = extra + ["price", "user", "clicked"]
    rows = "".join(",".join([*(str(v) for v in rng.integers(0, 9, len(extra))), f"{rng.lognormal():.3f}",
                              f"u{int(rng.zipf(1.5))}", str(int(rng.random() < 0.2))]) + "\n" for _ in range(30))
    path = tmp_path / "rows.csv"
    path.write_text(",".join(header) + "\n" + rows)
    typo = csv_spec("ingest", label="clicks")
    with pytest.raises(DataError, match=r"is 'clicks' the input's 'clicked' \(read by no feature or label\)\? correct "
                                        r"data.label: clicked$") as caught:  # (data.columns maps features only)
        convert(typo, "csv", [path], tmp_path / "a")
    assert "x11']...)" in str(caught.value)  # the columns shown, more of them left out
    mapped = csv_spec("ingest", columns={"user": "user_id"})
    with pytest.raises(DataError, match=r"data.columns maps 'user' to 'user_id': is it the input's 'user' "):
        convert(mapped, "csv", [path], tmp_path / "b")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    path.write_text("price,user,clicked\n" + "".join(f"{rng.lognormal():.3f},u{i},{i % 2}\n" for i in range(9)))
    with pytest.raises(DataError, match=r"\(has \['price', 'user', 'clicked'\]\);"):  # all shown: no '...'
        convert(typo, "csv", [path], tmp_path / "c")


@pytest.mark.parametrize("flag, value", [("--test-fraction", "nan"), ("--test-fraction", "1"),
                                         ("--split-seed", "-1"), ("--split-seed", str(1 << 64))])
def test_a_split_flag_out_of_range_is_named_as_the_flag(tmp_path: Path, flag: str, value: str) -> None:
    """`data convert ... --test-fraction nan` said 'test_fraction must be ...' (and --split-seed -1
    'split_seed must be ...'), the spec's data.options keys, which the user never wrote."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    spec = Path(__file__).resolve().parents[2] / "specs" / "two_task.yaml"
    (tmp_path / "x.csv").write_text("price,user,clicked\n1,a,0\n")
    result = CliRunner().invoke(app, ["data", "convert", "csv", str(tmp_path / "x.csv"), str(tmp_path / "out"),
                                      "--spec", str(spec), flag, value, "-q"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith(f"error: {flag} must be"), result.output
    assert not (tmp_path / "out").exists()


def test_a_split_seed_without_a_split_is_refused(tmp_path: Path) -> None:
    """`data convert ... --split-seed 5` without --test-fraction (nor the spec's) seeded nothing and
    wrote an unsplit dataset without a word."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nfeatures:\n  - {name: user, type: categorical, hash_buckets: 9, dim: 2}\n"
                    "modules:\n  - {name: top, kind: mlp, inputs: [user], layers: [2]}\n"
                    "heads:\n  - {name: ctr, input: top}\ndata: {format: csv, label: clicked}\n")
    (tmp_path / "x.csv").write_text("user,clicked\n" + "".join(f"u{i},{i % 2}\n" for i in range(40)))
    args = ["data", "convert", "csv", str(tmp_path / "x.csv"), str(tmp_path / "out"), "--spec", str(spec), "-q"]
    result = CliRunner().invoke(app, [*args, "--split-seed", "5"])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "--split-seed" in lines[0], result.output
    assert not (tmp_path / "out").exists()
    result = CliRunner().invoke(app, [*args, "--split-seed", "5", "--test-fraction", "0.25"])
    assert result.exit_code == 0 and (tmp_path / "out" / "test").is_dir(), result.output


@pytest.mark.parametrize("names, says", [(["price", "user", "user", "clicked"],
                                          r"names column 'user' twice \(columns 2 and 3\)")])
def test_a_parquet_file_naming_a_column_twice_names_the_columns(tmp_path: Path, names: list, says: str) -> None:
    """Raw Parquet naming one column twice in a file of a folder was pyarrow's "Can't unify schema
    with duplicate field names", naming no column: pyarrow's discovery refused it before flowrec's
    check of each file's names ran."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns = {"price": [1.5, 2.5], "user": ["u1", "u2"], "clicked": [0, 1], "": [1, 2]}
    (tmp_path / "rows" / "day=1").mkdir(parents=True)
    pq.write_table(pa.table([columns[n] for n in names], names=names), tmp_path / "rows" / "day=1" / "a.parquet")
    with pytest.raises(DataError, match=f"a\\.parquet: .*{says}"):
        convert(_spec(), "parquet", [tmp_path / "rows"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_standardize_keeps_the_spread_of_values_far_from_zero(tmp_path: Path) -> None:
    """standardize of epoch seconds (1.7e9 + 0..99) recorded std 1.0, not 29: the variance was the
    mean square less the squared mean, whose difference float64 rounding lost, so the encoded
    column spread over +-50; a column of one value (0.1) got a std of 2e-9, its rounding residue."""
    import pyarrow.parquet as pq

    from flowrec.data.layout import read_meta
    from flowrec.spec.load import spec_from_dict

    spec = spec_from_dict({
        "name": "ingest",
        "features": [{"name": "price", "type": "dense", "transform": "standardize"},
                     {"name": "fee", "type": "dense", "transform": "standardize"},
                     {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "data": {"format": "csv", "path": "x.csv", "label": "clicked"}})
    seconds = 1.7e9 + np.arange(2_000) % 100
    path = tmp_path / "rows.csv"
    path.write_text("price,fee,user,clicked\n" + "".join(f"{s:.0f},0.1,u{i},{i % 2}\n" for i, s in enumerate(seconds)),
                    encoding="utf-8")
    convert(spec, "csv", [path], tmp_path / "out")
    meta = read_meta(tmp_path / "out").dense
    assert meta["price"]["std"] == pytest.approx(seconds.std(), rel=1e-6)
    price = pq.read_table(tmp_path / "out").column("price").to_numpy()
    assert price.std() == pytest.approx(1.0, rel=1e-4) and abs(price.mean()) < 1e-4
    assert meta["fee"]["std"] == 1.0 and (pq.read_table(tmp_path / "out").column("fee").to_numpy() == 0).all()


def test_a_value_a_runs_std_scales_past_float32_is_a_malformed_row(tmp_path: Path) -> None:
    """A run whose standardized column had std 0.001: raw 3e38 (a finite float32) encoded as inf, so
    `data convert --encoder-from RUN` wrote a dataset train and eval refused ('non-finite value inf')
    and `flowrec predict` wrote NaN scores for the row, without a word (and numpy's RuntimeWarning)."""
    import types
    import warnings

    import pyarrow.parquet as pq

    from flowrec.cli.predict_cmd import _raw_chunks
    from flowrec.data.encode import DenseStats, Encoder
    from flowrec.spec.load import spec_from_dict

    spec = spec_from_dict({
        "name": "ingest",
        "features": [{"name": "price", "type": "dense", "transform": "standardize"},
                     {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "data": {"format": "csv", "path": "x.csv", "label": "clicked"}})
    encoder = Encoder(spec, {}, {}, {"price": DenseStats(7.0, 0.001)})
    path = tmp_path / "rows.csv"
    path.write_text("price,user,clicked\n7.001,a,1\n3e38,b,0\n-3e38,c,1\n6.999,d,0\n", encoding="utf-8")
    with pytest.raises(DataError, match=r"rows\.csv:3: dense value 3e\+38 in column price: standardized"):
        convert(spec, "csv", [path], tmp_path / "fail", encoder=encoder, grow=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's overflow in the float32 cast
        report = convert(spec, "csv", [path], tmp_path / "out", on_error="skip", encoder=encoder, grow=False)
    assert report.rows == 2 and report.errors == 2
    assert pq.read_table(tmp_path / "out").column("price").to_numpy() == pytest.approx([1.0, -1.0], abs=1e-3)
    model = types.SimpleNamespace(spec=spec, encoder=encoder)
    chunks, log = _raw_chunks(model, path, "csv", "skip")
    assert [c.column("user").to_pylist() for c in chunks] == [["a", "d"]] and log.count == 2


def test_training_labels_of_one_class_are_said(tmp_path: Path) -> None:
    """A binary head whose training rows were all clicked=0 (a filter that kept one class, a label
    column of another convention) trained without a word: the head learns to predict 0 alone."""
    import types

    from flowrec.runtime.session import label_warnings

    for name, labels in (("zeros", [0] * 40), ("both", [i % 2 for i in range(40)])):
        path = tmp_path / f"{name}.csv"
        path.write_text("price,user,clicked\n" + "".join(f"{i},u{i},{y}\n" for i, y in enumerate(labels)),
                        encoding="utf-8")
        convert(_spec(), "csv", [path], tmp_path / name, options={"test_fraction": 0.25})
    from flowrec.data.layout import read_meta

    lines = label_warnings(_spec(), types.SimpleNamespace(path=tmp_path / "zeros" / "train"))
    rows = read_meta(tmp_path / "zeros" / "train").rows
    assert len(lines) == 1 and lines[0].startswith("every training label of head ctr (column clicked) in ")
    assert lines[0].endswith(f" is 0 ({rows} rows): it can only learn to predict 0")
    assert label_warnings(_spec(), types.SimpleNamespace(path=tmp_path / "both" / "train")) == []
    assert label_warnings(_spec(), types.SimpleNamespace()) == []  # synthetic rows: no statistics


def test_training_labels_of_one_class_in_a_heads_task_space_are_said(tmp_path: Path) -> None:
    """The one-class warning read a label's mean over all rows, so an ESMM conversion head trained
    where clicked = 1 whose every clicked row converted (mean 0.5 over all rows) trained without a
    word, as did one whose space no training row is in; now its labels are judged in its space."""
    import types

    from flowrec.runtime.session import label_warnings
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    spec = spec_from_dict({**to_dict(_spec()), "heads": [
        {"name": "ctr", "input": "top"},
        {"name": "cvr", "input": "top", "label": "conv", "trained_where": {"label": "clicked", "equals": 1}}]})
    cases = (("converts", [i % 2 for i in range(40)], [i % 2 for i in range(40)]),
             ("both", [i % 2 for i in range(40)], [int(i % 4 == 1) for i in range(40)]),
             ("unclicked", [0] * 20 + [1] * 20, [0] * 40))
    for name, clicks, convs in cases:
        path = tmp_path / f"{name}.csv"
        path.write_text("price,user,clicked,conv\n" + "".join(f"{i},u{i},{c},{v}\n" for i, (c, v) in
                                                              enumerate(zip(clicks, convs))), encoding="utf-8")
        convert(spec, "csv", [path], tmp_path / name)
    folder = tmp_path / "converts"
    assert label_warnings(spec, types.SimpleNamespace(path=folder)) == [
        f"every training label of head cvr (column conv) in its task space (clicked = 1) in {folder} is 1 "
        "(20 rows): it can only learn to predict 1"]
    assert label_warnings(spec, types.SimpleNamespace(path=tmp_path / "both")) == []
    assert label_warnings(spec, types.SimpleNamespace(path=tmp_path / "unclicked")) == [
        f"every training label of head cvr (column conv) in {tmp_path / 'unclicked'} is 0 (40 rows): it can only "
        "learn to predict 0"]  # all rows of one class: the space's too, said as before


def test_training_weights_all_zero_are_said(tmp_path: Path) -> None:
    """A head whose sample weights were all 0 in the training rows (a weight column of another
    meaning, a filter) trained without a word, its loss 0 at every step: it learned nothing."""
    import types

    from flowrec.data.layout import read_meta
    from flowrec.runtime.session import label_warnings
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    spec = spec_from_dict({**to_dict(_spec()), "heads": [{"name": "ctr", "input": "top", "sample_weight": "w"}]})
    for name, weights in (("zeros", [0] * 40), ("some", [i % 2 for i in range(40)])):
        path = tmp_path / f"{name}.csv"
        path.write_text("price,user,clicked,w\n" + "".join(f"{i},u{i},{i % 2},{w}\n" for i, w in enumerate(weights)),
                        encoding="utf-8")
        convert(spec, "csv", [path], tmp_path / name, options={"test_fraction": 0.25})
    lines = label_warnings(spec, types.SimpleNamespace(path=tmp_path / "zeros" / "train"))
    rows = read_meta(tmp_path / "zeros" / "train").rows
    assert lines == [f"every sample weight of head ctr (column w) in {tmp_path / 'zeros' / 'train'} is 0 "
                     f"({rows} rows): its loss is 0 at every step, so it learns nothing"]
    assert label_warnings(spec, types.SimpleNamespace(path=tmp_path / "some" / "train")) == []


def test_one_class_labels_and_zero_weights_are_said_without_the_conversions_statistics(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The warnings read the conversion's _flowrec_stats.json alone, so a dataset without it (written
    by another tool and bound with format: parquet, or its statistics file removed) trained on
    labels of one class, or on weights all 0, without a word; now its Parquet parts are read (their
    footers' minimum and maximum, else the label and weight columns alone)."""
    import types

    import pyarrow.parquet as pq

    from flowrec.data.layout import read_meta
    from flowrec.data.rawstats import STATS_FILE
    from flowrec.runtime.session import label_warnings
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    spec = spec_from_dict({**to_dict(_spec()), "heads": [{"name": "ctr", "input": "top", "sample_weight": "w"}]})
    for name, clicks, weights in (("ones", [1] * 40, [0] * 40), ("both", [i % 2 for i in range(40)], [1] * 40)):
        path = tmp_path / f"{name}.csv"
        path.write_text("price,user,clicked,w\n" + "".join(f"{i},u{i},{c},{w}\n" for i, (c, w) in
                                                           enumerate(zip(clicks, weights))), encoding="utf-8")
        convert(spec, "csv", [path], tmp_path / name)
        (tmp_path / name / STATS_FILE).unlink()
    folder = tmp_path / "ones"
    expected = [f"every training label of head ctr (column clicked) in {folder} is 1 (40 rows): it can only "
                "learn to predict 1",
                f"every sample weight of head ctr (column w) in {folder} is 0 (40 rows): its loss is 0 at every "
                "step, so it learns nothing"]
    assert read_meta(folder).rows == 40
    assert label_warnings(spec, types.SimpleNamespace(path=folder)) == expected
    assert label_warnings(spec, types.SimpleNamespace(path=tmp_path / "both")) == []
    for part in folder.glob("*.parquet"):  # a writer that keeps no statistics in the footers: the columns are read
        pq.write_table(pq.read_table(part), part, write_statistics=False, row_group_size=7)
        assert pq.ParquetFile(part).metadata.row_group(0).column(0).statistics is None
    assert label_warnings(spec, types.SimpleNamespace(path=folder)) == expected
    for part in (tmp_path / "both").glob("*.parquet"):  # mixed labels, weights all 1: the first row group decides
        pq.write_table(pq.read_table(part), part, write_statistics=False, row_group_size=7)
    reads = []
    read = pq.ParquetFile.read_row_group
    monkeypatch.setattr(pq.ParquetFile, "read_row_group", lambda self, g, **kw: reads.append(g) or read(self, g, **kw))
    assert label_warnings(spec, types.SimpleNamespace(path=tmp_path / "both")) == [] and reads == [0, 0]


def test_ids_written_as_floats_unlike_the_training_rows_are_said(tmp_path: Path) -> None:
    """pandas writes an integer id column with a missing value as floats, so its CSV holds "12.0"
    where the training rows held "12": converted with the run's encoder (or scored by predict),
    almost every id was unknown (row 0) without a word. Now a line names the column and the fix;
    the ids are not merged ("12.0" stays unknown, as "012" would)."""
    import pyarrow.parquet as pq

    from flowrec.data.encode import UnseenIds
    from flowrec.data.encoder_record import load_encoder, raw_encoder
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    doc = to_dict(_spec())
    doc["features"][1] = {"name": "user", "type": "categorical", "vocab": 64, "vocab_spare": 40, "dim": 4}
    spec = spec_from_dict(doc)
    clean, floats = tmp_path / "clean.csv", tmp_path / "floats.csv"
    clean.write_text("price,user,clicked\n" + "".join(f"{i},{i % 30},{i % 2}\n" for i in range(60)), encoding="utf-8")
    floats.write_text("price,user,clicked\n" + "".join(f"{i},{'' if i == 7 else f'{i % 30}.0'},{i % 2}\n"
                                                        for i in range(60)), encoding="utf-8")
    for trained, other in ((clean, floats), (floats, clean)):
        convert(spec, "csv", [trained], tmp_path / trained.stem)
        encoder = load_encoder(raw_encoder(tmp_path / trained.stem), spec)
        for grow in (False, True):
            out = tmp_path / f"{other.stem}-{grow}"
            report = convert(spec, "csv", [other], out, encoder=encoder, grow=grow)
            (line,) = [w for w in report.warnings if w.startswith("column user: ")]
            assert bool(report.growth and report.growth[0].added) == grow  # grown: the new ids' rows are told too
            assert "ids are not in the vocabulary of feature user" in line and "(pandas' nullable dtype" in line
            assert ("'0.0' is '0' there): these rows write the ids as floats" if other is floats else
                    "'0' is '0.0' there): these rows write the ids as whole numbers") in line, line
        assert not [w for w in convert(spec, "csv", [trained], tmp_path / f"again-{trained.stem}", encoder=encoder,
                                       grow=False).warnings if w.startswith("column user")]
    assert (pq.read_table(tmp_path / "floats-False").column("user").to_numpy() == 0).all()  # not merged
    unseen = UnseenIds(load_encoder(raw_encoder(tmp_path / "clean"), spec))
    unseen.observe(pa.table({"user": ["1", "2", "3", "4.0"]}))  # a few, as new ids may be: not looked for
    assert unseen.counts == {"user": [4, 1, 0]} and unseen.lines() == []
    from flowrec.data.encode import Encoder

    days = Encoder(spec, {}, {"user": pa.array(["2024-01-05", "2024-01-06"])}, {})  # pandas' CSV of midnights
    unseen = UnseenIds(days)
    unseen.observe(pa.table({"user": pa.array([1704412800, 1704499200], pa.timestamp("s")).cast(pa.timestamp("us"))}))
    (line,) = unseen.lines()
    assert "('2024-01-05 00:00:00.000000' is '2024-01-05' there): these rows write times as" in line, line
    unseen = UnseenIds(Encoder(spec, {}, {"user": pa.array(["u1", "u2", "u3"])}, {}))
    unseen.observe(pa.table({"user": [" u1", " u2", " u3", "u1"]}))  # a CSV of ', ' between its fields
    (line,) = unseen.lines()
    assert "3 of 4 ids" in line and "(' u1' is 'u1' there): these rows write ids with spaces around them" in line


def test_booleans_are_the_ids_the_vocabulary_writes(tmp_path: Path) -> None:
    """A run trained on a CSV pandas wrote (True, False) encoded the same rows from Parquet or a
    DataFrame, whose bools are Arrow's 'true', as unknown ids (and --encoder-from grew the
    vocabulary by 'true' and 'false'), without a word; now a bool column takes the vocabulary's
    text. Text ids stay as written: CSV's 'true' for a vocabulary of 'True' is one warning."""
    import pyarrow.parquet as pq

    from flowrec.data.encoder_record import load_encoder, raw_encoder
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    doc = to_dict(_spec())
    doc["features"][1] = {"name": "user", "type": "categorical", "vocab": 64, "dim": 4}
    spec = spec_from_dict(doc)
    flags = [i % 3 == 0 for i in range(30)]
    (tmp_path / "pandas.csv").write_text("price,user,clicked\n" + "".join(
        f"{i},{f},{i % 2}\n" for i, f in enumerate(flags)), encoding="utf-8")
    (tmp_path / "arrow.csv").write_text("price,user,clicked\n" + "".join(
        f"{i},{str(f).lower()},{i % 2}\n" for i, f in enumerate(flags)), encoding="utf-8")
    pq.write_table(pa.table({"price": [float(i) for i in range(30)], "user": flags,
                             "clicked": [i % 2 for i in range(30)]}), tmp_path / "rows.parquet")
    convert(spec, "csv", [tmp_path / "pandas.csv"], tmp_path / "tr")
    encoder = load_encoder(raw_encoder(tmp_path / "tr"), spec)
    expected = pq.read_table(tmp_path / "tr").column("user").to_pylist()
    assert 0 not in expected
    for grow in (False, True):
        report = convert(spec, "parquet", [tmp_path / "rows.parquet"], tmp_path / f"pq-{grow}", encoder=encoder,
                         grow=grow)
        assert pq.read_table(tmp_path / f"pq-{grow}").column("user").to_pylist() == expected
        assert not report.growth or all(g.added == 0 for g in report.growth)
    report = convert(spec, "csv", [tmp_path / "arrow.csv"], tmp_path / "text", encoder=encoder, grow=False)
    (line,) = [w for w in report.warnings if w.startswith("column user: ")]
    assert "'true' is 'True' there): these rows write booleans as 'true'" in line, line
    assert (pq.read_table(tmp_path / "text").column("user").to_numpy() == 0).all()  # text ids as written


def test_labels_and_dense_values_a_csv_writes_as_booleans_are_ones_and_zeros(tmp_path: Path) -> None:
    """pandas writes a bool column as True/False: such a CSV's label column made every row malformed,
    with a hint to skip them all, where the same rows from Parquet (bools) are labels 1 and 0."""
    import pyarrow.parquet as pq

    flags = [i % 3 == 0 for i in range(12)]
    (tmp_path / "rows.csv").write_text("price,user,clicked\n" + "".join(
        f"{['TRUE', 'false', ' True'][i % 3] if i < 3 else float(i)},u{i},{f}\n" for i, f in enumerate(flags)),
        encoding="utf-8")
    pq.write_table(pa.table({"price": [1.0, 0.0, 1.0, *map(float, range(3, 12))],
                             "user": [f"u{i}" for i in range(12)], "clicked": flags}), tmp_path / "rows.parquet")
    for fmt in ("csv", "parquet"):
        assert convert(_spec(), fmt, [tmp_path / f"rows.{fmt}"], tmp_path / fmt).errors == 0
    text, typed = (pq.read_table(tmp_path / fmt) for fmt in ("csv", "parquet"))
    assert text.column("clicked").to_pylist() == [float(f) for f in flags] == typed.column("clicked").to_pylist()
    assert text.column("price").to_pylist() == typed.column("price").to_pylist()
    (tmp_path / "bad.csv").write_text("price,user,clicked\n1,u1,0\n2,u2,1\n3,u3,yes\n", encoding="utf-8")  # (all text: test_labels7_messages)
    with pytest.raises(DataError, match="non-numeric value 'yes' in column clicked"):
        convert(_spec(), "csv", [tmp_path / "bad.csv"], tmp_path / "bad")


def test_rows_of_other_column_names_convert_with_a_runs_encoder_and_its_model_takes_them(tmp_path: Path) -> None:
    """A new file naming a column otherwise, mapped by the spec's data.columns: `data convert
    --encoder-from RUN` stopped on a KeyError traceback (the encoder read the training rows' column
    names), and the data, once converted, was refused by train and eval as 'encoded with another
    encoder ... differs in column; convert it with --encoder-from RUN', which it was."""
    import pyarrow.parquet as pq

    from flowrec.data.encoder_record import check_same_encoder, load_encoder, raw_encoder, record_of_dataset
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    (tmp_path / "a.csv").write_text("price,user,clicked\n" + "".join(f"{i},u{i % 7},{i % 2}\n" for i in range(30)),
                                    encoding="utf-8")
    (tmp_path / "b.csv").write_text("price,uid,click\n" + "".join(f"{i},u{i % 7},{i % 2}\n" for i in range(30)),
                                    encoding="utf-8")
    doc = to_dict(_spec())
    doc["features"][1] = {"name": "user", "type": "categorical", "vocab": 16, "dim": 4}
    spec = spec_from_dict(doc)
    renamed = spec_from_dict({**doc, "data": {**doc["data"], "columns": {"user": "uid", "clicked": "click"}}})
    convert(spec, "csv", [tmp_path / "a.csv"], tmp_path / "a")
    encoder = load_encoder(raw_encoder(tmp_path / "a"), spec)
    convert(renamed, "csv", [tmp_path / "b.csv"], tmp_path / "b", encoder=encoder, grow=False)
    assert pq.read_table(tmp_path / "b").equals(pq.read_table(tmp_path / "a"))
    check_same_encoder(record_of_dataset(tmp_path / "a"), record_of_dataset(tmp_path / "b"), "b")  # no refusal
    (tmp_path / "d.csv").write_text("price,user,clicked\n" + "".join(f"{i},v{i % 7},{i % 2}\n" for i in range(30)),
                                    encoding="utf-8")
    convert(spec, "csv", [tmp_path / "d.csv"], tmp_path / "d")
    with pytest.raises(DataError, match="'user' differs in its vocabulary"):
        check_same_encoder(record_of_dataset(tmp_path / "a"), record_of_dataset(tmp_path / "d"), "d")


def test_a_nan_in_a_float_id_column_is_a_missing_id(tmp_path: Path) -> None:
    """Raw Parquet ids as floats (polars, DuckDB or pyarrow write a missing one as NaN, not null)
    encoded NaN as the id 'nan': a hashed row of its own shared by every missing user, where null
    is row 0 (missing), as a dense column's NaN is a missing value."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    nan = float("nan")
    pq.write_table(pa.table({"price": [1.0, 2.0, 3.0, 4.0], "user": [7.0, nan, None, 7.0],
                             "clicked": [0, 1, 0, 1]}), tmp_path / "rows.parquet")
    convert(_spec(), "parquet", [tmp_path / "rows.parquet"], tmp_path / "out")
    users = pq.read_table(tmp_path / "out").column("user").to_pylist()
    assert users[1] == users[2] == 0 and users[0] == users[3] != 0


@pytest.mark.parametrize("names", [["price", "", "user", "clicked"], ["price", "user", "clicked", "", ""],
                                   ["", "price", "user", "", "clicked", ""]], ids=lambda n: ",".join(n))
@pytest.mark.parametrize("folder", [False, True], ids=["file", "folder"])
def test_parquet_columns_of_no_name_are_unused_one_or_many(tmp_path: Path, names: list, folder: bool) -> None:
    """Raw Parquet holding two columns of no name ('' twice: pandas writes a frame's column '') was
    refused, naming the file and their positions, where a CSV header's are unused columns
    (62cd0bd). Now a Parquet file's are too: the rows equal those of the file without them."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    columns = {"price": rng.random(300).round(3), "user": [f"u{i}" for i in rng.integers(50, size=300)],
               "clicked": rng.integers(2, size=300)}
    pq.write_table(pa.table(columns), tmp_path / "plain.parquet")
    rows = tmp_path / "rows" / "day=1" if folder else tmp_path / "rows"
    rows.mkdir(parents=True)
    extra = iter([rng.integers(9, size=300), ["x"] * 300, rng.random(300)])
    pq.write_table(pa.table([columns[n] if n else next(extra) for n in names], names=names), rows / "a.parquet")
    convert(_spec(), "parquet", [tmp_path / "plain.parquet"], tmp_path / "a")
    convert(_spec(), "parquet", [tmp_path / "rows"], tmp_path / "b")
    a, b = pq.read_table(tmp_path / "a"), pq.read_table(tmp_path / "b")
    assert a.num_rows == 300 and a.equals(b)


@pytest.mark.parametrize("kind", ["int64", "string"])
def test_a_hive_folder_whose_files_hold_their_partition_column_is_read(tmp_path: Path, kind: str) -> None:
    """rows/day=1/a.parquet holding a column `day` too (a folder written by hand, one file a day)
    was a traceback: pyarrow's merge of the files' schema with the partition keys' ("Unable to
    merge: Field day has incompatible types: int64 vs int32"). Now it reads as the folder without
    that column in its files."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    for day in (1, 2):
        columns = {"price": rng.random(100).round(3), "user": [f"u{i}" for i in rng.integers(50, size=100)],
                   "clicked": rng.integers(2, size=100)}
        key = pa.array([day if kind == "int64" else str(day)] * 100)
        for root, held in (("plain", {}), ("rows", {"day": key})):
            (tmp_path / root / f"day={day}").mkdir(parents=True)
            pq.write_table(pa.table({**columns, **held}), tmp_path / root / f"day={day}" / "a.parquet")
    spec = _spec(columns={"user": "day"})  # the partition key is read, as an id
    convert(spec, "parquet", [tmp_path / "plain"], tmp_path / "a")
    convert(spec, "parquet", [tmp_path / "rows"], tmp_path / "b")
    a, b = pq.read_table(tmp_path / "a"), pq.read_table(tmp_path / "b")
    assert a.num_rows == 200 and a.equals(b)


def test_an_encoded_dataset_in_hive_folders_named_by_its_columns_is_read(tmp_path: Path) -> None:
    """An encoded dataset whose part was moved under `user=1/` (a Hive folder named by one of its
    columns) was a traceback in `data inspect`, `data profile` and training: listing the parts
    merged their columns with the folders' keys ("Unable to merge: Field user has incompatible
    types: int64 vs int32"). The parts are read by name, so now they are only listed."""
    import pyarrow.parquet as pq

    from flowrec.data.dataset import ParquetSource

    rows = "".join(f"{i / 10},u{i % 7},{i % 2}\n" for i in range(50))
    (tmp_path / "x.csv").write_text("price,user,clicked\n" + rows)
    convert(_spec(), "csv", [tmp_path / "x.csv"], tmp_path / "data")
    expected = pq.read_table(tmp_path / "data")
    (tmp_path / "data" / "user=1").mkdir()
    for part in (tmp_path / "data").glob("part-*.parquet"):
        part.rename(tmp_path / "data" / "user=1" / part.name)
    source = ParquetSource(tmp_path / "data")
    try:
        assert sum(source.partition_rows()) == 50
        assert [Path(f).parent.name for f in source.files] == ["user=1"]
    finally:
        source.close()
    assert pq.read_table(source.files[0]).equals(expected)


@pytest.mark.parametrize("content, says", [(b'{"a": ', "is not JSON"), (b"", "is empty"),
                                           (b"\xff\xfe{}", "is not UTF-8 text")])
def test_unreadable_dataset_metadata_is_one_plain_line(tmp_path: Path, content: bytes, says: str) -> None:
    """A damaged DATA/_flowrec.json said 'unreadable metadata (NotJsonError: DATA/_flowrec.json is not
    JSON (...))' (UnicodeDecodeError: 'utf-8' codec can't decode byte 0xff ...): Python's exception
    names and the file twice; now one plain line naming the file once."""
    from flowrec.data.layout import META_FILE, read_meta

    (tmp_path / "data").mkdir()
    (tmp_path / "data" / META_FILE).write_bytes(content)
    with pytest.raises(DataError) as caught:
        read_meta(tmp_path / "data")
    text = str(caught.value)
    assert text.startswith(f"{tmp_path / 'data' / META_FILE} {says}") and text.count(META_FILE) == 1, text
    assert "Error" not in text and "codec" not in text, text


def test_inspect_of_damaged_raw_statistics_does_not_say_there_are_none(tmp_path: Path) -> None:
    """`data inspect DATA` with a damaged DATA/_flowrec_stats.json warned that it is damaged, then said
    '(no raw statistics: the dataset was not converted from raw files, or by an older flowrec ...)'."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    (tmp_path / "x.csv").write_text("price,user,clicked\n" + "".join(f"{i},u{i % 3},{i % 2}\n" for i in range(20)))
    convert(_spec(), "csv", [tmp_path / "x.csv"], tmp_path / "data")
    (tmp_path / "data" / "_flowrec_stats.json").write_text("[]")
    result = CliRunner().invoke(app, ["data", "inspect", str(tmp_path / "data")])
    assert result.exit_code == 0 and "_flowrec_stats.json is damaged" in result.stderr, result.output
    assert "not converted from raw files" not in result.output, result.output


def test_a_folder_a_job_still_writes_into_is_named_and_hidden_files_stay_silent(tmp_path: Path) -> None:
    """`data convert parquet raw OUT` while a Spark job still wrote into raw (its `_temporary/`) read
    the rows already committed and said nothing: a dataset of part of the rows, without a word; so
    did a `.hidden/` folder of Parquet files. Each is now one warning line naming the folder; files
    that are never data (`_SUCCESS`, `.part-0.parquet.crc`, `.DS_Store`) and a folder of them stay
    silent."""
    from flowrec.data.parquet_folder import unread_lines

    rng = np.random.default_rng()

    def rows() -> dict[str, object]:
        n = int(rng.integers(3, 40))
        users = [f"u{k}" for k in rng.zipf(1.4, n)]
        users[int(rng.integers(n))] = "u0"  # zipf never draws 0: the column is never of one value
        return {"price": rng.lognormal(0, 2, n).tolist(), "user": users,
                "clicked": (rng.random(n) < 0.15).astype(int).tolist()}

    committed = rows()
    raw = _parquet_folder(tmp_path / "raw", {"part-0.parquet": committed,
                                             "_temporary/0/_temporary/attempt_0/part-1.parquet": rows(),
                                             ".hidden/part-2.parquet": rows()})
    for name in ("_SUCCESS", ".part-0.parquet.crc", ".DS_Store", ".cache/.DS_Store", "_logs/x.txt"):
        (raw / name).parent.mkdir(exist_ok=True)
        (raw / name).write_bytes(rng.bytes(int(rng.integers(1, 50))))
    report = convert(_spec(), "parquet", [raw], tmp_path / "out")
    assert report.rows == len(committed["price"])
    assert len(report.warnings) == 2, report.warnings
    writing, unread = report.warnings
    assert f"{raw}/_temporary" in writing and "still writing" in writing and ".hidden" not in writing
    assert f"{raw}/.hidden (1 Parquet file)" in unread and "not read" in unread
    assert not any(word in line for line in report.warnings for word in (".crc", ".DS_Store", "_SUCCESS", "_logs"))
    shutil.rmtree(raw / "_temporary")
    shutil.rmtree(raw / ".hidden")
    assert unread_lines(raw) == []  # marker files and folders without Parquet files: silent


@pytest.mark.parametrize("fmt", ["avazu", "criteo"])
def test_formats_of_fixed_layout_read_their_encoding_and_refuse_layout_options(tmp_path: Path, fmt: str) -> None:
    """avazu and criteo took data.options unread: `encoding: latin-1` passed validate and the file
    was still refused as invalid UTF-8, and `sep: ";"` read a comma file as if it were not there.
    Now encoding is read (the values equal those of the UTF-8 file), and sep, header and names,
    which their layout fixes, are one line naming format csv."""
    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    rng = np.random.default_rng()
    sites = [rng.choice(["caf\u00e9", "na\u00efve", "plain", "\u00fcber"]) + str(int(rng.zipf(1.5))) for _ in range(40)]
    if fmt == "avazu":
        text = "id,click,hour,site_id\n" + "".join(f"{k},{int(rng.integers(2))},14102100,{s}\n" for k, s in enumerate(sites))
        column = "site_id"
    else:
        text = "".join(f"{int(rng.integers(2))}\t" + "\t".join(str(int(v)) for v in rng.integers(0, 50, 13))
                       + "\t" + s + "\t" * 25 + "\n" for s in sites)
        column = "C1"

    def read(name: str, options: dict) -> list[str]:
        path = tmp_path / name
        tables = list(sources.reader(fmt)(path, options, ErrorLog("fail", str(path)), set()))
        return [v for t in tables for v in t.column(column).to_pylist()]

    (tmp_path / "utf8.txt").write_text(text, encoding="utf-8")
    (tmp_path / "latin1.txt").write_bytes(text.encode("latin-1"))
    assert read("utf8.txt", {}) == sites
    assert read("latin1.txt", {"encoding": "latin-1", "test_fraction": 0.2}) == sites
    for key, value in (("sep", ";"), ("header", False), ("names", ["a", "b"])):
        with pytest.raises(DataError, match=rf"data\.options\.{key} does not apply to format {fmt} .*format csv"):
            read("utf8.txt", {key: value})


@pytest.mark.parametrize("text", [b"", b"\n\n", b"\r\n\r\n\r\n"])
@pytest.mark.parametrize("fmt", ["csv", "avazu"])
def test_an_empty_or_blank_text_file_is_one_line_in_flowrecs_words(tmp_path: Path, text: bytes, fmt: str) -> None:
    """`data convert csv empty.csv` said pyarrow's 'cannot read empty.csv: Empty CSV file' (or 'CSV
    parse error: Empty CSV file or block: cannot infer number of columns' for blank lines); it now
    says the file holds no rows, as the criteo reader and docs/data.md do."""
    from flowrec.data import sources
    from flowrec.data.error_log import ErrorLog

    path = tmp_path / "rows.csv"
    path.write_bytes(text)
    with pytest.raises(DataError, match=r"rows\.csv holds no rows \(it is empty or blank\)$"):
        list(sources.reader(fmt)(path, {}, ErrorLog("fail", str(path)), set()))


def _skewed_rows(rng: np.random.Generator, n: int, price: bool = True, user: bool = True,
                 label: bool = True) -> str:
    """CSV rows of `csv_spec` (price, user, clicked) with skewed values; a column left out is
    written empty in every row (nothing, `nan` in a number column, spaces in the id column)."""
    blanks, missing = ("", " ", "  "), ("", "nan", "")
    return "price,user,clicked\n" + "".join(
        f"{rng.lognormal(1.0, 1.5) if price else missing[i % 3]},"
        f"{f'u{rng.zipf(1.4)}' if user else blanks[i % 3]},"
        f"{int(rng.random() < 0.15) if label else missing[i % 3]}\n" for i in range(n))


@pytest.mark.parametrize("empty", ["user", "price"])
def test_a_feature_column_empty_in_every_row_is_said_naming_the_column_and_the_file(
        tmp_path: Path, empty: str) -> None:
    """A feature column empty (blank or null) in every row converted without a word: every id was
    the missing id (every dense value its fill), a model trained on nothing from it; now one
    warning line per such feature names the column and the file."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    n = int(rng.integers(200, 400))
    path = tmp_path / "day.csv"
    path.write_text(_skewed_rows(rng, n, price=empty != "price", user=empty != "user"))
    report = convert(_spec(), "csv", [path], tmp_path / "out")
    said = [line for line in report.warnings if f"column {empty!r}" in line]
    assert len(said) == 1 and said[0].startswith(f"{path}: ") and f"every one of its {n:,} rows" in said[0], \
        report.warnings
    assert ("missing id (row 0)" if empty == "user" else "fill value 0") in said[0]
    assert not [line for line in report.warnings if "is empty in every" in line and line not in said]
    written = pq.read_table(tmp_path / "out").column(empty).to_numpy()
    assert (written[0::3] == 0).all() and len(np.unique(written)) <= 3  # missing (or fill), 2 texts of blanks
    # one row holding a value, the last, is a column that holds data: no warning
    lines = path.read_text().splitlines()
    last = lines[-1].split(",")
    last[1 if empty == "user" else 0] = "u7" if empty == "user" else "2.5"
    path.write_text("\n".join([*lines[:-1], ",".join(last)]) + "\n")
    report = convert(_spec(), "csv", [path], tmp_path / "out2")
    assert not [line for line in report.warnings if "is empty in every" in line], report.warnings


def test_a_feature_column_empty_in_a_parquet_file_and_in_bound_training_data_is_said(tmp_path: Path) -> None:
    """Parquet nulls (a dense NaN and a null id column) are as empty as blank text, and `flowrec
    train` encoding a spec's bound raw data says so too (the train path that converts raw files)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import yaml
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import mini_spec

    rng = np.random.default_rng()
    n = int(rng.integers(300, 500))
    pq.write_table(pa.table({"price": np.full(n, np.nan), "user": pa.array([None] * n, pa.string()),
                             "clicked": (rng.random(n) < 0.2).astype(float)}), tmp_path / "raw.parquet")
    report = convert(_spec(), "parquet", [tmp_path / "raw.parquet"], tmp_path / "out")
    assert sorted(line.split("'")[1] for line in report.warnings if "is empty in every" in line) == ["price", "user"]
    doc = yaml.safe_load(mini_spec("emptybound"))
    doc["data"] = {"format": "csv", "path": "rows.csv", "label": "clicked"}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    (tmp_path / "rows.csv").write_text("d1,user,clicked\n" + "".join(
        f"{rng.lognormal():.4f},,{int(rng.random() < 0.3)}\n" for _ in range(n)))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "spec.yaml"), "--out", str(tmp_path / "run"),
                                      "--epochs", "1", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    said = [line for line in result.output.splitlines() if "is empty in every" in line]
    assert len(said) == 1 and "column 'user'" in said[0] and "rows.csv" in said[0], result.output


@pytest.mark.parametrize("on_error", ["fail", "skip"])
def test_a_label_column_empty_in_every_row_is_refused_naming_it_not_advised_to_skip(
        tmp_path: Path, on_error: str) -> None:
    """A label column empty in every row said 'malformed row at day.csv:2: missing label in column
    clicked (use --on-error skip to skip such rows)', advice that skips every row; now one line
    naming the column, its head and the file, whatever --on-error."""
    rng = np.random.default_rng()
    path = tmp_path / "day.csv"
    path.write_text(_skewed_rows(rng, int(rng.integers(50, 300)), label=False))
    rows = "the \\d+ rows read" if on_error == "fail" else "its \\d+ rows"
    with pytest.raises(DataError, match=rf"day\.csv: column 'clicked', the label of head ctr, is empty in every one "
                                        rf"of {rows}: no row could train") as caught:
        convert(_spec(), "csv", [path], tmp_path / "out", on_error=on_error)
    assert "--on-error skip" not in str(caught.value)
    assert not (tmp_path / "out").exists()


def test_a_link_loop_given_as_a_path_is_one_line_naming_it(tmp_path: Path) -> None:
    """A link loop (`ln -s b a; ln -s a b`) given as data convert's input or output, train's --out,
    or a spec's data.path was Python's 'RuntimeError: Symlink loop from ...' traceback (or its words),
    and as --data or data inspect's folder 'dataset directory not found'; now one line naming the link."""
    import yaml
    from typer.testing import CliRunner

    from flowrec.cli import app

    rng = np.random.default_rng()
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    (tmp_path / "rows.csv").write_text(_skewed_rows(rng, int(rng.integers(20, 80))))
    doc = {"name": "loops", "features": [{"name": "price", "type": "dense"},
                                         {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
           "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}], "data": {"format": "csv", "path": "a/rows.csv", "label": "clicked"}}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(doc))
    spec, loop = str(tmp_path / "spec.yaml"), str(tmp_path / "a")
    for args, name in ((["data", "convert", "csv", loop, str(tmp_path / "out"), "--spec", spec, "-q"], "SOURCE"),
                       (["data", "convert", "csv", str(tmp_path / "rows.csv"), loop, "--spec", spec, "-q"], "OUT"),
                       (["data", "inspect", f"{loop}/x"], "DATA"),
                       (["train", spec, "--data", loop, "--device", "cpu"], "--data"),
                       (["train", spec, "--out", loop, "--device", "cpu"], "--out"),
                       (["train", spec, "--out", str(tmp_path / "run"), "--device", "cpu"], "the spec's data binding")):
        result = CliRunner().invoke(app, args)
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, (args, result.output)
        assert lines[0].startswith(f"error: {name}") and f"{loop} is a link loop" in lines[0], (args, lines)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b", "rows.csv", "spec.yaml"]


@pytest.mark.parametrize("fmt, name", [("libsvm", "rows.libsvm.gz"), ("csv", "rows.csv.gz")])
def test_a_truncated_gzip_file_is_one_line_naming_it(tmp_path: Path, fmt: str, name: str) -> None:
    """A .gz file cut short (a download or copy that stopped) given to libsvm said only 'error:
    Truncated compressed stream', naming no file (the CSV formats named it)."""
    import gzip

    rng = np.random.default_rng()
    n = int(rng.integers(2_000, 5_000))
    if fmt == "libsvm":
        text = "".join(f"{int(rng.random() < 0.2)} 0:{rng.lognormal():.4f} 1:{rng.zipf(1.3)}\n" for _ in range(n))
        spec = _spec(options={"fields": ["price", "user"]})
    else:
        text, spec = _skewed_rows(rng, n), _spec()
    packed = gzip.compress(text.encode())
    (tmp_path / name).write_bytes(packed[:int(len(packed) * rng.uniform(0.3, 0.9))])
    with pytest.raises(DataError, match=rf"^cannot read {re.escape(str(tmp_path / name))}: .*[Tt]runcated"):
        convert(spec, fmt, [tmp_path / name], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_inspect_of_a_dataset_with_a_damaged_part_names_that_part(tmp_path: Path) -> None:
    """A dataset whose later part file is 0 bytes (a disk that filled, a copy cut short) was said by
    `data inspect` to have an unreadable first part, a good file: the count of readable parts was
    never kept when one failed. The damaged part is named."""
    from flowrec.data.inspect import inspect_dataset

    rng = np.random.default_rng()
    path = tmp_path / "rows.csv"
    path.write_text(_skewed_rows(rng, int(rng.integers(300, 600))))
    convert(_spec(), "csv", [path], tmp_path / "ds", rows_per_file=int(rng.integers(40, 90)))
    parts = sorted((tmp_path / "ds").glob("part-*.parquet"))
    damaged = parts[int(rng.integers(1, len(parts)))]
    damaged.write_bytes(b"")
    with pytest.raises(DataError, match=rf"^{re.escape(str(damaged))}: unreadable Parquet part"):
        inspect_dataset(tmp_path / "ds")


def test_a_file_whose_every_row_is_one_row_repeated_is_said_per_feature(tmp_path: Path) -> None:
    """A file whose every row is a duplicate of one row (an export that repeated its first row, a
    column an export filled with one value) converted without a word: a model learns nothing from a
    feature that holds one value in every row. One warning line per such feature, naming the
    column, the value and the file; a column that holds a second value in its last row says nothing."""
    rng = np.random.default_rng()
    n = int(rng.integers(100, 400))
    row = f"{rng.lognormal(1.0, 1.5):.4f},u{rng.zipf(1.3)},{int(rng.random() < 0.5)}\n"
    path = tmp_path / "day.csv"
    path.write_text("price,user,clicked\n" + row * n)
    report = convert(_spec(), "csv", [path], tmp_path / "out")
    said = sorted(line for line in report.warnings if "holds one value" in line)
    price, user = row.split(",")[:2]
    assert said == [f"{path}: column 'price' (feature price) holds one value ({float(price)!r}) in every one of its "
                    f"{n:,} rows: a model learns nothing from it; a column an export filled, or a file of one row "
                    "repeated?",
                    f"{path}: column 'user' (feature user) holds one value ({user!r}) in every one of its {n:,} rows: "
                    "a model learns nothing from it; a column an export filled, or a file of one row repeated?"]
    path.write_text("price,user,clicked\n" + row * n + f"{float(price) + 1},{user}7,0\n")
    report = convert(_spec(), "csv", [path], tmp_path / "out2")
    assert not [line for line in report.warnings if "holds one value" in line], report.warnings


@pytest.mark.parametrize("header", ["use\u0301r id", "us\u00e9r\u00a0id"], ids=["accent-apart", "no-break-space"])
def test_a_header_name_that_only_looks_like_the_specs_says_how_it_differs(tmp_path: Path, header: str) -> None:
    """A header naming a column with its accent written apart (NFD, as macOS writes names) or a
    no-break space was refused as "columns ['usér id'] ... not in the input (has [..., 'usér id',
    ...])", two names that print alike; the line now shows both with their code points."""
    rng = np.random.default_rng()
    path = tmp_path / "day.csv"
    path.write_text(_skewed_rows(rng, int(rng.integers(20, 90))).replace("price,user,", f"price,{header},", 1))
    with pytest.raises(DataError, match=r"looks like 'us\\xe9r id' but is written with other characters") as caught:
        convert(_spec(columns={"user": "us\u00e9r id"}), "csv", [path], tmp_path / "out")
    assert ascii(header) in str(caught.value)
    path.write_text(path.read_text().replace(header, "us\u00e9r id", 1))  # the same characters: converts
    assert convert(_spec(columns={"user": "us\u00e9r id"}), "csv", [path], tmp_path / "out").rows > 0


@pytest.mark.parametrize("options", [{"test_fraction": 0.2}, {"sep": ";"}])
def test_rows_lacking_a_column_for_a_package_whose_spec_sets_data_options_are_one_line(
        tmp_path: Path, options: dict) -> None:
    """`flowrec predict PKG rows.csv` (and model.predict) of rows lacking a column, for a package
    whose spec sets any data.options (test_fraction, sep), was "AttributeError: 'tuple' object has
    no attribute 'get'": the separator note read the spec's options, frozen as (key, value) pairs,
    as a dict. It is the one line naming the columns (and the separator the package reads)."""
    from flowrec.serving.predict import separator_note

    spec = _spec(options=options)
    reads = options.get("sep", ",")
    other = "\t" if reads != "\t" else ","
    note = separator_note([other.join(["price", "user", "clicked"])], ["price", "user"], spec)
    assert note.startswith("; the header looks ") and f"where the package reads {reads!r}-separated text" in note
    assert separator_note(["prix", "usr"], ["price", "user"], spec) == ""


@pytest.mark.parametrize("feature", ["user", "price"])
def test_a_feature_mapped_to_the_label_column_is_said(tmp_path: Path, feature: str) -> None:
    """data.columns mapping a feature to the label column (a slip of the pen: `user: clicked`)
    converted without a word, and the model, given the answer as an input, trained to a loss near
    0; one warning line names the feature, the column and the head."""
    rng = np.random.default_rng()
    path = tmp_path / "day.csv"
    path.write_text(_skewed_rows(rng, int(rng.integers(50, 200))))
    report = convert(_spec(columns={feature: "clicked"}), "csv", [path], tmp_path / "out")
    said = [line for line in report.warnings if "is given the answer" in line]
    assert said == [f"feature {feature} reads column 'clicked', the label of head ctr: the model is given the answer "
                    f"it is to predict; map feature {feature} to another column (data.columns)"], report.warnings
    report = convert(_spec(), "csv", [path], tmp_path / "out2")
    assert not [line for line in report.warnings if "is given the answer" in line], report.warnings


def test_a_label_column_empty_in_its_first_chunk_only_skips_those_rows(tmp_path: Path) -> None:
    """Under --on-error skip a label column is refused only when no row of the file holds a label:
    a file whose first chunk (65,536 Parquet rows) lacks labels and whose later rows hold them
    converts the later rows, the others skipped as malformed."""
    import pyarrow.parquet as pq

    from flowrec.data.sources import PARQUET_BATCH_ROWS

    rng = np.random.default_rng()
    later = int(rng.integers(10, 500))
    n = PARQUET_BATCH_ROWS + later
    labels = (rng.random(n) < 0.2).astype(float)
    labels[:PARQUET_BATCH_ROWS] = np.nan
    pq.write_table(pa.table({"price": rng.lognormal(1.0, 1.5, n), "user": [f"u{i}" for i in rng.zipf(1.3, n)],
                             "clicked": labels}), tmp_path / "day.parquet")
    report = convert(_spec(), "parquet", [tmp_path / "day.parquet"], tmp_path / "out", on_error="skip")
    assert (report.rows, report.errors) == (later, PARQUET_BATCH_ROWS)


def test_a_number_written_as_spaces_is_missing_as_an_empty_field_is(tmp_path: Path) -> None:
    """A dense or label value of spaces only (`1.5, ,0`, as a spreadsheet pads cells) was a malformed
    row, "non-numeric value ' '", where the same field left empty is a missing value: both now read
    alike (the dense value missing, the label's row a missing label)."""
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    n = int(rng.integers(200, 400))
    prices = [f"{float(v):.3f}" for v in rng.lognormal(0.0, 1.5, n)]
    users = [f"u{int(v)}" for v in rng.zipf(1.4, n) % 500]
    labels = [str(int(v)) for v in rng.integers(0, 2, n)]
    blank = rng.choice(n, size=max(2, n // 10), replace=False)
    spaces = [" " * int(rng.integers(1, 4)) for _ in blank]

    def write(name: str, fill: list[str], column: list[str], which: int) -> Path:
        cells = [prices, users, labels]
        cells = [list(c) for c in cells]
        for i, text in zip(blank, fill):
            cells[which][i] = text
        path = tmp_path / name
        path.write_text("price,user,clicked\n" + "".join(f"{p},{u},{c}\n" for p, u, c in zip(*cells)))
        return path

    empty, padded = write("empty.csv", [""] * len(blank), prices, 0), write("spaces.csv", spaces, prices, 0)
    convert(_spec(), "csv", [empty], tmp_path / "a")
    convert(_spec(), "csv", [padded], tmp_path / "b")
    a, b = pq.read_table(tmp_path / "a"), pq.read_table(tmp_path / "b")
    assert a.num_rows == n and a.equals(b)
    messages = []
    for name, fill in (("empty_label.csv", [""] * len(blank)), ("spaces_label.csv", spaces)):
        with pytest.raises(DataError) as caught:
            convert(_spec(), "csv", [write(name, fill, labels, 2)], tmp_path / name.replace(".csv", ""))
        messages.append(str(caught.value).replace(name, "F"))
    assert messages[0] == messages[1] and "non-numeric" not in messages[1]


def test_a_spec_cannot_make_convert_read_only_some_columns_or_rows_without_labels(tmp_path: Path) -> None:
    """flowrec predict passed its own reads (only the package's columns; rows may lack their label)
    through data.options, the spec's one open mapping, so a spec setting `read_columns` or
    `labels_unused` made convert and train read so (82f1fa3 refused the two keys at validate). They
    are a reader argument of predict's now (`Scoring`): in a spec they are options no reader reads,
    and convert reads every column and refuses a row without its label as before."""
    import pyarrow.parquet as pq

    from flowrec.spec.validate import validate_document

    rng = np.random.default_rng()
    n = int(rng.integers(40, 80))
    prices = np.round(rng.lognormal(2.0, 1.5, n), 3)
    users = rng.zipf(1.6, n) % 1000
    labels = (rng.random(n) < 0.2).astype(int)
    path = tmp_path / "x.csv"
    path.write_text("price,user,clicked\n" + "".join(f"{p},u{u},{c}\n" for p, u, c in zip(prices, users, labels)))
    internal = {"read_columns": ["price"], "labels_unused": True}
    doc = {"name": "opts", "features": [{"name": "price", "type": "dense"},
                                        {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
           "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}],
           "data": {"format": "csv", "path": "x.csv", "label": "clicked", "options": {**internal, "sep": ","}},
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
           "training": {"batch_size": 8}}
    issues = [str(i) for i in validate_document(doc)]  # options of no reader: unknown keys (plan15)
    assert [i.split(" (")[0] for i in issues] == ["data.options: unknown key 'read_columns'",
                                                   "data.options: unknown key 'labels_unused'"]
    convert(_spec(options={**internal}), "csv", [path], tmp_path / "with")
    convert(_spec(), "csv", [path], tmp_path / "plain")
    with_options, plain = pq.read_table(tmp_path / "with"), pq.read_table(tmp_path / "plain")
    assert with_options.num_rows == n and with_options.equals(plain)  # user read and encoded alike
    assert len(set(with_options.column("user").to_pylist())) > 1
    gap = int(rng.integers(0, n))
    lines = path.read_text().splitlines()
    lines[gap + 1] = lines[gap + 1].rsplit(",", 1)[0] + ","  # that row's label left empty
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(DataError, match=f"x.csv:{gap + 2}: missing label"):
        convert(_spec(options={**internal}), "csv", [path], tmp_path / "unlabelled")


@pytest.mark.parametrize("codec", ["rot13", "base64", "hex", "undefined"])
def test_a_codec_that_is_no_text_encoding_is_one_line_naming_the_option(tmp_path: Path, codec: str) -> None:
    """`data.options.encoding: rot13` (a codec Python knows, of text to text; base64 and hex of
    bytes to bytes) passed the lookup and was a LookupError traceback once the file was read."""
    path = tmp_path / "x.csv"
    path.write_text("price,user,clicked\n1,a,1\n2,b,0\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^data\.options\.encoding: '{codec}' is not a text encoding"):
        convert(_spec(), "csv", [path], tmp_path / "out", options={"encoding": codec})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("policy", ["fail", "skip"])
@pytest.mark.parametrize("bad_line", [2, 3, 1_500])
def test_a_file_that_does_not_read_in_its_encoding_names_the_file_and_line(tmp_path: Path, bad_line: int,
                                                                            policy: str) -> None:
    """A byte cp1252 leaves undefined (0x81) in a file read as cp1252 was Python's bare 'charmap'
    codec can't decode byte 0x81 in position 6542952 ...', naming neither file nor line nor option,
    from the first block of the reader or a later one; a UTF-8 file read as utf-16 (no byte-order
    mark) was 'UTF-16 stream does not start with BOM', also with the header given as names."""
    lines = [f"{i},u{i},{i % 2}\n".encode() for i in range(2_000)]
    lines[bad_line - 2] = f"{bad_line},u\x81{bad_line},1\n".encode("latin-1")  # line 1 is the header
    path = tmp_path / "rows.csv"
    path.write_bytes(b"price,user,clicked\n" + b"".join(lines))
    options = {"encoding": "cp1252", "chunk_bytes": 4_096}  # several blocks: line 1,500 is in a later one
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:{bad_line}: the text does not read as cp1252 "
                                        r"\(byte b'\\x81'.*; set data\.options\.encoding"):
        convert(_spec(), "csv", [path], tmp_path / "out", on_error=policy, options=options)
    for given in ({}, {"header": False, "names": ["price", "user", "clicked"]}):
        with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:1: the text does not read as utf-16 .*"
                                            r"set data\.options\.encoding .*utf-16-le or utf-16-be"):
            convert(_spec(), "csv", [path], tmp_path / "out", on_error=policy, options={"encoding": "utf-16", **given})
    assert not (tmp_path / "out").exists()
    path.write_bytes(b"price,user,clicked\n" + b"".join(lines).replace(b"\x81", b"\xe9"))  # e acute in cp1252
    report = convert(_spec(), "csv", [path], tmp_path / "out", on_error=policy, options=options)
    assert report.rows == 2_000


def test_a_link_whose_target_is_gone_is_named_as_such_not_as_missing(tmp_path: Path) -> None:
    """A link left by a moved file (`latest.csv -> day_9.csv`, day_9.csv deleted) was 'input not
    found', 'no such file' or 'dataset directory not found' though `ls` lists it; each command now
    names the link and what it points at."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.testing.specs import mini_spec

    spec = tmp_path / "s.yaml"
    spec.write_text(mini_spec("links"))
    for name, target in (("latest.yaml", "v9.yaml"), ("latest.csv", "day_9.csv"), ("latest", "day_9")):
        (tmp_path / name).symlink_to(tmp_path / target)
    gone = {name: f"{tmp_path / name}" for name in ("latest.yaml", "latest.csv", "latest")}
    for args, said in (
            (["validate", gone["latest.yaml"]], f"{gone['latest.yaml']}: a link to '{tmp_path / 'v9.yaml'}', which does "
                                                "not exist: point it at the spec"),
            (["data", "convert", "csv", gone["latest.csv"], str(tmp_path / "out"), "--spec", str(spec)],
             f"error: input not found: {gone['latest.csv']} is a link to '{tmp_path / 'day_9.csv'}', which does not exist"),
            (["predict", str(tmp_path / "pkg"), gone["latest.csv"], "--out", str(tmp_path / "s.csv")],
             f"error: input not found: {gone['latest.csv']} is a link to '{tmp_path / 'day_9.csv'}', which does not exist"),
            (["data", "inspect", gone["latest"]],
             f"error: dataset directory not found: {gone['latest']} is a link to '{tmp_path / 'day_9'}', which does not "
             "exist")):
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 2, result.output
        assert result.output.startswith(said), result.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "latest.csv", "latest.yaml", "s.yaml"]


def test_a_folder_holding_a_dataset_among_other_files_is_not_called_a_dataset(tmp_path: Path) -> None:
    """`data convert csv . OUT` (or parquet) in a folder holding raw rows and, among them, a dataset
    `ds/` said '. is an encoded flowrec dataset': the folder is no dataset, it holds one; a split's
    root (train/, test/) and a dataset itself are still said to be one."""
    from flowrec.data.layout import META_FILE
    from flowrec.data.sources import encoded_dataset_line

    raw = tmp_path / "raw"
    (raw / "ds").mkdir(parents=True)
    (raw / "ds" / META_FILE).write_text("{}")
    (raw / "rows.csv").write_text("price,user,clicked\n1,a,1\n")
    line = encoded_dataset_line(raw)
    assert line is not None and line.startswith(f"{raw} holds the encoded flowrec dataset {raw / 'ds'} "), line
    for part in ("train", "test"):
        (tmp_path / "split" / part).mkdir(parents=True)
        (tmp_path / "split" / part / META_FILE).write_text("{}")
    for dataset in (tmp_path / "split", tmp_path / "split" / "train", raw / "ds"):
        line = encoded_dataset_line(dataset)
        assert line is not None and line.startswith(f"{dataset} is an encoded flowrec dataset ("), line
    with pytest.raises(DataError, match=f"^{re.escape(str(raw))} holds the encoded flowrec dataset"):
        convert(_spec(), "csv", [raw], tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["raw", "split"]
