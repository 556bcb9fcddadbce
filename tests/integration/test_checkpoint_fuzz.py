"""Checkpoint fuzz: random truncations and bit flips of a real checkpoint, scored with `flowrec eval`.
The property: exit 0 with exactly the metrics of the intact checkpoint, or exit 2 with one line;
never a traceback, never torch's own message, and the file is left as it was."""
from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app

SPEC = """
name: tiny_fuzz
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 40, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", user], layers: [4]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 64, epochs: 1, seed: 2}
"""
CASES = 60
runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[Path, bytes, dict]:
    root = tmp_path_factory.mktemp("fuzz")
    (root / "spec.yaml").write_text(SPEC)
    made = runner.invoke(app, ["data", "synth", str(root / "spec.yaml"), "--rows", "200", "--out",
                               str(root / "data"), "--seed", "1"])
    assert made.exit_code == 0, made.output
    run = runner.invoke(app, ["train", str(root / "spec.yaml"), "--rows", "300", "--out", str(root / "run"),
                              "--quiet"])
    assert run.exit_code == 0, run.output
    scored = runner.invoke(app, ["eval", str(root / "run"), "--data", str(root / "data"), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    return root, (root / "run" / "checkpoint.pt").read_bytes(), json.loads(scored.stdout)


def _mutate(data: bytes, rng: random.Random) -> bytes:
    if rng.random() < 0.3:
        return data[: rng.randrange(len(data))]
    out = bytearray(data)
    for _ in range(rng.randint(1, 3)):
        at = rng.randrange(len(out))
        out[at] ^= 1 << rng.randrange(8)
    return bytes(out)


@pytest.mark.parametrize("seed", range(CASES))
def test_a_mutated_checkpoint_scores_exactly_or_is_one_line(trained, tmp_path: Path, seed: int):
    root, good, expected = trained
    mutated = _mutate(good, random.Random(seed))
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(mutated)
    result = runner.invoke(app, ["eval", str(path), "--data", str(root / "data"), "--json", "-"])
    assert "Traceback" not in result.output and "weights_only" not in result.output
    assert isinstance(result.exception, (SystemExit, type(None))), repr(result.exception)
    if result.exit_code == 0:
        assert json.loads(result.stdout) == expected
    else:
        lines = result.stderr.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert path.read_bytes() == mutated
