"""SIGTERM (what `kill`, `timeout` and schedulers send) while `flowrec data convert` / `data synth`
write a dataset, `export` a package or `predict` a scores file: one line, exit 130, and no partial
folder or temp file left beside the output; and while any other command works (`plan`, `validate`,
`data inspect`): one line, exit 130."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import communicate_bounded, kill_tree, readline_bounded, run_bounded, wait_bounded
from flowrec.testing.ranks import subprocess_env

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 120
SPEC = """name: s
features:
- {name: d1, type: dense}
- {name: user, type: categorical, hash_buckets: 100, dim: 4}
modules:
- {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [4]}
heads:
- {name: ctr, input: top}
"""
# the process sends itself a signal (argv[1]) as it writes its first part file: no timing involved;
# argv[2] "ignored": SIGHUP ignored from the start, as `nohup` starts a command
TERMINATED = """
import os, signal, sys
import flowrec.data.convert as convert  # its PartWriter writes synth's parts too
from flowrec.__main__ import run

sig = getattr(signal, sys.argv.pop(1))
if sys.argv.pop(1) == "ignored":
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
real = convert.PartWriter.write

def write(self, *args, **kwargs):
    os.kill(os.getpid(), sig)
    return real(self, *args, **kwargs)

convert.PartWriter.write = write
sys.argv = ["flowrec", *sys.argv[1:]]
run()
"""


def _dataset_args(tmp_path: Path, command: str) -> list[str]:
    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "rows.csv").write_text("d1,user,label\n" + "".join(f"{i},u{i},{i % 2}\n" for i in range(50)))
    (tmp_path / "out").mkdir()
    return (["data", "convert", "csv", "rows.csv", "out/ds", "--spec", "spec.yaml", "-q"] if command == "convert"
            else ["data", "synth", "spec.yaml", "--rows", "50", "--out", "out/ds"])


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGHUP"])
@pytest.mark.parametrize("command", ["convert", "synth"])
def test_sigterm_while_a_dataset_is_written_leaves_no_partial_folder(tmp_path: Path, command: str, sig: str) -> None:
    """SIGTERM, and SIGHUP (a terminal closed, an ssh connection dropped), ended the process at once
    (Python's default: no line, status -15 or -1) and left the hidden `.OUT.partial-*` folder it was
    writing, a dataset's worth of part files, beside OUT."""
    args = _dataset_args(tmp_path, command)
    done = run_bounded([sys.executable, "-c", TERMINATED, sig, "", *args], cwd=tmp_path, env=subprocess_env(ROOT),
                       text=True, capture_output=True, timeout_s=TIMEOUT_S)
    assert done.returncode == 130, (done.returncode, done.stderr[-2000:])
    assert done.stderr.strip().splitlines()[-1] == f"error: interrupted ({sig})", done.stderr[-2000:]
    assert list((tmp_path / "out").iterdir()) == []


@pytest.mark.parametrize("command", ["convert", "synth"])
def test_sighup_ignored_from_the_start_is_still_ignored(tmp_path: Path, command: str) -> None:
    """Under `nohup` (SIGHUP ignored when the command starts) a hangup does not stop the command."""
    args = _dataset_args(tmp_path, command)
    done = run_bounded([sys.executable, "-c", TERMINATED, "SIGHUP", "ignored", *args], cwd=tmp_path,
                       env=subprocess_env(ROOT), text=True, capture_output=True, timeout_s=TIMEOUT_S)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert [p.name for p in (tmp_path / "out").iterdir()] == ["ds"]
    assert list((tmp_path / "out" / "ds").glob("*.parquet")) or list((tmp_path / "out" / "ds").rglob("*.parquet"))


# the same, as export stages its package and as predict opens its scores file
STAGED = """
import os, signal, sys
from pathlib import Path
import flowrec.cli.predict_cmd as predict_cmd, flowrec.serving.export as export
from flowrec.__main__ import run

def package(trained, out, *args, **kwargs):
    Path(out).mkdir(parents=True)
    (Path(out) / "model.pt2").write_bytes(b"part")
    os.kill(os.getpid(), signal.SIGTERM)

opened = predict_cmd._open_writer

def scores(*args, **kwargs):
    writer = opened(*args, **kwargs)
    os.kill(os.getpid(), signal.SIGTERM)
    return writer

export.write_package, predict_cmd._open_writer = package, scores
sys.argv = ["flowrec", *sys.argv[1:]]
run()
"""


def test_sigterm_while_a_package_or_scores_are_written_leaves_nothing_behind(tmp_path: Path) -> None:
    """SIGTERM ended `export` and `predict` without a word (status -15), leaving the package's
    staging folder `.OUT.export-tmp`, or the scores' temp file `.NAME.PID-*.tmp.parquet`, beside OUT."""
    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "rows.csv").write_text("d1,user,label\n" + "".join(f"{i},u{i},{i % 2}\n" for i in range(50)))
    env = subprocess_env(ROOT)
    for args in (["train", "spec.yaml", "--rows", "300", "--out", "run", "-q"], ["export", "run", "pkg"]):
        made = run_bounded([sys.executable, "-m", "flowrec", *args], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout_s=TIMEOUT_S)
        assert made.returncode == 0, made.stderr[-2000:]
    (tmp_path / "out").mkdir()
    for args in (["export", "run", "out/pkg"],
                 ["predict", "pkg", "rows.csv", "--format", "csv", "--out", "out/scores.parquet"]):
        done = run_bounded([sys.executable, "-c", STAGED, *args], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout_s=TIMEOUT_S)
        assert done.returncode == 130, (args[0], done.returncode, done.stderr[-2000:])
        assert "interrupted (SIGTERM)" in done.stderr
        assert list((tmp_path / "out").iterdir()) == []


# a reader of the dataset `ds` (as a run's training source is): opens it, says so, reads every row
# group of it once told to (a run's next epoch), prints the rows and the sum of d1 it read
READER = """
import sys
from flowrec.data.dataset import ParquetSource
source = ParquetSource("ds")
print("open", flush=True)
sys.stdin.readline()
tables = [source.submit(i, ["d1"]).result() for i in range(len(source.files))]
print(sum(t.num_rows for t in tables), sum(float(t["d1"].to_numpy().sum()) for t in tables), flush=True)
source.close()
"""


def test_a_conversion_replacing_a_dataset_waits_for_its_readers(tmp_path: Path) -> None:
    """`data synth ds --overwrite` (convert alike) while a run trained on ds renamed the new dataset
    over it: the run read the new part files under the old layout ('unreadable Parquet part' in the
    middle of training), or, where the layouts matched, the new rows silently. Now the replacement
    waits, with a line, until no flowrec process reads ds; the reader reads the old rows whole."""
    import pyarrow.parquet as pq

    (tmp_path / "spec.yaml").write_text(SPEC)
    env = subprocess_env(ROOT)
    made = run_bounded([sys.executable, "-m", "flowrec", "data", "synth", "spec.yaml", "--rows", "3000",
                        "--rows-per-file", "1000", "--out", "ds"], cwd=tmp_path, env=env, text=True,
                       capture_output=True, timeout_s=TIMEOUT_S)
    assert made.returncode == 0, made.stderr[-2000:]
    old = pq.read_table(tmp_path / "ds", columns=["d1"])
    reader = subprocess.Popen([sys.executable, "-c", READER], cwd=tmp_path, env=env, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    writer = None
    try:
        assert readline_bounded(reader, reader.stdout, TIMEOUT_S).strip() == "open", reader.stderr.read()[-2000:]
        writer = subprocess.Popen([sys.executable, "-m", "flowrec", "data", "synth", "spec.yaml", "--rows", "500",
                                   "--seed", "9", "--rows-per-file", "250", "--out", "ds", "--overwrite"],
                                  cwd=tmp_path, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        waiting = readline_bounded(writer, writer.stderr, TIMEOUT_S)  # its wait; before, its exit: ""
        assert "waiting for the flowrec processes reading ds" in waiting, waiting
        assert writer.poll() is None
        read, err = communicate_bounded(reader, TIMEOUT_S, "go\n")
        assert reader.returncode == 0, err[-2000:]
        rows, total = read.split()
        assert int(rows) == 3000 and float(total) == pytest.approx(float(old["d1"].to_numpy().sum()))
        _, err = communicate_bounded(writer, TIMEOUT_S)
        assert writer.returncode == 0, err[-2000:]
        assert pq.read_table(tmp_path / "ds", columns=["d1"]).num_rows == 500
        assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "spec.yaml"]  # no .ds.old-* left
    finally:
        for process in (reader, writer):
            if process is not None and process.poll() is None:
                kill_tree(process.pid)
            if process is not None:
                wait_bounded(process, TIMEOUT_S)


# the process sends itself SIGTERM as calibrate measures and as eval scores
MEASURING = """
import os, signal, sys
import flowrec.measure.calibrate as calibrate, flowrec.serving.trained as trained
from flowrec.__main__ import run

def terminated(*args, **kwargs):
    os.kill(os.getpid(), signal.SIGTERM)

calibrate.calibrate = trained.Trained.evaluate_dataset = terminated
sys.argv = ["flowrec", *sys.argv[1:]]
run()
"""


def test_sigterm_while_calibrate_measures_or_eval_scores_is_one_line(tmp_path: Path) -> None:
    """SIGTERM (timeout, a scheduler) ended `flowrec calibrate` and `flowrec eval` at once without
    a word, status 143, where every command's interrupt is one line and exit 130 (guide.md);
    Ctrl-C ended calibrate with an empty line. Now each says it was interrupted, exit 130, and leaves
    no --out or --json file, nor a temp file of one."""
    (tmp_path / "spec.yaml").write_text(SPEC)
    env = subprocess_env(ROOT)
    for args in (["data", "synth", "spec.yaml", "--rows", "300", "--out", "ds"],
                 ["train", "spec.yaml", "--data", "ds", "--out", "run", "-q"]):
        made = run_bounded([sys.executable, "-m", "flowrec", *args], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout_s=TIMEOUT_S)
        assert made.returncode == 0, made.stderr[-2000:]
    (tmp_path / "out").mkdir()
    for args, nothing in ((["calibrate", "spec.yaml", "--out", "out/cal.json"], "; no device profile was written"),
                          (["eval", "run", "--data", "ds", "--json", "out/m.json"], "")):
        done = run_bounded([sys.executable, "-c", MEASURING, *args], cwd=tmp_path, env=env, text=True,
                           capture_output=True, timeout_s=TIMEOUT_S)
        assert done.returncode == 130, (args[0], done.returncode, done.stderr[-2000:])
        assert done.stderr.strip().splitlines()[-1] == f"error: interrupted (SIGTERM){nothing}", done.stderr
        assert list((tmp_path / "out").iterdir()) == []


# the process sends itself SIGTERM right after it renamed the old dataset aside, before the new one is renamed in
SWAPPING = """
import os, signal, sys
from flowrec.__main__ import run

rename = os.rename

def renamed(source, target):
    rename(source, target)
    if ".old-" in os.fspath(target):
        os.kill(os.getpid(), signal.SIGTERM)

os.rename = renamed
sys.argv = ["flowrec", *sys.argv[1:]]
run()
"""


def test_sigterm_while_the_new_dataset_is_swapped_in_leaves_one_of_the_two(tmp_path: Path) -> None:
    """SIGTERM between the rename of the old OUT aside and that of the new one into place ended
    `data synth --overwrite` with 'interrupted (SIGTERM)' and no OUT at all: the old dataset hidden
    in `.OUT.old-*`, the new one removed as unfinished. Now the swap (and the old folder's removal)
    finishes: the new dataset is OUT, nothing hidden is left, and the command completes."""
    import pyarrow.parquet as pq

    (tmp_path / "spec.yaml").write_text(SPEC)
    env = subprocess_env(ROOT)
    made = run_bounded([sys.executable, "-m", "flowrec", "data", "synth", "spec.yaml", "--rows", "300",
                        "--out", "ds"], cwd=tmp_path, env=env, text=True, capture_output=True, timeout_s=TIMEOUT_S)
    assert made.returncode == 0, made.stderr[-2000:]
    done = run_bounded([sys.executable, "-c", SWAPPING, "data", "synth", "spec.yaml", "--rows", "200", "--out",
                        "ds", "--overwrite"], cwd=tmp_path, env=env, text=True, capture_output=True,
                       timeout_s=TIMEOUT_S)
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds", "spec.yaml"]
    assert pq.read_table(tmp_path / "ds").num_rows == 200


# holds a read lock on the folder argv[1] (as a dataset source, a `flowrec eval RUN`'s, does) until told to stop
HOLDER = """
import sys
from flowrec.data.readers import hold_for_reading, release
fd = hold_for_reading(sys.argv[1])
print("open" if fd is not None else "no lock", flush=True)
sys.stdin.readline()
release(fd)
"""


def test_a_run_encoding_its_changed_bound_data_again_waits_for_the_readers_of_run_data(tmp_path: Path) -> None:
    """`flowrec train SPEC --out RUN --overwrite` whose bound raw file changed removed RUN/data at
    once to encode it again, under a `flowrec eval RUN` reading it; now the new encoding replaces it
    once complete, after the readers are done, with the line of `data convert --overwrite`'s wait."""
    import os
    import threading
    import time

    import pyarrow.parquet as pq

    from flowrec.runtime.session import bound_dataset
    from flowrec.spec.load import load_spec

    def rows(folder: Path) -> int:
        return sum(pq.read_metadata(f).num_rows for f in folder.rglob("*.parquet"))

    raw = tmp_path / "raw.csv"
    raw.write_text("d1,user,label\n" + "".join(f"{i},u{i % 7},{i % 2}\n" for i in range(60)))
    spec_path = tmp_path / "spec.yaml"
    spec_path.write_text(SPEC + "data: {format: csv, path: raw.csv}\n")
    spec = load_spec(spec_path)
    data = bound_dataset(spec, spec_path, tmp_path / "run", lambda _: None)
    assert rows(data) == 60
    raw.write_text(raw.read_text() + "".join(f"{i}.5,u{i % 7},{i % 2}\n" for i in range(40)))
    os.utime(raw, ns=(raw.stat().st_atime_ns, raw.stat().st_mtime_ns + 10**9))  # (a coarse file clock)
    said: list[str] = []
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(data)], env=subprocess_env(ROOT), text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    encoding = threading.Thread(target=lambda: bound_dataset(spec, spec_path, tmp_path / "run", said.append))
    try:
        assert readline_bounded(holder, holder.stdout, TIMEOUT_S).strip() == "open", holder.stderr.read()[-2000:]
        encoding.start()
        deadline = time.monotonic() + TIMEOUT_S
        while encoding.is_alive() and not any("waiting for the flowrec processes reading" in s for s in said):
            assert time.monotonic() < deadline, said
            time.sleep(0.05)
        assert encoding.is_alive() and rows(data) == 60, said  # the reader's rows are all still there
        communicate_bounded(holder, TIMEOUT_S, "done\n")
        encoding.join(TIMEOUT_S)
        assert not encoding.is_alive()
        assert rows(data) == 100 and any("encoding it again" in s for s in said), said
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["data"]  # no .data.old-* left
    finally:
        if holder.poll() is None:
            kill_tree(holder.pid)
        wait_bounded(holder, 30)
        if encoding.is_alive():
            encoding.join(TIMEOUT_S)


# the command's work (argv[1], "module:function") writes a marker (argv[2]) and waits there, as a long
# plan or a long scan would: the test signals the process from outside once the marker is there
WORKING = """
import importlib, sys, time
from pathlib import Path
from flowrec.__main__ import run

module, name = sys.argv.pop(1).split(":")
marker = Path(sys.argv.pop(1))

def working(*args, **kwargs):
    marker.write_text("working")
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        time.sleep(0.01)
    raise SystemExit("never stopped")

setattr(importlib.import_module(module), name, working)
sys.argv = ["flowrec", *sys.argv[1:]]
run()
"""


@pytest.mark.parametrize("sig, says", [("SIGTERM", "SIGTERM"), ("SIGHUP", "SIGHUP"), ("SIGINT", "Ctrl-C")])
@pytest.mark.parametrize("command", ["plan", "validate", "inspect"])
def test_a_signal_while_any_command_works_is_one_line_and_exit_130(
        tmp_path: Path, command: str, sig: str, says: str) -> None:
    """`flowrec plan SPEC` (so `validate`, and `data inspect` between its reads) stopped by SIGTERM
    ended at once without a word (status 143), where train, convert and the others say they were
    stopped in one line and exit 130; Ctrl-C said click's 'Aborted!' at status 1."""
    import signal
    import time

    from flowrec.testing.specs import run_spec

    (tmp_path / "spec.yaml").write_text(run_spec("signalled"))
    (tmp_path / "ds").mkdir()
    work, args = {"plan": ("flowrec.cli.plan_cmd:make_plan", ["plan", "spec.yaml"]),
                  "validate": ("flowrec.cli.spec_cmds:validate_paths", ["validate", "spec.yaml"]),
                  "inspect": ("flowrec.data.days:split_parts", ["data", "inspect", "ds"])}[command]
    marker = tmp_path / "started"
    proc = subprocess.Popen([sys.executable, "-c", WORKING, work, str(marker), *args], cwd=tmp_path,
                            env=subprocess_env(ROOT), text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not marker.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert marker.exists(), communicate_bounded(proc, TIMEOUT_S)
        proc.send_signal(getattr(signal, sig))
        out, err = communicate_bounded(proc, TIMEOUT_S)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            communicate_bounded(proc, 30)
    assert proc.returncode == 130, (proc.returncode, err[-2000:])
    assert err.strip().splitlines() == [f"error: interrupted ({says})"], err[-2000:]
    assert "never stopped" not in out + err
