"""What a run guarantees, each handled as documented: --overwrite, stale temp files, race-free
default folders, settings restored by --resume, non-finite losses (stop / skip-batch), disk-full and
permission errors while checkpointing, metrics never torn, Ctrl-C during start-up."""
from __future__ import annotations

import collections
import dataclasses
import errno
import json
import os
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint import checkpointer, stream, store as ckpt
from flowrec.runtime import trainer
from flowrec.runtime import run_log as metrics
from flowrec.runtime.rundir import claim_new_folder
from flowrec.testing.processes import run_bounded
from flowrec.testing.specs import OVERFLOW_SPEC, run_spec

SPEC = run_spec()
STEPS_PER_EPOCH = 13  # 400 rows / 32
runner = CliRunner()
DiskUsage = collections.namedtuple("DiskUsage", "total used free")  # what shutil.disk_usage returns


@pytest.fixture
def spec(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def _train(spec: Path, *args: str):
    return runner.invoke(app, ["train", str(spec), "--rows", "400", "--quiet", *args])


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def _train_steps(run: Path) -> list[int]:
    return [r["step"] for r in _records(run) if r["event"] == "train"]


def _model(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_checkpoint(run)["model"]


def _poison_step(monkeypatch, step: int) -> None:
    """The batch of training step `step` gets NaN labels (so its loss is NaN)."""
    real = trainer.train_step
    calls = {"n": 0}

    def poisoned(model, optimizer, batch, *args):
        calls["n"] += 1
        if calls["n"] == step:
            batch = dataclasses.replace(batch, labels=torch.full_like(batch.labels, float("nan")))
        return real(model, optimizer, batch, *args)

    monkeypatch.setattr(trainer, "train_step", poisoned)


def test_overwrite_replaces_a_run_and_its_metrics(spec: Path, tmp_path: Path):
    run = tmp_path / "run"
    assert _train(spec, "--out", str(run), "--max-steps", "5").exit_code == 0
    replaced = _train(spec, "--out", str(run), "--overwrite", "--max-steps", "3")
    assert replaced.exit_code == 0, replaced.output
    assert ckpt.load_checkpoint(run)["position"]["step"] == 3
    assert _train_steps(run) == [1, 2, 3]


def test_stale_temp_files_are_removed_when_the_owning_run_starts(spec: Path, tmp_path: Path):
    run = tmp_path / "run"
    assert _train(spec, "--out", str(run), "--max-steps", "4").exit_code == 0
    # a rank of --nproc N killed in its shard's write leaves its temp file in checkpoint.shards/
    stale = [run / ".ckpt-killed.tmp", run / "checkpoint.shards" / ".ckpt-rank1.tmp", run / "best" / ".ckpt-b.tmp"]
    for path in stale:
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"half a checkpoint")
    resumed = _train(spec, "--resume", str(run), "--max-steps", "6")
    assert resumed.exit_code == 0, resumed.output
    assert not any(p.exists() for p in stale) and ckpt.load_checkpoint(run)["position"]["step"] == 6


def test_default_run_folders_are_claimed_without_races(tmp_path: Path):
    barrier = threading.Barrier(8)
    claimed, locks = [], []

    def claim() -> None:
        barrier.wait(timeout=60)  # a thread that never came: the others fail, not hang
        folder, lock = claim_new_folder(tmp_path / "runs", "job")
        claimed.append(folder.name)
        locks.append(lock)

    threads = [threading.Thread(target=claim) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for lock in locks:
        lock.release()
    assert sorted(claimed) == sorted(["job"] + [f"job-{n}" for n in range(2, 9)])


def test_resume_with_another_seed_is_refused_naming_the_seed_not_the_spec(spec: Path, tmp_path: Path):
    # it said "--seed 9 overrides the run's --seed None", read the data, then "spec.yaml differs from
    # the spec the run in run was trained with" of a spec file nobody had changed
    run = tmp_path / "run"
    assert _train(spec, "--out", str(run), "--max-steps", "4").exit_code == 0
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".flowrec.lock"}
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--seed", "9", "--max-steps", "6"])
    assert resumed.exit_code == 2, resumed.output
    assert f"--seed 9 differs from the seed the run in {run} was trained with (5)" in resumed.stderr
    # one line (runs.md): it was preceded by "restored from run.json: ..." and "--seed 9 overrides the run's
    # default (it was started without --seed)", which the refusal then contradicted
    assert len(resumed.stderr.strip().splitlines()) == 1 and "overrides" not in resumed.stderr, resumed.stderr
    assert "differs from the spec" not in resumed.stderr and "synthetic" not in resumed.stderr  # no data read
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file() and p.name != ".flowrec.lock"} == before
    again = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--seed", "5", "--max-steps", "6"])
    assert again.exit_code == 0, again.output
    assert _train_steps(run) == list(range(1, 7))


def test_resume_with_a_spec_changed_outside_the_model_names_what_differs(spec: Path, tmp_path: Path):
    # the spec's epochs raised to train a run further: "spec.yaml differs from the spec the run in run was
    # trained with (see run/spec.json)", and nothing said what differs or that --epochs does it
    run = tmp_path / "run"
    assert _train(spec, "--out", str(run), "--max-steps", "4").exit_code == 0
    spec.write_text(SPEC.replace("epochs: 2", "epochs: 3"))
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--quiet"])
    assert resumed.exit_code == 2, resumed.output
    assert resumed.stderr.strip().splitlines()[-1] == (
        f"error: {spec} differs from the spec the run in {run} was trained with: training.epochs 2 in the run, 3 in "
        f"the spec (see {run}/spec.json); to change that, keep the spec as it was and give --epochs on the command "
        "line")


@pytest.mark.parametrize("seed", [None, "5"], ids=["spec_seed", "same_seed_given"])
def test_resume_with_a_spec_changed_outside_the_model_is_refused_before_any_data_is_read(spec: Path, tmp_path: Path,
                                                                                         monkeypatch, seed):
    # the refusal came after the run's data was read and its model built (minutes on big data)
    from flowrec.runs import start

    run = tmp_path / "run"
    assert _train(spec, "--out", str(run), "--max-steps", "4").exit_code == 0
    started = []
    real = start.start_session
    monkeypatch.setattr(start, "start_session", lambda *a, **k: started.append(1) or real(*a, **k))
    again = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "5", "--quiet",
                                *(["--seed", seed] if seed else [])])
    assert again.exit_code == 0 and started, again.output  # the unchanged spec (and its own seed) resumes
    started.clear()
    spec.write_text(SPEC.replace("epochs: 2", "epochs: 3"))
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--quiet",
                                 *(["--seed", seed] if seed else [])])
    assert resumed.exit_code == 2, resumed.output
    assert resumed.stderr.strip().splitlines()[-1].startswith(
        f"error: {spec} differs from the spec the run in {run} was trained with: training.epochs 2 in the run")
    assert not started


def test_default_folder_of_a_second_run_is_numbered(spec: Path, tmp_path: Path):
    for _ in range(2):
        assert _train(spec, "--max-steps", "2").exit_code == 0
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["tiny_guard", "tiny_guard-2"]


def test_resume_restores_every_setting_and_says_which_flags_override(spec: Path, tmp_path: Path):
    run = tmp_path / "run"
    first = _train(spec, "--out", str(run), "--max-steps", "7", "--checkpoint-every", "3", "--eval-every", "5",
                   "--seed", "11", "--no-interleave", "--nan-policy", "skip-batch", "--epochs", "3")
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--quiet", "--max-steps", "12"])
    assert resumed.exit_code == 0, resumed.output
    note = next(line for line in resumed.stderr.splitlines() if line.startswith("restored from run.json"))
    for setting in ("--rows 400", "--epochs 3", "--checkpoint-every 3", "--eval-every 5", "--seed 11",
                    "--no-interleave", "--nan-policy skip-batch", "--device auto"):
        assert setting in note, setting
    assert "--max-steps 12 overrides the run's --max-steps 7" in resumed.stderr
    assert json.loads((run / "run.json").read_text())["max_steps"] == 12
    evals = [r["step"] for r in _records(run) if r["event"] == "eval" and not r["final"]]
    assert evals == [5, 10] and _train_steps(run) == list(range(1, 13))
    straight = _train(spec, "--out", str(tmp_path / "straight"), "--max-steps", "12", "--seed", "11",
                      "--no-interleave", "--epochs", "3")
    assert straight.exit_code == 0
    a, b = _model(run), _model(tmp_path / "straight")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_non_finite_loss_stops_naming_step_and_head_and_keeps_the_last_checkpoint(spec: Path, tmp_path: Path,
                                                                                   monkeypatch):
    run = tmp_path / "run"
    _poison_step(monkeypatch, 6)
    result = _train(spec, "--out", str(run), "--checkpoint-every", "4")
    assert result.exit_code == 2, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: non-finite loss (nan) at step 6 in head ctr")
    assert "the checkpoint of step 4 is kept" in error and "Traceback" not in result.output
    assert ckpt.load_checkpoint(run)["position"]["step"] == 4
    assert _records(run)[-1]["event"] == "stopped"


def test_skip_batch_skips_only_that_update_and_counts_it(spec: Path, tmp_path: Path, monkeypatch):
    """The count was in the JSON result and metrics.jsonl only: a run of lr 1000 whose batches were
    skipped 34 times in 36 closed with 'steps 36, 4,533 samples' and no word of it."""
    four = _train(spec, "--out", str(tmp_path / "four"), "--max-steps", "4", "--nan-policy", "skip-batch")
    assert four.exit_code == 0 and "non-finite" not in four.stderr
    _poison_step(monkeypatch, 5)
    result = _train(spec, "--out", str(tmp_path / "skip"), "--max-steps", "5", "--nan-policy", "skip-batch",
                    "--json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout[result.stdout.index("{"):])["skipped_batches"] == 1
    assert "warning: 1 of 5 batches had a non-finite loss and were skipped" in result.stderr
    a, b = _model(tmp_path / "four"), _model(tmp_path / "skip")
    assert all(torch.equal(a[k], b[k]) for k in a)  # the poisoned batch changed nothing
    skipped = [r for r in _records(tmp_path / "skip") if r.get("skipped")]
    assert [(r["step"], r["head"]) for r in skipped] == [(5, "ctr")]
    assert _records(tmp_path / "skip")[-1]["skipped_batches"] == 1


def test_skip_batch_stops_once_a_parameter_is_not_finite(tmp_path: Path, monkeypatch):
    """A finite loss whose update overflowed an fp16 table (lr 1000): --nan-policy skip-batch then
    skipped every later batch (34 of 36), evaluated on NaN scores (auc 0.5069 where there is none)
    and failed only at the final checkpoint; now it stops at the first such batch."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(OVERFLOW_SPEC)
    result = _train(tmp_path / "s.yaml", "--out", str(tmp_path / "run"), "--max-steps", "12", "--nan-policy",
                    "skip-batch", "--eval-every", "6")
    assert result.exit_code == 2, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: non-finite loss (") and ": parameter embeddings." in error, error
    assert "is not finite (an earlier update made it so" in error and "skipping batches cannot go on" in error
    records = _records(tmp_path / "run")
    assert records[-1]["event"] == "stopped" and not [r for r in records if r["event"] == "eval"]
    assert not [r for r in records if r.get("skipped")]
    stopped = _train(tmp_path / "s.yaml", "--out", str(tmp_path / "stop"), "--max-steps", "12")
    error = stopped.stderr.strip().splitlines()[-1]  # --nan-policy stop: the parameter named, skip-batch no advice
    assert stopped.exit_code == 2 and ": parameter embeddings." in error and "skip-batch" not in error, error


@pytest.mark.parametrize("writes", ["background", "inline"])
@pytest.mark.parametrize("code, words", [(errno.ENOSPC, "No space left on device"),
                                         (errno.EACCES, "Permission denied"),
                                         (None, "its disk has 0 MiB free and the checkpoint needs about")])
def test_a_failed_checkpoint_write_is_one_line_and_keeps_the_previous_one(spec: Path, tmp_path: Path,
                                                                          monkeypatch, code, words: str, writes: str):
    """The disk full (as the OS says it, or as torch's zip writer does: a RuntimeError "unexpected
    pos", then named by the free space), or no permission: one line, the previous checkpoint kept.
    In the background (the default) the second checkpoint (step 6) fails in the middle of its
    streamed tables and the run stops at the next checkpoint (step 9) with its error; inline
    (`FLOWREC_CHECKPOINT_WRITES=inline`, the comparison switch) it stops at step 6."""
    run = tmp_path / "run"

    def fail(file_write) -> None:  # half a checkpoint written, then the disk is full
        file_write(b"PK\x03\x04 half a checkpoint")
        if code is None:
            raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 135 vs 127")
        raise OSError(code, os.strerror(code))

    if writes == "inline":
        monkeypatch.setenv(trainer.CHECKPOINT_WRITES_ENV, "inline")
        real = ckpt.write_state
        calls = {"n": 0}

        def failing(state, file):
            calls["n"] += 1
            if calls["n"] == 2:
                fail(file.write)
            real(state, file)

        monkeypatch.setattr(ckpt, "write_state", failing)
    else:
        real_save, real_pwrite = checkpointer.save_streamed, stream._pwrite_all
        seen = {"fulls": 0, "writes": 0}

        def counting(*args, **kwargs):
            seen["fulls"] += 1
            return real_save(*args, **kwargs)

        def failing_pwrite(fd, data, offset):
            if seen["fulls"] == 2:
                seen["writes"] += 1
                if seen["writes"] == 2:  # the storages' bytes, after the first
                    fail(lambda b: real_pwrite(fd, b, offset))
            real_pwrite(fd, data, offset)

        monkeypatch.setattr(checkpointer, "save_streamed", counting)
        monkeypatch.setattr(stream, "_pwrite_all", failing_pwrite)
    if code is None:
        monkeypatch.setattr(ckpt.shutil, "disk_usage", lambda path: DiskUsage(10**12, 10**12 - 1000, 1000))
    # every checkpoint full (with the default auto, a checkpoint within the rest after a full write is a delta)
    result = _train(spec, "--out", str(run), "--checkpoint-every", "3", "--checkpoint-full-every", "1")
    assert result.exit_code == 2, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith(f"error: could not write checkpoint {run / 'checkpoint.pt'}: {words}")
    assert "previous checkpoint is intact" in error and "Traceback" not in result.output
    assert ckpt.load_checkpoint(run)["position"]["step"] == 3
    assert not list(run.glob(".ckpt-*"))
    stopped_at = 9 if writes == "background" else 6
    assert _train_steps(run) == list(range(1, stopped_at + 1))
    if writes == "background":
        assert seen["fulls"] == 2  # no checkpoint was taken after the failed one
    for name in ("run.json", "spec.json", "plan.json"):
        json.loads((run / name).read_text())


def test_a_metrics_line_that_cannot_be_written_whole_is_cut_back(tmp_path: Path, monkeypatch):
    log = metrics.MetricsLog(tmp_path / "metrics.jsonl", tensorboard=False)
    log.write({"event": "train", "step": 1, "loss": 0.5})
    real_write = os.write

    def disk_full(fd, data):
        real_write(fd, data[: len(data) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", disk_full)
    with pytest.raises(metrics.MetricsError, match="No space left on device"):
        log.write({"event": "train", "step": 2, "loss": 0.25})
    monkeypatch.setattr(os, "write", real_write)
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"event": "train", "loss": 0.5, "step": 1}\n'


def test_trimming_drops_later_steps_and_a_torn_line(tmp_path: Path):
    path = tmp_path / "metrics.jsonl"
    lines = [json.dumps({"event": "train", "step": s}) for s in (1, 2, 3, 4)]
    path.write_text("\n".join(lines) + '\n{"event": "tr')
    metrics.trim_metrics(path, 2)
    assert [r["step"] for r in metrics.read_records(path)] == [1, 2]
    assert path.read_text().endswith("\n") and not list(tmp_path.glob(".ckpt-*"))


def test_ctrl_c_during_start_up_is_one_line_and_exit_130(spec: Path, tmp_path: Path, monkeypatch):
    import flowrec.runs.start as start

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(start, "prepare", interrupted)  # the session the run lifecycle prepares
    result = _train(spec, "--out", str(tmp_path / "run"))
    assert result.exit_code == 130, result.output
    lines = result.stderr.strip().splitlines()
    assert lines == ["error: interrupted (Ctrl-C) before training started; nothing was trained"]


SIGNALLED = """
import importlib, os, signal, sys
sig = getattr(signal, sys.argv.pop(1))
module, name = sys.argv.pop(1).rsplit(":", 1)  # where the signal arrives: "flowrec.runtime.trainer:Trainer._evaluate"
owner = importlib.import_module(module)
*path, attr = name.split(".")
for part in path:
    owner = getattr(owner, part)
real = getattr(owner, attr)

def signalled(*args, **kwargs):
    os.kill(os.getpid(), sig)
    return real(*args, **kwargs)

setattr(owner, attr, signalled)
from flowrec.cli import main
sys.argv[0] = "flowrec"
main()
"""


def _signalled_run(tmp_path: Path, sig: str, where: str, *args: str, ignored: tuple[str, ...] = ()):
    """`flowrec train ARGS` in a process that gets `sig` from itself when `where` is first called;
    `ignored`: signals ignored from its start (as `nohup` starts a command with SIGHUP)."""
    import signal
    import sys

    from flowrec.testing.ranks import subprocess_env

    def ignore() -> None:
        for name in ignored:
            signal.signal(getattr(signal, name), signal.SIG_IGN)

    return run_bounded([sys.executable, "-c", SIGNALLED, sig, where, "train", *args], cwd=tmp_path, text=True,
                       capture_output=True, timeout_s=300, env=subprocess_env(Path(__file__).resolve().parents[2]),
                       preexec_fn=ignore if ignored else None)


def test_sighup_in_training_checkpoints_like_ctrl_c_unless_nohup_ignores_it(spec: Path, tmp_path: Path):
    # SIGHUP (a terminal closed, an ssh connection dropped) ended `flowrec train` at once, without a
    # word or its interrupt checkpoint; under `nohup` (SIGHUP ignored from the start) it must train on
    run = tmp_path / "run"
    done = _signalled_run(tmp_path, "SIGHUP", "flowrec.runtime.trainer:Trainer._interrupted", str(spec), "--rows",
                          "400", "--quiet", "--out", str(run), "--max-steps", "6", "--eval-every", "0")
    assert done.returncode == 130, done.stderr
    assert "interrupted: checkpoint saved; continue with" in done.stderr
    assert ckpt.load_checkpoint(run)["position"]["step"] == 1
    assert _records(run)[-1]["interrupted"] is True
    kept = tmp_path / "kept"
    done = _signalled_run(tmp_path, "SIGHUP", "flowrec.runtime.trainer:Trainer._interrupted", str(spec), "--rows",
                          "400", "--quiet", "--out", str(kept), "--max-steps", "6", "--eval-every", "0",
                          ignored=("SIGHUP",))
    assert done.returncode == 0, done.stderr
    assert ckpt.load_checkpoint(kept)["position"]["step"] == 6


@pytest.mark.parametrize("sig", ["SIGINT", "SIGTERM", "SIGHUP"])
def test_a_signal_during_the_final_evaluation_still_saves_the_last_checkpoint(spec: Path, tmp_path: Path, sig):
    # the final evaluation came after the last step and before the run's only checkpoint: Ctrl-C there
    # said "interrupted (Ctrl-C) at step 6; continue with ..." with no checkpoint (the resume trained
    # from step 0 again), and SIGTERM (`timeout`, a scheduler) ended the process without a word
    run = tmp_path / "run"
    done = _signalled_run(tmp_path, sig, "flowrec.runtime.trainer:Trainer._evaluate", str(spec), "--rows", "400",
                          "--quiet", "--out", str(run), "--max-steps", "6", "--eval-every", "0")
    assert done.returncode == 130, done.stderr
    assert "interrupted: checkpoint saved; continue with" in done.stderr
    assert ckpt.load_checkpoint(run)["position"]["step"] == 6
    end = _records(run)[-1]
    assert end["event"] == "end" and end["interrupted"] is True and _train_steps(run) == list(range(1, 7))


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
def test_sigterm_during_start_up_is_one_line_and_leaves_the_folder_as_found(spec: Path, tmp_path: Path, sig: str):
    # SIGTERM (`timeout`, a scheduler), or SIGHUP (a closed terminal), while the run read its data ended
    # it without a word, leaving the new --out folder behind (with --nproc 2: holding encoder/ and the
    # lock); Ctrl-C there was one line
    run = tmp_path / "run"
    done = _signalled_run(tmp_path, sig, "flowrec.runs.start:prepare", str(spec), "--rows", "400", "--quiet",
                          "--out", str(run))
    assert done.returncode == 130, done.stderr
    assert done.stderr.strip().splitlines()[-1] == f"error: interrupted ({sig}) before training started; nothing " \
                                                   "was trained"
    assert not run.exists()


def test_out_of_memory_in_training_is_one_line_and_keeps_the_checkpoint(spec: Path, tmp_path: Path,
                                                                        monkeypatch):
    real = trainer.train_step
    calls = {"n": 0}

    def exhausted(*args):
        calls["n"] += 1
        if calls["n"] == 5:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(*args)

    monkeypatch.setattr(trainer, "train_step", exhausted)
    run = tmp_path / "run"
    result = _train(spec, "--out", str(run), "--checkpoint-every", "2")
    assert result.exit_code == 3, result.output
    error = result.stderr.strip().splitlines()[-1]
    assert error.startswith("error: out of memory at step 5 on cpu: CUDA out of memory")
    assert "the checkpoint of step 4 is kept" in error and "--device cpu" not in error
    assert ckpt.load_checkpoint(run)["position"]["step"] == 4
