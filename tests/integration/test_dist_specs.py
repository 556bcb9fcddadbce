"""Every spec in specs/ (tables shrunk, an odd global batch) trains the same on 2 ranks as in one
process: float64, one row-wise and one replicated group where a spec has two, 6 steps of its own
optimizers through `train_step` with DDP and the sharded exchanges (tests/dist_specs_worker.py)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import communicate_bounded, kill_tree, wait_bounded

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 400
COLLECTIVE_TIMEOUT_S = 60


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("dist_specs")
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist_specs_worker.py"), str(out),
                                       str(COLLECTIVE_TIMEOUT_S)], env=env, stderr=subprocess.PIPE, text=True))
    try:
        errors = [communicate_bounded(p, TIMEOUT_S)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                wait_bounded(p, 30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


# A spec with managed tables needs its maps in the data stage (replicas or owner ranks): whole runs
# on 2 ranks against one process are in test_dist_managed.py and test_dist_managed_owner.py.
SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.yaml") if "managed:" not in p.read_text())


@pytest.mark.parametrize("spec", SPECS)
def test_two_ranks_equal_one_process(reports, spec):
    for rank, report in enumerate(reports):
        got = report[spec]
        assert got["keys"] and got["steps"] == 6, (rank, got)
        assert got["first_embed"] == 0.0, (rank, got)  # the sharded exchange: the same rows, bitwise
        assert got["first_logits"] == 0.0, (rank, got)  # the same parameters and rows: the same logits
        assert got["first_logits_rel"] < 1e-14, (rank, got)  # B / W rows against B: BLAS rounding at most
        assert got["loss_rel"] < 1e-13, (rank, got)
        assert got["param_rel"] < 1e-11, (rank, got)


def test_both_shardings_are_covered(reports):
    kinds = {k for report in reports[:1] for got in report.values() for k in got["sharding"]}
    assert kinds == {"row_wise", "replicated"}
