"""tools/gpu_lease.py: the steps of a short GPU lease run in order inside the budget, a step past its
limit is stopped with its children, the sweep's shards are dealt and merged, and without CUDA it
runs nothing."""
from __future__ import annotations

import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_lease", REPO / "tools" / "gpu_lease.py")
gpu_lease = importlib.util.module_from_spec(_spec)
sys.modules["gpu_lease"] = gpu_lease  # its dataclasses look their module up
_spec.loader.exec_module(gpu_lease)


def test_cases_are_dealt_round_robin_into_non_empty_shards():
    ids = [f"case{i}" for i in range(7)]
    shards = gpu_lease.shard(ids, 3)
    assert shards == [["case0", "case3", "case6"], ["case1", "case4"], ["case2", "case5"]]
    assert gpu_lease.shard(ids[:2], 6) == [["case0"], ["case1"]]


def test_shard_files_are_merged_and_a_missing_one_is_left_out(tmp_path):
    (tmp_path / "shard0.json").write_text(json.dumps({"device": "NVIDIA H100", "specs": [{"spec": "a"}, {"spec": "b"}]}))
    (tmp_path / "shard2.json").write_text(json.dumps({"device": "NVIDIA H100", "specs": [{"spec": "c"}]}))
    merged = gpu_lease.merge_shards([tmp_path / f"shard{k}.json" for k in range(3)])
    assert [r["spec"] for r in merged["specs"]] == ["a", "b", "c"]
    assert merged["device"] == "NVIDIA H100" and merged["shards"] == 3


def test_steps_run_in_order_and_the_budget_stops_and_skips(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_lease, "MIN_STEP_S", 0.5)
    pid_file, own_pid_file = tmp_path / "child.pid", tmp_path / "own_session.pid"
    # the slow step starts a child of its own, and one in a session of its own deaf to SIGTERM (as
    # torch's launcher starts its ranks: out of reach of a kill of the group), and outlives the
    # budget: all three must be stopped
    deaf = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"
    slow = ("import subprocess, sys, time\n"
            f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
            f"q = subprocess.Popen([sys.executable, '-c', {deaf!r}], start_new_session=True)\n"
            f"open({str(own_pid_file)!r}, 'w').write(str(q.pid))\n"
            f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
            "print('slow started', flush=True)\n"
            "time.sleep(60)\n")
    seen = []
    steps = [gpu_lease.Step("first", 30, call=lambda lease, limit, log: seen.append(limit) or 0),
             gpu_lease.Step("failing", 30, argv=lambda lease: [sys.executable, "-c", "raise SystemExit(3)"]),
             gpu_lease.Step("slow", 60, argv=lambda lease: [sys.executable, "-c", slow]),
             gpu_lease.Step("after", 30, call=lambda lease, limit, log: seen.append("after ran") or 0)]
    out = tmp_path / "out"
    out.mkdir()
    lease = gpu_lease.Lease(out, "cpu", 10.0, 2, 10, 1, tmp_path)  # room for three Python starts on a loaded machine
    log = gpu_lease.Log(out / "log.txt")
    began = time.monotonic()
    outcomes = gpu_lease.run_lease(lease, steps, log)
    log.close()
    assert time.monotonic() - began < 30  # the slow step was stopped at the budget, not after its 60 s
    assert [o.name for o in outcomes] == ["first", "failing", "slow", "after"]
    assert outcomes[0].status == "ok" and 0 < seen[0] <= 10.0
    assert outcomes[1].status == "failed (exit 3)"
    assert outcomes[2].status.startswith("timed out")
    assert outcomes[3].status == "skipped (budget)" and "after ran" not in seen
    text = (out / "log.txt").read_text()
    assert "slow started" in text and "=== after: skipped" in text
    for child in (int(pid_file.read_text()), int(own_pid_file.read_text())):
        for _ in range(50):  # the SIGTERM or SIGKILL reached it when the step stopped; allow it to be reaped
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break
            stat = Path(f"/proc/{child}/stat")
            if stat.is_file() and stat.read_text().rsplit(")", 1)[1].split()[0] == "Z":
                break  # a zombie waiting for init: dead
            time.sleep(0.1)
        else:
            pytest.fail(f"the slow step's child {child} outlived the step")


def test_the_bf16_spec_is_the_dlrm_spec_in_bf16(tmp_path):
    from flowrec.spec import load_spec

    lease = gpu_lease.Lease(tmp_path, "cpu", 10.0, 1, 10, 1, tmp_path)
    made = load_spec(gpu_lease.bf16_spec(lease))
    plain = load_spec(REPO / gpu_lease.SPEC)
    assert made.training.precision == "bf16" and plain.training.precision == "fp32"
    assert [f.name for f in made.features] == [f.name for f in plain.features]


def test_without_cuda_it_runs_nothing(tmp_path, monkeypatch, capsys):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gpu_lease.main(["--out", str(tmp_path / "out")]) == 2
    assert "no CUDA device" in capsys.readouterr().out
    assert not (tmp_path / "out").exists()


def test_a_folder_with_files_is_refused(tmp_path):
    (tmp_path / "log.txt").write_text("an earlier lease\n")
    with pytest.raises(SystemExit) as stop:
        gpu_lease.main(["--out", str(tmp_path), "--device", "cpu"])
    assert stop.value.code == 2
    assert (tmp_path / "log.txt").read_text() == "an earlier lease\n"


def test_an_unknown_step_name_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        gpu_lease.main(["--out", str(tmp_path / "out"), "--device", "cpu", "--only", "sweep,nonsense"])
    assert "nonsense" in capsys.readouterr().err
