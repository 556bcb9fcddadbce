"""A raw column named `__line__` (the name the readers give each row's line) was silently replaced
by line numbers: `flowrec data convert` encoded them and `flowrec predict --keep __line__` wrote
them instead of the user's values. Every reader now refuses it in one line naming it."""
from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data import sources
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import DataError
from flowrec.testing.specs import mini_spec

runner = CliRunner()
SPEC = mini_spec("lines")


def _rows(read, path: Path, options: dict | None = None) -> list[pa.Table]:
    return list(read(path, options or {}, ErrorLog("fail", str(path)), {"d1", "label"}))


def test_a_csv_column_named_like_the_line_column_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("d1,user,__line__,label\n0.5,a,700,1\n0.1,b,800,0\n")
    with pytest.raises(DataError, match=r"a\.csv: column 3 is named '__line__'"):
        _rows(sources.reader("csv"), path)


def test_a_parquet_column_named_like_the_line_column_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.parquet"
    pq.write_table(pa.table({"__line__": [700, 800], "d1": [0.5, 0.1], "label": [1.0, 0.0]}), path)
    with pytest.raises(DataError, match=r"column 1 is named '__line__'"):
        _rows(sources.read_parquet, path)


def test_a_libsvm_field_named_like_the_line_column_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "a.svm"
    path.write_text("1 0:5 1:7\n")
    with pytest.raises(DataError, match="'__line__'"):
        _rows(sources.read_libsvm, path, {"fields": ["user", "__line__"]})


def test_other_columns_still_get_their_lines(tmp_path: Path) -> None:
    path = tmp_path / "a.csv"
    path.write_text("d1,user,line,label\n0.5,a,700,1\n0.1,b,800,0\n")
    (table,) = _rows(sources.reader("csv"), path)
    assert table.column("line").to_pylist() == ["700", "800"]
    assert table.column(sources.LINE_COLUMN).to_pylist() == [2, 3]


def test_convert_refuses_it_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    (tmp_path / "s.yaml").write_text(SPEC)
    raw = tmp_path / "a.csv"
    raw.write_text("d1,user,__line__,label\n0.5,a,700,1\n0.1,b,800,0\n")
    made = runner.invoke(app, ["data", "convert", "csv", str(raw), str(tmp_path / "out"), "--spec",
                               str(tmp_path / "s.yaml"), "-q"])
    lines = made.stderr.strip().splitlines()
    assert made.exit_code == 2, made.output
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'__line__'" in lines[0], made.stderr
    assert not (tmp_path / "out").exists()


def test_a_row_after_blank_lines_is_named_by_its_own_line(tmp_path: Path) -> None:
    """pyarrow skips blank lines without counting them: a bad row after two blank lines was named
    two lines early (a.tsv:3 for line 5), in the field count, number and label messages alike."""
    import gzip

    row = "\t".join(["1"] + ["2"] * 13 + ["ab"] * 26)
    text = f"{row}\n\n\r\n{row}\n{row.replace('ab', 'cd', 1)[:20]}\n\n{row}\nx{row[1:]}\n"
    (tmp_path / "a.tsv").write_text(text)
    (tmp_path / "a.tsv.gz").write_bytes(gzip.compress(text.encode()))
    for name in ("a.tsv", "a.tsv.gz"):
        with pytest.raises(DataError, match=rf"{name}:5: wrong field count \(11, expected 40\)"):
            list(sources.read_criteo(tmp_path / name, {}, ErrorLog("fail", name), set()))
        log = ErrorLog("skip", name)
        tables = list(sources.read_criteo(tmp_path / name, {}, log, set()))
        assert [e.line for e in log.examples] == [5, 8]
        assert sum(t.num_rows for t in tables) == 3
    (tmp_path / "s.yaml").write_text(SPEC)
    (tmp_path / "b.csv").write_text("d1,user,label\n\n0.5,a,1\n\n\n0.1,b,2\n")
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "b.csv"), str(tmp_path / "out"), "--spec",
                               str(tmp_path / "s.yaml"), "-q"])
    assert made.exit_code == 2 and "b.csv:6: label 2.0 in column label" in made.stderr, made.stderr


def test_a_row_after_a_quoted_value_that_spans_lines_is_named_by_its_own_line(tmp_path: Path) -> None:
    """pyarrow numbers rows, not lines: a quoted value over three lines (one of them blank, one
    holding an escaped quote) named every later bad row two or three lines early (a.csv:4 for line 6)."""
    path = tmp_path / "a.csv"
    path.write_text('d1,user,label\n0.5,"a\n\nb "" c\nd",1\n0.1,b,0\n0.2,c\n0.3,"x\ny",1\nx,e,1\n0.4,f,2\n')
    with pytest.raises(DataError, match=r"a\.csv:7: wrong field count \(2, expected 3\)"):
        _rows(sources.reader("csv"), path)
    log = ErrorLog("skip", str(path))
    (table,) = list(sources.reader("csv")(path, {}, log, {"d1", "label"}))
    assert [e.line for e in log.examples] == [7, 10]
    assert table.column("user").to_pylist() == ['a\n\nb " c\nd', "b", "x\ny", "f"]
    (tmp_path / "s.yaml").write_text(SPEC)
    (tmp_path / "b.csv").write_text('d1,user,label\n0.5,"a\nb",1\n0.4,f,2\n')
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "b.csv"), str(tmp_path / "out"), "--spec",
                               str(tmp_path / "s.yaml"), "-q"])
    assert made.exit_code == 2 and "b.csv:4: label 2.0 in column label" in made.stderr, made.stderr


def test_a_bad_row_of_a_utf16_file_is_named_by_its_own_line(tmp_path: Path) -> None:
    """With `encoding: utf-16` (whose lines are not lines of its bytes) errors named pyarrow's row
    number: a.csv:4 for line 6, after a blank line and a quoted value over two lines."""
    path = tmp_path / "a.csv"
    path.write_bytes('d1,user,label\n\n0.5,"ä\nb",1\n0.1,b,0\n0.2,c\n0.3,d,1\n0.x,e,1\n'.encode("utf-16"))
    with pytest.raises(DataError, match=r"a\.csv:6: wrong field count \(2, expected 3\)"):
        _rows(sources.reader("csv"), path, {"encoding": "utf-16"})
    log = ErrorLog("skip", str(path))
    (table,) = list(sources.reader("csv")(path, {"encoding": "utf-16"}, log, {"d1", "label"}))
    assert [e.line for e in log.examples] == [6, 8] and table.column("user").to_pylist() == ["ä\nb", "b", "d"]


def test_a_quoted_value_that_spans_the_end_of_a_block_is_read(tmp_path: Path) -> None:
    """A file over one block (16 MiB) whose quoted value spanned lines across the block's end stopped
    the conversion: 'unreadable input (CSV parser got out of sync with chunker ...)'."""
    path = tmp_path / "a.csv"
    path.write_text("d1,user,label\n" + "".join(f'0.{i},"u{i}\nv",{i % 2}\n' for i in range(50)))
    tables = list(sources.reader("csv")(path, {"chunk_bytes": 64}, ErrorLog("fail", str(path)), {"d1", "label"}))
    users = [u for t in tables for u in t.column("user").to_pylist()]
    assert users == [f"u{i}\nv" for i in range(50)]


def test_a_header_named_over_by_data_options_names_is_skipped_after_blank_lines(tmp_path: Path) -> None:
    """With `names` and `header: true`, the header is skipped by its count of lines, and a blank line
    before it was skipped instead: the header became a row, 'non-numeric value 'd1''."""
    options = {"header": True, "names": ["d1", "user", "label"]}
    path = tmp_path / "a.csv"
    path.write_text("\n\r\nd1,user,label\n0.5,a,1\n\n0.7,c,0\n")
    (table,) = _rows(sources.reader("csv"), path, options)
    assert table.column("user").to_pylist() == ["a", "c"]
    path.write_text("\nd1,user,label\n0.5,a,1\n\nx\n")
    with pytest.raises(DataError, match=r"a\.csv:5: wrong field count \(1, expected 3\)"):
        _rows(sources.reader("csv"), path, options)


def test_a_malformed_row_s_error_kept_by_the_caller_does_not_keep_its_reader(tmp_path: Path) -> None:
    """The error of a row with the wrong field count kept the frames of the reader's row handler
    (its traceback), so Arrow's reader stayed alive as long as the caller kept the error: the exit
    hook (`flowrec.data.csv_release`) then waited on it."""
    from flowrec.data.csv_release import release_readers

    path = tmp_path / "a.tsv"
    path.write_text("1\t2\t3\n")
    with pytest.raises(DataError, match="wrong field count") as caught:
        list(sources.read_criteo(path, {}, ErrorLog("fail", str(path)), set()))
    assert release_readers(wait_s=1.0) and caught.value is not None


@pytest.mark.parametrize("chunk_bytes", [1 << 24, 2048])  # the file in one block, or in many
def test_a_quote_not_closed_is_named_not_skipped_with_the_rows_after_it(tmp_path: Path, chunk_bytes: int) -> None:
    """A stray quote at the start of a value ran the value on over every later line: under --on-error
    skip the 990 rows after it were dropped as 'skipped 1 malformed row of 10'; a file of many blocks
    stopped with pyarrow's 'straddling object straddles two block boundaries (try to increase block
    size?)', which no option of flowrec sets. Now one line names the line of the quote."""
    rows = ["d1,user,label", *(f"0.{i},u{i},{i % 2}" for i in range(1000))]
    rows[11] = '0.5,"u10,1'
    path = tmp_path / "a.csv"
    path.write_text("\n".join(rows) + "\n")
    for policy in ("skip", "fail"):
        with pytest.raises(DataError, match=r"a\.csv:12: .*a quote not closed\?"):
            list(sources.reader("csv")(path, {"chunk_bytes": chunk_bytes}, ErrorLog(policy, str(path)), {"d1", "label"}))
    rows[11] = '0.5,"u10\nv",1'  # closed on the next line: one row of two lines
    path.write_text("\n".join(rows) + "\n")
    tables = list(sources.reader("csv")(path, {"chunk_bytes": chunk_bytes}, ErrorLog("fail", str(path)), {"d1", "label"}))
    assert sum(t.num_rows for t in tables) == 1000


@pytest.mark.parametrize("fmt", ["csv", "criteo"])
def test_a_line_longer_than_a_block_is_named(tmp_path: Path, fmt: str) -> None:
    """A row longer than the reader's block (16 MiB; a binary file, or rows without line breaks)
    stopped with pyarrow's 'straddling object straddles two block boundaries (try to increase block
    size?)', which no option of flowrec sets, naming no line. Now one line names the line."""
    sep = "," if fmt == "csv" else "\t"
    rows = (["d1,user,label"] if fmt == "csv" else []) + [
        sep.join(["1", "u", "0"] if fmt == "csv" else ["0", *["1"] * 13, *["a"] * 26])] * 40
    rows[30] = rows[30].replace("u" if fmt == "csv" else "a", "x" * 9000, 1)
    path = tmp_path / f"a.{fmt}"
    path.write_text("\n".join(rows) + "\n")
    with pytest.raises(DataError, match=rf"a\.{fmt}:31: the line runs on past 2,048 bytes"):
        list(sources.reader(fmt)(path, {"chunk_bytes": 2048}, ErrorLog("fail", str(path)), {"d1", "label"}))
