"""A parameter that an update made non-finite stops `flowrec train --nproc 2` as it stops one
process (218000f, 5536bc4): every rank at the same step, with the same line naming the parameter."""
from __future__ import annotations

import json
from pathlib import Path

from flowrec.testing.ranks import run_flowrec
from flowrec.testing.specs import OVERFLOW_SPEC

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess: a rank left waiting for the other fails the test, never hangs it


def test_ranks_stop_together_at_a_non_finite_parameter_under_skip_batch(tmp_path: Path) -> None:
    """An update that overflowed an fp16 table (lr 1000) under --nproc 2 --nan-policy skip-batch:
    each rank decided alone (one process only stopped), so the ranks skipped every later batch,
    evaluated on NaN scores and failed at the final checkpoint; now both stop at that step, each
    with the same line naming the parameter, as one process does."""
    (tmp_path / "s.yaml").write_text(OVERFLOW_SPEC)
    result = run_flowrec("train", "s.yaml", "--rows", "400", "-q", "--max-steps", "12", "--nan-policy", "skip-batch",
                         "--eval-every", "6", "--nproc", "2", "--out", "run", cwd=tmp_path, root=ROOT,
                         timeout_s=TIMEOUT_S)
    assert result.returncode == 2, result.stderr
    lines = {line.split(": ", 2)[1]: line.split(": ", 2)[2] for line in result.stderr.splitlines()
             if line.startswith("error: rank ")}
    assert sorted(lines) == ["rank 0", "rank 1"], result.stderr
    assert lines["rank 0"] == lines["rank 1"], result.stderr  # the same step, head and parameter
    assert lines["rank 0"].startswith("non-finite loss (") and ": parameter embeddings." in lines["rank 0"]
    assert "skipping batches cannot go on" in lines["rank 0"], result.stderr
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert records[-1]["event"] == "stopped" and not [r for r in records if r["event"] == "eval"]
    assert not [r for r in records if r.get("skipped")]
