"""One-hot hashed features of a small chunk hash together, one array per Arrow type
(`flowrec.data.encode.hash_rows_together`): the ids must be bitwise those of `hash_rows` column by
column, whatever the columns' types, nulls, empty strings, NaN and table sizes."""
from __future__ import annotations

import random

import numpy as np
import pyarrow as pa
import pytest

from flowrec.data import encode
from flowrec.data.encode import Encoder, hash_rows, hash_rows_together
from flowrec.spec.load import spec_from_dict


def skewed_column(rng: np.random.Generator, kind: str, n: int) -> pa.Array:
    """Zipf ids of one type, with missing values of the type's kinds."""
    ids = rng.zipf(1.3, n) % 5000
    missing = rng.random(n) < 0.15
    if kind == "int":
        return pa.array([None if m else int(v) for v, m in zip(ids, missing)], pa.int64())
    if kind == "float":  # ids pandas wrote as floats: 3.0, NaN and a fraction or two
        values = ids.astype(np.float64) + (rng.random(n) < 0.1) * 0.5
        values[missing] = np.nan
        return pa.array(values, pa.float64())
    if kind == "text":
        return pa.array([None if m else ("" if v % 7 == 0 else f"u{v}") for v, m in zip(ids, missing)], pa.string())
    if kind == "large_text":
        return pa.array([None if m else str(v) for v, m in zip(ids, missing)], pa.large_string())
    if kind == "bool":
        return pa.array([None if m else bool(v % 2) for v, m in zip(ids, missing)], pa.bool_())
    if kind == "category":  # pandas categories: each column its own dictionary
        return pa.array([None if m else f"c{v % 11}" for v, m in zip(ids, missing)], pa.string()).dictionary_encode()
    raise AssertionError(kind)


KINDS = ["int", "float", "text", "large_text", "bool", "category"]


def test_hashing_together_gives_each_columns_own_ids_bitwise():
    rng = np.random.default_rng(random.randrange(1 << 30))
    n = int(rng.integers(1, 300))
    kinds = [KINDS[int(k)] for k in rng.integers(0, len(KINDS), 40)]
    columns = [skewed_column(rng, kind, n) for kind in kinds]
    rows = [int(r) for r in rng.choice([1, 2, 3, 97, 1 << 20, (1 << 40) + 7], len(columns))]
    together = hash_rows_together(list(columns), rows)
    for column, size, kind, ids in zip(columns, rows, kinds, together):
        alone = hash_rows(column, size)
        assert ids.dtype == np.int64 and np.array_equal(ids, alone), (kind, size)
    nonzero = sum(int((ids != 0).sum()) for ids in together)
    assert nonzero > n  # the draw has ids, not only missing values


def spec(features: list[dict]) -> object:
    return spec_from_dict({
        "name": "t", "features": [{"name": "x", "type": "dense"}, *features],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "y", "input": "m"}]})


@pytest.mark.parametrize("rows", [1, 17, 300])
def test_a_small_chunk_encodes_as_a_large_one(monkeypatch, rows):
    """`Encoder.encode` of a chunk of up to BATCHED_HASH_ROWS rows (hashed together) equals the
    column-by-column encoding, with multi-hot, vocabulary and managed features beside."""
    rng = np.random.default_rng(random.randrange(1 << 30))
    features, raw = [], {"x": pa.array(rng.random(rows))}
    for i, kind in enumerate(KINDS * 3):
        features.append({"name": f"h{i}", "type": "categorical", "hash_buckets": int(rng.integers(2, 5000)), "dim": 4})
        raw[f"h{i}"] = skewed_column(rng, kind, rows)
    features.append({"name": "seq", "type": "categorical", "hash_buckets": 99, "dim": 4, "max_len": 3})
    raw["seq"] = pa.array(["a^b", None, "c"] * (rows // 3) + ["d"] * (rows % 3))
    features.append({"name": "v", "type": "categorical", "vocab": 5, "dim": 4})
    raw["v"] = pa.array([f"w{i % 4}" for i in range(rows)])
    model = spec(features)
    table = pa.table(raw)
    enc = Encoder(model, {}, {"v": pa.array(["w1", "w2"])}, {})
    small = enc.encode(table, labels=False)
    monkeypatch.setattr(encode, "BATCHED_HASH_ROWS", 0)  # every chunk column by column, as a large one
    large = enc.encode(table, labels=False)
    assert small.column_names == large.column_names
    for name in small.column_names:
        assert small.column(name).equals(large.column(name)), name
    assert any(int(np.count_nonzero(small.column(f"h{i}").to_numpy())) for i in range(len(KINDS)))
