"""The line a rank restarted by `--max-restarts` prints: continuing the run from its last
checkpoint, or, where the failure came before the first checkpoint, training again from step 0
(that restart printed nothing, so a user could not tell the launch had restarted)."""
from __future__ import annotations

from pathlib import Path

import pytest

from flowrec.cli import train_cmds


def _request(out: Path | None, resume: Path | None = None) -> train_cmds.RunRequest:
    return train_cmds.RunRequest(spec_path=Path("spec.yaml"), out=out, resume=resume, overwrite=False, given={},
                                  quiet=False, json_out=False, report=False)


@pytest.fixture
def restarted(monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    for name in ("RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)


def test_a_restart_before_the_first_checkpoint_says_it_trains_from_step_0(restarted, tmp_path, capsys):
    request = _request(tmp_path / "run")
    assert train_cmds._restarted(request) is request  # nothing to resume: trains afresh
    err = capsys.readouterr().err
    assert err.startswith("restart 1: no checkpoint was taken before the failure") and "from step 0" in err
    assert str(tmp_path / "run") in err


def test_the_first_attempt_says_nothing(monkeypatch, tmp_path, capsys):
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    request = _request(tmp_path / "run")
    assert train_cmds._restarted(request) is request
    assert capsys.readouterr().err == ""


def test_a_restart_of_a_resumed_run_does_not_claim_step_0(restarted, tmp_path, capsys):
    request = _request(None, resume=tmp_path / "run")
    assert train_cmds._restarted(request) is request
    assert "step 0" not in capsys.readouterr().err
