"""What a hostile user found walking the README, one test per defect (each fails on the code before
its fix)."""
from __future__ import annotations

from pathlib import Path

import pytest

from flowrec.data import sources
from flowrec.data.error_log import ErrorLog


def _csv(tmp_path: Path, rows: list[str], header: str = "price,user,clicked") -> Path:
    path = tmp_path / "rows.csv"
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


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
