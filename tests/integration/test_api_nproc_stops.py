"""`flowrec.train(..., nproc=2)` stopped from outside, as a user's job is: SIGTERM or SIGHUP to the
calling process stops every rank at a checkpoint and leaves no process of the launch; a rank deaf to
SIGTERM is killed, with the launcher, once the stop wait (`flowrec.runs.launch.STOP_WAIT_S`, shortened
here) is over; a signal to a rank alone ends the call as an interrupt does, naming the call that
continues the run; `max_restarts=1` with a rank that fails once ends like the uninterrupted run (as
`flowrec train --max-restarts 1` does: test_dist_train). Each Python call runs in a subprocess under
a deadline (`run_bounded`, `communicate_bounded`)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flowrec.testing.processes import communicate_bounded, descendants, kill_tree, running, run_bounded, wait_bounded
from flowrec.testing.ranks import FLAKY_ENV, assert_same_model, flaky_spec, subprocess_env, tiny_ranks_folder

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess: a rank left waiting fails the test, never hangs it
EXIT_S = 150  # from the signal to the calling process's exit (the ranks' checkpoint, the launcher's shutdown)
# a custom module whose ranks ignore SIGTERM, SIGINT and SIGHUP from their first training step on
# (each step: the trainer's own handlers are installed before it) and take 0.1 s a step
DEAF_MODULE = textwrap.dedent('''
    import os, signal, threading, time
    from torch import nn


    class Flaky(nn.Module):
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            if self.training and "RANK" in os.environ and threading.current_thread() is threading.main_thread():
                for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                    signal.signal(sig, signal.SIG_IGN)
                time.sleep(0.1)
            return self.proj(x)
''')

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the ranks through /proc")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_ranks_folder(tmp_path_factory.mktemp("api_nproc_stops"), "tiny_api_stops", ROOT, TIMEOUT_S)


def _start(code: str, cwd: Path, **env: str) -> subprocess.Popen:
    """A Python process running `code` in `cwd` (SIGINT as Python handles it by default, whatever the
    test runner's), its output captured."""
    code = "import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n" + textwrap.dedent(code)
    return subprocess.Popen([sys.executable, "-c", code], cwd=cwd, env={**subprocess_env(ROOT), **env},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _ranks_after_steps(job: subprocess.Popen, folder: Path, steps: int) -> tuple[list[int], list[int]]:
    """Once the run in `folder` has logged `steps` training steps: every process under `job` (the
    launcher and the ranks) and the ranks among them."""
    metrics, deadline = folder / "metrics.jsonl", time.monotonic() + TIMEOUT_S
    while not (metrics.is_file() and sum('"event": "train"' in line for line in metrics.open()) >= steps):
        assert job.poll() is None, f"the run ended before {steps} steps: {communicate_bounded(job, 30)[1][-3000:]}"
        assert time.monotonic() < deadline, f"no {steps} training steps within {TIMEOUT_S} s"
        time.sleep(0.1)
    launch = descendants(job.pid)
    ranks = [p for p in launch if b"flowrec\x00train" in _cmdline(p) and b"flowrec.cli.ranks" not in _cmdline(p)]
    assert len(ranks) == 2, launch
    return launch, ranks


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _signalled(job: subprocess.Popen, pid: int, sig: int, again_after_s: float | None = None) -> tuple[str, str]:
    """`sig` sent to `pid` (and `again_after_s` later once more, where given), then `job`'s output once
    it exits (within EXIT_S; killed with its tree where the test fails first)."""
    try:
        os.kill(pid, sig)
        if again_after_s is not None:
            time.sleep(again_after_s)
            os.kill(pid, sig)
        return communicate_bounded(job, EXIT_S)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            wait_bounded(job, 30)


def _checkpoint_step(folder: Path) -> int:
    from flowrec.runtime.checkpoint.store import load_checkpoint

    return load_checkpoint(folder / "checkpoint.pt")["position"]["step"]


INTERRUPTED = """
    import flowrec
    try:
        flowrec.train("spec.yaml", data="d", out="{out}", checkpoint_every=4, nproc=2)
    except KeyboardInterrupt as exc:
        print("interrupted:", exc, flush=True)
        raise SystemExit(130)
"""


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_or_sighup_to_the_caller_stops_every_rank_at_a_checkpoint(work: Path, sig: int):
    out = f"stopped_{signal.Signals(sig).name}"
    job = _start(INTERRUPTED.format(out=out), work)
    launch, _ = _ranks_after_steps(job, work / out, 3)
    said, err = _signalled(job, job.pid, sig)
    assert job.returncode == 130, err[-3000:]
    assert not [p for p in launch if running(p)], launch  # the launcher and both ranks: stopped and joined
    said = said.split("interrupted: ", 1)[1].strip()
    step = _checkpoint_step(work / out)  # every rank's part of it: it loads whole
    assert said == (f"training interrupted after step {step}; its checkpoint is in {out}: flowrec.load('{out}') "
                    f"scores it, `flowrec.train('spec.yaml', resume='{out}', nproc=2)` continues it"), said
    assert 3 <= step < 48, said  # 4 epochs of 12 steps: stopped on the way


def test_a_signal_to_one_rank_ends_the_call_as_an_interrupt_naming_the_call_that_continues_it(work: Path):
    """A rank stopped by a signal of its own (`kill PID`, a scheduler) checkpoints with the others and
    they exit 130, as on Ctrl-C: the call raised RanksFailed 'no rank said why' (rank 0's line, an
    info line, named the command line's --resume); now the KeyboardInterrupt an interrupt raises."""
    job = _start(INTERRUPTED.format(out="rank_stopped"), work)
    launch, ranks = _ranks_after_steps(job, work / "rank_stopped", 3)
    said, err = _signalled(job, ranks[-1], signal.SIGTERM)
    assert job.returncode == 130, err[-3000:]
    assert not [p for p in launch if running(p)], launch
    step = _checkpoint_step(work / "rank_stopped")
    assert said.split("interrupted: ", 1)[1].strip() == (
        f"training interrupted after step {step}; its checkpoint is in rank_stopped: flowrec.load('rank_stopped') "
        "scores it, `flowrec.train('spec.yaml', resume='rank_stopped', nproc=2)` continues it"), said


@pytest.mark.parametrize("stop_wait_s,again_after_s", [(2.0, None), (None, 1.0)],
                         ids=["past the stop wait", "on a second signal"])
def test_ranks_deaf_to_sigterm_are_killed_with_the_launcher(tmp_path: Path, stop_wait_s: float | None,
                                                            again_after_s: float | None):
    """The ranks ignore the launcher's SIGTERM (it would kill them after its own 30 s shutdown): past
    STOP_WAIT_S (2 s here), or on a second signal to the call (STOP_WAIT_S left at its 120 s), the
    call kills the launcher and every rank, leaving none."""
    flaky_spec(tmp_path, 5)
    (tmp_path / "flaky.py").write_text(DEAF_MODULE)
    job = _start(f"""
        import flowrec
        from flowrec.runs import launch

        if {stop_wait_s!r} is not None:
            launch.STOP_WAIT_S = {stop_wait_s!r}
        run_launch = launch.run_launch

        def told(*args, **kwargs):  # the launcher's end, as run_launch saw it
            ended = run_launch(*args, **kwargs)
            print("launcher status:", ended.status, flush=True)
            return ended

        launch.run_launch = told
        try:
            flowrec.train("s.yaml", rows=6400, device="cpu", out="deaf", nproc=2)
        except KeyboardInterrupt as exc:
            print("interrupted:", exc, flush=True)
            raise SystemExit(130)
    """, tmp_path)
    launch, _ = _ranks_after_steps(job, tmp_path / "deaf", 2)
    said, err = _signalled(job, job.pid, signal.SIGTERM, again_after_s)
    assert job.returncode == 130, err[-3000:]
    assert not [p for p in launch if running(p)], launch
    assert "launcher status: -9" in said, said  # killed by this call (SIGKILL), not ended by its own shutdown
    assert "interrupted: training on 2 ranks interrupted (SIGTERM) before its first checkpoint: " in said, said


def test_max_restarts_from_python_ends_like_the_uninterrupted_run(tmp_path: Path):
    """Rank 1 fails at step 3 (a KeyError of its custom module) in the first attempt: with max_restarts=1
    every rank is restarted, the run goes on from its checkpoint of step 2 and ends as the run that
    never failed (FLAKY_MODULE, failing once where FLAKY_ENV names a file, never where it says so)."""
    flaky_spec(tmp_path, 5)
    code = textwrap.dedent("""
        import sys, flowrec
        run = flowrec.train("s.yaml", rows=400, device="cpu", out=sys.argv[1], max_steps=6, checkpoint_every=2,
                            nproc=2, max_restarts=1)
        print(run.trained.step)
    """)
    for out, env in (("whole", {FLAKY_ENV: "never"}), ("restarted", {FLAKY_ENV: str(tmp_path / "failed")})):
        done = run_bounded([sys.executable, "-c", code, out], cwd=tmp_path, env={**subprocess_env(ROOT), **env},
                           text=True, capture_output=True, timeout_s=TIMEOUT_S)
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.split() == ["6"], done.stdout
        assert (tmp_path / "failed").is_file() == (out == "restarted")  # rank 1 failed once, in that run only
    assert_same_model(tmp_path / "whole", tmp_path / "restarted")
