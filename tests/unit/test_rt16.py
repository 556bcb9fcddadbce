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


@pytest.mark.parametrize("below", ["", "sub/run"])
def test_a_run_folder_through_a_dangling_link_names_the_link_and_its_missing_target(
        tmp_path: Path, below: str) -> None:
    """`--out`/`out=` a symbolic link whose target is gone said "cannot create run folder dangling:
    File exists" of a name that holds nothing: the line names the link, where it leads, and what to do;
    nothing is made, the link stays as it was."""
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runtime.rundir import RunFolderError

    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / "gone")
    out = link / below if below else link
    with pytest.raises(RunFolderError) as caught:
        claim_run_folder(out, None, False, "wide_deep")
    assert str(caught.value) == (f"cannot create run folder {out}: {link} is a symbolic link to "
                                 f"{str(tmp_path / 'gone')!r}, which does not exist; create the folder it names, "
                                 "or remove the link, or give another folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling"] and link.is_symlink()


def test_a_link_to_a_dangling_link_says_it_leads_to_no_folder(tmp_path: Path) -> None:
    from flowrec.runtime.rundir import RunFolderError, open_folder

    (tmp_path / "first").symlink_to("gone")
    (tmp_path / "second").symlink_to("first")
    with pytest.raises(RunFolderError, match=r"second is a symbolic link to 'first', which leads to no folder"):
        open_folder(tmp_path / "second")
