"""Runs, round 9: the full load of a finished run on request, a finished run's `--nproc N` resume
told before any rank starts, and resume / eval of damaged and moved runs (one test per defect;
each fails on the code before its fix)."""
from __future__ import annotations

import json
import os
import random
import threading
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.testing.folders import make_read_only

runner = CliRunner()


def _spec(tmp_path: Path) -> Path:
    """A spec of small tables, fresh sizes and seed each time."""
    rng = random.Random()
    path = tmp_path / "tiny.yaml"
    path.write_text(
        "name: tiny_runs9\n"
        "features:\n  - {name: price, type: dense}\n"
        f"  - {{name: user, type: categorical, hash_buckets: {rng.randint(50, 400)}, dim: 4}}\n"
        f"  - {{name: item, type: categorical, hash_buckets: {rng.randint(20, 90)}, dim: 4}}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: ['@dense', '@sparse'], layers: [8]}\n"
        "heads:\n  - {name: ctr, input: top, task: binary, loss: bce}\n"
        f"training: {{batch_size: {rng.choice([16, 32])}, epochs: 1, seed: {rng.randint(0, 10**6)}}}\n")
    return path


def _train(spec: Path, run: Path, *extra: str) -> None:
    done = runner.invoke(app, ["train", str(spec), "--out", str(run), "-q", "--device", "cpu",
                               "--rows", str(random.randint(150, 400)), *extra])
    assert done.exit_code == 0, done.output


def _resume(spec: Path, run: Path, *extra: str, env: dict | None = None):
    return runner.invoke(app, ["train", str(spec), "--resume", str(run), "--json", *extra], env=env)


def _last_line(result) -> str:
    return result.stderr.strip().splitlines()[-1]


def test_the_full_load_of_a_finished_run_can_be_asked_for_and_says_the_same(tmp_path: Path, monkeypatch) -> None:
    """tools/bench_resume.py times a finished run told from its checkpoint against the run loaded
    whole, which nothing could ask for (only a test's monkeypatch); FLOWREC_RESUME_FULL_LOAD=1 loads
    it (its tables loaded once), with the same line and --json document."""
    from flowrec.runtime.trainer import Trainer

    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run, "--epochs", str(random.randint(1, 3)))
    told = _resume(spec, run)
    loads = []
    load_state = Trainer.load_state
    monkeypatch.setattr(Trainer, "load_state", lambda self, *a, **k: (loads.append(1), load_state(self, *a, **k))[1])
    loaded = _resume(spec, run, env={"FLOWREC_RESUME_FULL_LOAD": "1"})
    assert told.exit_code == loaded.exit_code == 0, (told.output, loaded.output)
    assert loads == [1], loaded.output
    assert _last_line(loaded) == _last_line(told) and "is finished" in _last_line(told)
    assert json.loads(loaded.stdout) == json.loads(told.stdout)
    again = _resume(spec, run, env={"FLOWREC_RESUME_FULL_LOAD": "0"})
    assert again.exit_code == 0 and loads == [1] and _last_line(again) == _last_line(told)


def test_a_bad_full_load_switch_is_one_line_before_anything_is_read(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    value = random.choice(["yes", "true", "2", "on", "x" * random.randint(1, 5)])
    result = runner.invoke(app, ["train", str(spec), "--out", str(run), "--device", "cpu", "--rows", "100"],
                           env={"FLOWREC_RESUME_FULL_LOAD": value})
    assert result.exit_code == 2, result.output
    assert _last_line(result).startswith("error: FLOWREC_RESUME_FULL_LOAD") and repr(value) in _last_line(result)
    assert "Traceback" not in result.output and not run.exists()


def _launches(monkeypatch, status: int | None = None) -> list[int]:
    """torch's launcher replaced: the ranks of each launch recorded; `status` its exit status (None:
    a launch fails the test)."""
    import flowrec.cli.ranks as ranks

    launched: list[int] = []

    def launch(nproc, *_a, **_k):
        if status is None:
            raise AssertionError("the ranks were launched")
        launched.append(nproc)
        return status

    monkeypatch.setattr(ranks, "launch_ranks", launch)
    return launched


@pytest.mark.parametrize("how", ["epochs", "max_steps"])
def test_a_finished_runs_nproc_resume_is_said_before_any_rank_starts(tmp_path: Path, monkeypatch, how: str) -> None:
    """`train --resume RUN --nproc 2` of a finished run launched two ranks that each read the run's
    data and built its model (13.6 s of CPU for a tiny run) to say it is finished; its checkpoint
    says it before any rank starts, in the line and --json document of one process, status 0."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    extra = ["--epochs", str(random.randint(1, 3))] if how == "epochs" else ["--max-steps", str(random.randint(1, 4))]
    _train(spec, run, *extra)
    one = _resume(spec, run)
    assert one.exit_code == 0 and "is finished" in _last_line(one), one.output
    _launches(monkeypatch)
    ranks = _resume(spec, run, "--nproc", "2", "--dist-timeout", "60")
    assert ranks.exit_code == 0, ranks.output
    assert _last_line(ranks) == _last_line(one) and json.loads(ranks.stdout) == json.loads(one.stdout)
    assert "launching" not in ranks.stderr and ranks.stderr.count("is finished") == 1, ranks.stderr


def _reshape_a_table(run: Path) -> None:
    import torch

    from flowrec.runtime.checkpoint import store as ckpt

    state = ckpt.load_checkpoint(run)
    state.pop("digest")
    key = next(k for k in state["model"] if k.endswith(".weight"))
    state["model"][key] = torch.rand(3, 3)
    ckpt.save_checkpoint(run / "checkpoint.pt", state)


@pytest.mark.parametrize("case", ["not_finished", "another_seed", "does_not_fit", "damaged_run_json"])
def test_an_nproc_resume_its_checkpoint_cannot_answer_launches_the_ranks_saying_nothing_first(
        tmp_path: Path, monkeypatch, case: str) -> None:
    """Where the checkpoint cannot say the run is finished (it is not, the command is refused, the
    checkpoint does not fit, run.json is damaged), `--resume RUN --nproc 2` launches the ranks as
    before, and this process says nothing of its own first (the ranks say it, rank 0's line)."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    steps = random.randint(1, 3)
    _train(spec, run, "--max-steps", str(steps))
    extra = {"not_finished": ["--max-steps", str(steps + random.randint(1, 5))],
             "another_seed": ["--seed", str(random.randint(10**6 + 1, 10**7))]}.get(case, [])
    if case == "does_not_fit":
        _reshape_a_table(run)
    if case == "damaged_run_json":
        (run / "run.json").write_text((run / "run.json").read_text()[:random.randint(1, 30)])
    status = random.choice([0, 2])
    launched = _launches(monkeypatch, status)
    result = _resume(spec, run, "--nproc", "2", "--dist-timeout", "60", *extra)
    assert launched == [2] and result.exit_code == status, result.output
    said = result.stderr.strip().splitlines()
    assert said and said[0].startswith("launching 2 ranks") and len(said) == 1, result.stderr
    assert result.stdout == ""


def test_a_run_trained_on_two_ranks_resumed_on_two_is_said_finished_from_its_shards(tmp_path: Path) -> None:
    """A run trained by `--nproc 2` (its tables in the shards of each rank) resumed with `--nproc 2`:
    said finished from its checkpoint, its shards fitted by shape and dtype, no rank launched; the
    line and --json document of one process, status 0 (gloo on CPU, torch's launcher picks the port)."""
    from flowrec.testing.ranks import run_flowrec

    root = Path(__file__).resolve().parents[2]
    spec, run = _spec(tmp_path), tmp_path / "run"
    common = ("--dist-timeout", "60")
    done = run_flowrec("train", str(spec), "--out", str(run), "-q", "--device", "cpu", "--rows",
                       str(random.randint(150, 400)), "--nproc", "2", *common, cwd=tmp_path, root=root, timeout_s=300)
    assert done.returncode == 0 and (run / "checkpoint.shards").is_dir(), done.stderr[-3000:]
    one = run_flowrec("train", str(spec), "--resume", str(run), "--json", cwd=tmp_path, root=root, timeout_s=300)
    ranks = run_flowrec("train", str(spec), "--resume", str(run), "--json", "--nproc", "2", *common, cwd=tmp_path,
                        root=root, timeout_s=300)
    assert one.returncode == ranks.returncode == 0, (one.stderr[-2000:], ranks.stderr[-2000:])
    assert ranks.stderr.strip().splitlines()[-1] == one.stderr.strip().splitlines()[-1]
    assert "is finished" in ranks.stderr and "launching" not in ranks.stderr, ranks.stderr
    assert json.loads(ranks.stdout) == json.loads(one.stdout) and json.loads(one.stdout)["finished"] is True


def _contents(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_finished_run_in_a_read_only_folder_is_said_finished(tmp_path: Path, monkeypatch) -> None:
    """`--resume RUN` of a finished run in a folder that cannot be written (an archived run, a
    read-only mount) said only 'cannot lock run folder RUN: Read-only file system', exit 2; it
    writes nothing, so it is said finished from its checkpoint, the line and --json document of a
    writable folder; a resume that would train still gets the lock's line."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run, "--epochs", str(random.randint(1, 2)))
    writable = _resume(spec, run)
    assert writable.exit_code == 0 and "is finished" in _last_line(writable), writable.output
    before = _contents(run)
    make_read_only(run, monkeypatch)
    try:
        told = _resume(spec, run)
        further = _resume(spec, run, "--epochs", "9")
    finally:
        for path in [run, *run.rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert told.exit_code == 0, told.output
    assert _last_line(told) == _last_line(writable) and json.loads(told.stdout) == json.loads(writable.stdout)
    assert further.exit_code == 2 and _last_line(further).startswith(f"error: cannot lock run folder {run}"), \
        further.output
    assert "Traceback" not in told.output + further.output and _contents(run) == before


@pytest.mark.parametrize("trained_on", ["dataset", "synthetic"])
def test_eval_of_a_run_whose_run_json_is_gone_says_so_not_that_it_trained_on_synthetic_rows(
        tmp_path: Path, monkeypatch, trained_on: str) -> None:
    """`flowrec eval RUN` of a run whose run.json was deleted said 'RUN recorded no evaluation data to
    score (it trained on synthetic rows)', of a run trained on a dataset too: run.json is what records
    the data (and a synthetic run's row count); the line now says it is missing, exit 2."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    extra: list[str] = []
    if trained_on == "dataset":
        made = runner.invoke(app, ["data", "synth", str(spec), "--rows", str(random.randint(120, 300)), "--out",
                                   str(tmp_path / "d"), "--seed", str(random.randint(0, 99)), "-q"])
        assert made.exit_code == 0, made.output
        extra = ["--data", str(tmp_path / "d")]
    _train(spec, run, *extra)
    (run / "run.json").unlink()
    result = runner.invoke(app, ["eval", str(run)])
    assert result.exit_code == 2, result.output
    line = _last_line(result)
    assert line.startswith(f"error: {run} recorded no evaluation data") and "run.json" in line and "missing" in line
    assert "synthetic" not in line and "Traceback" not in result.output


def _early_stopping_spec(tmp_path: Path) -> Path:
    """A spec bound to a skewed CSV with a test split, evaluated every step, stopping at its second
    evaluation (no AUC beats the first by 1): its run writes RUN/best."""
    rng = random.Random()
    rows = ["label,price,user"] + [f"{int(rng.random() < 0.2)},{rng.expovariate(0.5):.3f},"
                                   f"u{min(int(rng.paretovariate(1.2)), 60)}" for _ in range(rng.randint(240, 400))]
    (tmp_path / "raw.csv").write_text("\n".join(rows) + "\n")
    path = tmp_path / "early.yaml"
    path.write_text(
        "name: early_runs9\n"
        "features:\n  - {name: price, type: dense}\n  - {name: user, type: categorical, vocab: 80, dim: 4}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: ['@dense', '@sparse'], layers: [8]}\n"
        "heads:\n  - {name: ctr, input: top, task: binary, loss: bce}\n"
        "data: {format: csv, path: raw.csv, label: label, options: {test_fraction: 0.25}}\n"
        f"training: {{batch_size: 16, epochs: 4, seed: {rng.randint(0, 10**6)}, eval_every: 1, "
        "early_stopping: {metric: auc, patience: 1, min_delta: 1.0}}\n")
    return path


def test_resume_of_a_runs_best_checkpoint_names_the_run_not_an_overwrite_of_it(tmp_path: Path, monkeypatch) -> None:
    """`train --resume RUN/best` said 'RUN/best/run.json is missing ... start the run over with --out
    RUN/best --overwrite': advice to train a new run into the run's best checkpoint (which the output
    guard then refuses). It is one line naming the run to resume and --init-from RUN/best, exit 2,
    nothing written."""
    monkeypatch.chdir(tmp_path)
    spec, run = _early_stopping_spec(tmp_path), tmp_path / "run"
    done = runner.invoke(app, ["train", str(spec), "--out", str(run), "-q", "--device", "cpu"])
    assert done.exit_code == 0 and (run / "best" / "checkpoint.pt").is_file(), done.output
    before = _contents(run)
    result = _resume(spec, run / "best")
    assert result.exit_code == 2, result.output
    line = _last_line(result)
    assert line.startswith(f"error: {run / 'best'} is the best checkpoint of the run in {run}"), line
    assert f"--resume {run}" in line and f"--init-from {run / 'best'}" in line and "--overwrite" not in line
    assert _contents(run) == before and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["resume", "resume_further", "eval"])
def test_a_checkpoint_whose_model_holds_a_key_that_is_no_text_is_one_line(tmp_path: Path, monkeypatch,
                                                                          command: str) -> None:
    """A checkpoint (re-saved with a valid digest) whose model dict holds a key that is not a text
    (a number, a tuple): `--resume` (the finished run, or further) and `eval` ended in a traceback
    ('sequence item 0: expected str instance, int found') joining the unexpected keys; each is one
    line naming the file, exit 2."""
    import torch

    from flowrec.runtime.checkpoint import store as ckpt

    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run)
    state = ckpt.load_checkpoint(run)
    state.pop("digest")
    key = random.choice([random.randint(0, 99), (random.randint(0, 9), "w")])
    state["model"][key] = torch.rand(random.randint(1, 5))
    ckpt.save_checkpoint(run / "checkpoint.pt", state)
    args = {"resume": ["train", str(spec), "--resume", str(run)],
            "resume_further": ["train", str(spec), "--resume", str(run), "--epochs", str(random.randint(2, 4))],
            "eval": ["eval", str(run), "-q"]}[command]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, (result.output, result.exception)
    assert _last_line(result).startswith(f"error: {run / 'checkpoint.pt'} does not fit the spec's model: model ")
    assert repr(key) in _last_line(result) and "Traceback" not in result.output


@pytest.mark.parametrize("command", ["resume_further", "eval"])
def test_a_checkpoint_with_a_negative_skipped_batch_count_is_one_line(tmp_path: Path, monkeypatch,
                                                                      command: str) -> None:
    """A checkpoint (re-saved with a valid digest) whose `skipped_batches` is negative: a resume
    trained on, ending with 'warning: -5 of 20 batches had a non-finite loss and were skipped', and
    eval scored it; it is damaged like a negative position: one line naming the file, exit 2."""
    from flowrec.runtime.checkpoint import store as ckpt

    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run)
    state = ckpt.load_checkpoint(run)
    state.pop("digest")
    count = -random.randint(1, 10**6)
    state["skipped_batches"] = count
    ckpt.save_checkpoint(run / "checkpoint.pt", state)
    before = _contents(run)
    args = {"resume_further": ["train", str(spec), "--resume", str(run), "--epochs", str(random.randint(2, 4))],
            "eval": ["eval", str(run), "-q"]}[command]
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert _last_line(result) == f"error: {run / 'checkpoint.pt'} is damaged: skipped_batches {count} is not a count"
    assert _contents(run) == before and "Traceback" not in result.output


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a machine without CUDA")
def test_a_run_recorded_on_cuda_resumed_on_a_machine_without_it_is_said_finished_or_named(
        tmp_path: Path, monkeypatch) -> None:
    """A run trained with --device cuda (run.json records it) moved to a machine without CUDA:
    `--resume RUN` of the finished run said '--device cuda was asked for, but CUDA is not
    available', a flag never given, instead of that it is finished (its checkpoint needs no device
    to say so); it is said finished, and a resume that would train names the run's record."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run)
    here = _resume(spec, run)
    recorded = json.loads((run / "run.json").read_text())
    (run / "run.json").write_text(json.dumps({**recorded, "device": "cuda"}))
    told = _resume(spec, run)
    assert told.exit_code == 0, told.output
    assert _last_line(told) == _last_line(here) and json.loads(told.stdout) == json.loads(here.stdout)
    further = _resume(spec, run, "--epochs", str(random.randint(2, 4)))
    assert further.exit_code == 2, further.output
    line = _last_line(further)
    assert line.startswith(f"error: {run} was trained with --device cuda (its run.json records it)"), line
    assert "--device cpu" in line and "was asked for" not in line and "Traceback" not in further.output


def test_a_finished_run_whose_dataset_moved_is_said_finished_and_a_resume_further_names_it(
        tmp_path: Path, monkeypatch) -> None:
    """A finished run whose --data folder was moved: `--resume RUN` said 'RUN was trained with --data
    D, which is gone', though its checkpoint says it is finished without reading any data; it is said
    finished (the line and document it had before the move), and a resume that would train names
    the dataset gone, exit 2, nothing in the run changed."""
    monkeypatch.chdir(tmp_path)
    spec, run, data = _spec(tmp_path), tmp_path / "run", tmp_path / "d"
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", str(random.randint(120, 300)), "--out", str(data),
                               "--seed", str(random.randint(0, 99)), "-q"])
    assert made.exit_code == 0, made.output
    _train(spec, run, "--data", str(data))
    here = _resume(spec, run)
    data.rename(tmp_path / "moved")
    before = _contents(run)
    told = _resume(spec, run)
    assert told.exit_code == 0, told.output
    assert _last_line(told) == _last_line(here) and json.loads(told.stdout) == json.loads(here.stdout)
    further = _resume(spec, run, "--epochs", str(random.randint(2, 4)))
    assert further.exit_code == 2, further.output
    assert _last_line(further).startswith(f"error: {run} was trained with --data {data}, which is gone")
    assert _contents(run) == before and "Traceback" not in told.output + further.output


def test_eval_of_a_run_whose_checkpoint_is_a_folder_names_it(tmp_path: Path, monkeypatch) -> None:
    """A run whose checkpoint.pt is a folder (a copy gone wrong): `flowrec eval RUN` said 'no
    checkpoint at RUN/checkpoint.pt/checkpoint.pt', a path nobody made; it says RUN/checkpoint.pt is
    a folder, not a checkpoint file, exit 2."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run)
    (run / "checkpoint.pt").unlink()
    (run / "checkpoint.pt").mkdir()
    for given in (run, run / "checkpoint.pt"):
        result = runner.invoke(app, ["eval", str(given), "-q"])
        assert result.exit_code == 2, result.output
        assert _last_line(result) == f"error: {run / 'checkpoint.pt'} is a folder, not a checkpoint file", given


def _unblock_later(fifo: Path) -> threading.Timer:
    """A reader that opens `fifo` blocks until a writer comes: after 60 s one comes and leaves (the
    reader then reads nothing), so a regression fails this test instead of hanging it."""
    def writer() -> None:
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        except OSError:  # no reader waiting
            pass

    timer = threading.Timer(60, writer)
    timer.daemon = True
    timer.start()
    return timer


@pytest.mark.parametrize("name", ["run.json", "checkpoint.pt"])
def test_a_run_file_made_a_pipe_is_named_so_not_missing(tmp_path: Path, monkeypatch, name: str) -> None:
    """run.json or checkpoint.pt made a FIFO (`mkfifo`): resume and eval said the file 'is missing'
    (or 'no checkpoint at ...'); each line says it is a pipe, exit 2, nothing read from it."""
    monkeypatch.chdir(tmp_path)
    spec, run = _spec(tmp_path), tmp_path / "run"
    _train(spec, run)
    (run / name).unlink()
    os.mkfifo(run / name)
    timer = _unblock_later(run / name)
    try:
        resumed = _resume(spec, run)
        scored = runner.invoke(app, ["eval", str(run), "-q"])
    finally:
        timer.cancel()
    for result in (resumed, scored):
        assert result.exit_code == 2, result.output
        line = _last_line(result)
        assert f"{name}" in line and "is a pipe (FIFO), not " in line and "missing" not in line, line
