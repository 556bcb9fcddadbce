"""SIGTERM, SIGINT or SIGHUP to `flowrec train --nproc 2` (what `kill`, `timeout`, schedulers and a
closed terminal send) reaches torch's launcher and both ranks: they checkpoint after the current
step and exit, no process of the launch is left, and the printed resume command (which keeps
`--nproc 2`) ends the run with the parameters of an uninterrupted one. SIGTERM to one process checkpoints as Ctrl-C does.
A signal as the run finishes (its final checkpoint, its closing lines) is one line of what was kept."""
from __future__ import annotations

import os
import random
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest

from flowrec.testing.processes import communicate_bounded, descendants, kill_tree, running, wait_bounded
from flowrec.testing.ranks import assert_same_model, run_flowrec, subprocess_env, tiny_ranks_folder

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "tests" / "faults"  # holds a rank at a given point (sitecustomize.py)
TIMEOUT_S = 300  # every subprocess
EXIT_S = 120  # from the signal to the last process of the launch gone
ARRIVED_S = 120  # from the signal to the sign that the held processes have it
pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the ranks through /proc")


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_ranks_folder(tmp_path_factory.mktemp("nproc_signals"), "tiny_signals", ROOT, TIMEOUT_S)


def _args(out: str, nproc: int = 2) -> list[str]:
    return ["train", "spec.yaml", "--data", "d", "--out", out, "-q", "--eval-every", "0", "--checkpoint-every", "4",
            *(["--nproc", str(nproc)] if nproc > 1 else [])]


def _assert_gone(launch: list[int], err: str) -> None:
    """Every process of the launch has exited within EXIT_S (none left running)."""
    deadline = time.monotonic() + EXIT_S
    while any(running(p) for p in launch) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not [p for p in launch if running(p)], err[-3000:]


def _wait_for_ranks_training(job: subprocess.Popen, metrics: Path) -> list[int]:
    """The launch's processes once rank 0 has logged a few training steps."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        assert job.poll() is None, "the run ended before the signal"
        if metrics.is_file() and sum('"event": "train"' in line for line in metrics.open()) >= 3:
            return descendants(job.pid)
        time.sleep(0.1)
    pytest.fail(f"no training steps within {TIMEOUT_S} s")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=["sigterm", "sigint", "sighup"])
def test_a_signal_to_the_launch_stops_every_rank_and_the_printed_command_continues_it(work: Path, sig):
    reference = run_flowrec(*_args(f"ref_{sig.name}"), cwd=work, root=ROOT, timeout_s=TIMEOUT_S)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = f"run_{sig.name}"
    job = subprocess.Popen([sys.executable, "-m", "flowrec", *_args(out)], cwd=work, env=subprocess_env(ROOT),
                           stderr=subprocess.PIPE, text=True)
    try:
        launch = _wait_for_ranks_training(job, work / out / "metrics.jsonl")
        cmdlines = {p: Path(f"/proc/{p}/cmdline").read_bytes() for p in launch}
        ranks = [p for p, c in cmdlines.items() if b"flowrec\x00train" in c and b"flowrec.cli.ranks" not in c]
        assert len(ranks) == 2, ranks
        job.send_signal(sig)
        err = communicate_bounded(job, EXIT_S)[1]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            wait_bounded(job, 30)
    _assert_gone(launch, err)
    assert job.returncode == 128 + sig, err[-3000:]
    printed = [line for line in err.splitlines() if "continue with  flowrec" in line]
    assert printed and "Traceback" not in err, err[-3000:]
    words = shlex.split(printed[-1].split("continue with  ", 1)[1])
    assert words[:1] == ["flowrec"] and words[-2:] == ["--nproc", "2"], printed[-1]
    resumed = run_flowrec(*words[1:], cwd=work, root=ROOT, timeout_s=TIMEOUT_S)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resuming" in resumed.stderr
    assert_same_model(work / f"ref_{sig.name}", work / out, tol=0)


def test_sigterm_to_one_process_checkpoints_like_ctrl_c(work: Path):
    """SIGTERM (not only Ctrl-C) stops a one-process run after its step, with a checkpoint to continue."""
    reference = run_flowrec(*_args("ref_one", 1), cwd=work, root=ROOT, timeout_s=TIMEOUT_S)
    assert reference.returncode == 0, reference.stderr[-3000:]
    job = subprocess.Popen([sys.executable, "-m", "flowrec", *_args("run_one", 1)], cwd=work,
                           env=subprocess_env(ROOT), stderr=subprocess.PIPE, text=True)
    try:
        _wait_for_ranks_training(job, work / "run_one" / "metrics.jsonl")
        job.send_signal(signal.SIGTERM)
        err = communicate_bounded(job, EXIT_S)[1]
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            wait_bounded(job, 30)
    assert job.returncode == 130 and "interrupted: checkpoint saved" in err, err[-3000:]
    words = shlex.split(err.split("continue with  ")[-1].splitlines()[0])
    assert words[-2:] == ["--resume", "run_one"], words
    resumed = run_flowrec(*words[1:], cwd=work, root=ROOT, timeout_s=TIMEOUT_S)
    assert resumed.returncode == 0 and "resuming" in resumed.stderr, resumed.stderr[-3000:]
    assert_same_model(work / "ref_one", work / "run_one", tol=0)


def test_a_rank_gets_sigterm_when_its_launcher_is_killed(tmp_path: Path):
    # `kill -9` of torch's launcher (the OOM killer, a user) left both ranks of `flowrec train --nproc 2`
    # training on as orphans, holding the run folder; now the kernel sends each rank SIGTERM (a first
    # Ctrl-C: it stops after its step), here a rank stand-in that only asks for it and sleeps
    pid_file = tmp_path / "rank.pid"
    rank = ("import os, sys, time; from flowrec.cli.ranks import stop_with_launcher; stop_with_launcher(); "
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid())); time.sleep({TIMEOUT_S})")
    launcher = ("import subprocess, sys, time; "
                f"subprocess.Popen([sys.executable, '-c', {rank!r}]); time.sleep({TIMEOUT_S})")
    env = {**subprocess_env(ROOT), "TORCHELASTIC_RUN_ID": "test"}
    parent = subprocess.Popen([sys.executable, "-c", launcher], env=env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not (pid_file.is_file() and pid_file.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        child = int(pid_file.read_text())
        parent.kill()  # the launcher alone, as the OOM killer or a user kills it
        wait_bounded(parent, 30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}").exists() and time.monotonic() < deadline:
            time.sleep(0.1)
        gone = not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2]
        if not gone:
            os.kill(child, signal.SIGKILL)
        assert gone, "the rank outlived its launcher"
    finally:
        if parent.poll() is None:  # (a reaped process's id may be another's by now)
            kill_tree(parent.pid)
        wait_bounded(parent, 30)


def _signal_when_held(args: list[str], work: Path, env: dict, tmp_path: Path, held, sig: int,
                      arrived: Callable[[str], bool] | None) -> tuple[subprocess.Popen, list[int], str]:
    """Start `flowrec *args` in `work`, wait until `held()` (a hook of tests/faults holds a process
    of it), send `sig` to the launch, release the hold once `arrived(stderr so far)` shows the
    signal reached the held processes (None: once it exited) and return the job, the launch's
    processes and its stderr; the job and its launch are killed on failure."""
    job = subprocess.Popen([sys.executable, "-m", "flowrec", *args], cwd=work, env=env, stderr=subprocess.PIPE,
                           text=True)
    said: list[str] = []  # stderr so far, read as it comes: the sign that the signal arrived is a line

    def read() -> None:
        for line in job.stderr:
            said.append(line)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not held() and time.monotonic() < deadline:
            assert job.poll() is None, "the run ended before it was held: " + "".join(said)[-3000:]
            time.sleep(0.1)
        launch = descendants(job.pid)
        job.send_signal(sig)
        if arrived is not None:  # the held processes have the signal: a fixed sleep was too short on a loaded machine
            deadline = time.monotonic() + ARRIVED_S
            while not arrived("".join(said)) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert arrived("".join(said)), f"no sign within {ARRIVED_S} s that {sig.name} arrived: " + \
                "".join(said)[-3000:]
            (tmp_path / "release").write_text("")
        try:
            wait_bounded(job, EXIT_S)
        except AssertionError as late:  # the launch killed: what it said, read by `reader`, with the failure
            pytest.fail(f"{late} (sent {sig.name}): " + "".join(said)[-3000:])
        reader.join(timeout=EXIT_S)
    finally:
        (tmp_path / "release").write_text("")
        if job.poll() is None:  # with torch's launcher, in a session of its own, and the ranks
            kill_tree(job.pid)
            wait_bounded(job, 30)
    return job, launch, "".join(said)


def _exited(pid_file: Path) -> bool:
    """The process whose id a hold wrote to `pid_file` has exited."""
    text = pid_file.read_text()
    return text.isdigit() and not running(int(text))


def _stop_requested(err: str) -> bool:
    """Rank 0 has the signal (SIGINT): its stop handler's line is out."""
    return any(line.startswith("stop requested (Ctrl-C): ") for line in err.splitlines())


@pytest.mark.parametrize("phase", ["final_checkpoint", "closing_lines"])
def test_a_signal_as_the_run_finishes_is_one_line_of_what_was_kept(work: Path, tmp_path: Path, phase: str):
    # Ctrl-C after the last step of `flowrec train --nproc 2`: during the final checkpoint each rank said
    # 'error: rank N: interrupted (Ctrl-C) at step S; continue with ...' (nothing of what was kept), and
    # during rank 0's closing lines 'interrupted (Ctrl-C) before training started; nothing was trained'
    steps = random.choice([5, 6, 7, 9, 10])  # not a multiple of --checkpoint-every 4: the end takes its own
    out = f"finish_{phase}"
    env = {**subprocess_env(ROOT), "PYTHONPATH": f"{FAULTS}{os.pathsep}{ROOT}"}
    if phase == "final_checkpoint":  # rank 1's writer held at the run's last checkpoint
        env["FLOWREC_TEST_HOLD_CHECKPOINT"] = f"1:{steps}:{tmp_path}"
        held = tmp_path / f"held-rank1-step{steps}"
    else:  # rank 0 held after the run, before its closing lines
        env["FLOWREC_TEST_HOLD_END"] = str(tmp_path)
        held = tmp_path / "held-end"
    job, launch, err = _signal_when_held([*_args(out), "--max-steps", str(steps)], work, env, tmp_path, held.is_file,
                                         signal.SIGINT, _stop_requested)  # the ranks are held as the signal comes
    _assert_gone(launch, err)
    assert job.returncode == 130, err[-3000:]
    assert "Traceback" not in err and not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]
    said = [line for line in err.splitlines() if line.startswith("interrupted")]
    if phase == "final_checkpoint":
        assert said == [f"interrupted: checkpoint saved; continue with  flowrec train spec.yaml --resume {out} "
                        f"--nproc 2"], err[-3000:]
    else:
        assert said == [f"interrupted after the run finished: {out} holds all of it, its checkpoint of step {steps} "
                        f"included; nothing to continue"], err[-3000:]
    from flowrec.runtime.checkpoint.store import load_checkpoint

    assert load_checkpoint(work / out)["position"]["step"] == steps


def _digests(folder: Path) -> dict[str, bytes]:
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).digest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}


@pytest.mark.parametrize("resumed", [False, True], ids=["new", "resumed"])
def test_a_signal_to_the_launch_before_training_is_the_launchers_one_line(work: Path, tmp_path: Path, resumed: bool):
    # SIGTERM to `flowrec train --nproc 2` while its ranks loaded their data: each rank said 'error: rank N:
    # interrupted (SIGTERM) before training started; nothing was trained' (a rank not yet listening said
    # nothing), and a resumed run's line did not say it was kept nor how to continue it
    # (the resumed run goes on past its first --max-steps: a finished run's resume is said before any rank
    # starts, so none would be held)
    out = f"early_{'resumed' if resumed else 'new'}"
    steps = random.randrange(1, 4)
    if resumed:
        first = run_flowrec(*_args(out, 1), "--max-steps", str(steps), cwd=work, root=ROOT, timeout_s=TIMEOUT_S)
        assert first.returncode == 0, first.stderr[-3000:]
        before = _digests(work / out)
    env = {**subprocess_env(ROOT), "PYTHONPATH": f"{FAULTS}{os.pathsep}{ROOT}", "FLOWREC_TEST_HOLD_START": str(tmp_path)}
    args = _args(out) if not resumed else ["train", "spec.yaml", "--resume", out, "-q", "--nproc", "2",
                                           "--max-steps", str(steps + 3)]
    sig = random.choice([signal.SIGTERM, signal.SIGHUP])
    job, launch, err = _signal_when_held(args, work, env, tmp_path, lambda: any(tmp_path.glob("held-start-rank*")),
                                         sig, None)
    _assert_gone(launch, err)
    assert job.returncode == 128 + sig, err[-3000:]
    said = [line for line in err.splitlines() if "interrupted" in line or line.startswith("error")]
    kept = f"; the run is as it was: continue with  flowrec train spec.yaml --resume {out} --nproc 2" if resumed else ""
    assert said == [f"error: interrupted ({sig.name}) before training started; nothing was trained{kept}"], err[-3000:]
    assert err.strip().splitlines()[-1] == said[0] and "Traceback" not in err, err[-3000:]
    if resumed:
        assert _digests(work / out) == before  # untouched: the printed command continues it
    else:
        assert not (work / out).exists()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "sigint"])
def test_a_signal_to_the_launcher_after_the_ranks_finished_says_the_run_is_whole(work: Path, tmp_path: Path, sig):
    # the ranks had finished and exited (rank 0's closing lines out) and torch's launcher was winding up:
    # the launch ended with 143 (130) and not a line on what the run holds
    steps = random.randrange(3, 9)
    out = f"wound_{sig.name}"
    env = {**subprocess_env(ROOT), "PYTHONPATH": f"{FAULTS}{os.pathsep}{ROOT}",
           "FLOWREC_TEST_HOLD_LAUNCHER": str(tmp_path)}
    held = tmp_path / "held-launcher"  # torch's launcher held; the signal ends its hold (it exits)
    job, launch, err = _signal_when_held([*_args(out), "--max-steps", str(steps)], work, env, tmp_path,
                                         held.is_file, sig, lambda _: _exited(held))
    _assert_gone(launch, err)
    assert job.returncode == 128 + sig, err[-3000:]  # the signal's status, as one process's (docs/distributed.md)
    said = [line for line in err.splitlines() if "interrupted" in line or line.startswith("error")]
    assert said == [f"interrupted after the run finished: {out} holds all of it, its checkpoint of step {steps} "
                    f"included; nothing to continue"], err[-3000:]
    assert err.strip().splitlines()[-1] == said[0], err[-3000:]
    from flowrec.runtime.checkpoint.store import load_checkpoint

    assert load_checkpoint(work / out)["position"]["step"] == steps
