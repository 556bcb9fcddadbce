"""Sharded and replicated packed embeddings over gloo: W ranks equal one process; a dead rank fails.

Each test starts W rank processes of tests/dist_worker.py (a free port chosen at run time, a
timeout on every process, every process killed at the end) and checks what they report.
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flowrec.runtime.distributed import local_row_count
from flowrec.testing.processes import kill_tree, wait_bounded

REPO = Path(__file__).resolve().parents[2]
WORKER = REPO / "tests" / "dist_worker.py"
PACKED_ROWS = 23  # tests/dist_worker.py TABLES
LAUNCH_TIMEOUT_S = 240
TOLERANCE = {"fp64": 1e-12, "fp32": 1e-5}
ALL_CASES = ("rw_sum_sgd_f64", "rw_mean_adagrad_f64", "rw_seq_rowwise_f64", "rw_mixed_adam_dim1_f64",
             "rw_mixed_adam_f32", "rw_mixed_rowwise_f32", "rep_mixed_adam_f64", "rep_sum_sgd_f32",
             "rw_interleave_f64", "rw_one_sample_adam_f64")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, world: int, out: Path, timeout_s: float, cases: tuple[str, ...] = ()
           ) -> tuple[list[int], list[str]]:
    """Run W ranks to the end (or kill them at `LAUNCH_TIMEOUT_S`); their exit codes and logs."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    port = free_port()
    procs = [subprocess.Popen([sys.executable, str(WORKER), mode, str(r), str(world), str(port), str(out),
                               str(timeout_s), *cases], cwd=REPO, env=env,
                              stdout=(out / f"log{r}").open("wb"), stderr=subprocess.STDOUT)
             for r in range(world)]
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    try:
        codes = [wait_bounded(p, max(1.0, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                wait_bounded(p, 30)
    return codes, [(out / f"log{r}").read_text(errors="replace")[-3000:] for r in range(world)]


def check_equal(world: int, out: Path, cases: tuple[str, ...]) -> None:
    codes, logs = launch("equal", world, out, 60, cases)
    assert codes == [0] * world, logs
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    for case in cases:
        per_rank = [rep[case] for rep in reports]
        assert sum(r["ids_looked_up"] for r in per_rank) == per_rank[0]["global_ids"], case
        # rows went back for every id that went out: totals over the ranks match
        assert sum(r["rows_bytes_sent"] for r in per_rank) == sum(r["grad_bytes_sent"] for r in per_rank), case
        for rank, r in enumerate(per_rank):
            tol = TOLERANCE[r["dtype"]]
            rows = local_row_count(PACKED_ROWS, world, rank) if case.startswith("rw") else PACKED_ROWS
            assert r["local_rows"] == rows, (case, rank)
            assert r["initial_bitwise"] and r["forward_bitwise"], (case, rank, r)
            assert r["bytes_ok"], (case, rank, r)
            assert r.get("interleave_bitwise", True), (case, rank, r)  # interleaved == one group after another
            assert r["weight_moved"] > 0.1, (case, r)  # the table really trained
            assert r["weight_max_diff"] <= tol, (case, rank, r)
            assert r["state_max_diff"] <= tol, (case, rank, r)
            assert r["train_forward_max_diff"] <= 10 * tol, (case, rank, r)


def test_two_ranks_equal_one_process(tmp_path):
    """Every optimizer, sum / mean / sequence bags, dim 1, fp64 and fp32, row-wise and replicated,
    two groups with their exchanges interleaved, a global batch of one sample (a rank with none);
    23 packed rows and a global batch of 11: uneven rows and uneven slices."""
    check_equal(2, tmp_path, ALL_CASES)


@pytest.mark.slow
def test_three_ranks_equal_one_process(tmp_path):
    """The same cases on 3 ranks (3 processes on the 2-core CI machine: slow)."""
    check_equal(3, tmp_path, ALL_CASES)


@pytest.mark.parametrize("mode", ["dead", "hung"])
def test_failed_rank_fails_the_others_within_the_timeout(tmp_path, mode):
    """Rank 1 exits (dead) or stops taking part (hung) after a step; rank 0's next step raises
    instead of hanging."""
    timeout_s = 5
    codes, logs = launch(mode, 2, tmp_path, timeout_s)
    assert codes == [0, 0], logs
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["error"] is not None, report
    assert report["elapsed_s"] < timeout_s + 20, report  # failed by the group's timeout at the latest
