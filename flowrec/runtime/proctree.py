"""A process and every process below it (Linux's /proc; elsewhere none are found below it): the
walk and the kill that `flowrec.train(..., nproc=N)` stops a launch with (`flowrec.runs.launch`) and
that the tests' deadlines use (`flowrec.testing.processes`). The ranks of torch's launcher run in
sessions of their own, out of reach of a kill of the launcher or of its process group.

Example (a child with a grandchild, found and killed together):
    >>> import os, subprocess, sys
    >>> child = subprocess.Popen([sys.executable, "-c",
    ...     "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', "
    ...     "'import time; time.sleep(60)']); time.sleep(60)"])
    >>> import time; deadline = time.monotonic() + 60
    >>> while not descendants(child.pid) and time.monotonic() < deadline: time.sleep(0.05)
    >>> below = descendants(child.pid)
    >>> os.getpid() in descendants(os.getppid()), child.pid in descendants(os.getpid()), len(below)
    (True, True, 1)
    >>> kill_tree(child.pid) == [child.pid, *below], child.wait(timeout=30)
    (True, -9)
"""
from __future__ import annotations

import os
import signal
from pathlib import Path


def descendants(pid: int) -> list[int]:
    """Process ids below `pid` at any depth, parents before children."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            parent = int(stat.read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(parent, []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(0), [])
        found += kids
        todo += kids
    return found


def kill_tree(pid: int) -> list[int]:
    """SIGKILL `pid` and every process below it; the ids killed, `pid` first. Each is stopped first
    (SIGSTOP), until a look finds no new one, so that none starts another (torch's launcher
    restarting ranks) or is orphaned (and so lost to the walk) before the kill."""
    seen: list[int] = []
    for _ in range(10):  # a process started between looks is found by the next
        new = [p for p in [pid, *descendants(pid)] if p not in seen]
        if not new:
            break
        for p in new:
            send(p, signal.SIGSTOP)
        seen += new
    for p in seen:
        send(p, signal.SIGKILL)
    return seen


def running(pid: int) -> bool:
    """Whether `pid` runs (a zombie waiting for its parent's wait counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def send(pid: int, sig: int) -> None:
    """Signal `pid`; nothing where it is gone already."""
    try:
        os.kill(pid, sig)
    except OSError:
        pass
