"""What a seventh walk of README.md and docs/guide.md found, as a new user: one test per defect
(each fails on the code before its fix)."""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from flowrec.runs.errors import RunError
from flowrec.runs.plan import device_for_run
from flowrec.spec import load_spec


@pytest.mark.parametrize("hint", ["cuda", "cuda:1"])
def test_a_specs_cuda_device_without_cuda_is_named_as_the_specs(repo: Path, monkeypatch, hint: str) -> None:
    """`flowrec train my.yaml` of a spec with `plan: {device: cuda}` on a machine without CUDA, no
    --device given, said "--device cuda was asked for": a flag the user never gave."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    spec = load_spec(repo / "specs" / "movielens.yaml")
    spec = replace(spec, plan=replace(spec.plan, device=hint))
    with pytest.raises(RunError) as err:
        device_for_run(spec, "auto")
    message = str(err.value)
    assert message.startswith(f"the spec's plan.device is {hint}, but CUDA is not available"), message
    assert "--device cpu" in message and "plan.device: auto" in message
    assert device_for_run(spec, "cpu") == torch.device("cpu")  # --device cpu overrides the spec's hint


@pytest.mark.parametrize("given", ["cuda", "cuda:1"])
def test_device_cuda_without_cuda_says_what_to_give_instead(repo: Path, monkeypatch, given: str) -> None:
    """`--device cuda` (the guide's `flowrec train ... --device cuda`) on a machine without CUDA
    said only that CUDA is missing, and called `cuda:1` `cuda`."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RunError) as err:
        device_for_run(load_spec(repo / "specs" / "movielens.yaml"), given)
    message = str(err.value)
    assert message.startswith(f"--device {given} was asked for"), message
    assert "give --device cpu or auto" in message


@pytest.mark.parametrize("group, commands", [
    ([], ["train", "validate", "plan", "data convert", "eval", "export", "predict"]),
    (["data"], ["convert", "synth", "profile", "inspect"]),
])
@pytest.mark.parametrize("columns", [80, 120])
def test_the_group_helps_have_examples_too(group: list[str], commands: list[str], columns: int) -> None:
    """README: "Every command has a `--help` with examples"; `flowrec --help`, the first thing a new
    user types, and `flowrec data --help` had none: each now shows the README's path from a spec to
    scores, one example a line."""
    from typer.testing import CliRunner

    from flowrec.cli import app, data_cmds, help_layout

    kept = app.rich_markup_mode, data_cmds.data_app.rich_markup_mode
    for typer_app in (app, data_cmds.data_app):
        typer_app.rich_markup_mode = help_layout(columns)
    try:
        shown = CliRunner().invoke(app, [*group, "--help"], env={"COLUMNS": str(columns)}, terminal_width=columns)
    finally:
        app.rich_markup_mode, data_cmds.data_app.rich_markup_mode = kept
    assert shown.exit_code == 0, shown.output
    lines = [line.strip(" │") for line in shown.output.splitlines()]
    assert "Examples:" in lines, shown.output
    prefix = " ".join(["flowrec", *group])
    for command in commands:
        assert any(line.startswith(f"{prefix} {command} ") for line in lines), (command, shown.output)


@pytest.mark.parametrize("starting_from", [False, True])
def test_resuming_a_run_with_another_spec_names_both_specs_first(repo: Path, starting_from: bool) -> None:
    """`flowrec train specs/movielens.yaml --resume runs/first` (a run of my_model.yaml) listed
    the first three features that differ as JSON fragments ("features[user] {"name": "user",
    "pooling": ... in the run, not there in the spec; ...") and never said that the run is of
    another spec: the names of both come first."""
    import json

    from flowrec.runs.changes import changed_model_line
    from flowrec.spec.load import to_dict

    trained = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    given = load_spec(repo / "specs" / "movielens.yaml")
    line = changed_model_line("runs/first", {"spec": json.dumps(to_dict(trained))}, given, starting_from)
    named = "the run in runs/first was trained with (a run of spec 'dlrm_criteo'; this spec is 'movielens'): "
    assert named in line, line
    assert "(compare the spec with runs/first/spec.json)" in line
    same_name = replace(given, name="dlrm_criteo")
    assert "a run of spec" not in changed_model_line("runs/first", {"spec": json.dumps(to_dict(trained))},
                                                     same_name, starting_from)


def _help_records_of_every_command():
    """(command, option, its --help text as shown) of every option of every command."""
    import typer.main

    from flowrec.cli import app

    def walk(command, path):
        if hasattr(command, "commands"):  # a group (typer's own click, not the click package's classes)
            for name, sub in command.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, command

    for path, command in walk(typer.main.get_command(app), []):
        context = command.make_context(" ".join(path), [], resilient_parsing=True)
        for param in command.params:
            record = param.get_help_record(context)
            if record is not None and param.opts[0].startswith("--"):
                yield " ".join(path), param.opts[0], record[1]


def test_no_option_states_its_default_twice() -> None:
    """`flowrec train --help` read "... Default: 1. [default: 1]" (--nproc), "Default: 300.
    [default: 300.0]" (--dist-timeout), and so for --max-restarts, --follow-wait and --follow-order:
    an option whose help says its default does not have click append it again."""
    import re

    records = list(_help_records_of_every_command())
    assert len({command for command, _, _ in records}) >= 12 and len(records) > 80
    twice = [f"{command} {option}" for command, option, text in records
             if "[default:" in text and re.search(r"\bdefault\b", text.split("[default:")[0], re.IGNORECASE)]
    assert not twice, twice


def test_data_inspect_lists_features_in_column_order(tmp_path: Path) -> None:
    """`flowrec data inspect data/criteo/` (the guide's session) printed its 26 id-form lines and its
    hashing warnings in text order, C1, C10, C11, ..., C19, C2, C20, ..., under a column table in
    the spec's order C1, C2, ..., C26: both follow the table's order now."""
    import numpy as np

    from flowrec.data.convert import convert
    from flowrec.data.inspect import inspect_dataset

    rng = np.random.default_rng()
    names = [f"f{i}" for i in range(1, 13)]  # f1, f2, ..., f12: text order f1, f10, f11, f12, f2, ...
    features = "\n".join(f"  - {{name: {n}, type: categorical, hash_buckets: 5, dim: 4}}" for n in names)
    spec_file = tmp_path / "s.yaml"
    spec_file.write_text(f"name: s\nfeatures:\n{features}\nmodules:\n  - {{name: m, kind: mlp, inputs: ['@sparse'], "
                         "layers: [4]}\nheads:\n  - {name: y, input: m, task: binary, loss: bce}\n"
                         "data: {format: csv, label: y}\n", encoding="utf-8")
    rows = 400
    ids = rng.zipf(1.3, size=(rows, len(names))) + rng.integers(0, 10**6, size=len(names))  # skewed, each its own
    lines = [",".join(["y", *names])] + [",".join([str(int(rng.random() < 0.3)), *(f"v{x}" for x in row)])
                                         for row in ids]
    (tmp_path / "clicks.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    convert(load_spec(spec_file), "csv", [tmp_path / "clicks.csv"], tmp_path / "data")
    info = inspect_dataset(tmp_path / "data")
    columns = [c["name"] for c in info["columns"] if c["name"] in names]
    assert columns == names
    assert list(info["id_forms"]) == names
    warned = [w.split(":")[0] for w in info["warnings"] if "hashing merges" in w]
    assert len(warned) >= 6, info["warnings"]  # 5 rows for hundreds of distinct values: most merge
    assert warned == [n for n in names if n in warned]


@pytest.mark.parametrize("rows", [300, 900, 5000])
def test_a_profile_of_every_row_does_not_advise_a_higher_sample_rate(rows: int) -> None:
    """`flowrec data profile specs/dlrm_criteo.yaml data/criteo/` on the 1,000-row Criteo head
    (the guide's session) samples every row and warned "raise --sample-rate or profile more data":
    a higher rate samples nothing more; only more data helps, and the line says so."""
    import numpy as np

    from flowrec.data.profile import sample_warnings

    rate = float(np.random.default_rng().uniform(0.5, 1.0))
    every = sample_warnings(rows, rows, 1.0, 4096)
    assert every and all("--sample-rate" not in w and "profile more data" in w for w in every), every
    part = sample_warnings(int(rows * rate) - 1, rows, rate, 4096)  # a part of the rows: a higher rate helps
    assert part and all("raise --sample-rate" in w for w in part), part


@pytest.mark.parametrize("first_step", [0, 18, 395])
def test_a_resumed_runs_closing_line_says_which_steps_its_samples_are(tmp_path: Path, capsys,
                                                                     first_step: int) -> None:
    """`flowrec train SPEC --resume runs/ml2 --epochs 6` (the guide's scale-out lines) closed with
    "steps 474, 79,967 samples in 3.3 s": 474 steps of the run, the samples and seconds of the 79
    steps since the resume; a resumed run's line says so."""
    import numpy as np

    from flowrec.cli.train_cmds import _report
    from flowrec.runtime.trainer import TrainResult

    rng = np.random.default_rng()
    here = int(rng.integers(1, 500))
    samples = here * int(rng.integers(16, 4096))
    seconds = float(rng.uniform(0.5, 60.0))
    result = TrainResult(first_step + here, samples, seconds, samples / seconds, float(rng.uniform(0.1, 1.0)))
    _report(result, tmp_path, json_out=False, first_step=first_step)
    line = capsys.readouterr().err.splitlines()[0]
    assert line.startswith(f"steps {first_step + here}")
    assert f"{samples:,} samples in {seconds:.1f} s" in line
    assert (f"({here:,} since the resume at step {first_step:,})" in line) == (first_step > 0), line


def test_a_spec_whose_bound_data_is_missing_says_how_to_train_it_anyway(repo: Path, tmp_path: Path) -> None:
    """README: without ../shared/data, "train any spec on synthetic data with --rows N"; but
    `flowrec train specs/movielens.yaml --rows 1000` there said --rows is ignored and then only
    "the spec's data binding points to .../movielens-100k, which does not exist". The line says
    what to do: put the data there, give --data, or drop data.path from a copy to train on
    synthetic rows, and that copy is a spec that binds no data."""
    import re

    from flowrec.data.layout import DataError
    from flowrec.runtime.session import bound_dataset

    (tmp_path / "specs").mkdir()
    text = (repo / "specs" / "movielens.yaml").read_text(encoding="utf-8")
    spec_file = tmp_path / "specs" / "movielens.yaml"
    spec_file.write_text(text, encoding="utf-8")
    with pytest.raises(DataError) as err:
        bound_dataset(load_spec(spec_file), spec_file, tmp_path / "run", lambda line: None)
    message = str(err.value)
    assert "which does not exist: put the data there" in message, message
    assert "--data DIR" in message and "--rows N" in message and "without data.path" in message
    assert "relative to the spec's folder" in message
    unbound = tmp_path / "specs" / "synthetic.yaml"
    unbound.write_text(re.sub(r"\n  path: [^\n]*", "", text), encoding="utf-8")
    assert not load_spec(unbound).data.bound  # the copy the line describes trains on synthetic rows


@pytest.mark.parametrize("label", [0, 1])
def test_eval_json_to_stdout_still_says_why_a_metric_is_null(capsys, label: int) -> None:
    """`flowrec eval runs/first --data data/clicks/test --json -` (README's own-data section) on a
    test split whose labels are all one class printed auc, pr_auc, ne, calibration as null and
    nothing else: the table's warning ("every evaluation label is 0 ...: ... null in JSON") was left
    out with --json -. It goes to stderr there; stdout stays the JSON alone."""
    import json

    import numpy as np

    from flowrec.cli.train_cmds import _write_metrics

    rng = np.random.default_rng()
    rows = int(rng.integers(2, 500))
    metrics = {"click": {"auc": float("nan"), "pr_auc": float("nan") if label == 0 else 1.0,
                         "logloss": float(rng.uniform(0.05, 2.0)), "ne": float("nan"),
                         "calibration": float("nan"), "samples": rows}}
    _write_metrics(metrics, "-")
    out, err = capsys.readouterr()
    assert json.loads(out)["click"]["auc"] is None and json.loads(out)["click"]["samples"] == rows
    assert f"every evaluation label is {label} ({rows:,} row" in err, err


def test_building_one_packed_group_is_said_in_the_singular(repo: Path, monkeypatch) -> None:
    """Every run of the README (the default DLRM job, MovieLens, the own-data CSV) began with
    "building model on cpu (1 packed groups)"."""
    from flowrec.planner.manager import make_plan
    from flowrec.runtime import lowering as lowering_mod
    from flowrec.runtime import session as session_mod
    from flowrec.runtime.session import SessionOptions, prepare

    spec_path = repo / "specs" / "dlrm_criteo.yaml"
    spec = load_spec(spec_path)
    plan = make_plan(spec, target="cpu")
    assert len(plan.meta.groups) == 1

    def stop(group, seed, dev):
        raise KeyError("stopped after the status line")

    monkeypatch.setattr(lowering_mod, "group_embedding", stop)
    monkeypatch.setattr(session_mod, "synthetic_sources", lambda *a: (None, None, "synthetic"))
    said: list[str] = []
    with pytest.raises(KeyError):
        prepare(spec, spec_path, SessionOptions(), plan, torch.device("cpu"), said.append)
    assert "building model on cpu (1 packed group)" in said, said


@pytest.mark.parametrize("first_step", [0, 24, 395])
def test_report_of_a_resumed_run_times_the_steps_it_trained(repo: Path, first_step: int) -> None:
    """`flowrec train my_model.yaml --resume runs/first --epochs 5 --report` trained 6 steps in
    0.8 s and reported "report (30 steps ...)" and a step of 26.4 ms wall: the session's seconds over
    the run's 30 steps, 5x too fast. Its times (and the transfer bytes per step) are per step since
    the resume, and the header says which steps those are."""
    import numpy as np

    from flowrec.planner.manager import make_plan
    from flowrec.runtime.run_report import run_report
    from flowrec.runtime.trainer import TrainResult
    from flowrec.spec.units import format_bytes

    rng = np.random.default_rng()
    spec = load_spec(repo / "specs" / "movielens.yaml")
    plan = make_plan(spec, target="h100")
    here = int(rng.integers(2, 300))
    seconds, compute = float(rng.uniform(1.0, 30.0)), float(rng.uniform(0.2, 0.9))
    sent = int(rng.integers(10**5, 10**9))
    samples = here * spec.training.batch_size
    result = TrainResult(first_step + here, samples, seconds, samples / seconds, None,
                         stage_seconds={"compute": seconds * compute}, transfer_bytes=sent)
    lines = run_report(result, plan, spec.training.batch_size, len(spec.dense_features), len(spec.heads), first_step)
    since = f" since the resume at step {first_step:,}" if first_step else ""
    assert lines[0].startswith(f"report ({here:,} steps{since}, batch "), lines[0]
    step_line = next(line for line in lines if "step time" in line)
    assert f"{seconds / here * 1e3:9.2f} ms wall" in step_line, step_line
    assert f"{seconds * compute / here * 1e3:9.2f} ms compute" in step_line, step_line
    assert f"measured {format_bytes(sent / here)} per step" in next(line for line in lines if "host->device" in line)


def test_a_spec_or_a_runs_file_given_for_a_run_says_what_to_give(repo: Path, tmp_path: Path) -> None:
    """`flowrec eval my_model.yaml` (the spec, for the run it trained; so export and --init-from)
    said only "my_model.yaml is not a flowrec checkpoint (not a torch zip archive)"; and
    `flowrec eval runs/first/spec.json` the same. The first is told to train the spec into a run,
    the second to give the run folder; a damaged checkpoint.pt and other files keep the plain line."""
    import numpy as np

    from flowrec.runtime.checkpoint.format import CheckpointError
    from flowrec.runtime.checkpoint.store import load_checkpoint

    rng = np.random.default_rng()
    spec = tmp_path / "my_model.yaml"
    spec.write_text((repo / "specs" / "movielens.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    run = tmp_path / "runs" / "first"
    run.mkdir(parents=True)
    (run / "checkpoint.pt").write_bytes(rng.bytes(int(rng.integers(64, 4096))))  # damaged: not a zip
    (run / "spec.json").write_text('{"name": "m"}', encoding="utf-8")
    other = tmp_path / "clicks.csv"
    other.write_text("y,a\n" + "".join(f"{int(rng.integers(0, 2))},{int(rng.zipf(1.5))}\n" for _ in range(20)))

    def line(path: Path) -> str:
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(path)
        return str(err.value)

    assert f"train it into a run first (`flowrec train {spec} --out RUN`)" in line(spec)
    assert line(run / "spec.json").endswith(f"; give the run folder it lies in, {run}")
    for plain in (run, run / "checkpoint.pt", other):
        said = line(plain)
        assert "not a flowrec checkpoint" in said and "give the run folder" not in said and "flowrec train" not in said


def test_resuming_a_finished_run_gives_json(tmp_path: Path) -> None:
    """`train --resume` of a finished run said "is finished: nothing to train" and, with --json,
    printed no document on stdout (a script reading it got nothing); it prints one. (The run is
    still loaded first: a damaged checkpoint is said before "finished", test_run_hostile.)"""
    import json
    import random

    from typer.testing import CliRunner

    from flowrec.cli import app

    runner = CliRunner()
    rows, epochs = random.randint(200, 500), random.randint(1, 2)
    spec = tmp_path / "tiny.yaml"  # (a spec of small tables: wide_deep's 10M-row ones left this process 14 GB)
    spec.write_text("""
name: tiny_finished
features:
  - {name: price, type: dense}
  - {name: user, type: categorical, hash_buckets: 300, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
training: {batch_size: 64, epochs: 1, seed: 5}
""")
    done = runner.invoke(app, ["train", str(spec), "--rows", str(rows), "--epochs", str(epochs), "--out",
                               str(tmp_path / "run"), "-q", "--device", "cpu"])
    assert done.exit_code == 0, done.output
    again = runner.invoke(app, ["train", str(spec), "--rows", str(rows), "--resume", str(tmp_path / "run"), "--json"])
    assert again.exit_code == 0, again.output
    doc = json.loads(again.stdout)
    assert doc["finished"] is True and doc["epoch"] == epochs and doc["trained_steps"] == 0 and doc["steps"] > 0
    assert f"epoch {epochs} of {epochs}" in doc["message"] and "--epochs" in doc["message"]


@pytest.mark.parametrize("short, full", [("criteo", "criteo_tsv"), ("avazu", "avazu_csv"), ("libfm", "libsvm")])
def test_a_specs_data_format_takes_the_short_names_the_cli_takes(tmp_path: Path, short: str, full: str) -> None:
    """README, `data convert` and `predict --format` name formats criteo, avazu and libfm, but a spec's
    `data.format: criteo` was refused ('must be one of criteo_tsv, ...'); a spec now takes them and
    is read with the full name (so its fingerprint, data hash and spec.json are the full name's)."""
    import yaml

    from flowrec.graph.plan_io import model_fingerprint
    from flowrec.spec.load import to_dict
    from flowrec.spec.validate import validate_document

    doc = yaml.safe_load((Path(__file__).resolve().parents[2] / "specs" / "wide_deep.yaml").read_text())
    doc["data"] = {**(doc.get("data") or {}), "format": short, "path": "rows.txt"}
    doc["data"].pop("options", None)
    assert validate_document(doc) == []
    (tmp_path / "short.yaml").write_text(yaml.safe_dump(doc))
    spec = load_spec(tmp_path / "short.yaml")
    assert spec.data.format == full and to_dict(spec)["data"]["format"] == full
    (tmp_path / "full.yaml").write_text(yaml.safe_dump({**doc, "data": {**doc["data"], "format": full}}))
    assert model_fingerprint(load_spec(tmp_path / "full.yaml")) == model_fingerprint(spec)
    doc["data"]["format"] = "criteo_csv"  # another name is still refused
    assert validate_document(doc)
