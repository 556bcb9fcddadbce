"""How `flowrec predict` reads the rows a package scores (`flowrec.data.sources.Scoring`): only the
package's columns and the --keep ones, in every format whose layout lets a reader leave columns
unread (the CSV format alone did: one row of 100,000 columns took 1.5 GB in Avazu's reader and
1.7 GB in Parquet's); a column nobody reads is neither converted nor checked, and the columns read
hold what a read of every column holds."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import DataError
from flowrec.data.sources import CRITEO_COLUMNS, LINE_COLUMN, Scoring, reader

WANTED = frozenset({"price", "user"})


def _rows(rng: np.random.Generator, n: int, extra: int) -> dict[str, list]:
    """Skewed rows: a lognormal price, Zipf users, a rare click, and `extra` columns nobody reads."""
    rows = {"click": (rng.random(n) < 0.15).astype(int).tolist(),
            "price": np.round(rng.lognormal(1.0, 1.2, n), 3).tolist(),
            "user": [f"u{v}" for v in rng.zipf(1.4, n) % 5000]}
    for i in range(extra):
        rows[f"junk{i}"] = rng.integers(-10**6, 10**6, n).tolist()
    return rows


def _read(fmt: str, path: Path, scoring: Scoring | None, numeric: set[str], **options) -> pa.Table:
    return pa.concat_tables(list(reader(fmt)(path, options, ErrorLog("fail", str(path)), numeric, scoring)))


def test_avazu_reads_only_the_scored_columns_and_its_label(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(30, 90)), int(rng.integers(5, 40)))
    names = list(rows)
    lines = [",".join(names).encode()] + [",".join(str(rows[c][i]) for c in names).encode()
                                           for i in range(len(rows["click"]))]
    bad = int(rng.integers(1, len(lines)))
    cells = lines[bad].split(b",")
    # not UTF-8, in a junk column; bytes past ASCII only (a random quote or CR would split the row otherwise)
    cells[-1] = b"\xff\xfe" + bytes(int(v) for v in rng.integers(0x80, 0x100, 3))
    lines[bad] = b",".join(cells)
    path = tmp_path / "rows.csv"
    path.write_bytes(b"\n".join(lines) + b"\n")
    got = _read("avazu", path, Scoring(WANTED), {"price"})
    assert set(got.column_names) == WANTED | {"click", LINE_COLUMN}
    assert got.num_rows == len(rows["click"])  # the row with the junk bytes is scored
    assert got.column("user").to_pylist() == rows["user"] and got.column("price").to_pylist() == rows["price"]
    with pytest.raises(DataError, match="invalid UTF-8"):  # every column read: that row is malformed
        _read("avazu", path, None, {"price"})
    repeated = tmp_path / "repeated.csv"  # a header line repeated inside the file: still a malformed row
    repeated.write_bytes(b"\n".join(lines[:2] + [lines[0]] + lines[2:]) + b"\n")
    with pytest.raises(DataError, match=":3: non-numeric value 'click' in column click"):
        _read("avazu", repeated, Scoring(WANTED), {"price"})


def test_parquet_reads_only_the_scored_columns(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(30, 90)), int(rng.integers(5, 40)))
    table = pa.table(rows).append_column("nested", pa.array([{"a": [1, 2]}] * len(rows["click"])))
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=int(rng.integers(5, 20)))
    got = _read("parquet", path, Scoring(WANTED), {"price"})
    assert set(got.column_names) == WANTED | {LINE_COLUMN}
    every = _read("parquet", path, None, {"price"})
    assert got.equals(every.select(got.column_names))


def test_a_parquet_folders_unread_column_of_another_type_is_not_refused(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    folder = tmp_path / "rows"
    folder.mkdir()
    n = int(rng.integers(10, 40))
    for day, kind in ((1, pa.int64()), (2, pa.string())):  # junk0: integers in one file, text in the other
        rows = _rows(rng, n, 1)
        junk = pa.array(rows.pop("junk0")).cast(kind)
        pq.write_table(pa.table(rows).append_column("junk0", junk), folder / f"part-{day}.parquet")
    with pytest.raises(DataError, match="junk0"):
        _read("parquet", folder, None, {"price"})
    got = _read("parquet", folder, Scoring(WANTED), {"price"})
    assert got.num_rows == 2 * n and set(got.column_names) == WANTED | {LINE_COLUMN}


def test_libfm_leaves_the_values_of_unread_columns_unread(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(30, 90)), 0)
    n = len(rows["click"])
    bad = int(rng.integers(0, n))
    lines = []
    for i in range(n):
        junk = "oops" if i == bad else f"{rng.lognormal():.3f}"
        lines.append(f"{rows['click'][i]} price:0:{rows['price'][i]} user:{rows['user'][i]}:1 score:0:{junk}")
    path = tmp_path / "rows.libfm"
    path.write_text("\n".join(lines) + "\n")
    options = {"fields": ["price", "user", "score"]}
    got = _read("libfm", path, Scoring(WANTED), {"price", "score"}, **options)
    assert set(got.column_names) == WANTED | {"label", LINE_COLUMN} and got.num_rows == n
    assert got.column("user").to_pylist() == rows["user"] and got.column("price").to_pylist() == rows["price"]
    with pytest.raises(DataError, match=f":{bad + 1}: token 'score:0:oops' has the value 'oops', not a number"):  # every column read: malformed
        _read("libfm", path, None, {"price", "score"}, **options)


def test_criteo_reads_only_the_scored_columns_and_its_label(tmp_path: Path) -> None:
    rng = np.random.default_rng()
    n = int(rng.integers(20, 60))
    values = {c: ([str(v) for v in rng.zipf(1.3, n)] if c.startswith("I") else
                  [f"{v:08x}" for v in rng.integers(0, 1 << 32, n)]) for c in CRITEO_COLUMNS[1:]}
    values["label"] = [str(int(v)) for v in rng.random(n) < 0.2]
    bad = int(rng.integers(0, n))
    values["I13"][bad] = "not-a-number"  # in a column nobody reads
    path = tmp_path / "day.tsv"
    path.write_text("".join("\t".join(values[c][i] for c in CRITEO_COLUMNS) + "\n" for i in range(n)))
    wanted = frozenset({"I1", "C3"})
    got = _read("criteo", path, Scoring(wanted), set())
    assert set(got.column_names) == wanted | {"label", LINE_COLUMN} and got.num_rows == n
    assert got.column("C3").to_pylist() == values["C3"]
    with pytest.raises(DataError, match="non-numeric value 'not-a-number' in column I13"):
        _read("criteo", path, None, set())


def test_test_files_without_the_label_column_read_only_the_scored_columns(tmp_path: Path) -> None:
    """Avazu's and Criteo's test files have no label column; the label read beside the scored
    columns was not in their header, so every column was read (and a value of another column that is
    not UTF-8 or not a number made its row malformed)."""
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(30, 90)), int(rng.integers(3, 20)))
    del rows["click"]
    names = list(rows)
    lines = [",".join(names).encode()] + [",".join(str(rows[c][i]) for c in names).encode()
                                           for i in range(len(rows["user"]))]
    bad = int(rng.integers(1, len(lines)))
    lines[bad] = lines[bad].rsplit(b",", 1)[0] + b",\xff\xfe"  # not UTF-8, in a junk column
    avazu = tmp_path / "test.csv"
    avazu.write_bytes(b"\n".join(lines) + b"\n")
    got = _read("avazu", avazu, Scoring(WANTED), {"price"})
    assert set(got.column_names) == WANTED | {LINE_COLUMN} and got.num_rows == len(lines) - 1
    n = int(rng.integers(20, 60))
    values = {c: ([str(v) for v in rng.zipf(1.3, n)] if c.startswith("I") else
                  [f"{v:08x}" for v in rng.integers(0, 1 << 32, n)]) for c in CRITEO_COLUMNS[1:]}
    values["I13"][int(rng.integers(0, n))] = "not-a-number"  # in a column nobody reads
    criteo = tmp_path / "test.tsv"
    criteo.write_text("".join("\t".join(values[c][i] for c in CRITEO_COLUMNS[1:]) + "\n" for i in range(n)))
    got = _read("criteo", criteo, Scoring(frozenset({"I1", "C3"})), set(), has_label=False)
    assert set(got.column_names) == {"I1", "C3", LINE_COLUMN} and got.num_rows == n


def test_a_parquet_folders_files_may_differ_in_columns_nobody_reads(tmp_path: Path) -> None:
    """A folder of day files whose later days gained a column (or lost one) no feature reads was
    refused for scoring ('no column ..., which part-0 has'), as it is for training, where every
    column is read: only the columns read must be in every file."""
    rng = np.random.default_rng()
    folder = tmp_path / "days"
    folder.mkdir()
    n = int(rng.integers(10, 40))
    first, later = _rows(rng, n, 2), _rows(rng, n, 3)  # junk2 in the later file only
    pq.write_table(pa.table(first), folder / "part-1.parquet")
    pq.write_table(pa.table(later), folder / "part-2.parquet")
    with pytest.raises(DataError, match="junk2"):
        _read("parquet", folder, None, {"price"})
    got = _read("parquet", folder, Scoring(WANTED), {"price"})
    assert got.num_rows == 2 * n and set(got.column_names) == WANTED | {LINE_COLUMN}
    assert got.column("user").to_pylist() == first["user"] + later["user"]
