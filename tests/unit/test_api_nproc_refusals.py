"""`flowrec.train(..., nproc=N)` refuses what it cannot run before any rank starts, each in one line
of Python's words (the launch itself is replaced here by one that fails the test: none may start):
nproc or max_restarts of the wrong kind, callbacks, a ModelSpec, no run folder, a cache policy the
ranks cannot plan, data of another spec, too many ranks for the memory, a folder holding a run; a
finished run resumed on ranks is said finished and loaded. Also: the line of a failed launch and
of an interrupted one.
"""
from __future__ import annotations

import warnings
from pathlib import Path

import numpy as np
import pytest

import flowrec
from flowrec.data.layout import DataError
from flowrec.runs.errors import RunError
from flowrec.runs.launch import Launch, RanksFailed
from flowrec.runtime.rundir import RunFolderError

SPEC = """
name: tiny_ranks
features:
  - {name: price, type: dense}
  - {name: user_id, type: categorical, hash_buckets: 40, dim: 4}
modules:
  - {name: deep, kind: mlp, inputs: ["@dense", user_id], layers: [4]}
heads:
  - {name: click, input: deep, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adagrad, lr: 0.1}
training:
  batch_size: 32
  epochs: 1
"""


@pytest.fixture
def no_launch(monkeypatch, tmp_path: Path) -> Path:
    """A spec file in the working folder `tmp_path`, and no launch of ranks possible."""
    def launched(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("flowrec.runs.launch.run_launch", launched)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(SPEC)
    return tmp_path


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished one-process run of the spec (runs/done, 4 steps), in a folder of its own."""
    root = tmp_path_factory.mktemp("ranks_finished")
    (root / "s.yaml").write_text(SPEC)
    flowrec.train(root / "s.yaml", out=root / "done", rows=300, max_steps=4, seed=11)
    return root


def _one_line(exc: pytest.ExceptionInfo) -> str:
    text = str(exc.value)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("nproc", [0, -2, 2.0, "2", True, None])
def test_an_nproc_that_is_no_whole_number_of_ranks_is_one_value_error(no_launch: Path, nproc) -> None:
    with pytest.raises(ValueError) as exc:
        flowrec.train("s.yaml", out="r", nproc=nproc)
    assert isinstance(exc.value, RunError)
    assert _one_line(exc) == f"nproc must be a whole number of ranks, 1 or more, not {nproc!r}"
    assert not (no_launch / "r").exists()


@pytest.mark.parametrize("restarts", [-1, 1.5, "1"])
def test_max_restarts_of_the_wrong_kind_is_refused(no_launch: Path, restarts) -> None:
    with pytest.raises(RunError) as exc:
        flowrec.train("s.yaml", out="r", nproc=2, max_restarts=restarts)
    assert _one_line(exc) == f"max_restarts must be a whole number, 0 or more, not {restarts!r}"


def test_max_restarts_without_ranks_is_refused_as_the_command_line_refuses_it(no_launch: Path) -> None:
    with pytest.raises(RunError) as exc:
        flowrec.train("s.yaml", out="r", max_restarts=2)
    assert _one_line(exc).startswith("max_restarts=2 restarts the ranks of nproc=N after a failure: give nproc=2")


def test_callbacks_cannot_follow_ranks(no_launch: Path) -> None:
    with pytest.raises(ValueError) as exc:  # numpy's int, as a notebook computes it, is a number of ranks
        flowrec.train("s.yaml", out="r", nproc=np.int64(2), on_step=print, on_checkpoint=print)
    assert _one_line(exc).startswith("on_step, on_checkpoint cannot follow a run on nproc=2 ranks: ")
    assert "leave them out" in str(exc.value) and "nproc=1" in str(exc.value)


def test_a_model_spec_has_no_file_for_the_ranks(no_launch: Path) -> None:
    from flowrec.spec.load import load_spec

    with pytest.raises(RunError) as exc:
        flowrec.train(load_spec(no_launch / "s.yaml"), out="r", nproc=2)
    assert "a ModelSpec has none: write the spec to a YAML or JSON file and give its path" in _one_line(exc)


def test_no_run_folder_is_refused_saying_to_give_out(no_launch: Path) -> None:
    with pytest.raises(RunError) as exc:
        flowrec.train("s.yaml", nproc=2)
    assert _one_line(exc).startswith("nproc=2 trains in a run folder that every rank writes, and out=None keeps "
                                     "none: give out=")
    assert not (no_launch / "runs").exists()


def test_a_cache_policy_the_ranks_cannot_plan_is_refused_before_they_start(no_launch: Path) -> None:
    (no_launch / "s.yaml").write_text(SPEC + "plan:\n  cache: static_hot\n")
    with pytest.raises(RunError) as exc:
        flowrec.train("s.yaml", out="r", nproc=2)
    assert _one_line(exc).startswith("nproc=2 with the spec's plan.cache: ")
    assert not (no_launch / "r").exists()


def test_data_of_another_spec_is_a_data_error_before_the_ranks_start(no_launch: Path) -> None:
    (no_launch / "other.yaml").write_text(SPEC.replace("tiny_ranks", "other").replace("hash_buckets: 40",
                                                                                     "hash_buckets: 50"))
    assert _synth("other.yaml", "d") == 0
    with pytest.raises(DataError):
        flowrec.train("s.yaml", data="d", out="r", nproc=2)
    assert not (no_launch / "r").exists()


def _synth(spec: str, out: str) -> int:
    from typer.testing import CliRunner

    from flowrec.cli import app

    return CliRunner().invoke(app, ["data", "synth", spec, "--rows", "200", "--out", out, "-q"]).exit_code


def test_more_ranks_than_the_memory_holds_are_refused(no_launch: Path, monkeypatch) -> None:
    monkeypatch.setattr("flowrec.data.hostmemory.available_memory_bytes", lambda: 2**20)
    with pytest.raises(RunError) as exc:
        flowrec.train("s.yaml", out="r", nproc=3)
    assert _one_line(exc).startswith("nproc=3: 3 ranks of ")
    assert "give fewer ranks" in str(exc.value)


def test_a_caller_holding_its_own_data_is_not_taken_for_the_size_of_each_rank(no_launch: Path, monkeypatch) -> None:
    """A notebook that holds gigabytes of its own data called flowrec.train(..., nproc=2): each rank
    was taken to be as big as the notebook and refused; a rank is a fresh process that never holds
    them, so where the caller's size would refuse, a fresh process's size (measured) decides."""
    from flowrec.runs import launch

    fresh = launch.fresh_process_bytes()  # measured for real: torch and the trainer imported
    assert fresh is not None and 32 * 2**20 < fresh < 8 * 2**30
    monkeypatch.setattr(launch, "own_process_bytes", lambda: 64 * 2**30)  # the notebook: 64 GiB
    monkeypatch.setattr(launch, "fresh_process_bytes", lambda: fresh)
    monkeypatch.setattr("flowrec.data.hostmemory.available_memory_bytes", lambda: 8 * fresh + 2**20)
    launch.check_ranks_fit(8, python=True)  # 8 fresh ranks fit
    with pytest.raises(RunError) as exc:  # 9 do not, and the line gives the fresh size, not the caller's
        launch.check_ranks_fit(9, python=True)
    assert _one_line(exc).startswith(f"nproc=9: 9 ranks of {fresh / 2**20:,.0f} MiB each ")
    monkeypatch.setattr(launch, "fresh_process_bytes", lambda: None)  # not measurable: the caller's size stands
    with pytest.raises(RunError, match="ranks of 65,536 MiB each"):
        launch.check_ranks_fit(2, python=True)


def test_a_folder_holding_a_run_names_the_python_calls(finished_run: Path, monkeypatch) -> None:
    monkeypatch.setattr("flowrec.runs.launch.run_launch", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.chdir(finished_run)
    before = sorted(p.name for p in (finished_run / "done").iterdir())
    with pytest.raises(RunFolderError) as exc:
        flowrec.train("s.yaml", out="done", nproc=2)
    assert "`flowrec.train('s.yaml', resume='done', nproc=2)`" in _one_line(exc)
    assert "overwrite=True" in str(exc.value)
    assert sorted(p.name for p in (finished_run / "done").iterdir()) == before


def test_a_finished_run_resumed_on_ranks_is_said_finished_and_loaded(finished_run: Path, monkeypatch) -> None:
    monkeypatch.setattr("flowrec.runs.launch.run_launch", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.chdir(finished_run)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run = flowrec.train("s.yaml", resume="done", nproc=2)
    said = [str(w.message) for w in caught if "is finished" in str(w.message)]
    assert said and "max_steps=4" in said[0], [str(w.message) for w in caught]
    assert run.result is None and run.trained.step == 4 and run.run_dir == Path("done")


def test_a_resume_on_ranks_with_another_seed_is_refused_in_python_words(finished_run: Path, monkeypatch) -> None:
    monkeypatch.setattr("flowrec.runs.launch.run_launch", lambda *a, **k: pytest.fail("a rank was started"))
    monkeypatch.chdir(finished_run)
    with pytest.raises(RunError) as exc:
        flowrec.train("s.yaml", resume="done", nproc=2, seed=12, max_steps=8)
    assert "seed=12" in _one_line(exc) and "--seed" not in str(exc.value)


def test_a_failed_launch_is_one_line_with_the_ranks_lines_kept() -> None:
    lines = ["note: x", "error: rank 1: mine raised KeyError: 'no such user'", "torch says more"]
    failed = RanksFailed(2, 2, lines)
    assert str(failed) == "training on 2 ranks failed (exit status 2): mine raised KeyError: 'no such user'"
    assert failed.code == 2 and failed.lines == lines and isinstance(failed, RunError)
    killed = RanksFailed(3, -9, ["Traceback (most recent call last):"])
    assert str(killed) == ("training on 3 ranks failed (the launcher was killed by signal 9): no rank said why "
                           "(its last lines are in this error's note)")
    assert killed.code == 137


def test_an_interrupted_launch_says_what_was_kept_and_the_call_that_continues_it(tmp_path: Path,
                                                                                finished_run: Path) -> None:
    from flowrec.api import _ranks_interrupted_line

    folder = tmp_path / "r"
    folder.mkdir()
    before = Launch(130, note=None, interrupt=KeyboardInterrupt())
    assert _ranks_interrupted_line(before, "s.yaml", folder, 2, False) == (
        "training on 2 ranks interrupted (Ctrl-C) before training started; nothing was trained")
    # overwrite=True of a run: its checkpoint is the earlier run's, not a step this launch trained
    assert _ranks_interrupted_line(before, "s.yaml", finished_run / "done", 2, False) == (
        "training on 2 ranks interrupted (Ctrl-C) before training started; nothing was trained")
    assert _ranks_interrupted_line(before, "s.yaml", folder, 2, True) == (
        "training on 2 ranks interrupted (Ctrl-C) before training started; nothing was trained; the run is as it "
        f"was: `flowrec.train('s.yaml', resume={str(folder)!r}, nproc=2)` continues it")
    whole = Launch(130, note="interrupted after the run finished", interrupt=KeyboardInterrupt())
    assert _ranks_interrupted_line(whole, "s.yaml", folder, 2, False) == (
        f"interrupted (Ctrl-C) after the run finished: {folder} holds all of it; flowrec.load({str(folder)!r}) "
        "scores it")


@pytest.mark.parametrize("line,said", [
    # a rank's error naming the flags the call passed on: the keywords, as one process names them
    ("ds/test is missing: ...; restore it, or give --eval-data DIR (eval_data=) to evaluate on other data",
     "ds/test is missing: ...; restore it, or give eval_data=DIR to evaluate on other data"),
    ("give the training data too (--data, data=, or data bound in the spec), not synthetic rows",
     "give the training data too (data=, or data bound in the spec), not synthetic rows"),
    ("put r/encoder back to resume, or start over (a new run, another --out)",
     "put r/encoder back to resume, or start over (a new run, another out=)"),
    ("put the missing files back, or start over with --out runs/x --overwrite",
     "put the missing files back, or start over with out='runs/x', overwrite=True"),
    ("--max-steps 10 is past the end; --seed 3 differs: leave --seed out, or --device cpu",
     "max_steps=10 is past the end; seed=3 differs: leave seed= out, or device='cpu'"),
    ("a rank's share under --nproc; --rows 400,000 synthetic rows", "a rank's share under nproc=; rows=400_000 synthetic rows"),
    ("give a larger `--max-steps N` (or `--epochs`)", "give a larger `max_steps=N` (or `epochs=`)"),
    # the command that continues a run: the call that does
    ("interrupted (SIGTERM) at step 7; continue with  flowrec train 'my s.yaml' --resume runs/a --nproc 2",
     "interrupted (SIGTERM) at step 7; continue with  `flowrec.train('my s.yaml', resume='runs/a', nproc=2)`"),
    ("records the encoder again: `flowrec train SPEC --resume r --max-steps=8`",
     "records the encoder again: `flowrec.train(SPEC, resume='r', max_steps=8)`"),
    # an undefined metric: as the returned metrics hold it
    ("h1: every evaluation label is 0 (600 rows): auc is undefined ('-' in the table, null in JSON)",
     "h1: every evaluation label is 0 (600 rows): auc is undefined (NaN in the returned metrics)"),
    # unchanged: no flag, a flag no keyword stands for, a command of other flags (typed in a shell)
    ("at step 3: custom module 'mine' raised KeyError: 'no such user'; no checkpoint was written", None),
    ("3 of 10 batches were skipped (--nan-policy skip-batch); within --dist-timeout 300 s", None),
    ("convert them with `flowrec data convert csv x DIR --spec s.yaml --on-error skip` and train on DIR", None),
    ("start it again with `flowrec train SPEC --follow days --out RUN`", None),
])
def test_a_ranks_line_is_said_in_the_words_of_the_python_call(line: str, said: str | None) -> None:
    from flowrec.runs.launch import python_words

    assert python_words(line) == (said if said is not None else line)


def test_a_failed_launch_is_the_first_failed_ranks_own_line_not_the_launchers_words_around_it() -> None:
    """The launcher's line ('training failed: rank(s) 0, 1 exited; the first, rank 1, with status 2: ...')
    said the failure again after RanksFailed's own 'training on 2 ranks failed (exit status 2)'."""
    own = "at step 3: custom module 'mine' (f.py:Flaky) raised KeyError: 'no such user'; no checkpoint was written"
    lines = ["run folder run; if it stops, continue with  flowrec train s.yaml --resume run --nproc 2",
             f"error: rank 1: {own}", "error: rank 0: stopped at step 3: rank 1 stopped first (its line says why); "
             "no checkpoint was written", f"error: training failed: rank(s) 0, 1 exited; the first, rank 1, with status 2: {own}"]
    assert str(RanksFailed(2, 2, lines)) == f"training on 2 ranks failed (exit status 2): {own}"
    above = [*lines[:3], "error: training failed: rank(s) 0, 1 exited; the first, rank 1, with status 2 (its message "
             "is above)"]
    assert str(RanksFailed(2, 2, above)) == f"training on 2 ranks failed (exit status 2): {own}"
    killed = "training failed: rank(s) 1 exited; the first, rank 1, was killed by signal 9 (SIGKILL) and wrote no message"
    assert str(RanksFailed(2, 137, [f"error: {killed}"])) == f"training on 2 ranks failed (exit status 137): {killed}"


def test_a_failed_launch_names_the_python_keywords_not_the_ranks_flags() -> None:
    lines = ["error: rank 0: d/test is missing: restore it, or give --eval-data DIR (eval_data=) to evaluate"]
    failed = RanksFailed(2, 2, lines)
    assert str(failed) == "training on 2 ranks failed (exit status 2): d/test is missing: restore it, or give " \
                          "eval_data=DIR to evaluate"
    assert failed.lines == lines  # the ranks' own output, as they wrote it


def test_a_run_started_from_another_that_never_checkpointed_goes_to_the_ranks_as_on_the_command_line(
        finished_run: Path, tmp_path: Path, monkeypatch) -> None:
    """`flowrec train SPEC --resume RUN --nproc 2` starts such a run from its parent again; the Python
    call on 2 ranks refused it with the one-process line ('flowrec.train does not start a run from
    another'), though its ranks are that command's. It now hands it to them, as the command line does."""
    import json

    class Launched(Exception):
        pass

    def launched(nproc, max_restarts, args, *rest, **kwargs):
        raise Launched(args)

    monkeypatch.setattr("flowrec.runs.launch.run_launch", launched)
    monkeypatch.chdir(finished_run)
    child = tmp_path / "child"  # as `flowrec train --init-from done --out child` leaves it, stopped at once
    child.mkdir()
    recorded = json.loads((finished_run / "done" / "run.json").read_text())
    (child / "run.json").write_text(json.dumps({**recorded, "init_from": str(finished_run / "done")}))
    with pytest.raises(Launched) as exc:
        flowrec.train("s.yaml", resume=child, max_steps=3, nproc=2)
    assert exc.value.args[0] == ["s.yaml", f"--resume={child}", "--max-steps=3", "-q"]  # rows= left out: on data
    with pytest.raises(RunError, match="does not start a run from another"):  # one process: still refused
        flowrec.train("s.yaml", resume=child, max_steps=3)
