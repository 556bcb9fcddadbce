"""bf16 on a CPU without bf16 matrix kernels (an AVX2-only CPU: oneDNN emulates them) made the DLRM
step 24x slower than fp32 without a word; `flowrec train` now warns at start, and `flowrec doctor`
says bf16 is emulated. The probe is oneDNN's own (`bf16_native`)."""
from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

import operators.device as device_module
from flowrec.cli import app
from flowrec.testing.specs import run_spec

runner = CliRunner()


@pytest.mark.parametrize("native", [False, True])
def test_train_warns_of_bf16_without_bf16_kernels(tmp_path, monkeypatch, native):
    monkeypatch.setattr(device_module, "bf16_native", lambda device: native)
    spec = tmp_path / "spec.yaml"
    spec.write_text(run_spec("bf16_note", epochs=1).replace("seed: 5}", "seed: 5, precision: bf16}"))
    assert "precision: bf16" in spec.read_text()
    result = runner.invoke(app, ["train", str(spec), "--rows", "200", "--out", str(tmp_path / "run"), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    warned = result.stderr.count("warning: training.precision is bf16, but this CPU has no bf16 matrix kernels")
    assert warned == (0 if native else 1), result.stderr
    assert "data: synthetic, 200 train" in result.stderr  # the data note is still said, not replaced


def test_fp32_is_never_warned(tmp_path, monkeypatch):
    from flowrec.runtime.session import precision_note

    monkeypatch.setattr(device_module, "bf16_native", lambda device: False)
    assert precision_note("fp32", torch.device("cpu")) is None
    note = precision_note("bf16", torch.device("cpu"))
    assert "set training.precision: fp32" in note and "no faster than fp32" in note


def test_the_probe_is_onednns_and_doctor_reports_it(monkeypatch):
    from flowrec.cli.doctor_cmd import text_lines
    from flowrec.measure.doctor import devices

    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    if probe is None:
        pytest.skip("this torch has no oneDNN bf16 probe")
    assert device_module.bf16_native(torch.device("cpu")) is bool(probe())
    cpu = devices()[0]
    assert cpu["bf16"] == ("native" if probe() else "emulated")
    for mode in ("native", "emulated"):
        report = {"versions": {}, "devices": [{**cpu, "bf16": mode}], "checks": [], "not_checked": [], "ok": True}
        line = next(x for x in text_lines(report) if x.strip().startswith("cpu"))
        assert ("bf16 emulated" in line) is (mode == "emulated"), line
