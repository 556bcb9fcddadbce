"""`flowrec doctor`: a real run on this machine (exit 0, what it could not check listed), and the
exit status and text of a failing report."""
from __future__ import annotations

import json

import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.cli.doctor_cmd import text_lines
from flowrec.measure import doctor
from flowrec.measure.doctor import Check, DoctorReport

runner = CliRunner()


def test_doctor_on_this_machine():
    result = runner.invoke(app, ["doctor", "--json"])
    report = json.loads(result.stdout)
    assert result.exit_code == 0, report
    assert report["ok"] and report["versions"]["torch"] == torch.__version__
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["train/cpu"]["status"] == "pass" and "reference" in checks["train/cpu"]["detail"]
    assert checks["collective/gloo"]["status"] == "pass" and "= 3.0" in checks["collective/gloo"]["detail"]
    assert checks["kernels"]["status"] in ("pass", "skip")
    assert report["devices"][0]["device"] == "cpu"
    from operators.onednn import cpu_vendor, gemm_library
    assert report["devices"][0]["gemm"] == gemm_library() and report["devices"][0]["vendor"] == (cpu_vendor() or "unknown")
    from flowrec.cli.doctor_cmd import text_lines
    assert any(f"fp32 GEMMs by {gemm_library()}" in line for line in text_lines(report))
    if not torch.cuda.is_available():
        assert {"train/cuda", "collective/nccl"} <= {c.split(":")[0] for c in report["not_checked"]}


def _failing() -> DoctorReport:
    return DoctorReport({"torch": "2", "torch_cuda": None, "nvrtc": None}, (
        {"device": "cpu", "name": "x86", "cores": 2, "memory_bytes": 2**31},), (
        Check("kernels", "skip", "NVRTC not usable"), Check("train/cpu", "fail", "ops.x differs", 1.0)))


def test_a_failed_check_exits_1_and_says_so(monkeypatch):
    monkeypatch.setattr(doctor, "run_doctor", lambda plan_of, status: _failing())
    result = runner.invoke(app, ["doctor"])
    assert result.exit_code == 1
    assert "FAIL train/cpu" in result.stdout and "some checks FAILED" in result.stdout
    assert "not checked here: kernels: NVRTC not usable" in result.stdout
    assert "none (a CPU build of torch)" in result.stdout


def test_report_is_ok_only_without_failures():
    report = _failing()
    assert not report.ok
    fixed = DoctorReport(report.versions, report.devices, (report.checks[0],))
    assert fixed.ok and text_lines(fixed.to_dict())[-1] == "all checks that ran passed"


def test_a_crashing_check_is_a_failure_with_its_message():
    def boom():
        raise RuntimeError("CUDA error: device-side assert\nmore")

    check = doctor.timed("train/cuda:0", boom)
    assert check.status == "fail" and check.detail == "RuntimeError: CUDA error: device-side assert"


def test_a_collective_that_cannot_start_fails():
    status, detail = doctor.check_collective("no-such-backend")
    assert status == "fail" and "rank 0: exit" in detail
