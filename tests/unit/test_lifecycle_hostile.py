"""Hostile and careless input to the run lifecycle and the continuous-training options: every bad
input is a typed exception from `flowrec.train` (a `RunError` for an argument) or one line and exit
2 from the CLI, before anything is written; nothing is ordered or reported silently wrong."""
from __future__ import annotations

import json
import os
import re
import warnings
import shutil
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.cli.follow import LOCK_FILE, done_days
from flowrec.cli.plan_cmd import run_managed
from flowrec.data.days import DayOrder, day_partitions, parse_order
from flowrec.data.layout import DataError
from flowrec.runs.errors import RunError
from flowrec.runs.settings import merge_settings
from flowrec.runtime.rundir import RunFolderError, RunLock
from flowrec.spec.load import load_spec
from flowrec.testing.specs import run_spec

runner = CliRunner()
MANAGED_SPEC = Path(__file__).parents[1].joinpath("integration", "test_managed_runs.py").read_text() \
    .split('SPEC = """')[1].split('"""')[0]


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(run_spec("hostile", batch_size=32, epochs=1))
    return path


def _synth(spec: Path, out: Path, seed: int = 1) -> Path:
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "120", "--seed", str(seed), "--out", str(out),
                               "-q"])
    assert made.exit_code == 0, made.output
    return out


def _listing(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("argument, value, says", [
    ("epochs", 0, "epochs must be at least 1"),
    ("epochs", "3", "epochs must be a non-negative integer"),
    ("max_steps", -2, "max_steps must be a non-negative integer"),
    ("max_steps", True, "max_steps must be a non-negative integer, not True"),
    ("max_steps", 1.5, "max_steps must be a non-negative integer"),
    ("rows", 0, "rows must be at least 1"),
    ("seed", -1, "seed must be a non-negative integer"),
    ("seed", 2**70, "seed must be in 0.."),
    ("eval_every", -3, "eval_every must be a non-negative integer"),
    ("checkpoint_every", -1, "checkpoint_every must be a non-negative integer"),
    ("on_step", 5, "on_step must be a callable"),
    ("on_eval", "print", "on_eval must be a callable"),
    ("overwrite", "yes", "overwrite must be True or False"),
    ("data", 3, "data must be a folder path"),
    # a frame's repr is its table: the error ran over its rows' lines
    ("data", pd.DataFrame({"user": ["a", "b"], "label": [1, 0]}), r"data must be a folder path .*, not a pandas\.DataFrame "
     r"\(rows are read from a dataset folder: .*flowrec data convert parquet.*load_model\(PACKAGE\)\.predict"),
    ("eval_data", pa.table({"user": ["a", "b"]}), r"eval_data must be a folder path .*, not a pyarrow\.Table"),
    ("out", 3.0, "out must be a folder path"),
    ("device", None, "device must be a device name"),
    ("device_budget", 4096, "device_budget must be a byte size"),
    ("device_budget", "xx", "device_budget must be a byte size"),  # was "not a byte size: 'xx'", naming no argument
])
def test_train_refuses_a_bad_argument_before_writing_anything(spec: Path, tmp_path: Path, argument: str,
                                                              value, says: str) -> None:
    out = tmp_path / "run"
    kwargs = {"out": out, "max_steps": 2, argument: value}
    with pytest.raises(RunError, match=says) as caught:
        flowrec.train(spec, **kwargs)
    assert "\n" not in str(caught.value)
    assert not out.exists()


@pytest.mark.parametrize("argument", ["out", "data", "eval_data", "spec"])
def test_an_empty_path_given_to_train_is_refused_not_the_working_folder(spec: Path, tmp_path: Path, monkeypatch,
                                                                        argument: str) -> None:
    """flowrec.train(spec, out=os.environ.get("OUT", "")) trained into the working folder (Path reads
    "" as '.'), where `flowrec train --out ""` is refused since ff3d98e; now each path argument of the
    API refuses "" too, naming it, and nothing is written."""
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    kwargs = {"spec": spec, "max_steps": 2, "rows": 200, "progress": False, argument: ""}
    with pytest.raises(RunError, match=f"{argument} is an empty path"):
        flowrec.train(kwargs.pop("spec"), **kwargs)
    assert list(work.iterdir()) == []


def test_an_empty_path_given_to_load_evaluate_or_load_model_is_refused(tmp_path: Path, monkeypatch) -> None:
    """flowrec.load(""), Run.evaluate("") and load_model("") read the working folder as the run,
    dataset or package; each now names the empty argument, as the command line does."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RunError, match="run_dir is an empty path"):
        flowrec.load("")
    with pytest.raises(ValueError, match="path is an empty path"):
        flowrec.load_model("")


def test_an_empty_text_or_path_given_to_run_evaluate_is_refused(spec: Path, tmp_path: Path) -> None:
    """Run.evaluate(group_by="") was read as no group_by and scored without gAUC (the spec's
    eval_group_by neither), as `flowrec eval --group-by ""` did before 2e52a41; evaluate(data="")
    scored the working folder. Each now names the empty argument."""
    run = flowrec.train(spec, out=tmp_path / "run", rows=200, max_steps=1, progress=False)
    with pytest.raises(RunError, match="group_by is empty"):
        run.evaluate(group_by="")
    with pytest.raises(RunError, match="data is an empty path"):
        run.evaluate(data="")


@pytest.mark.parametrize("name", [os.fsdecode(b"day\xe9"), "x" * 300])
def test_a_path_flowrec_cannot_use_is_refused_by_the_api_before_a_folder_is_made(spec: Path, tmp_path: Path,
                                                                                 name: str) -> None:
    """flowrec.train(out=NAME) with a name that is not UTF-8 (as os.listdir gives a latin-1 one) made
    the folder, then raised UnicodeEncodeError writing run.json and left it behind; a name over 255
    bytes was an OSError. The command line refuses both first since 73ef415 and fc99123; now the API
    does, a RunError naming the argument (load and load_model alike), nothing made."""
    with pytest.raises(RunError, match="^out: the name") as caught:
        flowrec.train(spec, out=tmp_path / name, rows=200, max_steps=1, progress=False)
    assert "\n" not in str(caught.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.name]
    with pytest.raises(RunError, match="^run_dir: the name"):
        flowrec.load(tmp_path / name)
    with pytest.raises(ValueError, match="^path: the name"):
        flowrec.load_model(tmp_path / name)


def test_every_callback_event_of_the_docs_is_a_name_of_flowrec() -> None:
    """docs/python.md gives on_eval an `EvalEvent`: `flowrec.EvalEvent` in a callback's annotation
    was an AttributeError, though `flowrec.StepEvent` and `flowrec.CheckpointEvent` were names."""
    from flowrec.runtime.trainer import EvalEvent

    assert flowrec.EvalEvent is EvalEvent and "EvalEvent" in flowrec.__all__
    assert flowrec.StepEvent.__name__ == "StepEvent" and flowrec.CheckpointEvent.__name__ == "CheckpointEvent"


def test_the_api_names_are_in_dir_of_flowrec_for_a_notebooks_completion() -> None:
    """IPython completes `flowrec.<Tab>` from dir(flowrec), which listed load_model but not train,
    load, Run or the events (they load on first use through the module's __getattr__)."""
    names = dir(flowrec)
    assert set(flowrec.__all__) <= set(names) and {"train", "load", "Run", "StepEvent"} <= set(names)
    assert names == sorted(names) and "load_model" in names


def test_train_refuses_a_spec_of_the_wrong_kind(tmp_path: Path) -> None:
    with pytest.raises(RunError, match="spec must be a spec file path or a ModelSpec"):
        flowrec.train(3, out=tmp_path / "run")
    assert not (tmp_path / "run").exists()
    # the text of a spec was read as a file name: "cannot read the file: File name too long"
    text = run_spec("as_text", batch_size=32, epochs=1)
    with pytest.raises(RunError, match="not the text of a spec: write it to a file") as caught:
        flowrec.train(text, out=tmp_path / "run")
    assert "\n" not in str(caught.value) and not (tmp_path / "run").exists()


def test_a_spec_given_as_a_dict_names_the_way_to_a_model_spec(tmp_path: Path) -> None:
    """`flowrec.train(yaml.safe_load(text))` said only 'not {'name': ..., 'features': [{'name': ...'
    (its repr cut at 80 characters); now the line names flowrec.spec.spec_from_dict, which the run
    then takes."""
    import yaml

    document = yaml.safe_load(run_spec("as_dict", batch_size=32, epochs=1))
    with pytest.raises(RunError) as caught:
        flowrec.train(document, out=tmp_path / "run")
    assert str(caught.value) == ("spec must be a spec file path or a ModelSpec, not a dict: "
                                 "flowrec.spec.spec_from_dict(spec) makes a ModelSpec of it (checked as a spec file is)")
    assert not (tmp_path / "run").exists()
    with pytest.raises(RunError, match="device must be"):  # the named way gives a spec the run takes
        flowrec.train(flowrec.spec.spec_from_dict(document), device="tpu", out=tmp_path / "run")


def test_a_refused_run_leaves_no_folder_it_made(spec: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError):
        flowrec.train(spec, data=tmp_path / "missing", out=tmp_path / "run", max_steps=1)
    assert not (tmp_path / "run").exists()
    kept = tmp_path / "kept"
    kept.mkdir()
    with pytest.raises(RunError):
        flowrec.train(spec, device_budget="lots", out=kept, rows=200, max_steps=1)
    assert kept.is_dir()  # a folder the user made stays


def _early_stopping_csv_spec(tmp_path: Path) -> Path:
    """A spec bound to a raw CSV without a test split, with early stopping: refused after its data
    is encoded into the run folder."""
    rows = ["label,d1,c1"] + [f"{i % 2},{i / 100:.2f},c{i % 7}" for i in range(120)]
    (tmp_path / "raw.csv").write_text("\n".join(rows) + "\n")
    (tmp_path / "es.yaml").write_text(
        "name: es_csv\n"
        "features:\n  - {name: d1, type: dense}\n  - {name: c1, type: categorical, vocab: 20, dim: 4}\n"
        "modules:\n  - {name: deep, kind: mlp, inputs: ['@dense', '@sparse'], layers: [4]}\n"
        "heads:\n  - {name: ctr, input: deep, task: binary, loss: bce}\n"
        "data: {format: csv, path: raw.csv, label: label}\n"
        "training: {batch_size: 32, epochs: 1, seed: 0, early_stopping: {metric: auc}}\n")
    return tmp_path / "es.yaml"


def test_a_run_refused_after_encoding_its_data_leaves_no_folder_it_made(tmp_path: Path) -> None:
    spec = _early_stopping_csv_spec(tmp_path)
    with pytest.raises(RunError, match="early_stopping"):
        flowrec.train(spec, out=tmp_path / "run", eval_every=5, max_steps=2)
    assert not (tmp_path / "run").exists()  # data/ and encoder/ written for it went with it
    result = CliRunner().invoke(app, ["train", str(spec), "--out", str(tmp_path / "cli"), "--eval-every", "5",
                                      "--max-steps", "2", "-q"])
    assert result.exit_code == 2
    assert not (tmp_path / "cli").exists()
    # a folder the run did not make, or one holding something the run did not write, stays whole
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(RunError):
        flowrec.train(spec, out=mine, eval_every=5, max_steps=2)
    assert mine.is_dir() and not any(mine.iterdir())  # the user's empty folder stays, empty again
    result = CliRunner().invoke(app, ["train", str(spec), "--out", str(mine), "--eval-every", "5",
                                      "--max-steps", "2", "-q"])
    assert result.exit_code == 2
    assert mine.is_dir() and not any(mine.iterdir())
    folder = tmp_path / "new"
    folder.mkdir()
    lock = RunLock.acquire(folder)
    (folder / "data").mkdir()
    (folder / "theirs.txt").write_text("x")
    lock.release_and_remove_if_unused()
    assert (folder / "data").is_dir() and (folder / "theirs.txt").is_file()


def test_eval_data_that_is_no_dataset_is_refused_before_the_bound_data_is_encoded(tmp_path: Path) -> None:
    """`train SPEC --eval-data FILE` of a spec bound to raw data encoded the raw data first (minutes
    for a large file), then refused FILE; now FILE is refused before anything is encoded."""
    spec = _early_stopping_csv_spec(tmp_path)
    spec.write_text(spec.read_text().replace(", early_stopping: {metric: auc}", ""))
    (tmp_path / "not_a_dataset").write_text("x\n")
    result = CliRunner().invoke(app, ["train", str(spec), "--out", str(tmp_path / "run"), "--eval-data",
                                      str(tmp_path / "not_a_dataset"), "--max-steps", "2"])
    assert result.exit_code == 2, result.output
    assert "not_a_dataset is a file, not a dataset folder" in result.output
    assert "encoding csv data" not in result.output
    assert not (tmp_path / "run").exists()


def test_resuming_a_run_whose_test_split_was_deleted_is_refused_in_one_line(tmp_path: Path) -> None:
    """RUN/data/test deleted, `train --resume RUN` trained on without evaluating, saying 'the data has
    no test split', though RUN/data/train/_flowrec.json records the split; now it is refused in one
    line naming the folder, and removing RUN/data encodes the same split again."""
    spec = _early_stopping_csv_spec(tmp_path)
    spec.write_text(spec.read_text().replace(", early_stopping: {metric: auc}", "")
                    .replace("label: label}", "label: label, options: {test_fraction: 0.2}}"))
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "1", "--epochs", "2", "-q"])
    assert made.exit_code == 0, made.output
    shutil.rmtree(run / "data" / "test")
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 2, result.output
    assert f"{run / 'data' / 'test'} is missing" in result.output
    assert "no test split" not in result.output
    # `flowrec eval RUN` said the run 'trained on synthetic rows'
    result = runner.invoke(app, ["eval", str(run)])
    assert result.exit_code == 2 and f"{run / 'data' / 'test'}, is gone" in result.output, result.output
    shutil.rmtree(run / "data")
    result = runner.invoke(app, ["eval", str(run)])
    assert result.exit_code == 2 and "synthetic rows" not in result.output, result.output
    assert f"its encoded data {run / 'data'} is gone" in result.output
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    assert "final evaluation" in result.output and (run / "data" / "test").is_dir()
    # its encoding's record gone, the data is encoded again: not because the raw file 'changed'
    (run / "data" / "train" / "_flowrec.json").unlink()
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "3"])
    assert result.exit_code == 0, result.output
    assert "changed since" not in result.output
    assert f"{run / 'data'} holds no complete encoding" in result.output
    # its Parquet files deleted: the line said only 'RUN/data/train: no Parquet files'
    for part in (run / "data" / "train").glob("*.parquet"):
        part.unlink()
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "4"])
    assert result.exit_code == 2, result.output
    assert f"remove {run / 'data'} to encode the spec's data again" in result.output, result.output


def test_a_resumed_run_whose_data_is_gone_encodes_it_again_with_its_own_encoder(tmp_path: Path) -> None:
    """A run of a flowrec of before 2026-12-06 on bound data split by a seed recorded the encoder
    fitted on every row, test rows included (a value seen only in test rows had a row). RUN/data
    removed, `--resume` fitted a new encoder on the train rows and was refused: 'encoded with
    another encoder ... convert it with data convert --encoder-from RUN', a command for other data,
    the new RUN/data left behind; so was a new run `--init-from` it. Now RUN/data is encoded again
    with the run's own encoder (a child's data with its parent's): the same ids, and the run goes on."""
    from flowrec.data.convert import convert
    from flowrec.data.encoder_record import RUN_ENCODER_DIR, record_of_dataset, write_record

    spec, run = _bound_split_run(tmp_path, [f"{i % 2},{i / 100:.2f},{f'once{i}' if i % 5 == 0 else f'c{i % 7}'}"
                                            for i in range(150)], ", transform: standardize")
    # the older flowrec's encoder: fitted on every row, as converting them unsplit fits it
    every = tmp_path / "every"
    convert(load_spec(spec), "csv", [tmp_path / "raw.csv"], every, options={"test_fraction": 0})
    shutil.rmtree(run / RUN_ENCODER_DIR)
    write_record(record_of_dataset(every), run / RUN_ENCODER_DIR)
    shutil.rmtree(run / "data")
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 0, result.output
    assert "final evaluation" in result.output
    for part in ("train", "test"):
        assert pq.read_table(run / "data" / part / "_vocab" / "c1.parquet").equals(
            pq.read_table(every / "_vocab" / "c1.parquet"))
        assert (json.loads((run / "data" / part / "_flowrec.json").read_text())["dense"]
                == json.loads((every / "_flowrec.json").read_text())["dense"])
    # the test rows' values seen nowhere else keep the rows the run's encoder gave them
    assert (pq.read_table(run / "data" / "test", columns=["c1"]).column("c1").to_numpy() > 0).all()
    # a new run started from it encodes the spec's data with its encoder too (it was refused alike)
    child = tmp_path / "child"
    result = runner.invoke(app, ["train", str(spec), "--init-from", str(run), "--out", str(child), "--max-steps", "1"])
    assert result.exit_code == 0, result.output
    assert pq.read_table(child / "data" / "train" / "_vocab" / "c1.parquet").equals(
        pq.read_table(every / "_vocab" / "c1.parquet"))
    assert json.loads((child / "data" / "train" / "_flowrec.json").read_text())["split"]["fit_on"] == "given"


def test_a_resumed_run_whose_data_and_encoder_are_both_gone_is_refused_not_fitted_again(tmp_path: Path) -> None:
    """RUN/data and RUN/encoder both removed, `--resume` of a run on bound data fitted a new encoder
    on the raw rows and went on with its ids without a word (a run of before 2026-12-06 had fitted
    its split's encoder on the test rows too: other ids under the same rows). Now one line naming
    both and what to put back, nothing encoded, the checkpoint untouched; RUN/encoder put back, the
    run goes on."""
    spec, run = _bound_split_run(tmp_path, [f"{i % 2},{i / 100:.2f},c{i % 7}" for i in range(150)])
    shutil.copytree(run / "encoder", tmp_path / "kept")
    shutil.rmtree(run / "encoder")
    shutil.rmtree(run / "data")
    checkpoint = (run / "checkpoint.pt").read_bytes()
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 2, result.output
    said = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert len(said) == 1 and f"{run / 'data'}" in said[0] and f"put {run / 'encoder'}" in said[0], result.output
    assert not (run / "data").exists() and not (run / "encoder").exists()
    assert (run / "checkpoint.pt").read_bytes() == checkpoint
    shutil.copytree(tmp_path / "kept", run / "encoder")
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 0 and "final evaluation" in result.output, result.output


def _bound_split_run(tmp_path: Path, rows: list[str], transform: str = "") -> tuple[Path, Path]:
    """A spec bound to a CSV of `rows` (label,d1,c1; 0.3 of them split off to test; d1's
    `transform`) and its run of one step: (the spec, the run folder)."""
    (tmp_path / "raw.csv").write_text("\n".join(["label,d1,c1", *rows]) + "\n")
    spec = tmp_path / "bound.yaml"
    spec.write_text(
        "name: bound_csv\n"
        f"features:\n  - {{name: d1, type: dense{transform}}}\n  - {{name: c1, type: categorical, vocab: 60, dim: 4}}\n"
        "modules:\n  - {name: deep, kind: mlp, inputs: ['@dense', '@sparse'], layers: [4]}\n"
        "heads:\n  - {name: ctr, input: deep, task: binary, loss: bce}\n"
        "data: {format: csv, path: raw.csv, label: label, options: {test_fraction: 0.3}}\n"
        "training: {batch_size: 32, epochs: 2, seed: 0}\n")
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "1", "-q"])
    assert made.exit_code == 0, made.output
    return spec, run


def _tiny_retrieval_spec(tmp_path: Path) -> Path:
    """A two-tower spec bound to a CSV of 12 items in an item vocab of 200 (top_k: TOPK to fill in)."""
    rows = ["user,item,label"] + [f"u{i % 9},i{i % 12},1" for i in range(200)]
    (tmp_path / "raw.csv").write_text("\n".join(rows) + "\n")
    spec = tmp_path / "tt.yaml"
    spec.write_text(
        "name: tt_small\n"
        "features:\n  - {name: user, type: categorical, vocab: 50, dim: 4}\n"
        "  - {name: item, type: categorical, vocab: 200, dim: 4}\n"
        "modules:\n  - {name: score, kind: similarity, inputs: [user, item], metric: dot}\n"
        "heads:\n  - {name: retrieve, input: score, task: retrieval, negatives: {kind: in_batch}, top_k: [TOPK]}\n"
        "data: {format: csv, path: raw.csv, label: label, options: {test_fraction: 0.2}}\n"
        "training: {batch_size: 32, epochs: 1, seed: 0, eval_group_by: user}\n")
    return spec


def test_a_top_k_reaching_the_items_the_data_holds_is_warned_of_in_train_and_eval(tmp_path: Path) -> None:
    """An item vocab of 200 filled by data of 12 items, top_k [5, 50]: evaluation ranks the 12 rows
    that hold an item, so hr@50 was 1.0 whatever the model, without a word; now train's evaluations
    and `flowrec eval` warn in one line naming K and the count (K = 5 is no warning)."""
    spec = _tiny_retrieval_spec(tmp_path)
    text = spec.read_text()
    spec.write_text(text.replace("TOPK", "5, 50"))
    result = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "run"), "--max-steps", "2", "-q"])
    assert result.exit_code == 0, result.output
    warning = re.compile(r"warning: head retrieve ranks a catalogue of 12 items.* top_k 50 is at least that")
    assert len(warning.findall(result.output)) == 1, result.output
    result = runner.invoke(app, ["eval", str(tmp_path / "run"), "-q"])
    assert result.exit_code == 0, result.output
    assert len(warning.findall(result.output)) == 1, result.output
    said = re.compile(r"head retrieve ranks a catalogue of 12 items.* top_k 50 is at least that")
    with pytest.warns(UserWarning) as caught:  # the Python API: the same line, as a warning
        flowrec.train(spec, out=tmp_path / "api", max_steps=2)
    assert [str(w.message) for w in caught if said.search(str(w.message))], [str(w.message) for w in caught]
    with pytest.warns(UserWarning) as caught:
        flowrec.load(tmp_path / "api")
    assert [str(w.message) for w in caught if said.search(str(w.message))], [str(w.message) for w in caught]
    spec.write_text(text.replace("TOPK", "5"))
    result = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "five"), "--max-steps", "2", "-q"])
    assert result.exit_code == 0 and "warning: head retrieve" not in result.output, result.output
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # K = 5 is no warning in Python either
        flowrec.load(tmp_path / "five")


def test_run_evaluate_of_an_exclude_seen_head_leaves_out_the_runs_training_items_as_eval_does(tmp_path: Path) -> None:
    """A retrieval head with exclude_seen: `flowrec eval RUN` leaves out each user's items of the run's
    recorded training data, but Run.evaluate() (and evaluate(data=...)) gave it none and raised
    'give the training data (flowrec eval --seen DIR)', a flag Python has not; now both score as
    eval does, and seen= is eval's --seen."""
    spec = _tiny_retrieval_spec(tmp_path)
    spec.write_text(spec.read_text().replace("top_k: [TOPK]", "top_k: [2], exclude_seen: true"))
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "2", "-q"]).exit_code == 0
    result = runner.invoke(app, ["eval", str(run), "--json", str(tmp_path / "m.json"), "-q"])
    assert result.exit_code == 0, result.output
    expected = json.loads((tmp_path / "m.json").read_text())
    loaded = flowrec.load(run)
    for scored in (loaded.evaluate(), loaded.evaluate(run / "data" / "test"), loaded.evaluate(seen=run / "data" / "train")):
        assert scored["retrieve"] == pytest.approx(expected["retrieve"])
    with pytest.raises(RunError, match="seen must be"):
        loaded.evaluate(seen=3)


def test_a_run_whose_encoder_was_removed_is_said_so_by_eval_and_load(tmp_path: Path) -> None:
    """RUN/encoder removed: `flowrec eval RUN` checked no data against the run's encoding and the
    retrieval head ranked every row of its item table (200) where the run's evaluations rank the 12
    rows that hold an item, so its metrics changed without a word; now eval and flowrec.load say so."""
    spec = _tiny_retrieval_spec(tmp_path)
    spec.write_text(spec.read_text().replace("TOPK", "5"))
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "2", "-q"]).exit_code == 0
    said = re.compile(r"encoder is missing \(removed, or a run made before encoders were recorded\).*ranks every row")
    result = runner.invoke(app, ["eval", str(run), "-q"])
    assert result.exit_code == 0 and not said.search(result.output), result.output
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        flowrec.load(run)
    shutil.rmtree(run / "encoder")
    result = runner.invoke(app, ["eval", str(run), "-q"])
    assert result.exit_code == 0, result.output
    assert len(said.findall(result.output)) == 1 and "\nwarning: " + str(run / "encoder") in "\n" + result.output, result.output
    with pytest.warns(UserWarning, match="encoder is missing"):
        flowrec.load(run)


def test_a_malformed_row_of_bound_data_names_a_way_to_skip_it_that_exists(tmp_path: Path) -> None:
    """A malformed row of the spec's bound raw data said '(use --on-error skip to skip such rows)',
    an option neither `flowrec train` nor `flowrec.train` has; now it names the conversion that
    skips them, and that command runs as written."""
    spec = _early_stopping_csv_spec(tmp_path)
    spec.write_text(spec.read_text().replace(", early_stopping: {metric: auc}", ""))
    raw = tmp_path / "raw.csv"
    raw.write_text(raw.read_text().replace("\n1,", "\n2,", 1))  # one label that is not 0 or 1
    with pytest.raises(DataError) as caught:
        flowrec.train(spec, out=tmp_path / "api", max_steps=1)
    cli = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "cli"), "--max-steps", "1", "-q"])
    assert cli.exit_code == 2
    for said in (str(caught.value), cli.output):
        assert "not 0 or 1" in said and "(use --on-error skip" not in said, said
        command = re.search(r"`flowrec (data convert .*? DIR --spec .*?)`", said)
        assert command is not None, said
    made = runner.invoke(app, command.group(1).replace("DIR", str(tmp_path / "skipped")).split())
    assert made.exit_code == 0, made.output


def _bad_label_late(spec: Path, out: Path) -> Path:
    """Data whose last partition holds a label that is not 0 or 1: found once training reaches it,
    after the run wrote run.json, spec.json, plan.json, metrics.jsonl and tensorboard/."""
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "160", "--rows-per-file", "40", "--out",
                               str(out), "-q"])
    assert made.exit_code == 0, made.output
    last = sorted(out.glob("part-*.parquet"))[-1]
    table = pq.read_table(last)
    labels = table.column("label").to_pylist()
    labels[7] = 2.0
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label",
                                    pa.array(labels, table.schema.field("label").type)), last)
    return out


def test_a_run_refused_in_training_leaves_no_folder_it_made_and_an_empty_one_empty(spec: Path,
                                                                                   tmp_path: Path) -> None:
    data = _bad_label_late(spec, tmp_path / "bad")
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(DataError, match="label 2.0"):
        flowrec.train(spec, data=data, out=mine)
    assert mine.is_dir() and not any(mine.iterdir())
    with pytest.raises(DataError, match="label 2.0"):
        flowrec.train(spec, data=data, out=tmp_path / "new")
    assert not (tmp_path / "new").exists()
    result = runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(mine), "-q"])
    assert result.exit_code == 2 and "label 2.0" in result.output and "Traceback" not in result.output
    assert mine.is_dir() and not any(mine.iterdir())  # not run.json, spec.json, metrics.jsonl, tensorboard/
    result = runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(tmp_path / "cli"), "-q"])
    assert result.exit_code == 2
    assert not (tmp_path / "cli").exists()


def test_a_run_that_stopped_in_training_or_was_interrupted_keeps_what_it_wrote(tmp_path: Path) -> None:
    def started(folder: Path, records: str) -> RunLock:
        folder.mkdir()
        lock = RunLock.acquire(folder)
        (folder / "run.json").write_text("{}")
        (folder / "metrics.jsonl").write_text(records)
        return lock

    started(tmp_path / "stopped", '{"event": "stopped", "step": 3}\n').release_as_found("absent", refused=True)
    assert (tmp_path / "stopped" / "metrics.jsonl").is_file()  # a non-finite loss: its metrics say where
    started(tmp_path / "stop", '{"event": "train", "step": 3}\n').release_as_found("empty", refused=False)
    assert (tmp_path / "stop" / "run.json").is_file()  # Ctrl-C: the printed --resume command still works
    lock = started(tmp_path / "ckpt", '{"event": "train", "step": 3}\n')
    (tmp_path / "ckpt" / "checkpoint.pt").write_bytes(b"x")
    lock.release_as_found("empty", refused=True)
    assert (tmp_path / "ckpt" / "checkpoint.pt").is_file() and (tmp_path / "ckpt" / "run.json").is_file()
    started(tmp_path / "refused", '{"event": "train", "step": 3}\n').release_as_found("absent", refused=True)
    assert not (tmp_path / "refused").exists()


def test_a_run_folder_inside_a_dataset_package_or_run_is_refused(spec: Path, tmp_path: Path) -> None:
    data = _synth(spec, tmp_path / "data")
    before = _listing(data)
    with pytest.raises(RunFolderError, match="a dataset's folder"):
        flowrec.train(spec, data=data, out=data / "run", max_steps=1)
    cli = runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(data / "sub" / "run"),
                              "--max-steps", "1", "-q"])
    assert cli.exit_code == 2 and "a dataset's folder" in cli.output
    assert len(cli.output.strip().splitlines()) == 1, cli.output
    (tmp_path / "link").symlink_to(data)
    with pytest.raises(RunFolderError, match="a dataset's folder"):
        flowrec.train(spec, data=data, out=tmp_path / "link" / "run", max_steps=1)
    assert _listing(data) == before  # nothing landed among the dataset's part files
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "manifest.json").write_text('{"format": "flowrec-model"}')
    with pytest.raises(RunFolderError, match="a model package's folder"):
        flowrec.train(spec, data=data, out=package / "run", max_steps=1)
    other = tmp_path / "other"
    other.mkdir()
    (other / "run.json").write_text("{}")
    with pytest.raises(RunFolderError, match="a training run's folder"):
        flowrec.train(spec, data=data, out=other / "nested", max_steps=1)
    assert not (package / "run").exists() and not (other / "nested").exists()


@pytest.mark.parametrize("recorded", ["NaN", "[1]", "true", '{"a": 1}', json.dumps("9" * 300)])
def test_a_damaged_recorded_date_is_refused_not_ordered(spec: Path, tmp_path: Path, recorded: str) -> None:
    days = tmp_path / "days"
    for seed, name in enumerate(["d1", "d2"]):
        _synth(spec, days / name, seed + 1)
        (days / name / "_flowrec_stats.json").write_text(
            '{"dates": {"column": "ts", "min": %s, "max": 9}}' % (recorded if name == "d1" else "5.0"))
    with pytest.raises(DataError, match="day d1: _flowrec_stats.json is damaged") as caught:
        day_partitions(days, parse_order("date:ts"))
    assert "\n" not in str(caught.value)
    inspect = runner.invoke(app, ["data", "inspect", str(days), "--follow-order", "date:ts"])
    assert inspect.exit_code == 2 and "is damaged" in inspect.output
    follow = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(tmp_path / "stream"),
                                 "--follow-order", "date:ts", "-q"])
    assert follow.exit_code == 2 and "is damaged" in follow.output
    assert not (tmp_path / "stream" / "follow.json").exists()


def test_integer_and_float_dates_order_together(spec: Path, tmp_path: Path) -> None:
    days = tmp_path / "days"
    for seed, (name, low) in enumerate([("a", "30"), ("b", "10.5"), ("c", "20")]):
        _synth(spec, days / name, seed + 1)
        (days / name / "_flowrec_stats.json").write_text('{"dates": {"column": "ts", "min": %s, "max": 99}}' % low)
    assert [d.name for d in day_partitions(days, DayOrder("ts"))] == ["b", "c", "a"]


def test_days_are_not_ordered_by_an_encoded_categorical_column(spec: Path, tmp_path: Path) -> None:
    days = tmp_path / "days"
    for seed, name in enumerate(["d1", "d2"]):
        _synth(spec, days / name, seed + 1)
    with pytest.raises(DataError, match="'user' is an encoded categorical feature"):
        day_partitions(days, DayOrder("user"))
    assert [d.name for d in day_partitions(days, DayOrder("d1"))] in (["d1", "d2"], ["d2", "d1"])  # dense: fine


def test_a_day_linked_in_twice_is_refused(spec: Path, tmp_path: Path) -> None:
    days = tmp_path / "days"
    _synth(spec, days / "d1")
    (days / "d1-again").symlink_to(days / "d1")
    with pytest.raises(DataError, match="days d1 and d1-again .* are the same folder"):
        day_partitions(days, DayOrder())


@pytest.mark.parametrize("damage", ["deep", "fifo", "folder", "utf16"])
def test_a_damaged_follow_record_is_one_line(tmp_path: Path, capsys, damage: str) -> None:
    path = tmp_path / "follow.json"
    if damage == "deep":
        path.write_text("[" * 100_000)
    elif damage == "fifo":
        os.mkfifo(path)  # must not block
    elif damage == "folder":
        path.mkdir()
    else:
        path.write_bytes('{"days": []}'.encode("utf-16"))
    with pytest.raises(typer.Exit) as caught:
        done_days(tmp_path)
    assert caught.value.exit_code == 2
    err = capsys.readouterr().err
    assert "follow.json is damaged" in err and len(err.strip().splitlines()) == 1


def test_a_second_follow_on_the_same_stream_is_refused(spec: Path, tmp_path: Path) -> None:
    days = tmp_path / "days"
    _synth(spec, days / "d1")
    stream = tmp_path / "stream"
    stream.mkdir()
    held = RunLock.acquire(stream, LOCK_FILE)
    try:
        second = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(stream), "-q"])
        assert second.exit_code == 2 and f"pid {os.getpid()}" in second.output, second.output
        assert "in use by this same process" in second.output and "not another flowrec train --follow" in second.output
        assert sorted(p.name for p in stream.iterdir()) == [LOCK_FILE]  # nothing trained, nothing recorded
    finally:
        held.release()
    RunLock.acquire(stream, LOCK_FILE).release()  # released: the next one gets it


@pytest.mark.parametrize("rank", ["0", "1"])
def test_follow_under_a_launch_of_several_ranks_is_one_line(spec: Path, tmp_path: Path, monkeypatch, rank: str) -> None:
    # `torchrun --nproc-per-node 2 -m flowrec train SPEC --follow DAYS --out S` (--nproc is refused with
    # --follow): every rank followed the stream, rank 1 said S 'is in use by another flowrec train --follow
    # (pid of rank 0)' and rank 0 waited for it in its first collective until the launcher killed it
    days = tmp_path / "days"
    _synth(spec, days / "d1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", rank)
    stream = tmp_path / "stream"
    refused = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(stream), "-q"])
    assert refused.exit_code == 2, refused.output
    assert "a launch of 2 ranks" in refused.output and len(refused.output.strip().splitlines()) == 1, refused.output
    assert not stream.exists()


def test_a_stream_folder_owned_by_a_dataset_or_run_is_refused(spec: Path, tmp_path: Path) -> None:
    days = tmp_path / "days"
    _synth(spec, days / "d1")
    before = _listing(days)
    for out, says in ((days / "d1", "it is a dataset's folder"), (days / "d1" / "stream", "it lies in")):
        refused = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(out), "-q"])
        assert refused.exit_code == 2 and says in refused.output, refused.output
    assert _listing(days) == before


def _managed_run(tmp_path: Path, report) -> Path:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    text = report if isinstance(report, str) else json.dumps({"event": "end", "step": 3, "managed": report})
    (run / "metrics.jsonl").write_text('{"event": "step", "step": 1}\n' + text + "\n")
    return run


GOOD = {"rows": 200, "held": 5, "waiting": 1, "admitted": 6, "evicted": 1, "expired": 0, "lookups": 9,
        "default_lookups": 2}


@pytest.mark.parametrize("report, says", [
    ({"tables": {"users": {**GOOD, "held": "x"}}}, "held is 'x'"),
    ({"tables": {"users": {**GOOD, "held": 1e300}}}, "held is 1e+300"),
    ({"tables": {"users": {**GOOD, "default_lookups": -1}}}, "default_lookups is -1"),
    ({"tables": {"users": {**GOOD, "rows": True}}}, "rows is True"),
    ({"tables": [1]}, "lists no tables"),
    ({"tables": {"other": GOOD}}, "no managed table 'users' of spec"),
    ("[" * 100_000, "recorded no managed tables"),
])
def test_plan_managed_from_refuses_a_damaged_report(tmp_path: Path, capsys, report, says: str) -> None:
    spec = tmp_path / "m.yaml"
    spec.write_text(MANAGED_SPEC)
    run = _managed_run(tmp_path, report)
    with pytest.raises(typer.Exit) as caught:
        run_managed(run, load_spec(spec))
    assert caught.value.exit_code == 2
    err = capsys.readouterr().err
    assert says in err and len(err.strip().splitlines()) == 1, err
    cli = runner.invoke(app, ["plan", str(spec), "--managed-from", str(run), "--json", str(tmp_path / "p.json")])
    assert cli.exit_code == 2 and not (tmp_path / "p.json").exists()  # refused before any output


def test_plan_managed_from_shows_a_good_report(tmp_path: Path) -> None:
    spec = tmp_path / "m.yaml"
    spec.write_text(MANAGED_SPEC)
    run = _managed_run(tmp_path, {"tables": {"users": GOOD}})
    assert run_managed(run, load_spec(spec))["tables"]["users"] == GOOD
    shown = runner.invoke(app, ["plan", str(spec), "--managed-from", str(run)])
    assert shown.exit_code == 0 and "5/200 rows held" in shown.output, shown.output


def test_plan_managed_from_refuses_a_spec_without_managed_tables(spec: Path, tmp_path: Path) -> None:
    """`flowrec plan specs/movielens.yaml --managed-from RUN` (a spec of no managed table) printed
    the plan, exit 0, the flag ignored without a word, where managed.md says it adds the run's
    line under each managed table; now one line before any output, as other --managed-from refusals."""
    run = _managed_run(tmp_path, {"tables": {"users": GOOD}})
    cli = runner.invoke(app, ["plan", str(spec), "--managed-from", str(run), "--json", str(tmp_path / "p.json")])
    assert cli.exit_code == 2 and "has no managed tables" in cli.output, cli.output
    assert len(cli.output.strip().splitlines()) == 1 and not (tmp_path / "p.json").exists()


def test_inspect_refuses_a_follow_order_for_one_dataset(spec: Path, tmp_path: Path) -> None:
    data = _synth(spec, tmp_path / "data")
    result = runner.invoke(app, ["data", "inspect", str(data), "--follow-order", "date:ts"])
    assert result.exit_code == 2 and "one dataset" in result.output


def test_a_split_dataset_is_no_folder_of_days(spec: Path, tmp_path: Path) -> None:
    split = tmp_path / "split"
    for part in ("train", "test"):
        _synth(spec, split / part)
    for part in ("train", "test"):  # as `data convert --test-fraction` records them
        meta = json.loads((split / part / "_flowrec.json").read_text())
        meta["split"] = {"part": part, "test_fraction": 0.2, "split_seed": 1}
        (split / part / "_flowrec.json").write_text(json.dumps(meta))
    with pytest.raises(DataError, match="split into train/ and test/"):
        day_partitions(split, DayOrder())
    inspect = runner.invoke(app, ["data", "inspect", str(split)])  # each part as a dataset, no days
    assert inspect.exit_code == 0, inspect.output
    assert [line.split(":")[0] for line in inspect.stdout.splitlines() if " rows in " in line] == \
        [str(split / "train"), str(split / "test")]
    follow = runner.invoke(app, ["train", str(spec), "--follow", str(split), "--out", str(tmp_path / "stream"), "-q"])
    assert follow.exit_code == 2 and "not a folder of day partitions" in follow.output
    assert not (tmp_path / "stream").exists()  # a refused stream leaves no folder it made


@pytest.mark.parametrize("other", ["damaged", "absent"])
def test_recorded_dates_never_mix_with_stored_values(spec: Path, tmp_path: Path, other: str) -> None:
    """d1 is a stored dense column (transformed values); a day whose recorded dates are unreadable
    or absent must not be keyed by them next to days keyed by recorded raw dates."""
    days = tmp_path / "days"
    for seed, name in enumerate(["a", "b"]):
        _synth(spec, days / name, seed + 1)
    (days / "a" / "_flowrec_stats.json").write_text('{"dates": {"column": "d1", "min": 1000.0, "max": 2000.0}}')
    if other == "damaged":
        (days / "b" / "_flowrec_stats.json").write_text('{"dates": ' * 100 + "}" * 100)
    with pytest.raises(DataError, match="is damaged" if other == "damaged" else "only its stored values"):
        day_partitions(days, DayOrder("d1"))


@pytest.mark.parametrize("days", [["../../elsewhere"], ["a/b"], [".."], [""], ["d1", "d1"], [3]])
def test_a_follow_record_naming_no_plain_day_is_damaged(tmp_path: Path, capsys, days: list) -> None:
    (tmp_path / "follow.json").write_text(json.dumps({"days": days, "order": "name"}))
    with pytest.raises(typer.Exit):
        done_days(tmp_path)
    assert "follow.json is damaged" in capsys.readouterr().err
    (tmp_path / "follow.json").write_text(json.dumps({"days": ["d1", "d2"], "order": "name"}))
    assert done_days(tmp_path) == ["d1", "d2"]


def test_overwriting_a_run_folder_in_use_is_refused_and_keeps_it(spec: Path, tmp_path: Path) -> None:
    from flowrec.runtime.rundir import RunLock

    run = tmp_path / "run"
    run.mkdir()
    (run / "run.json").write_text('{"kept": true}')
    (run / "checkpoint.pt").write_bytes(b"the other run's checkpoint")
    held = RunLock.acquire(run)
    try:
        with pytest.raises(RunFolderError, match=f"in use by this same process \\(pid {os.getpid()}\\)"):
            flowrec.train(spec, out=run, overwrite=True, rows=200, max_steps=1)
        cli = runner.invoke(app, ["train", str(spec), "--out", str(run), "--overwrite", "--rows", "200", "-q"])
        assert cli.exit_code == 2 and "in use" in cli.output
    finally:
        held.release()
    assert (run / "run.json").read_text() == '{"kept": true}'
    assert (run / "checkpoint.pt").read_bytes() == b"the other run's checkpoint"


@pytest.mark.parametrize("key, value", [("max_steps", 0), ("epochs", 0), ("rows", 0), ("checkpoint_full_every", -1),
                                        ("seed", -1), ("eval_every", True)])
def test_a_recorded_setting_out_of_the_flags_range_is_damaged(spec: Path, tmp_path: Path, key: str, value) -> None:
    from flowrec.runs.settings import read_run_file

    run = tmp_path / "run"
    run.mkdir()
    recorded = {"data": None, "eval_data": None, "rows": 100, "seed": None, "epochs": 1, "max_steps": 2,
                "eval_every": 0, key: value}
    (run / "run.json").write_text(json.dumps(recorded))
    with pytest.raises(RunFolderError, match=f"run.json is damaged: {key} must be"):
        read_run_file(run)
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "-q"])
    assert resumed.exit_code == 2 and "is damaged" in resumed.output
    assert sorted(p.name for p in run.iterdir()) == [".flowrec.lock", "run.json"]  # nothing trained


def test_an_empty_device_is_refused_by_the_cli_and_the_api(spec: Path, tmp_path: Path) -> None:
    cli = runner.invoke(app, ["train", str(spec), "--device", "", "--out", str(tmp_path / "cli"), "--rows", "200",
                              "--max-steps", "1", "-q"])
    assert cli.exit_code == 2 and "--device is empty" in cli.output, cli.output
    with pytest.raises(RunError):
        flowrec.train(spec, device="", out=tmp_path / "api", rows=200, max_steps=1)
    assert not (tmp_path / "cli").exists() and not (tmp_path / "api").exists()


def test_cuda_on_a_machine_without_cuda_is_a_run_error_naming_the_argument(spec: Path, tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """`flowrec.load(run, device="cuda")` without CUDA was the session's RuntimeError naming the
    CLI's --device (flowrec.train's RunError named --device too); now both are a RunError naming
    the argument, raised before the run is read or a folder is made."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for call in (lambda: flowrec.load(tmp_path / "no-run", device="cuda"),
                 lambda: flowrec.train(spec, device="cuda:0", out=tmp_path / "api", rows=200, max_steps=1)):
        with pytest.raises(RunError) as caught:
            call()
        assert re.match(r"device 'cuda(:0)?' was asked for, but CUDA is not available", str(caught.value)), caught.value
    assert not (tmp_path / "api").exists()


def test_a_follow_with_no_day_to_train_says_so(spec: Path, tmp_path: Path) -> None:
    raw = tmp_path / "raw"  # a mistyped DAYS: raw files, no encoded day partitions
    raw.mkdir()
    (raw / "2026-11-01.csv").write_text("a,b\n1,2\n")
    result = runner.invoke(app, ["train", str(spec), "--follow", str(raw), "--out", str(tmp_path / "stream"), "-q"])
    assert result.exit_code == 0 and "no new day partition under" in result.output, result.output
    assert "0 day(s) trained" in result.output and not (tmp_path / "stream").exists()


def test_early_stopping_without_evaluations_is_refused_by_the_api_as_by_the_cli(spec: Path, tmp_path: Path) -> None:
    stopping = tmp_path / "es.yaml"
    stopping.write_text(spec.read_text().replace("epochs: 1", "epochs: 1, early_stopping: {metric: auc, patience: 2}"))
    assert "early_stopping" in stopping.read_text()
    data = _synth(spec, tmp_path / "data")
    with pytest.raises(RunError, match="training.early_stopping needs an evaluation set"):
        flowrec.train(stopping, data=data, out=tmp_path / "api", max_steps=2)
    cli = runner.invoke(app, ["train", str(stopping), "--data", str(data), "--out", str(tmp_path / "cli"),
                              "--max-steps", "2", "-q"])
    assert cli.exit_code == 2 and "training.early_stopping needs an evaluation set" in cli.output
    with pytest.raises(RunError, match="needs evaluations during training"):
        flowrec.train(stopping, data=data, eval_data=data, eval_every=0, out=tmp_path / "api", max_steps=2)
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


@pytest.mark.parametrize("field, value", [("batch_size", 0), ("batch_size", -5), ("epochs", 0)])
def test_an_invalid_model_spec_object_is_refused_like_a_spec_file(spec: Path, tmp_path: Path, field: str,
                                                                  value: int) -> None:
    import dataclasses

    from flowrec.spec.errors import SpecError

    loaded = load_spec(spec)
    bad = dataclasses.replace(loaded, training=dataclasses.replace(loaded.training, **{field: value}))
    with pytest.raises(SpecError, match=f"training.{field}: must be >= 1"):
        flowrec.train(bad, out=tmp_path / "run", rows=200, max_steps=2)
    assert not (tmp_path / "run").exists()


def test_a_callback_that_raises_leaves_the_run_resumable_and_unlocked(spec: Path, tmp_path: Path) -> None:
    from flowrec.runtime.rundir import RunLock

    def broken(event) -> None:
        if event.step == 2:
            raise RuntimeError("a bug in the user's callback")

    run = tmp_path / "run"
    with pytest.raises(RuntimeError, match="a bug in the user's callback"):
        flowrec.train(spec, out=run, rows=200, max_steps=3, checkpoint_every=1, on_step=broken)
    RunLock.acquire(run).release()  # the lock was released
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "-q"])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming" in resumed.output and "(step 1)" in resumed.output  # from the last checkpoint
    assert flowrec.load(run).history[-1]["step"] == 3


@pytest.mark.parametrize("damage", [
    lambda d: d["managed"]["users"].update(distinct_ids="lots"),
    lambda d: d["hashed"]["item"].update(occupied_rows=-1),
    lambda d: d.update(label_mean={"label": "high"}),
    lambda d: d.update(hashed=[1, 2]),
    lambda d: d["dense_missing"].update(d1=3),
    lambda d: d.update(rows=True),
])
def test_damaged_raw_statistics_are_ignored_with_a_warning(tmp_path: Path, damage) -> None:
    import csv

    from flowrec.data.rawstats import read_stats

    spec = tmp_path / "m.yaml"
    spec.write_text(MANAGED_SPEC + "data: {format: csv, path: raw, options: {date_column: ts}}\n")
    with (tmp_path / "x.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["d1", "user", "friends", "item", "label", "ts"])
        writer.writerows([[0.5 * i, f"u{i % 7}", "", f"i{i % 5}", i % 2, 1000 + i] for i in range(40)])
    data = tmp_path / "x"
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "x.csv"), str(data), "--spec", str(spec), "-q"])
    assert made.exit_code == 0, made.output
    good = read_stats(data)
    assert good is not None and good["managed"]["users"]["distinct_ids"] == 7  # what conversion wrote passes
    damage(good)
    (data / "_flowrec_stats.json").write_text(json.dumps(good))
    assert read_stats(data) is None
    shown = runner.invoke(app, ["data", "inspect", str(data)])
    assert shown.exit_code == 0 and "_flowrec_stats.json is damaged" in shown.output, shown.output
    assert "Traceback" not in shown.output


@pytest.mark.parametrize("order", [5, None, "date:", "by size", "date: ts"])
def test_a_follow_record_with_no_usable_order_is_damaged(tmp_path: Path, capsys, order) -> None:
    (tmp_path / "follow.json").write_text(json.dumps({"days": ["d1"], "order": order}))
    with pytest.raises(typer.Exit):
        done_days(tmp_path, DayOrder())
    assert "follow.json is damaged (its order" in capsys.readouterr().err
    (tmp_path / "follow.json").write_text(json.dumps({"days": ["d1"], "order": "date:ts"}))
    assert done_days(tmp_path) == ["d1"]
    (tmp_path / "follow.json").write_text(json.dumps({"days": ["d1"]}))  # written before orders were recorded
    assert done_days(tmp_path, DayOrder()) == ["d1"]


def test_more_synthetic_rows_than_memory_holds_are_refused_at_once(spec: Path, tmp_path: Path) -> None:
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.runs.start import synthetic_bytes

    loaded = load_spec(spec)
    assert synthetic_bytes(loaded, 1000) >= synth_table(loaded, 1200, SynthConfig(seed=1)).nbytes  # an upper estimate
    rows = 10**14  # petabytes: more than any machine holds
    with pytest.raises(RunError, match="synthetic rows take about .* GiB in memory"):
        flowrec.train(spec, out=tmp_path / "api", rows=rows, max_steps=1)
    cli = runner.invoke(app, ["train", str(spec), "--rows", str(rows), "--out", str(tmp_path / "cli"), "-q"])
    assert cli.exit_code == 2 and "give fewer --rows" in cli.output
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_resuming_an_older_run_whose_seeded_split_data_is_lost_is_refused_not_split_again(tmp_path: Path) -> None:
    """A run of a flowrec of before 2026-12-05 on bound data split by a seed (its RUN/data records
    no split_rule, its run.json no train_rows): that flowrec put other rows in test (ffdac45), so
    RUN/data/test deleted was 'remove RUN/data to encode the spec's data again (the same split)',
    and with RUN/data removed --resume encoded a new split and went on from the checkpoint's batch
    in other rows, evaluating on rows it had trained on, without a word. Now neither is advised or
    done: one line each, the run folder left as it was."""
    spec = _early_stopping_csv_spec(tmp_path)
    spec.write_text(spec.read_text().replace(", early_stopping: {metric: auc}", "")
                    .replace("label: label}", "label: label, options: {test_fraction: 0.2}}"))
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "1", "--epochs", "2", "-q"])
    assert made.exit_code == 0, made.output
    for record in (run / "run.json", run / "data" / "train" / "_flowrec.json", run / "data" / "test" / "_flowrec.json"):
        doc = json.loads(record.read_text())  # as the older flowrec wrote them
        doc.pop("train_rows", None)
        doc.get("split", {}).pop("split_rule", None)
        record.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    shutil.rmtree(run / "data" / "test")
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 2, result.output
    assert "the same split" not in result.output and "names no split rule" in result.output, result.output
    shutil.rmtree(run / "data")
    before = _listing(run)
    result = runner.invoke(app, ["eval", str(run)])
    assert result.exit_code == 2 and "encodes again" not in result.output, result.output
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2"])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error:") and "before 2026-12-05" in line and f"--out {run} --overwrite" in line, line
    assert _listing(run) == before and not (run / "data").exists()
    # as the line says: started over, the data is encoded and split by this flowrec
    result = runner.invoke(app, ["train", str(spec), "--out", str(run), "--overwrite", "--max-steps", "1", "-q"])
    assert result.exit_code == 0, result.output
    assert (run / "data" / "test").is_dir()


def test_resuming_an_older_run_on_its_data_folder_split_again_by_this_flowrec_is_refused(tmp_path: Path) -> None:
    """A run of a flowrec of before 2026-12-05 (run.json without train_rows) on a split --data
    folder converted again since by this flowrec (data.md: 'convert again to compare with runs
    trained since'): --resume went on from the checkpoint's batch in rows of another split,
    evaluating on rows it had trained on, without a word; now one line, the run left as it was,
    and eval (Run.evaluate) of it warns. The folder as that flowrec left it (no split_rule) still
    resumes."""
    spec = _early_stopping_csv_spec(tmp_path)
    spec.write_text(spec.read_text().replace(", early_stopping: {metric: auc}", ""))
    data, run = tmp_path / "d", tmp_path / "run"

    def convert() -> None:
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "raw.csv"), str(data), "--spec", str(spec),
                                   "--test-fraction", "0.25", "--overwrite", "-q"])
        assert made.exit_code == 0, made.output

    convert()
    made = runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(run), "--max-steps", "1", "-q"])
    assert made.exit_code == 0, made.output
    older = json.loads((run / "run.json").read_text())
    older.pop("train_rows")  # as the older flowrec wrote it
    (run / "run.json").write_text(json.dumps(older, indent=2, sort_keys=True) + "\n")
    for part in ("train", "test"):  # and its conversion of the data
        record = data / part / "_flowrec.json"
        doc = json.loads(record.read_text())
        doc["split"].pop("split_rule")
        record.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2", "-q"])
    assert resumed.exit_code == 0, resumed.output
    # a run of this flowrec on data converted before it, whose run.json an older flowrec's resume
    # rewrote without train_rows, is not taken for one on data converted again
    started = (run / "encoder" / "encoder.json").stat().st_mtime_ns
    for part in ("train", "test"):
        record = data / part / "_flowrec.json"
        doc = json.loads(record.read_text())
        doc["split"]["split_rule"] = 2
        record.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
        os.utime(record, ns=(started - 10**9, started - 10**9))
    older["max_steps"] = 1
    (run / "run.json").write_text(json.dumps(older, indent=2, sort_keys=True) + "\n")
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2", "-q"])
    assert resumed.exit_code == 0, resumed.output
    older["max_steps"] = 2
    (run / "run.json").write_text(json.dumps(older, indent=2, sort_keys=True) + "\n")
    convert()  # upgraded, the data converted again
    before = _listing(run)
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "3"])
    assert result.exit_code == 2, result.output
    line = result.output.strip().splitlines()[-1]
    assert line.startswith("error:") and f"{data} was converted again since the run" in line, line
    assert _listing(run) == before
    # scoring the run on that folder's test part, which holds rows it trained on, says so
    result = runner.invoke(app, ["eval", str(run)])
    assert result.exit_code == 0 and "not of held-out rows" in result.output, result.output
    with pytest.warns(UserWarning, match="not of held-out rows"):
        flowrec.load(run).evaluate()


def _bound_csv_spec(tmp_path: Path, rows: int = 80) -> Path:
    """The managed spec bound to a raw CSV file of `rows` random rows (skewed ids)."""
    import csv
    import random

    rng = random.Random()
    with (tmp_path / "raw.csv").open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["d1", "user", "friends", "item", "label"])
        for _ in range(rows):
            writer.writerow([rng.random() * 5, f"u{int(rng.paretovariate(1.2)) % 50}",
                             "^".join(f"u{rng.randrange(80)}" for _ in range(rng.randrange(4))),
                             f"i{rng.randrange(40)}", int(rng.random() < 0.3)])
    path = tmp_path / "bound.yaml"
    path.write_text(MANAGED_SPEC + "data: {format: csv, path: raw.csv}\n")
    return path


def test_bound_data_is_encoded_once_by_two_runs_started_together(tmp_path: Path, monkeypatch) -> None:
    """Two runs without a run folder (`flowrec.train(out=None)`) encode the spec's raw data into
    runs/<name>/data: the second waits for the first and reuses its folder, instead of encoding
    it again over the folder the first is already reading (or failing on it)."""
    import threading
    import time

    import flowrec.data.convert as convert_module
    from flowrec.data.layout import read_meta
    from flowrec.runtime.session import bound_dataset

    spec_path = _bound_csv_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    real, calls = convert_module.convert, []

    def slow_convert(*args, **kwargs):
        calls.append(args[-1])
        deadline = time.monotonic() + 60  # the other run arrives meanwhile and says it waits
        while not any("waiting for another flowrec process" in n for n in notes) and time.monotonic() < deadline:
            time.sleep(0.01)
        return real(*args, **kwargs)

    monkeypatch.setattr(convert_module, "convert", slow_convert)
    loaded, results, notes = load_spec(spec_path), [], []
    start = threading.Barrier(2)

    def run() -> None:
        start.wait(timeout=60)  # a thread that never came: the other fails, not hangs
        try:
            results.append(bound_dataset(loaded, spec_path, None, notes.append))
        except Exception as exc:  # noqa: BLE001 - the test reports it
            results.append(exc)

    threads = [threading.Thread(target=run) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # two encodings of the data, one waiting for the other, on a loaded machine
    out = Path("runs") / "tiny_managed" / "data"
    assert results == [out, out] and len(calls) == 1
    assert read_meta(out).rows == 80
    assert sum("waiting for another flowrec process" in n for n in notes) == 1
    assert sorted(p.name for p in out.parent.iterdir()) == ["data"]  # no lock file, no partial left
    again = flowrec.train(spec_path, out=None, max_steps=1)  # the API reuses it, encoding nothing
    assert len(calls) == 1 and again.result.steps == 1


def test_bound_data_changed_since_it_was_encoded_is_not_reused_without_a_word(tmp_path: Path, monkeypatch) -> None:
    """`flowrec.train(out=None)` reuses runs/<name>/data, the spec's raw data encoded by an earlier
    call: after the raw file changed (rows added, fixed) it trained on the old rows without a word.
    Now that reuse is one line saying how to encode it again; unchanged files are still reused, and
    a run folder's own data stays its data (a resumed run continues on what it trained on)."""
    import os

    from flowrec.runtime.session import bound_dataset

    spec_path = _bound_csv_spec(tmp_path)
    monkeypatch.chdir(tmp_path)
    spec = load_spec(spec_path)
    first = bound_dataset(spec, spec_path, None, lambda _: None)
    assert bound_dataset(spec, spec_path, None, lambda _: None) == first  # unchanged: reused
    run_data = bound_dataset(spec, spec_path, tmp_path / "run", lambda _: None)
    raw = tmp_path / "raw.csv"
    raw.write_text(raw.read_text() + "1.5,u1,,i1,1\n")
    os.utime(raw, ns=(raw.stat().st_atime_ns, raw.stat().st_mtime_ns + 10**9))  # (a coarse file clock)
    with pytest.raises(DataError, match=r"runs/tiny_managed/data holds .*raw\.csv encoded before the file changed"
                                        r".*remove runs/tiny_managed/data to encode it again"):
        bound_dataset(spec, spec_path, None, lambda _: None)
    assert bound_dataset(spec, spec_path, tmp_path / "run", lambda _: None, resumed=True) == run_data


def test_a_new_run_in_a_folder_encodes_bound_data_that_changed_again(tmp_path: Path, monkeypatch) -> None:
    """`flowrec train SPEC --out R --overwrite` (and `flowrec.train(out=R, overwrite=True)`) reused
    R/data, encoded from the raw file the replaced run read, after the file changed: the new run
    trained on the old rows without a word. Now a new run encodes the changed file again (said in a
    line), and a resumed run (`--resume R`) keeps the data it trained on."""
    import os

    import pyarrow.parquet as pq

    from flowrec.runtime.session import bound_dataset

    def rows(folder: Path) -> int:
        return sum(pq.read_metadata(f).num_rows for f in folder.rglob("*.parquet"))

    spec_path = _bound_csv_spec(tmp_path)
    spec = load_spec(spec_path)
    said: list[str] = []
    data = bound_dataset(spec, spec_path, tmp_path / "run", said.append)
    before = rows(data)
    assert bound_dataset(spec, spec_path, tmp_path / "run", said.append) == data and rows(data) == before
    assert sum("encoding" in line for line in said) == 1  # unchanged: reused by a new run too
    raw = tmp_path / "raw.csv"
    raw.write_text(raw.read_text() + "".join(f"{i}.5,u{i % 3},,i{i % 4},{i % 2}\n" for i in range(40)))
    os.utime(raw, ns=(raw.stat().st_atime_ns, raw.stat().st_mtime_ns + 10**9))  # (a coarse file clock)
    assert bound_dataset(spec, spec_path, tmp_path / "run", said.append, resumed=True) == data
    assert rows(data) == before  # a resumed run continues on what it trained on
    assert bound_dataset(spec, spec_path, tmp_path / "run", said.append) == data
    assert rows(data) == before + 40 and any("changed since" in line and "encoding it again" in line
                                             for line in said), said
    (data / "_flowrec_raw.json").unlink()  # an encoding from before flowrec stamped them: encoded again
    assert bound_dataset(spec, spec_path, tmp_path / "run", said.append) == data and rows(data) == before + 40
    assert (data / "_flowrec_raw.json").is_file()


def test_data_naming_a_file_says_it_is_a_file_not_a_dataset_folder(spec: Path, tmp_path: Path) -> None:
    """A raw file given where a dataset folder goes: one line saying what it is (CLI exit 2, a
    DataError from the API), not "directory not found"; nothing written."""
    raw = tmp_path / "clicks.csv"
    raw.write_text("d1,label\n1,0\n")
    says = f"{raw} is a file, not a dataset folder: give the folder holding _flowrec.json"
    with pytest.raises(DataError, match="is a file, not a dataset folder"):
        flowrec.train(spec, data=raw, out=tmp_path / "api", max_steps=1)
    for args in (["train", str(spec), "--data", str(raw), "--out", str(tmp_path / "cli"), "-q"],
                 ["data", "inspect", str(raw)]):
        shown = runner.invoke(app, args)
        assert shown.exit_code == 2 and says in shown.output and "not found" not in shown.output, shown.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["clicks.csv", "s.yaml"]
    missing = runner.invoke(app, ["data", "inspect", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "dataset directory not found" in missing.output


@pytest.mark.parametrize("wait", ["inf", "-inf", "nan", "-1", "1e300", "604801"])
def test_a_follow_wait_out_of_range_is_one_line(spec: Path, tmp_path: Path, wait: str) -> None:
    """--follow-wait inf used to wait forever (nan and huge values too): refused, with the bounds."""
    days = tmp_path / "days"
    _synth(spec, days / "d1")
    shown = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(tmp_path / "stream"),
                                "--follow-wait", wait, "-q"])
    assert shown.exit_code == 2, shown.output
    assert shown.output.strip().splitlines() == [
        f"error: --follow-wait must be a number of seconds in 0..604800 (a week), not {float(wait)!r}"]
    assert not (tmp_path / "stream").exists()
    shown = runner.invoke(app, ["train", "--help"], env={"COLUMNS": "400"}).output
    assert "(0 .. 604800, a week)" in " ".join(shown.replace("│", " ").split())


def test_data_naming_a_part_file_of_a_dataset_names_the_dataset(spec: Path, tmp_path: Path) -> None:
    """A dataset's part file given where the dataset goes was told to be converted as raw Parquet
    (`flowrec data convert parquet PART OUT`), which refuses encoded rows; now its dataset is named."""
    data = _synth(spec, tmp_path / "ds")
    part = next(data.glob("*.parquet"))
    says = f"{part} is a file of the dataset {data}, not a dataset folder: give that folder"
    with pytest.raises(DataError, match=re.escape(says)):
        flowrec.train(spec, data=part, out=tmp_path / "api", max_steps=1)
    shown = runner.invoke(app, ["data", "inspect", str(part)])
    assert shown.exit_code == 2 and says in shown.output and "data convert" not in shown.output, shown.output
    assert not (tmp_path / "api").exists()


def test_the_longest_follow_wait_is_accepted(spec: Path, tmp_path: Path) -> None:
    days = tmp_path / "days"
    _synth(spec, days / "d1")
    shown = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(tmp_path / "stream"),
                                "--follow-wait", "604800", "--follow-once", "--max-steps", "2", "-q"])
    assert shown.exit_code == 0, shown.output  # one day trained, then stops (--follow-once): no wait


def test_eval_data_without_training_data_is_refused_not_ignored(spec: Path, tmp_path: Path) -> None:
    """--eval-data (eval_data=) with synthetic training rows used to be ignored silently (a whole
    synthetic run, evaluated on synthetic rows): refused, nothing written."""
    held_out = _synth(spec, tmp_path / "held_out", seed=2)
    with pytest.raises(DataError, match="needs training data encoded alike"):
        flowrec.train(spec, eval_data=held_out, out=tmp_path / "api", max_steps=1)
    shown = runner.invoke(app, ["train", str(spec), "--eval-data", str(held_out), "--out", str(tmp_path / "cli"),
                                "--max-steps", "1", "-q"])
    assert shown.exit_code == 2 and "needs training data encoded alike" in shown.output, shown.output
    assert len(shown.output.strip().splitlines()) == 1
    assert not (tmp_path / "api").exists() and not (tmp_path / "cli").exists()


def test_eval_data_replaces_the_bound_datas_evaluation(tmp_path: Path, monkeypatch) -> None:
    """With data bound in the spec, eval_data is what the run evaluates on (it was ignored)."""
    from flowrec.data.layout import read_meta

    spec_path = _bound_csv_spec(tmp_path, rows=64)
    monkeypatch.chdir(tmp_path)
    held_out = tmp_path / "held_out"
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "raw.csv"), str(held_out),
                               "--spec", str(spec_path), "-q"])
    assert made.exit_code == 0, made.output
    seen = []
    run = flowrec.train(spec_path, eval_data=held_out, out=tmp_path / "run", max_steps=2,
                        on_eval=lambda e: seen.append(e))
    assert read_meta(held_out).rows == 64 and run.result.steps == 2
    assert seen and all(head["samples"] == 64 for head in seen[-1].metrics.values())


def test_eval_data_closes_the_test_split_it_replaces(spec: Path, tmp_path: Path, monkeypatch) -> None:
    """A dataset's own test split, replaced by eval_data, is closed (its readers used to stay open
    for the whole run); a failure to open eval_data still closes it."""
    from flowrec.runtime import session

    closed: list[str] = []

    class Source:
        def __init__(self, name: str) -> None:
            self.name = name

        def close(self) -> None:
            closed.append(self.name)

    monkeypatch.setattr(session, "dataset_pair", lambda *a, **k: (Source("train"), Source("test")))
    monkeypatch.setattr(session, "open_dataset", lambda path, *a: Source(f"eval:{Path(path).name}"))
    model = load_spec(spec)
    opts = session.SessionOptions(data=tmp_path / "d", eval_data=tmp_path / "held")
    train, evaluation, _ = session.resolve_data(model, spec, opts, lambda _: None)
    assert (train.name, evaluation.name, closed) == ("train", "eval:held", ["test"])

    def refused(path, *a):
        raise DataError(f"{path}: not a dataset")

    monkeypatch.setattr(session, "open_dataset", refused)
    with pytest.raises(DataError, match="not a dataset"):
        session.resolve_data(model, spec, opts, lambda _: None)
    assert closed == ["test", "train", "test"]


def test_a_lost_rank_line_says_timeout_only_for_a_timeout() -> None:
    """A collective that timed out names the timeout; a closed connection (the rank died) does not
    (before, both said "failed or did not answer within T s", even a crash at once)."""
    from types import SimpleNamespace

    from flowrec.cli.train_cmds import _rank_lost

    world = SimpleNamespace(timeout_s=8.0)
    died = _rank_lost(world, RuntimeError("Connection closed by peer [127.0.0.1]:5\nmore"))
    hung = _rank_lost(world, RuntimeError("[gloo] Timed out waiting 8000ms for recv operation"))
    assert died == "another rank failed (Connection closed by peer [127.0.0.1]:5)"
    assert hung.startswith("another rank did not answer within 8 s (") and "8000ms" in hung


def test_a_resumed_run_on_real_data_does_not_list_the_synthetic_row_count() -> None:
    """'restored from run.json: --data d, --rows 400000, ...' named rows a run on data never used."""
    given = {key: None for key in ("data", "rows", "epochs")}
    recorded = {"data": "/d", "rows": 400_000, "epochs": 2}
    _, notes = merge_settings(given, recorded, {})
    assert "--data /d" in notes[0] and "--rows" not in notes[0] and "--epochs 2" in notes[0]
    _, notes = merge_settings(given, {**recorded, "data": None}, {}, bound_data=True)  # the spec's data
    assert "--rows" not in notes[0] and "--epochs 2" in notes[0]
    _, notes = merge_settings(given, {**recorded, "data": None}, {})  # synthetic rows: they are the data
    assert "--rows 400000" in notes[0]


def test_the_closing_line_lists_what_the_run_folder_holds(spec: Path, tmp_path: Path) -> None:
    """It always said '(checkpoint.pt, metrics.jsonl, plan.json)', leaving out run.json, spec.json
    and the folders (encoder/, data/, tensorboard/) a run writes."""
    run = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "2", "--rows", "200"])
    assert result.exit_code == 0, result.output
    line = next(x for x in result.output.splitlines() if x.startswith("run folder: "))
    listed = line.split(" (", 1)[1].rstrip(")").split(", ")
    assert listed == sorted(p.name + ("/" if p.is_dir() else "") for p in run.iterdir() if p.name[0] != ".")
    assert {"checkpoint.pt", "run.json", "spec.json", "metrics.jsonl"} <= set(listed), line


def test_a_run_names_the_spec_target_it_does_not_price_and_refuses_a_missing_one(tmp_path: Path) -> None:
    """plan.target was ignored by `flowrec train` without a word, a missing profile file included."""
    text = run_spec("targets", batch_size=32, epochs=1)
    (tmp_path / "h100.yaml").write_text(text + "plan: {target: h100}\n")
    (tmp_path / "nope.yaml").write_text(text + f"plan: {{target: {tmp_path / 'nope.json'}}}\n")
    args = ["--max-steps", "1", "--rows", "200", "--device", "cpu"]
    ran = CliRunner().invoke(app, ["train", str(tmp_path / "h100.yaml"), "--out", str(tmp_path / "a"), *args])
    assert ran.exit_code == 0, ran.output
    assert "plan.target h100 is for `flowrec plan`" in ran.output and "target cpu" in ran.output, ran.output
    given = CliRunner().invoke(app, ["train", str(tmp_path / "h100.yaml"), "--out", str(tmp_path / "b"), *args,
                                     "--target", "h100"])
    assert given.exit_code == 0 and "is for `flowrec plan`" not in given.output, given.output
    refused = CliRunner().invoke(app, ["train", str(tmp_path / "nope.yaml"), "--out", str(tmp_path / "c"), *args])
    assert refused.exit_code == 2 and "nope.json" in refused.output, refused.output
    assert not (tmp_path / "c").exists()


@pytest.mark.parametrize("exitcode, said, status", [
    (-9, "rank 1, was killed by signal 9 (SIGKILL) and wrote no message", 137),
    (4, "rank 1, with status 4 (its message is above)", 4),
])
def test_the_launcher_says_a_rank_killed_by_a_signal_left_no_message(monkeypatch, capsys, tmp_path: Path, exitcode,
                                                                     said, status):
    # `kill -9` of one rank of `flowrec train --nproc 2`: "the first, rank 1, with status -9 (its message
    # is above)" pointed at a message the killed rank never wrote, and the launch exited with status 1
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from flowrec.cli import ranks

    def failing(args):
        raise ChildFailedError("flowrec", {1: ProcessFailure(1, 4242, exitcode, str(tmp_path / "none.json"))})

    monkeypatch.setattr(torch_run, "run", failing)
    assert ranks.run_launcher(["--nproc-per-node=2", "-m", "flowrec", "train", "s.yaml"]) == status
    err = capsys.readouterr().err
    assert f"error: training failed: rank(s) 1 exited; the first, {said}\n" == err


@pytest.mark.parametrize("first, then", [(-9, 4), (2, 4), (-9, 130), (2, -15)])
def test_the_launcher_names_the_rank_that_failed_not_the_one_that_lost_it(monkeypatch, capsys, tmp_path: Path,
                                                                          first, then):
    # `kill -9` of rank 1 of `flowrec train --nproc 2`: rank 0 lost it at once (status 4) and the launcher,
    # seeing both in one poll (torch stamps a rank without an error file in whole seconds), said "the
    # first, rank 0, with status 4 (its message is above)" and exited 4, not 137
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from flowrec.cli import ranks

    def failing(args):
        failures = {0: ProcessFailure(0, 4241, then, str(tmp_path / "none.json")),
                    1: ProcessFailure(1, 4242, first, str(tmp_path / "none.json"))}
        for failure in failures.values():
            failure.timestamp = 1_700_000_000  # one poll of the launcher
        raise ChildFailedError("flowrec", failures)

    monkeypatch.setattr(torch_run, "run", failing)
    status = ranks.run_launcher(["--nproc-per-node=2", "-m", "flowrec", "train", "s.yaml"])
    assert status == (128 + 9 if first == -9 else first)
    err = capsys.readouterr().err
    assert err.startswith("error: training failed: rank(s) 0, 1 exited; the first, rank 1, "), err


def test_the_launcher_names_the_rank_that_timed_out_before_the_hung_rank_it_killed(monkeypatch, capsys,
                                                                                  tmp_path: Path):
    # a hung rank 1 (SIGSTOP): rank 0 stopped after --dist-timeout (status 4, its line names the wait) and
    # the launcher killed rank 1 30 s later: rank 0's failure is the first the launcher saw
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from flowrec.cli import ranks

    def failing(args):
        failures = {0: ProcessFailure(0, 4241, 4, str(tmp_path / "none.json")),
                    1: ProcessFailure(1, 4242, -9, str(tmp_path / "none.json"))}
        failures[0].timestamp, failures[1].timestamp = 1_700_000_000, 1_700_000_030
        raise ChildFailedError("flowrec", failures)

    monkeypatch.setattr(torch_run, "run", failing)
    assert ranks.run_launcher(["--nproc-per-node=2", "-m", "flowrec", "train", "s.yaml"]) == 4
    assert "the first, rank 0, with status 4" in capsys.readouterr().err


def test_a_signal_to_one_rank_is_rank_0s_interrupted_line_not_a_failure(monkeypatch, capsys, tmp_path: Path):
    # `kill PID` (SIGTERM) of rank 1 of `flowrec train --nproc 2`: the ranks agreed to stop, rank 0 saved and
    # said "interrupted: checkpoint saved; continue with ...", then the launcher added "error: training
    # failed: rank(s) 0 exited; the first, rank 0, with status 130 (its message is above)"
    import torch.distributed.run as torch_run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from flowrec.cli import ranks

    def interrupted(args):
        raise ChildFailedError("flowrec", {0: ProcessFailure(0, 4241, 130, str(tmp_path / "none.json"))})

    monkeypatch.setattr(torch_run, "run", interrupted)
    assert ranks.run_launcher(["--nproc-per-node=2", "-m", "flowrec", "train", "s.yaml"]) == 130
    assert capsys.readouterr().err == ""


def test_a_signal_while_the_launcher_starts_is_one_line_and_128_plus_the_signal(monkeypatch, capsys):
    # SIGTERM to `flowrec train --nproc 2` in its first seconds: sent on to torch's launcher before that
    # process had its handlers, it ended by the signal, and the launch exited with status 241 (the
    # sys.exit(-15) of its -15) and no word
    import signal
    import subprocess
    import sys

    from flowrec.cli import ranks

    class Starting:  # torch's launcher, killed by the signal sent on to it before it could handle it
        def __init__(self, cmd, **kwargs):
            self.got = None
            os.kill(os.getpid(), signal.SIGTERM)  # the user's signal, to this process, as the launcher starts

        def poll(self):
            return None if self.got is None else -self.got

        def send_signal(self, sig):
            self.got = sig

        def wait(self):
            return -self.got

    monkeypatch.setattr(subprocess, "Popen", Starting)
    monkeypatch.setattr(sys, "argv", ["flowrec", "train", "s.yaml", "--nproc", "2"])
    assert ranks.launch_ranks(2, 0, None) == 128 + signal.SIGTERM
    assert capsys.readouterr().err == "error: interrupted (SIGTERM) before training started; nothing was trained\n"


def test_a_relative_plan_target_missing_says_it_is_the_specs_and_read_from_the_working_folder(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A spec in dir/ naming `plan: {target: only.json}` beside it (data.path is read from the spec's
    folder) was 'cannot read only.json' from plan and train, naming neither plan.target nor where it
    was looked for. Now both name the spec's plan.target and the working folder it is read from."""
    (tmp_path / "dir").mkdir()
    (tmp_path / "dir" / "t.yaml").write_text(run_spec("rel_target", batch_size=32, epochs=1)
                                             + "plan: {target: only.json}\n")
    (tmp_path / "dir" / "only.json").write_text("{}")  # beside the spec, not in the working folder
    monkeypatch.chdir(tmp_path)
    for argv in (["plan", "dir/t.yaml"], ["train", "dir/t.yaml", "--rows", "100", "--out", "r"]):
        result = CliRunner().invoke(app, argv)
        assert result.exit_code == 2, result.output
        line = result.output.strip().splitlines()[-1]
        assert "the spec's plan.target: cannot read only.json" in line and f"working folder ({tmp_path})" in line, line
    assert not (tmp_path / "r").exists()


def test_the_folder_of_a_distributed_run_is_a_run_folder_and_overwrite_removes_its_shards(tmp_path: Path):
    # `--out RUN --overwrite` of a `--nproc 2` run's folder said "RUN is not empty and is not a flowrec run
    # folder (it holds checkpoint.shards)"; and a new run over a run's folder left the old ranks' shards
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runtime.rundir import clear_run_files

    run = tmp_path / "run"
    for name in ("checkpoint.pt", "run.json", "checkpoint.shards/step000000040-rank0-of2.pt",
                 "best/checkpoint.pt", "best/checkpoint.shards/step000000020-rank1-of2.pt"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_bytes(b"x")
    with pytest.raises(RunFolderError, match="already holds a run"):
        claim_run_folder(run, None, False, "tiny")
    folder, lock = claim_run_folder(run, None, True, "tiny")
    try:
        clear_run_files(folder)
    finally:
        lock.release()
    assert sorted(p.name for p in run.rglob("*") if p.name != ".flowrec.lock") == ["best", "run.json"]


def test_a_python_run_into_a_folder_holding_a_run_names_the_command_that_continues_it(tmp_path: Path, monkeypatch):
    # flowrec.train(spec, out=RUN) of a folder holding a run said "continue it with --resume RUN, or replace it
    # with overwrite=True": flowrec.train took no resume= then (a TypeError); now it names the Python call
    monkeypatch.chdir(tmp_path)
    Path("my spec.yaml").write_text(
        "name: mine\nfeatures:\n  - {name: price, type: dense}\n"
        "  - {name: user, type: categorical, hash_buckets: 64, dim: 4}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: ['@dense', '@sparse'], layers: [4]}\n"
        "heads:\n  - {name: ctr, input: top}\n"
        "optimizer: {dense: {name: adam, lr: 0.01}, sparse: {name: sgd, lr: 0.1}}\ntraining: {batch_size: 64}\n")
    run = Path("runs/first")
    run.mkdir(parents=True)
    files = {"checkpoint.pt": os.urandom(64), "run.json": b"{}"}
    for name, data in files.items():
        (run / name).write_bytes(data)
    with pytest.raises(RunFolderError) as caught:
        flowrec.train("my spec.yaml", out=run, rows=500, max_steps=2)
    line = str(caught.value)
    assert "continue it with `flowrec.train('my spec.yaml', resume='runs/first')`, or replace it with overwrite=True" \
        in line, line
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.name != ".flowrec.lock"} == files
    result = CliRunner().invoke(app, ["train", "my spec.yaml", "--rows", "500", "--out", str(run)])
    assert result.exit_code == 2 and "continue it with --resume runs/first, or replace it with --overwrite" \
        in result.output, result.output  # the command line's own flags, as before


def test_resume_with_another_model_names_what_differs():
    # `--resume RUN` with the batch size or a table changed said only "the spec's model differs from the one
    # the run in RUN was trained with", leaving the user to diff the specs by hand
    import yaml

    from flowrec.runs.changes import changed_model_line
    from flowrec.spec import spec_from_dict
    from flowrec.spec.load import to_dict

    doc = yaml.safe_load(run_spec())
    state = {"spec": json.dumps(to_dict(spec_from_dict(doc)))}
    doc["training"]["batch_size"] = 64
    doc["features"][1]["hash_buckets"] = 60
    doc["modules"][2]["layers"] = [8, 4]
    line = changed_model_line("runs/a", state, spec_from_dict(doc), starting_from=False)
    assert line == ("the spec's model differs from the one the run in runs/a was trained with: tables[user].hash_buckets "
                    "50 in the run, 60 in the spec; modules[top].layers [8] in the run, [8, 4] in the spec; "
                    "training.batch_size 32 in the run, 64 in the spec (compare the spec with runs/a/spec.json)"), line
    doc["modules"].append({"name": "extra", "kind": "mlp", "inputs": ["top"], "layers": [2]})
    doc["heads"][0]["input"] = "extra"
    line = changed_model_line("runs/a", state, spec_from_dict(doc), starting_from=False)
    assert "modules[extra] not there in the run, " in line and line.endswith(
        "; and 2 more (compare the spec with runs/a/spec.json)"), line


def test_the_training_bar_keeps_its_step_count_whole_at_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    """In a log (80 columns) or an 80-column terminal the bar cut its figures: '412/281…' for
    412/28125 steps. Now the bar itself gives way and every figure is whole."""
    import io
    import sys

    from flowrec.runtime.progress import TrainProgress

    for width in (80, 120):
        monkeypatch.setenv("COLUMNS", str(width))
        monkeypatch.setattr(sys, "stderr", io.StringIO())
        bar = TrainProgress(28_125, initial=411)
        bar.update(4096, 0.693147)
        bar.close()
        shown = sys.stderr.getvalue()
        assert "412/28125" in shown and "loss 0.6931" in shown and "samples/s" in shown, shown
        assert "…" not in shown, shown


def test_the_training_bar_shows_a_tiny_loss_as_the_metrics_table_does(monkeypatch: pytest.MonkeyPatch) -> None:
    """A regression head of rates (mse 3e-06) showed 'loss 0.0000' on the bar at every step, as if
    the model were exact, where the metrics table shows 3.2000e-06 since 05e2196."""
    import io
    import sys

    from flowrec.cli.metrics_table import metrics_table
    from flowrec.runtime.progress import TrainProgress

    monkeypatch.setenv("COLUMNS", "120")
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    bar = TrainProgress(10)
    bar.update(64, 3.2e-06)
    bar.close()
    assert "3.2000e-06" in metrics_table({"val": {"mse": 3.2e-06}})[1]
    assert "loss 3.2000e-06" in sys.stderr.getvalue(), sys.stderr.getvalue()


def test_max_restarts_without_nproc_is_refused_not_ignored(spec: Path, tmp_path: Path) -> None:
    # `--max-restarts 2` of one process trained as if it were not there: a failure was not restarted
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(spec), "--rows", "100", "--out", str(out), "-q", "--max-restarts", "2"])
    assert result.exit_code == 2, result.output
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: --max-restarts 2") and "--nproc" in lines[0], result.output
    assert not out.exists()


def test_predict_given_a_stream_folder_names_its_last_days_package(tmp_path: Path) -> None:
    """`flowrec predict RUN ...` of a --follow stream folder said it is no model package and to make
    one with `flowrec export RUN OUT/`, though --follow-export had written one per day under
    RUN/export/ (and exporting the stream folder itself is refused). Now one line names the last
    trained day's package, or, without --follow-export, that day's run to export."""
    stream = tmp_path / "stream"
    (stream / "days" / "d2").mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": ["d1", "d2"], "order": "name", "names": "natural"}))
    rows = tmp_path / "rows.csv"
    rows.write_text("d1,user,label\n1,a,0\n")

    def said() -> str:
        got = runner.invoke(app, ["predict", str(stream), str(rows), "--format", "csv", "--out",
                                  str(tmp_path / "s.parquet")])
        assert got.exit_code == 2 and not (tmp_path / "s.parquet").exists()
        return got.output

    assert f"export a day's run first, e.g. flowrec export {stream / 'days' / 'd2'} OUT/" in said()
    (stream / "export" / "d2").mkdir(parents=True)
    (stream / "export" / "d2" / "manifest.json").write_text("{}")
    assert f"predict with one of them, e.g. {stream / 'export' / 'd2'} (the last of its 2 trained days)" in said()


def test_ctrl_c_while_flowrec_starts_is_one_line(monkeypatch, capsys) -> None:
    """A Ctrl-C in the second flowrec spends importing torch, pyarrow and dask printed a traceback
    through the imports (the `flowrec` command's entry point imported the command line before any
    handler of flowrec's ran). Now `flowrec.__main__.run`, the entry point, ends in one line, 130."""
    import sys

    from flowrec.__main__ import run

    class Interrupted:  # a finder that is 'interrupted' while the command line is imported
        @staticmethod
        def find_spec(name, path=None, target=None):
            if name == "flowrec.cli":
                raise KeyboardInterrupt
            return None

    monkeypatch.delitem(sys.modules, "flowrec.cli")
    monkeypatch.setattr(sys, "meta_path", [Interrupted(), *sys.meta_path])
    with pytest.raises(SystemExit) as stop:
        run()
    assert stop.value.code == 130
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C) while flowrec was starting; nothing was done\n"
    import tomllib

    scripts = tomllib.loads((Path(flowrec.__file__).parents[1] / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["flowrec"] == "flowrec.__main__:run"


def test_rows_given_for_a_run_on_real_data_is_said_to_be_ignored() -> None:
    """`flowrec train specs/movielens.yaml --rows 2000` (or `--data D --rows 2000`) trained on every
    row of the data without a word; on --resume it even said '--rows 2000 overrides the run's ...'."""
    given = {"data": None, "rows": 2000, "epochs": None}
    _, notes = merge_settings(given, None, {}, bound_data=True)
    assert any("--rows 2000 is ignored" in n and "the data the spec binds" in n for n in notes), notes
    _, notes = merge_settings({**given, "data": "/d"}, None, {})
    assert any("--rows 2000 is ignored" in n and "--data /d" in n for n in notes), notes
    _, notes = merge_settings({**given, "data": "/d"}, {"data": "/d", "rows": 400_000, "epochs": 2}, {})
    assert not any("overrides" in n for n in notes) and any("--rows 2000 is ignored" in n for n in notes), notes
    _, notes = merge_settings(given, None, {})  # synthetic rows: --rows is what they are
    assert not any("ignored" in n for n in notes), notes


def test_dask_given_for_a_run_on_synthetic_rows_is_said_to_be_ignored() -> None:
    """`flowrec train SPEC --rows 2000 --dask local` (or a bad scheduler's address) trained on rows
    made in memory without a word, as --dask reads only a dataset's partitions."""
    given = {"data": None, "rows": 2000, "dask": "tcp://10.0.0.5:8786"}
    _, notes = merge_settings(given, None, {})
    assert any("--dask tcp://10.0.0.5:8786 is ignored" in n and "synthetic rows" in n for n in notes), notes
    for data, bound in (("/d", False), (None, True)):  # a dataset: Dask reads it
        _, notes = merge_settings({**given, "data": data, "rows": None}, None, {}, bound_data=bound)
        assert not any("--dask" in n for n in notes), notes


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_lock_file_that_is_a_link_is_refused_and_the_file_it_names_kept(tmp_path: Path, link: str) -> None:
    """A run folder whose .flowrec.lock was a link to another file (planted, or copied with the
    folder): `flowrec train --resume RUN` (or --out) truncated that file and wrote its pid there, a
    file outside the run folder lost. Now the lock is opened without following a link, and a hard
    link (one file under two names) is refused too: one line, the file untouched."""
    from flowrec.runtime.rundir import LOCK_NAME, RunFolderError, RunLock

    victim = tmp_path / "rows.csv"
    victim.write_text("user,label\nu1,1\n")
    run = tmp_path / "run"
    run.mkdir()
    if link == "symbolic":
        (run / LOCK_NAME).symlink_to(victim)
    else:
        os.link(victim, run / LOCK_NAME)
    with pytest.raises(RunFolderError, match=rf"cannot lock run folder .*: its lock file {LOCK_NAME} is a "
                                             rf"{link} link") as caught:
        RunLock.acquire(run)
    assert "\n" not in str(caught.value) and victim.read_text() == "user,label\nu1,1\n"
    (run / LOCK_NAME).unlink()
    lock = RunLock.acquire(run)  # the lock made afresh
    assert (run / LOCK_NAME).read_text() == f"{os.getpid()}\n" and victim.read_text() == "user,label\nu1,1\n"
    lock.release()


def test_a_run_never_writes_its_encoder_into_the_folder_a_link_named(tmp_path: Path) -> None:
    """`flowrec train --out RUN --overwrite` where RUN/encoder was a link to a folder elsewhere
    wrote encoder.json and vocab/ into that folder (rmtree refuses a link, and its error was
    ignored), over what it held. Now the link is removed and RUN/encoder made as a folder."""
    from flowrec.data.encoder_record import ENCODER_FILE
    from flowrec.runs.encoder import adopt_encoder
    from flowrec.testing.specs import csv_spec

    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / ENCODER_FILE).write_text("someone else's")
    run = tmp_path / "run"
    run.mkdir()
    (run / "encoder").symlink_to(elsewhere, target_is_directory=True)
    adopt_encoder(csv_spec("linked"), run, object(), None, resuming=False)  # synthetic rows' encoder
    assert [p.name for p in elsewhere.iterdir()] == [ENCODER_FILE] and (elsewhere / ENCODER_FILE).read_text() == "someone else's"
    assert not (run / "encoder").is_symlink() and (run / "encoder" / ENCODER_FILE).is_file()


@pytest.mark.parametrize("linked", ["best", "checkpoint.shards", "best/checkpoint.shards"])
def test_a_run_folder_whose_checkpoint_folder_is_a_link_is_refused_before_anything_is_removed(
        tmp_path: Path, linked: str) -> None:
    """RUN/best (or a checkpoint.shards folder) as a link to another run's: `train --out RUN
    --overwrite` removed that run's best checkpoint (and its shards and temp files) through the
    link, and a resumed run wrote its best checkpoint there. Now opening the run folder refuses the
    link in one line, before anything is removed or written."""
    from flowrec.runtime.rundir import RunFolderError, clear_run_files, open_folder

    other = tmp_path / "other"
    other.mkdir()
    (other / "checkpoint.pt").write_bytes(b"another run's checkpoint")
    (other / ".ckpt-x.tmp").write_bytes(b"another run's write in flight")
    run = tmp_path / "run"
    (run / linked).parent.mkdir(parents=True, exist_ok=True)
    (run / linked).symlink_to(other, target_is_directory=True)
    with pytest.raises(RunFolderError, match=rf"{linked} is a symbolic link .*: remove the link$"):
        clear_run_files(run) if open_folder(run) else None
    assert sorted(p.name for p in other.iterdir()) == [".ckpt-x.tmp", "checkpoint.pt"]
    (run / linked).unlink()
    open_folder(run).release()  # the lock was released: the folder opens once the link is gone


@pytest.mark.parametrize("key,value,says", [
    ("train_rows", "x", "train_rows must be a non-negative integer, not 'x'"),
    ("init_from", 5, "init_from must be a string, not 5"),
    ("fresh_optimizer", "yes", "fresh_optimizer must be true or false, not 'yes'"),
])
def test_run_json_records_beside_the_flags_are_checked_as_the_flags_are(tmp_path: Path, key, value, says) -> None:
    """run.json's train_rows "x" was read as no record (so --resume's check that its data still
    holds the rows the run started on was off, without a word), init_from 5 was refused as
    '--init-from: no checkpoint at 5' (a flag nobody gave), fresh_optimizer "yes" read as true."""
    from flowrec.runs.settings import REQUIRED, read_run_file
    from flowrec.runtime.rundir import RunFolderError

    doc = {name: None for name in REQUIRED}
    (tmp_path / "run.json").write_text(json.dumps({**doc, key: value}))
    with pytest.raises(RunFolderError, match=rf"run\.json is damaged: {re.escape(says)}$"):
        read_run_file(tmp_path)
    (tmp_path / "run.json").write_text(json.dumps(doc))
    assert read_run_file(tmp_path) == doc


@pytest.mark.parametrize("damage", ["truncated", "replaced"])
def test_a_damaged_vocabulary_of_the_run_is_refused_by_resume_and_eval(tmp_path: Path, damage: str) -> None:
    """A damaged RUN/encoder/vocab file (truncated, or another table's or run's) was noticed by
    export and --encoder-from only: `train --resume` trained on and `flowrec eval RUN` scored
    without a word. Now both refuse it in one line naming the file, as export does."""
    import random

    rng = random.Random()
    (tmp_path / "raw.csv").write_text("price,user,item,label\n" + "".join(
        f"{rng.random():.3f},u{rng.randrange(50)},i{rng.randrange(20)},{rng.randrange(2)}\n" for _ in range(200)))
    spec = tmp_path / "s.yaml"
    spec.write_text("""
name: vocab_damage
features:
  - {name: price, type: dense}
  - {name: user, type: categorical, vocab: 60, dim: 4}
  - {name: item, type: categorical, vocab: 30, dim: 4}
modules:
  - {name: m, kind: mlp, inputs: ["@dense", "@sparse"], layers: [4]}
heads:
  - {name: h, input: m, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 32, epochs: 1, seed: 0}
data: {format: csv, path: raw.csv, options: {test_fraction: 0.2}}
""")
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "2", "-q", "--device", "cpu"])
    assert made.exit_code == 0, made.output
    assert runner.invoke(app, ["eval", str(run)]).exit_code == 0
    vocab = run / "encoder" / "vocab" / "user.parquet"
    if damage == "truncated":
        vocab.write_bytes(vocab.read_bytes()[: vocab.stat().st_size // 2])
    else:
        vocab.write_bytes((run / "encoder" / "vocab" / "item.parquet").read_bytes())
    for args in (["eval", str(run)], ["train", str(spec), "--resume", str(run), "--max-steps", "4", "-q"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert str(vocab) in result.output.strip().splitlines()[-1] and "Traceback" not in result.output


def test_eval_of_a_run_on_synthetic_rows_scores_the_rows_it_evaluated_on(spec: Path, tmp_path: Path) -> None:
    """`flowrec eval RUN` of a run trained on synthetic rows (`train SPEC --rows N`) said only
    'give --data DIR', and no dataset fits: `data synth --seed S` draws another hidden model (AUC
    about 0.4), and its default seed the training rows again. Now eval (and `Run.evaluate()`) draw
    the run's own evaluation rows again from its seed: the metrics are its final evaluation's."""
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--rows", "700", "--seed", "5", "--out", str(run), "-q",
                               "--device", "cpu"])
    assert made.exit_code == 0, made.output
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"final": true' in line][-1]["metrics"]
    scored = runner.invoke(app, ["eval", str(run), "--json", str(tmp_path / "m.json"), "-q"])
    assert scored.exit_code == 0, scored.output
    assert json.loads((tmp_path / "m.json").read_text())["ctr"] == pytest.approx(final["ctr"])
    assert dict(flowrec.load(run).evaluate())["ctr"] == pytest.approx(final["ctr"])


def test_data_inspect_of_a_run_or_package_names_what_to_inspect(spec: Path, tmp_path: Path) -> None:
    """`flowrec data inspect RUN` (or PKG) said 'neither an encoded dataset nor a folder of day
    partitions', as if the folder were not flowrec's; now one line says it is a run's folder and
    names the dataset it trained on (or that it trained on synthetic rows), or that a package
    holds no rows."""
    data = _synth(spec, tmp_path / "d")
    for run, extra in ((tmp_path / "a", ["--data", str(data)]), (tmp_path / "b", ["--rows", "200"])):
        made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "1", "-q", *extra])
        assert made.exit_code == 0, made.output
    assert runner.invoke(app, ["export", str(tmp_path / "a"), str(tmp_path / "pkg"), "-q"]).exit_code == 0
    for folder, says in ((tmp_path / "a", f"training run's folder, not a dataset: inspect the data it trained on, {data}"),
                         (tmp_path / "b", "it trained on synthetic rows"),
                         (tmp_path / "pkg", "is a model package, not a dataset")):
        result = runner.invoke(app, ["data", "inspect", str(folder)])
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert says in result.output.strip().splitlines()[-1], result.output
    assert runner.invoke(app, ["data", "inspect", str(data)]).exit_code == 0


def test_a_run_or_package_given_as_data_says_what_it_is_not_convert_it(tmp_path: Path) -> None:
    """`eval RUN --data RUN`, `train --data RUN`, `data profile SPEC PKG` said the folder 'is not a
    flowrec dataset (no _flowrec.json); convert it first with flowrec data convert', which the
    folder of a run or package cannot be; now one line says what it is and names the data a run on
    bound data encoded."""
    spec = _bound_csv_spec(tmp_path)
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--out", str(run), "--max-steps", "1", "-q"])
    assert made.exit_code == 0, made.output
    assert runner.invoke(app, ["export", str(run), str(tmp_path / "pkg"), "-q"]).exit_code == 0
    for args, says in ((["eval", str(run), "--data", str(run)], f"a training run's folder, not a dataset: give the "
                        f"data it encoded, {run / 'data'}"),
                       (["train", str(spec), "--data", str(run), "--out", str(tmp_path / "r2"), "-q"],
                        "a training run's folder, not a dataset"),
                       (["data", "profile", str(spec), str(tmp_path / "pkg"), "-q"], "is a model package, not a dataset")):
        result = runner.invoke(app, args)
        assert result.exit_code == 2 and "Traceback" not in result.output and "convert it first" not in result.output
        assert says in result.output.strip().splitlines()[-1], result.output


def test_eval_of_a_synthetic_retrieval_run_leaves_out_the_pairs_it_trained_on(tmp_path: Path) -> None:
    """`flowrec eval RUN` of a run on synthetic rows whose retrieval head has exclude_seen ranked
    each user's training items too, where the run's own evaluation left them out (other metrics);
    now it leaves out the pairs of the run's synthetic training rows, drawn again with them."""
    spec = tmp_path / "tt.yaml"
    spec.write_text("""
name: tt
features:
  - {name: user_id, type: categorical, vocab: 50, dim: 8}
  - {name: item_id, type: categorical, vocab: 40, dim: 8}
modules:
  - {name: score, kind: similarity, inputs: [user_id, item_id], metric: dot}
heads:
  - {name: retrieve, input: score, task: retrieval, negatives: {kind: in_batch}, exclude_seen: true, top_k: [10]}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.01}
training: {batch_size: 128, epochs: 1, seed: 0, eval_group_by: user_id}
""")
    run = tmp_path / "run"
    made = runner.invoke(app, ["train", str(spec), "--rows", "1500", "--out", str(run), "-q", "--device", "cpu"])
    assert made.exit_code == 0, made.output
    final = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()
             if '"final": true' in line][-1]["metrics"]["retrieve"]
    scored = runner.invoke(app, ["eval", str(run), "--json", "-", "-q"])
    assert scored.exit_code == 0, scored.output
    assert json.loads(scored.stdout)["retrieve"] == pytest.approx(final)


def test_more_ranks_than_the_memory_holds_are_refused_before_the_launch(spec: Path, tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --nproc 1000000` had torch's launcher make a log folder per rank for minutes (572,295
    of them in 9 minutes), deaf to timeout's SIGTERM, before any rank started; now ranks that cannot
    all start in the memory available (each at least this process's size) are one line."""
    from flowrec.cli import ranks

    launched = []
    monkeypatch.setattr(ranks, "launch_ranks", lambda nproc, *args: launched.append(nproc) or 0)
    shown = runner.invoke(app, ["train", str(spec), "--nproc", "1000000", "--out", str(tmp_path / "run"), "-q"])
    lines = shown.output.strip().splitlines()
    assert shown.exit_code == 2 and len(lines) == 1 and lines[0].startswith("error: --nproc 1000000: "), shown.output
    assert "give fewer ranks" in lines[0] and launched == [] and not (tmp_path / "run").exists()
    fits = runner.invoke(app, ["train", str(spec), "--nproc", "2", "--out", str(tmp_path / "run"), "-q"])
    assert fits.exit_code == 0 and launched == [2], fits.output


def test_a_launch_stopped_before_its_ranks_wrote_leaves_no_run_folder(spec: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """`flowrec train SPEC --nproc 2` (no --out) stopped before rank 0 claimed the folder the launcher
    named (SIGTERM in its first seconds) left `runs/hostile` holding its lock alone, and the next run
    took `runs/hostile-2`; the folder goes when no rank wrote in it, and stays when one did."""
    from flowrec.cli import ranks

    monkeypatch.chdir(tmp_path)
    named = []

    def stopped(nproc, max_restarts, folder, *args):
        named.append(folder)
        return 143

    monkeypatch.setattr(ranks, "launch_ranks", stopped)
    for _ in range(2):
        shown = runner.invoke(app, ["train", str(spec), "--nproc", "2", "-q"])
        assert shown.exit_code == 143, shown.output
    assert named == [Path("runs") / "hostile"] * 2 and list((tmp_path / "runs").iterdir()) == []

    def wrote(nproc, max_restarts, folder, *args):
        (folder / "run.json").write_text("{}")  # as rank 0 writes it
        return 0

    monkeypatch.setattr(ranks, "launch_ranks", wrote)
    assert runner.invoke(app, ["train", str(spec), "--nproc", "2", "-q"]).exit_code == 0
    assert (tmp_path / "runs" / "hostile" / "run.json").is_file()


def test_data_the_ranks_cannot_read_is_refused_before_the_launch(spec: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --nproc 2 --data nope` (or a dataset of another spec, or --eval-data missing) started
    both ranks, and each said 'dataset directory not found: nope' 16-37 s later, then the launcher a
    third time; now one line, the one a process says, before any rank starts."""
    from flowrec.cli import ranks

    launched = []
    monkeypatch.setattr(ranks, "launch_ranks", lambda nproc, *args: launched.append(nproc) or 0)
    data = _synth(spec, tmp_path / "d")
    other = tmp_path / "o.yaml"
    other.write_text(spec.read_text().replace("name: hostile", "name: other", 1).replace("hash_buckets: 50,", "hash_buckets: 51,", 1))
    (tmp_path / "empty").mkdir()
    cases = [(["--data", str(tmp_path / "nope")], f"error: dataset directory not found: {tmp_path / 'nope'}"),
             (["--data", str(data), "--eval-data", str(tmp_path / "gone")],
              f"error: dataset directory not found: {tmp_path / 'gone'}"),
             (["--data", str(tmp_path / "empty")], f"error: {tmp_path / 'empty'} is not a flowrec dataset")]
    for args, said in cases:
        shown = runner.invoke(app, ["train", str(spec), "--nproc", "2", *args, "--out", str(tmp_path / "run"), "-q"])
        lines = shown.output.strip().splitlines()
        assert shown.exit_code == 2 and len(lines) == 1 and lines[0].startswith(said), shown.output
    shown = runner.invoke(app, ["train", str(other), "--nproc", "2", "--data", str(data), "--out", str(tmp_path / "run"),
                                "-q"])
    assert shown.exit_code == 2 and f"dataset {data} was encoded for spec 'hostile'" in shown.output, shown.output
    assert launched == [] and not (tmp_path / "run").exists()
    fits = runner.invoke(app, ["train", str(spec), "--nproc", "2", "--data", str(data), "--out", str(tmp_path / "run"),
                               "-q"])
    assert fits.exit_code == 0 and launched == [2], fits.output


@pytest.mark.parametrize("policy", ["static_hot", "lookahead"])
def test_a_cache_policy_ranks_cannot_plan_is_refused_before_the_launch(spec: Path, tmp_path: Path, policy: str,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`train --nproc 2 --cache static_hot` (distributed.md: a planning error) started both ranks,
    and each refused it in a line of its own ('error: rank 0: pass 'cache' failed (passes before it:
    pack, shard): ValueError: ...'), then the launcher a third, 15 s later; now one line before any
    rank starts, for --cache as for the spec's plan.cache."""
    from flowrec.cli import ranks

    launched = []
    monkeypatch.setattr(ranks, "launch_ranks", lambda nproc, *args: launched.append(nproc) or 0)
    shown = runner.invoke(app, ["train", str(spec), "--nproc", "2", "--cache", policy, "--out", str(tmp_path / "run"),
                                "-q"])
    lines = shown.output.strip().splitlines()
    assert shown.exit_code == 2 and len(lines) == 1, shown.output
    assert lines[0].startswith("error: --nproc 2 with --cache: "), shown.output
    assert f"{policy} is not yet supported for sharded groups" in lines[0] and "pass 'cache'" not in lines[0]
    in_spec = tmp_path / "c.yaml"
    in_spec.write_text(spec.read_text() + f"\nplan: {{cache: {policy}}}\n")
    shown = runner.invoke(app, ["train", str(in_spec), "--nproc", "2", "--out", str(tmp_path / "run"), "-q"])
    assert shown.exit_code == 2 and "with the spec's plan.cache" in shown.output, shown.output
    assert launched == [] and not (tmp_path / "run").exists()
    fits = runner.invoke(app, ["train", str(in_spec), "--nproc", "2", "--cache", "auto", "--out", str(tmp_path / "run"),
                               "-q"])
    assert fits.exit_code == 0 and launched == [2], fits.output


def test_a_loaded_runs_undefined_metrics_are_nan_as_a_trained_runs(tmp_path: Path) -> None:
    """metrics.jsonl writes an undefined metric (the AUC of evaluation labels all 0) as null, and
    flowrec.load(RUN).metrics gave it as None where the Run flowrec.train returned, and evaluate(),
    give NaN: `run.metrics["ctr"]["auc"] > 0.7` was a TypeError on a loaded run only."""
    import math
    import types

    from flowrec.api import Run

    record = {"event": "eval", "step": 4, "final": True,
              "metrics": {"ctr": {"auc": None, "logloss": 0.75, "samples": 88}}}
    (tmp_path / "metrics.jsonl").write_text(json.dumps(record) + "\n", encoding="utf-8")
    run = Run(spec=None, run_dir=tmp_path, result=None, trained=types.SimpleNamespace(step=4))
    ctr = run.metrics["ctr"]
    assert isinstance(ctr["auc"], float) and math.isnan(ctr["auc"]) and not ctr["auc"] > 0.7
    assert ctr["logloss"] == 0.75 and ctr["samples"] == 88


@pytest.mark.parametrize("classes", [5, 6])
def test_an_accuracy_at_k_covering_the_classes_that_occur_is_warned_of(tmp_path: Path, classes: int) -> None:
    """A 6-class head has k = 5; evaluated on rows of 5 classes every label is among the top 5 once
    the model ranks the sixth (which never occurs) last: accuracy_at_k was 1.0 without a word. Now
    train's evaluations, `flowrec eval` and `Run.evaluate` warn, naming k and the classes (rows of
    all 6 classes: no warning); the metrics report `classes`, the classes the rows hold."""
    rows = ["id,user,genre"] + [f"{i},u{i % 9},{i % classes}" for i in range(300)]  # each row its own (the split
    # draws a row's side from its values: 18 distinct rows were 18 draws)
    (tmp_path / "raw.csv").write_text("\n".join(rows) + "\n")
    spec = tmp_path / "mc.yaml"
    spec.write_text(
        "name: mc_small\n"
        "features:\n  - {name: user, type: categorical, vocab: 20, dim: 4}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: [user], layers: [8]}\n"
        "heads:\n  - {name: genre, input: top, task: multiclass, num_classes: 6, label: genre}\n"
        "data: {format: csv, path: raw.csv, label: genre, options: {test_fraction: 0.2}}\n"
        "training: {batch_size: 32, epochs: 1, seed: 0}\n")
    warning = re.compile(r"warning: head genre ranks the top 5 classes for accuracy_at_k, and its evaluation rows "
                         r"hold 5 classes")
    result = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "run"), "--max-steps", "2", "-q"])
    assert result.exit_code == 0, result.output
    assert len(warning.findall(result.output)) == (classes == 5), result.output
    result = runner.invoke(app, ["eval", str(tmp_path / "run"), "--json", "-"])
    assert result.exit_code == 0, result.output
    assert len(warning.findall(result.output)) == (classes == 5), result.output
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        metrics = flowrec.load(tmp_path / "run").evaluate()
    said = [str(w.message) for w in caught if "accuracy_at_k" in str(w.message)]
    assert len(said) == (classes == 5) and metrics["genre"]["classes"] == classes, said
    result = runner.invoke(app, ["eval", str(tmp_path / "run"), "--json", "-"])
    assert f'"classes": {classes},' in result.stdout and '"k": 5,' in result.stdout, result.stdout  # not 5.0
    log = tmp_path / "run" / "metrics.jsonl"
    assert f'"classes": {classes},' in log.read_text() and '"k": 5,' in log.read_text()
    log.write_text(log.read_text().replace('"k": 5,', '"k": 5.0,'))  # as a flowrec of before 2026-12-06 wrote it
    assert type(flowrec.load(tmp_path / "run").metrics["genre"]["k"]) is int


@pytest.mark.parametrize("given", ["rows.parquet", "rows"])
def test_a_spec_bound_to_raw_parquet_is_not_told_to_remove_it(tmp_path: Path, given: str) -> None:
    """`data.format: parquet` binds an encoded dataset, the user's own; bound to raw Parquet rows (a
    file, a folder) the refusal ended 'ROWS is flowrec's encoding of the spec's data: remove ROWS to
    encode the spec's data again', advice to delete the user's data. Now it names the problem only."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / given
    if given == "rows":
        path.mkdir()
    pq.write_table(pa.table({"user": ["a", "b"], "clicked": [0, 1]}), path / "a.parquet" if given == "rows" else path)
    spec = tmp_path / "s.yaml"
    spec.write_text(
        "name: bound_pq\n"
        "features:\n  - {name: user, type: categorical, hash_buckets: 20, dim: 4}\n"
        "modules:\n  - {name: top, kind: mlp, inputs: [user], layers: [4]}\n"
        f"heads:\n  - {{name: ctr, input: top}}\ndata: {{format: parquet, path: {given}, label: clicked}}\n"
        "training: {batch_size: 8, epochs: 1}\n")
    result = runner.invoke(app, ["train", str(spec), "--out", str(tmp_path / "run"), "--max-steps", "1", "-q"])
    assert result.exit_code == 2 and result.output.count("error:") == 1, result.output
    assert "flowrec data convert" in result.output and "remove" not in result.output, result.output
    assert path.exists()


def test_a_device_budget_given_again_in_another_unit_is_no_change_on_resume() -> None:
    """`train --resume RUN --device-budget 1024MiB` of a run started with --device-budget 1GiB was
    refused as a plan flag that 'would not change' the plan (e57b95b compared the texts), and the
    notes said it overrides the run's 1GiB; the same bytes are the recorded setting."""
    from flowrec.cli.train_cmds import _refuse_plan_flags

    recorded = {"device_budget": "1GiB"}
    _refuse_plan_flags({"device_budget": "1024MiB"}, recorded, None)  # no exit: the same budget
    _, notes = merge_settings({"device_budget": "1024MiB"}, recorded, {})
    assert not [n for n in notes if "overrides" in n], notes
    with pytest.raises(typer.Exit):  # another budget is still refused
        _refuse_plan_flags({"device_budget": "2GiB"}, recorded, None)
    _, notes = merge_settings({"device_budget": "2GiB"}, recorded, {})
    assert [n for n in notes if "--device-budget 2GiB overrides" in n], notes


def test_rows_given_to_train_with_data_is_warned_of_as_the_cli_does(spec: Path, tmp_path: Path) -> None:
    """flowrec.train(spec, data=D, rows=2000) trained on every row of D without a word, where
    `flowrec train --rows 2000 --data D` says --rows is ignored since 612ed80; now a UserWarning
    says so (rows alone, on synthetic data, is none)."""
    data = _synth(spec, tmp_path / "d")
    with pytest.warns(UserWarning, match=r"rows=150 is ignored: .*every row of data="):
        flowrec.train(spec, data=data, rows=150, max_steps=1, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        flowrec.train(spec, rows=150, max_steps=1, progress=False)  # synthetic rows: it counts
        flowrec.train(spec, data=data, max_steps=1, progress=False)  # not given


def test_resuming_a_run_whose_recorded_data_is_gone_names_the_flag(spec: Path, tmp_path: Path) -> None:
    """--resume RUN of a run trained with --data D (or --eval-data E) after D was moved said only
    'dataset directory not found: D', a path not on the command line; now the line names the flag
    run.json recorded it for and the way on, giving it again where the dataset is now."""
    data, run = _synth(spec, tmp_path / "d"), tmp_path / "run"
    first = runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(run), "--max-steps", "1", "-q"])
    assert first.exit_code == 0, first.output
    moved = data.rename(tmp_path / "moved")
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "2", "-q"])
    assert result.exit_code == 2, result.output
    assert f"was trained with --data {data}, which is gone" in result.output and "give --data DIR" in result.output
    result = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--data", str(moved), "--max-steps", "2",
                                 "-q"])
    assert result.exit_code == 0, result.output


def test_eval_with_data_given_reads_no_run_json_where_nothing_is_left_out(spec: Path, tmp_path: Path) -> None:
    """`flowrec eval RUN --data D` of a run whose run.json was damaged was refused ('RUN/run.json is
    damaged ...; the run cannot be resumed'), though only a retrieval head with exclude_seen needs
    the run's recorded training data; now eval (and Run.evaluate) read run.json only for such a head."""
    data, run = _synth(spec, tmp_path / "d"), tmp_path / "run"
    first = runner.invoke(app, ["train", str(spec), "--data", str(data), "--out", str(run), "--max-steps", "1", "-q"])
    assert first.exit_code == 0, first.output
    (run / "run.json").write_text("{bad")
    result = runner.invoke(app, ["eval", str(run), "--data", str(data), "--json", "-"])
    assert result.exit_code == 0, result.output
    scored = json.loads(result.stdout)
    again = flowrec.load(run).evaluate(data)
    assert {h: again[h]["samples"] for h in again} == {h: scored[h]["samples"] for h in scored}


@pytest.mark.parametrize("how", ["--data DIR", "data="])
def test_scoring_a_run_whose_run_json_is_damaged_asks_for_data(tmp_path: Path, how: str) -> None:
    """flowrec eval RUN (Run.evaluate()) of a run whose run.json was damaged said only that the run
    cannot be resumed, where eval RUN --data DIR scores it; now the line says to give the data."""
    from flowrec.data.layout import DataError
    from flowrec.runs.recorded import eval_data_to_score, synthetic_rows
    from flowrec.spec.load import load_spec

    run = tmp_path / "R"
    run.mkdir()
    (run / "run.json").write_text("{bad")
    spec = load_spec(Path(__file__).resolve().parents[2] / "specs" / "wide_deep.yaml")
    for score in (lambda: synthetic_rows(run, spec, how), lambda: eval_data_to_score(run, how)):
        with pytest.raises(DataError, match=rf"run\.json is damaged .*: give {re.escape(how)}$"):
            score()


def test_a_run_whose_spec_json_nests_too_deep_is_read_as_unreadable(tmp_path):
    """`eval --group-by F` and a run's bound data read RUN/spec.json before the checkpoint, by
    json.loads: a spec.json nested thousands of levels deep was a RecursionError traceback. It is
    read as every JSON document flowrec reads (depth-bounded): unreadable, so the checkpoint's
    own spec decides, as for a missing spec.json; a readable one still answers."""
    import random

    from flowrec.runs.recorded import _bound_data, group_by_problem

    depth = random.randint(20_000, 60_000)
    (tmp_path / "spec.json").write_text("[" * depth + "]" * depth)
    assert group_by_problem(tmp_path, "user") is None and _bound_data(tmp_path) is None
    feature = random.choice(["genres", "tags"])
    (tmp_path / "spec.json").write_text(json.dumps({
        "features": [{"name": "user", "type": "categorical"},
                     {"name": feature, "type": "categorical", "max_len": 4}],
        "data": {"path": "raw.csv", "format": "csv"}}))
    assert "multi-hot" in group_by_problem(tmp_path, feature) and group_by_problem(tmp_path, "user") is None
    assert _bound_data(tmp_path) == {"path": "raw.csv", "format": "csv"}
