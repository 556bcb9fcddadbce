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


@pytest.mark.parametrize("below, gone", [("", "gone"), ("sub/run", "gone"), ("", "a-long-name-" * 12)])
def test_a_run_folder_through_a_dangling_link_names_the_link_and_its_missing_target(
        tmp_path: Path, below: str, gone: str) -> None:
    """`--out`/`out=` a symbolic link whose target is gone said "cannot create run folder dangling:
    File exists" of a name that holds nothing: the line names the link, where it leads, and what to do;
    nothing is made, the link stays as it was. The target is named whole, however long (CI's
    temporary folders are longer than a laptop's)."""
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runtime.rundir import RunFolderError

    link = tmp_path / "dangling"
    link.symlink_to(tmp_path / gone)
    out = link / below if below else link
    with pytest.raises(RunFolderError) as caught:
        claim_run_folder(out, None, False, "wide_deep")
    assert str(caught.value) == (f"cannot create run folder {out}: {link} is a symbolic link to "
                                 f"{str(tmp_path / gone)!r}, which does not exist; create the folder it names, "
                                 "or remove the link, or give another folder")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dangling"] and link.is_symlink()


def test_a_link_to_a_dangling_link_says_it_leads_to_no_folder(tmp_path: Path) -> None:
    from flowrec.runtime.rundir import RunFolderError, open_folder

    (tmp_path / "first").symlink_to("gone")
    (tmp_path / "second").symlink_to("first")
    with pytest.raises(RunFolderError, match=r"second is a symbolic link to 'first', which leads to no folder"):
        open_folder(tmp_path / "second")


def test_a_run_folder_locked_by_this_same_process_says_so(tmp_path: Path) -> None:
    """A second thread training into a run's folder, or `flowrec.train()` called from a callback into
    its own folder, was told the folder was "in use by another flowrec run (pid N)", N being its own
    pid: the line says it is this process, another call of the same program."""
    import os

    from flowrec.runs.folder import claim_run_folder
    from flowrec.runtime.rundir import RunFolderError, RunLock
    from flowrec.testing.processes import call_within

    run = tmp_path / "run"
    run.mkdir()
    held = RunLock.acquire(run)
    try:
        def second_call() -> str:  # on a thread of its own, as a second training thread would
            try:
                claim_run_folder(run, None, True, "wide_deep")
            except RunFolderError as exc:
                return str(exc)
            return "not refused"

        line = call_within(60, second_call)
    finally:
        held.release()
    assert line == (f"run folder {run} is in use by this same process (pid {os.getpid()}), not another flowrec "
                    "run: another call of this program (a thread, or a callback of the run) holds it; let that "
                    "call end first, or give another folder")
    RunLock.acquire(run).release()  # released: the next call gets it


def test_a_run_folder_locked_by_another_process_still_names_it_another_run(tmp_path: Path) -> None:
    """The same lock held by another process (its pid in the lock file, as a run writes it) is still
    another flowrec run's."""
    import subprocess
    import sys

    from flowrec.runtime.rundir import LOCK_NAME, RunFolderError, RunLock
    from flowrec.testing.processes import communicate_bounded, readline_bounded

    run = tmp_path / "run"
    run.mkdir()
    hold = ("import fcntl, os, sys; fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT); "
            "fcntl.flock(fd, fcntl.LOCK_EX); os.write(fd, f'{os.getpid()}\\n'.encode()); "
            "print('held', flush=True); sys.stdin.read()")
    child = subprocess.Popen([sys.executable, "-c", hold, str(run / LOCK_NAME)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert readline_bounded(child, child.stdout, 60) == "held\n"
        with pytest.raises(RunFolderError) as caught:
            RunLock.acquire(run)
    finally:
        communicate_bounded(child, 60, input="")
    assert str(caught.value) == f"run folder {run} is in use by another flowrec run (pid {child.pid})"


def test_evaluation_data_without_training_data_is_said_in_the_callers_words(tmp_path: Path) -> None:
    """`flowrec.train(spec, eval_data=DIR)` on synthetic rows was told to give the training data
    "(--data, data=, or data bound in the spec)", a flag of the command line among the keywords:
    Python reads `data=`, `flowrec train` reads `--data`."""
    import flowrec
    from flowrec.data.layout import DataError

    spec, held = SPECS / "dlrm_criteo.yaml", tmp_path / "held"
    with pytest.raises(DataError) as caught:
        flowrec.train(spec, eval_data=held, rows=200, max_steps=1, out=tmp_path / "py")
    assert str(caught.value) == (f"evaluation data {held} needs training data encoded alike: give the training "
                                 "data too (data=, or data bound in the spec), not synthetic rows")
    result = CliRunner().invoke(app, ["train", str(spec), "--eval-data", str(held), "--rows", "200",
                                      "--max-steps", "1", "--out", str(tmp_path / "cli")])
    assert result.exit_code == 2, result.output
    assert "give the training data too (--data, or data bound in the spec)" in result.output


def _tiny_doc() -> dict:
    import copy

    from flowrec.testing.specs import TINY

    return copy.deepcopy(TINY)


def test_a_dict_spec_with_numpy_numbers_takes_their_python_values() -> None:
    """A spec built in Python from arrays (`np.int64(8)` as a dim, `np.float32` as a learning rate)
    was told "(got a int64; quote text)", YAML's wording of a date: the values are taken as the
    Python numbers they are, and the spec round-trips as JSON."""
    import json

    import numpy as np

    from flowrec.spec.load import spec_from_dict, to_dict
    from flowrec.spec.validate import validate_document

    plain, doc = _tiny_doc(), _tiny_doc()
    plain["optimizer"]["dense"]["lr"] = 0.5
    plain["training"]["batch_size"] = 64
    doc["tables"][0]["dim"] = np.int64(plain["tables"][0]["dim"])
    doc["optimizer"]["dense"]["lr"] = np.float32(0.5)
    doc["training"]["batch_size"] = np.int32(64)
    spec = spec_from_dict(doc)
    assert spec == spec_from_dict(plain)
    assert type(spec.tables[0].dim) is int and type(spec.training.batch_size) is int
    assert type(doc["tables"][0]["dim"]) is np.int64  # the caller's document is left as it was
    assert spec_from_dict(json.loads(json.dumps(to_dict(spec)))) == spec
    assert validate_document(to_dict(spec)) == validate_document(to_dict(spec_from_dict(plain)))


def test_python_values_a_spec_cannot_hold_are_said_in_python_words() -> None:
    """A ModelSpec holding a numpy number (built with it, or `dataclasses.replace`), or a spec given a
    class object, read "(got a int64; quote text)" and "(got a type; quote text)": each line says
    what to give instead, in Python's words."""
    import numpy as np

    from flowrec.spec.validate import validate_document

    class Tower:
        pass

    doc = _tiny_doc()
    doc["tables"][0]["dim"] = np.int64(8)
    doc["training"]["deterministic"] = np.bool_(True)
    doc["modules"][0]["layers"] = Tower
    doc["modules"][0]["inputs"] = ("@dense",)
    said = {i.path: i.message for i in validate_document(doc)}
    assert said["tables[0].dim"] == "must be a Python int, not numpy.int64 (8): give int(x)"
    assert said["training.deterministic"] == f"must be a Python bool, not numpy.{type(np.bool_(True)).__name__} (True): give bool(x)"
    assert said["modules[0].layers"] == (
        "must be text, a number, True / False, None, a list or a dict, not the class "
        f"{Tower.__qualname__}: give its class path as text ('{__name__}.{Tower.__qualname__}')")
    assert said["modules[0].inputs"] == "must be a list, not a tuple: give a list"
    assert not any("quote text" in message for message in said.values())


def test_a_dict_spec_with_a_number_that_is_not_finite_is_refused_naming_its_path() -> None:
    """`spec_from_dict` took a NaN batch_size and an infinite lr, which `flowrec.train` refused
    later: they are refused at once, each line naming its key's path."""
    from flowrec.spec.errors import SpecError
    from flowrec.spec.load import spec_from_dict

    doc = _tiny_doc()
    doc["training"]["batch_size"] = float("nan")
    doc["optimizer"]["sparse"]["lr"] = float("inf")
    with pytest.raises(SpecError) as caught:
        spec_from_dict(doc)
    assert [str(i) for i in caught.value.issues] == ["optimizer.sparse.lr: must be a finite number, not inf",
                                                    "training.batch_size: must be a finite number, not nan"]
