"""Background checkpoints of `flowrec train` on 2 gloo ranks (`runtime.checkpoint.ranks`).

Each rank's writer thread streams its shard from a copy-on-write snapshot while training goes on;
the ranks commit on their checkpoint group and rank 0 names the shards. A fault-injection module
(tests/faults/sitecustomize.py, on PYTHONPATH here only) holds one rank's writer at one
checkpoint until the test releases it, so the tests can see training go past a checkpoint whose
write is not done, change rows the snapshot still has to write, and kill a rank in the middle of a
write. Every run ends, or resumes, to parameters bitwise equal to an uninterrupted 2-rank run.

The spec is `flowrec.testing.specs.TINY` with larger tables, its large group row-wise sharded and
the small one replicated (as in test_dist_incremental.py); 7 global steps.
"""
from __future__ import annotations

import copy
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.testing.processes import communicate_bounded, kill_tree, wait_bounded
from flowrec.testing.ranks import assert_same_model, run_flowrec, subprocess_env
from flowrec.testing.specs import TINY

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "tests" / "faults"
TIMEOUT_S = 300  # every subprocess
DIST_TIMEOUT_S = 60  # --dist-timeout of the ranks started here: a rank a loaded machine holds back is not lost
ROWS = 700  # training rows: 7 global batches of 101 (the last one 94)


def flowrec(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return run_flowrec(*args, cwd=cwd, root=ROOT, timeout_s=TIMEOUT_S)


def ok(done: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert done.returncode == 0, done.stderr[-3000:]
    return done


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    """Spec, a 2-rank plan (the large group row-wise), data, and an uninterrupted 2-rank run."""
    root = tmp_path_factory.mktemp("dist_ckpt_background")
    doc = copy.deepcopy(TINY)
    doc["name"] = "tiny_dist_background"
    doc["training"] = {"batch_size": 101, "epochs": 1, "seed": 7}
    doc["heads"][1]["label"] = "label2"
    doc["tables"][0]["vocab"] = 3000
    next(f for f in doc["features"] if f["name"] == "b")["hash_buckets"] = 2000
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    ok(flowrec("plan", "spec.yaml", "--world-size", "2", "--json", "p2.json", cwd=root))
    plan = json.loads((root / "p2.json").read_text())
    for g in plan["groups"]:
        sharding = "row_wise" if g["rows"] > 1000 else "replicated"
        g["sharding"], g["shards"] = (sharding, 2 if sharding == "row_wise" else 1)
    (root / "p2.json").write_text(json.dumps(plan))
    ok(flowrec("data", "synth", "spec.yaml", "--rows", str(ROWS), "--rows-per-file", "150", "--out", "d",
               "--seed", "3", "-q", cwd=root))
    ok(flowrec("train", "spec.yaml", "--data", "d", "--out", "ref2", "-q", "--eval-every", "0",
               "--plan", "p2.json", "--nproc", "2", cwd=root))
    return root


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(work: Path, out: str, hold: str | None, *extra: str, resuming: bool = False,
                env_extra: dict[str, str] | None = None) -> list[subprocess.Popen]:
    """The 2 ranks of `flowrec train` into (or `resuming`) `out`, started directly (no launcher),
    with the checkpoint writer of one of them held (`hold`: "RANK:STEP") when given."""
    port = _free_port()
    marks = work / f"{out}.marks"
    marks.mkdir(exist_ok=True)
    procs = []
    for rank in (0, 1):
        env = {**subprocess_env(ROOT), "WORLD_SIZE": "2", "RANK": str(rank), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": os.pathsep.join([str(ROOT), str(FAULTS)])}
        if hold is not None:
            env["FLOWREC_TEST_HOLD_CHECKPOINT"] = f"{hold}:{marks}"
        env.update(env_extra or {})
        where = ["--resume", out] if resuming else ["--data", "d", "--out", out, "--eval-every", "0",
                                                     "--plan", "p2.json"]
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "flowrec", "train", "spec.yaml", *where, "-q",
             "--dist-timeout", str(DIST_TIMEOUT_S), *extra],
            cwd=work, env=env, stderr=subprocess.PIPE, text=True))
    return procs


def finish(procs: list[subprocess.Popen]) -> list[tuple[int, str]]:
    """Each rank's exit status and stderr (all ended within the timeout; none left running)."""
    out = []
    try:
        for p in procs:
            _, err = communicate_bounded(p, TIMEOUT_S)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                wait_bounded(p, 30)
    return out


def wait_until(what: str, ready, procs: list[subprocess.Popen]) -> None:
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        if ready():
            return
        assert all(p.poll() is None for p in procs), f"a rank ended before {what}"
        time.sleep(0.05)
    pytest.fail(f"not {what} within {TIMEOUT_S} s")


def trained_steps(metrics: Path) -> int:
    if not metrics.is_file():
        return 0
    return sum('"event": "train"' in line for line in metrics.read_text().splitlines())


def held_pid(marks: Path, rank: int, step: int) -> int | None:
    path = marks / f"held-rank{rank}-step{step}"
    return int(path.read_text()) if path.is_file() and path.read_text() else None


def resume(work: Path, run: str) -> subprocess.CompletedProcess:
    (work / run / ".flowrec.lock").unlink(missing_ok=True)
    return flowrec("train", "spec.yaml", "--resume", run, "--max-steps", "1000", "-q", "--nproc", "2", cwd=work)


def train_past_a_held_full_write(work: Path, run: str, trained: int, *extra: str) -> None:
    """Train 5 steps on 2 ranks into `run`, checkpointing every 2, with rank 1's full shard of step 2
    held until `trained` steps are trained (so training went on past that checkpoint, its write
    not committed), then released; both ranks end with status 0."""
    procs = start_ranks(work, run, "1:2", "--max-steps", "5", "--checkpoint-every", "2", *extra)
    marks = work / f"{run}.marks"
    try:
        wait_until("rank 1 held its write of step 2", lambda: held_pid(marks, 1, 2) is not None, procs)
        wait_until(f"step {trained} trained",
                   lambda: trained_steps(work / run / "metrics.jsonl") >= trained, procs)
        assert not (work / run / "checkpoint.pt").exists()  # the write of step 2 is not committed yet
    finally:
        (marks / "release").write_text("")
    for code, err in finish(procs):
        assert code == 0, err[-3000:]


def test_training_goes_on_while_a_full_shard_is_written_and_the_snapshot_is_the_step(work):
    """Rank 1's full shard of step 2 is held until training has run steps 3 and 4 (which change
    rows of its shard): the shard still holds the rows of step 2, so the run ends (deltas at 4 and
    5) and the base checkpoint alone resumes, both bitwise like the uninterrupted run."""
    run = "held_full"
    train_past_a_held_full_write(work, run, 4, "--checkpoint-full-every", "3")
    records = [json.loads(line) for line in (work / run / "metrics.jsonl").read_text().splitlines()]
    stalls = [r for r in records if r["event"] == "checkpoint"]
    assert [r["step"] for r in stalls] == [2, 4]  # one record per checkpoint taken while training
    end = records[-1]
    assert end["event"] == "end" and end["checkpoint_extra_bytes"] and end["checkpoint_writes_s"]["delta"]
    assert load_checkpoint(work / run)["position"]["step"] == 5
    assert sorted(p.name for p in (work / run).glob("checkpoint.delta-*.pt")) == [
        "checkpoint.delta-000001.pt", "checkpoint.delta-000002.pt"]
    base = "held_full_base"
    shutil.copytree(work / run, work / base)
    for path in (work / base).glob("checkpoint.delta-*.pt"):
        path.unlink()
    assert load_checkpoint(work / base)["position"]["step"] == 2
    for name in (run, base):
        ok(resume(work, name))
        assert_same_model(work / "ref2", work / name, tol=0.0)


def test_the_default_auto_takes_a_delta_on_every_rank_while_one_rank_writes_the_full_shard(work):
    """`--checkpoint-full-every auto` (the default): rank 1's full shard of step 2 is held, so at
    the checkpoint of step 4 the ranks agree that a full write is in flight and both take a delta
    on it instead of waiting (training reaches step 5 while the write is held; with K = 1 the
    checkpoint of step 4 would wait for it). The run resumes bitwise like the uninterrupted run."""
    run = "auto_held"
    train_past_a_held_full_write(work, run, 5)
    end = [json.loads(line) for line in (work / run / "metrics.jsonl").read_text().splitlines()][-1]
    assert end["event"] == "end" and len(end["checkpoint_writes_s"]["delta"]) >= 1
    assert json.loads((work / run / "run.json").read_text())["checkpoint_full_every"] == 0
    assert load_checkpoint(work / run)["position"]["step"] == 5
    ok(resume(work, run))
    assert_same_model(work / "ref2", work / run, tol=0.0)


@pytest.mark.parametrize("rank,full_every,held,kept", [(1, 3, 4, 2), (0, 2, 6, 4)],
                         ids=["rank1-in-a-delta", "rank0-in-a-full"])
def test_a_kill_during_a_background_write_keeps_the_last_checkpoint(work, rank, full_every, held, kept):
    """A rank killed while its writer holds the checkpoint of step `held` (training has gone on to
    the end of the data meanwhile): the other rank exits within the timeout with one line, the
    run is at its last committed checkpoint, and a resume ends bitwise like the uninterrupted run."""
    run = f"killed_{rank}"
    procs = start_ranks(work, run, f"{rank}:{held}", "--checkpoint-every", "2",
                        "--checkpoint-full-every", str(full_every))
    marks = work / f"{run}.marks"
    try:
        wait_until(f"rank {rank} held its write of step {held}", lambda: held_pid(marks, rank, held) is not None,
                   procs)
        wait_until("step 7 trained", lambda: trained_steps(work / run / "metrics.jsonl") >= 7, procs)
        os.kill(held_pid(marks, rank, held), signal.SIGKILL)
        (code, err), = finish([procs[1 - rank]])
    finally:
        finish(procs)
    assert code != 0
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in err, err[-3000:]
    assert load_checkpoint(work / run)["position"]["step"] == kept
    ok(resume(work, run))
    assert_same_model(work / "ref2", work / run, tol=0.0)


def test_a_failing_shard_write_on_one_rank_fails_every_rank_and_keeps_the_checkpoint(work):
    """Rank 1 cannot write its full shard of step 4 (a folder is in the way): both ranks learn it
    and exit with its one line naming the file; the checkpoint of step 2 stays; once the folder is
    gone the run resumes bitwise like the uninterrupted run."""
    run = "failing"
    ok(flowrec("train", "spec.yaml", "--data", "d", "--out", run, "-q", "--eval-every", "0", "--plan", "p2.json",
               "--nproc", "2", "--max-steps", "2", cwd=work))
    blocker = work / run / "checkpoint.shards" / "step000000004-rank1-of2.pt"
    blocker.mkdir()
    (blocker / "keep").write_text("")
    (work / run / ".flowrec.lock").unlink(missing_ok=True)
    procs = start_ranks(work, run, None, "--max-steps", "1000", "--checkpoint-every", "2", resuming=True)
    results = finish(procs)
    for code, err in results:
        assert code == 2, err[-3000:]
        errors = [line for line in err.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and blocker.name in errors[0] and "Traceback" not in err, err[-3000:]
    assert load_checkpoint(work / run)["position"]["step"] == 2
    shutil.rmtree(blocker)
    ok(resume(work, run))
    assert_same_model(work / "ref2", work / run, tol=0.0)


def test_inline_rank_checkpoints_still_resume_bitwise(work):
    """FLOWREC_RANK_CHECKPOINTS=inline (the older name of the comparison switch
    FLOWREC_CHECKPOINT_WRITES=inline of tools/bench_checkpoint.py, still read) writes on the training thread: a run stopped on base + deltas resumes, inline too,
    bitwise like the uninterrupted run, and no shard is left unnamed."""
    run, inline = "inline", {"FLOWREC_RANK_CHECKPOINTS": "inline"}
    for code, err in finish(start_ranks(work, run, None, "--max-steps", "5", "--checkpoint-every", "2",
                                        "--checkpoint-full-every", "3", env_extra=inline)):
        assert code == 0, err[-3000:]
    assert load_checkpoint(work / run)["position"]["step"] == 5
    (work / run / ".flowrec.lock").unlink(missing_ok=True)
    for code, err in finish(start_ranks(work, run, None, "--max-steps", "1000", resuming=True, env_extra=inline)):
        assert code == 0, err[-3000:]
    assert_same_model(work / "ref2", work / run, tol=0.0)
    named = set(_named_shards(work / run))
    assert named == {p.name for p in (work / run / "checkpoint.shards").iterdir()}


def _named_shards(run: Path) -> list[str]:
    """The shard files the run's manifests name (checkpoint.pt and its deltas)."""
    from flowrec.runtime.checkpoint.format import read_torch_file

    names = []
    for path in [run / "checkpoint.pt", *sorted(run.glob("checkpoint.delta-*.pt"))]:
        names += read_torch_file(path, "cpu")["shards"]["files"]
    return names
