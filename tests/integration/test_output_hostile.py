"""Hostile outputs, datasets and values, one row per case: an output never lands in a run, package or
dataset folder, never over an input (paths, symbolic and hard links), never over a file without
--overwrite; names from a dataset's or encoder's JSON stay inside their folder; values that would
silently give wrong results (non-finite dense inputs, a run.json without its settings, NaN in a
device profile) and inputs that gave tracebacks are one line with exit 2, and nothing changes."""
from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Callable

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from flowrec.cli import app

SPEC = """
name: out_hostile
features:
  - {name: price, type: dense, transform: standardize}
  - {name: user, type: categorical, vocab: 40, dim: 4}
  - {name: city, type: categorical, hash_buckets: 20, dim: 4}
modules:
  - {name: top, kind: mlp, inputs: ["@dense", "@sparse"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 64, epochs: 1, seed: 0}
"""
runner = CliRunner()


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    user = rng.integers(0, 50, rows)
    return pd.DataFrame({"price": rng.lognormal(2.0, 1.0, rows), "user": [f"u{u}" for u in user],
                         "city": rng.integers(0, 90, rows), "label": (user % 3 == 0).astype(int)})


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    """spec.yaml, new.csv, an encoded dataset (data/, with vocabularies), a run and its package."""
    root = tmp_path_factory.mktemp("out_hostile")
    (root / "spec.yaml").write_text(SPEC)
    raw_rows(600, 0).to_csv(root / "train.csv", index=False)
    raw_rows(40, 1).to_csv(root / "new.csv", index=False)
    steps = [["data", "convert", "csv", str(root / "train.csv"), str(root / "data"), "--spec", str(root / "spec.yaml"),
              "-q"],
             ["train", str(root / "spec.yaml"), "--data", str(root / "data"), "--out", str(root / "run"), "-q",
              "--device", "cpu"],
             ["export", str(root / "run"), str(root / "pkg"), "-q"]]
    for argv in steps:
        done = runner.invoke(app, argv)
        assert done.exit_code == 0, done.output
    (root / "train.csv").unlink()
    return root


@pytest.fixture
def case(base: Path, tmp_path: Path) -> Path:
    for name in ("spec.yaml", "new.csv", "data", "run", "pkg"):
        src, dst = base / name, tmp_path / name
        shutil.copytree(src, dst) if src.is_dir() else shutil.copy(src, dst)
    return tmp_path


def snapshot(folder: Path) -> dict[str, str]:
    """Every file (links as their target's name) with its digest; the run's lock file aside."""
    found = {}
    for p in sorted(folder.rglob("*")):
        if p.is_symlink():
            found[str(p.relative_to(folder))] = "-> " + os.readlink(p)
        elif p.is_file() and p.name != ".flowrec.lock":
            found[str(p.relative_to(folder))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return found


def one_line_exit_2(result, fragment: str, status_lines: bool = False) -> None:
    """Exit 2 with one `error:` line, the last on stderr (status lines above it when allowed)."""
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert [line for line in lines if line.startswith("error: ")] == lines[-1:], result.stderr
    assert status_lines or len(lines) == 1, result.stderr
    assert fragment in lines[-1], lines[-1]
    assert "Traceback" not in result.output


def predict(*extra: str) -> Callable[[Path], list[str]]:
    return lambda r: ["predict", str(r / "pkg"), str(r / "new.csv"), "--format", "csv", "-q", *extra]


def out(name: str, *extra: str) -> Callable[[Path], list[str]]:
    """predict into `name` (relative to the case folder)."""
    return lambda r: predict("--out", str(r / name), *extra)(r)


def eval_json(name: str, *extra: str) -> Callable[[Path], list[str]]:
    return lambda r: ["eval", str(r / "run"), "--data", str(r / "data"), "-q", "--json", str(r / name), *extra]


def _link(name: str, target: str, hard: bool = False) -> Callable[[Path], None]:
    def make(r: Path) -> None:
        (os.link if hard else os.symlink)(r / target, r / name)
    return make


OUTPUTS = {  # case -> (argv, flowrec's words, what to prepare first)
    "predict_over_the_run_checkpoint": (out("run/checkpoint.pt", "--overwrite"), "a training run's folder", None),
    "predict_into_a_run_folder": (out("run/scores.parquet"), "a training run's folder", None),
    "predict_over_its_raw_input": (out("new.csv", "--overwrite"), "which this command reads", None),
    "predict_over_the_package_program": (out("pkg/model.pt2", "--overwrite"), "a model package's folder", None),
    "predict_into_a_dataset": (out("data/scores.parquet"), "a dataset's folder", None),
    "predict_through_a_link_into_the_run": (out("s.parquet", "--overwrite"), "a training run's folder",
                                            _link("s.parquet", "run/checkpoint.pt")),
    "predict_over_a_hard_link_of_its_input": (out("copy.csv", "--overwrite"), "the same file, linked",
                                              _link("copy.csv", "new.csv", hard=True)),
    "predict_over_a_file_without_overwrite": (out("spec.yaml"), "exists; give --overwrite", None),
    # predict's guard knows only its inputs: --overwrite replaced the raw training CSV with scores
    "predict_over_the_training_csv": (out("train.csv", "--overwrite"), "not scores of ctr",
                                      lambda r: raw_rows(30, 2).to_csv(r / "train.csv", index=False)),
    "predict_over_a_parquet_of_rows": (out("rows.parquet", "--overwrite"), "not scores of ctr",
                                       lambda r: raw_rows(30, 2).to_parquet(r / "rows.parquet")),
    "eval_json_over_run_json": (eval_json("run/run.json"), "a training run's folder", None),
    "eval_json_over_the_checkpoint": (eval_json("run/checkpoint.pt", "--overwrite"), "a training run's folder", None),
    "eval_json_over_the_dataset_meta": (eval_json("data/_flowrec.json", "--overwrite"), "a dataset's folder", None),
    "eval_json_over_a_file_without_overwrite": (eval_json("spec.yaml"), "exists; give --overwrite", None),
    # eval reads neither the spec nor raw rows: --overwrite replaced them with metrics
    "eval_json_over_the_spec": (eval_json("spec.yaml", "--overwrite"), "not metrics `flowrec eval --json` wrote",
                                None),
    "eval_json_over_raw_rows": (eval_json("new.csv", "--overwrite"), "not metrics `flowrec eval --json` wrote", None),
    "export_into_the_run": (lambda r: ["export", str(r / "run"), str(r / "run" / "pkg")], "a training run's folder",
                            None),
    "export_over_a_dataset": (lambda r: ["export", str(r / "run"), str(r / "data"), "--overwrite"],
                              "a dataset's folder", None),
    "export_into_a_package": (lambda r: ["export", str(r / "run"), str(r / "pkg" / "vocab")],
                              "a model package's folder", None),
    "plan_json_over_its_spec": (lambda r: ["plan", str(r / "spec.yaml"), "-q", "--json", str(r / "spec.yaml"),
                                           "--overwrite"], "which this command reads", None),
    "plan_json_into_the_run": (lambda r: ["plan", str(r / "spec.yaml"), "-q", "--json", str(r / "run" / "plan.json"),
                                          "--overwrite"], "a training run's folder", None),
    "plan_two_outputs_in_one_file": (lambda r: ["plan", str(r / "spec.yaml"), "-q", "--json", str(r / "p.txt"),
                                                "--dot", str(r / "p.txt")], "writes as another output", None),
    "calibrate_into_the_run": (lambda r: ["calibrate", str(r / "spec.yaml"), "--out", str(r / "run" / "cpu.json")],
                               "a training run's folder", None),
    "convert_into_the_run": (lambda r: ["data", "convert", "csv", str(r / "new.csv"), str(r / "run" / "d2"), "--spec",
                                        str(r / "spec.yaml"), "-q"], "a training run's folder", None),
    "convert_over_the_package": (lambda r: ["data", "convert", "csv", str(r / "new.csv"), str(r / "pkg"), "--spec",
                                            str(r / "spec.yaml"), "-q", "--overwrite"], "a model package's folder", None),
    "convert_over_its_source_folder": (lambda r: ["data", "convert", "csv", str(r / "new.csv"), str(r), "--spec",
                                                  str(r / "spec.yaml"), "-q", "--overwrite"],
                                       "which this command reads", None),
    "synth_into_the_package": (lambda r: ["data", "synth", str(r / "spec.yaml"), "--rows", "10", "--out",
                                          str(r / "pkg" / "x")], "a model package's folder", None),
    "profile_json_into_the_run": (lambda r: ["data", "profile", str(r / "spec.yaml"), str(r / "data"), "-q", "--json",
                                             str(r / "run" / "p.json")], "a training run's folder", None),
}


@pytest.mark.parametrize("name", sorted(OUTPUTS))
def test_an_output_never_lands_on_what_flowrec_reads_or_owns(case: Path, name: str, monkeypatch):
    monkeypatch.chdir(case)
    argv_of, fragment, prepare = OUTPUTS[name]
    if prepare is not None:
        prepare(case)
    before = snapshot(case)
    result = runner.invoke(app, argv_of(case))
    one_line_exit_2(result, fragment)
    assert snapshot(case) == before


def test_overwrite_replaces_an_output_of_its_own_atomically(case: Path):
    (case / "scores.parquet").write_text("")  # an empty file, or scores predict wrote, is replaced
    for name in ("scores.parquet", "scores.parquet", "scores.csv", "scores.csv", "scores.tsv", "scores.tsv"):
        made = runner.invoke(app, out(name, "--overwrite")(case))
        assert made.exit_code == 0, made.output
    assert len(pd.read_parquet(case / "scores.parquet")) == len(pd.read_csv(case / "scores.csv")) == 40
    assert len(pd.read_csv(case / "scores.tsv", sep="\t")) == 40
    scored = runner.invoke(app, eval_json("m.json")(case))
    again = runner.invoke(app, eval_json("m.json", "--overwrite")(case))
    assert scored.exit_code == 0 and again.exit_code == 0, scored.output + again.output
    assert "ctr" in json.loads((case / "m.json").read_text())
    (case / "pkg" / "notes.txt").write_text("of the old package")
    exported = runner.invoke(app, ["export", str(case / "run"), str(case / "pkg"), "--overwrite", "-q"])
    assert exported.exit_code == 0, exported.output
    assert not (case / "pkg" / "notes.txt").exists() and (case / "pkg" / "model.pt2").is_file()
    assert sorted(p.name for p in case.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_an_export_whose_out_another_export_wrote_meanwhile_does_not_replace_it(case: Path, monkeypatch):
    """Two `flowrec export` into one new OUT at once (a scheduler starting a job twice, or two runs
    into one name) both said 'wrote OUT', the second having replaced the first's package without
    --overwrite. Now the one that comes second is one line, exit 2, and leaves OUT as the other wrote it."""
    import flowrec.serving.export as export

    written = export.write_package

    def another_export_lands(trained, staged, *args, **kwargs):  # while this one writes its package
        report = written(trained, staged, *args, **kwargs)
        shutil.copytree(case / "pkg", case / "new_pkg")
        (case / "new_pkg" / "notes.txt").write_text("the other export's")
        return report

    monkeypatch.setattr(export, "write_package", another_export_lands)
    before = snapshot(case / "pkg")
    done = runner.invoke(app, ["export", str(case / "run"), str(case / "new_pkg"), "-q"])
    one_line_exit_2(done, "new_pkg was written by another process while this one ran; give --overwrite")
    assert snapshot(case / "new_pkg") == {**before, "notes.txt": hashlib.sha256(b"the other export's").hexdigest()}
    assert sorted(p.name for p in case.iterdir() if p.name.startswith(".")) == []  # no staging folder left


@pytest.mark.parametrize("command", ["predict", "eval"])
def test_a_file_output_another_process_wrote_meanwhile_is_kept_without_overwrite(case: Path, command: str,
                                                                                  monkeypatch):
    """Two `predict --out F` (or `eval --json F`) at once into one new F both said they wrote it,
    the second having replaced the first's scores without --overwrite. Now the one that comes second
    is one line, exit 2, and leaves F as the other wrote it, no temp file beside it."""
    import flowrec.cli.predict_cmd as predict_cmd
    import flowrec.serving.trained as trained

    name = "scores.csv" if command == "predict" else "m.json"
    owner, attr = (predict_cmd, "_score") if command == "predict" else (trained.Trained, "evaluate_dataset")
    work = getattr(owner, attr)

    def another_lands(*args, **kwargs):  # the other process writes F while this one works
        done = work(*args, **kwargs)
        (case / name).write_text("the other process's")
        return done

    monkeypatch.setattr(owner, attr, another_lands)
    result = runner.invoke(app, (out(name) if command == "predict" else eval_json(name))(case))
    one_line_exit_2(result, f"{name} was written by another process while this one ran; give --overwrite")
    assert (case / name).read_text() == "the other process's"
    assert sorted(p.name for p in case.iterdir() if p.name.startswith(".")) == []  # no temp file left


def test_predict_while_export_overwrite_replaces_the_package_scores_with_one_package(case: Path, monkeypatch):
    """`export RUN PKG --overwrite` renamed a new package over PKG while `predict PKG` loaded it:
    predict had checked the old package's files against its manifest and then read the new one's
    model.pt2 by name, so it refused the package as damaged ('... is not that of model.pt2's
    tables') or scored with one package's encoder and another's model. Now a load whose package
    folder was replaced during it starts again on the new one: the scores are the new package's."""
    import flowrec.serving.predict as predict_mod
    from flowrec.data.output_guard import replace_folder

    made = runner.invoke(app, ["export", str(case / "run"), str(case / "pkg16"), "--dtype", "fp16", "-q"])
    assert made.exit_code == 0, made.output
    alone = runner.invoke(app, ["predict", str(case / "pkg16"), str(case / "new.csv"), "--format", "csv", "-q",
                                "--out", str(case / "alone.csv")])
    assert alone.exit_code == 0, alone.output
    shutil.copytree(case / "pkg16", case / "staged16")
    checked, swapped = predict_mod.check_archive, []

    def export_lands(path, *args, **kwargs):  # the export's rename, after the files were checked
        if not swapped:
            replace_folder(case / "staged16", case / "pkg")
            swapped.append(path)
        return checked(path, *args, **kwargs)

    monkeypatch.setattr(predict_mod, "check_archive", export_lands)
    done = runner.invoke(app, out("scores.csv")(case))
    assert swapped and done.exit_code == 0, done.output
    assert pd.read_csv(case / "scores.csv").equals(pd.read_csv(case / "alone.csv"))


# ------------------------------------------------------------------ names from files, values, tracebacks
def _meta(edit: Callable[[dict], None], folder: str = "data") -> Callable[[Path], None]:
    def make(r: Path) -> None:
        doc = json.loads((r / folder / "_flowrec.json").read_text())
        edit(doc)
        (r / folder / "_flowrec.json").write_text(json.dumps(doc))
    return make


def _run_encoder(edit: Callable[[dict], None]) -> Callable[[Path], None]:
    def make(r: Path) -> None:
        doc = json.loads((r / "run" / "encoder" / "encoder.json").read_text())
        edit(doc)
        (r / "run" / "encoder" / "encoder.json").write_text(json.dumps(doc))
    return make


def _vocab_link_out(r: Path) -> None:
    vocab = r / "data" / "_vocab" / "user.parquet"
    shutil.copy(vocab, r / "outside.parquet")
    vocab.unlink()
    vocab.symlink_to(r / "outside.parquet")


def _parquet_with(value: float) -> Callable[[Path], None]:
    """The raw rows as Parquet, row 4's price `value` (a NaN stored as a value, not as null)."""
    def make(r: Path) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows = pd.read_csv(r / "new.csv")
        price = rows["price"].to_numpy().copy()
        price[3] = value
        table = pa.Table.from_pandas(rows.drop(columns=["price"]), preserve_index=False)
        pq.write_table(table.append_column("price", pa.array(price, from_pandas=False)), r / "rows.parquet")
    return make


def _profile(measured: dict) -> Callable[[Path], None]:
    def make(r: Path) -> None:
        from flowrec.planner.calibration import profile_document

        doc = profile_document("cpu", {k: (v, "planted") for k, v in measured.items()}, "x", "2026-01-01T00:00:00Z")
        (r / "prof.json").write_text(json.dumps(doc))
    return make


def _shuffle_vocab(path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    values = pq.read_table(path).column("value").to_pylist()
    pq.write_table(pa.table({"value": values[1:] + values[:1]}), path)


def _write(name: str, text: str) -> Callable[[Path], None]:
    return lambda r: (r / name).write_text(text)


def train(*extra: str) -> Callable[[Path], list[str]]:
    return lambda r: ["train", str(r / "spec.yaml"), "-q", "--device", "cpu", *extra]


def predict_rows(*extra: str) -> Callable[[Path], list[str]]:
    return lambda r: ["predict", str(r / "pkg"), str(r / "rows.parquet"), "--format", "parquet", "-q", "--out",
                      str(r / "s.parquet"), *extra]


NESTED = "[" * 200_000
VALUES = {  # case -> (argv, flowrec's words, what to prepare, status lines may come first)
    "dataset_table_up_and_out": (train("--data", "{r}/data", "--out", "{r}/r2"), "not a plain name",
                                 _meta(lambda d: d["encoding"]["user"].update(table="../../X")), True),
    "dataset_vocab_file_absolute": (train("--data", "{r}/data", "--out", "{r}/r2"), "not a relative path",
                                    _meta(lambda d: d["encoding"]["user"].update(vocab_file="/etc/passwd")), True),
    "dataset_vocab_file_up_and_out": (train("--data", "{r}/data", "--out", "{r}/r2"), "not a plain name",
                                      _meta(lambda d: d["encoding"]["user"].update(vocab_file="../new.csv")), True),
    "dataset_vocab_links_out": (train("--data", "{r}/data", "--out", "{r}/r2"), "leads outside", _vocab_link_out,
                                True),
    "encoder_from_a_hostile_dataset": (lambda r: ["data", "convert", "csv", str(r / "new.csv"), str(r / "d2"), "--spec",
                                                  str(r / "spec.yaml"), "-q", "--encoder-from", str(r / "data")],
                                       "not a plain name", _meta(lambda d: d["encoding"]["user"].update(table="a/b")),
                                       False),
    "dataset_meta_of_another_version": (train("--data", "{r}/data", "--out", "{r}/r2"), "metadata version 9",
                                        _meta(lambda d: d.update(version=9)), False),
    "nested_dataset_meta": (train("--data", "{r}/data", "--out", "{r}/r2"), "nested deeper",
                            _write("data/_flowrec.json", NESTED), False),
    "run_encoder_vocab_up_and_out": (lambda r: ["export", str(r / "run"), str(r / "p2"), "-q"], "not a plain name",
                                     _run_encoder(lambda d: d["vocab_files"].update(user="../../new.csv")), False),
    "run_encoder_vocab_reordered": (lambda r: ["export", str(r / "run"), str(r / "p2"), "-q"],
                                    "does not match the digest its encoder records",
                                    lambda r: _shuffle_vocab(r / "run" / "encoder" / "vocab" / "user.parquet"), False),
    "resume_with_run_json_without_settings": (train("--resume", "{r}/run"), "lacks the setting",
                                              _write("run/run.json", '{"epochs": 2}'), False),
    "resume_with_nested_run_json": (train("--resume", "{r}/run"), "nested deeper", _write("run/run.json", NESTED),
                                    False),
    # a malformed row, as in CSV (the reader's words; --on-error skip skips it)
    "parquet_rows_with_inf": (predict_rows(), "non-finite value inf in column price", _parquet_with(math.inf), False),
    "parquet_rows_with_minus_inf": (predict_rows(), "non-finite value -inf in column price", _parquet_with(-math.inf),
                                    False),
    "parquet_rows_beyond_float32": (predict_rows(), "value beyond float32 1e+300 in column price", _parquet_with(1e300),
                                    False),
    "keep_a_head": (predict_rows("--keep", "ctr"), "already has a column ctr", _parquet_with(1.0), False),
    "keep_twice": (predict_rows("--keep", "user", "--keep", "user"), "given twice", _parquet_with(1.0), False),
    "only_row_malformed": (lambda r: ["predict", str(r / "pkg"), str(r / "one.csv"), "--format", "csv", "-q", "--out",
                                      str(r / "s.parquet")], "one.csv:2", _write("one.csv", "price,user,city\n1.0,u1\n"),
                           False),
    "profile_with_nan_in_dense_ops": (lambda r: ["plan", str(r / "spec.yaml"), "-q", "--target", str(r / "prof.json")],
                                      "finite non-negative numbers",
                                      _profile({"dense_ops": {"mlp": [64.0, math.nan, 1.0]}}), False),
    "profile_with_an_infinite_rate": (lambda r: ["plan", str(r / "spec.yaml"), "-q", "--target", str(r / "prof.json")],
                                      "must be a positive number", _profile({"hbm_gbps": math.inf}), False),
    "plan_target_nested": (lambda r: ["plan", str(r / "spec.yaml"), "-q", "--target", str(r / "deep.json")],
                           "nested deeper", _write("deep.json", NESTED), False),
    "train_target_nested": (train("--target", "{r}/deep.json", "--out", "{r}/r2"), "nested deeper",
                            _write("deep.json", NESTED), False),
    "dist_timeout_inf": (train("--dist-timeout", "inf"), "--dist-timeout must be", None, False),
    "dist_timeout_nan": (train("--dist-timeout", "nan"), "--dist-timeout must be", None, False),
    "dist_timeout_too_long": (train("--dist-timeout", "1e30"), "--dist-timeout must be", None, False),
}


@pytest.mark.parametrize("name", sorted(VALUES))
def test_a_hostile_name_or_value_is_one_line_and_changes_nothing(case: Path, name: str, monkeypatch):
    monkeypatch.chdir(case)
    argv_of, fragment, prepare, status_lines = VALUES[name]
    if prepare is not None:
        prepare(case)
    before = snapshot(case)
    argv = [a.format(r=case) for a in argv_of(case)]
    result = runner.invoke(app, argv)
    one_line_exit_2(result, fragment, status_lines)
    assert snapshot(case) == before
    assert not any(p.exists() for p in (case / "r2", case / "d2", case / "p2", case / "s.parquet", case / "runs"))
    assert not (case.parent / "X").exists() and not (case.parent / "X.parquet").exists()


def test_a_dataframe_with_inf_in_a_dense_column_is_refused_by_the_api(case: Path):
    from flowrec.data.layout import DataError
    from flowrec.serving.predict import load_model

    model = load_model(case / "pkg")
    rows = pd.read_csv(case / "new.csv")
    assert len(model.predict(rows)) == 40
    rows.loc[5, "price"] = np.inf
    with pytest.raises(DataError, match="row 6: dense column price"):
        model.predict(rows)
    rows.loc[5, "price"] = np.nan  # a missing value in a DataFrame: filled as the encoder says
    assert np.isfinite(model.predict(rows)["ctr"].to_numpy()).all()


def test_nan_in_a_parquet_dense_column_is_a_missing_value_as_in_csv(case: Path):
    """Parquet's NaN stored as a value scores like CSV's `nan` text: a missing value, filled."""
    _parquet_with(math.nan)(case)
    pd.read_parquet(case / "rows.parquet").to_csv(case / "rows.csv", index=False, na_rep="nan")
    assert "nan" in (case / "rows.csv").read_text()
    for fmt, rows in (("parquet", "rows.parquet"), ("csv", "rows.csv")):
        done = runner.invoke(app, ["predict", str(case / "pkg"), str(case / rows), "--format", fmt, "-q", "--out",
                                   str(case / f"{fmt}.parquet")])
        assert done.exit_code == 0, done.output
    a, b = pd.read_parquet(case / "parquet.parquet"), pd.read_parquet(case / "csv.parquet")
    assert np.isfinite(a["ctr"]).all()
    np.testing.assert_allclose(a["ctr"], b["ctr"], rtol=0, atol=1e-6)


@pytest.mark.parametrize("name,sep", [("scores.csv", ","), ("scores.TSV", "\t"), ("scores.parquet", None), ("scores", None)])
def test_predict_writes_the_format_its_out_name_says(case: Path, name: str, sep):
    """--out scores.csv is CSV text (header, one row per raw row, kept columns after the heads), .tsv
    tab-separated, .parquet or no suffix Parquet: never Parquet bytes under a text name."""
    made = runner.invoke(app, out(name, "--keep", "user")(case))
    assert made.exit_code == 0, made.output
    got = pd.read_parquet(case / name) if sep is None else pd.read_csv(case / name, sep=sep)
    assert list(got.columns) == ["ctr", "user"] and len(got) == 40
    assert got["user"].tolist() == pd.read_csv(case / "new.csv")["user"].tolist()
    reference = runner.invoke(app, out("reference.parquet")(case))
    assert reference.exit_code == 0, reference.output
    np.testing.assert_allclose(got["ctr"].to_numpy(), pd.read_parquet(case / "reference.parquet")["ctr"].to_numpy(),
                               rtol=1e-6, atol=0)


@pytest.mark.parametrize("name,fragment", [("scores.json", "cannot write .json"), ("scores.xlsx", "cannot write .xlsx")])
def test_predict_refuses_an_out_name_of_another_format_before_scoring(case: Path, name: str, fragment: str):
    before = snapshot(case)
    one_line_exit_2(runner.invoke(app, out(name)(case)), fragment)
    assert snapshot(case) == before


def test_predict_refuses_a_kept_list_column_as_text_and_writes_nothing(case: Path):
    rows = pd.read_csv(case / "new.csv")
    rows["tags"] = [[i, i + 1] for i in range(len(rows))]
    rows.to_parquet(case / "rows.parquet")
    before = snapshot(case)
    argv = ["predict", str(case / "pkg"), str(case / "rows.parquet"), "--format", "parquet", "-q", "--out",
            str(case / "s.csv"), "--keep", "tags"]
    one_line_exit_2(runner.invoke(app, argv), "--keep tags")
    assert snapshot(case) == before


def test_top_k_lists_are_refused_as_text():
    from flowrec.cli.predict_cmd import output_kind

    with pytest.raises(ValueError, match="--top-k writes lists"):
        output_kind(Path("recs.csv"), lists=True)
    assert output_kind(Path("recs.pq"), lists=True) == "parquet"


def test_predict_reads_parquet_as_convert_does_a_bad_row_skipped_and_a_folder_of_parts(case: Path):
    """Raw Parquet rows go through the same reader as `data convert parquet`: an infinite price is a
    malformed row that --on-error skip skips (the others scored as from CSV), and a folder of part
    files scores as the one file."""
    _parquet_with(math.inf)(case)
    skipped = runner.invoke(app, predict_rows("--on-error", "skip", "--keep", "user")(case))
    assert skipped.exit_code == 0, skipped.output
    assert "skipped 1 malformed row of " in skipped.stderr
    from_csv = runner.invoke(app, out("all.parquet", "--keep", "user")(case))
    assert from_csv.exit_code == 0, from_csv.output
    got, every = pd.read_parquet(case / "s.parquet"), pd.read_parquet(case / "all.parquet")
    assert len(got) == 39
    kept = every.drop(index=3).reset_index(drop=True)
    assert got["user"].tolist() == kept["user"].tolist()
    np.testing.assert_allclose(got["ctr"].to_numpy(), kept["ctr"].to_numpy(), rtol=1e-6, atol=0)
    rows = pd.read_csv(case / "new.csv")
    (case / "parts").mkdir()
    rows.iloc[:25].to_parquet(case / "parts" / "a.parquet")
    rows.iloc[25:].to_parquet(case / "parts" / "b.parquet")
    folder = runner.invoke(app, ["predict", str(case / "pkg"), str(case / "parts"), "--format", "parquet", "-q",
                                 "--out", str(case / "f.parquet")])
    assert folder.exit_code == 0, folder.output
    np.testing.assert_allclose(pd.read_parquet(case / "f.parquet")["ctr"].to_numpy(), every["ctr"].to_numpy(),
                               rtol=1e-6, atol=0)


def test_a_full_disk_while_predict_or_convert_writes_names_the_output(case: Path, monkeypatch):
    """A disk that filled while predict or data convert wrote was pyarrow's own line, naming no
    file ('[Errno 28] Error writing bytes to file. Detail: [errno 28] No space left on device');
    now the line names the output and says nothing was written, and nothing is left."""
    import errno

    import pyarrow.parquet as pq

    def full(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", full)
    before = snapshot(case)
    one_line_exit_2(runner.invoke(app, out("scores.parquet")(case)),
                    f"cannot write {case / 'scores.parquet'}: No space left on device; ")
    pd.DataFrame(raw_rows(30, 2)).to_csv(case / "more.csv", index=False)
    one_line_exit_2(runner.invoke(app, ["data", "convert", "csv", str(case / "more.csv"), str(case / "more"),
                                        "--spec", str(case / "spec.yaml"), "-q"]),
                    f"cannot write {case / 'more'}: No space left on device; nothing was written")
    (case / "more.csv").unlink()
    assert snapshot(case) == before


def test_export_predict_and_convert_write_through_an_output_that_is_a_link(case: Path):
    """`export RUN latest --overwrite`, `predict ... --out s.csv --overwrite` and `data convert ... d
    --overwrite`, each output a link to a package, a file or a dataset on another disk: the new
    output was renamed over the link, landing beside it, and the old one lived on where no name of
    the user's led. Each now replaces what its link names, and the link stays."""
    big = case / "big"
    big.mkdir()
    links = {"latest": "pkg", "s.csv": "s1.csv", "d": "data"}
    for name in ("pkg", "data"):
        shutil.move(case / name, big / name)
    (big / "s1.csv").write_text("")
    for link, target in links.items():
        (case / link).symlink_to(big / target)
    steps = [["export", str(case / "run"), str(case / "latest"), "--overwrite", "-q"],
             ["predict", str(case / "latest"), str(case / "new.csv"), "--format", "csv", "-q", "--out",
              str(case / "s.csv"), "--overwrite"],
             ["data", "convert", "csv", str(case / "new.csv"), str(case / "d"), "--spec", str(case / "spec.yaml"),
              "--overwrite", "-q"]]
    for argv in steps:
        done = runner.invoke(app, argv)
        assert done.exit_code == 0, (argv, done.output)
    for link, target in links.items():
        assert (case / link).is_symlink() and (case / link).resolve() == (big / target).resolve(), link
    assert len(pd.read_csv(big / "s1.csv")) == 40
    assert json.loads((big / "data" / "_flowrec.json").read_text())["rows"] == 40
    assert sorted(p.name for p in big.iterdir()) == sorted(links.values())  # nothing left beside them
    assert not [p.name for p in case.iterdir() if p.name.startswith(".")]


def test_predict_of_a_parquet_folder_a_job_still_writes_into_says_so(case: Path):
    """`predict PKG raw/ --format parquet` while a Spark job still wrote into raw/ (its
    `_temporary/`) scored the committed rows and said nothing of the others; now one warning line
    names the folder. The scores are those of the committed rows alone."""
    rng = np.random.default_rng()
    raw = case / "raw"
    (raw / "_temporary" / "0").mkdir(parents=True)
    committed = raw_rows(int(rng.integers(5, 40)), int(rng.integers(1, 10**6)))
    committed.to_parquet(raw / "part-0.parquet")
    raw_rows(int(rng.integers(5, 40)), int(rng.integers(1, 10**6))).to_parquet(raw / "_temporary" / "0" / "part-1.parquet")
    (raw / "_SUCCESS").write_text("")
    done = runner.invoke(app, ["predict", str(case / "pkg"), str(raw), "--format", "parquet", "-q", "--out",
                               str(case / "s.parquet")])
    assert done.exit_code == 0, done.output
    lines = [line for line in done.output.splitlines() if "still writing" in line]
    assert len(lines) == 1 and f"{raw}/_temporary" in lines[0] and "_SUCCESS" not in done.output, done.output
    assert len(pd.read_parquet(case / "s.parquet")) == len(committed)


def test_scores_that_are_not_finite_are_one_warning(case: Path, monkeypatch) -> None:
    """A package whose model computes NaN for some rows (a custom module overflowing) wrote empty
    score cells with only 'wrote N scored rows'. Now one warning counts them and names the first
    row; the rows are still written (a finite run of the same rows has no warning)."""
    from flowrec.serving import predict as serving

    real = serving.load_model
    rng = np.random.default_rng()
    broken = sorted(rng.choice(40, size=int(rng.integers(2, 6)), replace=False).tolist())

    def load_model(path):
        model = real(path)
        score = model.predict

        def predict_nan(rows):
            frame = score(rows)
            frame.loc[frame.index.isin(broken), "ctr"] = rng.choice([np.nan, np.inf, -np.inf], len(broken))
            return frame

        model.predict = predict_nan
        return model

    clean = runner.invoke(app, out("clean.parquet")(case))
    assert clean.exit_code == 0 and "warning" not in clean.stderr, clean.output
    monkeypatch.setattr(serving, "load_model", load_model)
    done = runner.invoke(app, out("scores.parquet")(case))
    assert done.exit_code == 0, done.output
    warned = [line for line in done.stderr.splitlines() if "not a finite number" in line]
    assert len(warned) == 1 and warned[0].startswith(f"warning: {len(broken)} of 40 rows"), done.stderr
    assert f"the first is row {broken[0]} of the output" in warned[0]
    scores = pd.read_parquet(case / "scores.parquet")["ctr"]
    assert len(scores) == 40 and sorted(np.flatnonzero(~np.isfinite(scores.to_numpy(dtype=float))).tolist()) == broken


def test_predict_of_rows_in_another_encoding_says_to_write_them_in_the_packages(case: Path) -> None:
    """predict of a latin-1 file said 'another encoding? set data.options.encoding', an option
    predict does not take (it reads with the package's spec); it now says to write the file in the
    package's encoding, naming the file, and writes nothing."""
    frame = pd.read_csv(case / "new.csv")
    rng = np.random.default_rng()
    frame.loc[int(rng.integers(len(frame))), "user"] = "caf\u00e9"
    (case / "new.csv").write_bytes(frame.to_csv(index=False).encode("latin-1"))
    done = runner.invoke(app, out("scores.parquet")(case))
    one_line_exit_2(done, "the package reads utf-8 text: write the file in it (e.g. iconv -f latin1 -t utf-8 new.csv)")
    assert "data.options" not in done.stderr and not (case / "scores.parquet").exists()


def test_predict_of_tab_separated_rows_for_a_comma_package_names_the_separator(case: Path) -> None:
    """predict of a tab-separated file for a package trained on comma CSV said only 'the rows lack
    columns [...] that model ... reads' (every column: the header read as one name); data convert
    named the separator. It now says the header looks tab-separated and what the package reads."""
    frame = pd.read_csv(case / "new.csv").sample(frac=1.0, random_state=int(np.random.default_rng().integers(1 << 30)))
    frame.to_csv(case / "new.csv", sep="\t", index=False)
    done = runner.invoke(app, out("scores.parquet")(case))
    one_line_exit_2(done, "the header looks tab-separated, where the package reads ','-separated text: write the rows with ','")
    assert not (case / "scores.parquet").exists()


@pytest.mark.parametrize("free", [4096, 64 << 30])
def test_an_export_that_fails_on_a_full_disk_says_the_disk_is_full(case: Path, monkeypatch, free: int):
    """`flowrec export RUN full/pkg` on a full disk said torch's 'cannot export to full/pkg: basic_ios::clear:
    iostream error', naming neither the disk nor the cause; now the line adds the free space of the
    disk holding OUT when it is nearly none (and nothing when there is room: another cause)."""
    import collections

    import flowrec.serving.export as export

    def full_disk(*args, **kwargs):
        raise RuntimeError("basic_ios::clear: iostream error")

    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(export, "write_package", full_disk)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(1 << 40, (1 << 40) - free, free))
    done = runner.invoke(app, ["export", str(case / "run"), str(case / "new_pkg"), "-q"])
    one_line_exit_2(done, f"cannot export to {case / 'new_pkg'}: basic_ios::clear: iostream error")
    said = f" (the disk holding {case} has 4.0 KiB free: it is full, most likely; free space there or export elsewhere)"
    assert done.stderr.strip().endswith(said) == (free == 4096), done.stderr
    assert not (case / "new_pkg").exists() and not [p for p in case.iterdir() if p.name.startswith(".")]
