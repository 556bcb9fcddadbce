"""`--encoder-from RUN/best`: the best checkpoint of early stopping (a folder holding only its
checkpoint.pt) encodes with its run's encoder, as eval and export of RUN/best already did; the data
layer finds the run without importing the training runtime."""
from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.encoder_record import (
    check_same_encoder,
    find_record,
    record_of_dataset,
    synthetic_record,
    write_record,
)
from flowrec.data.layout import DataError
from flowrec.testing.specs import mini_spec
from flowrec.data.run_paths import run_folder_of
from flowrec.spec.load import load_spec

runner = CliRunner()

SPEC = mini_spec("best")


def _run(folder: Path, spec: Path, synthetic: bool = False) -> Path:
    """A run folder as training leaves it: run.json, checkpoint.pt, encoder/ (of converted raw rows,
    or of synthetic rows), best/checkpoint.pt."""
    (folder / "best").mkdir(parents=True)
    for name in ("run.json", "checkpoint.pt", "best/checkpoint.pt"):
        (folder / name).write_text("{}")
    write_record(synthetic_record(load_spec(spec)) if synthetic else record_of_dataset(_converted(folder, spec)),
                 folder / "encoder")
    return folder


def _converted(folder: Path, spec: Path) -> Path:
    """Raw rows converted with a new encoder (the run's training data)."""
    raw, out = folder.parent / f"{folder.name}.csv", folder.parent / f"{folder.name}_data"
    raw.write_text("d1,user,label\n0.5,a,1\n0.1,b,0\n")
    made = runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "-q"])
    assert made.exit_code == 0, made.output
    return out


@pytest.fixture
def spec(tmp_path: Path) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(SPEC)
    return path


def test_the_best_checkpoint_finds_its_runs_encoder(spec: Path, tmp_path: Path) -> None:
    run = _run(tmp_path / "run", spec)
    expected = find_record(run).fingerprint
    assert find_record(run / "best").fingerprint == expected
    assert find_record(run / "best" / "checkpoint.pt").fingerprint == expected


def test_a_run_folder_named_best_is_its_own(spec: Path, tmp_path: Path) -> None:
    outer = tmp_path / "outer"
    outer.mkdir()
    (outer / "run.json").write_text("{}")
    inner = outer / "best"
    inner.mkdir()
    (inner / "run.json").write_text("{}")
    assert run_folder_of(inner) == inner
    with pytest.raises(DataError, match=f"{inner / 'encoder'} is missing"):  # not the outer run's
        find_record(inner)


def test_a_run_whose_encoder_was_removed_is_named_with_the_way_to_record_it_again(spec: Path, tmp_path: Path) -> None:
    """RUN/encoder removed: export RUN (--encoder-from RUN, RUN/best) said 'RUN holds no encoder: give a
    run folder, an export package or an encoded dataset', though RUN is a run folder; now the line
    names RUN/encoder and --resume, which records it again."""
    import shutil

    run = _run(tmp_path / "run", spec)
    shutil.rmtree(run / "encoder")
    for given in (run, run / "best", run / "checkpoint.pt"):
        with pytest.raises(DataError) as caught:
            find_record(given)
        assert f"{run / 'encoder'} is missing" in str(caught.value) and f"--resume {run}" in str(caught.value)
        assert "give a run folder" not in str(caught.value)


def test_a_missing_path_never_takes_the_encoder_of_the_folder_above(spec: Path, tmp_path: Path) -> None:
    run = _run(tmp_path / "run", spec)
    with pytest.raises(DataError, match="typo not found: give a run folder"):  # (it said 'holds no encoder')
        find_record(run / "typo")


def test_a_file_of_a_folder_holding_an_encoder_names_the_folder(spec: Path, tmp_path: Path) -> None:
    """`data convert ... --encoder-from RUN/plan.json` (PKG/manifest.json, DATA/part-0.parquet) said
    the file 'holds no encoder: give a run folder, an export package ...'; now it names the folder."""
    run = _run(tmp_path / "run", spec)
    (run / "plan.json").write_text("{}")
    with pytest.raises(DataError, match=f"plan.json is a file of {run}, which holds the encoder: give {run}$"):
        find_record(run / "plan.json")
    (tmp_path / "loose.json").write_text("{}")
    with pytest.raises(DataError, match="loose.json holds no encoder"):
        find_record(tmp_path / "loose.json")


def test_convert_with_the_encoder_of_run_best(spec: Path, tmp_path: Path) -> None:
    run = _run(tmp_path / "run", spec)
    raw = tmp_path / "other.csv"
    raw.write_text("d1,user,label\n0.5,a,1\n0.1,c,0\n")
    out = tmp_path / "out"
    made = runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec),
                               "--encoder-from", str(run / "best"), "-q"])
    assert made.exit_code == 0, made.output
    assert pq.read_table(out).num_rows == 2
    meta = json.loads((out / "_flowrec.json").read_text())
    assert meta["spec"] == "best"


def test_convert_with_the_encoder_of_a_run_on_synthetic_rows_is_refused(spec: Path, tmp_path: Path) -> None:
    """A run trained on synthetic rows (`train --rows N`) has an encoder that maps no raw value:
    convert succeeded with it, then eval refused the data and advised `--encoder-from RUN`, the
    very thing done. Now convert refuses in one line, writes nothing, and eval no longer advises it."""
    run = _run(tmp_path / "run", spec, synthetic=True)
    raw, out = tmp_path / "other.csv", tmp_path / "out"
    raw.write_text("d1,user,label\n0.5,a,1\n0.1,c,0\n")
    made = runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec),
                               "--encoder-from", str(run), "-q"])
    assert made.exit_code == 2 and made.output.count("error:") == 1 and "Traceback" not in made.output
    assert "synthetic data" in made.output and "convert without --encoder-from" in made.output
    assert not out.exists()
    data = _converted(tmp_path / "raw", spec)
    with pytest.raises(DataError, match="trained on synthetic rows") as refused:
        check_same_encoder(find_record(run), record_of_dataset(data), str(data))
    assert "--encoder-from" not in str(refused.value)
