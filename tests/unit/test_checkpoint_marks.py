"""A step marks the rows it touches for the checkpoints only when a checkpoint can be taken while
training runs (`checkpoint_every`): without one, the only checkpoint is the whole one at the end,
and the marks (scattered writes into a mask of every row, 1.5 ms a DLRM step) were never read."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrec import api
from flowrec.runtime.checkpoint import checkpointer as ckpt_module

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "custom_module.yaml"


@pytest.fixture
def marks(monkeypatch):
    calls: list[int] = []
    mark = ckpt_module.Checkpointer.mark

    def counted(self, batch):
        calls.append(1)
        return mark(self, batch)

    monkeypatch.setattr(ckpt_module.Checkpointer, "mark", counted)
    return calls


@pytest.mark.parametrize("out, every, want", [(None, 0, 0), ("run", 0, 0), ("run", 2, 6)])
def test_steps_mark_rows_only_for_checkpoints_taken_while_training(tmp_path, marks, out, every, want):
    run = api.train(SPEC, out=None if out is None else tmp_path / out, max_steps=6, epochs=6, rows=2048,
                    seed=1, checkpoint_every=every)
    assert run.result.steps == 6
    assert len(marks) == want
    if out is not None:  # the end's checkpoint is written either way, and loads
        assert (tmp_path / out / "checkpoint.pt").is_file()
        assert api.load(tmp_path / out).trained.model is not None


@pytest.mark.parametrize("every, steps, want", [(3, 6, [3, 6]), (3, 7, [3, 6, 7])])
def test_the_last_step_is_checkpointed_once_and_a_resume_from_it_is_exact(tmp_path, every, steps, want):
    """With --checkpoint-every N and a last step that is a multiple of N, the periodic rule and the
    end both wrote the last step's checkpoint: twice the writing at the end of the run. It is
    written once, and a resume from it ends on the parameters of an uninterrupted run."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.runtime.checkpoint.store import load_checkpoint

    seen: list[int] = []
    api.train(SPEC, out=tmp_path / "run", max_steps=steps, epochs=4, rows=3000, seed=7, checkpoint_every=every,
              on_checkpoint=lambda event: seen.append(event.step))
    assert seen == want
    done = CliRunner().invoke(app, ["train", str(SPEC), "--resume", str(tmp_path / "run"), "--max-steps", "9", "-q"])
    assert done.exit_code == 0, done.output
    api.train(SPEC, out=tmp_path / "whole", max_steps=9, epochs=4, rows=3000, seed=7, checkpoint_every=every)
    resumed, whole = (load_checkpoint(tmp_path / name)["model"] for name in ("run", "whole"))
    assert resumed.keys() == whole.keys()
    assert all(torch.equal(resumed[key], whole[key]) for key in whole)
