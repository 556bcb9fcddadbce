"""A rank of `flowrec train --nproc 2` that stops on an error of its own outside the training loop
(its loading of the data, as a damaged file only it reads fails; its shard of the final checkpoint)
ends the run as one process ends it: its one line, status 2, and the other rank's line naming it (no
traceback of gloo's closed connection, no status 1 or 4); the launcher's last line names it with its
line; the run folder is left as one process leaves it (a new run's removed, a resumed run's
untouched, the last checkpoint kept)."""
from __future__ import annotations

import copy
import hashlib
import random
from pathlib import Path

import pytest
import yaml

from flowrec.testing.processes import communicate_bounded, kill_tree, run_bounded, wait_bounded
from flowrec.testing.ranks import run_flowrec, subprocess_env
from flowrec.testing.specs import TINY

ROOT = Path(__file__).resolve().parents[2]
FAULTS = ROOT / "tests" / "faults"
TIMEOUT_S = 300  # every subprocess: a rank left waiting fails the test, never hangs it


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("nproc_rank_stops")
    doc = copy.deepcopy(TINY)
    doc["name"] = "tiny_rank_stops"
    doc["training"] = {"batch_size": 40, "epochs": 1, "seed": random.randrange(1 << 20)}
    doc["heads"][1]["label"] = "label2"
    (root / "spec.yaml").write_text(yaml.safe_dump(doc))
    made = run_flowrec("data", "synth", "spec.yaml", "--rows", str(random.randrange(300, 500)), "--out", "d",
                       "--seed", str(random.randrange(100)), "-q", cwd=root, root=ROOT, timeout_s=TIMEOUT_S)
    assert made.returncode == 0, made.stderr
    return root


def _train(work: Path, *extra: str, failing_rank: int | str | None = None, nproc: int = 2):
    import sys

    env = subprocess_env(ROOT)
    if failing_rank is not None:
        env.update(PYTHONPATH=f"{FAULTS}:{ROOT}", FLOWREC_TEST_DATA_ERROR=str(failing_rank))
    return run_bounded([sys.executable, "-m", "flowrec", "train", "spec.yaml", "--data", "d", "-q",
                        "--eval-every", "0", "--dist-timeout", "60", "--nproc", str(nproc), *extra], cwd=work, env=env,
                       text=True, capture_output=True, timeout_s=TIMEOUT_S)


def _digests(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and not p.name.startswith(".")}  # not the lock


def _check_lines(err: str, rank: int) -> None:
    other = 1 - rank
    assert "Traceback" not in err and "Connection closed" not in err, err[-3000:]
    own = [line for line in err.splitlines() if line.startswith(f"error: rank {rank}: ")]
    assert len(own) == 1 and f"cannot be read on rank {rank} (injected)" in own[0], err[-3000:]
    follower = [line for line in err.splitlines() if line.startswith(f"error: rank {other}: ")]
    # rank 0 refusing the data it prepares is its line alone (the others learn it and stop without one)
    said = [] if rank == 0 else [
        f"error: rank {other}: stopped before training: rank {rank} stopped first (its line says why)"]
    # torch's launcher stops the other ranks once one exits: rank 0 may be stopped before it says that it
    # follows (1 in about 5 runs under load); the launcher's last line names the rank and its line either way
    assert follower in (said, []), err[-3000:]
    last = err.strip().splitlines()[-1]
    if rank == 0:  # rank 0's line is the run's one line, as one process says it: not a second time by the launcher
        assert last == own[0] and err.count(own[0].split(": ", 2)[2]) == 1, err[-3000:]
        return
    assert last.startswith("error: training failed: rank(s) 0") and last.endswith(
        f" exited; the first, rank {rank}, with status 2: {own[0].split(': ', 2)[2]}"), last


def test_a_rank_whose_data_fails_ends_a_new_run_as_one_process_does(work: Path) -> None:
    rank = random.randrange(2)
    done = _train(work, "--out", "new", failing_rank=rank)
    assert done.returncode == 2, done.stderr[-3000:]
    _check_lines(done.stderr, rank)
    assert not (work / "new").exists()  # a new run refused on its data: nothing left, as one process


def test_a_rank_whose_data_fails_on_resume_leaves_the_run_to_resume(work: Path) -> None:
    first = _train(work, "--out", "run", "--max-steps", "2", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    before = _digests(work / "run")
    done = _train(work, "--resume", "run", "--max-steps", "4", failing_rank=1)
    assert done.returncode == 2, done.stderr[-3000:]
    _check_lines(done.stderr, 1)
    assert _digests(work / "run") == before  # untouched: `--resume run` continues from the checkpoint of step 2


def test_a_final_checkpoint_one_rank_cannot_write_is_its_line_and_keeps_the_last(work: Path) -> None:
    # rank 1 could not write its shard of the final checkpoint: rank 0 said the same bare line as its
    # own, and the launcher named rank 1 'killed by signal 15 (SIGTERM) and wrote no message', exit 143
    from flowrec.runtime.checkpoint.store import load_checkpoint

    first = _train(work, "--out", "ck", "--max-steps", "2", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    blocker = work / "ck" / "checkpoint.shards" / "step000000004-rank1-of2.pt"  # a folder in the way
    blocker.mkdir(parents=True)
    (blocker / "keep").write_text("")
    done = _train(work, "--resume", "ck", "--max-steps", "4")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    own = [line for line in done.stderr.splitlines() if line.startswith("error: rank 1: ")]
    assert len(own) == 1 and f"could not write checkpoint {Path('ck') / blocker.parent.name / blocker.name}" in own[0]
    said = own[0].split(": ", 2)[2]
    assert [line for line in done.stderr.splitlines() if line.startswith("error: rank 0: ")] == [
        f"error: rank 0: rank 1 stopped first: {said}"], done.stderr[-3000:]
    last = done.stderr.strip().splitlines()[-1]
    assert last == f"error: training failed: rank(s) 0, 1 exited; the first, rank 1, with status 2: {said}", last
    assert load_checkpoint(work / "ck")["position"]["step"] == 2  # the last whole checkpoint stays


def test_a_rank_killed_while_loading_its_data_is_the_one_named(work: Path) -> None:
    # rank 1 killed (the out-of-memory killer) as it loaded its data: the launcher stopped rank 0, whose
    # 'interrupted (SIGTERM) before training started' line (status 130) the launcher named as the first
    done = _train(work, "--out", "killed", failing_rank="1:kill")
    assert done.returncode == 128 + 9 and "Traceback" not in done.stderr, done.stderr[-3000:]
    # rank 0: stopped by the launcher (an interrupt), or, where it met the closed connection first
    # (building DDP), a lost rank's line where it was a traceback; or nothing, where the launcher's
    # SIGTERM found it still starting, before its handler (on a loaded machine rank 0 can lag rank 1
    # by seconds; a tiers run beside other work saw it), or past the launcher's 30 s shutdown (SIGKILL):
    # then the launcher's line alone names what happened
    said = [line for line in done.stderr.splitlines() if line.startswith("error: rank 0: ")]
    assert len(said) <= 1 and all("interrupted (SIGTERM)" in s or "another rank failed" in s for s in said), said
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: training failed: rank(s) ") and last.endswith(
        " exited; the first, rank 1, was killed by signal 9 (SIGKILL) and wrote no message"), done.stderr[-3000:]


def _rank_pid(launch_pid: int, rank: int) -> int | None:
    """The process id of rank `rank` of the launch under `launch_pid` (Linux /proc), or None."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            children.setdefault(int(stat.read_text().rsplit(")", 1)[1].split()[1]), []).append(int(stat.parent.name))
        except (OSError, IndexError, ValueError):
            continue
    todo = [launch_pid]
    while todo:
        for pid in children.get(todo.pop(), []):
            todo.append(pid)
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
            except OSError:
                continue
            if f"RANK={rank}".encode() in env and b"flowrec\0train" in cmd and b"flowrec.cli.ranks" not in cmd:
                return pid
    return None


@pytest.mark.skipif(not Path("/proc/self/environ").is_file(), reason="finds the ranks through /proc")
def test_a_rank_killed_in_training_is_named_without_gloos_words(work: Path) -> None:
    # `kill -9` of rank 1 while training: the launcher's last line named it (137), but rank 0's line
    # before it carried gloo's words: 'another rank failed ([.../gloo/transport/tcp/pair.cc:537] Read
    # error [127.0.0.1]:17825: Connection reset by peer. ... GLHF! ...)'
    import os
    import signal
    import subprocess
    import sys
    import time

    killed = random.randrange(2)
    job = subprocess.Popen([sys.executable, "-m", "flowrec", "train", "spec.yaml", "--data", "d", "-q", "--out", "k9",
                            "--eval-every", "0", "--epochs", "200", "--dist-timeout", "60", "--nproc", "2"],
                           cwd=work, env=subprocess_env(ROOT), stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = work / "k9" / "metrics.jsonl", time.monotonic() + TIMEOUT_S
        while not (metrics.is_file() and sum('"event": "train"' in line for line in metrics.open()) >= 3):
            assert job.poll() is None and time.monotonic() < deadline, "no training steps"
            time.sleep(0.1)
        pid = _rank_pid(job.pid, killed)
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        err = communicate_bounded(job, TIMEOUT_S)[1]
    finally:
        if job.poll() is None:  # with torch's launcher, in a session of its own, and the ranks
            kill_tree(job.pid)
            wait_bounded(job, 30)
    assert job.returncode == 128 + 9, err[-3000:]
    other = [line for line in err.splitlines() if line.startswith(f"error: rank {1 - killed}: ")]
    assert len(other) == 1 and "another rank failed" in other[0], err[-3000:]
    assert not any(words in err for words in ("Connection", "transport", "pair.cc", "GLHF", "Traceback")), err[-3000:]
    assert err.strip().splitlines()[-1].endswith(
        f"the first, rank {killed}, was killed by signal 9 (SIGKILL) and wrote no message"), err[-3000:]


def test_a_resume_every_rank_refuses_alike_is_rank_0s_line_alone(work: Path) -> None:
    # `--resume RUN --nproc 2` of a run whose run.json (or a shard its checkpoint names) was damaged or
    # gone: rank 1, rank 0 and the launcher said the same line, three times
    first = _train(work, "--out", "damaged", "--max-steps", "2", nproc=1)
    assert first.returncode == 0, first.stderr[-3000:]
    run_file = work / "damaged" / "run.json"
    run_file.write_text(run_file.read_text()[:random.randrange(1, 40)])  # cut short
    before = _digests(work / "damaged")
    done = _train(work, "--resume", "damaged", "--max-steps", "4")
    assert done.returncode == 2 and "Traceback" not in done.stderr, done.stderr[-3000:]
    said = [line for line in done.stderr.splitlines() if line.startswith("error")]
    assert len(said) == 1 and said[0].startswith("error: rank 0: ") and "run.json is damaged" in said[0], said
    assert _digests(work / "damaged") == before
