"""What a hostile user found scoring the newer model kinds (multi-task, retrieval, sequence, custom,
managed) with `flowrec predict`, one test per defect (each fails on the code before its fix)."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data import sources
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import META_FILE, DataError
from flowrec.testing.processes import run_bounded


def _encoded(tmp_path: Path) -> Path:
    """A folder laid out as an encoded dataset: a part file beside _flowrec.json."""
    folder = tmp_path / "D"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(7)
    pq.write_table(pa.table({"price": rng.lognormal(size=50), "user_id": rng.zipf(1.3, 50) % 97,
                             "label": (rng.random(50) < 0.3).astype(np.float32)}), folder / "part-00000.parquet")
    (folder / META_FILE).write_text(json.dumps({"format": "flowrec-dataset"}), encoding="utf-8")
    return folder


def _read(path: Path) -> list[pa.Table]:
    return list(sources.read_parquet(path, {}, ErrorLog("fail", str(path)), {"price", "label"}))


@pytest.mark.parametrize("where", ["folder", "part file", "split parent"])
def test_an_encoded_dataset_read_as_raw_parquet_is_refused_naming_its_meta_file(tmp_path: Path, where: str) -> None:
    """`flowrec predict PKG D --format parquet` on the encoded data the run trained on encoded its
    ids and dense values a second time (rehashed ids, log1p twice) and wrote other scores without a
    word: eval's AUC 0.94 came out of predict as 0.85 logloss against eval's 0.66."""
    folder = _encoded(tmp_path / "x" if where == "split parent" else tmp_path)
    path = {"folder": folder, "part file": folder / "part-00000.parquet", "split parent": folder.parent}[where]
    with pytest.raises(DataError, match=f"encoded flowrec dataset.*{META_FILE}"):
        _read(path)


def test_raw_parquet_beside_an_encoded_dataset_is_still_read(tmp_path: Path) -> None:
    """A raw file whose folder also holds a dataset folder is not itself encoded data."""
    folder = _encoded(tmp_path)
    raw = tmp_path / "raw.parquet"
    pq.write_table(pq.read_table(folder / "part-00000.parquet"), raw)
    assert sum(t.num_rows for t in _read(raw)) == 50


def test_the_sasrec_example_scores_the_most_recent_movies_of_a_long_raw_history() -> None:
    """specs/sasrec_movielens.yaml trains on histories of up to 20 previous movies, oldest first; a
    user's longer raw history given to `flowrec predict` kept its 20 OLDEST movies (truncate
    defaulted to first), so the package recommended from the user's distant past without a word:
    a 59-movie history scored exactly as its first 20 movies did."""
    from flowrec.data.encode import truncated_lists
    from flowrec.spec.load import load_spec

    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "sasrec_movielens.yaml")
    feature = next(f for f in spec.features if f.name == "history")
    rng = np.random.default_rng(11)
    history = [int(x) for x in rng.zipf(1.2, 59) % 1682 + 1]  # skewed ids, oldest first
    values = pa.array([history], pa.list_(pa.int64()))
    rows = np.asarray(history, np.int64)
    kept = truncated_lists(values, rows, np.ones(len(history), bool), feature.max_len, feature.truncate).to_pylist()
    assert kept == [history[-feature.max_len:]]


@pytest.mark.parametrize("rows", [{"d1": [1.0]}, [[1.0]], "rows.csv", None],
                         ids=["dict", "list", "str", "none"])
def test_predict_and_recommend_name_what_they_take(rows) -> None:
    """A dict, list or path was an AttributeError deep inside; now a TypeError naming the accepted kinds."""
    import numpy as np

    from flowrec.serving.predict import LoadedModel

    for items, call in ((None, "predict"), (np.array(["a"]), "recommend")):
        model = object.__new__(LoadedModel)
        model.items, model.path = items, "pkg"
        args = (rows,) if call == "predict" else (rows, 1)
        with pytest.raises(TypeError, match="DataFrame or a pyarrow Table"):
            getattr(model, call)(*args)
    with pytest.raises(TypeError, match="DataFrame or a pyarrow Table"):
        _plain().predict(np.zeros((2, 2)))


def _plain():
    from flowrec.serving.predict import LoadedModel

    model = object.__new__(LoadedModel)
    model.items, model.path = None, "pkg"
    return model


def test_an_integer_beyond_64_bits_is_one_line() -> None:
    import pandas as pd

    from flowrec.data.layout import DataError
    from flowrec.serving.predict import raw_table

    with pytest.raises(DataError, match="beyond 64 bits") as caught:
        raw_table(pd.DataFrame({"d1": [2 ** 70, 1]}))
    assert "\n" not in str(caught.value)


def test_a_dense_integer_beyond_2_53_is_a_number_as_csv_reads_it() -> None:
    """`model.predict(df)` refused an int64 dense value of 2**60 (or a uint64 one) as "values that
    are not numbers" (a safe cast to float64 refuses the rounding), while `flowrec predict` scored
    the same value in a CSV or Parquet file."""
    from flowrec.data.encode import dense_values
    from flowrec.serving.predict import check_finite
    from flowrec.spec.model import DenseFeature

    for column in (pa.array([1, 2 ** 60]), pa.array([1, 2 ** 64 - 1], pa.uint64())):
        check_finite(column, "d1")
        values = dense_values(DenseFeature("d1"), column)
        assert values.tolist() == [1.0, float(column[1].as_py())]
    with pytest.raises(DataError, match="not numbers"):
        check_finite(pa.array(["1", "x"]), "d1")


def test_an_arrow_table_naming_a_column_twice_is_one_line_as_a_frame_is() -> None:
    """A pyarrow Table may name a column twice (`append_column` of an existing name): predict raised
    pyarrow's KeyError 'Field "user" exists 2 times in schema'; now the DataFrame's one line."""
    from flowrec.serving.predict import raw_table

    table = pa.table({"user": ["a"], "d1": [1.0]}).append_column("user", pa.array(["b"]))
    with pytest.raises(DataError, match=r"^the rows name column 'user' twice: drop or rename one$"):
        raw_table(table)
    assert raw_table(table.select([0, 1])).column_names == ["user", "d1"]  # named once: read as given


def test_columns_of_no_name_are_unused_in_a_frame_or_an_arrow_table() -> None:
    """`model.predict(rows)` of rows holding two columns of no name ('' twice, as a Parquet file of
    pandas' may) said 'the rows name column '' twice', where CSV and Parquet inputs leave them out."""
    from flowrec.serving.predict import raw_table

    table = pa.table([["a", "b"], [1, 2], [1.0, 2.0], ["x", "y"]], names=["user", "", "d1", ""])
    assert raw_table(table).equals(pa.table({"user": ["a", "b"], "d1": [1.0, 2.0]}))
    frame = table.to_pandas()
    assert raw_table(frame).to_pydict() == {"user": ["a", "b"], "d1": [1.0, 2.0]}  # (pandas' text: large_string)


def test_sparse_pandas_columns_are_read_as_their_values() -> None:
    """`model.predict(df)` with a sparse column (`pd.get_dummies(..., sparse=True)`) raised Arrow's
    TypeError 'Sparse pandas data (column d1) not supported'; now it is read as its values."""
    import pandas as pd

    from flowrec.serving.predict import raw_table

    dense = pd.DataFrame({"d1": [0.0, 1.5, 0.0], "user": ["a", "b", "c"]})
    sparse = dense.assign(d1=pd.arrays.SparseArray(dense["d1"], fill_value=0.0))
    assert raw_table(sparse).equals(raw_table(dense))
    assert isinstance(sparse.dtypes["d1"], pd.SparseDtype)  # the caller's frame is left as it was


def test_a_dense_column_of_pandas_periods_is_no_numbers_as_datetimes_are_not() -> None:
    """`model.predict(df)` with a pd.Period column for a dense feature scored each period's day count
    without a word (Arrow's pandas.period extension casts to its int64 storage), where datetimes are
    refused as not numbers; now periods (and intervals, any extension type) are refused alike."""
    import pandas as pd

    from flowrec.serving.predict import check_finite, raw_table

    for values in (pd.period_range("2024-01", periods=2, freq="M"), pd.interval_range(0, 2),
                   pd.date_range("2024-01-01", periods=2)):
        with pytest.raises(DataError, match=r"column d1 holds values that are not numbers \(type "):
            check_finite(raw_table(pd.DataFrame({"d1": values})).column("d1"), "d1")


def test_export_takes_the_last_evaluation_past_a_damaged_or_edited_metrics_line(tmp_path: Path) -> None:
    """A metrics.jsonl line that was not UTF-8 (torn bytes) refused `flowrec export` ('cannot export
    to pkg: 'utf-8' codec can't decode byte 0xff'), where --resume and eval skip such a line, and an
    eval record whose metrics were not a mapping went into the manifest as they were
    (`"metrics_at_export": 5`). Now both lines are skipped, as the metrics log's reader skips them."""
    from flowrec.cli.export_cmd import _last_eval

    good = {"event": "eval", "step": 4, "metrics": {"y": {"auc": 0.75}}}
    lines = [json.dumps({"event": "train", "step": 4}).encode(), json.dumps(good).encode(), b"\xff\xfe torn",
             json.dumps({"event": "eval", "step": 5, "metrics": 5}).encode()]
    (tmp_path / "metrics.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    assert _last_eval(tmp_path) == good["metrics"]
    assert _last_eval(tmp_path, step=3) == {}


def test_two_exports_to_one_folder_stage_apart_and_a_killed_ones_staging_is_removed(tmp_path: Path) -> None:
    """`flowrec export RUN pkg` twice at once: both staged into `.pkg.export-tmp`, and the second
    removed it while the first wrote there ('cannot export to pkg: Parent directory
    .pkg.export-tmp does not exist'). Each export now stages in a folder of its own; one left by an
    export that no longer runs (killed) is removed, one of a running export is left alone."""
    import os
    import sys

    from flowrec.cli.export_cmd import _staging_folder
    from flowrec.data.output_guard import host_tag

    done = run_bounded([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                       timeout_s=120)
    dead, h = int(done.stdout), host_tag()
    for name in (f".pkg.export-{dead}-{h}-00000000", f".pkg.export-{os.getppid()}-{h}-11111111"):
        (tmp_path / name).mkdir()
    first, second = _staging_folder(tmp_path / "pkg"), _staging_folder(tmp_path / "pkg")
    assert first != second and first.parent == tmp_path and first.name.startswith(f".pkg.export-{os.getpid()}-{h}-")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f".pkg.export-{os.getppid()}-{h}-11111111"]
