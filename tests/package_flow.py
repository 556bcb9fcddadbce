"""The CLI path the package tests share: a spec and raw CSV rows -> converted data, a trained run,
an exported package (each step through the real CLI, exit 0 checked)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import pandas as pd
from typer.testing import CliRunner

from flowrec.cli import app


def train_and_export(root: Path, spec_text: str, rows: pd.DataFrame) -> Path:
    """Write `root/spec.yaml` and `root/train.csv`, then convert to `root/data`, train `root/run`
    on the CPU and export `root/pkg`; returns `root`."""
    runner = CliRunner()
    spec, csv = root / "spec.yaml", root / "train.csv"
    spec.write_text(spec_text)
    rows.to_csv(csv, index=False)
    for args in (["data", "convert", "csv", str(csv), str(root / "data"), "--spec", str(spec), "-q"],
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
