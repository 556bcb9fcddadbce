"""`flowrec train --follow DAYS`: each day partition trains from the day before (managed maps
kept), after progressive validation on it; days are never trained twice; a stream rerun after
its days are done trains nothing; the result equals chaining `--init-from` by hand."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.testing.processes import run_bounded, wait_bounded

SPEC = Path(__file__).with_name("test_managed_runs.py").read_text().split('SPEC = """')[1].split('"""')[0]
runner = CliRunner()


@pytest.fixture
def days(tmp_path: Path, monkeypatch) -> tuple[Path, Path]:
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("epochs: 2", "epochs: 1"))
    folder = tmp_path / "days"
    for seed, name in enumerate(["2026-11-01", "2026-11-02", "2026-11-03"]):
        made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "320", "--seed", str(seed + 1),
                                   "--out", str(folder / name)])
        assert made.exit_code == 0, made.output
    return spec, folder


def _follow(spec: Path, days: Path, out: Path, *args: str):
    result = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(out), "--quiet",
                                 "--device", "cpu", *args])
    assert result.exit_code == 0, result.output
    return result


def test_follow_trains_each_day_once_with_progressive_validation(days, tmp_path: Path):
    spec, folder = days
    out = tmp_path / "stream"
    _follow(spec, folder, out, "--follow-once", "--follow-export")
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01"]
    from flowrec.serving.predict import load_model

    package = load_model(out / "export" / "2026-11-01")  # the day's package, with its managed map
    assert package.maps["users"][0].size > 0
    rest = _follow(spec, folder, out, "--json")  # one JSON line per day (indented documents one after
    # the other were no JSON a reader could load)
    assert [json.loads(x)["run_dir"] for x in rest.stdout.splitlines()] == [
        str(out / "days" / d) for d in ("2026-11-02", "2026-11-03")]
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01", "2026-11-02", "2026-11-03"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [(x["day"], x["model"]) for x in lines] == [("2026-11-02", "2026-11-01"), ("2026-11-03", "2026-11-02")]
    assert all(0.0 <= x["metrics"]["ctr"]["auc"] <= 1.0 for x in lines)
    first = load_checkpoint(out / "days" / "2026-11-01")["model"]
    last = load_checkpoint(out / "days" / "2026-11-03")["model"]
    steps = 320 // 16
    assert int(first["managed.users.clock"][0]) == steps
    assert int(last["managed.users.clock"][0]) == 3 * steps  # the map went on across days
    before = (out / "days" / "2026-11-03" / "checkpoint.pt").stat().st_mtime_ns
    _follow(spec, folder, out)  # nothing new: nothing trained again
    assert (out / "days" / "2026-11-03" / "checkpoint.pt").stat().st_mtime_ns == before

    by_hand = tmp_path / "by_hand"
    previous = None
    for name in ["2026-11-01", "2026-11-02", "2026-11-03"]:
        args = ["train", str(spec), "--data", str(folder / name), "--out", str(by_hand / name), "--quiet",
                "--device", "cpu"] + (["--init-from", str(previous)] if previous else [])
        result = runner.invoke(app, args)
        assert result.exit_code == 0, result.output
        previous = by_hand / name
    mine = load_checkpoint(by_hand / "2026-11-03")["model"]
    assert all(torch.equal(mine[k], last[k]) for k in mine)


def test_a_kill_during_a_day_then_the_same_command_ends_bitwise_equal(days, tmp_path: Path):
    import os
    import signal
    import subprocess
    import sys
    import time

    spec, folder = days
    whole = tmp_path / "whole"
    _follow(spec, folder, whole, "--checkpoint-every", "3")
    cut = tmp_path / "cut"
    argv = [sys.executable, "-m", "flowrec", "train", str(spec), "--follow", str(folder), "--out", str(cut),
            "--quiet", "--device", "cpu", "--checkpoint-every", "3"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.Popen(argv, cwd=tmp_path, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = cut / "days" / "2026-11-02" / "checkpoint.pt"
    deadline = time.monotonic() + 300
    while not target.is_file() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    wait_bounded(proc, 60)
    assert target.is_file() and "2026-11-03" not in (cut / "follow.json").read_text()  # cut in the middle of day 2
    again = run_bounded(argv, cwd=tmp_path, env=env, capture_output=True, timeout_s=600)
    assert again.returncode == 0, again.stderr.decode()[-2000:]
    a = load_checkpoint(whole / "days" / "2026-11-03")["model"]
    b = load_checkpoint(cut / "days" / "2026-11-03")["model"]
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    days_scored = [json.loads(x)["day"] for x in (cut / "metrics.jsonl").read_text().splitlines()]
    assert days_scored == ["2026-11-02", "2026-11-03"]


@pytest.mark.parametrize("extra, flag", [(["--data", "x"], "--data"), (["--resume", "x"], "--resume"),
                                         (["--init-from", "x"], "--init-from")])
def test_follow_refuses_flags_that_name_another_run_or_data(days, tmp_path: Path, extra: list, flag: str):
    spec, folder = days
    result = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(tmp_path / "s"), *extra])
    assert result.exit_code == 2
    assert flag in result.output and "Traceback" not in result.output
    assert not (tmp_path / "s").exists()


def test_a_day_landing_before_the_last_trained_one_is_refused(days, tmp_path: Path):
    import shutil

    spec, folder = days
    out = tmp_path / "stream"
    _follow(spec, folder, out, "--follow-once")
    _follow(spec, folder, out, "--follow-once")
    shutil.copytree(folder / "2026-11-01", folder / "2026-10-31")  # lands late, named earlier
    late = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet"])
    assert late.exit_code == 2 and "2026-10-31" in late.output and "Traceback" not in late.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01", "2026-11-02"]
    (out / "follow.json").write_text("{oops")
    damaged = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet"])
    assert damaged.exit_code == 2 and "follow.json" in damaged.output and "Traceback" not in damaged.output


def test_days_follow_a_date_column_and_a_stream_keeps_its_order(tmp_path: Path, monkeypatch):
    """Days converted with data option date_column train in date order (not name order); the
    stream refuses another order, and a day dated before the last day trained."""
    import numpy as np

    from tests.unit.test_days import write_day

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("epochs: 2", "epochs: 1") + "data: {format: csv, path: raw, options: {date_column: ts}}\n")
    rng = np.random.default_rng()
    folder, first = tmp_path / "days", None
    for name, start in (("b", 1000), ("a", 3000), ("c", 2000), ("0", 500)):
        write_day(tmp_path / f"{name}.csv", rng, start)
        target = folder / name if name != "0" else tmp_path / "late" / name
        extra = ["--encoder-from", str(first)] if first else []
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / f"{name}.csv"), str(target),
                                   "--spec", str(spec), "-q", *extra])
        assert made.exit_code == 0, made.output
        first = first or target
    out = tmp_path / "stream"
    _follow(spec, folder, out, "--follow-order", "date:ts", "--follow-once")
    _follow(spec, folder, out, "--follow-order", "date:ts", "--follow-once")
    assert json.loads((out / "follow.json").read_text()) == {"days": ["b", "c"], "order": "date:ts", "names": "natural"}
    other = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                "--device", "cpu"])
    assert other.exit_code == 2 and "--follow-order date:ts" in other.output
    (tmp_path / "late" / "0").rename(folder / "0")  # lands dated before the days trained
    late = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                               "--device", "cpu", "--follow-order", "date:ts"])
    assert late.exit_code == 2 and "landed after day c" in late.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["b", "c"]


def test_a_day_copied_in_before_its_dates_is_waited_for_in_date_order(tmp_path: Path, monkeypatch):
    """With --follow-order date:COLUMN, a day copied in (cp -r, rsync) whose _flowrec.json and part
    file arrived before its _flowrec_stats.json stopped a --follow-wait stream with exit 2 ('day c:
    no dates of column ts (convert it with the data option date_column ...)'), the day wrongly
    called unconvertible. Now the stream waits for it as for a day whose rows are not all there, and
    trains it once its files are complete."""
    import shutil

    import numpy as np

    from tests.unit.test_days import write_day

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("epochs: 2", "epochs: 1") + "data: {format: csv, path: raw, options: {date_column: ts}}\n")
    rng = np.random.default_rng(3)
    folder, staged = tmp_path / "days", tmp_path / "staged"
    for name, start, target in (("a", 1000, folder / "a"), ("b", 2000, staged / "b")):
        write_day(tmp_path / f"{name}.csv", rng, start)
        extra = ["--encoder-from", str(folder / "a")] if name == "b" else []
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / f"{name}.csv"), str(target),
                                   "--spec", str(spec), "-q", *extra])
        assert made.exit_code == 0, made.output
    (folder / "b").mkdir()  # the copy under way: the stats file comes last
    for part in staged.joinpath("b").iterdir():
        if part.name != "_flowrec_stats.json":
            shutil.copy(part, folder / "b" / part.name)
    stats = folder / "b" / "_flowrec_stats.json"
    polls = copy_lands_in_first_wait(monkeypatch, stats.exists, lambda: not stats.exists(),
                                     lambda: shutil.copy(staged / "b" / stats.name, stats))
    out = tmp_path / "stream"
    waited = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                 "--device", "cpu", "--follow-order", "date:ts", "--follow-wait", "60"])
    assert waited.exit_code == 130, waited.output
    assert polls == [False, True], polls
    assert waited.output.count("waiting for the days under") == 1, waited.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["a", "b"]


def test_a_day_copied_in_before_its_vocabulary_is_waited_for(tmp_path: Path, monkeypatch):
    """A day copied in (cp -r, rsync) whose _flowrec.json and part files arrived before its _vocab/
    folder (a table with a vocabulary) passed the stream's check of its rows, and its training
    stopped the --follow-wait stream, exit 2: '_vocab/item.parquet: unreadable vocabulary file
    (FileNotFoundError)'. Now the stream waits for the day's vocabulary files too, then trains it."""
    import shutil

    import numpy as np

    from tests.unit.test_days import write_day

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.replace("epochs: 2", "epochs: 1").replace("hash_buckets: 3000", "vocab: 60"))
    assert "vocab: 60" in spec.read_text()
    rng = np.random.default_rng(4)
    folder, staged = tmp_path / "days", tmp_path / "staged"
    for name, target in (("a", folder / "a"), ("b", staged / "b")):
        write_day(tmp_path / f"{name}.csv", rng, 1000)
        extra = ["--encoder-from", str(folder / "a")] if name == "b" else []
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / f"{name}.csv"), str(target),
                                   "--spec", str(spec), "-q", *extra])
        assert made.exit_code == 0, made.output
    assert (staged / "b" / "_vocab").is_dir()
    shutil.copytree(staged / "b", folder / "b", ignore=shutil.ignore_patterns("_vocab"))  # the copy under way
    vocab = folder / "b" / "_vocab"
    polls = copy_lands_in_first_wait(monkeypatch, vocab.exists, lambda: not vocab.exists(),
                                     lambda: shutil.copytree(staged / "b" / "_vocab", vocab))
    out = tmp_path / "stream"
    waited = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                 "--device", "cpu", "--follow-wait", "60"])
    assert waited.exit_code == 130, waited.output
    assert polls == [False, True], polls
    assert waited.output.count("waiting for day b to be complete") == 1, waited.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["a", "b"]


def test_an_interrupted_day_names_the_streams_command_not_a_resume_of_the_day(days, tmp_path: Path, monkeypatch):
    """Ctrl-C in a day's training said `continue with flowrec train SPEC --resume RUN/days/<day>`:
    that trains the day alone, and the stream's follow.json never lists it nor do the next days
    train. The line names the --follow command, which resumes the day and goes on."""
    from flowrec.runtime.trainer import Trainer

    spec, folder = days
    out = tmp_path / "stream"

    def interrupted(self, *args, **kwargs):
        raise KeyboardInterrupt

    with monkeypatch.context() as patched:
        patched.setattr(Trainer, "fit", interrupted)
        cut = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--device", "cpu",
                                  "--follow-export"])
    assert cut.exit_code == 130, cut.output
    lines = [x for x in cut.output.splitlines() if "continue with" in x]
    assert lines and all(f"--follow {folder} --out {out} --follow-export" in x and "--resume" not in x
                         for x in lines), cut.output
    _follow(spec, folder, out)  # the command it named: every day trained and recorded
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01", "2026-11-02", "2026-11-03"]


@pytest.mark.parametrize("signal_name", ["SIGTERM", "Ctrl-C"])
def test_an_interrupt_while_a_day_is_exported_names_the_streams_command(days, tmp_path: Path, monkeypatch,
                                                                       signal_name: str):
    """SIGTERM or Ctrl-C while --follow-export wrote a day's package ended the stream on export's own
    line ('interrupted (SIGTERM); runs/stream/export/<day> was not written'), with no word of the
    stream nor of how to continue it, where an interrupt in a day's training or in the wait names
    the --follow command. Now the last line is the stream's, and that command finishes the day."""
    import flowrec.serving.export as export
    from flowrec.runtime.signals import Terminated

    spec, folder = days
    written = export.write_package

    def interrupted(*args, **kwargs):  # the second day's package
        if "2026-11-02" in str(args[1]):
            raise Terminated if signal_name == "SIGTERM" else KeyboardInterrupt
        return written(*args, **kwargs)

    monkeypatch.setattr(export, "write_package", interrupted)
    out = tmp_path / "stream"
    stopped = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                  "--device", "cpu", "--follow-export"])
    assert stopped.exit_code == 130, stopped.output
    line = stopped.output.strip().splitlines()[-1]
    assert line.startswith(f"error: interrupted ({signal_name}); the stream in") and "has trained 1 day(s)" in line, line
    assert f"continue with  flowrec train {spec} --follow {folder} --out {out} --follow-export" in line, line
    monkeypatch.setattr(export, "write_package", written)
    _follow(spec, folder, out, "--follow-export")
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01", "2026-11-02", "2026-11-03"]
    assert sorted(p.name for p in (out / "export").iterdir()) == ["2026-11-01", "2026-11-02", "2026-11-03"]


def test_ctrl_c_while_waiting_for_a_day_says_how_many_days_the_stream_trained(days, tmp_path: Path, monkeypatch):
    """Ctrl-C during --follow-wait said 'before training started; nothing was trained' after the
    stream had trained its days."""
    import threading

    import flowrec.cli.follow as follow_cli

    spec, folder = days
    out = tmp_path / "stream"

    sleep = follow_cli.time.sleep

    def interrupted(seconds):  # Ctrl-C in the stream's wait for a new day (other sleeps as they were)
        if seconds == follow_cli.POLL_S and threading.current_thread() is threading.main_thread():
            raise KeyboardInterrupt
        sleep(seconds)

    monkeypatch.setattr(follow_cli.time, "sleep", interrupted)
    waited = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                 "--device", "cpu", "--follow-wait", "60"])
    assert waited.exit_code == 130, waited.output
    assert "nothing was trained" not in waited.output and "Traceback" not in waited.output
    assert f"the stream in {out} has trained 3 day(s)" in waited.output
    assert f"continue with  flowrec train {spec} --follow {folder} --out {out}" in waited.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01", "2026-11-02", "2026-11-03"]


def test_a_day_encoded_for_another_spec_is_refused_naming_its_folder(days, tmp_path: Path):
    """A day converted for another spec among the stream's days was refused with 'dataset was
    encoded for spec ...', naming no folder: which of the days?"""
    spec, folder = days
    out = tmp_path / "stream"
    _follow(spec, folder, out, "--follow-once")
    other = tmp_path / "other.yaml"
    other.write_text(spec.read_text().replace("hash_buckets: 3000", "hash_buckets: 2000"))
    (folder / "2026-11-02").rename(tmp_path / "moved")
    made = runner.invoke(app, ["data", "synth", str(other), "--rows", "64", "--out", str(folder / "2026-11-02")])
    assert made.exit_code == 0, made.output
    refused = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert f"dataset {folder / '2026-11-02'} was encoded for spec" in refused.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01"]


def test_commands_given_the_stream_folder_point_at_its_days(days, tmp_path: Path):
    """eval, --init-from, plan --managed-from and data convert --encoder-from of the stream's folder
    said 'no checkpoint at RUN/checkpoint.pt', 'the run recorded no managed tables (none in its
    spec, or it never ended)' or 'RUN holds no encoder', and --resume 'nothing to resume'; each now
    names a day's run (or, for --resume, the --follow command that continues the stream), as
    export did."""
    spec, folder = days
    out = tmp_path / "stream"
    _follow(spec, folder, out, "--follow-once")
    last = out / "days" / "2026-11-01"
    commands = {"eval": ["eval", str(out)],
                "init": ["train", str(spec), "--init-from", str(out), "--data", str(folder / "2026-11-02"),
                         "--out", str(tmp_path / "child")],
                "plan": ["plan", str(spec), "--managed-from", str(out)],
                "convert": ["data", "convert", "csv", str(tmp_path / "day.csv"), str(tmp_path / "converted"), "--spec",
                            str(spec), "--encoder-from", str(out)]}
    for name, argv in commands.items():
        refused = runner.invoke(app, argv)
        assert refused.exit_code == 2 and "Traceback" not in refused.output, (name, refused.output)
        assert f"{out} is a --follow stream folder" in refused.output and str(last) in refused.output, refused.output
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(out)])
    assert resumed.exit_code == 2 and f"--follow DAYS --out {out}" in resumed.output, resumed.output
    assert not (tmp_path / "child").exists() and not (tmp_path / "converted").exists()
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01"]


def test_a_folder_of_the_users_own_files_is_refused_as_the_streams_folder(days, tmp_path: Path):
    """`--out` of a folder holding the user's files was taken as the stream's folder: its
    metrics.jsonl was cut back and rewritten by the second day's progressive line (a run refuses
    such a folder)."""
    spec, folder = days
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "metrics.jsonl").write_text('{"my": "log", "step": 7}\nanother line of mine\n')
    (mine / "notes.txt").write_text("keep me\n")
    refused = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(mine), "--quiet"])
    assert refused.exit_code == 2 and "Traceback" not in refused.output
    assert f"--out {mine} is not empty and is not a --follow stream's folder (it holds metrics.jsonl, notes.txt)" \
        in refused.output
    assert sorted(p.name for p in mine.iterdir()) == ["metrics.jsonl", "notes.txt"]
    assert (mine / "metrics.jsonl").read_text() == '{"my": "log", "step": 7}\nanother line of mine\n'


def test_a_day_still_being_copied_is_waited_for_not_refused(days, tmp_path: Path, monkeypatch):
    """A day copied in with `cp -r` or rsync whose _flowrec.json arrived before its part files (here
    one truncated, as mid-copy) stopped a --follow-wait stream with exit 2 ('not a readable Parquet
    file ... convert it again'). Now the stream says it waits for that day and trains it once its
    files are complete; without --follow-wait it is one line that says how to land a day."""

    spec, folder = days
    part = sorted((folder / "2026-11-02").glob("*.parquet"))[0]
    whole = part.read_bytes()
    part.write_bytes(whole[: len(whole) // 2])
    refused = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(tmp_path / "s0"),
                                  "--quiet", "--device", "cpu"])
    assert refused.exit_code == 2, refused.output
    line = refused.output.strip().splitlines()[-1]
    assert "day 2026-11-02 is not complete" in line and "--follow-wait" in line, line
    assert json.loads((tmp_path / "s0" / "follow.json").read_text())["days"] == ["2026-11-01"]

    polls = copy_lands_in_first_wait(monkeypatch, lambda: part.stat().st_size,
                                     lambda: part.stat().st_size < len(whole), lambda: part.write_bytes(whole))
    out = tmp_path / "s1"
    waited = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                 "--device", "cpu", "--follow-wait", "60"])
    assert waited.exit_code == 130, waited.output
    assert polls[0] < len(whole) and len(polls) == 2, polls
    assert waited.output.count("waiting for day 2026-11-02 to be complete") == 1, waited.output
    assert json.loads((out / "follow.json").read_text())["days"] == ["2026-11-01", "2026-11-02", "2026-11-03"]


def test_sigterm_while_waiting_for_a_day_ends_in_the_streams_line(days, tmp_path: Path, monkeypatch):
    """SIGTERM (kill, timeout, a scheduler) while --follow waited for a day ended the process with
    exit 143 and no word; then it said 'interrupted (Ctrl-C)'. Now the stream's line names SIGTERM,
    with the days trained and the command to continue, exit 130, as Ctrl-C there."""
    import os
    import signal
    import threading

    import flowrec.cli.follow as follow_cli

    spec, folder = days
    out = tmp_path / "stream"
    sleep = follow_cli.time.sleep

    def terminated(seconds):  # SIGTERM to this process in the stream's wait for a new day
        if seconds == follow_cli.POLL_S and threading.current_thread() is threading.main_thread():
            os.kill(os.getpid(), signal.SIGTERM)
        sleep(seconds)

    monkeypatch.setattr(follow_cli.time, "sleep", terminated)
    waited = runner.invoke(app, ["train", str(spec), "--follow", str(folder), "--out", str(out), "--quiet",
                                 "--device", "cpu", "--follow-wait", "60"])
    assert waited.exit_code == 130, waited.output
    line = waited.output.strip().splitlines()[-1]
    assert line.startswith("error: interrupted (SIGTERM); the stream in") and "has trained 3 day(s)" in line, line
    assert f"continue with  flowrec train {spec} --follow {folder} --out {out}" in line


def copy_lands_in_first_wait(monkeypatch, observe, pending, land):
    """Patch the stream's sleep between polls: at each poll of the main thread, note `observe()`;
    while `pending()`, `land()` (the copy under way finishes during the wait) and poll again; then
    Ctrl-C, once no day is left. Returns the notes, one a poll."""
    import threading

    import flowrec.cli.follow as follow_cli

    sleep, polls = follow_cli.time.sleep, []

    def copy_lands(seconds):
        if seconds == follow_cli.POLL_S and threading.current_thread() is threading.main_thread():
            polls.append(observe())
            if pending():
                land()
                return
            raise KeyboardInterrupt
        sleep(seconds)

    monkeypatch.setattr(follow_cli.time, "sleep", copy_lands)
    return polls
