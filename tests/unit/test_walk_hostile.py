"""What a hostile user found walking the README, one test per defect (each fails on the code before
its fix).

Raw-row readers: pyarrow's streaming CSV reader keeps a read-ahead thread; one left open when a
command failed reached the interpreter's teardown through the error's traceback and aborted the
process after the one-line error ("terminate called without an active exception", exit 134, about
one run in forty of `flowrec predict` on a row with a dense value beyond float32). Every way out of
a read (a malformed row, a failing consumer, a generator closed early) now closes the reader, which
the tests observe through a recording wrapper around `pyarrow.csv.open_csv`.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pyarrow.csv as pcsv
import pytest

from flowrec.data import sources
from flowrec.data.convert import convert
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import DataError
from flowrec.spec.load import spec_from_dict

SPEC = {
    "name": "walk",
    "features": [
        {"name": "price", "type": "dense"},
        {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4},
    ],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "data": {"format": "csv", "path": "x.csv", "label": "clicked"},
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 8},
}


class _Recorded:
    """A streaming reader that records whether it was closed (directly or by `with`)."""

    def __init__(self, inner: Any, opened: list["_Recorded"]) -> None:
        self.inner, self.closed = inner, False
        opened.append(self)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def close(self) -> None:
        self.closed = True
        self.inner.close()

    def __enter__(self) -> "_Recorded":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


@pytest.fixture
def opened(monkeypatch: pytest.MonkeyPatch) -> list[_Recorded]:
    readers: list[_Recorded] = []
    real = pcsv.open_csv
    monkeypatch.setattr(sources.pcsv, "open_csv", lambda *a, **k: _Recorded(real(*a, **k), readers))
    return readers


def _csv(tmp_path: Path, rows: list[str], header: str = "price,user,clicked") -> Path:
    path = tmp_path / "rows.csv"
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def test_a_malformed_row_closes_the_csv_reader(tmp_path: Path, opened: list[_Recorded]) -> None:
    path = _csv(tmp_path, ["1.5,u1,0", "1e300,u2,1", "2.0,u3,0"])
    with pytest.raises(DataError, match="beyond float32"):
        for _ in sources.read_csv(path, {}, ErrorLog("fail", str(path)), {"price", "clicked"}):
            pass
    assert len(opened) == 1 and opened[0].closed


def test_a_reader_closed_early_by_its_consumer_closes_the_csv_reader(tmp_path: Path,
                                                                     opened: list[_Recorded]) -> None:
    path = _csv(tmp_path, [f"{i}.5,u{i},{i % 2}" for i in range(20)])
    chunks: Iterator[Any] = sources.read_csv(path, {}, ErrorLog("fail", str(path)), {"price", "clicked"})
    next(chunks)
    assert not opened[0].closed
    chunks.close()  # type: ignore[attr-defined]
    assert opened[0].closed


def test_convert_failing_on_a_missing_column_closes_the_csv_reader(tmp_path: Path,
                                                                   opened: list[_Recorded]) -> None:
    path = _csv(tmp_path, ["1.5,0", "2.5,1"], header="price,clicked")  # no `user` column
    with pytest.raises(DataError, match="user"):
        convert(spec_from_dict(SPEC), "csv", [path], tmp_path / "out")
    assert opened and all(r.closed for r in opened)
    assert not (tmp_path / "out").exists()


def test_predict_failing_on_a_chunk_closes_its_raw_reader(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrec.cli import predict_cmd
    from flowrec.serving import predict as serving_predict

    state = {"closed": False}

    def chunks() -> Iterator[Any]:
        try:
            yield pcsv.read_csv(_csv(tmp_path, ["1.5,u1,0"]))
            yield pcsv.read_csv(_csv(tmp_path, ["2.5,u2,1"]))
        finally:
            state["closed"] = True

    class Model:
        items = None
        heads = ["ctr"]

        def predict(self, chunk: Any) -> Any:
            raise DataError("the rows lack columns ['x'] that model 'walk' reads")

    monkeypatch.setattr(serving_predict, "load_model", lambda path: Model())
    monkeypatch.setattr(predict_cmd, "_raw_chunks", lambda *a: (chunks(), ErrorLog("fail", "rows.csv")))
    try:
        predict_cmd._score(tmp_path / "pkg", tmp_path / "rows.csv", tmp_path / "out.parquet", None, [], "fail",
                           True)
    except DataError as exc:  # the traceback still holds _score's frame: nothing was collected yet
        assert "lack columns" in str(exc)
        assert state["closed"]
    else:
        pytest.fail("_score scored rows that the model refused")


def test_keep_of_a_missing_column_lists_the_files_columns_not_the_readers_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrec.cli import predict_cmd
    from flowrec.serving import predict as serving_predict

    path = _csv(tmp_path, ["1.5,u1,0"])

    class Model:
        items = None
        heads = ["ctr"]

    monkeypatch.setattr(serving_predict, "load_model", lambda p: Model())
    monkeypatch.setattr(predict_cmd, "_raw_chunks", lambda *a: (
        sources.read_csv(path, {}, ErrorLog("fail", str(path)), {"price", "clicked"}), ErrorLog("fail", str(path))))
    with pytest.raises(ValueError, match="--keep nope: no such column") as info:
        predict_cmd._score(tmp_path / "pkg", path, tmp_path / "out.parquet", None, ["nope"], "fail", True)
    assert str(info.value).endswith("(has price, user, clicked)")
