"""Local processes for collectives: a free port and W ranks of a module started, waited for and
reaped under one timeout (`flowrec doctor`'s collective check, `flowrec calibrate --nproc`).

Example:
    >>> outputs = run_local_ranks("flowrec.measure.doctor", "gloo", 2, free_port(), 30)  # doctest: +SKIP
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_local_ranks(module: str, backend: str, world: int, port: int, timeout_s: float,
                    ) -> list[tuple[int, str, str]]:
    """Run `python -m module BACKEND RANK WORLD PORT` as `world` local processes (rendezvous on
    `port`); (exit code, stdout, stderr) of each, stripped. Every process is killed and reaped
    when they do not all finish within `timeout_s` (then `subprocess.TimeoutExpired`)."""
    procs = [subprocess.Popen([sys.executable, "-m", module, backend, str(rank), str(world), str(port)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(world)]
    outputs = []
    deadline = time.monotonic() + timeout_s
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=max(deadline - time.monotonic(), 1))
            outputs.append((proc.returncode, out.strip(), err.strip()))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs
