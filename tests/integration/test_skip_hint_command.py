"""`flowrec train` of a spec whose bound raw data holds a malformed row says how to skip such rows:
`flowrec data convert FORMAT RAW DIR --spec SPEC --on-error skip`. Its paths were written bare, so
with a space in the spec's or the data's path the command did not run as written (the shell split
the path). They are quoted as a shell word now; the command, pasted, converts the data."""
from __future__ import annotations

import random
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app

SPEC = """
name: skip_hint
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 100, dim: 4}
modules:
  - {name: deep, kind: mlp, inputs: ["@sparse", "@dense"], layers: [8]}
heads:
  - {name: ctr, input: deep, task: binary, loss: bce}
data: {format: csv, path: "clicks v2.csv", label: label}
optimizer:
  dense: {name: adam, lr: 0.001}
  sparse: {name: adagrad, lr: 0.05}
training: {batch_size: 64, epochs: 1, seed: 0}
"""
runner = CliRunner()


@pytest.mark.parametrize("folder", ["plain", "my data"])
def test_the_skip_command_a_malformed_row_suggests_runs_as_written(tmp_path: Path, monkeypatch, folder: str):
    rng = random.Random()
    rows = [f"{int(rng.random() < 0.3)},{rng.expovariate(0.1):.3f},u{int(rng.paretovariate(1.2))}"
            for _ in range(300)]  # skewed prices and users
    bad = rng.randrange(1, 300)
    rows[bad] = "1,notanumber,u3"
    work = tmp_path / folder
    work.mkdir()
    (work / "clicks v2.csv").write_text("label,price,user\n" + "\n".join(rows) + "\n")
    (work / "my spec.yaml").write_text(SPEC)
    monkeypatch.chdir(work)
    done = runner.invoke(app, ["train", "my spec.yaml", "--out", "run", "-q"])
    assert done.exit_code == 2, done.output
    command = re.search(r"convert them with `([^`]*)`", done.output)
    assert command is not None, done.output
    words = shlex.split(command.group(1).replace(" DIR ", f" {shlex.quote(str(tmp_path / 'out dir'))} "))
    assert words[:3] == ["flowrec", "data", "convert"] and "--on-error" in words
    converted = runner.invoke(app, words[1:])
    assert converted.exit_code == 0, (words, converted.output)
    assert "skipped 1 malformed row of 300" in converted.output
    assert (tmp_path / "out dir" / "_flowrec.json").is_file()
