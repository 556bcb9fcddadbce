"""A test's child process still running at its deadline (`flowrec.testing.processes`) is killed with
every process below it, ranks in a session of their own included, and the test fails with what the
child printed: a hung child hung CI, or failed with a bare TimeoutExpired and left its ranks running.
A tool's child (`run_tree`) is killed with its tree alike, and raises a TimeoutExpired that says so."""
from __future__ import annotations

import random
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from flowrec.testing.processes import (call_within, communicate_bounded, kill_tree, readline_bounded, run_bounded,
                                       run_tree, running, wait_bounded)
from flowrec.testing.ranks import run_flowrec

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the processes through /proc")

# a launcher stand-in: a grandchild in a session of its own (as torch's launcher of `--nproc N` is),
# each process writing its id, then both sleeping past any deadline
HUNG = """
import os, subprocess, sys, time
word, pids = sys.argv[1], sys.argv[2]
subprocess.Popen([sys.executable, "-c", "import os, sys, time; open(sys.argv[1], 'a').write(f'{os.getpid()}\\\\n'); "
                  "time.sleep(600)", pids], start_new_session=True)
open(pids, "a").write(f"{os.getpid()}\\n")
print(word, flush=True)
print("on stderr: " + word, file=sys.stderr, flush=True)
time.sleep(600)
"""


def _started(pids: Path, count: int) -> list[int]:
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        found = [int(p) for p in pids.read_text().split()] if pids.is_file() else []
        if len(found) == count:
            return found
        time.sleep(0.05)
    pytest.fail(f"{count} processes did not start within 120 s")


def _gone(pids: list[int]) -> bool:
    deadline = time.monotonic() + 60
    while any(running(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(running(p) for p in pids)


def test_a_hung_child_is_killed_with_its_tree_and_fails_with_what_it_printed(tmp_path: Path):
    word, pids = f"w{random.randrange(10**9)}", tmp_path / "pids"
    with pytest.raises(AssertionError) as failed:
        run_bounded([sys.executable, "-c", HUNG, word, str(pids)], timeout_s=10,
                    capture_output=True, text=True)
    started = _started(pids, 2)
    assert _gone(started), [p for p in started if running(p)]
    said = str(failed.value)
    assert "still running after" in said and word in said.split("stdout")[1] and f"on stderr: {word}" in said


def test_a_popen_past_its_deadline_is_killed_with_its_tree(tmp_path: Path):
    word, pids = f"w{random.randrange(10**9)}", tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", HUNG, word, str(pids)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        with pytest.raises(AssertionError) as failed:
            communicate_bounded(proc, 10)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            wait_bounded(proc, 30)
    started = _started(pids, 2)
    assert _gone(started), [p for p in started if running(p)]
    assert f"on stderr: {word}" in str(failed.value)


def test_a_tools_hung_child_is_killed_with_its_tree_and_raises_timeout_expired(tmp_path: Path):
    # a tool's `subprocess.run(..., timeout=T)` killed only the launcher at T and left its ranks running
    word, pids = f"w{random.randrange(10**9)}", tmp_path / "pids"
    with pytest.raises(subprocess.TimeoutExpired) as expired:  # what the tools catch, as before
        run_tree([sys.executable, "-c", HUNG, word, str(pids)], timeout_s=10, capture_output=True, text=True)
    started = _started(pids, 2)
    assert _gone(started), [p for p in started if running(p)]
    assert (expired.value.timeout, expired.value.output, expired.value.stderr) == (10, f"{word}\n",
                                                                                   f"on stderr: {word}\n")
    said = str(expired.value)
    assert "killed with every process below it" in said and f"on stderr: {word}" in said, said


def test_a_popen_waited_past_its_deadline_is_killed_with_its_tree(tmp_path: Path):
    word, pids = f"w{random.randrange(10**9)}", tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", HUNG, word, str(pids)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    try:
        with pytest.raises(AssertionError, match="still running after 10 s"):
            wait_bounded(proc, 10)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            wait_bounded(proc, 30)
    started = _started(pids, 2)
    assert _gone(started), [p for p in started if running(p)]
    code = random.randrange(1, 100)
    assert wait_bounded(subprocess.Popen([sys.executable, "-c", f"raise SystemExit({code})"]), 120) == code


def test_a_child_within_its_deadline_is_subprocess_run(tmp_path: Path):
    code = random.randrange(1, 100)
    done = run_bounded([sys.executable, "-c", f"import sys; print(sys.stdin.read()[::-1]); sys.exit({code})"],
                       timeout_s=120, capture_output=True, text=True, input="abc")
    assert (done.returncode, done.stdout) == (code, "cba\n")
    with pytest.raises(subprocess.CalledProcessError):
        run_bounded([sys.executable, "-c", f"raise SystemExit({code})"], timeout_s=120, check=True)
    done = run_tree([sys.executable, "-c", "import sys; print(sys.stdin.read()[::-1])"], timeout_s=120,
                    capture_output=True, text=True, input="xyz")
    assert (done.returncode, done.stdout) == (0, "zyx\n")
    with pytest.raises(subprocess.CalledProcessError) as failed:
        run_tree([sys.executable, "-c", f"raise SystemExit({code})"], timeout_s=120, check=True)
    assert failed.value.returncode == code
    done = run_flowrec("--help", cwd=tmp_path, root=Path(__file__).resolve().parents[2], timeout_s=120)
    assert done.returncode == 0 and "train" in done.stdout, done.stderr[-3000:]


def test_a_line_that_never_comes_kills_the_tree(tmp_path: Path):
    word, pids = f"w{random.randrange(10**9)}", tmp_path / "pids"
    proc = subprocess.Popen([sys.executable, "-c", HUNG, word, str(pids)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        assert readline_bounded(proc, proc.stdout, 120) == f"{word}\n"
        with pytest.raises(AssertionError, match="no line within"):
            readline_bounded(proc, proc.stdout, 5)  # it says nothing more and sleeps on
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
        wait_bounded(proc, 30)
        proc.stdout.close()
        proc.stderr.close()
    started = _started(pids, 2)
    assert _gone(started), [p for p in started if running(p)]


def test_a_call_that_never_returns_fails_within_its_deadline():
    never, value = threading.Event(), random.randrange(10**9)
    with pytest.raises(AssertionError, match="did not return within"):
        call_within(2, never.wait)  # a wait without a timeout of its own, blocked for good
    never.set()
    assert call_within(120, lambda: value) == value

    def failing() -> None:
        raise OSError(28, f"No space left on device {value}")

    with pytest.raises(OSError, match=str(value)):  # its exception, raised to the caller
        call_within(120, failing)
