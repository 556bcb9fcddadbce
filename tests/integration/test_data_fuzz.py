"""Fuzz (hypothesis): corrupted raw files through `data convert`, bad Parquet values through `train`.

The property: exit 0 with a correct result, or exit 2 with one `error:` line; never a traceback, a
hang (each example runs under an alarm) or a changed input file. The default suite runs a few
dozen examples (seconds); `-m slow` runs the large profile.
"""
from __future__ import annotations

import hashlib
import json
import signal
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.checked import RECORD_FILE
from flowrec.data.checks import check_partition, partition_rules
from flowrec.spec import load_spec

from test_data_hostile import CSV_ROWS, LIBSVM_SPEC, SPEC, SVM_ROWS, csv, svm

REPO = Path(__file__).resolve().parents[2]
EXAMPLE_S = 60  # an example running longer than this is a hang
QUICK = {"raw": 60, "parquet": 25}
SLOW = {"raw": 600, "parquet": 200}
runner = CliRunner()


def criteo_sample(lines: int = 8) -> bytes:
    rng = np.random.default_rng(0)
    rows = []
    for i in range(lines):
        ints = [str(int(v)) if v >= 0 else "" for v in rng.integers(-2, 500, 13)]
        cats = [f"{int(v):08x}" if v else "" for v in rng.integers(0, 1 << 32, 26) * (rng.random(26) > 0.1)]
        rows.append("\t".join([str(i % 2), *ints, *cats]))
    return ("\n".join(rows) + "\n").encode()


RAW = {  # name -> (spec text or spec path, format, sample bytes)
    "csv": (SPEC, "csv", csv(*CSV_ROWS, *CSV_ROWS)),
    "libsvm": (LIBSVM_SPEC, "libsvm", svm(*SVM_ROWS, "-1 3:1 7:0.5 9:1", "+1 4:2 1:3 5:1")),
    "criteo": (REPO / "specs" / "dlrm_criteo.yaml", "criteo", criteo_sample()),
}
TOKENS = [b"nan", b"inf", b"-inf", b"-1", b"2", b"7", b"0.5", b"", b"\t", b",", b":", b" ", b"\n", b"\r\n",
          b"\xff\xfe", b"1e999", b"+1", b'"', b"^", b"\x00", b"9" * 30]
MUTATION = st.one_of(
    st.tuples(st.just("byte"), st.integers(0, 1 << 16), st.integers(0, 255)),
    st.tuples(st.just("insert"), st.integers(0, 1 << 16), st.binary(min_size=1, max_size=6)),
    st.tuples(st.just("token"), st.integers(0, 1 << 16), st.sampled_from(TOKENS)),
    st.tuples(st.just("delete"), st.integers(0, 1 << 16), st.integers(1, 40)),
    st.tuples(st.just("truncate"), st.integers(0, 1 << 16), st.just(0)),
    st.tuples(st.just("dup_line"), st.integers(0, 64), st.just(0)),
    st.tuples(st.just("drop_line"), st.integers(0, 64), st.just(0)),
)


def mutate(data: bytes, mutations: list[tuple[str, int, object]]) -> bytes:
    for kind, at, arg in mutations:
        pos = at % (len(data) + 1)
        if kind == "byte" and data:
            pos %= len(data)
            data = data[:pos] + bytes([arg]) + data[pos + 1:]
        elif kind in ("insert", "token"):
            data = data[:pos] + arg + data[pos:]
        elif kind == "delete":
            data = data[:pos] + data[pos + arg:]
        elif kind == "truncate":
            data = data[:pos]
        else:
            lines = data.split(b"\n")
            i = at % len(lines)
            lines[i:i + 1] = [lines[i]] * 2 if kind == "dup_line" else []
            data = b"\n".join(lines)
    return data


@contextmanager
def time_limit(seconds: int) -> Iterator[None]:
    def expire(*_):
        raise AssertionError(f"example still running after {seconds} s (hang)")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def digest(folder: Path) -> dict[str, str]:
    """Hash of every file but the check record (a cache flowrec may add: `flowrec.data.checked`)."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != RECORD_FILE}


def one_error_line(res) -> str:
    assert "Traceback" not in res.output, res.output
    assert res.exception is None or isinstance(res.exception, SystemExit), repr(res.exception)
    assert res.exit_code in (0, 2), res.output
    lines = [line for line in res.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == (res.exit_code == 2), res.output
    return lines[0] if lines else ""


def spec_path(folder: Path, spec) -> Path:
    if isinstance(spec, Path):
        return spec
    path = folder / "spec.yaml"
    path.write_text(spec)
    return path


def check_raw(name: str, mutations: list, on_error: str) -> None:
    spec, fmt, sample = RAW[name]
    with tempfile.TemporaryDirectory() as tmp, time_limit(EXAMPLE_S):
        folder = Path(tmp)
        spec_file = spec_path(folder, spec)
        src = folder / "input.txt"
        src.write_bytes(mutate(sample, mutations))
        before = digest(folder)
        out = folder / "out"
        res = runner.invoke(app, ["data", "convert", fmt, str(src), str(out), "--spec", str(spec_file), "-q",
                                  "--on-error", on_error])
        line = one_error_line(res)
        assert {k: v for k, v in digest(folder).items() if not k.startswith("out/")} == before
        if res.exit_code == 2:
            assert str(src) in line and not out.exists(), line
            assert sorted(p.name for p in folder.iterdir()) == sorted(before)  # no partial folders
            return
        table = pq.read_table(out)
        meta = json.loads((out / "_flowrec.json").read_text())
        assert table.num_rows == meta["rows"] > 0 and f"wrote {meta['rows']:,} row" in res.stdout
        check_partition(table, partition_rules(load_spec(spec_file)), str(out))  # ids, finite, 0/1 labels


def raw_test(examples: int):
    @settings(max_examples=examples, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(st.sampled_from(sorted(RAW)), st.lists(MUTATION, min_size=1, max_size=4),
           st.sampled_from(["fail", "skip"]))
    def run(name, mutations, on_error):
        check_raw(name, mutations, on_error)
    return run


BAD_VALUES = {
    "ids": [-1, 100, 101, 2 ** 62, -(2 ** 63), None, 0, 99],
    "dense": [float("nan"), float("inf"), -float("inf"), None, 0.0, -3.5, 1e30],
    "label": [float("nan"), 2.0, -1.0, 0.5, float("inf"), None, 0.0, 1.0],
}
COLUMNS = {"c1": "ids", "c2": "ids", "d1": "dense", "label": "label"}
ROWS = {"c1": 100, "c2": 50}


def valid(column: str, value) -> bool:
    if value is None:
        return False
    if column in ROWS:
        return 0 <= value < ROWS[column]
    if column == "label":
        return value in (0.0, 1.0)
    return bool(np.isfinite(value))


def check_parquet(edits: list[tuple[str, int, int]]) -> None:
    with tempfile.TemporaryDirectory() as tmp, time_limit(EXAMPLE_S):
        folder = Path(tmp)
        spec_file = spec_path(folder, SPEC)
        data = folder / "data"
        assert runner.invoke(app, ["data", "synth", str(spec_file), "--rows", "64", "--out", str(data)]).exit_code == 0
        part = data / "part-00000.parquet"
        table = pq.read_table(part)
        for column, row, pick in edits:
            values = table.column(column).to_pylist()
            values[row] = BAD_VALUES[COLUMNS[column]][pick % len(BAD_VALUES[COLUMNS[column]])]
            table = table.set_column(table.column_names.index(column), column,
                                     pa.array(values, table.schema.field(column).type))
        pq.write_table(table, part)
        first_bad = {}  # the reference: first invalid row per column, plain Python
        for column in COLUMNS:
            bad = [i for i, v in enumerate(table.column(column).to_pylist()) if not valid(column, v)]
            if bad:
                first_bad[column] = bad[0]
        before = digest(data)
        res = runner.invoke(app, ["train", str(spec_file), "--data", str(data), "--max-steps", "4", "--out",
                                  str(folder / "run"), "-q"])
        line = one_error_line(res)
        assert digest(data) == before
        assert (res.exit_code == 2) == bool(first_bad), res.output
        if first_bad:
            assert str(part) in line and any(f"column '{c}'" in line and f"at row {r} " in line
                                             for c, r in first_bad.items()), (line, first_bad)


def parquet_test(examples: int):
    @settings(max_examples=examples, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
    @given(st.lists(st.tuples(st.sampled_from(sorted(COLUMNS)), st.integers(0, 63), st.integers(0, 7)),
                    min_size=1, max_size=3))
    def run(edits):
        check_parquet(edits)
    return run


def test_fuzz_raw_files():
    raw_test(QUICK["raw"])()


def test_fuzz_parquet_values():
    parquet_test(QUICK["parquet"])()


@pytest.mark.slow
def test_fuzz_raw_files_large():
    raw_test(SLOW["raw"])()


@pytest.mark.slow
def test_fuzz_parquet_values_large():
    parquet_test(SLOW["parquet"])()
