"""`vocab_spare`: the spec's rows include the spare rows; new values take the free rows in order of
first appearance (row by row, features in spec order, list positions), min_freq applies, overflow
is counted; a spec without spare rows keeps its data hash."""
from __future__ import annotations

import pyarrow as pa

from flowrec.data.encode import Encoder, fit_encoder
from flowrec.data.layout import data_hash
from flowrec.data.vocab_growth import grow_encoder
from flowrec.spec.load import spec_from_dict, to_dict

SPEC = {
    "name": "grow",
    "features": [
        {"name": "a", "type": "categorical", "table": "t"},
        {"name": "b", "type": "categorical", "table": "t", "max_len": 3},
        {"name": "c", "type": "categorical", "vocab": 2, "dim": 4},
    ],
    "tables": [{"name": "t", "vocab": 3, "vocab_spare": 4, "dim": 4}],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
}


def _spec(**table):
    doc = {**SPEC, "tables": [{**SPEC["tables"][0], **table}]}
    return spec_from_dict(doc)


def _raw(a: list, b: list[str], c: list) -> pa.Table:
    return pa.table({"a": a, "b": b, "c": c, "label": [0] * len(a)})


def _fitted(spec) -> Encoder:
    return fit_encoder(spec, [_raw(["x", "y", "z"], ["", "", ""], ["p", "q", "p"])], {})


def test_rows_include_the_spare_rows_and_the_spec_round_trips():
    spec = _spec()
    assert spec.table("t").rows == 3 + 1 + 4 and spec.table("t").vocab_size == 3
    assert spec_from_dict(to_dict(spec)) == spec
    assert to_dict(spec)["tables"][0]["vocab_spare"] == 4


def test_a_spec_without_spare_rows_hashes_as_before():
    doc = {**SPEC, "tables": [{"name": "t", "vocab": 3, "dim": 4}]}
    spec = spec_from_dict(doc)
    assert "vocab_spare" not in to_dict(spec)["tables"][0] and spec.table("t").rows == 4
    assert data_hash(spec) != data_hash(_spec())
    assert data_hash(spec) == data_hash(spec_from_dict(dict(doc, tables=[{"name": "t", "vocab": 3, "dim": 4,
                                                                          "vocab_spare": 0}])))


def test_fitting_keeps_vocab_values_and_leaves_the_spare_rows_free():
    encoder = _fitted(_spec())
    assert encoder.vocabs["t"].to_pylist() == ["x", "y", "z"]


def test_new_values_take_rows_in_order_of_first_appearance_across_rows_features_and_positions():
    encoder = _fitted(_spec())
    chunks = [_raw(["x", "n3", None], ["n1^n2", "x^n4", ""], ["p", "r", "q"]),
              _raw(["n5", "n1"], ["n6", ""], ["p", "p"])]
    grown, (report,) = grow_encoder(encoder, chunks)
    # row 0: a=x (known), b=n1, n2; row 1: a=n3, b=x, n4; then n5 (a), n6 (b) in the next chunk
    assert grown.vocabs["t"].to_pylist() == ["x", "y", "z", "n1", "n2", "n3", "n4"]
    assert (report.first_row, report.added, report.free_left) == (4, 4, 0)
    assert (report.overflow_values, report.overflow_rows) == (2, 2)
    assert grown.vocabs["c"].to_pylist() == encoder.vocabs["c"].to_pylist()  # no spare rows: unchanged
    encoded = grown.encode(chunks[1], labels=False)
    assert encoded.column("a").to_pylist() == [0, 4]  # n5 had no row left
    assert grown.encode(chunks[0], labels=False).column("c").to_pylist() == [1, 0, 2]


def test_min_freq_keeps_rare_new_values_at_row_0():
    encoder = _fitted(_spec(min_freq=2))
    grown, (report,) = grow_encoder(encoder, [_raw(["n1", "n2", "n1", "n3", "n2"], [""] * 5, ["p"] * 5)])
    assert encoder.vocabs["t"].to_pylist() == []  # x, y, z were seen once each
    assert grown.vocabs["t"].to_pylist() == ["n1", "n2"]
    assert (report.first_row, report.added, report.overflow_values) == (1, 2, 0)


def test_a_vocabulary_smaller_than_vocab_leaves_its_free_rows_to_new_values_first():
    encoder = fit_encoder(_spec(), [_raw(["x"], [""], ["p"])], {})
    grown, (report,) = grow_encoder(encoder, [_raw(["n1", "n2"], [""] * 2, ["p"] * 2)])
    assert grown.vocabs["t"].to_pylist() == ["x", "n1", "n2"]
    assert (report.first_row, report.added, report.free_left) == (2, 2, 4)
