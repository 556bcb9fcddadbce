"""SIGKILL at 10 random moments, each time running again exactly the command flowrec printed (or
the same command when it printed none): the run ends with parameters bitwise identical to an
uninterrupted one, metrics.jsonl holds each step once, and no temp file is left."""
from __future__ import annotations

import json
import os
import random
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.testing.processes import run_bounded, wait_bounded
from flowrec.testing.specs import run_spec

SPEC = run_spec("tiny_kill", batch_size=16)
STEPS = 2 * 38  # 600 rows / 16 = 38 batches (the last one partial), 2 epochs
KILLS = 10
RUN_TIMEOUT_S = 120
STARTUP_S = 3.0  # kills in the start-up land within this many seconds of the launch
REPO = Path(__file__).resolve().parents[2]
FLOWREC = [sys.executable, "-c", "from flowrec.cli import main; main()"]


def _command(spec: Path, out: Path) -> list[str]:
    return [*FLOWREC, "train", str(spec), "--rows", "600", "--out", str(out), "--checkpoint-every", "1",
            "--eval-every", "25", "--quiet"]


def _start(argv: list[str], cwd: Path, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(argv, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=log.open("wb"))


def _printed_command(log: Path) -> list[str] | None:
    """The last `continue with  flowrec ...` command in a log, as argv."""
    lines = [line for line in log.read_text(errors="replace").splitlines() if "continue with  flowrec" in line]
    if not lines:
        return None
    words = shlex.split(lines[-1].split("continue with  ", 1)[1])
    assert words[0] == "flowrec"
    return [*FLOWREC, *words[1:]]


def _train_records(run: Path) -> int:
    path = run / "metrics.jsonl"
    return path.read_text(errors="replace").count('"event": "train"') if path.is_file() else 0


def _kill_at_random_moment(proc: subprocess.Popen, run: Path, rng: random.Random) -> None:
    """Half the moments are a random time into the start-up; half a random number of further
    training steps (so kills land in training, evaluation and checkpoint writes too)."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    if rng.random() < 0.5:
        end = time.monotonic() + rng.uniform(0.0, STARTUP_S)
        while time.monotonic() < end and proc.poll() is None:
            time.sleep(0.01)
    else:
        target = _train_records(run) + rng.randint(1, 12)
        while _train_records(run) < target and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.002)
    if proc.poll() is None:
        proc.send_signal(signal.SIGKILL)
    wait_bounded(proc, RUN_TIMEOUT_S)


def test_sigkill_at_random_moments_then_the_printed_command_ends_bitwise_equal(tmp_path: Path):
    spec = tmp_path / "tiny.yaml"
    spec.write_text(SPEC)
    reference = CliRunner().invoke(app, _command(spec, tmp_path / "full")[len(FLOWREC):])
    assert reference.exit_code == 0, reference.output

    rng = random.Random(9)
    run = tmp_path / "cut"
    argv = _command(spec, run)
    killed = resumed = 0
    for attempt in range(KILLS):
        log = tmp_path / f"attempt{attempt}.log"
        had_checkpoint = (run / "checkpoint.pt").is_file()
        proc = _start(argv, tmp_path, log)
        _kill_at_random_moment(proc, run, rng)
        killed += proc.returncode == -signal.SIGKILL
        resumed += had_checkpoint and proc.returncode == -signal.SIGKILL
        text = log.read_text(errors="replace")
        assert "Traceback" not in text
        argv = _printed_command(log) or argv
    assert killed >= KILLS // 2 and resumed >= 3  # attempts really died, several of them resumed ones

    final = run_bounded(argv, cwd=tmp_path, timeout_s=RUN_TIMEOUT_S, capture_output=True,
                        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert final.returncode == 0, final.stderr.decode()
    full, cut = load_checkpoint(tmp_path / "full"), load_checkpoint(run)
    assert cut["position"] == full["position"] and cut["position"]["step"] == STEPS
    assert full["model"].keys() == cut["model"].keys()
    assert all(torch.equal(full["model"][k], cut["model"][k]) for k in full["model"])
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["event"] == "train"] == list(range(1, STEPS + 1))
    assert not list(run.glob(".ckpt-*"))
