"""Bounded waits on the child processes of tests and tools: a child still running at its deadline
is killed with every process below it (the ranks of `flowrec train --nproc N` run under torch's
launcher, in a session of its own, out of reach of a kill of the child or of its process group).
A test's wait (`run_bounded`, `communicate_bounded`, `wait_bounded`) then fails, with the tail of
what the child printed where the wait read it, instead of hanging CI or failing with a bare
`TimeoutExpired` and leaving the child running; a tool's (`run_tree`, `communicate_tree`:
`subprocess.run` and `Popen.communicate` with their arguments) raises `TreeTimeout`, a
`subprocess.TimeoutExpired` that says the tree was killed, with that tail, so a tool that catches
TimeoutExpired catches it as before. A blocking call of the test's own
process (a background writer's `wait()`, which takes no timeout) gets a deadline from `call_within`.

Example:
    >>> import sys
    >>> done = run_bounded([sys.executable, "-c", "print('hi')"], timeout_s=120, capture_output=True, text=True)
    >>> done.stdout
    'hi\\n'
"""
from __future__ import annotations

import shlex
import subprocess
import threading
from typing import Any, Callable, Sequence

from flowrec.runtime.proctree import descendants, kill_tree, running  # the walk and the kill, shared with flowrec.runs

__all__ = ["TreeTimeout", "call_within", "communicate_bounded", "communicate_tree", "descendants", "kill_tree",
           "readline_bounded", "run_bounded", "run_tree", "running", "wait_bounded"]

TAIL_CHARS = 3000  # of each of stdout and stderr, in a timed-out child's failure
REAP_S = 30  # after the kill: the pipes close once every process holding them is gone


class TreeTimeout(subprocess.TimeoutExpired):
    """A child still running at its deadline, killed with every process below it: what it printed
    until then in `output` / `stderr` (where captured), and its tail in the message."""

    def __str__(self) -> str:
        return (f"{_command(self.cmd)}: still running after {self.timeout:g} s; killed with every process below "
                f"it{_tail('stdout', self.output)}{_tail('stderr', self.stderr)}")


def communicate_tree(proc: subprocess.Popen, timeout_s: float, input: Any = None) -> tuple[Any, Any]:
    """`proc.communicate(input, timeout=timeout_s)`, whose deadline kills `proc` and everything below
    it, then raises `TreeTimeout` (`Popen.communicate`'s own timeout kills nothing)."""
    try:
        return proc.communicate(input, timeout=timeout_s)
    except subprocess.TimeoutExpired as expired:
        kill_tree(proc.pid)
        try:
            out, err = proc.communicate(timeout=REAP_S)
        except subprocess.TimeoutExpired as again:  # a process that escaped the walk holds a pipe
            out, err = again.output, again.stderr
        if out is None and err is None:
            out, err = expired.output, expired.stderr
        raise TreeTimeout(proc.args, timeout_s, out, err) from None


def communicate_bounded(proc: subprocess.Popen, timeout_s: float, input: Any = None) -> tuple[Any, Any]:
    """`proc.communicate(input)` within `timeout_s` seconds; past it `proc` and everything below it
    are killed and an AssertionError says so, with the tail of what it printed (where captured)."""
    try:
        return communicate_tree(proc, timeout_s, input)
    except TreeTimeout as expired:
        raise AssertionError(str(expired)) from None


def wait_bounded(proc: subprocess.Popen, timeout_s: float) -> int:
    """`proc.wait(timeout=timeout_s)`, its exit status (its pipes left to whoever reads them); past
    the deadline `proc` and everything below it are killed and an AssertionError says so. A killed
    child's reap too: one that outlives a kill by its deadline is killed with its tree again."""
    try:
        return proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        try:
            proc.wait(timeout=REAP_S)
        except subprocess.TimeoutExpired:  # stopped in the kernel: the failure says so all the same
            pass
        raise AssertionError(f"{_command(proc.args)}: still running after {timeout_s:g} s; killed with every "
                             f"process below it") from None


def readline_bounded(proc: subprocess.Popen, stream: Any, timeout_s: float) -> Any:
    """One line of `stream` (a pipe of `proc`; at its end: empty) within `timeout_s` seconds; past it
    `proc` and everything below it are killed and an AssertionError says so (a child that never
    said its line, nor exited, hung the test at its `readline`)."""
    got: list[Any] = []
    reader = threading.Thread(target=lambda: got.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout_s)
    if not got:
        if proc.poll() is None:
            kill_tree(proc.pid)
        raise AssertionError(f"{_command(proc.args)}: no line within {timeout_s:g} s; killed with every process "
                             f"below it")
    return got[0]


def run_tree(argv: Sequence[Any], *, timeout_s: float, input: Any = None, capture_output: bool = False,
             check: bool = False, **popen: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, ..., timeout=timeout_s)` whose deadline kills the whole tree, then
    raises `TreeTimeout` (`communicate_tree`); `popen`: Popen's own arguments (cwd, env, text,
    stdout, stderr, ...). Interrupted (Ctrl-C), it kills the tree too: no child left behind."""
    if capture_output:
        popen.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    if input is not None:
        popen["stdin"] = subprocess.PIPE
    with subprocess.Popen(argv, **popen) as proc:
        try:
            out, err = communicate_tree(proc, timeout_s, input)
        except KeyboardInterrupt:
            if proc.poll() is None:
                kill_tree(proc.pid)
            raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


def run_bounded(argv: Sequence[Any], *, timeout_s: float, **run: Any) -> subprocess.CompletedProcess:
    """`subprocess.run(argv, ...)` with a deadline that kills the whole tree, past which the test
    fails with an AssertionError and the tail of what the child printed (`run_tree`'s arguments)."""
    try:
        return run_tree(argv, timeout_s=timeout_s, **run)
    except TreeTimeout as expired:
        raise AssertionError(str(expired)) from None


def _command(args: Any) -> str:
    words = [str(a) for a in args] if isinstance(args, (list, tuple)) else [str(args)]
    text = shlex.join(words)
    return text if len(text) <= 300 else text[:300] + " ..."


def _tail(name: str, text: Any) -> str:
    if not text:
        return ""
    if isinstance(text, bytes):
        text = text.decode(errors="replace")
    return f"\n--- its {name} (last {TAIL_CHARS} characters) ---\n{text[-TAIL_CHARS:]}"


def call_within(timeout_s: float, call: Callable[[], Any]) -> Any:
    """`call()` on a thread of its own: its result, or its exception raised here, within `timeout_s`
    seconds; past it an AssertionError (the call is left blocked on its daemon thread), so that a
    wait that never returns fails the test instead of hanging the run."""
    outcome: list[tuple[bool, Any]] = []

    def run() -> None:
        try:
            outcome.append((True, call()))
        except BaseException as exc:  # handed to the caller
            outcome.append((False, exc))

    thread = threading.Thread(target=run, name="call_within", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if not outcome:
        raise AssertionError(f"{getattr(call, '__qualname__', call)} did not return within {timeout_s:g} s")
    returned, value = outcome[0]
    if not returned:
        raise value
    return value
