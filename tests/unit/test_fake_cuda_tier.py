"""The fake-CUDA tier: every spec and placement, a step's parts on fake CUDA tensors in a
subprocess (tests/unit/fake_cuda_harness.py); no tensor on the wrong device, no unaccounted host
sync. Planted mistakes are caught and named by file and line."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
HARNESS = Path(__file__).with_name("fake_cuda_harness.py")
SPECS = sorted((REPO / "specs").glob("*.yaml"))
PLACEMENTS = ("device", "host", "static_hot", "lookahead")
TIMEOUT_S = 600  # the whole tier, all specs (about a minute on a 2-core box); at most 600 s a child
MANAGED = {s.name for s in SPECS if "managed:" in s.read_text()}  # specs with managed tables
REFUSED = "cannot follow their changing rows"  # a managed table's group is never static_hot


def run_harness(specs: list[Path], *extra: str) -> list[dict]:
    proc = run_bounded([sys.executable, str(HARNESS), *map(str, specs), *extra], capture_output=True,
                       text=True, timeout_s=TIMEOUT_S, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


@pytest.fixture(scope="module")
def tier() -> dict[tuple[str, str], dict]:
    return {(r["spec"], r["placement"]): r for r in run_harness(SPECS)}


def test_tier_covers_every_spec_and_placement(tier):
    assert set(tier) == {(s.name, p) for s in SPECS for p in PLACEMENTS}
    for name in {s.name for s in SPECS}:  # the caches did exchange rows (their copies are accounted)
        assert tier[(name, "lookahead")]["accounted_d2h"].get("flowrec/runtime/caches/scratchpad.py:_write_back")
        if name not in MANAGED:
            assert tier[(name, "static_hot")]["accounted_d2h"].get("flowrec/runtime/caches/static_hot.py:update")
    assert MANAGED, "no spec in specs/ has managed tables: the tier no longer checks their resets"
    for name in MANAGED:  # eviction passes freed rows, and the resets ran on the fake device
        assert all(tier[(name, p)]["reset_rows"] > 0 for p in ("device", "host", "lookahead"))


@pytest.mark.parametrize("placement", PLACEMENTS)
@pytest.mark.parametrize("spec", [s.name for s in SPECS])
def test_step_on_fake_cuda_is_clean(tier, spec, placement):
    findings = tier[(spec, placement)]["findings"]
    if spec in MANAGED and placement == "static_hot":  # refused in one line, before anything runs
        assert [f["kind"] for f in findings] == ["error"] and REFUSED in findings[0]["message"], findings
        return
    assert findings == [], "\n".join(f"{f['where']} ({f['function']}): {f['kind']}: {f['message']}"
                                     for f in findings)


def _plant(tmp_path: Path, body: str) -> tuple[Path, int]:
    path = tmp_path / "plant.py"
    path.write_text(body)
    marked = next(i for i, line in enumerate(body.splitlines(), 1) if "# planted" in line)
    return path, marked


MISPLACED = '''
import torch
from flowrec.runtime import lowering

_dense_forward = lowering.LoweredModel.dense_forward


def dense_forward(self, dense, emb, masks):
    logits = _dense_forward(self, dense, emb, masks)
    return logits + torch.zeros(logits.shape[1])  # planted: a host tensor in the dense stage


lowering.LoweredModel.dense_forward = dense_forward
'''

SYNCS = '''
from operators import sparse_optim

_row_grads = sparse_optim.casted_row_grads


def casted_row_grads(grad_out, casting):
    grads = _row_grads(grad_out, casting)
    grads.cpu()
    if float(grads.abs().max()) > 1e9:  # planted: a value read on the host
        raise ValueError("huge gradient")
    return grads


sparse_optim.casted_row_grads = casted_row_grads
'''


def test_a_planted_misplaced_tensor_is_named_by_file_and_line(tmp_path):
    plant, line = _plant(tmp_path, MISPLACED)
    (result,) = run_harness([REPO / "specs" / "movielens.yaml"], "--placements", "device", "--plant", str(plant))
    (finding,) = result["findings"]
    assert finding["kind"] == "device mismatch"
    assert finding["where"] == f"{plant}:{line}" and finding["function"] == "dense_forward"
    assert "cuda:0 and cpu" in finding["message"]


def test_planted_host_syncs_are_named_by_file_and_line(tmp_path):
    plant, line = _plant(tmp_path, SYNCS)
    (result,) = run_harness([REPO / "specs" / "movielens.yaml"], "--placements", "device", "--plant", str(plant))
    copy, read = result["findings"]
    assert copy["kind"] == "host sync" and copy["where"] == f"{plant}:{line - 1}" and ".cpu()" in copy["message"]
    assert read["kind"] == "host sync" and read["where"] == f"{plant}:{line}" and "__float__" in read["message"]
