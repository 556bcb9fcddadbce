"""The CLI path the package tests share: a spec and raw CSV rows -> converted data, a trained run,
an exported package (each step through the real CLI, exit 0 checked)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
from typer.testing import CliRunner

from flowrec.cli import app


TWO_TOWER = """
name: tt_walk
features:
  - {name: user_id, type: categorical, vocab: 60, dim: 8}
  - {name: item_id, type: categorical, vocab: 40, dim: 8}
modules:
  - {name: score, kind: similarity, inputs: [user_id, item_id], metric: dot}
heads:
  - {name: retrieve, input: score, task: retrieval, negatives: {kind: in_batch}, top_k: [5]}
data: {format: csv, label: label}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.01}
training: {batch_size: 64, epochs: 1, seed: 0}
"""  # a small two-tower retrieval spec (the serving tests' package of items)


def ratings(rng: np.random.Generator, items: np.ndarray, n: int = 600) -> pd.DataFrame:
    """Skewed (user, item) positives: a few items hold most rows."""
    return pd.DataFrame({"user_id": rng.integers(1, 50, n), "item_id": items[rng.zipf(1.4, n) % len(items)],
                         "label": np.ones(n, np.int64)})


def train_and_export(root: Path, spec_text: str, rows: pd.DataFrame, fmt: str = "csv") -> Path:
    """Write `root/spec.yaml` and `root/train.csv` (`fmt` parquet: `root/train.parquet`), then
    convert to `root/data`, train `root/run` on the CPU and export `root/pkg`; returns `root`."""
    runner = CliRunner()
    spec, file = root / "spec.yaml", root / f"train.{fmt}"
    spec.write_text(spec_text)
    if fmt == "csv":
        rows.to_csv(file, index=False)
    else:
        pq.write_table(pa.Table.from_pandas(rows, preserve_index=False), file)
    for args in (["data", "convert", fmt, str(file), str(root / "data"), "--spec", str(spec), "-q"],
                 ["train", str(spec), "--data", str(root / "data"), "--out", str(root / "run"), "--quiet",
                  "--device", "cpu"],
                 ["export", str(root / "run"), str(root / "pkg")]):
        result = runner.invoke(app, args)
        assert result.exit_code == 0, (args[0], result.output)
    return root


def invoke(args: list) -> Any:
    """`flowrec ARGS` through the CLI runner (each argument as text): its result, checked to have
    ended by an exit (never an exception escaping the command) and without a traceback."""
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    return result
