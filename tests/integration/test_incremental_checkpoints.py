"""Incremental checkpoints: deltas of touched rows on the last full checkpoint, written in the
background. A run with deltas ends bitwise equal to one with full checkpoints, also when resumed
from a chain and after a SIGKILL in the middle of a delta write; eval reads base + deltas; stale,
damaged and incomplete chains are handled as documented."""
from __future__ import annotations

import json
import os
import shutil
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import CheckpointError, content_digest, load_checkpoint
from flowrec.runtime import trainer
from flowrec.runtime.checkpoint import checkpointer, incremental, stream
from flowrec.runtime.checkpoint import delta as chain
from flowrec.runtime.checkpoint.delta import delta_files, delta_path
from flowrec.runtime.checkpoint.direct import DirectFile
from flowrec.runtime.trainer import CHECKPOINT_WRITES_ENV
from flowrec.serving.trained import ServingModel, load_trained
from flowrec.planner.contract import scoring_plan
from flowrec.testing.processes import run_bounded

SPEC = """
name: tiny_delta
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 5000, dim: 4}
  - {name: item, type: categorical, hash_buckets: 8000, dim: 4}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense"], layers: [4]}
  - {name: interact, kind: dot, inputs: [bottom, user, item]}
  - {name: top, kind: mlp, inputs: [interact, bottom], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 16, epochs: 2, seed: 5}
"""
STEPS = 2 * 38  # 600 rows / 16, 2 epochs
REPO = Path(__file__).resolve().parents[2]
RUN_TIMEOUT_S = 180
runner = CliRunner()


@pytest.fixture
def spec(tmp_path: Path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "spec.yaml"
    path.write_text(SPEC)
    return path


def _train(spec: Path, out: Path, *args: str):
    result = runner.invoke(app, ["train", str(spec), "--rows", "600", "--out", str(out), "--quiet",
                                 "--checkpoint-every", "5", *args])
    assert result.exit_code == 0, result.output
    return result


def _assert_same_run(a: dict, b: dict) -> None:
    assert a["position"] == b["position"] and a["skipped_batches"] == b["skipped_batches"]
    assert a["model"].keys() == b["model"].keys()
    assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
    sa, sb = a["dense_optimizer"]["state"], b["dense_optimizer"]["state"]
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[i][n], sb[i][n]) for i in sa for n in sa[i])


def test_deltas_end_bitwise_equal_to_full_checkpoints_and_are_small(spec: Path, tmp_path: Path):
    _train(spec, tmp_path / "full")
    _train(spec, tmp_path / "inc", "--checkpoint-full-every", "4")
    base = tmp_path / "inc" / "checkpoint.pt"
    chain = delta_files(base)
    assert [n for n, _ in chain] == [1, 2, 3]  # 16 checkpoints: full, 3 deltas, full, ... (last: 3 deltas)
    _assert_same_run(load_checkpoint(tmp_path / "full"), load_checkpoint(tmp_path / "inc"))
    delta = torch.load(chain[0][1], weights_only=True)
    touched = delta["tables"]
    assert sum(part["rows"].numel() for part in touched.values()) <= 5 * 16 * 2  # 5 steps x 16 samples x 2 ids
    assert all(p["rows"].numel() == torch.unique(p["rows"]).numel() for p in touched.values())
    assert chain[0][1].stat().st_size < base.stat().st_size / 5


def test_resume_from_a_chain_ends_bitwise_equal(spec: Path, tmp_path: Path):
    _train(spec, tmp_path / "full")
    run = tmp_path / "inc"
    _train(spec, run, "--checkpoint-full-every", "3", "--max-steps", "28")
    assert load_checkpoint(run)["position"]["step"] == 28 and delta_files(run / "checkpoint.pt")
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", str(STEPS), "--quiet"])
    assert resumed.exit_code == 0, resumed.output
    _assert_same_run(load_checkpoint(tmp_path / "full"), load_checkpoint(run))
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"event": "train"' in line]
    assert steps == list(range(1, STEPS + 1))


def test_a_full_checkpoint_copied_while_training_runs_holds_the_state_of_its_step(spec: Path, tmp_path: Path,
                                                                                   monkeypatch):
    monkeypatch.setattr(incremental, "SNAPSHOT_CHUNK_BYTES", 1)  # a slow write: later steps run during it
    saved = []
    real = incremental.TableSnapshot.before_write

    def counting(self, group, ids):
        real(self, group, ids)  # rows saved so far in this snapshot (the marks grow until the write ends)
        saved.append(sum(int(s.saved.sum()) for streams in self._parts.values() for s in streams
                         if s.saved is not None))

    monkeypatch.setattr(incremental.TableSnapshot, "before_write", counting)
    run = tmp_path / "inc"
    _train(spec, run, "--checkpoint-full-every", "3", "--max-steps", "28")  # full at 5 and 20, deltas after
    _train(spec, tmp_path / "full20", "--max-steps", "20")
    base = torch.load(run / "checkpoint.pt", weights_only=True)  # the full checkpoint alone, no deltas
    reference = load_checkpoint(tmp_path / "full20")
    assert base["position"]["step"] == 20
    _assert_same_run(reference, base)
    assert sum(saved) > 0  # rows were saved for the copy before steps changed them


KILLER = """
import os, signal, sys
import flowrec.runtime.checkpoint.store as ckpt
real = ckpt.write_state
seen = {"deltas": 0}
def dying(state, file):
    if state.get("format") == "flowrec-checkpoint-delta":
        seen["deltas"] += 1
        if seen["deltas"] == int(os.environ["KILL_AT_DELTA"]):
            file.write(b"PK\\x03\\x04 half a delta")
            file.flush()
            os.kill(os.getpid(), signal.SIGKILL)
    real(state, file)
ckpt.write_state = dying
from flowrec.cli import main
sys.argv = ["flowrec", *sys.argv[1:]]
main()
"""


def test_a_kill_during_a_delta_write_resumes_bitwise_equal(spec: Path, tmp_path: Path):
    _train(spec, tmp_path / "full")
    run = tmp_path / "inc"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILL_AT_DELTA": "5"}
    argv = [sys.executable, "-c", textwrap.dedent(KILLER), "train", str(spec), "--rows", "600", "--out",
            str(run), "--quiet", "--checkpoint-every", "5", "--checkpoint-full-every", "4"]
    killed = run_bounded(argv, cwd=tmp_path, env=env, timeout_s=RUN_TIMEOUT_S, capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()
    assert list(run.glob(".ckpt-*.tmp"))  # the kill left half a delta behind
    # full at step 5, deltas at 10, 15, 20; full at 25, delta 1 at 30; delta 2 (step 35) died
    assert load_checkpoint(run)["position"]["step"] == 30
    resumed = run_bounded([sys.executable, "-m", "flowrec", "train", str(spec), "--resume", str(run),
                           "--quiet"], cwd=tmp_path, env=env, timeout_s=RUN_TIMEOUT_S, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr.decode()
    _assert_same_run(load_checkpoint(tmp_path / "full"), load_checkpoint(run))
    assert not list(run.glob(".ckpt-*"))


STREAM_KILLER = """
import os, signal, sys
import flowrec.runtime.checkpoint.checkpointer as checkpointer
import flowrec.runtime.checkpoint.stream as stream
import flowrec.runtime.checkpoint.incremental as incremental
import flowrec.runtime.checkpoint.direct as direct
import fcntl
incremental.SNAPSHOT_CHUNK_BYTES = 64  # many chunks: the kill lands inside the tables
direct.DIRECT_BUFFER_BYTES = 2 * direct.DIRECT_ALIGN  # many direct writes (on the I/O thread)
real_save, real_pwrite = checkpointer.save_streamed, stream._pwrite_all
seen = {"fulls": 0, "writes": 0}
only_direct = os.environ["KILL_IN"] == "direct"  # count only writes through an O_DIRECT descriptor
def counting(*args, **kwargs):
    seen["fulls"] += 1
    return real_save(*args, **kwargs)
def dying(fd, data, offset):
    if seen["fulls"] == int(os.environ["KILL_AT_FULL"]):
        if not only_direct or fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            seen["writes"] += 1
        if seen["writes"] == int(os.environ["KILL_AT_WRITE"]):
            os.kill(os.getpid(), signal.SIGKILL)
    real_pwrite(fd, data, offset)
checkpointer.save_streamed, stream._pwrite_all = counting, dying
from flowrec.cli import main
sys.argv = ["flowrec", *sys.argv[1:]]
main()
"""


@pytest.mark.parametrize("kill_in, at_write", [("any", 40), ("direct", 7)])
def test_a_kill_during_a_streamed_full_write_keeps_the_chain_and_resumes_bitwise_equal(spec: Path, tmp_path: Path,
                                                                                      kill_in: str, at_write: int):
    """SIGKILL in the middle of the second full checkpoint's write: at its 40th write of any kind,
    or at the 7th block written around the page cache (O_DIRECT, on the writer's I/O thread)."""
    if kill_in == "direct" and not DirectFile.open(_probe(tmp_path)).usable:
        pytest.skip("this file system refuses O_DIRECT")
    _train(spec, tmp_path / "full")
    run = tmp_path / "inc"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KILL_AT_FULL": "2", "KILL_IN": kill_in,
           "KILL_AT_WRITE": str(at_write)}
    argv = [sys.executable, "-c", textwrap.dedent(STREAM_KILLER), "train", str(spec), "--rows", "600", "--out",
            str(run), "--quiet", "--checkpoint-every", "5", "--checkpoint-full-every", "4"]
    killed = run_bounded(argv, cwd=tmp_path, env=env, timeout_s=RUN_TIMEOUT_S, capture_output=True)
    assert killed.returncode == -9, killed.stderr.decode()
    assert list(run.glob(".ckpt-*.tmp"))  # the kill left part of the second full checkpoint behind
    # full at step 5, deltas at 10, 15, 20; the full one of step 25 died while its tables were written
    assert load_checkpoint(run)["position"]["step"] == 20 and len(delta_files(run / "checkpoint.pt")) == 3
    resumed = run_bounded([sys.executable, "-m", "flowrec", "train", str(spec), "--resume", str(run),
                           "--quiet"], cwd=tmp_path, env=env, timeout_s=RUN_TIMEOUT_S, capture_output=True)
    assert resumed.returncode == 0, resumed.stderr.decode()
    _assert_same_run(load_checkpoint(tmp_path / "full"), load_checkpoint(run))
    assert not list(run.glob(".ckpt-*"))


def _probe(folder: Path) -> Path:
    probe = folder / "probe"
    probe.write_bytes(b"")
    return probe


def test_metrics_list_the_stall_of_every_checkpoint(spec: Path, tmp_path: Path):
    run = tmp_path / "inc"
    _train(spec, run, "--checkpoint-full-every", "4", "--max-steps", "20")
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    during = [r for r in records if r["event"] == "checkpoint"]
    assert [r["step"] for r in during] == [5, 10, 15, 20]
    end = records[-1]
    assert end["event"] == "end"
    stalls = end["checkpoint_stalls"]
    # step 20's checkpoint is the periodic one (the end takes none of the same step), then the wait
    assert [s["step"] for s in stalls] == [5, 10, 15, 20, 20] and stalls[-1]["wait"]
    assert all(s["stall_s"] >= 0 for s in stalls)
    assert abs(sum(s["stall_s"] for s in stalls) - end["stage_seconds"]["checkpoint"]) < 1e-9
    assert len(end["checkpoint_extra_bytes"]) == 1 and min(end["checkpoint_extra_bytes"]) > 0  # full at 5


def _holding_first_table_write(held: threading.Event, released: threading.Event, real_pwrite):
    """A `stream._pwrite_all` that sets `held` at the first write past the archive's start (inside
    the tables) and waits there until `released` (at most RUN_TIMEOUT_S)."""
    def holding(fd, data, offset):
        if not released.is_set() and not held.is_set() and offset > 0:
            held.set()
            released.wait(RUN_TIMEOUT_S)
        real_pwrite(fd, data, offset)
    return holding


def test_the_default_auto_writes_a_delta_while_the_full_write_is_going_and_full_ones_after(
        spec: Path, tmp_path: Path, monkeypatch):
    """`--checkpoint-full-every auto` (the default): the full checkpoint of step 5 is held in its
    write until training reaches step 12, so the checkpoint of step 10 finds it in flight and is
    a delta on it (training does not wait); once that write is on disk (awaited at step 13) and
    with no rest after it (AUTO_REST 0 here), the checkpoint of step 15 is a full one again. The run ends bitwise equal to one written inline,
    and `--resume` from the chain continues it like an uninterrupted run."""
    held, released, done = threading.Event(), threading.Event(), threading.Event()
    steps: list[int] = []
    kinds: list[tuple[str, int]] = []
    real_pwrite, real_step = stream._pwrite_all, trainer.train_step
    holding = _holding_first_table_write(held, released, real_pwrite)
    real_full, real_delta = checkpointer.Checkpointer._save_full, checkpointer.Checkpointer._save_delta
    real_snapshot = checkpointer.Checkpointer._write_snapshot

    def stepping(*args):
        steps.append(1)
        if len(steps) == 12:
            released.set()
        if len(steps) == 13:
            assert done.wait(RUN_TIMEOUT_S), "the held full write never ended"
        return real_step(*args)

    def full(self, state, embeddings, step):
        kinds.append(("full", step))
        return real_full(self, state, embeddings, step)

    def delta(self, state, embeddings, step):
        kinds.append(("delta", step))
        return real_delta(self, state, embeddings, step)

    def snapshot(self, *args):
        try:
            return real_snapshot(self, *args)
        finally:
            done.set()

    monkeypatch.setattr(stream, "_pwrite_all", holding)
    monkeypatch.setattr(trainer, "train_step", stepping)
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_full", full)
    monkeypatch.setattr(checkpointer.Checkpointer, "_save_delta", delta)
    monkeypatch.setattr(checkpointer.Checkpointer, "_write_snapshot", snapshot)
    monkeypatch.setattr(checkpointer, "AUTO_REST", 0.0)  # the held write's time: no rest after it
    run = tmp_path / "auto"
    _train(spec, run, "--max-steps", "20")
    assert held.is_set() and released.is_set()
    assert kinds[:3] == [("full", 5), ("delta", 10), ("full", 15)], kinds
    assert json.loads((run / "run.json").read_text())["checkpoint_full_every"] == 0  # auto, recorded
    for name, value in (("_pwrite_all", real_pwrite),):
        monkeypatch.setattr(stream, name, value)
    monkeypatch.setattr(trainer, "train_step", real_step)
    monkeypatch.setenv(CHECKPOINT_WRITES_ENV, "inline")
    _train(spec, tmp_path / "inline", "--max-steps", "20")
    _assert_same_run(load_checkpoint(tmp_path / "inline"), load_checkpoint(run))
    monkeypatch.delenv(CHECKPOINT_WRITES_ENV)
    _train(spec, tmp_path / "whole", "--max-steps", "30")
    _train(spec, run, "--resume", str(run), "--max-steps", "30")
    _assert_same_run(load_checkpoint(tmp_path / "whole"), load_checkpoint(run))


def test_checkpoint_full_every_takes_auto_or_a_positive_whole_number(spec: Path, tmp_path: Path):
    for bad in ("0", "-1", "often", "1.5", "\u00b2"):
        result = runner.invoke(app, ["train", str(spec), "--rows", "600", "--out", str(tmp_path / "x"), "--quiet",
                                     "--checkpoint-full-every", bad])
        assert result.exit_code == 2, (bad, result.output)
        assert "--checkpoint-full-every must be auto or a whole number" in result.output
        assert not (tmp_path / "x").exists()  # refused before the run folder is made
    run = tmp_path / "three"
    _train(spec, run, "--max-steps", "20", "--checkpoint-full-every", "AUTO")
    assert json.loads((run / "run.json").read_text())["checkpoint_full_every"] == 0
    result = _train(spec, run, "--resume", str(run), "--max-steps", "25", "--checkpoint-full-every", "3")
    assert "--checkpoint-full-every 3 overrides the run's --checkpoint-full-every auto" in result.output


def test_the_default_run_trains_on_while_its_full_checkpoint_is_written(spec: Path, tmp_path: Path, monkeypatch):
    """K = 1: the full checkpoint of step 5 is written in the background. Its write
    is held in the middle of the tables until training has run three more steps (steps 6-8: so
    training did not wait for it); the file then holds exactly the state of step 5, the run ends
    bitwise equal to one written inline (FLOWREC_CHECKPOINT_WRITES=inline), and metrics list
    every full checkpoint as streamed from a snapshot (`checkpoint_extra_bytes`)."""
    monkeypatch.setattr(incremental, "SNAPSHOT_CHUNK_BYTES", 64)  # many chunks: held inside the tables
    held, released = threading.Event(), threading.Event()
    trained_while_held: list[int] = []
    real_pwrite, real_step, real_remove = stream._pwrite_all, trainer.train_step, checkpointer.remove_deltas
    holding = _holding_first_table_write(held, released, real_pwrite)
    first_file = tmp_path / "step5.pt"

    def stepping(*args):
        if held.is_set() and not released.is_set():
            trained_while_held.append(1)
            if len(trained_while_held) == 3:
                released.set()
        return real_step(*args)

    def keeping_the_first(path):  # called once a full checkpoint is on disk
        if not first_file.exists():
            shutil.copy(path, first_file)
        real_remove(path)

    monkeypatch.setattr(stream, "_pwrite_all", holding)
    monkeypatch.setattr(trainer, "train_step", stepping)
    monkeypatch.setattr(checkpointer, "remove_deltas", keeping_the_first)
    run = tmp_path / "bg"
    _train(spec, run, "--max-steps", "20", "--checkpoint-full-every", "1")
    assert held.is_set() and len(trained_while_held) == 3  # released by training, not by a timeout
    monkeypatch.setattr(stream, "_pwrite_all", real_pwrite)
    monkeypatch.setattr(trainer, "train_step", real_step)
    monkeypatch.setattr(checkpointer, "remove_deltas", real_remove)
    monkeypatch.setenv(CHECKPOINT_WRITES_ENV, "inline")
    _train(spec, tmp_path / "inline5", "--max-steps", "5")
    _train(spec, tmp_path / "inline", "--max-steps", "20")
    assert torch.load(first_file, weights_only=True)["position"]["step"] == 5
    _assert_same_run(load_checkpoint(tmp_path / "inline5"), load_checkpoint(first_file))
    _assert_same_run(load_checkpoint(tmp_path / "inline"), load_checkpoint(run))
    ends = {name: [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()][-1]
            for name in ("bg", "inline")}
    assert [s["step"] for s in ends["bg"]["checkpoint_stalls"]] == [5, 10, 15, 20, 20]  # the end's wait
    assert len(ends["bg"]["checkpoint_writes_s"]["full"]) == 4  # 5, 10, 15, 20 (the end's: step 20's)
    extra = ends["bg"]["checkpoint_extra_bytes"]
    assert len(extra) == 4 and min(extra) > 0  # every full checkpoint streamed from a snapshot
    assert ends["inline"]["checkpoint_extra_bytes"] == []  # inline: serialized whole, no snapshot
    assert not delta_files(run / "checkpoint.pt")


def test_eval_and_export_read_base_and_deltas(spec: Path, tmp_path: Path):
    _train(spec, tmp_path / "full")
    _train(spec, tmp_path / "inc", "--checkpoint-full-every", "4")
    assert delta_files(tmp_path / "inc" / "checkpoint.pt")
    trained = [load_trained(tmp_path / name, "cpu", scoring_plan) for name in ("full", "inc")]
    a, b = (t.model.state_dict() for t in trained)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    exported = runner.invoke(app, ["export", str(tmp_path / "inc"), str(tmp_path / "inc_pkg")])
    assert exported.exit_code == 0, exported.output
    served = torch.export.load(tmp_path / "inc_pkg" / "model.pt2").module().state_dict()
    reference = ServingModel(trained[0].spec, trained[0].model).state_dict()
    differ = [k for k in served if not torch.equal(served[k], reference[k])]
    assert served.keys() == reference.keys() and not differ, differ


def test_a_load_while_the_run_replaces_its_base_reads_the_new_checkpoint(spec: Path, tmp_path: Path, monkeypatch):
    # `flowrec eval RUN` while RUN trains: between the load's read of checkpoint.pt and of its deltas
    # the run put a new full checkpoint in place and removed the old one's deltas ("cannot read
    # RUN/checkpoint.delta-000012.pt: No such file or directory")
    run, later = tmp_path / "inc", tmp_path / "later"
    _train(spec, run, "--checkpoint-full-every", "4", "--max-steps", "15")
    _train(spec, later, "--checkpoint-full-every", "1", "--max-steps", "20")
    base = run / "checkpoint.pt"
    assert delta_files(base)  # base and deltas
    real_read, replaced = chain.read_torch_file, []

    def writer_goes_on(path, *args, **kwargs):  # what the run's writer does, just before this read
        if not replaced:
            replaced.append(path)
            os.replace(later / "checkpoint.pt", base)
            chain.remove_deltas(base)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(chain, "read_torch_file", writer_goes_on)
    assert load_checkpoint(run)["position"]["step"] == 20
    assert replaced == [delta_path(base, 1)]


def test_a_load_of_the_new_base_while_the_run_removes_the_old_deltas_reads_it(spec: Path, tmp_path: Path,
                                                                             monkeypatch):
    # `flowrec eval RUN` while RUN trains: the load read the new checkpoint.pt, listed the old base's deltas
    # the run had not removed yet, and the run removed them before the load read one: "cannot read
    # RUN/checkpoint.delta-000001.pt: No such file or directory; removing checkpoint.delta-000001.pt ...
    # from RUN leaves the checkpoint before it", though the checkpoint in place was whole
    run, later = tmp_path / "inc", tmp_path / "later"
    _train(spec, run, "--checkpoint-full-every", "4", "--max-steps", "15")
    _train(spec, later, "--checkpoint-full-every", "1", "--max-steps", "20")
    base = run / "checkpoint.pt"
    assert delta_files(base)
    os.replace(later / "checkpoint.pt", base)  # the new base is in place, the old one's deltas not yet removed
    real_read, removed = chain.read_torch_file, []

    def writer_goes_on(path, *args, **kwargs):  # the run's writer removes them just before this read
        if not removed:
            removed.append(path)
            chain.remove_deltas(base)
        return real_read(path, *args, **kwargs)

    monkeypatch.setattr(chain, "read_torch_file", writer_goes_on)
    assert load_checkpoint(run)["position"]["step"] == 20
    assert removed == [delta_path(base, 1)]


def test_stale_damaged_and_missing_deltas(spec: Path, tmp_path: Path):
    run = tmp_path / "inc"
    _train(spec, run, "--checkpoint-full-every", "4", "--max-steps", "15")
    base = run / "checkpoint.pt"
    step15 = load_checkpoint(run)
    stale = delta_path(base, 3)
    delta = torch.load(delta_path(base, 2), weights_only=True)
    other = {k: v for k, v in delta.items() if k != "digest"} | {"base": "0" * 64, "sequence": 3}
    torch.save({**other, "digest": content_digest(other)}, stale)  # a delta of another base
    assert load_checkpoint(run)["position"] == step15["position"]
    stale.unlink()
    delta_path(base, 1).unlink()
    with pytest.raises(CheckpointError, match="delta-000002.pt does not follow delta 0"):
        load_checkpoint(run)
    data = bytearray(delta_path(base, 2).read_bytes())
    data[len(data) // 2] ^= 0xFF
    delta_path(base, 2).write_bytes(bytes(data))
    result = runner.invoke(app, ["export", str(run), str(tmp_path / "x.pt")])
    assert result.exit_code == 2 and "delta-000002.pt is damaged" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "x.pt").exists()


def test_a_damaged_delta_names_the_files_whose_removal_resumes_from_the_checkpoint_before_it(spec: Path,
                                                                                             tmp_path: Path):
    # the refusal named the damaged delta only; removing it and the deltas after it resumes
    run = tmp_path / "inc"
    _train(spec, run, "--checkpoint-full-every", "4", "--max-steps", "15")  # full at 5, deltas at 10 and 15
    first = delta_path(run / "checkpoint.pt", 1)
    first.write_bytes(first.read_bytes()[:200])
    refused = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "20", "--quiet"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output, refused.output
    deltas = [path for _, path in delta_files(run / "checkpoint.pt")]
    assert len(deltas) >= 2
    named = f"{', '.join(p.name for p in deltas[:-1])} and {deltas[-1].name}"
    hint = f"removing {named} from {run} leaves the checkpoint before it (step 5)"
    assert hint in refused.output.replace("\n", " "), refused.output
    for path in deltas:
        path.unlink()
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "20"])
    assert resumed.exit_code == 0, resumed.output
    assert "(step 5)" in resumed.output and load_checkpoint(run)["position"]["step"] == 20
