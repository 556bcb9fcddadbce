"""`truncate: last` end to end: data converted by the CLI and raw rows scored by an exported
package (`flowrec predict`'s path) keep the same, most recent, ids of a long history."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from package_flow import train_and_export

SPEC = """
name: trunc_pkg
features:
  - {name: item, type: categorical, table: items}
  - {name: clicks, type: sequence, table: items, max_len: 4, truncate: last, pooling: mean}
tables:
  - {name: items, hash_buckets: 97, dim: 8}
modules:
  - {name: top, kind: mlp, inputs: ["@sparse"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 2, seed: 0}
"""


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    lengths = np.minimum(rng.zipf(1.4, rows) - 1, 11)  # many short, some empty, many longer than max_len
    clicks = ["^".join("" if rng.random() < 0.1 else str(int(v) % 120) for v in rng.zipf(1.3, n)) for n in lengths]
    item = rng.zipf(1.3, rows) % 120
    label = (rng.random(rows) < np.where(item % 3 == 0, 0.7, 0.2)).astype(int)
    return pd.DataFrame({"item": item, "clicks": clicks, "label": label})


def kept(text: str, first: bool) -> str:
    """The history with only the 4 present items one rule keeps (missing ones dropped first)."""
    present = [s for s in text.split("^") if s] if isinstance(text, str) else []
    return "^".join(present[:4] if first else present[-4:])


def test_conversion_and_the_package_keep_the_last_items(tmp_path):
    from flowrec.serving.predict import load_model

    raw = raw_rows(800, 0)
    root = train_and_export(tmp_path, SPEC, raw)
    model = load_model(root / "pkg")
    converted = pq.read_table(root / "data").column("clicks").to_pylist()
    scored = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False), labels=False)
    assert scored.column("clicks").to_pylist() == converted
    long = raw["clicks"].map(lambda t: len([s for s in str(t).split("^") if s]) > 4).to_numpy()
    assert long.sum() > 50
    predicted = model.predict(raw)["ctr"].to_numpy()
    last = model.predict(raw.assign(clicks=raw["clicks"].map(lambda t: kept(t, False))))["ctr"].to_numpy()
    first = model.predict(raw.assign(clicks=raw["clicks"].map(lambda t: kept(t, True))))["ctr"].to_numpy()
    np.testing.assert_array_equal(predicted, last)  # scoring raw rows keeps the last 4
    assert (np.abs(predicted[long] - first[long]) > 1e-6).mean() > 0.5  # not the first 4
