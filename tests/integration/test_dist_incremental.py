"""`flowrec train --nproc 2 --checkpoint-full-every K` on gloo: incremental checkpoints on ranks.

Each rank writes a delta shard of the rows it owns that the steps touched, rank 0 the delta
manifest. A run interrupted on base + deltas continues on 2 ranks or on 1 to the parameters of an
uninterrupted run; a kill before a delta's manifest is in place leaves the previous checkpoint;
a damaged delta shard is one line naming it; the delta shards hold only the touched rows.

The spec is `flowrec.testing.specs.TINY` with larger tables (so a batch touches few of the rows),
its plans edited so the large group is row-wise sharded and the small one replicated.
"""
from __future__ import annotations

import copy
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
import yaml

from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.runtime.checkpoint.format import read_torch_file
from flowrec.testing.ranks import assert_same_model, run_flowrec
from flowrec.testing.specs import TINY

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess
ROWS = 700  # training rows: 7 global batches of 101 (the last one 94)
INCREMENTAL = ("--checkpoint-every", "2", "--checkpoint-full-every", "3")  # full @2, deltas @4 and @5 (the end)


def flowrec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_flowrec(*args, cwd=cwd, root=ROOT, timeout_s=TIMEOUT_S)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Spec, plans for 1 and 2 ranks, data, uninterrupted reference runs on 1 and 2 ranks, and a
    2-rank run stopped at step 5 on a full checkpoint (step 2) and two deltas (steps 4 and 5)."""
    root = tmp_path_factory.mktemp("dist_incremental")
    doc = copy.deepcopy(TINY)
    doc["name"] = "tiny_dist_incremental"
    doc["training"] = {"batch_size": 101, "epochs": 1, "seed": 7}
    doc["heads"][1]["label"] = "label2"
    doc["tables"][0]["vocab"] = 3000
    next(f for f in doc["features"] if f["name"] == "b")["hash_buckets"] = 2000
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    for world in (1, 2):
        ok(flowrec("plan", "spec.yaml", "--world-size", str(world), "--json", f"p{world}.json", cwd=root))
        plan = json.loads((root / f"p{world}.json").read_text())
        assert len(plan["groups"]) == 2
        for g in plan["groups"]:  # the large dim-4 group row-wise, the 7-row dim-1 group replicated
            sharding = "row_wise" if g["rows"] > 1000 else "replicated"
            g["sharding"], g["shards"] = (sharding, world if sharding == "row_wise" else 1)
        (root / f"p{world}.json").write_text(json.dumps(plan))
    ok(flowrec("data", "synth", "spec.yaml", "--rows", str(ROWS), "--rows-per-file", "150", "--out", "d",
               "--seed", "3", "-q", cwd=root))
    ok(train(root, "ref", "--plan", "p1.json"))
    ok(train(root, "ref2", "--plan", "p2.json", "--nproc", "2"))
    ok(train(root, "inc", "--plan", "p2.json", "--nproc", "2", "--max-steps", "5", *INCREMENTAL))
    return root


def train(work: Path, out: str, *extra: str) -> subprocess.CompletedProcess:
    return flowrec("train", "spec.yaml", "--data", "d", "--out", out, "-q", "--eval-every", "0", *extra, cwd=work)


def resume(work: Path, run: str, *extra: str) -> subprocess.CompletedProcess:
    return flowrec("train", "spec.yaml", "--resume", run, "--max-steps", "1000", "-q", *extra, cwd=work)


def copy_run(work: Path, name: str) -> str:
    shutil.copytree(work / "inc", work / name)
    (work / name / ".flowrec.lock").unlink(missing_ok=True)
    return name


def shard_names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoint.shards").iterdir())


def test_a_run_on_base_and_deltas_continues_on_two_ranks_and_on_one(work):
    run = work / "inc"
    assert sorted(p.name for p in run.glob("checkpoint.delta-*.pt")) == ["checkpoint.delta-000001.pt",
                                                                        "checkpoint.delta-000002.pt"]
    assert shard_names(run) == ["step000000002-rank0-of2.pt", "step000000002-rank1-of2.pt",
                                "step000000004-rank0-of2-delta000001.pt", "step000000004-rank1-of2-delta000001.pt",
                                "step000000005-rank0-of2-delta000002.pt", "step000000005-rank1-of2-delta000002.pt"]
    assert load_checkpoint(run)["position"]["step"] == 5
    on_two, on_one = copy_run(work, "inc_on2"), copy_run(work, "inc_on1")
    ok(resume(work, on_two, "--nproc", "2"))  # --checkpoint-full-every 3 as recorded
    assert_same_model(work / "ref", work / on_two)
    assert_same_model(work / "ref2", work / on_two, tol=0.0)  # bitwise: an uninterrupted 2-rank run
    # a resumed process starts with a full checkpoint (step 6), then a delta (the end, step 7);
    # the files of the older chain are gone
    assert shard_names(work / on_two) == [
        "step000000006-rank0-of2.pt", "step000000006-rank1-of2.pt",
        "step000000007-rank0-of2-delta000001.pt", "step000000007-rank1-of2-delta000001.pt"]
    assert [p.name for p in (work / on_two).glob("checkpoint.delta-*.pt")] == ["checkpoint.delta-000001.pt"]
    ok(resume(work, on_one, "--nproc", "1"))
    assert_same_model(work / "ref", work / on_one)
    assert not (work / on_one / "checkpoint.shards").exists()  # one process's checkpoints replaced them (45f2df6)


def test_a_kill_before_the_delta_manifest_leaves_the_previous_checkpoint(work):
    """Rank 0 renames the manifest into place after every delta shard is written: without it the
    run is at the previous delta (step 4), its unnamed delta shards are ignored, and a resume ends
    like the uninterrupted run, removing them with the older files after its first full checkpoint."""
    name = copy_run(work, "inc_killed")
    (work / name / "checkpoint.delta-000002.pt").unlink()
    assert load_checkpoint(work / name)["position"]["step"] == 4
    ok(resume(work, name, "--nproc", "2"))
    assert_same_model(work / "ref2", work / name, tol=0.0)
    assert all(n.startswith(("step000000006-", "step000000007-")) for n in shard_names(work / name))


def test_a_damaged_delta_shard_is_one_line_naming_it(work):
    name = copy_run(work, "inc_damaged")
    target = work / name / "checkpoint.shards" / "step000000004-rank1-of2-delta000001.pt"
    doc = read_torch_file(target)
    group = next(iter(doc["groups"].values()))
    data = bytearray(target.read_bytes())
    at = data.index(group["weight"][0].numpy().tobytes())
    data[at] ^= 0x01
    target.write_bytes(bytes(data))
    for args in (("eval", name, "--data", "d"), ("train", "spec.yaml", "--resume", name, "-q")):
        done = flowrec(*args, cwd=work)
        assert done.returncode == 2, done.stderr[-2000:]
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(target.name) in errors[0] and "does not match its digest" in errors[0]
        assert "Traceback" not in done.stderr


def test_delta_shards_hold_only_the_touched_rows(work):
    """Each delta shard holds the rows its rank owns that changed since the previous checkpoint
    (every changed row, and few of the table's), so it is much smaller than a full shard."""
    run = work / "inc"
    full = sorted((run / "checkpoint.shards").glob("step000000002-rank*-of2.pt"))
    delta = sorted((run / "checkpoint.shards").glob("step000000004-rank*-of2-delta000001.pt"))
    base = copy_run(work, "inc_base_only")
    for path in (work / base).glob("checkpoint.delta-*.pt"):
        path.unlink()
    before, after = load_checkpoint(work / base)["model"], _state_after_first_delta(work)
    for rank, (f, d) in enumerate(zip(full, delta)):
        assert d.stat().st_size * 4 < f.stat().st_size, (d.stat().st_size, f.stat().st_size)
        for group, part in read_torch_file(d)["groups"].items():
            key = f"embeddings.{group}.weight"
            changed = (before[key] != after[key]).any(dim=1).nonzero().flatten()
            mine = changed[changed % 2 == rank]
            assert bool((part["rows"] % 2 == rank).all()), group  # only rows this rank owns
            assert bool(torch.isin(mine, part["rows"]).all()), group  # every row of it that changed
            assert 0 < mine.numel() and part["rows"].numel() < before[key].shape[0] // 4


def _state_after_first_delta(work: Path) -> dict[str, torch.Tensor]:
    name = copy_run(work, "inc_first_delta")
    (work / name / "checkpoint.delta-000002.pt").unlink()
    return load_checkpoint(work / name)["model"]
