"""`flowrec.train(spec, nproc=2)`: the ranks of `flowrec train SPEC --nproc 2`, from Python. The run
and its resume on two ranks end bitwise as the command line's; a rank's failure is one `RanksFailed`
with the rank's line; Ctrl-C in the calling process stops every rank (none left) and the
KeyboardInterrupt says the call that continues the run, which does. Each Python call runs in a
subprocess under a deadline (`run_bounded`, `communicate_bounded`)."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from flowrec.testing.processes import communicate_bounded, descendants, kill_tree, running, run_bounded, wait_bounded
from flowrec.testing.ranks import assert_same_model, flaky_spec, run_flowrec, subprocess_env, tiny_ranks_folder

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess: a rank left waiting fails the test, never hangs it
EXIT_S = 150  # from Ctrl-C to the calling process's exit (the ranks' checkpoint, the launcher's shutdown)


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    return tiny_ranks_folder(tmp_path_factory.mktemp("api_nproc"), "tiny_api_nproc", ROOT, TIMEOUT_S)


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """`code` run by a Python process in `cwd`, within TIMEOUT_S (its output captured)."""
    return run_bounded([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, env=subprocess_env(ROOT), text=True,
                       capture_output=True, timeout_s=TIMEOUT_S)


def test_two_ranks_from_python_train_and_resume_as_the_command_line_does(work: Path):
    cli = run_flowrec("train", "spec.yaml", "--data", "d", "--out", "cli", "--max-steps", "6", "-q", "--nproc", "2",
                      cwd=work, root=ROOT, timeout_s=TIMEOUT_S)
    assert cli.returncode == 0, cli.stderr[-3000:]
    py = _python("""
        import json, warnings, flowrec
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            run = flowrec.train("spec.yaml", data="d", out="py", max_steps=6, rows=123, nproc=2)
        print(json.dumps({"dir": str(run.run_dir), "step": run.trained.step, "said": [str(w.message) for w in caught],
                          "trained": sum(r.get("event") == "train" for r in run.history)}))
    """, work)
    assert py.returncode == 0, py.stderr[-3000:]
    done = json.loads(py.stdout.splitlines()[-1])
    assert {key: done[key] for key in ("dir", "step", "trained")} == {"dir": "py", "step": 6, "trained": 6}
    assert [line for line in done["said"] if "rows" in line] == [  # in Python's words, once (not the ranks' --rows)
        "rows=123 is ignored: it sets the rows of synthetic data, and this run trains on every row of data=d "
        "(max_steps=N stops it sooner)"], done["said"]
    assert "Traceback" not in py.stderr and "continue with" not in py.stderr  # without progress: the ranks' lines kept
    assert_same_model(work / "cli", work / "py", tol=0)

    cli = run_flowrec("train", "spec.yaml", "--resume", "cli", "--max-steps", "10", "-q", "--nproc", "2", cwd=work,
                      root=ROOT, timeout_s=TIMEOUT_S)
    assert cli.returncode == 0, cli.stderr[-3000:]
    py = _python("""
        import flowrec
        run = flowrec.train("spec.yaml", resume="py", max_steps=10, nproc=2, progress=True)
        print(run.trained.step)
    """, work)
    assert py.returncode == 0, py.stderr[-3000:]
    assert py.stdout.split() == ["10"]
    assert "resuming" in py.stderr  # progress=True: the ranks' lines on stderr
    assert_same_model(work / "cli", work / "py", tol=0)


def test_a_failing_rank_is_one_ranks_failed_with_its_line(tmp_path: Path):
    flaky_spec(tmp_path, 5)
    py = _python("""
        import json, flowrec
        from flowrec.runs.errors import RunError
        from flowrec.runs.launch import RanksFailed
        try:
            flowrec.train("s.yaml", rows=400, device="cpu", out="run", nproc=2)
        except RanksFailed as exc:
            print(json.dumps({"line": str(exc), "code": exc.code, "lines": exc.lines,
                              "run_error": isinstance(exc, RunError)}))
    """, tmp_path)
    assert py.returncode == 0, py.stderr[-3000:]
    failed = json.loads(py.stdout.splitlines()[-1])
    assert failed["run_error"] and failed["code"] == 2, failed
    assert failed["line"] == (  # the rank's line, as one process's note says it (not the launcher's again)
        f"training on 2 ranks failed (exit status 2): at step 3: custom module 'mine' ({tmp_path / 'flaky.py'}:Flaky) "
        "raised KeyError: 'no such user'; no checkpoint was written"), failed
    assert any("raised KeyError" in line for line in failed["lines"]), failed["lines"]
    assert not (tmp_path / "run").exists()  # as one process leaves a run that wrote no checkpoint


@pytest.mark.skipif(not Path("/proc/self/stat").is_file(), reason="finds the ranks through /proc")
def test_ctrl_c_in_the_caller_stops_every_rank_and_says_the_call_that_continues_it(work: Path):
    code = """
        import signal, flowrec
        signal.signal(signal.SIGINT, signal.default_int_handler)  # as Python's own, where the runner's shell ignores it
        try:
            flowrec.train("spec.yaml", data="d", out="stopped", checkpoint_every=4, nproc=2)
        except KeyboardInterrupt as exc:
            print("interrupted:", exc, flush=True)
            raise SystemExit(130)
    """
    job = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], cwd=work, env=subprocess_env(ROOT),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        metrics, deadline = work / "stopped" / "metrics.jsonl", time.monotonic() + TIMEOUT_S
        while not (metrics.is_file() and sum('"event": "train"' in line for line in metrics.open()) >= 3):
            assert job.poll() is None, "the run ended before Ctrl-C"
            assert time.monotonic() < deadline, f"no training steps within {TIMEOUT_S} s"
            time.sleep(0.1)
        launch = descendants(job.pid)
        ranks = [p for p in launch if b"flowrec\x00train" in Path(f"/proc/{p}/cmdline").read_bytes()
                 and b"flowrec.cli.ranks" not in Path(f"/proc/{p}/cmdline").read_bytes()]
        assert len(ranks) == 2, launch
        job.send_signal(signal.SIGINT)
        out, err = communicate_bounded(job, EXIT_S)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            wait_bounded(job, 30)
    assert job.returncode == 130, err[-3000:]
    assert not [p for p in launch if running(p)]  # the launcher and both ranks: killed and joined
    said = out.split("interrupted: ", 1)[1].strip()
    assert said.startswith("training interrupted after step ") and "\n" not in said, said
    call = said.split(" scores it, ", 1)[1]
    assert call == "`flowrec.train('spec.yaml', resume='stopped', nproc=2)` continues it", said
    resumed = _python(f"""
        import flowrec
        run = {call.split('`')[1]}
        print(run.trained.step)
    """, work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert resumed.stdout.split() == ["48"]  # 4 epochs of 12 steps (600 rows, batch 50)


def test_the_ranks_own_errors_and_warnings_are_in_the_words_of_the_python_call(work: Path):
    """What only the ranks find (a split whose test part is gone; evaluation labels of one class) was
    said in the words of their command line: `give --eval-data DIR (eval_data=)`, "('-' in the table,
    null in JSON)"; the RanksFailed line and the UserWarnings now name the call's keywords, as one
    process's warnings do."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("split/train", "zeros"):  # d as a split whose test part is gone; d with label 0 everywhere
        (work / name).mkdir(parents=True)
        for path in (work / "d").iterdir():
            (work / name / path.name).write_bytes(path.read_bytes())
    meta = work / "split" / "train" / "_flowrec.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "split": {"test_fraction": 0.2, "seed": 1}}))
    for part in (work / "zeros").glob("*.parquet"):
        table = pq.read_table(part)
        column = table.schema.get_field_index("label")
        pq.write_table(table.set_column(column, "label", pa.array([0.0] * table.num_rows, pa.float32())), part)
    py = _python("""
        import json, warnings, flowrec
        from flowrec.runs.launch import RanksFailed

        def said(**options):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                flowrec.train("spec.yaml", data="zeros", eval_data="zeros", max_steps=2, **options)
            return sorted(str(w.message) for w in caught if "undefined" in str(w.message))

        try:
            flowrec.train("spec.yaml", data="split", out="split_run", max_steps=2, nproc=2)
            failed = None
        except RanksFailed as exc:
            failed = str(exc)
        print(json.dumps({"failed": failed, "one": said(out="z1"), "ranks": said(out="z2", nproc=2)}))
    """, work)
    assert py.returncode == 0, py.stderr[-3000:]
    done = json.loads(py.stdout.splitlines()[-1])
    assert done["failed"] == (
        "training on 2 ranks failed (exit status 2): split/test is missing: split/train/_flowrec.json records a "
        "split (test fraction 0.2) whose test part is gone, so nothing would be evaluated; restore it, or give "
        "eval_data=DIR to evaluate on other data"), done["failed"]
    assert done["one"] and done["ranks"] == done["one"], done  # '(NaN in the returned metrics)'


def test_a_run_started_from_another_that_never_checkpointed_starts_on_ranks_as_the_command_line_starts_it(
        work: Path):
    """`flowrec train SPEC --resume RUN --nproc 2` starts a run of `--init-from` that stopped before its
    first checkpoint from its parent again; `flowrec.train(SPEC, resume=RUN, nproc=2)` refused it with
    the one-process line ('flowrec.train does not start a run from another'), though its ranks are that
    command's. It now hands the run to them (test_api_nproc_refusals: with the command's arguments),
    and they start it from its parent."""
    py = _python("""
        import json, os, flowrec
        flowrec.train("spec.yaml", data="d", out="parent", max_steps=2)
        recorded = json.load(open("parent/run.json"))
        os.mkdir("child")  # as `flowrec train --init-from parent --out child` leaves it, stopped at once
        json.dump({**recorded, "init_from": "parent"}, open("child/run.json", "w"))
        print(flowrec.train("spec.yaml", resume="child", max_steps=4, nproc=2, progress=True).trained.step)
    """, work)
    assert py.returncode == 0, py.stderr[-3000:]
    assert py.stdout.split() == ["4"]
    assert "starting from parent (parameters" in py.stderr, py.stderr[-3000:]  # the ranks' line (progress=True)
