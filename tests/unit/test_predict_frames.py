"""predict's DataFrame to Arrow (`flowrec.serving.frames`): a wide frame of a few rows is read column by
column, not by `pa.Table.from_pandas` (80-160 ms for 1,000 columns), into the same table."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from flowrec.serving.frames import FEW_ROWS, frame_table
from flowrec.serving.predict import raw_table


def _mixed(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """Columns of every kind a user's rows hold, plain ones interleaved with others, skewed values."""
    ints = rng.zipf(1.3, n).astype(np.int64) * rng.choice([-1, 1], n)
    floats = rng.lognormal(size=n)
    floats[rng.random(n) < 0.3] = np.nan
    text = np.array([f"u{v}" for v in rng.zipf(1.5, n)], dtype=object)
    text[rng.random(n) < 0.2] = None
    nullable = pd.array(rng.zipf(1.4, n), dtype="Int64")
    nullable[rng.random(n) < 0.3] = pd.NA
    return pd.DataFrame({
        "user": ints, "name": text, "price": floats, "big": rng.integers(2 ** 62, 2 ** 64 - 1, n, dtype=np.uint64),
        "flag": rng.random(n) < 0.5, "small": rng.integers(-100, 100, n).astype(np.int8), "nullable": nullable,
        "f32": rng.normal(size=n).astype(np.float32), "city": pd.Categorical(rng.choice(["a", "b", "c"], n)),
        "when": pd.to_datetime(rng.integers(0, 10 ** 9, n), unit="s"), "item": rng.zipf(1.2, n) % 9_973})


@pytest.mark.parametrize("rows", [0, 1, 7, FEW_ROWS, FEW_ROWS + 1])
def test_a_frame_becomes_the_table_from_pandas_makes(rows):
    frame = _mixed(np.random.default_rng(), rows)
    want = pa.Table.from_pandas(frame, preserve_index=False)
    got = frame_table(frame)
    assert got.schema.remove_metadata().equals(want.schema.remove_metadata()), (got.schema, want.schema)
    assert got.num_rows == rows and all(got.column(i).equals(want.column(i)) for i in range(want.num_columns))


def _spied_arrow(read: list) -> object:
    """pyarrow, but for `Table.from_pandas`, which adds the names of the columns it reads to `read`
    (pyarrow's Table takes no new attributes: its module is replaced where it is used)."""
    class Meta(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, pa.Table)

        def __getattr__(cls, name):
            return getattr(pa.Table, name)

    class Table(metaclass=Meta):
        @staticmethod
        def from_pandas(frame, *args, **kwargs):
            read.extend(frame.columns)
            return pa.Table.from_pandas(frame, *args, **kwargs)

    class Arrow:
        def __getattr__(self, name):
            return Table if name == "Table" else getattr(pa, name)

    return Arrow()


def test_a_one_row_frame_of_a_wide_model_is_read_without_from_pandas_for_its_number_columns(monkeypatch):
    rng = np.random.default_rng()
    row = pd.DataFrame({f"f{i:04d}": rng.zipf(1.3, 1) for i in range(300)})
    row.insert(17, "price", rng.lognormal(size=1))
    row.insert(5, "city", ["c" + str(rng.integers(100))])
    read: list = []
    monkeypatch.setattr("flowrec.serving.predict.pa", _spied_arrow(read))
    monkeypatch.setattr("flowrec.serving.frames.pa", _spied_arrow(read))
    table = raw_table(row)
    assert read == ["city"]  # the 301 number columns read column by column
    assert table.column_names == list(row.columns)
    assert table.column("f0007").to_pylist() == row["f0007"].tolist()
    assert table.column("price").to_pylist() == row["price"].tolist()


def test_columns_named_otherwise_than_by_text_are_named_as_from_pandas_names_them():
    rng = np.random.default_rng()
    frame = pd.DataFrame({3: rng.zipf(1.3, 4), "x": rng.lognormal(size=4)})
    assert frame_table(frame).column_names == pa.Table.from_pandas(frame, preserve_index=False).column_names


def test_the_id_form_check_of_a_call_reads_each_hashed_features_ids_as_text_once(monkeypatch):
    """`model.predict` looks at the form of each hashed feature's ids (`flowrec.data.id_forms`): it
    made each feature's text three times and trimmed it four (437 ms of a one-row call of 1,000
    hashed fields, at load 2.5); then once a feature; now every feature's text is made in one call
    (columns of one Arrow type: `id_forms.sample_forms`), with the same record."""
    import flowrec.data.id_forms as id_forms
    from flowrec.data.encode import Encoder
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    fields = int(rng.integers(5, 40))
    doc = {"name": "forms_once", "features": [{"name": "price", "type": "dense"}] + [
               {"name": f"f{i}", "type": "categorical", "dim": 4, "hash_buckets": 97} for i in range(fields)],
           "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}], "data": {"format": "csv", "label": "clicked"},
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
           "training": {"batch_size": 16}}
    encoder = Encoder(spec_from_dict(doc), {}, {}, {})
    rows = pa.table({f"f{i}": [str(v) for v in rng.zipf(1.4, 3)] for i in range(fields)})
    made = []
    as_strings = id_forms.as_strings
    monkeypatch.setattr(id_forms, "as_strings", lambda values: made.append(1) or as_strings(values))
    forms = id_forms.IdForms()
    forms.observe(encoder, rows)
    assert len(made) == 1
    assert all(rule["form"] == "integers" for rule in forms.record().values()) and len(forms.record()) == fields


def test_an_id_column_of_pandas_intervals_is_one_line_naming_it_not_arrows_cast_error():
    """A DataFrame's interval column (pandas' Arrow extension type, stored as a struct) passed the
    id check and its cast to text was pyarrow's ArrowNotImplementedError traceback; its storage
    now reaches the check, which refuses it in one line naming the column."""
    from flowrec.data.layout import DataError
    from flowrec.data.raw_ids import check_ids

    rng = np.random.default_rng()
    n = int(rng.integers(2, 40))
    edges = np.cumsum(rng.zipf(1.5, n + 1))
    frame = pd.DataFrame({"user": pd.arrays.IntervalArray.from_breaks(edges), "price": rng.lognormal(size=n),
                          "month": pd.period_range("2024-01", periods=n, freq="M")})
    for rows in (frame, pa.Table.from_pandas(frame, preserve_index=False)):
        raw = raw_table(rows)
        with pytest.raises(DataError, match="^column user holds struct<left: int64, right: int64>, not one id"):
            check_ids(raw.column("user"), "user", False)
        assert raw.column("price").to_pylist() == frame.price.tolist()
        assert raw.column("month").type == pa.Table.from_pandas(frame[["month"]]).column("month").type  # as it was


def test_a_categorical_id_column_of_integers_beyond_64_bits_is_named():
    """`pd.Categorical` of ids beyond 64 bits: Arrow's OverflowError became 'a column holds an
    integer beyond 64 bits', naming no column; its column, value and row are named now, as an
    object column's are."""
    from flowrec.data.layout import DataError

    rng = np.random.default_rng()
    n = int(rng.integers(3, 40))
    ids = [int(v) for v in rng.zipf(1.4, n)]
    row = int(rng.integers(0, n))
    ids[row] = 2 ** 64 + int(rng.integers(1, 10 ** 6))
    frame = pd.DataFrame({"price": rng.lognormal(size=n), "user": pd.Categorical(ids)})
    with pytest.raises(DataError, match=rf"column user holds the integer {ids[row]} at row {row} \(0-based\), beyond"):
        raw_table(frame)


def test_a_run_end_encoded_id_column_is_read_as_its_values():
    """An Arrow table whose sorted id column Arrow compressed into runs (run-end encoding) was refused
    as 'holds run_end_encoded<...>, not one id per row'; its values are read as the plain column's."""
    import pyarrow.compute as pc

    from flowrec.data.raw_ids import as_strings, check_ids

    rng = np.random.default_rng()
    n = int(rng.integers(5, 200))
    users = pa.array(np.sort(rng.zipf(1.3, n)), mask=rng.random(n) < 0.1)
    plain = pa.table({"user": users, "price": rng.lognormal(size=n), "tags": [["a", "b"]] * n})
    encoded = plain.set_column(0, "user", pc.run_end_encode(users)).set_column(
        2, "tags", pc.run_end_encode(plain.column("tags")))
    raw = raw_table(encoded)
    assert raw.equals(raw_table(plain))
    check_ids(raw.column("user"), "user", False)
    assert as_strings(raw.column("user")).equals(as_strings(plain.column("user").combine_chunks()))
