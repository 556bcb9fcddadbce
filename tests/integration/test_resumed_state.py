"""A run cut at a checkpoint and resumed saves the same state as an uninterrupted run: parameters,
optimizer state, position, loop state and torch's process generator. The generator was left as the
process started (at a random seed) and recorded as it was, so a resumed run's checkpoint carried
the first process's generator and an uninterrupted run's its own, though every parameter was
bitwise equal. Training now seeds it from the run's seed as a run starts."""
from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint

SPEC = """
name: cut
features:
  - {{name: price, type: dense, transform: log1p}}
  - {{name: user_id, type: categorical, hash_buckets: 400, dim: 8}}
  - {{name: item_id, type: categorical, hash_buckets: 300, dim: 8}}
modules:
  - {{name: bottom, kind: mlp, inputs: ["@sparse", price], layers: [16]{dropout}}}
  - {{name: top, kind: mlp, inputs: [bottom], layers: [8]}}
heads:
  - {{name: click, input: top}}
optimizer:
  dense: {{name: adam, lr: 0.01}}
  sparse: {{name: adagrad, lr: 0.05}}
training: {{batch_size: 64, seed: {seed}}}
"""
# what names a checkpoint file rather than the run's state: a random nonce per full write (linking
# its deltas to it) and the content digest over it
FILE_KEYS = ("chain", "digest")
runner = CliRunner()


def _flat(value, prefix: str = ""):
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flat(item, f"{prefix}.{key}")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            yield from _flat(item, f"{prefix}[{i}]")
    else:
        yield prefix, value


def _train(*args: str) -> None:
    torch.manual_seed(random.randrange(1 << 62))  # as in a new process: the generator starts anywhere
    done = runner.invoke(app, ["train", *args, "-q"])
    assert done.exit_code == 0, done.output


@pytest.mark.parametrize("dropout", ["", ", dropout: 0.3"], ids=["plain", "dropout"])
def test_a_run_cut_at_a_checkpoint_and_resumed_saves_every_state_of_an_uninterrupted_one(tmp_path: Path, dropout):
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(dropout=dropout, seed=random.randrange(1 << 30)))  # fresh Zipf-skewed rows
    steps, every = random.randint(9, 13), random.randint(3, 5)
    common = [str(spec), "--rows", "1000", "--checkpoint-every", str(every)]
    _train(*common, "--max-steps", str(steps), "--out", str(tmp_path / "whole"))
    _train(*common, "--max-steps", str(every), "--out", str(tmp_path / "cut"))
    _train(str(spec), "--resume", str(tmp_path / "cut"), "--max-steps", str(steps))
    whole, cut = (load_checkpoint(tmp_path / name) for name in ("whole", "cut"))
    assert whole["position"]["step"] == steps and ("noise_steps" in whole["model"]) == bool(dropout)
    assert torch.equal(whole["rng"]["torch"], cut["rng"]["torch"])  # the generator the run leaves
    whole, cut = (dict(_flat({k: v for k, v in state.items() if k not in FILE_KEYS})) for state in (whole, cut))
    assert sorted(whole) == sorted(cut)
    differ = [key for key, value in whole.items()
              if not (torch.equal(value, cut[key]) if isinstance(value, torch.Tensor) else value == cut[key])]
    assert differ == []
