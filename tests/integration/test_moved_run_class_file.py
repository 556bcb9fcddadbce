"""A run of a custom module from a file records the file absolute; a run folder moved with its class
file (`rsync -a work/ other:`) failed `flowrec eval RUN`, `export`, `train --resume` and
`train --init-from` on the absolute path that is gone. The file is now looked for by its trailing
names in the run folder, the folders above it and the working folder, checked against the sha256 run.json records (a different
file is one line, exit 2), and the file used is said in one line."""
from __future__ import annotations

import json
import random
import shutil
import textwrap
import warnings
from pathlib import Path

import pytest
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint

BLOCKS = textwrap.dedent('''
    import torch
    from torch import nn


    class Gate(nn.Module):
        def __init__(self, in_features, rank):
            super().__init__()
            self.gate = nn.Linear(in_features, in_features)
            self.down = nn.Linear(in_features, rank)

        def forward(self, x):
            return torch.relu(self.down(x * torch.sigmoid(self.gate(x))))
''')
SPEC = """
name: moved
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user_id, type: categorical, hash_buckets: 400, dim: 8}
  - {name: item_id, type: categorical, hash_buckets: 300, dim: 8}
modules:
  - {name: bottom, kind: mlp, inputs: ["@sparse", price], layers: [16]}
  - {name: mine, kind: custom, class: "lib/blocks.py:Gate", inputs: [bottom], params: {in_features: 16, rank: 4}}
  - {name: top, kind: mlp, inputs: [mine, bottom], layers: [8]}
heads:
  - {name: click, input: top}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adagrad, lr: 0.05}
training: {batch_size: 128, seed: 0}
"""
runner = CliRunner()


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """work/ (spec.yaml, lib/blocks.py, runs/r1: 2 steps) as it was when the run trained."""
    work = tmp_path_factory.mktemp("made") / "work"
    (work / "lib").mkdir(parents=True)
    (work / "lib" / "blocks.py").write_text(BLOCKS)
    (work / "spec.yaml").write_text(SPEC)
    seed = str(random.randrange(1 << 30))  # fresh Zipf-skewed synthetic rows each time
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(work)
        done = runner.invoke(app, ["train", "spec.yaml", "--rows", "600", "--seed", seed, "--max-steps", "2",
                                   "--out", "runs/r1", "-q"])
    assert done.exit_code == 0, done.output
    assert str(work / "lib" / "blocks.py") in (work / "runs" / "r1" / "spec.json").read_text()
    return work


def _moved(trained: Path, tmp_path: Path, layout: str) -> tuple[Path, Path, Path]:
    """The run (and its class file) in another folder, the original folder gone: (run, file, cwd)."""
    gone = trained.parent / "gone"
    other, cwd = tmp_path / "other", tmp_path / "cwd"
    cwd.mkdir()
    if layout == "tree":  # the whole work folder copied: other/runs/r1, other/lib/blocks.py
        shutil.copytree(trained, other)
        run, file = other / "runs" / "r1", other / "lib" / "blocks.py"
    elif layout == "beside":  # the run folder alone, its file copied beside it: other/r1, other/blocks.py
        shutil.copytree(trained / "runs" / "r1", other / "r1")
        run, file = other / "r1", other / "blocks.py"
        shutil.copy(trained / "lib" / "blocks.py", file)
    else:  # "cwd": the file in the working folder of the command
        shutil.copytree(trained / "runs" / "r1", other / "r1")
        run, file = other / "r1", cwd / "blocks.py"
        shutil.copy(trained / "lib" / "blocks.py", file)
    trained.rename(gone)  # the absolute path the run recorded is gone
    return run, file, cwd


@pytest.fixture
def moved(trained: Path, tmp_path: Path, request):
    run, file, cwd = _moved(trained, tmp_path, request.param)
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(cwd)
        yield run, file
    (trained.parent / "gone").rename(trained)


def _note(output: str, file: Path) -> list[str]:
    return [line for line in output.splitlines() if line.startswith("note:") and "is gone" in line
            and f"using {file.resolve()}" in line]


@pytest.mark.parametrize("moved", ["tree", "beside", "cwd"], indirect=True)
def test_eval_export_and_resume_of_a_moved_run_find_its_class_file(moved):
    run, file = moved
    done = runner.invoke(app, ["eval", str(run), "--json", "-"])
    assert done.exit_code == 0, done.output
    assert 0.0 <= json.loads(done.stdout)["click"]["auc"] <= 1.0
    assert len(_note(done.stderr, file)) == 1, done.stderr
    done = runner.invoke(app, ["export", str(run), str(run.parent / "pkg")])
    assert done.exit_code == 0, done.output
    assert (run.parent / "pkg" / "model.pt2").is_file() and len(_note(done.stderr, file)) == 1
    child = run.parent / "child"  # --init-from said nothing of the file it used (and failed to import the gone one)
    done = runner.invoke(app, ["train", str(run / "spec.json"), "--init-from", str(run), "--out", str(child),
                               "--max-steps", "1", "-q"])
    assert done.exit_code == 0, done.output
    assert len(_note(done.stderr, file)) == 1, done.stderr
    assert load_checkpoint(child)["position"]["step"] == 1
    done = runner.invoke(app, ["train", str(run / "spec.json"), "--resume", str(run), "--max-steps", "3", "-q"])
    assert done.exit_code == 0, done.output
    assert len(_note(done.stderr, file)) == 1, done.stderr
    assert load_checkpoint(run)["position"]["step"] == 3
    recorded = json.loads((run / "run.json").read_text())["class_files"]
    assert list(recorded) == [str(file.resolve())]  # the resumed run records its file's new place
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert flowrec.load(run, device="cpu").trained.step == 3
    assert not [w for w in caught if "is gone" in str(w.message)]  # its checkpoint now names the new place


@pytest.mark.parametrize("moved", ["beside"], indirect=True)
def test_a_file_found_in_place_of_a_moved_runs_that_differs_is_one_line_and_nothing_is_written(moved):
    run, file = moved
    file.write_text(BLOCKS + "\nEDITED = True\n")
    before = sorted(p.name for p in run.parent.iterdir()), (run / "checkpoint.pt").read_bytes()
    for args in (["eval", str(run)], ["export", str(run), str(run.parent / "pkg")],
                 ["train", str(run / "spec.json"), "--resume", str(run), "--max-steps", "3", "-q"],
                 ["train", str(run / "spec.json"), "--init-from", str(run / "checkpoint.pt"), "--out",
                  str(run.parent / "child"), "--max-steps", "1", "-q"]):
        done = runner.invoke(app, args)
        assert done.exit_code == 2, (args, done.output)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and str(file.resolve()) in errors[0] and "sha256" in errors[0], done.stderr
        assert "Traceback" not in done.output
    assert (sorted(p.name for p in run.parent.iterdir()), (run / "checkpoint.pt").read_bytes()) == before


@pytest.mark.parametrize("moved", ["beside"], indirect=True)
def test_a_moved_run_that_recorded_no_digest_uses_the_file_found_and_says_it_is_unchecked(moved):
    """A run of a flowrec that recorded no digest (or a run.json edited without one)."""
    run, file = moved
    settings = json.loads((run / "run.json").read_text())
    del settings["class_files"]
    (run / "run.json").write_text(json.dumps(settings))
    done = runner.invoke(app, ["eval", str(run), "-q"])
    assert done.exit_code == 0, done.output
    notes = _note(done.stderr, file)
    assert len(notes) == 1 and "unchecked" in notes[0], done.stderr


DAMAGED = [["/a/blocks.py"], {"/a/blocks.py": 5}, {"/a/blocks.py": "abc"}, {"/a/blocks.py": "zq" * 32}, "0" * 64]


@pytest.mark.parametrize("value", DAMAGED)
def test_a_damaged_record_of_class_file_digests_is_refused_not_a_check_silently_off(tmp_path: Path, value):
    from flowrec.runs.settings import REQUIRED, read_run_file
    from flowrec.runtime.rundir import RunFolderError

    doc = {name: None for name in REQUIRED}
    (tmp_path / "run.json").write_text(json.dumps({**doc, "class_files": value}))
    with pytest.raises(RunFolderError, match=r"run\.json is damaged: class_files must map each class file"):
        read_run_file(tmp_path)
    digest = "%064x" % random.getrandbits(256)
    (tmp_path / "run.json").write_text(json.dumps({**doc, "class_files": {"/a/blocks.py": digest}}))
    assert read_run_file(tmp_path)["class_files"] == {"/a/blocks.py": digest}


@pytest.mark.parametrize("moved", ["beside"], indirect=True)
def test_eval_export_and_init_from_of_a_moved_run_refuse_a_damaged_record_as_resume_does(moved):
    """The spec layer's reading of the digests skipped a damaged record, and the file found was used
    'unchecked: run.json records no digest', where --resume refuses the record in one line."""
    run, file = moved
    settings = json.loads((run / "run.json").read_text())
    for value in DAMAGED:
        (run / "run.json").write_text(json.dumps({**settings, "class_files": value}))
        before = sorted(p.name for p in run.parent.iterdir()), (run / "checkpoint.pt").read_bytes()
        # eval --data: the run's class file is checked before the data is read (without --data, the
        # run.json read for the data it evaluated on refused the record, saying to give --data)
        for args in (["eval", str(run), "--data", str(run / "no-data")], ["export", str(run), str(run.parent / "pkg")],
                     ["train", str(run / "spec.json"), "--init-from", str(run), "--out", str(run.parent / "child"),
                      "--max-steps", "1", "-q"],
                     ["train", str(run / "spec.json"), "--resume", str(run), "--max-steps", "3", "-q"]):
            done = runner.invoke(app, args)
            assert done.exit_code == 2, (value, args, done.output)
            errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and "run.json is damaged: class_files must map" in errors[0], (args, done.stderr)
            assert "Traceback" not in done.output and not _note(done.stderr, file), done.output
        assert (sorted(p.name for p in run.parent.iterdir()), (run / "checkpoint.pt").read_bytes()) == before
    upper = {key: digest.upper() for key, digest in settings["class_files"].items()}  # hex digits either case
    (run / "run.json").write_text(json.dumps({**settings, "class_files": upper}))
    done = runner.invoke(app, ["eval", str(run), "-q"])
    assert done.exit_code == 0, done.output
    assert len(_note(done.stderr, file)) == 1 and "by its sha256" in _note(done.stderr, file)[0], done.stderr


def test_a_copy_of_the_class_file_elsewhere_is_the_same_model_and_an_edited_copy_is_not(trained: Path, tmp_path: Path):
    """A spec naming a copy of the run's class file (its content the same: sha256) was another model
    to --resume and --init-from ('modules[mine].class ... in the run, ... in the spec'), refused."""
    run = tmp_path / "r1"
    shutil.copytree(trained / "runs" / "r1", run)  # its class file stays where it trained
    copy = tmp_path / "elsewhere" / "blocks.py"
    copy.parent.mkdir()
    shutil.copy(trained / "lib" / "blocks.py", copy)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("lib/blocks.py:Gate", f"{copy}:Gate"))

    def used(output: str) -> list[str]:
        return [line for line in output.splitlines() if line.startswith("note:") and f"class file {copy}" in line
                and f"the content of {trained / 'lib' / 'blocks.py'}" in line and f"using {copy}" in line]

    child = tmp_path / "child"
    done = runner.invoke(app, ["train", str(spec), "--init-from", str(run), "--out", str(child), "--max-steps", "1", "-q"])
    assert done.exit_code == 0, done.output
    assert len(used(done.stderr)) == 1 and load_checkpoint(child)["position"]["step"] == 1, done.stderr
    done = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "3", "-q"])
    assert done.exit_code == 0, done.output
    assert len(used(done.stderr)) == 1 and load_checkpoint(run)["position"]["step"] == 3, done.stderr
    edited = tmp_path / "edited" / "blocks.py"  # the same class in a file of other content: another model
    edited.parent.mkdir()
    edited.write_text(BLOCKS + "\nEDITED = True\n")
    spec.write_text(SPEC.replace("lib/blocks.py:Gate", f"{edited}:Gate"))
    before = sorted(p.name for p in tmp_path.iterdir()), (run / "checkpoint.pt").read_bytes()
    for args in (["--resume", str(run), "--max-steps", "4"], ["--init-from", str(run), "--out", str(tmp_path / "c2")]):
        done = runner.invoke(app, ["train", str(spec), *args, "-q"])
        assert done.exit_code == 2, (args, done.output)
        errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
        assert len(errors) == 1 and "modules[mine].class" in errors[0] and "in the spec" in errors[0] and not used(done.stderr), done.stderr
    assert (sorted(p.name for p in tmp_path.iterdir()), (run / "checkpoint.pt").read_bytes()) == before


def test_a_class_file_edited_in_place_is_one_line_and_nothing_is_written(trained: Path):
    """`train --resume` of a run whose class file was edited where it lies trained the run's weights
    on the other code without a word (eval, export and --init-from too), where a moved file of other
    content was refused: the file in place is checked against run.json's sha256 alike."""
    file, run = trained / "lib" / "blocks.py", trained / "runs" / "r1"
    file.write_text(BLOCKS.replace("torch.sigmoid", "torch.tanh"))
    before = sorted(p.name for p in run.parent.iterdir()), (run / "checkpoint.pt").read_bytes()
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.chdir(trained)
            for args in (["eval", str(run)], ["export", str(run), str(run.parent / "pkg")],
                         ["train", "spec.yaml", "--resume", str(run), "--max-steps", "3", "-q"],
                         ["train", "spec.yaml", "--init-from", str(run), "--out", str(run.parent / "child"),
                          "--max-steps", "1", "-q"]):
                done = runner.invoke(app, args)
                assert done.exit_code == 2, (args, done.output)
                errors = [line for line in done.stderr.splitlines() if line.startswith("error:")]
                assert len(errors) == 1 and str(file) in errors[0] and "changed since the run trained" in errors[0], \
                    (args, done.stderr)
                assert "Traceback" not in done.output
        assert (sorted(p.name for p in run.parent.iterdir()), (run / "checkpoint.pt").read_bytes()) == before
    finally:
        file.write_text(BLOCKS)
