"""The ranks' start (`flowrec.runtime.distributed.world.join_world`) over gloo, 2 processes: ranks
that start seconds apart join although the gap is longer than `--dist-timeout` (the start waits
START_TIMEOUT_S at least), and a rank that dies after the start still fails the other within the
timeout; a rank that never starts fails the one that did with one line naming how many started.

Each test starts 2 processes of this file (`python test_dist_start.py MODE RANK PORT OUT TIMEOUT`,
a free port chosen at run time, a timeout on every process, every process killed at the end).
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

from flowrec.testing.processes import communicate_bounded, kill_tree, wait_bounded

REPO = Path(__file__).resolve().parents[2]
RUN_S = 300  # every process


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(mode: str, rank: int, port: int, out: Path, timeout_s: float) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "WORLD_SIZE": "2", "RANK": str(rank),
           "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, __file__, mode, str(rank), str(port), str(out), str(timeout_s)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    results = []
    try:
        for p in procs:
            _, err = communicate_bounded(p, RUN_S)
            results.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                wait_bounded(p, 30)
    return results


def _report(out: Path, rank: int) -> dict:
    return json.loads((out / f"rank{rank}.json").read_text())


def test_ranks_started_further_apart_than_the_timeout_join_and_a_later_death_fails_within_it(tmp_path):
    """Rank 1 starts 3 timeouts after rank 0: before, rank 0 failed 'could not join the other 1
    rank(s) within 2 s'; both join now, agree on an all-reduce, and rank 1's exit after it fails
    rank 0's next collective within the 2 s timeout (plus the machine's slack), not the start's."""
    port, timeout_s = _free_port(), 2.0
    first = _start("late", 0, port, tmp_path, timeout_s)
    time.sleep(3 * timeout_s)
    second = _start("late", 1, port, tmp_path, timeout_s)
    results = _finish([first, second])
    assert [code for code, _ in results] == [0, 0], results
    zero, one = _report(tmp_path, 0), _report(tmp_path, 1)
    assert zero["sum"] == one["sum"] == 3.0
    assert one["joined_s"] < zero["joined_s"]  # rank 0 waited for the late rank
    assert zero["joined_s"] > 2 * timeout_s, zero
    assert zero["failed"] and zero["failed_after_s"] < timeout_s + 45, zero


def test_a_rank_that_never_starts_fails_the_other_with_how_many_started(tmp_path):
    port = _free_port()
    (code, err), = _finish([_start("alone", 0, port, tmp_path, 1.0)])
    assert code == 0, err
    said = _report(tmp_path, 0)["error"]
    assert said.startswith("could not join the other 1 rank(s) within 4 s"), said
    assert "1 of 2 ranks started" in said, said


def main(argv: list[str]) -> int:
    mode, rank, _port, out, timeout_s = argv[:5]
    rank, timeout_s, out = int(rank), float(timeout_s), Path(out)
    import torch
    import torch.distributed as dist

    from flowrec.runtime.distributed import world as world_module

    torch.set_num_threads(1)
    began = time.monotonic()
    report: dict = {}
    if mode == "alone":
        world_module.START_TIMEOUT_S = 4.0  # the start's wait, shortened for the test
        try:
            world_module.join_world(2, rank, timeout_s, torch.device("cpu"))
            report["error"] = None
        except world_module.WorldError as exc:
            report["error"] = str(exc)
        (out / f"rank{rank}.json").write_text(json.dumps(report))
        return 0
    world = world_module.join_world(2, rank, timeout_s, torch.device("cpu"))
    report["joined_s"] = time.monotonic() - began
    value = torch.tensor([float(rank + 1)])
    dist.all_reduce(value)
    report["sum"] = float(value.item())
    if rank == 1:
        (out / "rank1.json").write_text(json.dumps(report))
        os._exit(0)  # gone without leaving the group: rank 0's next collective loses it
    time.sleep(0.5)
    lost_at = time.monotonic()
    try:
        for _ in range(100):
            dist.all_reduce(torch.ones(1))
        report["failed"] = False
    except RuntimeError:
        report["failed"] = True
    report["failed_after_s"] = time.monotonic() - lost_at
    (out / "rank0.json").write_text(json.dumps(report))
    del world
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
