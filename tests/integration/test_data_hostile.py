"""Hostile data, one row per case: raw files through `data convert`, Parquet datasets through `train`.

Each case either gives exit 2 and one `error:` line naming the file (and row or column), leaving
nothing behind, or is handled as documented (libsvm's -1/+1 labels read as 0/1 and counted). The
input files are never changed.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.checked import RECORD_FILE

SPEC = """
name: hostile
features:
  - {name: d1, type: dense}
  - {name: c1, type: categorical, hash_buckets: 100, dim: 4}
  - {name: c2, type: categorical, hash_buckets: 50, dim: 4}
  - {name: c3, type: sequence, hash_buckets: 20, dim: 4, max_len: 3, pooling: mean}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [4]}
heads:
  - {name: ctr, input: top}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: sgd, lr: 0.1}
training: {batch_size: 16}
"""
LIBSVM_DATA = "data: {format: libsvm, path: x, options: {fields: [c1, d1, c2, c3]}}\n"
LIBSVM_SPEC = SPEC.replace("training:", LIBSVM_DATA + "training:")
REGRESSION_SPEC = LIBSVM_SPEC.replace("{name: ctr, input: top}", "{name: ctr, input: top, task: regression}")
CSV_HEADER = "label,d1,c1,c2,c3\n"


def csv_options(options: str) -> str:
    """SPEC bound to format csv with these data options (YAML flow mapping body)."""
    return SPEC.replace("training:", f"data: {{format: csv, options: {{{options}}}}}\ntraining:")


CSV_ROWS = ["1,0.5,a,b,x^y", "0,1.5,c,d,", "1,,e,f,z"]
SVM_ROWS = ["1 3:1 7:0.5 9:1", "0 4:1 9:2.0 2:1", "1 4:1 1:3 5:1"]

runner = CliRunner()


def digest(folder: Path) -> dict[str, str]:
    """Hash of every file but the check record (a cache flowrec may add: `flowrec.data.checked`)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != RECORD_FILE}


def error_lines(result) -> list[str]:
    assert "Traceback" not in result.output, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


def expect_one_error(result, *parts: str) -> str:
    lines = error_lines(result)
    assert result.exit_code == 2, result.output
    assert len(lines) == 1, result.output
    for part in parts:
        assert part in lines[0], lines[0]
    return lines[0]


@dataclass(frozen=True)
class RawCase:
    """A raw input converted with `data convert`; `error` is None when it converts."""

    name: str
    fmt: str
    spec: str
    content: bytes
    error: tuple[str, ...] | None
    on_error: str = "fail"
    labels: tuple[float, ...] = ()
    mapped: int = 0


def csv(*rows: str) -> bytes:
    return (CSV_HEADER + "".join(r + "\n" for r in rows)).encode()


def svm(*rows: str) -> bytes:
    return "".join(r + "\n" for r in rows).encode()


RAW_CASES = [
    RawCase("libsvm_plus_minus_mapped", "libsvm", LIBSVM_SPEC,
            svm("+1 3:1 7:0.5 9:1", "-1 4:1 9:2.0 2:1", "-1 4:1 1:3 5:1"), None, labels=(1.0, 0.0, 0.0),
            mapped=2),
    RawCase("libfm_alias_plus_minus", "libfm", LIBSVM_SPEC, svm("-1 3:1 7:0.5 9:1", "1 4:1 9:2 2:1"), None,
            labels=(0.0, 1.0), mapped=1),
    RawCase("libsvm_utf8_byte_order_mark", "libsvm", LIBSVM_SPEC, b"\xef\xbb\xbf" + svm(*SVM_ROWS), None,
            labels=(1.0, 0.0, 1.0)),
    RawCase("libsvm_label_2", "libsvm", LIBSVM_SPEC, svm(SVM_ROWS[0], "2 4:1 9:2.0 2:1"),
            ("x.in:2:", "label 2.0")),
    RawCase("libsvm_label_7", "libsvm", LIBSVM_SPEC, svm("7 4:1 9:2.0 2:1"), ("x.in:1:", "label 7.0")),
    RawCase("libsvm_label_half", "libsvm", LIBSVM_SPEC, svm(*SVM_ROWS[:2], "0.5 4:1 1:3 5:1"),
            ("x.in:3:", "label 0.5")),
    RawCase("libsvm_label_nan", "libsvm", LIBSVM_SPEC, svm("nan 4:1 9:2.0 2:1"), ("x.in:1:", "label nan")),
    RawCase("libsvm_label_inf", "libsvm", LIBSVM_SPEC, svm(SVM_ROWS[0], "inf 4:1 9:2.0 2:1"),
            ("x.in:2:", "non-finite value 'inf' in column label")),
    RawCase("libsvm_dense_inf", "libsvm", LIBSVM_SPEC, svm("1 3:1 7:inf 9:1"), ("x.in:1:", "non-finite", "d1")),
    RawCase("libsvm_dense_beyond_float32", "libsvm", LIBSVM_SPEC, svm(SVM_ROWS[0], "1 3:1 7:1e60 9:1"),
            ("x.in:2:", "beyond float32", "d1")),
    RawCase("libsvm_label_2_skipped", "libsvm", LIBSVM_SPEC, svm(SVM_ROWS[0], "2 4:1 9:2 2:1", SVM_ROWS[2]),
            None, on_error="skip", labels=(1.0, 1.0)),
    RawCase("libsvm_regression_keeps_2", "libsvm", REGRESSION_SPEC, svm("2.5 4:1 9:2 2:1", "-1 3:1 7:1 9:1"),
            None, labels=(2.5, -1.0)),
    RawCase("libsvm_regression_nan", "libsvm", REGRESSION_SPEC, svm("nan 4:1 9:2 2:1"), ("x.in:1:", "label nan")),
    RawCase("csv_label_2", "csv", SPEC, csv(CSV_ROWS[0], "2,1.5,c,d,"), ("x.in:3:", "label 2.0")),
    RawCase("csv_label_minus_1", "csv", SPEC, csv("-1,1.5,c,d,"), ("x.in:2:", "label -1.0")),
    RawCase("csv_label_empty", "csv", SPEC, csv(*CSV_ROWS[:2], ",1.5,c,d,"), ("x.in:4:", "missing label")),
    RawCase("csv_label_nan_is_missing", "csv", SPEC, csv("nan,1.5,c,d,"), ("x.in:2:", "missing label")),
    RawCase("csv_label_inf", "csv", SPEC, csv("inf,1.5,c,d,"), ("x.in:2:", "non-finite", "label")),
    RawCase("csv_dense_inf", "csv", SPEC, csv(CSV_ROWS[0], "1,inf,c,d,"), ("x.in:3:", "non-finite", "d1")),
    RawCase("csv_dense_beyond_float32", "csv", SPEC, csv("1,-1e39,c,d,"), ("x.in:2:", "beyond float32", "d1")),
    RawCase("csv_header_only", "csv", SPEC, CSV_HEADER.encode(), ("no rows converted", "x.in")),
    RawCase("csv_empty_file", "csv", SPEC, b"", ("x.in",)),
    RawCase("libsvm_blank_lines_only", "libsvm", LIBSVM_SPEC, b"\n\n\n", ("no rows converted", "x.in")),
    RawCase("csv_all_rows_malformed_skip", "csv", SPEC, csv("2,1,a,b,", "3,1,a,b,"),
            ("no rows converted", "all 2 rows were malformed"), on_error="skip"),
    RawCase("libsvm_file_read_as_csv", "csv", SPEC, svm(*SVM_ROWS), ("x.in", "not in the input")),
    RawCase("csv_file_read_as_libsvm", "libsvm", LIBSVM_SPEC, csv(*CSV_ROWS), ("x.in:1:",)),
    # options reach the reader as the spec gives them: each wrong one is one line naming it
    RawCase("csv_sep_two_characters", "csv", csv_options('sep: "::"'), csv(*CSV_ROWS), ("data.options.sep", "'::'")),
    RawCase("csv_sep_a_number", "csv", csv_options("sep: 5"), csv(*CSV_ROWS), ("data.options.sep",)),
    RawCase("csv_names_numbers", "csv", csv_options("header: false, names: [1, 2, 3, 4, 5]"), csv(*CSV_ROWS),
            ("data.options.names",)),
    RawCase("csv_names_one_string", "csv", csv_options("names: label"), csv(*CSV_ROWS), ("data.options.names",)),
    RawCase("csv_header_text", "csv", csv_options('header: "no", names: [label, d1, c1, c2, c3]'),
            csv(*CSV_ROWS), ("data.options.header",)),
    RawCase("csv_sequence_sep_empty", "csv", csv_options('sequence_sep: ""'), csv(*CSV_ROWS),
            ("data.options.sequence_sep",)),
    RawCase("csv_header_names_given", "csv", csv_options("header: true, names: [label, d1, c1, c2, c3]"),
            csv(*CSV_ROWS), None, labels=(1.0, 0.0, 1.0)),
    RawCase("parquet_file_read_as_csv", "csv", SPEC, b"PAR1\x15\x04\x15\x18\x80\xff,\x00\n\x81\x82,\x00\x01\n",
            ("x.in",)),
]


def write_spec(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("case", RAW_CASES, ids=[c.name for c in RAW_CASES])
def test_raw_input_case(case: RawCase, tmp_path: Path):
    spec = write_spec(tmp_path, case.spec)
    src = tmp_path / "x.in"
    src.write_bytes(case.content)
    before = digest(tmp_path)
    out = tmp_path / "out"
    res = runner.invoke(app, ["data", "convert", case.fmt, str(src), str(out), "--spec", str(spec), "-q",
                              "--on-error", case.on_error])
    if case.error is not None:
        expect_one_error(res, *case.error)
        assert not out.exists() and digest(tmp_path) == before
        return
    assert res.exit_code == 0 and not error_lines(res), res.output
    assert pq.read_table(out).column("label").to_pylist() == list(case.labels)
    label = "label" if case.mapped == 1 else "labels"
    assert (f"read {case.mapped:,} {label} -1 as 0" in res.output) == (case.mapped > 0), res.output
    assert {k: v for k, v in digest(tmp_path).items() if not k.startswith("out/")} == before


def test_a_csv_label_minus_1_says_how_to_write_it_not_to_skip_the_row(tmp_path: Path):
    """A CSV of -1/+1 labels was refused with 'use --on-error skip to skip such rows': following it
    dropped every negative row, a dataset of positives only. The -1 row now says that only libsvm
    reads -1 as 0, without the hint; another label (a stray 2 among 0/1 labels) keeps it."""
    spec = write_spec(tmp_path, SPEC)
    (tmp_path / "pm.csv").write_bytes(csv("1,0.5,a,b,", "-1,1.5,c,d,"))
    res = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "pm.csv"), str(tmp_path / "out"), "--spec",
                              str(spec), "-q"])
    line = expect_one_error(res, "pm.csv:3:", "label -1.0", "only libsvm and libfm read -1 as 0")
    assert "--on-error skip" not in line
    (tmp_path / "two.csv").write_bytes(csv(*["1,0.5,a,b,", "0,1.5,c,d,"] * 10, "2,1.5,c,d,"))
    res = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "two.csv"), str(tmp_path / "out"), "--spec",
                              str(spec), "-q"])
    line = expect_one_error(res, "two.csv:22:", "label 2.0", "use --on-error skip")
    assert "libsvm" not in line


def test_convert_into_a_log_writes_its_closing_line_not_a_spinner(tmp_path: Path):
    """Without a terminal convert's spinner printed its last frame ('⠋ converting x.in 2 rows')."""
    spec = write_spec(tmp_path, SPEC)
    (tmp_path / "x.in").write_bytes(csv("1,1.5,c,d,", "0,2.5,e,f,"))
    res = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "x.in"), str(tmp_path / "out"), "--spec",
                              str(spec)])
    assert res.exit_code == 0, res.output
    assert "converting" not in res.output and "wrote 2 rows" in res.output, res.output


@pytest.mark.parametrize("fmap, expected", [
    (b"3 c1\n7\n9 c2\n", ("fmap.txt:2:", "'7'", "index name")),
    (b"\xff\xfe3 c1\n", ("fmap.txt", "not UTF-8")),
    (None, ("data.options.fields", "'c1'")),
], ids=["one_token_line", "not_utf8", "fields_a_string"])
def test_libsvm_options_wrong_are_one_line_naming_them(tmp_path: Path, fmap: bytes | None, expected: tuple[str, ...]):
    """A feature map line of one token was dict()'s 'dictionary update sequence element #1 has length
    1; 2 is required', a map that is not UTF-8 a codec message, both naming no file; fields: c1 (a
    string) read as the fields c and 1 ('more tokens than fields (2)')."""
    if fmap is None:
        options = "fields: c1"
    else:
        (tmp_path / "fmap.txt").write_bytes(fmap)
        options = f"feature_map: {tmp_path / 'fmap.txt'}"
    spec = write_spec(tmp_path, SPEC.replace("training:", f"data: {{format: libsvm, options: {{{options}}}}}\ntraining:"))
    src = tmp_path / "x.svm"
    src.write_bytes(svm(*SVM_ROWS))
    out = tmp_path / "out"
    res = runner.invoke(app, ["data", "convert", "libsvm", str(src), str(out), "--spec", str(spec), "-q"])
    expect_one_error(res, *expected)
    assert not out.exists()


def test_reconversion_refused_then_replaced_atomically(tmp_path: Path):
    spec = write_spec(tmp_path, SPEC)
    src = tmp_path / "x.csv"
    src.write_bytes(csv(*CSV_ROWS))
    out = tmp_path / "out"
    args = ["data", "convert", "csv", str(src), str(out), "--spec", str(spec), "-q"]
    assert runner.invoke(app, [*args, "--rows-per-file", "1"]).exit_code == 0
    assert len(list(out.glob("part-*.parquet"))) == 3
    first = digest(out)
    expect_one_error(runner.invoke(app, args), "not empty", "--overwrite")
    assert digest(out) == first
    src.write_bytes(csv(*CSV_ROWS, *CSV_ROWS))
    assert runner.invoke(app, [*args, "--overwrite"]).exit_code == 0
    assert [p.name for p in out.glob("part-*.parquet")] == ["part-00000.parquet"]  # no stale part files
    info = json.loads(runner.invoke(app, ["data", "inspect", str(out), "--json"]).stdout)
    assert info["rows"] == info["meta_rows"] == json.loads((out / "_flowrec.json").read_text())["rows"] == 6
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "spec.yaml", "x.csv"]  # no partial folders
    second = digest(out)
    src.write_bytes(csv("7,1,a,b,"))
    expect_one_error(runner.invoke(app, [*args, "--overwrite"]), "x.csv:2:")
    assert digest(out) == second  # a failed overwrite keeps the old dataset
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "spec.yaml", "x.csv"]


def test_synth_refuses_a_non_empty_folder(tmp_path: Path):
    spec = write_spec(tmp_path, SPEC)
    out = tmp_path / "d"
    args = ["data", "synth", str(spec), "--rows", "40", "--out", str(out)]
    assert runner.invoke(app, args).exit_code == 0
    first = digest(out)
    expect_one_error(runner.invoke(app, args), "not empty")
    assert digest(out) == first
    assert runner.invoke(app, [*args, "--seed", "1", "--overwrite"]).exit_code == 0
    assert digest(out) != first and json.loads((out / "_flowrec.json").read_text())["rows"] == 40


@pytest.mark.parametrize("seed", ["-1", "99999999999999999999999"])
def test_synth_refuses_a_seed_outside_uint64_in_one_line(tmp_path: Path, seed: str):
    """A negative seed failed in numpy ('expected non-negative integer', naming no option), one past
    2^64 with an OverflowError traceback."""
    spec = write_spec(tmp_path, SPEC)
    out = tmp_path / "d"
    res = runner.invoke(app, ["data", "synth", str(spec), "--rows", "40", "--out", str(out), "--seed", seed])
    expect_one_error(res, "--seed", seed)
    assert not out.exists()


@pytest.mark.parametrize("option", [("--window", "0"), ("--window", "-3"), ("--seed", "-1")])
def test_profile_refuses_a_window_below_1_or_a_negative_seed(tmp_path: Path, option: tuple[str, str]):
    """--window 0 was the spec's window without a word, --window -3 wrote curves 'lookahead_w-3' into
    the profile the planner reads, --seed -1 failed in numpy ('expected non-negative integer') or,
    where every row is sampled, was accepted."""
    spec = write_spec(tmp_path, SPEC)
    data = tmp_path / "d"
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "40", "--out", str(data)]).exit_code == 0
    out = tmp_path / "p.json"
    res = runner.invoke(app, ["data", "profile", str(spec), str(data), "-q", "--json", str(out), *option])
    assert res.exit_code == 2 and option[0] in res.output and "Traceback" not in res.output, res.output
    assert not out.exists()


Mutation = Callable[[Path], None]


def set_value(column: str, row: int, value) -> Mutation:
    def mutate(folder: Path) -> None:
        path = folder / "part-00000.parquet"
        table = pq.read_table(path)
        values = table.column(column).to_pylist()
        values[row] = value
        array = pa.array(values, type=table.schema.field(column).type if value is not None else None)
        pq.write_table(table.set_column(table.column_names.index(column), column, array), path)
    return mutate


def retype(column: str, type_: pa.DataType) -> Mutation:
    def mutate(folder: Path) -> None:
        path = folder / "part-00000.parquet"
        table = pq.read_table(path)
        array = table.column(column).cast(type_)
        pq.write_table(table.set_column(table.column_names.index(column), column, array), path)
    return mutate


def drop(column: str) -> Mutation:
    def mutate(folder: Path) -> None:
        path = folder / "part-00000.parquet"
        pq.write_table(pq.read_table(path).drop_columns([column]), path)
    return mutate


def zero_rows(folder: Path) -> None:
    path = folder / "part-00000.parquet"
    pq.write_table(pq.read_table(path).slice(0, 0), path)
    meta = json.loads((folder / "_flowrec.json").read_text())
    (folder / "_flowrec.json").write_text(json.dumps({**meta, "rows": 0}))


def stale_part(folder: Path) -> None:
    (folder / "part-00001.parquet").write_bytes((folder / "part-00000.parquet").read_bytes())


def truncated(folder: Path) -> None:
    path = folder / "part-00000.parquet"
    path.write_bytes(path.read_bytes()[:200])


def edit_meta(key: str, value, entry: str | None = None) -> Mutation:
    """Set `key` (or `key`.`entry`) of the dataset's _flowrec.json, as a hand edit or another tool would."""
    def mutate(folder: Path) -> None:
        meta = json.loads((folder / "_flowrec.json").read_text())
        if entry is None:
            meta[key] = value
        else:
            meta[key][entry] = value
        (folder / "_flowrec.json").write_text(json.dumps(meta))
    return mutate


META_CASES = [
    ("meta_rows_text", edit_meta("rows", "x"), ("_flowrec.json", "'rows'", "row count")),
    ("meta_labels_one_string", edit_meta("labels", "label"), ("_flowrec.json", "'labels'")),
    ("meta_encoding_a_list", edit_meta("encoding", []), ("_flowrec.json", "'encoding'")),
    ("meta_source_null", edit_meta("source", None), ("_flowrec.json", "'source'")),
    ("meta_dense_entry_a_number", edit_meta("dense", 5, "d1"), ("_flowrec.json", "'dense'")),
]
DATASET_CASES = [*META_CASES,
    ("meta_encoding_entry_empty", edit_meta("encoding", {}, "c1"), ("_flowrec.json", "lacks the key 'table'")),

    ("id_equal_to_table_rows", set_value("c1", 5, 100), ("part-00000.parquet", "'c1'", "id 100", "row 5")),
    ("id_negative", set_value("c2", 3, -1), ("'c2'", "id -1", "row 3")),
    ("id_huge", set_value("c1", 0, 2 ** 62), ("'c1'", f"id {2 ** 62}", "row 0")),
    ("sequence_id_out_of_range", set_value("c3", 7, [1, 20]), ("'c3'", "id 20", "row 7")),
    ("id_null", set_value("c2", 2, None), ("'c2'", "null id", "row 2")),
    ("ids_as_floats", retype("c1", pa.float64()), ("'c1'", "expected int64")),
    ("dense_nan", set_value("d1", 9, float("nan")), ("'d1'", "non-finite value nan", "row 9")),
    ("dense_inf", set_value("d1", 1, float("-inf")), ("'d1'", "non-finite value -inf", "row 1")),
    ("dense_beyond_float32", retype("d1", pa.float64()), None),
    ("label_nan", set_value("label", 4, float("nan")), ("'label'", "label nan", "row 4")),
    ("label_inf", set_value("label", 4, float("inf")), ("'label'", "label inf", "row 4")),
    ("label_2", set_value("label", 6, 2.0), ("'label'", "label 2.0", "row 6", "not 0 or 1")),
    ("label_minus_1", set_value("label", 0, -1.0), ("'label'", "label -1.0")),
    ("label_half", set_value("label", 8, 0.5), ("'label'", "label 0.5")),
    ("missing_column", drop("c2"), ("'c2'",)),
    ("truncated_part", truncated, ("part-00000.parquet",)),
    ("zero_rows", zero_rows, ("has 0 rows",)),
    ("stale_part_file", stale_part, ("_flowrec.json records 64", "128")),
]


@pytest.mark.parametrize("name,mutate,error", DATASET_CASES, ids=[c[0] for c in DATASET_CASES])
def test_dataset_case_through_train(name: str, mutate: Mutation, error, tmp_path: Path):
    spec = write_spec(tmp_path, SPEC)
    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "64", "--out", str(data)]).exit_code == 0
    mutate(data)
    before = digest(data)
    res = runner.invoke(app, ["train", str(spec), "--data", str(data), "--max-steps", "4", "--out",
                              str(tmp_path / "run"), "-q"])
    if error is None:  # float64 values that fit float32 are fine
        assert res.exit_code == 0 and not error_lines(res), res.output
    else:
        line = expect_one_error(res, str(data), *error)
        assert "Traceback" not in line
    assert digest(data) == before


def test_dense_float64_beyond_float32_is_refused(tmp_path: Path):
    spec = write_spec(tmp_path, SPEC)
    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "64", "--out", str(data)]).exit_code == 0
    retype("d1", pa.float64())(data)
    set_value("d1", 11, 1e300)(data)
    res = runner.invoke(app, ["train", str(spec), "--data", str(data), "--max-steps", "4", "--out",
                              str(tmp_path / "run"), "-q"])
    expect_one_error(res, "'d1'", "1e+300", "row 11")
    assert np.isclose(pq.read_table(data).column("d1").to_numpy()[11], 1e300)


@pytest.mark.parametrize("name,mutate,error", META_CASES, ids=[c[0] for c in META_CASES])
def test_inspect_refuses_metadata_of_the_wrong_kind_in_one_line(name: str, mutate: Mutation, error, tmp_path: Path):
    """A _flowrec.json key of the wrong kind was a traceback (rows "x": a format error in `data
    inspect`; encoding [], source null: AttributeError in `train`) or misread (labels "label")."""
    spec = write_spec(tmp_path, SPEC)
    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "64", "--out", str(data)]).exit_code == 0
    mutate(data)
    expect_one_error(runner.invoke(app, ["data", "inspect", str(data)]), str(data), *error)


def test_inspect_shows_a_row_count_that_disagrees_with_the_metadata(tmp_path: Path):
    spec = write_spec(tmp_path, SPEC)
    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "64", "--out", str(data)]).exit_code == 0
    res = runner.invoke(app, ["data", "inspect", str(data)])
    assert res.exit_code == 0 and "64 rows" in res.stdout and "warning" not in res.stderr
    stale_part(data)
    res = runner.invoke(app, ["data", "inspect", str(data)])
    assert res.exit_code == 0 and "128 rows" in res.stdout
    assert "warning: the part files hold 128 rows but _flowrec.json records 64" in res.stderr


@pytest.mark.parametrize("bad, warned", [(1, False), (3, True)], ids=["one_of_11", "three_of_13"])
def test_skipping_many_rows_says_how_many_of_the_input_and_warns(tmp_path: Path, bad: int, warned: bool):
    """`--on-error skip` said only 'skipped N malformed rows', so a label convention that hit most
    rows (-1/+1 in CSV) left a one-class dataset with nothing but that line. Now the line gives the
    share of the input, and over a tenth of it is a warning that the rows kept may not stand for it."""
    spec = write_spec(tmp_path, SPEC)
    rows = [f"{i % 2},{i + 0.5},u{i},i{i},s{i % 3}" for i in range(10)] + [f"-1,{i}.5,x,y," for i in range(bad)]
    (tmp_path / "mix.csv").write_bytes(csv(*rows))
    res = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "mix.csv"), str(tmp_path / "out"), "--spec",
                              str(spec), "-q", "--on-error", "skip"])
    assert res.exit_code == 0, res.output
    total = 10 + bad
    assert f"skipped {bad} malformed row{'s' if bad > 1 else ''} of {total} ({bad / total:.1%})" in res.stderr
    warning = [line for line in res.stderr.splitlines() if line.startswith("warning:")]
    assert len(warning) == int(warned), res.stderr
    if warned:
        assert f"{bad / total:.0%} of the rows were skipped" in warning[0] and "10 rows written" in warning[0]
    assert pq.read_table(tmp_path / "out").num_rows == 10
