"""Defects a third hostile walk found (a multi-hot CSV column without its separator, Arrow's
threads at the exit of a notebook's Python, the model language), one test per defect; each fails
on the code before its fix."""
from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.testing.processes import run_bounded

runner = CliRunner()

SEQUENCE_SPEC = """
name: seqbag
features:
  - {name: user, type: categorical, hash_buckets: 50, dim: 4}
  - {name: hist, type: sequence, hash_buckets: 80, dim: 4, max_len: 5, pooling: mean}
modules:
  - {name: top, kind: mlp, inputs: [user, hist], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
training: {batch_size: 8, epochs: 1, seed: 1}
"""


def _sequence_csv(tmp_path: Path, sep: str) -> Path:
    rows = [f"u{i % 7},{sep.join(str((i * 7 + k * 13) % 70 + 1) for k in range(1 + i % 4))},{i % 2}"
            for i in range(40)]
    path = tmp_path / "rows.csv"
    path.write_text("\n".join(["user,hist,label", *rows]) + "\n")
    return path


def _spec(tmp_path: Path, options: str = "") -> Path:
    path = tmp_path / "spec.yaml"
    path.write_text(SEQUENCE_SPEC + (f"data: {{options: {options}}}\n" if options else ""))
    return path


def test_a_multi_hot_column_written_with_another_separator_is_one_line_naming_the_field(tmp_path: Path):
    """'9|33|16' under the default separator '^' used to become one id per row, silently."""
    rows = _sequence_csv(tmp_path, "|")
    result = runner.invoke(app, ["data", "convert", "csv", str(rows), str(tmp_path / "out"),
                                 "--spec", str(_spec(tmp_path)), "-q"])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in result.output
    assert "feature 'hist'" in line and "sequence_sep: '|'" in line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sep,options", [("|", '{sequence_sep: "|"}'), ("^", ""), ("^", '{sequence_sep: "^"}')])
def test_a_multi_hot_column_with_its_separator_is_split_into_its_ids(tmp_path: Path, sep: str, options: str):
    rows = _sequence_csv(tmp_path, sep)
    result = runner.invoke(app, ["data", "convert", "csv", str(rows), str(tmp_path / "out"),
                                 "--spec", str(_spec(tmp_path, options)), "-q"])
    assert result.exit_code == 0, result.output
    hist = pq.read_table(tmp_path / "out").column("hist").to_pylist()
    assert [len(h) for h in hist] == [1 + i % 4 for i in range(40)]


def test_an_explicit_separator_is_trusted_even_where_values_hold_another(tmp_path: Path):
    """sequence_sep given (here '^', each value one id): no guess overrides the user."""
    rows = _sequence_csv(tmp_path, "|")
    result = runner.invoke(app, ["data", "convert", "csv", str(rows), str(tmp_path / "out"),
                                 "--spec", str(_spec(tmp_path, '{sequence_sep: "^"}')), "-q"])
    assert result.exit_code == 0, result.output
    assert {len(h) for h in pq.read_table(tmp_path / "out").column("hist").to_pylist()} == {1}


def test_a_multi_hot_column_with_another_separator_is_refused_with_encoder_from_too(tmp_path: Path):
    """`data convert csv day2.csv ... --encoder-from runs/day1` skipped the check (the encoder brings
    its separator), so day 2's '9|33|16' became one id per row, silently."""
    day1 = runner.invoke(app, ["data", "convert", "csv", str(_sequence_csv(tmp_path, "^")), str(tmp_path / "d1"),
                               "--spec", str(_spec(tmp_path)), "-q"])
    assert day1.exit_code == 0, day1.output
    (tmp_path / "day2").mkdir()
    result = runner.invoke(app, ["data", "convert", "csv", str(_sequence_csv(tmp_path / "day2", "|")),
                                 str(tmp_path / "d2"), "--spec", str(_spec(tmp_path)), "-q",
                                 "--encoder-from", str(tmp_path / "d1")])
    assert result.exit_code == 2, result.output
    line = result.stderr.strip()
    assert "\n" not in line and "feature 'hist'" in line and "separated by '^'" in line, line
    assert not (tmp_path / "d2").exists()


# ------------------------------------------------------------------ Arrow's threads at a library user's exit
READ_AND_EXIT = """
import sys
from pathlib import Path
import flowrec.api  # torch loaded, as in a notebook: the exit's timing that aborted
from flowrec.data.error_log import ErrorLog
from flowrec.data.sources import read_csv
path = Path(sys.argv[1])
rows = sum(t.num_rows for t in read_csv(path, {}, ErrorLog("skip", str(path)), set()))
left = read_csv(path, {"chunk_bytes": 64}, ErrorLog("skip", str(path)), set())
print(rows, next(left).num_rows)
"""


def _small_csv(tmp_path: Path) -> Path:
    path = tmp_path / "rows.csv"
    path.write_text("user,item,label\n" + "".join(f"u{i % 9},i{i % 13},{i % 2}\n" for i in range(40)))
    return path


def test_a_python_script_that_reads_a_csv_exits_0(tmp_path: Path):
    """A script reading a CSV through flowrec.data (one read to the end, one left suspended) used to
    abort at the interpreter's exit now and then (exit 134: an Arrow IO thread released the
    reader's Python row handler during finalization; about 1 run in 8 with torch loaded)."""
    import os
    import sys

    path = _small_csv(tmp_path)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    for _ in range(4):
        done = run_bounded([sys.executable, "-c", READ_AND_EXIT, str(path)], capture_output=True,
                           text=True, timeout_s=120, env=env)
        assert done.returncode == 0, (done.returncode, done.stderr[-500:])
        rows, first = map(int, done.stdout.split())
        assert rows == 40 and 1 <= first < 40, done.stdout


def test_arrow_releases_every_csv_reader_before_the_exit_hook_returns(tmp_path: Path):
    """The exit hook drops a reader left suspended and sees Arrow release its row handler."""
    from flowrec.data import csv_release
    from flowrec.data.error_log import ErrorLog
    from flowrec.data.layout import DataError
    from flowrec.data.sources import read_csv

    path = _small_csv(tmp_path)
    assert sum(t.num_rows for t in read_csv(path, {}, ErrorLog("skip", str(path)), set())) == 40
    left = read_csv(path, {"chunk_bytes": 64}, ErrorLog("skip", str(path)), set())
    assert next(left).num_rows >= 1
    assert len(csv_release._HANDLERS) >= 1  # the suspended reader's handler is Arrow's still
    assert csv_release.release_readers(wait_s=10.0)
    assert len(csv_release._HANDLERS) == 0
    with pytest.raises(DataError, match="closed at the interpreter's exit"):
        next(left)


# ------------------------------------------------------------------ the model language: custom class paths at validate
CUSTOM_SPEC = """
name: walk_custom
features:
  - {{name: price, type: dense}}
  - {{name: user_id, type: categorical, hash_buckets: 100, dim: 8}}
modules:
  - {{name: bottom, kind: mlp, inputs: ["@dense", user_id], layers: [16]}}
  - {{name: mine, kind: custom, class: "{cls}", inputs: [bottom]}}
  - {{name: top, kind: mlp, inputs: [mine], layers: [8]}}
heads:
  - {{name: ctr, input: top, task: binary, loss: bce}}
training: {{batch_size: 32, epochs: 1, seed: 0}}
"""
BLOCKS = """
import torch
if torch.__version__:
    class Gated(torch.nn.Module):
        def forward(self, x):
            return x
Alias = Gated
"""
CLASS_PATHS = {
    "missing_file": ("nope.py:Thing", "no Python file at nope.py"),
    "syntax_error": ("broken.py:X", "broken.py does not parse: SyntaxError"),
    "no_such_class": ("blocks.py:Nope", "blocks.py defines no top-level 'Nope' (it defines Alias, Gated, torch)"),
    "no_such_package": ("nosuchpkg_walk3.blocks:Gated", "no module 'nosuchpkg_walk3' can be imported here"),
}


@pytest.mark.parametrize("case", sorted(CLASS_PATHS))
def test_a_custom_class_path_that_cannot_import_is_one_line_at_validate(tmp_path: Path, monkeypatch, case: str):
    """validate said `ok` for a custom module whose file is missing, does not parse or lacks the
    class (only plan or train found out); it still runs none of the user's code."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blocks.py").write_text(BLOCKS)
    (tmp_path / "broken.py").write_text("import os\nclass X(:\n    pass\nopen('RAN', 'w')\n")
    cls, says = CLASS_PATHS[case]
    (tmp_path / "spec.yaml").write_text(CUSTOM_SPEC.format(cls=cls))
    result = runner.invoke(app, ["validate", "spec.yaml"])
    assert result.exit_code == 2, result.output
    assert result.output.startswith("spec.yaml: modules[1].class: "), result.output
    assert says in result.output and "\n" not in result.output.strip()
    assert not (tmp_path / "RAN").exists()


@pytest.mark.parametrize("cls", ["blocks.py:Gated", "blocks.py:Alias", "torch.nn:Linear"])
def test_a_custom_class_path_that_imports_validates_without_running_it(tmp_path: Path, monkeypatch, cls: str):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "blocks.py").write_text(BLOCKS + "open('RAN', 'w')\n")
    (tmp_path / "spec.yaml").write_text(CUSTOM_SPEC.format(cls=cls))
    result = runner.invoke(app, ["validate", "spec.yaml"])
    assert result.exit_code == 0, result.output
    assert not (tmp_path / "RAN").exists()
