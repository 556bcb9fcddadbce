"""`flowrec.train(spec, resume=RUN)`: a run continued from Python where it stopped, as `flowrec train
SPEC --resume RUN` continues it (flowrec.runs.resume): bitwise the run that was never stopped; a
finished run said finished, nothing written; each bad resume one clear error, nothing written.

Before it, a run stopped in a notebook said "`flowrec train SPEC --resume RUN` continues it": a
Python user had to leave Python to go on.
"""
from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.runs.errors import RunError
from flowrec.runtime.checkpoint.store import CheckpointError, load_checkpoint
from flowrec.runtime.rundir import RunFolderError
from flowrec.testing.folders import make_read_only


def _spec(folder: Path, epochs: int = 2) -> Path:
    """A tiny spec of random sizes (its ids Zipf-skewed by the synthetic rows)."""
    path = folder / "t.yaml"
    path.write_text(f"""
name: tiny
features:
  - {{name: price, type: dense, transform: log1p}}
  - {{name: user_id, type: categorical, hash_buckets: {random.randint(30, 90)}, dim: 4}}
  - {{name: item_id, type: categorical, hash_buckets: {random.randint(60, 150)}, dim: 4}}
modules:
  - {{name: deep, kind: mlp, inputs: ["@dense", user_id, item_id], layers: [{random.choice([4, 8])}]}}
heads:
  - {{name: click, input: deep, task: binary, loss: bce}}
optimizer:
  dense: {{name: adam, lr: {random.choice([0.01, 0.02])}}}
  sparse: {{name: adagrad, lr: 0.1}}
training:
  batch_size: {random.choice([16, 32])}
  epochs: {epochs}
""")
    return path


def _files(folder: Path) -> dict[str, bytes]:
    """Every file of a run folder with its bytes (the lock left out)."""
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != ".flowrec.lock"}


def _same_state(a: Path, b: Path) -> None:
    """The newest checkpoints of two runs hold the same tensors, bitwise, and the same position."""
    sa, sb = load_checkpoint(a), load_checkpoint(b)
    assert sa["position"] == sb["position"]
    assert sa["model"].keys() == sb["model"].keys()
    for key in sa["model"]:
        assert torch.equal(sa["model"][key], sb["model"][key]), key
    for x, y in zip(sa["dense_optimizer"]["state"].values(), sb["dense_optimizer"]["state"].values()):
        for key in x:
            assert torch.equal(torch.as_tensor(x[key]), torch.as_tensor(y[key])), key


def _options() -> dict:
    return {"rows": random.randint(250, 400), "seed": random.randint(1, 10**6)}


def test_a_run_resumed_in_python_ends_bitwise_as_the_run_never_stopped(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    n, options = random.randint(3, 5), _options()
    flowrec.train("t.yaml", out="a", max_steps=n, **options)
    seen = []
    run = flowrec.train("t.yaml", resume="a", max_steps=2 * n, on_step=lambda e: seen.append(e.step))
    whole = flowrec.train("t.yaml", out="whole", max_steps=2 * n, **options)
    assert seen == list(range(n + 1, 2 * n + 1))  # the callback sees the steps from the resumed one on
    assert run.result.steps == whole.result.steps == 2 * n and run.run_dir == Path("a")
    assert run.metrics == whole.metrics and run.metrics["click"]["samples"] > 0
    assert [r["step"] for r in run.history if r["event"] == "train"] == list(range(1, 2 * n + 1))
    _same_state(Path("a"), Path("whole"))


def test_an_interrupted_run_names_the_python_call_that_continues_it_and_that_call_does(tmp_path: Path,
                                                                                        monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    total, options = random.randint(5, 8), _options()
    stop = random.randint(2, total - 2)

    def on_step(event) -> None:
        if event.step == stop:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt) as caught:
        flowrec.train(spec, out=tmp_path / "a", max_steps=total, on_step=on_step, **options)
    assert f"flowrec.train({str(spec)!r}, resume={str(tmp_path / 'a')!r})" in str(caught.value)
    assert "flowrec train" not in str(caught.value)
    run = flowrec.train(spec, resume=tmp_path / "a")  # max_steps and the rest restored from run.json
    whole = flowrec.train(spec, out=tmp_path / "whole", max_steps=total, **options)
    assert run.result.steps == total and run.metrics == whole.metrics
    _same_state(tmp_path / "a", tmp_path / "whole")


def test_a_finished_run_is_said_finished_and_nothing_is_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    n = random.randint(2, 4)
    flowrec.train("t.yaml", out="a", max_steps=n, **_options())
    before = _files(tmp_path / "a")
    with pytest.warns(UserWarning, match=rf"a is finished: step {n}, .*max_steps={n}; nothing to train \(give a "
                                         r"larger max_steps= to train further\)"):
        run = flowrec.train("t.yaml", resume="a")
    assert run.trained.step == n and run.run_dir == Path("a")
    assert _files(tmp_path / "a") == before


@pytest.mark.parametrize("case", ["spec", "seed", "missing", "out", "overwrite", "checkpoint", "budget", "run.json"])
def test_a_resume_that_cannot_go_on_is_one_clear_error_and_writes_nothing(tmp_path: Path, monkeypatch,
                                                                         case: str) -> None:
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path)
    options = _options()
    flowrec.train("t.yaml", out="a", max_steps=2, **options)
    if case == "spec":  # another spec: one more epoch
        spec.write_text(spec.read_text().replace("epochs: 2", "epochs: 3"))
    if case == "checkpoint":
        data = (tmp_path / "a" / "checkpoint.pt").read_bytes()
        (tmp_path / "a" / "checkpoint.pt").write_bytes(data[: random.randint(100, len(data) // 2)])
    if case == "run.json":
        (tmp_path / "a" / "run.json").write_text((tmp_path / "a" / "run.json").read_text()[:-random.randint(2, 20)])
    before, listing = _files(tmp_path / "a"), sorted(p.name for p in tmp_path.iterdir())
    expected = {
        "spec": (RunError, r"t\.yaml differs from the spec the run in a was trained with: training\.epochs .*give "
                           r"epochs= to flowrec\.train"),
        "seed": (RunError, rf"seed={options['seed'] + 1} differs from the seed the run in a was trained with "
                           rf"\({options['seed']}\).*leave seed= out"),
        "missing": (RunFolderError, "nothing to resume: nowhere does not exist"),
        "out": (RunError, "out='b' and resume='a' name different run folders"),
        "overwrite": (RunError, "resume= continues a run and overwrite=True replaces it; give one of them"),
        "checkpoint": (CheckpointError, "checkpoint.pt"),
        "run.json": (RunFolderError, r"^a/run\.json is damaged \(.*\); it records how the run was started, so the run "
                                     r"cannot be resumed$"),
        "budget": (RunError, r"resume= continues the run with the plan it was trained with .*device_budget= would "
                             r"not change it"),
    }[case]
    arguments = {"spec": {}, "seed": {"seed": options["seed"] + 1}, "missing": {}, "out": {"out": "b"},
                 "overwrite": {"overwrite": True}, "checkpoint": {}, "budget": {"device_budget": "1MiB"},
                 "run.json": {}}[case]
    with pytest.raises(expected[0], match=expected[1]) as caught:
        flowrec.train("t.yaml", resume="nowhere" if case == "missing" else "a", **arguments)
    assert "\n" not in str(caught.value) and "--" not in str(caught.value).replace("--resume", "")
    assert _files(tmp_path / "a") == before
    assert sorted(p.name for p in tmp_path.iterdir()) == listing


def test_runs_go_on_across_the_command_line_and_python(tmp_path: Path, monkeypatch) -> None:
    """A run started by `flowrec train` continues in Python, by any spelling of its folder (relative,
    absolute, a Path, under ~), and a run started in Python continues on the command line, each the
    run never stopped."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(home)
    _spec(home)
    n, options = random.randint(2, 3), _options()
    common = ["--rows", str(options["rows"]), "--seed", str(options["seed"]), "-q"]
    result = CliRunner().invoke(app, ["train", "t.yaml", "--out", "cli", "--max-steps", str(n), *common])
    assert result.exit_code == 0, result.output
    flowrec.train("~/t.yaml", resume=random.choice(["~/cli", "./cli", str(home / "cli"), Path("cli")]),
                  max_steps=2 * n)
    flowrec.train(home / "t.yaml", out="py", max_steps=n, **options)
    result = CliRunner().invoke(app, ["train", "t.yaml", "--resume", "py", "--max-steps", str(2 * n), "-q"])
    assert result.exit_code == 0, result.output
    flowrec.train("t.yaml", out="whole", max_steps=2 * n, **options)
    _same_state(home / "cli", home / "whole")
    _same_state(home / "py", home / "whole")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same run resumed again from the other side: finished
        with pytest.raises(UserWarning, match="cli is finished"):
            flowrec.train("t.yaml", resume="cli")
    for spelled in ("~/cli", "./cli", "cli/", str(home / "cli"), Path("cli"), Path("~/cli"), home / "cli"):
        with pytest.warns(UserWarning, match=rf"cli is finished: step {2 * n},"):
            assert flowrec.train(Path("~/t.yaml"), resume=spelled).trained.step == 2 * n, spelled


def test_a_run_of_two_ranks_goes_on_in_python_as_on_the_command_line(tmp_path: Path, monkeypatch) -> None:
    """A `--nproc 2` run's folder (its tables in each rank's shards) resumed in Python goes on in one
    process, as `flowrec train SPEC --resume RUN` continues it: the same tensors, bitwise."""
    import shutil

    from flowrec.testing.ranks import run_flowrec

    monkeypatch.chdir(tmp_path)
    spec, n, options = _spec(tmp_path), random.randint(2, 3), _options()
    done = run_flowrec("train", str(spec), "--out", "ranks", "-q", "--device", "cpu", "--rows", str(options["rows"]),
                       "--seed", str(options["seed"]), "--max-steps", str(n), "--nproc", "2", "--dist-timeout", "60",
                       cwd=tmp_path, root=Path(__file__).resolve().parents[2], timeout_s=300)
    assert done.returncode == 0 and (tmp_path / "ranks" / "checkpoint.shards").is_dir(), done.stderr[-3000:]
    shutil.copytree(tmp_path / "ranks", tmp_path / "copy")
    run = flowrec.train("t.yaml", resume="ranks", max_steps=2 * n)
    result = CliRunner().invoke(app, ["train", "t.yaml", "--resume", "copy", "--max-steps", str(2 * n), "-q"])
    assert result.exit_code == 0, result.output
    assert run.result.steps == 2 * n
    _same_state(tmp_path / "ranks", tmp_path / "copy")


def test_a_stream_folder_given_to_resume_names_the_command_that_follows_it(tmp_path: Path, monkeypatch) -> None:
    """`resume=` of a `--follow` stream folder (each day a run of its own) said 'nothing to resume: it
    has no checkpoint.pt or run.json', though it holds a stream the command line goes on with."""
    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    stream = tmp_path / f"stream{random.randint(0, 99)}"
    stream.mkdir()
    (stream / "follow.json").write_text("{}")
    with pytest.raises(RunFolderError, match=rf"^{stream.name} is a --follow stream folder: continue it with the "
                                             rf"command that follows it, flowrec train t\.yaml --follow DAYS --out "
                                             rf"{stream.name} \(it resumes a day cut short\)$"):
        flowrec.train("t.yaml", resume=stream.name)
    assert _files(stream) == {"follow.json": b"{}"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a run recorded on CUDA is refused on a machine without it")
def test_a_run_recorded_on_cuda_is_continued_here_by_the_device_the_line_names(tmp_path: Path, monkeypatch) -> None:
    """A run whose run.json records device cuda, resumed on a machine without CUDA, said 'give
    device="cpu" or "auto"'; device="auto" is the default, which keeps the recorded device, and was
    refused again. The line names device="cpu", which continues it."""
    import json

    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    n = random.randint(2, 3)
    flowrec.train("t.yaml", out="a", max_steps=n, **_options())
    recorded = json.loads((tmp_path / "a" / "run.json").read_text())
    (tmp_path / "a" / "run.json").write_text(json.dumps({**recorded, "device": "cuda"}))
    before = _files(tmp_path / "a")
    for device in ({}, {"device": "auto"}):
        with pytest.raises(RunError, match="a was trained with device='cuda'") as caught:
            flowrec.train("t.yaml", resume="a", max_steps=2 * n, **device)
        assert 'give device="cpu" to continue it here' in str(caught.value) and "auto" not in str(caught.value)
        assert _files(tmp_path / "a") == before
    assert flowrec.train("t.yaml", resume="a", max_steps=2 * n, device="cpu").result.steps == 2 * n


def test_an_older_run_on_data_split_again_since_is_refused_in_python_as_on_the_command_line(tmp_path: Path) -> None:
    """A run of a flowrec of before 2026-12-05 (run.json without train_rows) whose --data folder this
    flowrec converted again since (another draw of the test rows): `flowrec train --resume` refuses it
    in one line, `flowrec.train(resume=)` went on from the checkpoint's batch in rows of another split,
    evaluating on rows it had trained on, without a word. Now the same line in Python's words."""
    import json

    import numpy as np

    rng = np.random.default_rng()
    ids = rng.zipf(1.3, 300) % 40
    rows = ["label,d1,c1"] + [f"{int(rng.random() < 0.3 + 0.01 * (i % 20))},{rng.lognormal():.3f},c{i}"
                              for i in ids]
    (tmp_path / "raw.csv").write_text("\n".join(rows) + "\n")
    spec = tmp_path / "s.yaml"
    spec.write_text("name: s\nfeatures:\n  - {name: d1, type: dense}\n  - {name: c1, type: categorical, vocab: 50, "
                    "dim: 4}\nmodules:\n  - {name: deep, kind: mlp, inputs: ['@dense', '@sparse'], layers: [4]}\n"
                    "heads:\n  - {name: ctr, input: deep, task: binary, loss: bce}\n"
                    f"training: {{batch_size: {random.choice([16, 32])}, epochs: 1}}\n")
    data, run = tmp_path / "d", tmp_path / "run"

    def convert() -> None:
        made = CliRunner().invoke(app, ["data", "convert", "csv", str(tmp_path / "raw.csv"), str(data), "--spec",
                                        str(spec), "--test-fraction", "0.25", "--overwrite", "-q"])
        assert made.exit_code == 0, made.output

    convert()
    flowrec.train(spec, data=data, out=run, max_steps=1)
    older = json.loads((run / "run.json").read_text())
    older.pop("train_rows")  # as the older flowrec wrote it
    (run / "run.json").write_text(json.dumps(older, indent=2, sort_keys=True) + "\n")
    convert()  # converted again since, by this flowrec's split
    before = _files(run)
    with pytest.raises(RunError, match=rf"^{data} was converted again since the run in {run} started: .*start a "
                                       r"new run on this data \(out=NEW\)$"):
        flowrec.train(spec, resume=run, max_steps=2)
    assert _files(run) == before
    result = CliRunner().invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2", "-q"])
    assert result.exit_code == 2 and "(--out NEW)" in result.output, result.output
    assert _files(run) == before


def test_a_finished_run_in_a_read_only_folder_is_said_finished_in_python(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train(spec, resume=RUN)` of a finished run in a folder it cannot write (an archived run,
    a read-only mount) raised 'cannot lock run folder RUN: Read-only file system', where `flowrec train
    --resume` says it is finished: it writes nothing, so it is said finished; one that would train
    still gets the lock's error."""
    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    n = random.randint(2, 4)
    flowrec.train("t.yaml", out="run", max_steps=n, **_options())
    before = _files(tmp_path / "run")
    make_read_only(tmp_path / "run", monkeypatch)
    try:
        with pytest.warns(UserWarning, match=rf"^run is finished: step {n}, .*max_steps={n}; nothing to train"):
            run = flowrec.train("t.yaml", resume="run")
        with pytest.raises(RunFolderError, match="cannot lock run folder run"):
            flowrec.train("t.yaml", resume="run", max_steps=2 * n)
    finally:
        for path in [tmp_path / "run", *(tmp_path / "run").rglob("*")]:
            path.chmod(path.stat().st_mode | 0o200)
    assert run.trained.step == n and _files(tmp_path / "run") == before


def test_a_changed_managed_setting_names_the_python_argument_of_a_new_run(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train(spec, resume=RUN)` with a managed table's setting changed said 'start a new run
    (another --out)', a flag of the command line; it names `out=` now, as the command line keeps `--out`."""
    monkeypatch.chdir(tmp_path)
    every, rows = random.randint(5, 15), random.randint(30, 80)
    spec = tmp_path / "mg.yaml"
    spec.write_text(f"""
name: mg
features:
  - {{name: user, type: categorical, table: users}}
  - {{name: item, type: categorical, hash_buckets: {random.randint(50, 150)}, dim: 8}}
tables:
  - {{name: users, dim: 8, managed: {{rows: {rows}, admit_min_count: 2, evict: lfu, every_steps: {every}}}}}
modules:
  - {{name: top, kind: mlp, inputs: ["@sparse"], layers: [8]}}
heads:
  - {{name: ctr, input: top}}
optimizer: {{dense: {{name: adam, lr: 0.001}}, sparse: {{name: adagrad, lr: 0.01}}}}
training: {{batch_size: 32, epochs: 1}}
""")
    flowrec.train("mg.yaml", out="mg", max_steps=2, **_options())
    spec.write_text(spec.read_text().replace(f"every_steps: {every}", f"every_steps: {every + 1}"))
    before = _files(tmp_path / "mg")
    with pytest.raises(RunError, match=rf"managed\.every_steps {every} in the run, {every + 1} in the spec .* to "
                                       r"resume it, or start a new run \(another out=\) with the new value$"):
        flowrec.train("mg.yaml", resume="mg", max_steps=4)
    result = CliRunner().invoke(app, ["train", "mg.yaml", "--resume", "mg", "--max-steps", "4", "-q"])
    assert result.exit_code == 2 and "(another --out) with the new value" in result.output, result.output
    assert _files(tmp_path / "mg") == before


def test_rows_given_to_the_resume_of_a_run_on_a_dataset_is_said_ignored(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train(spec, resume=RUN, rows=N)` of a run on a dataset trained on every row of it without
    a word, where a new run (and `flowrec train --resume RUN --rows N`) says that rows= is ignored."""
    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    made = CliRunner().invoke(app, ["data", "synth", "t.yaml", "--rows", str(random.randint(200, 400)), "--out", "d",
                                    "--seed", str(random.randint(0, 99)), "-q"])
    assert made.exit_code == 0, made.output
    flowrec.train("t.yaml", data="d", out="a", max_steps=2)
    rows = random.randint(10, 1000)
    with pytest.warns(UserWarning, match=rf"^rows={rows} is ignored: it sets the rows of synthetic data, and this run "
                                         rf"trains on every row of data={tmp_path / 'd'}"):
        run = flowrec.train("t.yaml", resume="a", max_steps=4, rows=rows)
    assert run.result.steps == 4


def test_a_run_on_a_dataset_closes_its_data_as_the_command_line_does(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train` on an encoded dataset, new or resumed, closes its data sources when it returns
    (as `flowrec train` does): their reader threads end and the record of the partitions it checked
    is saved in the dataset folder, so the next run on it does not check them again. Before, every
    call left its `flowrec-read` threads behind (a notebook training in a loop gathered them) and
    saved no record."""
    import threading

    from flowrec.data.checked import RECORD_FILE

    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, epochs=1)
    made = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", str(random.randint(300, 500)),
                                    "--seed", str(random.randint(1, 999)), "--out", str(tmp_path / "d")])
    assert made.exit_code == 0, made.output

    def readers() -> set[int]:
        return {t.ident for t in threading.enumerate() if t.name.startswith("flowrec-read") and t.is_alive()}

    before = readers()
    flowrec.train(spec, data=tmp_path / "d", out=tmp_path / "r", max_steps=2)
    assert readers() <= before
    records = sorted(p.relative_to(tmp_path / "d").as_posix() for p in (tmp_path / "d").rglob(RECORD_FILE))
    assert records, "no check record saved in the dataset folder"
    for record in (tmp_path / "d").rglob(RECORD_FILE):
        record.unlink()
    flowrec.train(spec, resume=tmp_path / "r", max_steps=4)
    assert readers() <= before
    assert sorted(p.relative_to(tmp_path / "d").as_posix() for p in (tmp_path / "d").rglob(RECORD_FILE)) == records


def test_other_synthetic_rows_given_to_a_resume_are_said(tmp_path: Path, monkeypatch) -> None:
    """`rows=` other than a synthetic run's own, given to its resume, goes on in other rows: a
    UserWarning says so (the command line says it in a note); the same rows given again, none."""
    monkeypatch.chdir(tmp_path)
    spec = _spec(tmp_path, epochs=3)
    rows, seed = random.randint(250, 400), random.randint(1, 10**6)
    flowrec.train(spec, out=tmp_path / "r", rows=rows, seed=seed, max_steps=2)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        flowrec.train(spec, resume=tmp_path / "r", rows=rows, max_steps=3)
    assert not [w for w in caught if "overrides the run's rows" in str(w.message)]
    other = rows + random.randint(50, 200)
    with pytest.warns(UserWarning, match=f"rows={other} overrides the run's rows={rows}"):
        flowrec.train(spec, resume=tmp_path / "r", rows=other, max_steps=4)


def test_a_run_started_from_another_that_never_checkpointed_is_refused_in_python_words(tmp_path: Path,
                                                                                     monkeypatch) -> None:
    """Its resume said "start it again with `flowrec train SPEC --resume RUN`" as if to the command
    line, with no word of why flowrec.train cannot: it starts no run from another."""
    import json

    monkeypatch.chdir(tmp_path)
    _spec(tmp_path)
    flowrec.train("t.yaml", out="parent", max_steps=2, **_options())
    (tmp_path / "child").mkdir()  # as `flowrec train --init-from parent --out child` leaves it, killed at once
    recorded = json.loads((tmp_path / "parent" / "run.json").read_text())
    (tmp_path / "child" / "run.json").write_text(json.dumps({**recorded, "init_from": "parent"}))
    before = _files(tmp_path / "child")
    with pytest.raises(RunError) as exc:
        flowrec.train("t.yaml", resume="child")
    assert str(exc.value) == (
        "resume='child': that run was started from the run in parent (`flowrec train --init-from`) and stopped "
        "before its first checkpoint, so it has nothing of its own to continue, and flowrec.train does not start "
        "a run from another (it takes no init_from=); start it again from that run on the command line: "
        "`flowrec train SPEC --resume child`")
    assert _files(tmp_path / "child") == before
