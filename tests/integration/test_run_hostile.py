"""Hostile run folders and checkpoints, one row per case: each gives one line and exit 2 (never a
traceback, never torch's own message) and changes nothing, or is handled as documented."""
from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import struct
import zipfile
from pathlib import Path
from typing import Callable

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint import store as ckpt
from flowrec.runtime.rundir import RunLock
from flowrec.testing.processes import run_bounded
from flowrec.testing.specs import run_spec

SPEC = run_spec("tiny_hostile", epochs=1)
runner = CliRunner()


class Payload:
    """A pickle that would run a command when loaded without weights_only."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """A spec, a finished run of it (checkpoint every 4 steps) and a small dataset."""
    root = tmp_path_factory.mktemp("hostile")
    (root / "spec.yaml").write_text(SPEC)
    made = runner.invoke(app, ["data", "synth", str(root / "spec.yaml"), "--rows", "300", "--out",
                               str(root / "data"), "--seed", "1"])
    assert made.exit_code == 0, made.output
    trained = runner.invoke(app, ["train", str(root / "spec.yaml"), "--rows", "400", "--out", str(root / "run"),
                                  "--quiet", "--checkpoint-every", "4"])
    assert trained.exit_code == 0, trained.output
    return root


@pytest.fixture
def case(base: Path, tmp_path: Path) -> Path:
    """A private copy of the base folder (spec, run, data)."""
    for name in ("spec.yaml", "run", "data"):
        src, dst = base / name, tmp_path / name
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return tmp_path


def _snapshot(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != ".flowrec.lock"}


def _one_line_exit_2(result, fragment: str, status_lines: bool = False) -> None:
    """Exit 2 with one `error:` line (the only stderr line, or after status lines when allowed)."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == lines[-1:] and (status_lines or len(lines) == 1), result.stderr
    assert fragment in lines[-1], lines[-1]
    assert "Traceback" not in result.output and "weights_only" not in result.output
    assert isinstance(result.exception, SystemExit)


# ------------------------------------------------------------------ damaged checkpoints
def _good_state(root: Path) -> dict:
    return ckpt.load_checkpoint(root / "run")


def _resaved(edit: Callable[[dict], None]) -> Callable[[Path, Path], None]:
    """A checkpoint re-saved by flowrec itself (valid digest) after `edit`."""

    def make(root: Path, target: Path) -> None:
        state = _good_state(root)
        state.pop("digest")
        edit(state)
        ckpt.save_checkpoint(target, state)
    return make


def _torch_file(obj_of: Callable[[Path], object]) -> Callable[[Path, Path], None]:
    def make(root: Path, target: Path) -> None:
        torch.save(obj_of(root), target)
    return make


def _bytes(of: Callable[[bytes], bytes]) -> Callable[[Path, Path], None]:
    def make(root: Path, target: Path) -> None:
        target.write_bytes(of(target.read_bytes()))
    return make


def _flip_tensor_byte(data: bytes) -> bytes:
    """Flip one bit inside the bytes of the largest tensor record of the archive (located by its
    local header: checkpoints carry no CRC-32, so zipfile would refuse to read the record)."""
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    name_len, extra_len = struct.unpack("<HH", data[info.header_offset + 26:info.header_offset + 30])
    start = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    return data[:start] + bytes([data[start] ^ 0x04]) + data[start + 1:]


def _zip_of_text(_: bytes) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as z:
        z.writestr("notes.txt", "not a checkpoint")
    return buffer.getvalue()


def _reshape_first_table(state: dict) -> None:
    key = next(k for k in state["model"] if k.endswith(".weight"))
    state["model"][key] = torch.zeros(3, 3)


def _retype_first_table(state: dict) -> None:
    key = next(k for k in state["model"] if k.endswith(".weight"))
    state["model"][key] = state["model"][key].double()


DAMAGED = {
    "empty": (_bytes(lambda b: b""), "is empty"),
    "truncated": (_bytes(lambda b: b[: len(b) // 2]), "not a usable flowrec checkpoint"),
    "truncated_to_header": (_bytes(lambda b: b[:100]), "not a usable flowrec checkpoint"),
    "text_file": (_bytes(lambda b: b"step: 3\nloss: 0.1\n"), "not a torch zip archive"),
    "zip_not_checkpoint": (_bytes(_zip_of_text), "not a usable flowrec checkpoint"),
    "plain_torch_dict": (_torch_file(lambda root: {"model": {"w": torch.zeros(2)}}), "not a flowrec checkpoint"),
    "plain_tensor": (_torch_file(lambda root: torch.zeros(4)), "not a flowrec checkpoint"),
    "hostile_pickle": (_torch_file(lambda root: {"format": "flowrec-checkpoint", "x": Payload(root / "PWNED")}),
                       "refused without running them"),
    "bit_flip_in_a_tensor": (_bytes(_flip_tensor_byte), "does not match its digest"),
    "other_version": (_resaved(lambda s: s.update(version=1)), "checkpoint version 1"),
    "missing_key": (_resaved(lambda s: s.pop("dense_optimizer")), "missing dense_optimizer"),
    "bad_position": (_resaved(lambda s: s.update(position={"step": -1})), "not a training position"),
    "wrong_shape": (_resaved(_reshape_first_table), "does not fit the spec's model"),
    "wrong_dtype": (_resaved(_retype_first_table), "does not fit the spec's model"),
}
COMMANDS = {
    "resume": lambda root: ["train", str(root / "spec.yaml"), "--resume", str(root / "run"), "--quiet"],
    "eval": lambda root: ["eval", str(root / "run"), "--data", str(root / "data")],
    "export": lambda root: ["export", str(root / "run"), str(root / "pkg")],
}


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("damage", sorted(DAMAGED))
def test_a_damaged_checkpoint_is_one_line_on_every_load_path(case: Path, damage: str, command: str):
    make, fragment = DAMAGED[damage]
    make(case, case / "run" / "checkpoint.pt")
    late = damage in ("wrong_shape", "wrong_dtype") and command == "resume"  # found once the model is built
    before = _snapshot(case)
    result = runner.invoke(app, COMMANDS[command](case))
    _one_line_exit_2(result, fragment, status_lines=late)
    assert _snapshot(case) == before
    assert not (case / "PWNED").exists() and not (case / "pkg").exists()


# ------------------------------------------------------------------ run folders and options
def _locked_out(root: Path) -> list[str]:
    return ["train", str(root / "spec.yaml"), "--out", str(root / "run"), "--overwrite", "--quiet"]


RUN_CASES = {
    # the lock is held by this test's process: the line says so (tests/unit/test_run_folder_refusals.py: another's)
    "second_run_into_a_locked_folder": (_locked_out, "in use by this same process (pid {pid})"),
    "resume_of_a_locked_folder": (COMMANDS["resume"], "in use by this same process (pid {pid})"),
    "out_on_an_existing_run": (lambda r: ["train", str(r / "spec.yaml"), "--out", str(r / "run")],
                               "already holds a run"),
    "out_is_a_folder_of_other_files": (lambda r: ["train", str(r / "spec.yaml"), "--out", str(r / "data")],
                                       "not a flowrec run folder"),
    "out_is_a_file": (lambda r: ["train", str(r / "spec.yaml"), "--out", str(r / "spec.yaml")], "is a file"),
    "resume_a_file": (lambda r: ["train", str(r / "spec.yaml"), "--resume", str(r / "spec.yaml")], "is a file"),
    "resume_a_folder_of_other_files": (lambda r: ["train", str(r / "spec.yaml"), "--resume", str(r / "data")],
                                       "has no checkpoint.pt or run.json"),
    "resume_nothing": (lambda r: ["train", str(r / "spec.yaml"), "--resume", str(r / "nope")], "nothing to resume"),
    "resume_and_overwrite": (lambda r: ["train", str(r / "spec.yaml"), "--resume", str(r / "run"), "--overwrite"],
                             "give one of them"),
    "damaged_run_json": (COMMANDS["resume"], "run.json is damaged"),
    "run_json_of_wrong_types": (COMMANDS["resume"], "run.json is damaged: rows must be a non-negative integer"),
    "export_over_the_checkpoint": (lambda r: ["export", str(r / "run"), str(r / "run" / "checkpoint.pt")],
                                   "a training run's folder"),
    "export_over_run_metrics": (lambda r: ["export", str(r / "run"), str(r / "run" / "metrics.jsonl"),
                                           "--overwrite"], "a training run's folder"),
    "export_over_an_existing_file": (lambda r: ["export", str(r / "run"), str(r / "spec.yaml")],
                                     "is a file; give a folder"),
    "export_to_a_folder_of_other_files": (lambda r: ["export", str(r / "run"), str(r / "other")],
                                          "is not empty; give --overwrite"),
    "export_over_a_dataset": (lambda r: ["export", str(r / "run"), str(r / "data"), "--overwrite"],
                              "a dataset's folder"),
    "export_below_a_file": (lambda r: ["export", str(r / "run"), str(r / "spec.yaml" / "pkg")],
                            "is not a folder"),
    "eval_of_no_checkpoint": (lambda r: ["eval", str(r / "nope"), "--data", str(r / "data")], "no checkpoint at"),
    "seed_beyond_63_bits": (lambda r: ["train", str(r / "spec.yaml"), "--seed", str(2**63)], "--seed must be in"),
    "negative_seed": (lambda r: ["train", str(r / "spec.yaml"), "--seed", "-1"], "--seed must be in"),
    "unknown_nan_policy": (lambda r: ["train", str(r / "spec.yaml"), "--nan-policy", "ignore"],
                           "--nan-policy must be one of"),
    # --overwrite of the run --init-from starts from removed its checkpoint (a resume then had no parent)
    "init_from_the_run_it_overwrites": (lambda r: ["train", str(r / "spec.yaml"), "--init-from", str(r / "run"),
                                                   "--out", str(r / "run"), "--overwrite", "--quiet"],
                                        "would replace the run it starts from"),
    "init_from_a_checkpoint_of_the_run_it_overwrites": (
        lambda r: ["train", str(r / "spec.yaml"), "--init-from", str(r / "run" / "checkpoint.pt"), "--out",
                   str(r / "." / "run"), "--overwrite", "--quiet"], "would replace the run it starts from"),
}


@pytest.mark.parametrize("name", sorted(RUN_CASES))
def test_a_hostile_run_folder_or_option_is_one_line(case: Path, name: str, monkeypatch):
    monkeypatch.chdir(case)
    argv_of, fragment = RUN_CASES[name]
    if name == "damaged_run_json":
        (case / "run" / "run.json").write_text('{"epochs": 2, "rows":')
    if name == "run_json_of_wrong_types":
        (case / "run" / "run.json").write_text('{"epochs": 2, "rows": "many"}')
    if name == "export_to_a_folder_of_other_files":
        (case / "other").mkdir()
        (case / "other" / "notes.txt").write_text("not a package")
    before = _snapshot(case)
    lock = RunLock.acquire(case / "run") if "locked" in name else None
    try:
        result = runner.invoke(app, argv_of(case))
    finally:
        if lock is not None:
            lock.release()
    _one_line_exit_2(result, fragment.format(pid=os.getpid()))
    assert _snapshot(case) == before
    assert not (case / "runs").exists()


# ------------------------------------------------------------------ a checkpoint lost after it was written
def _lose_checkpoint(run: Path, proof: str) -> None:
    """Delete run/checkpoint.pt, leaving one proof that it had been written: "end" (the finished
    run's metrics), "delta" (a delta file on it; the metrics' end record dropped) or "saved" (the
    metrics cut after the first `saved` record: a run killed once its first checkpoint landed)."""
    base = run / "checkpoint.pt"
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    if proof == "delta":
        shutil.copy(base, run / "checkpoint.delta-000001.pt")
        (run / "metrics.jsonl").write_text("".join(x for x in lines if '"event": "end"' not in x))
    if proof == "saved":  # and no delta: a kill before any was written
        for path in run.glob("checkpoint.delta-*"):
            path.unlink()
        first = next(i for i, x in enumerate(lines) if '"event": "saved"' in x)
        assert '"event": "end"' not in "".join(lines[:first + 1])
        (run / "metrics.jsonl").write_text("".join(lines[:first + 1]))
    base.unlink()


LOST = {
    "resume_finished_run": ("end", COMMANDS["resume"], "start the run over with --out"),
    "resume_with_a_delta_left": ("delta", COMMANDS["resume"], "incremental checkpoint checkpoint.delta-000001.pt"),
    "resume_killed_after_a_checkpoint_landed": ("saved", COMMANDS["resume"],
                                                "records the checkpoint of step 4 written"),
    "out_without_overwrite": ("end", lambda r: ["train", str(r / "spec.yaml"), "--out", str(r / "run"), "--quiet"],
                              "replace the run with --overwrite"),
}


def test_each_checkpoint_on_disk_gets_a_saved_record_after_it_lands(base: Path):
    """A `saved` record names each checkpoint taken while training (every 4 steps) once training
    sees its file in place, after that checkpoint's `checkpoint` record (written when the snapshot
    is taken) and before the end record (itself the proof of the last checkpoint)."""
    records = [json.loads(x) for x in (base / "run" / "metrics.jsonl").read_text().splitlines()]
    saved = [(i, r["step"]) for i, r in enumerate(records) if r["event"] == "saved"]
    taken = {r["step"]: i for i, r in enumerate(records) if r["event"] == "checkpoint"}
    end_index, end = next((i, r["step"]) for i, r in enumerate(records) if r["event"] == "end")
    assert len(saved) >= 2 and end_index == len(records) - 1, saved
    assert [s for _, s in saved] == sorted({s for _, s in saved})  # each once, in order
    for index, step in saved:
        assert step % 4 == 0 and step < end, (step, end)
        assert taken[step] < index < end_index
    assert ckpt.load_checkpoint(base / "run" / "checkpoint.pt")["position"]["step"] == end


def test_a_resume_keeps_the_saved_record_of_the_checkpoint_it_resumes(tmp_path: Path):
    """A resume from the checkpoint of step 4 cuts metrics.jsonl back to step 4; the `saved` record
    of that checkpoint, written when training saw it land (after step 6 here), stays, so a later
    loss of checkpoint.pt before the next one lands is still refused; the steps after 4 go."""
    from flowrec.runtime.run_log import trim_metrics
    from flowrec.runtime.rundir import lost_checkpoint

    records = [{"event": "train", "step": s, "loss": 0.5} for s in range(1, 7)]
    records[4:4] = [{"event": "checkpoint", "step": 4, "stall_s": 0.01}]
    records.append({"event": "saved", "step": 4})
    records += [{"event": "train", "step": s, "loss": 0.5} for s in range(7, 10)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "run.json").write_text("{}")
    trim_metrics(tmp_path / "metrics.jsonl", 4)
    kept = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in kept if r["event"] == "train"] == [1, 2, 3, 4]
    assert {"event": "saved", "step": 4} in kept
    assert "records the checkpoint of step 4 written" in lost_checkpoint(tmp_path)


@pytest.mark.parametrize("name", sorted(LOST))
def test_a_run_whose_checkpoint_was_deleted_is_refused_not_retrained(case: Path, name: str):
    """`--resume RUN` (or `--out RUN`) after RUN/checkpoint.pt was deleted once the run wrote it
    used to retrain from step 0 and replace the run's metrics and plan; now one line, nothing changed."""
    proof, argv_of, fragment = LOST[name]
    _lose_checkpoint(case / "run", proof)
    before = _snapshot(case)
    result = runner.invoke(app, argv_of(case))
    _one_line_exit_2(result, fragment)
    assert f"{case / 'run'}/checkpoint.pt is missing" in result.stderr
    assert _snapshot(case) == before


def test_resume_of_a_run_whose_run_json_was_deleted_is_refused_not_trained_on_other_data(case: Path):
    """`--resume RUN` without RUN/run.json went on from the checkpoint with the defaults' settings:
    400,000 synthetic rows instead of the run's 400 (or the spec's bound data instead of its --data)."""
    (case / "run" / "run.json").unlink()
    before = _snapshot(case)
    result = runner.invoke(app, ["train", str(case / "spec.yaml"), "--resume", str(case / "run"), "--max-steps", "14"])
    _one_line_exit_2(result, f"{case / 'run'}/run.json is missing")
    assert _snapshot(case) == before


def test_resume_on_data_that_changed_under_the_run_is_refused(case: Path):
    """The run's --data folder converted again with other rows: `--resume RUN` went on from the
    checkpoint's epoch and batch in the new rows without a word."""
    run, data = case / "run2", case / "data"
    trained = runner.invoke(app, ["train", str(case / "spec.yaml"), "--data", str(data), "--out", str(run),
                                  "--quiet", "--max-steps", "3"])
    assert trained.exit_code == 0, trained.output
    shutil.rmtree(data)
    made = runner.invoke(app, ["data", "synth", str(case / "spec.yaml"), "--rows", "200", "--out", str(data)])
    assert made.exit_code == 0, made.output
    before = _snapshot(run)
    result = runner.invoke(app, ["train", str(case / "spec.yaml"), "--resume", str(run), "--max-steps", "5"])
    _one_line_exit_2(result, f"the training data of the run in {run} changed since it started: {data} holds 200 "
                             f"rows, the run started on 300", status_lines=True)
    assert _snapshot(run) == before
    other = runner.invoke(app, ["train", str(case / "spec.yaml"), "--resume", str(run), "--max-steps", "5",
                                "--data", str(data), "--quiet"])  # given again: still the run's path, refused
    assert other.exit_code == 2, other.output
    again = runner.invoke(app, ["train", str(case / "spec.yaml"), "--resume", str(run), "--max-steps", "5",
                                "--rows", "50", "--quiet"])  # --rows given again on real data: not other data
    assert again.exit_code == 2, again.output


def test_a_run_killed_before_its_first_checkpoint_still_starts_again(case: Path):
    """No proof of a written checkpoint (no end record, no delta): --resume starts from step 0."""
    run = case / "run"
    for path in [run / "checkpoint.pt", run / "plan.json", run / "spec.json", *run.glob("checkpoint.delta-*")]:
        path.unlink()
    lines = (run / "metrics.jsonl").read_text().splitlines(keepends=True)
    (run / "metrics.jsonl").write_text("".join([x for x in lines if '"event": "train"' in x][:2]))
    result = runner.invoke(app, COMMANDS["resume"](case))
    assert result.exit_code == 0, result.output
    assert "has no checkpoint yet: starting it again from step 0" in result.stderr
    assert (run / "checkpoint.pt").is_file()


def _unprivileged() -> list[str] | None:
    """A command prefix that runs a process as the user nobody (65534), or None where that is not
    possible (not root, no setpriv, or this Python cannot run as nobody)."""
    import sys

    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None:
        return None
    prefix = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups"]
    try:
        probe = run_bounded([*prefix, sys.executable, "-c", "import flowrec, torch"], capture_output=True,
                            timeout_s=120, cwd="/", env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    except (OSError, AssertionError):  # not started, or past its deadline (run_bounded killed it and said so)
        return None
    return prefix if probe.returncode == 0 else None


@pytest.mark.parametrize("inside", [False, True], ids=["read_only_folder", "folder_inside_a_read_only_one"])
def test_out_on_a_read_only_folder_is_one_line_before_training_and_leaves_nothing(inside):
    # untested: we run as root, to whom every folder is writable; a user's --out on a folder they may
    # not write must be one line before anything is read or trained, and leave nothing behind
    import sys
    import tempfile

    prefix = _unprivileged()
    if prefix is None:
        pytest.skip("needs root, setpriv and a Python the user nobody can run")
    top = Path(tempfile.mkdtemp(prefix="flowrec-ro-"))
    try:
        top.chmod(0o755)
        read_only, cwd, home = top / "ro", top / "cwd", top / "home"
        read_only.mkdir(mode=0o755)  # root's: nobody may not write in it
        for folder in (cwd, home):
            folder.mkdir()
            folder.chmod(0o1777)
        (cwd / "spec.yaml").write_text(SPEC)
        out = read_only / "run" if inside else read_only
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[2]), "HOME": str(home), "TMPDIR": str(home),
               "OMP_NUM_THREADS": "1"}
        done = run_bounded([*prefix, sys.executable, "-m", "flowrec", "train", "spec.yaml", "--rows", "200",
                            "--out", str(out), "--quiet"], cwd=cwd, env=env, capture_output=True, text=True,
                           timeout_s=300)
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, done.stderr
        assert len(lines) == 1 and lines[0].startswith("error: ") and str(out) in lines[0], done.stderr
        assert list(read_only.iterdir()) == [] and [p.name for p in cwd.iterdir()] == ["spec.yaml"]
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_evaluation_data_that_is_the_training_data_is_warned(case: Path) -> None:
    """`train --data D --eval-data D` (or `--data SPLIT --eval-data SPLIT/train`) reported the fit to
    the training rows as the run's metrics without a word (AUC 0.75 where the test rows gave 0.53)."""
    made = runner.invoke(app, ["data", "synth", str(case / "spec.yaml"), "--rows", "100", "--out",
                               str(case / "other"), "--seed", "2", "-q"])
    assert made.exit_code == 0, made.output
    (case / "link").symlink_to(case / "data")
    for given, warned in (("data", True), ("link", True), ("other", False)):
        done = runner.invoke(app, ["train", str(case / "spec.yaml"), "--data", str(case / "data"), "--eval-data",
                                   str(case / given), "--out", str(case / f"run_{given}"), "--quiet"])
        assert done.exit_code == 0, done.output
        lines = [line for line in done.output.splitlines() if "is training data" in line]
        assert lines == ([f"warning: the evaluation data {case / given} is training data: the run trains on every "
                          "one of its part files, so its metrics measure the fit to rows the model learnt, not to "
                          "new ones; give --eval-data of other rows (a split's test part: `flowrec data convert ... "
                          "--test-fraction F`)"] if warned else []), done.output
