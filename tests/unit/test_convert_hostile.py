"""Hostile files given to `flowrec data convert` (a line of gigabytes, ...): one line naming the
problem, in bounded memory, nothing written."""
from __future__ import annotations

import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from flowrec.data.convert import convert
from flowrec.data.layout import DataError
from flowrec.data.sources import LINE_LIMIT
from flowrec.spec import spec_from_dict


def _spec(**options):
    return spec_from_dict({
        "name": "hostile",
        "features": [{"name": "user", "type": "categorical", "vocab": 100, "dim": 4},
                     {"name": "price", "type": "dense", "transform": "standardize"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse", "@dense"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "data": {"format": "csv", "path": "x", "options": options},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})


def _rows(rng: np.random.Generator, n: int) -> list[str]:
    return [f"u{rng.zipf(1.5) % 80},{rng.lognormal(1, 1):.3f},{int(rng.random() < 0.2)}" for _ in range(n)]


def test_a_line_of_many_blocks_is_refused_without_holding_it(tmp_path: Path):
    """A line of 2.2 GB took 50 s and 5 GB of memory to be refused ('runs on past 16,777,216 bytes'):
    the lookup of its line number read it whole (and copied it). The line is refused holding at most
    about one reader's block of it."""
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(20, 60)))
    at = int(rng.integers(1, len(rows)))
    long = 6 * LINE_LIMIT + int(rng.integers(1, 1000))
    raw = tmp_path / "long.csv"
    with raw.open("w") as f:
        f.write("user,price,label\n" + "\n".join(rows[:at]) + "\nu1,")
        f.write("9" * long)
        f.write(",0\n" + "\n".join(rows[at:]) + "\n")
    tracemalloc.start()
    try:
        with pytest.raises(DataError, match=f"long.csv:{at + 2}: the line runs on past {LINE_LIMIT:,} bytes"):
            convert(_spec(), "csv", [raw], tmp_path / "out")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 3 * LINE_LIMIT, peak  # the whole line (and its copy) was 12 blocks
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fmt", ["csv", "parquet"])
def test_a_column_named_like_the_leave_last_out_marker_is_not_taken_for_it(tmp_path: Path, fmt: str):
    """split: leave_last_out marks each user's last MovieLens rating in a column `__test__`; a CSV or
    Parquet input with a column of that name split its rows by the truth of its values (any text
    but '' went to test) without a word. Only MovieLens sequences take the option, in one line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng()
    n = int(rng.integers(100, 300))
    table = pa.table({"user": [f"u{v % 50}" for v in rng.zipf(1.4, n)], "price": rng.lognormal(1, 1, n),
                      "label": (rng.random(n) < 0.2).astype(np.int64),
                      "__test__": rng.choice(["yes", "no", "", "later"], n)})
    raw = tmp_path / f"rows.{fmt}"
    if fmt == "csv":
        raw.write_text(table.to_pandas().to_csv(index=False))
    else:
        pq.write_table(table, raw)
    with pytest.raises(DataError, match="leave_last_out needs per-user sequences"):
        convert(_spec(split="leave_last_out"), fmt, [raw], tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fraction, side", [(1e-9, "test"), (1 - 1e-9, "train")])
def test_a_test_fraction_that_draws_no_row_on_average_says_so(tmp_path: Path, fraction: float, side: str):
    """--test-fraction 1e-9 of 400 rows was 'change test_fraction or split_seed, or convert more rows':
    no seed helps a fraction that draws 4e-07 rows. The line gives the rows drawn on average and the
    least (or most) test_fraction that draws one."""
    rng = np.random.default_rng()
    n = int(rng.integers(100, 900))
    raw = tmp_path / "rows.csv"
    raw.write_text("user,price,label,rid\n" + "\n".join(f"{row},{r}" for r, row in enumerate(_rows(rng, n))) + "\n")
    with pytest.raises(DataError) as caught:
        convert(_spec(test_fraction=fraction), "csv", [raw], tmp_path / "out")
    said = str(caught.value)
    assert f"into the {side} split" in said and f"of its {n:,} rows" in said, said
    bound = f"at least {1 / n:.2g}" if side == "test" else f"at most {1 - 1 / n:.6g}"
    assert f"give test_fraction {bound}" in said and "split_seed" not in said, said
    assert not (tmp_path / "out").exists()


def test_a_parquet_folder_without_files_is_said_so(tmp_path: Path):
    """An empty folder (or one of markers and empty subfolders only) given as a Parquet input was
    'it holds no data rows for format parquet (empty, header only, or another format)'."""
    rng = np.random.default_rng()
    folder = tmp_path / "parts"
    for k in range(int(rng.integers(0, 3))):
        (folder / f"day={k}").mkdir(parents=True)
    folder.mkdir(exist_ok=True)
    (folder / "_SUCCESS").write_text("")
    with pytest.raises(DataError) as caught:
        convert(_spec(), "parquet", [folder], tmp_path / "out")
    said = str(caught.value)
    assert f"{folder} is a folder without files to read" in said and "header only" not in said, said
    assert not (tmp_path / "out").exists()


def test_libsvm_lines_ended_by_a_carriage_return_alone_are_said_so(tmp_path: Path):
    """A libsvm file whose lines end with \\r alone (the CSV formats read them) was one row: "token '1' is
    not idx:val" (the next row's label), or, past a block, "not a text file of rows?"."""
    import io

    from flowrec.data.sources import bounded_lines

    rng = np.random.default_rng()
    rows = [f"{rng.choice(['-1', '1'])} {rng.zipf(1.3) % 500}:1 {500 + rng.integers(0, 80)}:1"
            for _ in range(int(rng.integers(20, 200)))]
    raw = tmp_path / "mac.svm"
    raw.write_bytes("\r".join(rows).encode() + b"\r")
    spec = spec_from_dict({
        "name": "svm", "features": [{"name": "user", "type": "categorical", "hash_buckets": 97, "dim": 4},
                                    {"name": "item", "type": "categorical", "hash_buckets": 97, "dim": 4}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "data": {"format": "libsvm", "path": "x", "options": {"fields": ["user", "item"]}},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})
    for policy in ("fail", "skip"):
        with pytest.raises(DataError, match=r"mac.svm:1: lines ended by a carriage return alone"):
            convert(spec, "libsvm", [raw], tmp_path / "out", on_error=policy)
    assert not (tmp_path / "out").exists()
    (tmp_path / "unix.svm").write_bytes(raw.read_bytes().replace(b"\r", b"\n"))  # as the line says
    assert convert(spec, "libsvm", [tmp_path / "unix.svm"], tmp_path / "out").rows == len(rows)
    with pytest.raises(DataError, match=r"line 1 is longer than 16 bytes \(no line break in it: lines ended by \\r"):
        list(bounded_lines(io.BytesIO(raw.read_bytes()), raw, limit=16))


def test_a_criteo_test_file_without_labels_is_named_as_such_not_skippable(tmp_path: Path) -> None:
    """`data convert criteo test.tsv` of Criteo's test layout (39 fields, no label) said 'wrong field
    count (39, expected 40) ... use --on-error skip', which would skip every row; it now says the file
    is label-less and how to score it, before anything is written. A labelled file still converts."""
    from flowrec.spec import load_spec

    rng = np.random.default_rng()
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "dlrm_criteo.yaml")
    rows = int(rng.integers(20, 80))

    def row(label: bool) -> str:
        ints = [str(v) if rng.random() > 0.2 else "" for v in rng.zipf(1.5, 13)]
        cats = [format(int(v), "x") for v in rng.zipf(1.3, 26)]
        return "\t".join(([str(int(rng.random() < 0.3))] if label else []) + ints + cats)

    (tmp_path / "test.tsv").write_text("".join(row(False) + "\n" for _ in range(rows)))
    with pytest.raises(DataError) as caught:
        convert(spec, "criteo", [tmp_path / "test.tsv"], tmp_path / "out")
    assert "39 fields" in str(caught.value) and "--format criteo" in str(caught.value)
    assert "--on-error skip" not in str(caught.value) and not (tmp_path / "out").exists()
    (tmp_path / "train.tsv").write_text("".join(row(True) + "\n" for _ in range(rows)))
    assert convert(spec, "criteo", [tmp_path / "train.tsv"], tmp_path / "ok").rows == rows
