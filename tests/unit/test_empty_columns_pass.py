"""The empty-column check of predict's rows in one pass per column type: a 1,000-field model's text
columns took four Arrow calls each per call of predict (35 ms of a one-row call); the lines it
gives are those of a check column by column."""
from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from flowrec.data import empty_columns
from flowrec.data.empty_columns import EmptyColumns
from flowrec.spec.load import spec_from_dict

FIELDS = 300


def _spec(fields: int):
    features = [{"name": "price", "type": "dense"}, {"name": "hours", "type": "dense"}]
    features += [{"name": f"f{i:03d}", "type": "categorical", "hash_buckets": 50, "dim": 4} for i in range(fields)]
    features.append({"name": "tags", "type": "categorical", "hash_buckets": 50, "dim": 4, "multi": True})
    return spec_from_dict({"name": "wide", "features": features,
                           "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
                           "heads": [{"name": "ctr", "input": "top", "task": "binary", "loss": "bce"}],
                           "training": {"batch_size": 8, "epochs": 1, "seed": 0}})


def _rows(rows: int, seed: int) -> tuple[pa.Table, set[str], set[str]]:
    """Skewed random rows: text ids, int ids, floats; some columns empty (null, blank, NaN, empty
    lists) in every row, some of blanks only; the empty and the blank features."""
    rng = np.random.default_rng(seed)
    columns, empty, blank = {}, set(), set()
    for name in ("price", "hours"):
        values = rng.lognormal(1.0, 2.0, rows)
        if rng.random() < 0.5:
            values[:] = np.nan
            empty.add(name)
        columns[name] = pa.array(values)
    for i in range(FIELDS):
        name, draw = f"f{i:03d}", rng.random()
        ids = rng.zipf(1.3, rows) % 10_000
        if draw < 0.1:  # empty: null or NaN or empty text in every row
            kind = rng.integers(3)
            columns[name] = (pa.nulls(rows, pa.string()) if kind == 0 else pa.array([np.nan] * rows) if kind == 1
                             else pa.array([""] * rows))
            empty.add(name)
        elif draw < 0.15:  # blanks only
            columns[name] = pa.array([" " * int(k) for k in rng.integers(1, 4, rows)])
            empty.add(name)
            blank.add(name)
        elif draw < 0.5:  # text ids, a few missing
            columns[name] = pa.array([None if rng.random() < 0.3 else f"v{k}" for k in ids])
        elif draw < 0.7:  # float ids with NaN
            values = ids.astype(float)
            values[rng.random(rows) < 0.4] = np.nan
            columns[name] = pa.array(values)
        else:  # int ids, some null
            columns[name] = pa.array([None if rng.random() < 0.2 else int(k) for k in ids], pa.int64())
    if rng.random() < 0.5:
        columns["tags"] = pa.array([[] for _ in range(rows)], pa.list_(pa.string()))
        empty.add("tags")
    else:
        columns["tags"] = pa.array([[f"t{k}"] if k % 3 else [] for k in rng.integers(0, 9, rows)])
    table = pa.table(columns)
    chunked = pa.concat_tables([table.slice(0, rows // 2), table.slice(rows // 2)])  # two chunks a column
    return chunked, empty, blank


@pytest.mark.parametrize("seed", range(4))
def test_filled_counts_are_each_columns_own(seed: int):
    table, _, _ = _rows(37, seed)
    for blank in (True, False):
        expected = [_one_column(table.column(name), blank) for name in table.column_names]
        assert empty_columns.filled_counts([table.column(name) for name in table.column_names], blank) == expected


def _one_column(column: pa.ChunkedArray, blank: bool) -> int:
    """filled_rows as it was: the column alone, value by value."""
    count = 0
    for value in column.to_pylist():
        if value is None or (isinstance(value, float) and value != value) or value == []:
            continue
        if isinstance(value, str) and (value.strip() if blank else value) == "":
            continue
        count += 1
    return count


@pytest.mark.parametrize("seed", range(3))
def test_predicts_check_says_each_empty_column_in_one_arrow_pass_per_type(seed: int, monkeypatch):
    spec = _spec(FIELDS)
    table, empty, blank = _rows(int(np.random.default_rng(seed).integers(2, 40)), seed + 10)
    calls = []
    trim = pc.utf8_trim_whitespace

    def counted(*args, **kwargs):
        calls.append(1)
        return trim(*args, **kwargs)

    monkeypatch.setattr(empty_columns.pc, "utf8_trim_whitespace", counted)
    seen = EmptyColumns(spec, {}, [f.name for f in spec.features], one_value=False, hint="look")
    seen.observe("the rows", table)
    lines = seen.lines()
    said = {line.split("(feature ")[1].split(")")[0] for line in lines}
    assert said == empty
    assert {n for n in said if "or an id of blank text" in next(ln for ln in lines if f"(feature {n})" in ln)} == blank
    text_columns = sum(pa.types.is_string(table.column(n).type) for n in table.column_names)
    assert text_columns > 50 and len(calls) <= 2  # one pass over the text columns (and one for their blanks)
