"""The Python API given what a hostile or careless notebook user gives it (pyapi14): each argument of
the wrong kind one `RunError` line naming it, before anything is written; a callback's answer never
ignored without a word; the run's refusals in the call's own words (`rows=`, not `--rows`). One test
per defect; each fails on the code before its fix.
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path

import numpy as np
import pytest

import flowrec
from flowrec.runs.errors import RunError


def _spec(folder: Path, early_stopping: bool = False) -> Path:
    """A tiny spec of random sizes; with early stopping on auc where asked."""
    path = folder / "t.yaml"
    stopping = "  early_stopping: {metric: auc, patience: 2}\n" if early_stopping else ""
    path.write_text(f"""
name: hostile
features:
  - {{name: price, type: dense, transform: log1p}}
  - {{name: user_id, type: categorical, hash_buckets: {random.randint(30, 90)}, dim: 4}}
modules:
  - {{name: deep, kind: mlp, inputs: ["@dense", user_id], layers: [{random.choice([4, 8])}]}}
heads:
  - {{name: click, input: deep, task: binary, loss: bce}}
training:
  batch_size: {random.choice([16, 32])}
  epochs: 1
{stopping}""")
    return path


@pytest.mark.parametrize("device", ["meta", "mps", "xpu", "meta:0"])
def test_a_device_torch_reads_but_flowrec_does_not_run_on_is_one_line_before_anything(tmp_path: Path,
                                                                                     device: str) -> None:
    """`device="meta"` passed the check (torch reads the name): `flowrec.load` returned a run whose
    model had no weights (torch's warnings only, every score from nothing) and `flowrec.train`
    failed deep in torch ('Tensor.item() cannot be called on meta tensors'; mps: 'Could not run
    aten::empty.memory_format'), after the run folder was made. Both are one RunError line now."""
    spec = _spec(tmp_path)
    out = tmp_path / "run"
    with pytest.raises(RunError, match=rf"^device must be auto, cpu or cuda\[:N\], not '{device}'") as err:
        flowrec.train(spec, out=out, rows=200, max_steps=1, device=device)
    assert "\n" not in str(err.value) and not out.exists()
    with pytest.raises(RunError, match=rf"^device must be auto, cpu or cuda\[:N\], not '{device}'"):
        flowrec.load(tmp_path / "nowhere", device=device)


@pytest.mark.parametrize("argument", ["spec", "out", "data", "eval_data", "resume", "run_dir"])
def test_a_path_holding_a_nul_character_is_one_line_naming_the_argument(tmp_path: Path, argument: str) -> None:
    """A NUL in a path (text pasted from a binary file, a C string's end) met os.stat's bare
    ValueError ('embedded null byte') deep in the loader; a shell's argument cannot hold one, so only
    the API meets it. It is one RunError naming the argument."""
    spec = _spec(tmp_path)
    bad = str(tmp_path / f"r{random.randint(0, 9)}\0x")
    given = Path(bad) if random.random() < 0.5 else bad
    with pytest.raises(RunError, match=rf"^{argument}: the path .* holds a NUL character") as err:
        if argument == "run_dir":
            flowrec.load(given)
        elif argument == "spec":
            flowrec.train(given, out=None)
        else:
            flowrec.train(spec, **{argument: given})
    assert "\n" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.yaml"]


def _two(event, extra):
    return None


def _keyword_only(*, event):
    return None


class _NoArgument:
    def __call__(self):
        return None


@pytest.mark.parametrize("name,event", [("on_step", "StepEvent"), ("on_eval", "EvalEvent"),
                                        ("on_checkpoint", "CheckpointEvent")])
@pytest.mark.parametrize("callback", [lambda: None, _two, _keyword_only, _NoArgument()])
def test_a_callback_that_cannot_take_its_event_is_refused_before_anything(tmp_path: Path, name: str, event: str,
                                                                        callback) -> None:
    """`on_step=lambda: None` (or a function of two arguments) was a TypeError at the first step,
    after the data was generated, the model built and the run folder written; it is one RunError
    naming the callback and the event it is given, before anything is read or written."""
    spec = _spec(tmp_path)
    out = tmp_path / "run"
    with pytest.raises(RunError, match=rf"^{name} must take one argument, the {event} \(def {name}\(event\)") as err:
        flowrec.train(spec, out=out, rows=200, max_steps=1, **{name: callback})
    assert "\n" not in str(err.value) and not out.exists()


def test_a_callback_answer_other_than_a_bool_is_read_by_its_truth_and_said(tmp_path: Path, monkeypatch) -> None:
    """`return 1` (or "stop", a 0-d tensor) from on_step was ignored without a word: `answer is True`
    missed it and the run trained on to its end. A true answer stops the run after that step, a
    false one goes on, each said once per callback in a UserWarning naming what it returned."""
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    stop_at = random.randint(2, 4)
    answer = random.choice([1, "stop", [0], np.int64(7)])
    with pytest.warns(UserWarning, match=r"^on_step returned .*, read as True: the run stops after step") as said:
        run = flowrec.train(spec, out=None, rows=600, max_steps=8, seed=1,
                            on_step=lambda e: answer if e.step == stop_at else None)
    assert run.result.steps == stop_at and run.result.stop_requested
    assert len([w for w in said if "on_step returned" in str(w.message)]) == 1
    with pytest.warns(UserWarning, match=r"^on_step returned 0 \(int\), read as False: the run goes on") as said:
        run = flowrec.train(spec, out=None, rows=600, max_steps=5, seed=1, on_step=lambda e: 0)
    assert run.result.steps == 5 and not run.result.stop_requested
    assert len([w for w in said if "on_step returned" in str(w.message)]) == 1  # once, not once per step
    with warnings.catch_warnings():  # True, np.True_ and None as before: no word
        warnings.simplefilter("error")
        assert flowrec.train(spec, out=None, rows=600, max_steps=5, seed=1,
                             on_step=lambda e: np.True_ if e.step == 2 else None).result.steps == 2


def test_a_callback_answer_without_a_truth_is_one_line_and_keeps_the_run(tmp_path: Path, monkeypatch) -> None:
    """An answer that is neither true nor false (an array of several values) is a RunError naming the
    callback and the step, and the run folder is kept as it was at that step (its checkpoints)."""
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    at = random.randint(2, 4)
    with pytest.raises(RunError, match=rf"^on_step returned array\(.*\) at step {at}, which is neither true nor false"):
        flowrec.train(spec, out="run", rows=600, max_steps=8, checkpoint_every=1,
                      on_step=lambda e: np.array([True, False]) if e.step == at else None)
    assert (tmp_path / "run" / "checkpoint.pt").is_file()
    assert flowrec.load("run").trained.step in (at - 1, at)  # the background write of step `at` may be the last


def test_the_refusals_of_a_run_name_the_calls_keywords_not_the_command_lines_flags(tmp_path: Path,
                                                                                  monkeypatch) -> None:
    """`flowrec.train(spec, rows=10**15)` said '--rows 1,000,000,000,000,000 synthetic rows ...: give
    fewer --rows (rows=)' and early stopping without evaluations 'give --eval-every N (eval_every=)':
    the command line's flags in a Python call. They name the keywords now, as the same call on
    ranks says them; the command line keeps its flags."""
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, early_stopping=True)
    rows = random.randint(10**14, 10**15)
    with pytest.raises(RunError, match=rf"^rows={rows} synthetic rows take about .*: give fewer rows=, or a") as err:
        flowrec.train(spec, out=None, rows=rows)
    outside = str(err.value).split("`")[::2]  # the command in backticks is typed in a shell: its flags stay
    assert not any("--" in part for part in outside), err.value
    with pytest.raises(RunError, match=r"needs evaluations during training: .* give eval_every=N$") as err:
        flowrec.train(spec, out=None, rows=300, eval_every=0)
    assert "--" not in str(err.value)


def test_a_custom_class_of_the_session_is_said_where_the_run_is_kept(tmp_path: Path, monkeypatch) -> None:
    """A custom module of a class defined in the notebook (`class: "__main__:Gate"`) trained and
    wrote its run without a word; a restarted kernel's `flowrec.load(RUN)` then met "cannot import
    '__main__:Gate'". The call says so where it keeps a run (not with out=None), naming the module,
    the class and the way out (a file's class path)."""
    import sys

    from torch import nn

    class Gate(nn.Module):
        def __init__(self, n: int) -> None:
            super().__init__()
            self.lin = nn.Linear(n, n)

        def forward(self, x):
            return self.lin(x) * x

    name = f"HostileGate{random.randint(0, 999)}"
    monkeypatch.setattr(sys.modules["__main__"], name, Gate, raising=False)
    monkeypatch.chdir(tmp_path)
    width = random.choice([4, 8])
    spec = tmp_path / "t.yaml"
    spec.write_text(f"""
name: session_class
features:
  - {{name: price, type: dense}}
  - {{name: user_id, type: categorical, hash_buckets: 40, dim: 4}}
modules:
  - {{name: deep, kind: mlp, inputs: ["@dense", user_id], layers: [{width}]}}
  - {{name: gate, kind: custom, class: "__main__:{name}", inputs: [deep], params: {{n: {width}}}}}
heads:
  - {{name: click, input: gate}}
training: {{batch_size: 32, epochs: 1}}
""")
    with pytest.warns(UserWarning, match=rf"^custom module 'gate' is __main__:{name}, a class of this Python "
                                         rf"session: the run in run is loaded.*give its path \('blocks.py:{name}'\)"):
        flowrec.train(spec, out="run", rows=200, max_steps=1)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing kept, nothing to say
        flowrec.train(spec, out=None, rows=200, max_steps=1)


@pytest.mark.parametrize("stop", ["Ctrl-C", "SIGTERM"])
def test_an_interrupt_before_training_says_what_was_kept(tmp_path: Path, monkeypatch, stop: str) -> None:
    """Ctrl-C while a run planned, generated its rows or built its model was a bare KeyboardInterrupt
    (no message: nothing said whether anything was trained or kept), where `flowrec train` says
    'interrupted (Ctrl-C) before training started; nothing was trained' and a stop in training names
    the step and the call that continues it. It says the command line's line now; a resumed run's
    adds that the run is as it was and the call that continues it."""
    from flowrec.runtime.signals import Terminated

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    flowrec.train(spec, out="run", rows=300, max_steps=2, epochs=1)

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt() if stop == "Ctrl-C" else Terminated("SIGTERM")

    monkeypatch.setattr("flowrec.runs.plan.plan_for_run", interrupted)
    with pytest.raises(KeyboardInterrupt) as err:
        flowrec.train(spec, out="new", rows=300, max_steps=2)
    assert str(err.value) == f"interrupted ({stop}) before training started; nothing was trained"
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr("flowrec.runs.resume.read_resumption", interrupted)
    before = sorted(p.name for p in (tmp_path / "run").iterdir())
    with pytest.raises(KeyboardInterrupt) as err:
        flowrec.train(spec, resume="run", max_steps=4)
    assert str(err.value) == (f"interrupted ({stop}) before training started; nothing was trained; the run is as it "
                              f"was: `flowrec.train('{spec}', resume='run')` continues it")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == before


def test_load_model_of_no_path_is_one_line_naming_the_argument(tmp_path: Path) -> None:
    """`flowrec.load_model(None)` (a variable never set), bytes or a frame of rows met pathlib's
    TypeError ('expected str, bytes or os.PathLike object, not NoneType') seven frames deep, naming
    no argument, and a NUL in the path os.stat's bare ValueError ('embedded null byte')."""
    import pandas as pd

    for given, shown in ((None, "NoneType"), (b"pkg", "bytes"), (pd.DataFrame({"price": [1.0]}), "DataFrame")):
        with pytest.raises(TypeError, match=rf"^path must be a model package's folder \(str or pathlib.Path\), "
                                            rf"not {shown}") as err:
            flowrec.load_model(given)
        assert "\n" not in str(err.value)
    bad = tmp_path / f"pkg{random.randint(0, 9)}\0"
    with pytest.raises(ValueError, match=r"^path .* holds a NUL character"):
        flowrec.load_model(bad if random.random() < 0.5 else str(bad))


def test_a_resume_on_other_data_of_other_rows_is_said(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train(spec, resume=RUN, data=OTHER)` of a run on a dataset went on, without a word, from
    its checkpoint's epoch and batch, a place in the rows it started on, in other data of another
    number of rows (the row check skips a data= given on purpose; `flowrec train --resume RUN --data
    OTHER` notes that it overrides the run's data). A UserWarning says so now, naming both datasets
    and both counts; the same rows in a new folder (data moved) are not said."""
    import shutil

    from typer.testing import CliRunner

    from flowrec.cli import app

    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    first, other = random.randint(200, 300), random.randint(320, 500)
    for folder, rows in (("d", first), ("e", other)):
        made = CliRunner().invoke(app, ["data", "synth", "t.yaml", "--rows", str(rows), "--out", folder, "--seed",
                                        str(random.randint(0, 99)), "-q"])
        assert made.exit_code == 0, made.output
    flowrec.train("t.yaml", data="d", out="a", max_steps=2)
    shutil.copytree("a", "b")
    with pytest.warns(UserWarning, match=rf"^data='e' overrides the run's data='{tmp_path / 'd'}': it holds {other:,} "
                                         rf"training rows, the run started on {first:,}, and goes on from"):
        flowrec.train("t.yaml", resume="a", data="e", max_steps=3)
    shutil.copytree("d", "moved")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the run's own rows in their new place: nothing to say
        assert flowrec.train("t.yaml", resume="b", data="moved", max_steps=3).result.steps == 3


def test_a_lower_layers_refusal_names_the_calls_keywords_as_the_ranks_do(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train(spec, data=D)` of a split whose test part is gone said 'restore it, or give
    --eval-data DIR (eval_data=)' in one process, where the same call on ranks (`nproc=2`) says
    'restore it, or give eval_data=DIR': the data layer's line was the command line's. A line of a
    layer below the call (data, run folder, checkpoint) is now said in the call's keywords in one
    process too, and the command line keeps its flags."""
    import json

    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.data.layout import DataError

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    synth = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", str(random.randint(200, 400)),
                                     "--out", str(tmp_path / "d" / "train"), "-q"])
    assert synth.exit_code == 0, synth.output
    meta = tmp_path / "d" / "train" / "_flowrec.json"
    fraction = random.choice([0.1, 0.2, 0.25])
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "split": {"test_fraction": fraction, "seed": 1}}))
    with pytest.raises(DataError) as err:
        flowrec.train(spec, data=tmp_path / "d", out=None, max_steps=2)
    assert str(err.value).endswith("restore it, or give eval_data=DIR to evaluate on other data"), err.value
    assert f"(test fraction {fraction})" in str(err.value) and "--" not in str(err.value), err.value
    cli = CliRunner().invoke(app, ["train", str(spec), "--data", str(tmp_path / "d"), "--out", str(tmp_path / "r"),
                                   "--max-steps", "2"])
    assert cli.exit_code == 2 and "give --eval-data DIR" in cli.output, cli.output
