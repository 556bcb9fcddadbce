"""What a hostile user found walking the README, one test per defect (each fails on the code before
its fix)."""
from __future__ import annotations

import sys
import threading
from pathlib import Path
from typing import Callable

import pytest

from flowrec.data import sources
from flowrec.data.error_log import ErrorLog
from flowrec.testing.processes import run_bounded
from flowrec.testing.specs import csv_spec


def _csv(tmp_path: Path, rows: list[str], header: str = "price,user,clicked") -> Path:
    path = tmp_path / "rows.csv"
    path.write_text("\n".join([header, *rows]) + "\n", encoding="utf-8")
    return path


def test_keep_of_a_missing_column_lists_the_files_columns_not_the_readers_own(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from flowrec.cli import predict_cmd
    from flowrec.serving import predict as serving_predict

    path = _csv(tmp_path, ["1.5,u1,0"])

    class Model:
        items = None
        heads = ["ctr"]

    monkeypatch.setattr(serving_predict, "load_model", lambda p: Model())
    monkeypatch.setattr(predict_cmd, "_raw_chunks", lambda *a: (
        sources.read_csv(path, {}, ErrorLog("fail", str(path)), {"price", "clicked"}), ErrorLog("fail", str(path))))
    with pytest.raises(ValueError, match="--keep nope: no such column") as info:
        predict_cmd._score(tmp_path / "pkg", path, tmp_path / "out.parquet", None, ["nope"], "fail", True)
    assert str(info.value).endswith("(has price, user, clicked)")


def _raised_within(call: Callable[[], object], seconds: float = 60.0) -> BaseException | None:
    """What `call` raised (None: nothing), failing the test when it runs past `seconds` (a hang)."""
    box: dict[str, BaseException | None] = {}

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # handed to the test
            box["raised"] = exc
        else:
            box["raised"] = None

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(seconds)
    assert "raised" in box, f"still running after {seconds} s: a hang"
    return box["raised"]


def _spec(**data: object) -> object:
    return csv_spec("walk", **data)


@pytest.mark.parametrize("rows_per_file", [0, -3])
def test_convert_with_no_rows_per_file_is_one_line_not_a_hang(tmp_path: Path, rows_per_file: int) -> None:
    """`data convert --rows-per-file 0` looped forever writing empty slices (a negative count too)."""
    from flowrec.data.convert import convert
    from flowrec.data.layout import DataError

    path = _csv(tmp_path, ["1.5,u1,0", "2.5,u2,1"])
    raised = _raised_within(lambda: convert(_spec(), "csv", [path], tmp_path / "out", rows_per_file=rows_per_file))
    assert isinstance(raised, DataError) and str(raised) == f"rows per file must be at least 1, not {rows_per_file}"
    assert not (tmp_path / "out").exists() and [p.name for p in tmp_path.iterdir()] == ["rows.csv"]


def test_synth_with_no_rows_per_file_is_one_line_not_a_hang(tmp_path: Path) -> None:
    from flowrec.data.layout import DataError
    from flowrec.data.synth import synth_dataset

    raised = _raised_within(lambda: synth_dataset(_spec(), tmp_path / "out", 10, rows_per_file=0))
    assert isinstance(raised, DataError) and str(raised) == "rows per file must be at least 1, not 0"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("fraction", [1.5, -0.1, float("nan"), 1.0, "a third"])
def test_a_test_fraction_outside_0_1_names_the_option(tmp_path: Path, fraction: object) -> None:
    """1.5, -0.1 and NaN were reported as an empty train or test split ("change test_fraction or
    split_seed, or convert more rows"); the same from the spec's data.options."""
    from flowrec.data.convert import convert
    from flowrec.data.layout import DataError

    path = _csv(tmp_path, [f"{i}.5,u{i},{i % 2}" for i in range(40)])
    with pytest.raises(DataError, match="test_fraction must be a number at least 0 and below 1"):
        convert(_spec(), "csv", [path], tmp_path / "out", options={"test_fraction": fraction})
    if fraction != fraction:  # NaN in a spec is refused as the spec is read, naming its path (SpecError)
        from flowrec.spec import SpecError

        with pytest.raises(SpecError, match=r"data\.options\.test_fraction"):
            _spec(options={"test_fraction": fraction})
    else:
        with pytest.raises(DataError, match="test_fraction must be a number at least 0 and below 1"):
            convert(_spec(options={"test_fraction": fraction}), "csv", [path], tmp_path / "out2")
    assert not (tmp_path / "out").exists() and not (tmp_path / "out2").exists()


@pytest.mark.parametrize("fraction", [0.0, 0.25])
def test_a_test_fraction_in_0_1_still_converts(tmp_path: Path, fraction: float) -> None:
    from flowrec.data.convert import convert

    path = _csv(tmp_path, [f"{i}.5,u{i},{i % 2}" for i in range(40)])
    report = convert(_spec(), "csv", [path], tmp_path / "out", options={"test_fraction": fraction})
    assert report.rows == 40 and (sum(report.split.values()) == 40 if fraction else not report.split)


@pytest.mark.parametrize("seed", [-5, 1 << 64, "abc", 2.5, True])
def test_a_split_seed_outside_the_unsigned_64_bit_range_names_the_option(tmp_path: Path, seed: object) -> None:
    """`--split-seed -5` was an OverflowError traceback (exit 1); text one line naming no option."""
    from flowrec.data.convert import convert
    from flowrec.data.layout import DataError

    path = _csv(tmp_path, [f"{i}.5,u{i},{i % 2}" for i in range(40)])
    with pytest.raises(DataError, match="split_seed must be an integer from 0 to 2\\^64-1"):
        convert(_spec(), "csv", [path], tmp_path / "out", options={"test_fraction": 0.25, "split_seed": seed})
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("seed", [0, 7, "7", 7.0, (1 << 64) - 1])
def test_a_split_seed_in_range_splits_as_before(tmp_path: Path, seed: object) -> None:
    from flowrec.data.convert import convert

    path = _csv(tmp_path, [f"{i}.5,u{i},{i % 2}" for i in range(40)])
    report = convert(_spec(), "csv", [path], tmp_path / "out", options={"test_fraction": 0.25, "split_seed": seed})
    assert report.rows == 40 and sum(report.split.values()) == 40 and report.split["test"] > 0


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), float("-inf")])
def test_synth_refuses_a_non_finite_zipf_exponent(tmp_path: Path, alpha: float) -> None:
    """`data synth --alpha nan` wrote a dataset whose every id was one row (inf: rank 0), silently."""
    from flowrec.data.layout import DataError
    from flowrec.data.synth import SynthConfig, synth_dataset

    with pytest.raises(DataError, match="--alpha must be a finite number"):
        synth_dataset(_spec(), tmp_path / "out", 10, SynthConfig(alpha=alpha))
    assert not (tmp_path / "out").exists()


def test_zipf_ranks_of_a_steep_negative_exponent_stay_in_range_and_others_are_unchanged() -> None:
    """alpha -1000 was an OverflowError traceback (`data synth --alpha -1000`); ranks stay in 0..n-1."""
    import warnings

    import numpy as np

    from flowrec.data.synth import zipf_ranks

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ranks = zipf_ranks(np.random.default_rng(3), 1000, 5000, -1000.0)
    assert ranks.min() >= 0 and ranks.max() == 999
    for alpha in (0.3, 1.0, 1.1, 2.5):  # the former expression, on the same draws: equal ranks
        u = np.random.default_rng(5).random(5000)
        e = 1.0 - alpha
        k = np.exp(u * np.log(1001.0)) if alpha == 1.0 else (u * (1001.0 ** e - 1.0) + 1.0) ** (1.0 / e)
        before = np.minimum(k.astype(np.int64) - 1, 999)
        np.testing.assert_array_equal(zipf_ranks(np.random.default_rng(5), 1000, 5000, alpha), before)


def test_a_streaming_csv_read_marks_the_process_to_end_without_the_teardown(tmp_path, monkeypatch):
    """Arrow's IO threads may release the reader's Python row handler during interpreter shutdown
    (exit 134 about 1 run in 20-40, after a correct result): a CSV read marks the process."""
    from flowrec.data import csv_release, sources
    from flowrec.data.error_log import ErrorLog

    monkeypatch.setattr(csv_release, "_HOOKED", [False])
    assert sources.arrow_threads_may_hold_python() is False
    path = tmp_path / "rows.csv"
    path.write_text("label,a,b\n1,x,3.5\n0,y\n1,z,-2\n")  # the second row malformed: the handler runs
    log = ErrorLog("skip")
    rows = sum(t.num_rows for t in sources.read_csv(path, {}, log, {"label", "b"}))
    assert rows == 2
    assert sources.arrow_threads_may_hold_python() is True


@pytest.mark.parametrize("argv, status", [(["--version"], 0), (["validate", "no/such/spec.yaml"], 2)])
def test_the_command_line_ends_without_the_teardown_after_a_csv_read(monkeypatch, capsys, argv, status):
    """After a CSV read the command's exit status and output are kept and the process ends at
    once (`os._exit`); without one it exits as before (SystemExit, the teardown runs)."""
    import flowrec.cli as cli
    from flowrec.data import csv_release, sources  # noqa: F401  (cli.main looks at the loaded reader module)

    class Ended(Exception):
        pass

    ended = []

    def fake_exit(code):
        ended.append(code)
        raise Ended

    import os

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(sys, "argv", ["flowrec", *argv])
    monkeypatch.setattr(csv_release, "_HOOKED", [True])
    with pytest.raises(Ended):
        cli.main()
    assert ended == [status]
    monkeypatch.setattr(csv_release, "_HOOKED", [False])
    with pytest.raises(SystemExit) as exc:
        cli.main()
    assert (exc.value.code or 0) == status and ended == [status]


def test_exporting_a_stream_folder_names_the_day_run_to_export(tmp_path: Path) -> None:
    """A --follow stream folder has no checkpoint of its own: export names its last trained day's
    run folder (it said only "no checkpoint at STREAM/checkpoint.pt"); nothing is written."""
    import json

    from typer.testing import CliRunner

    from flowrec.cli import app

    stream = tmp_path / "stream"
    days = ["2026-11-01", "2026-11-02", "2026-11-03"]
    for day in days:
        (stream / "days" / day).mkdir(parents=True)
    (stream / "follow.json").write_text(json.dumps({"days": days, "order": "name"}))
    out = tmp_path / "pkg"
    result = CliRunner().invoke(app, ["export", str(stream), str(out)])
    assert result.exit_code == 2
    text = " ".join(result.output.split())
    assert str(stream / "days" / "2026-11-03") in text and "3 trained days" in text
    assert not out.exists()
    (stream / "follow.json").write_text(json.dumps({"days": [], "order": "name"}))
    result = CliRunner().invoke(app, ["export", str(stream), str(out)])
    assert result.exit_code == 2 and "trained no day yet" in " ".join(result.output.split())


def _walk_csv_spec(tmp_path: Path) -> Path:
    """A tiny CSV-bound spec (price, user, clicked) for the line-break tests."""
    spec = tmp_path / "walk.yaml"
    spec.write_text("name: walk\nfeatures:\n  - {name: price, type: dense}\n"
                    "  - {name: user, type: categorical, hash_buckets: 64, dim: 4}\n"
                    "modules:\n  - {name: top, kind: mlp, inputs: ['@dense', '@sparse'], layers: [4]}\n"
                    "heads:\n  - {name: ctr, input: top}\n"
                    "data: {format: csv, path: x.csv, label: clicked}\n"
                    "optimizer: {dense: {name: adam, lr: 0.01}, sparse: {name: sgd, lr: 0.1}}\n"
                    "training: {batch_size: 8}\n")
    return spec


def test_a_file_name_holding_a_line_break_is_named_on_one_line(tmp_path: Path) -> None:
    """A data file named 'q<newline>q.csv' made the one-line error two lines ('error: malformed row at
    q' then 'q.csv:2: ...'), and `flowrec predict`, which shows an error's first line, said only
    'error: malformed row at q'; `flowrec validate` of such a spec the same. Now the name's line
    break is escaped as in a repr ('q\\nq.csv') and the line is whole."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.data.layout import DataError
    from flowrec.runtime.messages import first_line

    spec = _walk_csv_spec(tmp_path)
    raw = tmp_path / "q\nq.csv"
    raw.write_text('price,user,clicked\n1.5,"unterminated\n', encoding="utf-8")
    broken = tmp_path / "sp\nec.yaml"
    broken.write_text(spec.read_text() + "foo: 1\n")
    runner = CliRunner()
    for args, says in ((["data", "convert", "csv", str(raw), str(tmp_path / "out"), "--spec", str(spec)],
                        "q\\nq.csv:2: "), (["validate", str(broken)], "sp\\nec.yaml: unknown key 'foo'")):
        result = runner.invoke(app, args)
        lines = (result.stderr or result.stdout).strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1 and says in lines[0], result.output
    assert first_line(DataError(f"malformed row at {raw}:2: x")) == f"malformed row at {tmp_path}/q\\nq.csv:2: x"
    assert first_line(RuntimeError("Error(s) in loading:\n\tmissing key")) == "Error(s) in loading: missing key"


def test_a_run_folder_named_with_a_line_break_prints_one_line_and_a_resume_command_that_works(
        tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    """`train --out 'r<newline>un'` printed 'run folder r' and 'un; if it stops, ...' on two lines.
    Escaping the status line alone would print `--resume 'r\\nun'`, which names another folder;
    the command's words now use bash's $'...' quoting where they hold a line break."""

    from flowrec.cli.train_cmds import _resume_command, _say

    folder = tmp_path / "r\nun"
    command = _resume_command(Path("spec.yaml"), folder)
    _say(f"run folder {folder}; if it stops, continue with  {command}")
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and command in err
    word = command.split(" --resume ")[1]
    assert run_bounded(["bash", "-c", f"printf %s {word}"], capture_output=True, text=True,
                       timeout_s=120).stdout == str(folder)


def test_a_success_line_naming_a_file_with_a_line_break_is_one_line(tmp_path: Path) -> None:
    """Error lines escaped a line break in a file's name (7c3b054), but the success lines did not:
    'wrote 2 rows in 1 file to o<newline>ut in 0.1s' printed on two lines (data convert, data synth,
    predict, export the same). Now every such line is one, the name escaped as in an error."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    spec = _walk_csv_spec(tmp_path)
    raw = tmp_path / "rows.csv"
    raw.write_text("price,user,clicked\n1.5,a,1\n2.5,b,0\n", encoding="utf-8")
    runner = CliRunner()
    for args, says in ((["data", "convert", "csv", str(raw), str(tmp_path / "o\nut"), "--spec", str(spec)], "o\\nut"),
                       (["data", "synth", str(spec), "--rows", "5", "--out", str(tmp_path / "sy\nn")], "sy\\nn")):
        result = runner.invoke(app, args)
        lines = result.stdout.strip().splitlines()
        assert result.exit_code == 0 and len(lines) == 1 and says in lines[0], result.output


def test_loading_a_package_as_a_run_in_python_names_load_model(tmp_path: Path) -> None:
    """`flowrec.load("pkg")` of a model package said to score it with `flowrec predict pkg RAW --out
    FILE`, a shell command, to a user in Python; now the line names flowrec.load_model('pkg') too."""
    import flowrec
    from flowrec.runtime.checkpoint.store import CheckpointError

    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "manifest.json").write_text('{"format": "flowrec-model"}')
    with pytest.raises(CheckpointError) as caught:
        flowrec.load(pkg)
    assert f"flowrec.load_model({str(pkg)!r})" in str(caught.value), caught.value


def test_evaluation_rows_among_the_training_rows_are_told_by_their_part_files(tmp_path: Path) -> None:
    """The warning of `train --eval-data` naming training data: every part file, some, or none shared
    (a link to a part file is that file)."""
    from types import SimpleNamespace

    from flowrec.cli.train_cmds import training_rows_evaluated

    parts = [tmp_path / f"part-{i}.parquet" for i in range(3)]
    for part in parts:
        part.write_bytes(b"x")
    (tmp_path / "linked.parquet").symlink_to(parts[0])
    (tmp_path / "new.parquet").write_bytes(b"y")
    train = SimpleNamespace(files=[str(p) for p in parts], path=tmp_path)

    def said(*names: str) -> str | None:
        return training_rows_evaluated(train, SimpleNamespace(files=[str(tmp_path / n) for n in names], path="E"))

    assert said("part-1.parquet", "part-0.parquet").startswith("the evaluation data E is training data: the run "
                                                               "trains on every one of its part files,")
    assert said("new.parquet", "linked.parquet").startswith("the evaluation data E is training data: the run "
                                                            "trains on 1 of the 2 of its part files,")
    assert said("new.parquet") is None
    assert training_rows_evaluated(train, None) is None
