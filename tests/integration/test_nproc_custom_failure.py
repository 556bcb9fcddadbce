"""A custom module that raises on one rank of `flowrec train --nproc 2` ends the run as one process
ends it: status 2, the module's line, and the run folder of a run that wrote no checkpoint removed
(it was status 4 with run.json, metrics.jsonl, ... left behind and no checkpoint)."""
from __future__ import annotations

import random
from pathlib import Path


from flowrec.testing.ranks import flaky_spec, run_flowrec

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess: a rank left waiting for the other fails the test, never hangs it


def test_a_custom_module_raising_on_one_rank_ends_the_run_as_one_process_does(tmp_path: Path) -> None:
    flaky_spec(tmp_path, random.randrange(1 << 20))
    rows = str(random.randrange(300, 500))
    one = run_flowrec("train", "s.yaml", "--rows", rows, "-q", "--device", "cpu", "--out", "one", cwd=tmp_path,
                      root=ROOT, timeout_s=TIMEOUT_S)
    assert one.returncode == 2 and "raised KeyError" in one.stderr, one.stderr
    assert not (tmp_path / "one").exists()  # what one process leaves: nothing
    ranks = run_flowrec("train", "s.yaml", "--rows", rows, "-q", "--device", "cpu", "--nproc", "2", "--out", "run",
                        cwd=tmp_path, root=ROOT, timeout_s=TIMEOUT_S)
    assert ranks.returncode == 2, ranks.stderr
    named = [line for line in ranks.stderr.splitlines() if line.startswith("error: rank 1: ")]
    assert len(named) == 1 and "flaky.py:Flaky) raised KeyError" in named[0], ranks.stderr
    assert "Traceback" not in ranks.stderr and not (tmp_path / "run").exists(), ranks.stderr
    # the launcher's closing line names rank 1, whose own error it was, with its line (rank 0, which
    # lost it in the same second with the same status 2, was named first now and then)
    last = ranks.stderr.strip().splitlines()[-1]
    assert last == f"error: training failed: rank(s) 0, 1 exited; the first, rank 1, with status 2: {named[0][15:]}", last
    # rank 0's line that it follows, unless torch's launcher stopped it first (it stops the other ranks
    # once one exits); the launcher's last line above names rank 1 and its line either way
    assert [line for line in ranks.stderr.splitlines() if line.startswith("error: rank 0: ")] in ([
        "error: rank 0: stopped at step 3: rank 1 stopped first (its line says why); no checkpoint was written"], [])
