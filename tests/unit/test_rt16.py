"""Small defects a hostile Python user found in the runtime (devices, run folders, their locks, the
session's data lines) and in specs built in Python: each one line naming what to do, nothing left."""
from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app

SPECS = Path(__file__).resolve().parents[2] / "specs"


@pytest.mark.parametrize("device", ["meta", "mps", "xpu", "meta:0"])
def test_a_device_torch_reads_but_flowrec_does_not_run_on_is_refused_before_the_run_folder(
        tmp_path: Path, device: str) -> None:
    """`flowrec train SPEC --device meta` trained into torch's traceback ('Tensor.item() cannot be
    called on meta tensors') and left a run folder of data, plan and metrics behind; mps and xpu, which
    this torch names but flowrec never runs on, did likewise."""
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(SPECS / "wide_deep.yaml"), "--device", device,
                                      "--rows", "200", "--out", str(out)])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert lines == [f"error: --device must be auto, cpu or cuda[:N], not {device!r}: flowrec trains and scores "
                     "on the CPU or a CUDA GPU"], result.output
    assert not out.exists()
    eval_result = CliRunner().invoke(app, ["eval", str(tmp_path / "no-run"), "--device", device])
    assert eval_result.exit_code == 2 and "flowrec trains and scores on the CPU or a CUDA GPU" in eval_result.output
