"""Predict and load_model leftovers, as a demanding user meets them: a feature column empty in every
row of the rows scored is said (once a run), a column name that only looks like the package's says
how it differs, and hostile packages and rows give one line, never a traceback or a lost file.

One package, trained on raw CSV rows whose user column is named 'usér id' (data.columns)."""
from __future__ import annotations

import re
import warnings
from pathlib import Path

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import yaml

from flowrec.data.layout import DataError
from flowrec.serving.predict import load_model
from flowrec.testing.processes import run_bounded
from package_flow import invoke, train_and_export

USER = "us\u00e9r id"  # the package's raw user column (é written as one code point, NFC)
SPEC = {
    "name": "leftovers",
    "features": [{"name": "price", "type": "dense"},
                 {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4},
                 {"name": "item", "type": "categorical", "hash_buckets": 64, "dim": 4}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "data": {"format": "csv", "path": "train.csv", "label": "clicked", "columns": {"user": USER}},
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 32},
}


def _rows(rng: np.random.Generator, n: int, label: bool = True) -> pd.DataFrame:
    """`n` raw rows of skewed values: lognormal prices, Zipf users and items."""
    rows = pd.DataFrame({"price": rng.lognormal(1.0, 1.5, n), USER: [f"u{z}" for z in rng.zipf(1.4, n)],
                         "item": [f"i{z}" for z in rng.zipf(1.3, n)]})
    return rows.assign(clicked=(rng.random(n) < 0.2).astype(int)) if label else rows


@pytest.fixture(scope="module")
def pkg(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serving_leftovers")
    return train_and_export(root, yaml.safe_dump(SPEC), _rows(np.random.default_rng(), 600)) / "pkg"


def _empty_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "is empty in every one of its" in line]


def test_a_feature_column_empty_in_every_row_is_said_once_and_the_rows_are_scored(pkg, tmp_path, monkeypatch):
    """`flowrec predict` (and `model.predict`) of rows whose user column is blank in every row scored
    without a word, every user the missing id; now one warning line per such column naming it, once a
    run (not once per chunk), and the scores are written. A column of one value (one user's rows) and
    a column empty only in the first chunk are no such column."""
    import flowrec.data.sources as sources

    monkeypatch.setattr(sources, "CHUNK_BYTES", 4096)  # several chunks of text
    rng = np.random.default_rng()
    n = int(rng.integers(900, 2000))
    rows = _rows(rng, n, label=False)
    empty = rows.assign(**{USER: [("", " ", None)[i % 3] for i in range(n)]})
    empty.to_csv(tmp_path / "empty.csv", index=False)
    result = invoke(["predict", pkg, tmp_path / "empty.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
    assert result.exit_code == 0, result.output
    said = _empty_lines(result.output)
    assert len(said) == 1 and f"column {USER!r} (feature user)" in said[0] and f"{n:,} rows" in said[0], result.output
    assert str(tmp_path / "empty.csv") in said[0]
    assert pq.read_table(tmp_path / "s.parquet").num_rows == n
    late = rows.assign(**{USER: [None] * (n - 1) + ["u7"]})  # one value, in the last chunk: the column is read
    late.to_csv(tmp_path / "late.csv", index=False)
    one = rows.assign(item="i3")  # one item in every row: a question a user asks, no fault
    one.to_csv(tmp_path / "one.csv", index=False)
    for name in ("late.csv", "one.csv"):
        result = invoke(["predict", pkg, tmp_path / name, "--format", "csv", "--out", tmp_path / f"{name}.parquet"])
        assert result.exit_code == 0 and not _empty_lines(result.output), result.output
        assert "holds one value" not in result.output
    model = load_model(pkg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scores = model.predict(empty.assign(price=np.nan))
    said = sorted(str(w.message) for w in caught if "is empty in every one" in str(w.message))
    assert len(said) == 2 and "column 'price' (feature price)" in said[0] and f"column {USER!r}" in said[1], said
    assert len(scores) == n
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model.predict(one)
    assert not [w for w in caught if "every one of its" in str(w.message)]


@pytest.mark.parametrize("header", ["use\u0301r id", "us\u00e9r\u00a0id"], ids=["accent-apart", "no-break-space"])
def test_a_column_name_that_only_looks_like_the_packages_shows_both_code_points(pkg, tmp_path, header):
    """Rows whose user column is written with its accent apart (NFD, as macOS writes names) or a
    no-break space said "(the rows have 'usér id': rename it to 'usér id'?)", two names that print
    alike; predict's line now shows both with their code points, as data convert's does."""
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(20, 90)), label=False).rename(columns={USER: header})
    says = f"the rows' {ascii(header)} looks like {ascii(USER)} but is written with other characters"
    with pytest.raises(DataError) as caught:
        load_model(pkg).predict(rows)
    assert says in str(caught.value) and "rename" not in str(caught.value), caught.value
    rows.to_csv(tmp_path / "rows.csv", index=False)
    result = invoke(["predict", pkg, tmp_path / "rows.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
    assert result.exit_code == 2 and says in result.output and result.output.count("error:") == 1, result.output
    assert not (tmp_path / "s.parquet").exists()
    rows.rename(columns={header: USER}).to_csv(tmp_path / "rows.csv", index=False)  # the same characters: scored
    result = invoke(["predict", pkg, tmp_path / "rows.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
    assert result.exit_code == 0 and pq.read_table(tmp_path / "s.parquet").num_rows == len(rows), result.output


SUBPROCESS_TIMEOUT_S = 60  # the wide row takes about 8 s on 2 cores with imports; the quadratic check took minutes
WIDE_ROW = """
import sys
import pyarrow as pa
from flowrec.serving.predict import load_model
n = int(sys.argv[2])
names = ["price", sys.argv[3], "item"] + [f"c{i}" for i in range(n)]
one = pa.array([7], pa.int64())
rows = pa.Table.from_arrays([pa.array([1.5]), pa.array(["u1"]), pa.array(["i2"])] + [one] * n, names=names)
print(len(load_model(sys.argv[1]).predict(rows)))
try:
    load_model(sys.argv[1]).predict(rows.append_column("c7", one))
except Exception as exc:
    print(type(exc).__name__, exc)
"""


def test_a_row_of_150000_columns_is_scored_and_a_column_named_twice_among_them_is_named(pkg):
    """One row of 150,000 columns (a wide export, a pivot gone wrong) hung predict for minutes
    (flowrec predict of a 100,000-column CSV row: 80 s on 2 cores) before any line: the check for a
    column named twice compared each name with every name before it; it is one pass now. The row
    is scored and a column named twice among them is still one line naming it. (A hang guard, as
    test_cli_spec_hostile's FIFO test: the process is ended after SUBPROCESS_TIMEOUT_S.)"""
    import os
    import sys

    repo = Path(__file__).parents[2]
    proc = run_bounded([sys.executable, "-c", WIDE_ROW, str(pkg), "150000", USER], capture_output=True, text=True,
                       timeout_s=SUBPROCESS_TIMEOUT_S, env={**os.environ, "PYTHONPATH": str(repo)}, cwd=repo)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == ["1", "DataError the rows name column 'c7' twice: drop or rename one"]



def test_keeping_the_readers_own_line_column_is_no_such_column(pkg, tmp_path):
    """`--keep __line__` of a CSV without such a column wrote the reader's own line numbers under
    that name, a column the rows never had (a Parquet file's rows refuse it: no such column); it is
    refused alike, and nothing is written."""
    rng = np.random.default_rng()
    _rows(rng, int(rng.integers(10, 60)), label=False).to_csv(tmp_path / "rows.csv", index=False)
    result = invoke(["predict", pkg, tmp_path / "rows.csv", "--format", "csv", "--out", tmp_path / "s.parquet",
                      "--keep", "__line__"])
    assert result.exit_code == 2 and "--keep __line__: no such column in" in result.output, result.output
    assert "has price, " in result.output and not (tmp_path / "s.parquet").exists()


def test_keeping_columns_written_as_one_list_says_to_give_keep_once_per_column(pkg, tmp_path):
    """`--keep price,item` (columns the rows have, written as one list, as many tools take them) said
    only '--keep price,item: no such column in ROWS (has price, ...)', the columns it lists among those
    it 'has'; it says --keep takes one column, and the flags to give; nothing is written. A name of no
    such column is refused as before."""
    rng = np.random.default_rng()
    _rows(rng, int(rng.integers(10, 60)), label=False).to_csv(tmp_path / "rows.csv", index=False)
    out = tmp_path / "s.parquet"
    for keep, said in (("price,item", "--keep takes one column, give it once per column: --keep price --keep item"),
                       ("price, nope", "(has price, ")):
        result = invoke(["predict", pkg, tmp_path / "rows.csv", "--format", "csv", "--out", out, "--keep", keep])
        assert result.exit_code == 2 and f"--keep {keep}: no such column in" in result.output, result.output
        assert said in result.output and not out.exists(), result.output
    result = invoke(["predict", pkg, tmp_path / "rows.csv", "--format", "csv", "--out", out, "--keep", "price",
                     "--keep", "item"])
    assert result.exit_code == 0 and pq.read_table(out).column_names == ["ctr", "price", "item"], result.output



def test_keeping_a_misspelt_column_names_the_close_one(pkg, tmp_path):
    """`--keep Item` (the rows' column is item) listed the columns the rows have without naming the
    close one, as a misspelt feature column's line does; it asks 'did you mean --keep item?'. A name
    close to none is listed as before."""
    rng = np.random.default_rng()
    _rows(rng, int(rng.integers(10, 60)), label=False).to_csv(tmp_path / "rows.csv", index=False)
    out = tmp_path / "s.parquet"
    for keep, close in (("Item", "item"), ("prices", "price"), ("zzzz", None)):
        result = invoke(["predict", pkg, tmp_path / "rows.csv", "--format", "csv", "--out", out, "--keep", keep])
        assert result.exit_code == 2 and f"--keep {keep}: no such column in" in result.output, result.output
        assert ("did you mean" in result.output) == (close is not None), result.output
        assert close is None or f"did you mean --keep {close}?" in result.output, result.output
        assert not out.exists()

def test_a_column_of_blanks_is_said_empty_not_written_as_space_padded_ids(pkg, tmp_path):
    """A user column of blanks in every row was said empty and, in a second line, 'written as
    space-padded text (' ')' with advice to write the ids without the spaces: blanks are no ids and
    have no form; the form of the ids among blanks is judged from the ids alone."""
    from flowrec.data.id_forms import written_form
    import pyarrow as pa

    rng = np.random.default_rng()
    n = int(rng.integers(20, 200))
    rows = _rows(rng, n, label=False)
    rows.assign(**{USER: [(" ", "  ", "")[i % 3] for i in range(n)]}).to_csv(tmp_path / "blank.csv", index=False)
    result = invoke(["predict", pkg, tmp_path / "blank.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
    assert result.exit_code == 0 and len(_empty_lines(result.output)) == 1, result.output
    assert "space-padded" not in result.output and result.output.count("warning:") == 1, result.output
    ids = [f"u{z}" for z in rng.zipf(1.4, n)]
    assert written_form(pa.array([" "] * 3 * n + ids)) == ("text", ids[0])  # mostly blanks: its ids' own form
    assert written_form(pa.array([" ", "  "] * n)) is None


@pytest.mark.parametrize("kind", ["folder", "pipe"])
@pytest.mark.parametrize("name", ["model.pt2", "spec.json"])
def test_a_package_file_that_is_a_folder_or_a_pipe_is_said_so_not_missing(pkg, tmp_path, kind, name):
    """A package whose model.pt2 (or spec.json) is a folder or a named pipe was 'pkg/model.pt2 is
    missing (the package is incomplete)', a file `ls` shows there; the line says what it is instead,
    and nothing is read from a pipe (it would block)."""
    import os
    import shutil

    copy = tmp_path / "pkg"
    shutil.copytree(pkg, copy)
    (copy / name).unlink()
    (copy / name).mkdir() if kind == "folder" else os.mkfifo(copy / name)
    says = f"{copy / name} is not a regular file ({'a folder' if kind == 'folder' else 'a pipe or a device'})"
    with pytest.raises(ValueError, match=re.escape(says)):
        load_model(copy)
    _rows(np.random.default_rng(), 30, label=False).to_csv(tmp_path / "rows.csv", index=False)
    result = invoke(["predict", copy, tmp_path / "rows.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
    assert result.exit_code == 2 and says in result.output and "missing" not in result.output, result.output
    assert not (tmp_path / "s.parquet").exists()


def test_a_training_run_or_a_dataset_given_as_the_package_says_what_it_is(pkg, tmp_path):
    """`flowrec predict RUN rows.csv` (the run for its export, the commonest slip) said 'RUN is not a
    flowrec model package (no readable manifest.json: cannot read RUN/manifest.json: No such file or
    directory)'; it names the run and the export that makes its package (a dataset: what it is)."""
    run, data = pkg.parent / "run", pkg.parent / "data"
    _rows(np.random.default_rng(), 30, label=False).to_csv(tmp_path / "rows.csv", index=False)
    for folder, says in ((run, f"{run} is a training run's folder, not a flowrec model package: export it (`flowrec "
                                f"export {run} OUT/`) and give OUT"),
                         (data, f"{data} is a dataset's folder, not a flowrec model package")):
        with pytest.raises(ValueError, match=re.escape(says)):
            load_model(folder)
        result = invoke(["predict", folder, tmp_path / "rows.csv", "--format", "csv", "--out", tmp_path / "s.parquet"])
        assert result.exit_code == 2 and says in result.output, result.output
    assert not (tmp_path / "s.parquet").exists()
    with pytest.raises(ValueError, match=re.escape(f"{tmp_path} is not a flowrec model package")):
        load_model(tmp_path)  # a folder of no one's: as before


def test_a_specs_table_map_is_made_once_and_a_spec_still_pickles():
    """`spec.table(name)`, asked per feature at every predict call, made a dict of every table at each
    ask: a one-row predict of a 1,000-field model spent 156 ms there (834 ms a call in all, 264 ms
    now, with predict's column names asked once); the map is made once per spec, and a spec whose
    map was made still pickles and compares equal."""
    import pickle

    from flowrec.testing.specs import wide_spec

    spec = wide_spec(int(np.random.default_rng().integers(20, 60)))
    assert spec.table_map is spec.table_map
    assert all(spec.table(t.name) is t for t in spec.tables)
    again = pickle.loads(pickle.dumps(spec))
    assert again == spec and again.table_map == spec.table_map


def test_a_csvs_columns_the_package_does_not_read_are_not_read(pkg, tmp_path):
    """`flowrec predict PKG rows.csv` read every column of the rows (one row of 100,000 columns took
    1.5 GB in the CSV reader), so a value that is not UTF-8 in a column no feature reads made its
    row malformed and the file was refused. Only the package's columns and --keep's are read: the
    scores with extra columns of garbage among them are those of the rows without, and the kept
    column is written."""
    rng = np.random.default_rng()
    n = int(rng.integers(30, 300))
    rows = _rows(rng, n, label=False)
    rows.to_csv(tmp_path / "plain.csv", index=False)
    junk = [f"JUNK{i:06d}" if i % 3 == 0 else f"n/a {rng.zipf(1.5)}" for i in range(n)]  # (marks, then bytes)
    wide = rows.assign(extra=rng.lognormal(2.0, 2.0, n), junk=junk)[["extra", "price", "junk", USER, "item"]]
    text = wide.to_csv(index=False).encode()
    for i in range(0, n, 3):  # bytes that are no UTF-8 (no separator, quote or line break among them)
        text = text.replace(f"JUNK{i:06d}".encode(), b"\xff\xfe" + bytes(rng.integers(128, 256, 4).tolist()))
    (tmp_path / "wide.csv").write_bytes(text)
    scored = {}
    for name in ("plain", "wide"):
        result = invoke(["predict", pkg, tmp_path / f"{name}.csv", "--format", "csv", "--out",
                          tmp_path / f"{name}.parquet", "--keep", "item"])
        assert result.exit_code == 0 and "warning" not in result.output, result.output
        scored[name] = pq.read_table(tmp_path / f"{name}.parquet")
    assert scored["wide"].column_names == ["ctr", "item"]
    assert scored["wide"].equals(scored["plain"]) and scored["wide"].num_rows == n
    assert scored["wide"].column("item").to_pylist() == rows["item"].tolist()
    result = invoke(["predict", pkg, tmp_path / "wide.csv", "--format", "csv", "--out", tmp_path / "k.parquet",
                      "--keep", "junk"])  # a kept column is read: its bytes that are not UTF-8 are malformed rows
    assert result.exit_code == 2 and "invalid UTF-8 in column junk" in result.output, result.output
