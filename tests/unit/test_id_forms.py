"""Ids of hashed and managed tables written in another form than the training rows wrote them.

A hashed table hashes an id's text and a managed table keeps its text's hash: with no vocabulary
to look ids up in, a CSV pandas wrote from an integer column with a missing value ("12.0") was
scored as ids never seen (hashed: other rows; managed: new ids), without a word. Conversion now
records each feature's form with the encoder and predict says where new rows write it otherwise.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.data.id_forms import IdForms, checked_forms, other_form, written_form

runner = CliRunner()


def _spec(table: str) -> dict:
    """A model of a dense price and a user id, the user's table `table`: hashed or managed."""
    user = {"name": "user", "type": "categorical", "dim": 4}
    if table == "hashed":
        user["hash_buckets"] = 97
    else:
        user["table"] = "users"
    doc = {"name": f"forms_{table}", "features": [{"name": "price", "type": "dense"}, user],
           "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}],
           "data": {"format": "csv", "label": "clicked"},
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
           "training": {"batch_size": 16}}
    if table == "managed":
        doc["tables"] = [{"name": "users", "dim": 4, "managed": {"rows": 64, "admit_min_count": 1,
                                                                 "every_steps": 4}}]
    return doc


def _rows(rng: np.random.Generator, n: int) -> pd.DataFrame:
    """Fresh skewed rows: Zipf user ids (a few users most of the rows), random prices and clicks."""
    users = rng.zipf(1.3, n) % 5_000 + int(rng.integers(1, 1_000))
    return pd.DataFrame({"price": rng.lognormal(1.0, 1.5, n), "user": users,
                         "clicked": (rng.random(n) < 0.3).astype(int)})


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_ids_written_as_floats_after_training_on_integers_are_said(table: str, tmp_path: Path) -> None:
    rng = np.random.default_rng()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(table)))
    rows = _rows(rng, 400)
    rows.to_csv(tmp_path / "train.csv", index=False)
    floats = rows.astype({"user": float})
    floats.loc[int(rng.integers(0, len(rows))), "user"] = np.nan  # as pandas writes a column missing an id
    floats.to_csv(tmp_path / "floats.csv", index=False)
    assert ".0," in (tmp_path / "floats.csv").read_text()
    for args in (["data", "convert", "csv", tmp_path / "train.csv", tmp_path / "ds", "--spec", spec, "-q"],
                 ["train", spec, "--data", tmp_path / "ds", "--out", tmp_path / "run", "--max-steps", "4",
                  "--device", "cpu", "-q"],
                 ["export", tmp_path / "run", tmp_path / "pkg", "-q"]):
        made = runner.invoke(app, [str(a) for a in args])
        assert made.exit_code == 0, made.output
    recorded = json.loads((tmp_path / "pkg" / "encoder.json").read_text())["id_forms"]
    assert recorded["user"]["form"] == "integers"
    said = {}
    for name in ("floats", "train"):
        scored = runner.invoke(app, ["predict", str(tmp_path / "pkg"), str(tmp_path / f"{name}.csv"), "--format",
                                     "csv", "--out", str(tmp_path / f"{name}-scores.csv"), "-q"])
        assert scored.exit_code == 0, scored.output
        said[name] = [x for x in scored.output.splitlines() if x.startswith("warning: column user: ")]
    (line,) = said["floats"]
    assert "written as integral floats" in line and "as integers" in line and "write column user as" in line
    assert ("managed table 'users'" if table == "managed" else "hashed table") in line
    assert said["train"] == []  # the training rows' own form: nothing said
    converted = runner.invoke(app, [str(a) for a in ["data", "convert", "csv", tmp_path / "floats.csv",
                                                     tmp_path / "ds2", "--spec", spec, "-q", "--encoder-from",
                                                     tmp_path / "run"]])
    assert converted.exit_code == 0 and "the ids of feature user are written as integral floats" in converted.output
    import flowrec.serving.predict as serving

    model = serving.load_model(tmp_path / "pkg")
    some = floats.dropna().head(int(rng.integers(5, 50)))
    with pytest.warns(UserWarning, match="column user: the ids of feature user are written as integral floats"):
        model.predict(some.assign(user=some.user.map(lambda u: f"{u:.1f}")))
    assert len(model.unseen_ids().lines()) == 1
    model = serving.load_model(tmp_path / "pkg")
    model.predict(some)  # a float column of a DataFrame: 3.0 is the id "3", as trained
    assert model.unseen_ids().lines() == []
    doc = json.loads((tmp_path / "run" / "encoder" / "encoder.json").read_text())
    del doc["id_forms"]  # a run recorded before forms were, and its package: no warning, no failure
    (tmp_path / "run" / "encoder" / "encoder.json").write_text(json.dumps(doc))
    assert runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "old"), "-q"]).exit_code == 0
    scored = runner.invoke(app, ["predict", str(tmp_path / "old"), str(tmp_path / "floats.csv"), "--format", "csv",
                                 "--out", str(tmp_path / "old-scores.csv"), "-q"])
    assert scored.exit_code == 0 and "warning: column user" not in scored.output, scored.output


def test_forms_of_random_ids() -> None:
    rng = np.random.default_rng()
    ids = rng.zipf(1.2, 3_000) % 10**9
    texts = [str(i) for i in ids]
    assert written_form(pa.array(texts))[0] == "integers"
    assert written_form(pa.array([f"{i}.0" for i in ids]))[0] == "integral floats"
    assert written_form(pa.array(ids.astype(float)))[0] == "integers"  # floats' text: 3.0 is "3"
    assert written_form(pa.array([f" {t}" for t in texts]))[0] == "space-padded integers"
    flags = rng.random(500) < 0.2
    assert written_form(pa.array(flags))[0] == "true/false"
    assert written_form(pa.array([str(bool(f)) for f in flags]))[0] == "True/False"
    assert written_form(pa.array([None, ""], pa.string())) is None
    assert other_form("true/false", "True/False") and other_form("integers", "space-padded integers")
    assert other_form("times", "times with a fraction of a second") and not other_form("integers", "integers")
    assert not other_form("text", "integers") and not other_form("integers", "text")
    assert not other_form("integers", "true/false")


def test_a_record_of_several_forms_or_hand_edited_tells_nothing() -> None:
    from flowrec.data.encode import Encoder
    from flowrec.spec import spec_from_dict

    spec = spec_from_dict(_spec("hashed"))
    rng = np.random.default_rng()
    ids = rng.zipf(1.4, 200) % 700
    forms = IdForms()
    encoder = Encoder(spec, {}, {}, {})
    forms.observe(encoder, pa.table({"user": [str(i) for i in ids]}))
    assert forms.record()["user"]["form"] == "integers"
    forms.observe(encoder, pa.table({"user": [f"{i}.0" for i in ids]}))
    assert forms.record() == {}  # trained on both forms: neither is another
    assert checked_forms({"user": {"form": 3}, "x": "integers", 5: {}}) == {}
    assert checked_forms([1]) == {} and checked_forms(None) == {}


@pytest.mark.parametrize("table", ["managed", "hashed"])
def test_a_day_of_a_stream_that_writes_its_ids_as_floats_is_said(table: str, tmp_path: Path) -> None:
    """Days converted one by one (a hashed or managed spec needs no encoder to convert with): a day
    pandas wrote with a missing user id ("12.0") trained every user of it as a new id (a managed
    table gave each a second row) without a word. The stream says so for that day; a later day of
    integers again is the trained form (the first day's, kept by each day's run): nothing said.
    The day's progressive evaluation (d1's model scoring d2 before training on it) scored every
    user of it as never seen without a word: it says so too, once for the day, and again where the
    day's training is resumed (a resumed run compares no forms)."""
    rng = np.random.default_rng()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(table)))
    days = tmp_path / "days"
    for day in ("d1", "d2", "d3"):
        rows = _rows(rng, int(rng.integers(150, 300)))
        if day == "d2":
            rows = rows.astype({"user": float})
            rows.loc[int(rng.integers(0, len(rows))), "user"] = np.nan
        rows.to_csv(tmp_path / f"{day}.csv", index=False)
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / f"{day}.csv"), str(days / day), "--spec",
                                   str(spec), "-q"])
        assert made.exit_code == 0, made.output
    follow = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(tmp_path / "stream"),
                                 "--max-steps", "3", "--device", "cpu", "-q"])
    assert follow.exit_code == 0, follow.output
    said = [x for x in follow.output.splitlines() if "the ids of feature user are written as" in x]
    scored, line = said  # d2 scored by d1's model, then trained on: once each, not per batch
    assert scored.startswith(f"warning: evaluation data {days / 'd2'}: column user: ") and "integral floats" in scored
    assert line.startswith(f"warning: training data {days / 'd2'}: column user: ") and "integral floats" in line
    assert ("managed table 'users'" if table == "managed" else "hashed table") in line
    progressive = [json.loads(x) for x in (tmp_path / "stream" / "metrics.jsonl").read_text().splitlines()
                   if '"progressive"' in x]
    assert [x["day"] for x in progressive] == ["d2", "d3"]
    stream = json.loads((tmp_path / "stream" / "follow.json").read_text())
    (tmp_path / "stream" / "follow.json").write_text(json.dumps({**stream, "days": ["d1"]}))  # as if d2's cut short
    (days / "d3").rename(tmp_path / "d3-later")
    again = runner.invoke(app, ["train", str(spec), "--follow", str(days), "--out", str(tmp_path / "stream"),
                                "--max-steps", "3", "--device", "cpu", "-q"])
    assert again.exit_code == 0, again.output
    said = [x for x in again.output.splitlines() if "the ids of feature user are written as" in x]
    assert [x.split(": column")[0] for x in said] == [f"warning: evaluation data {days / 'd2'}"], again.output


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_evaluation_data_that_writes_its_ids_as_floats_is_said(table: str, tmp_path: Path) -> None:
    """Evaluation data converted on its own (no --encoder-from: a hashed or managed spec needs none)
    from rows pandas wrote with a missing user id ("12.0") has the run's fingerprint, so `train
    --eval-data`, `flowrec.train(eval_data=)`, `eval --data` and `Run.evaluate(data=)` scored every
    user of it as never seen without a word. Each says so in one line; data of the training rows'
    form is not warned of."""
    spec = tmp_path / "spec.json"
    _, _, trained = _run_scoring_floats(tmp_path, table, np.random.default_rng())
    said = "the ids of feature user are written as integral floats"
    (line,) = [x for x in trained.output.splitlines() if said in x]
    assert line.startswith(f"warning: evaluation data {tmp_path / 'floats'}: column user: ")
    assert ("managed table 'users'" if table == "managed" else "hashed table") in line
    for data, lines in (("floats", 1), ("train", 0)):
        scored = runner.invoke(app, ["eval", str(tmp_path / "run"), "--data", str(tmp_path / data)])
        assert scored.exit_code == 0, scored.output
        found = [x for x in scored.output.splitlines() if said in x]
        assert len(found) == lines, scored.output
        assert all(x.startswith(f"warning: evaluation data {tmp_path / data}: column user: ") for x in found)
    import warnings

    import flowrec

    run = flowrec.load(tmp_path / "run", device="cpu")
    with pytest.warns(UserWarning, match=f"evaluation data .*: column user: {said}"):
        run.evaluate(data=tmp_path / "floats")
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        run.evaluate(data=tmp_path / "train")
    with pytest.warns(UserWarning, match=f"evaluation data .*: column user: {said}"):  # out=None too
        flowrec.train(spec, data=tmp_path / "train", eval_data=tmp_path / "floats", max_steps=2, device="cpu")
    child = runner.invoke(app, ["train", str(spec), "--data", str(tmp_path / "floats"), "--init-from",
                                str(tmp_path / "run"), "--eval-data", str(tmp_path / "train"), "--out",
                                str(tmp_path / "child"), "--max-steps", "2", "--device", "cpu", "-q"])
    assert child.exit_code == 0, child.output
    (line,) = [x for x in child.output.splitlines() if said in x]  # the parent's form: its eval data not warned
    assert line.startswith(f"warning: training data {tmp_path / 'floats'}: column user: ")


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_data_inspect_shows_the_recorded_forms_of_ids(table: str, tmp_path: Path) -> None:
    """Which form a dataset's hashed or managed ids were recorded in (what predict, eval and
    --init-from compare new rows with) was to be read only in _flowrec.json: `data inspect` shows a
    line per such feature, `--json` the record; a split dataset's each part."""
    rng = np.random.default_rng()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(table)))
    rows = _rows(rng, int(rng.integers(200, 500)))
    floats = bool(rng.integers(0, 2))
    if floats:
        rows = rows.astype({"user": float})
        rows.loc[int(rng.integers(0, len(rows))), "user"] = np.nan
    rows.to_csv(tmp_path / "rows.csv", index=False)
    made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / "rows.csv"), str(tmp_path / "ds"), "--spec",
                               str(spec), "--test-fraction", "0.2", "-q"])
    assert made.exit_code == 0, made.output
    form = "integral floats" if floats else "integers"
    shown = runner.invoke(app, ["data", "inspect", str(tmp_path / "ds")])
    assert shown.exit_code == 0, shown.output
    lines = [x for x in shown.output.splitlines() if x.startswith("ids of feature user: ")]
    assert len(lines) == 2, shown.output  # train/ and test/
    if floats:  # the first id, as the CSV writes it (read as text)
        example = f"{rows.user.dropna().iloc[0]:.1f}"
    else:  # integers: their narrowest (what lost zeros are told by; the sample holds every row here)
        ids = [str(u) for u in rows.user]
        example = next(u for u in ids if len(u) == min(map(len, ids)))
    assert lines[0] == f"ids of feature user: written as {form} ({example!r}, read as string)", lines
    assert all(x.startswith(f"ids of feature user: written as {form} (") for x in lines)
    doc = json.loads(runner.invoke(app, ["data", "inspect", str(tmp_path / "ds"), "--json"]).output)
    assert doc["train"]["id_forms"]["user"]["form"] == form and doc["train"]["id_forms"]["user"]["column"] == "user"


def _run_scoring_floats(tmp_path: Path, table: str, rng: np.random.Generator) -> tuple[Path, Path, Any]:
    """A run trained on integer user ids (fresh skewed rows) whose --eval-data writes them as floats
    (pandas' "12.0" for a column missing an id), each converted on its own: (the run, the floats,
    the training command's result)."""
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(table)))
    _rows(rng, int(rng.integers(200, 400))).to_csv(tmp_path / "train.csv", index=False)
    floats = _rows(rng, int(rng.integers(100, 300))).astype({"user": float})
    floats.loc[int(rng.integers(0, len(floats))), "user"] = np.nan
    floats.to_csv(tmp_path / "floats.csv", index=False)
    for name in ("train", "floats"):
        made = runner.invoke(app, ["data", "convert", "csv", str(tmp_path / f"{name}.csv"), str(tmp_path / name),
                                   "--spec", str(spec), "-q"])
        assert made.exit_code == 0, made.output
    trained = runner.invoke(app, ["train", str(spec), "--data", str(tmp_path / "train"), "--eval-data",
                                  str(tmp_path / "floats"), "--out", str(tmp_path / "run"), "--max-steps", "3",
                                  "--device", "cpu", "-q"])
    assert trained.exit_code == 0, trained.output
    return tmp_path / "run", tmp_path / "floats", trained


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_eval_reads_the_encoder_record_of_its_data_once(table: str, tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """`flowrec eval RUN --data D` (and `Run.evaluate(data=D)`) read D's _flowrec.json for the
    encoder check and again for the forms of its ids: a conversion replacing D in between was
    checked by one record and warned of by another. One record serves both; the warning stays."""
    import flowrec
    import flowrec.serving.trained as trained

    run, floats, _ = _run_scoring_floats(tmp_path, table, np.random.default_rng())
    read = []
    real = trained.record_of_dataset
    monkeypatch.setattr(trained, "record_of_dataset", lambda path, *more: read.append(Path(path)) or real(path, *more))
    scored = runner.invoke(app, ["eval", str(run), "--data", str(floats)])
    assert scored.exit_code == 0, scored.output
    assert read == [floats]
    (line,) = [x for x in scored.output.splitlines() if "the ids of feature user are written as integral floats" in x]
    assert line.startswith(f"warning: evaluation data {floats}: column user: ")
    read.clear()
    with pytest.warns(UserWarning, match="evaluation data .*: column user: the ids of feature user are written"):
        flowrec.load(run, device="cpu").evaluate(data=floats)
    assert read == [floats]


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_export_says_when_the_rows_of_its_score_check_write_ids_otherwise(table: str, tmp_path: Path) -> None:
    """`export --dtype fp16` measures the largest score difference on the run's evaluation data;
    where that data writes the ids in another form than the training rows (converted on its own
    from rows pandas wrote with a missing id), its hashed ids land in other rows and its managed
    ones are all unseen, so the rows compared do not score as trained, without a word. It is a
    warning line (the package is written); the training rows' form, or fp32 (no check), says nothing."""
    rng = np.random.default_rng()
    run, floats, _ = _run_scoring_floats(tmp_path, table, rng)
    said = "the ids of feature user are written as integral floats"
    for dtype, out, lines in (("fp16", "pkg", 1), ("fp32", "pkg32", 0)):
        made = runner.invoke(app, ["export", str(run), str(tmp_path / out), "--dtype", dtype])
        assert made.exit_code == 0, made.output
        assert (tmp_path / out / "model.pt2").is_file()
        found = [x for x in made.output.splitlines() if said in x]
        assert len(found) == lines, made.output
        assert all(x.startswith(f"warning: the score difference is measured on the run's evaluation data {floats}: "
                                "column user: ") for x in found)
    own = runner.invoke(app, ["train", str(tmp_path / "spec.json"), "--data", str(tmp_path / "train"), "--eval-data",
                              str(tmp_path / "train"), "--out", str(tmp_path / "own"), "--max-steps", "3",
                              "--device", "cpu", "-q"])
    assert own.exit_code == 0, own.output
    made = runner.invoke(app, ["export", str(tmp_path / "own"), str(tmp_path / "pkg-own"), "--dtype", "bf16"])
    assert made.exit_code == 0 and "largest score difference" in made.output, made.output
    assert said not in made.output


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_a_parquet_folder_of_text_ids_in_several_arrow_types_is_read_as_one_text(table: str, tmp_path: Path) -> None:
    """Files of one folder holding the id column as Arrow string (Spark, pyarrow), large_string
    (polars) and a dictionary of strings (pandas' categories) were refused ('a column holds one
    type in every file'), though each holds the same text: each file is read with its own type, and
    every id encodes as in a folder of strings alone (no two ids merged, none split)."""
    import pyarrow.parquet as pq

    from flowrec.data.convert import convert
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    doc = _spec(table)
    doc["data"]["format"] = "parquet"
    spec = spec_from_dict(doc)
    kinds = [pa.string(), pa.large_string(), "categories"]
    parts = []
    for i in range(int(rng.integers(3, 6))):
        rows = _rows(rng, int(rng.integers(50, 200)))
        users = [f"u{x:05d}" if rng.random() < 0.9 else None for x in rows.user]
        parts.append((rows.assign(user=users), kinds[i % len(kinds)] if i < len(kinds) else
                      kinds[int(rng.integers(0, len(kinds)))]))
    encoded = {}
    for folder in ("mixed", "strings"):
        (tmp_path / folder).mkdir()
        for i, (rows, kind) in enumerate(parts):
            kind = pa.string() if folder == "strings" else kind
            user = (pa.array(rows.user, pa.string()).dictionary_encode() if kind == "categories"
                    else pa.array(rows.user, kind))
            pq.write_table(pa.table({"price": rows.price, "user": user, "clicked": rows.clicked}),
                           tmp_path / folder / f"part-{i}.parquet")
        assert convert(spec, "parquet", [tmp_path / folder], tmp_path / f"{folder}-out").rows == sum(
            len(rows) for rows, _ in parts)
        encoded[folder] = pq.read_table(tmp_path / f"{folder}-out").column("user").to_pylist()
    assert encoded["mixed"] == encoded["strings"]
    raw = [u for rows, _ in parts for u in rows.user]
    if table == "managed":  # a 64-bit hash per id's text: as many as the raw ids
        assert len({e for e, u in zip(encoded["mixed"], raw) if u is not None}) == len({u for u in raw if u})


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_ids_beyond_int64_that_pandas_read_as_python_ints_are_one_line_naming_the_column(table: str,
                                                                                       tmp_path: Path) -> None:
    """A CSV of ids beyond int64 trains (ids are their text), but pd.read_csv of it gives an object
    column of Python ints, and `model.predict` of that frame said 'a column holds an integer beyond
    64 bits; ... ids at most 64-bit integers', naming no column and wrongly (the package holds such
    ids). The line names the column, the row and the remedy; the remedy scores as the CSV does."""
    import pyarrow.parquet as pq

    import flowrec.serving.predict as serving
    from flowrec.data.layout import DataError

    rng = np.random.default_rng()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(table)))
    rows = _rows(rng, int(rng.integers(200, 400)))
    base = int(rng.choice([2 ** 64, 2 ** 70]))  # (ints of 2**63 or more beside negative ones pandas reads as text)
    rows["user"] = [base + int(u) if rng.random() < 0.7 else -int(u) for u in rows.user]
    rows.to_csv(tmp_path / "rows.csv", index=False)
    for args in (["data", "convert", "csv", tmp_path / "rows.csv", tmp_path / "ds", "--spec", spec, "-q"],
                 ["train", spec, "--data", tmp_path / "ds", "--out", tmp_path / "run", "--max-steps", "3",
                  "--device", "cpu", "-q"],
                 ["export", tmp_path / "run", tmp_path / "pkg", "-q"],
                 ["predict", tmp_path / "pkg", tmp_path / "rows.csv", "--format", "csv", "--out",
                  tmp_path / "scores.parquet", "-q"]):
        made = runner.invoke(app, [str(a) for a in args])
        assert made.exit_code == 0, made.output
    read = pd.read_csv(tmp_path / "rows.csv")
    assert read.user.dtype == object  # Python ints, as pandas reads them
    model = serving.load_model(tmp_path / "pkg")
    with pytest.raises(DataError, match=r"column user holds the integer -?[0-9]+ at row [0-9]+ \(0-based\), beyond "
                                        r".*\.astype\(\"string\"\)") as caught:
        model.predict(read.drop(columns="clicked"))
    assert "\n" not in str(caught.value)
    scores = model.predict(read.drop(columns="clicked").astype({"user": "string"}))
    cli = pq.read_table(tmp_path / "scores.parquet").column("ctr").to_numpy()
    np.testing.assert_array_equal(np.asarray(scores["ctr"], dtype=cli.dtype), cli)


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_ids_as_half_floats_encode_as_their_integers(table: str, tmp_path: Path) -> None:
    """A Parquet file (or a frame) whose id column is float16 (pandas' and numpy's half floats) was
    Arrow's 'Function floor has no kernel matching input types (halffloat)': a traceback of
    `data convert`, the same words from `predict` and `model.predict`. Half floats are exact as
    float32: each id encodes as its integer does; one of 2**11 or more (which a half float may
    have rounded from another) is one line, as for other floats."""
    import pyarrow.parquet as pq

    from flowrec.data.convert import convert
    from flowrec.data.layout import DataError
    from flowrec.data.raw_ids import raw_id_hashes
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    doc = _spec(table)
    doc["data"]["format"] = "parquet"
    spec = spec_from_dict(doc)
    rows = _rows(rng, int(rng.integers(100, 300)))
    users = (rows.user % 2000).astype(float)
    users[rng.random(len(users)) < 0.1] = np.nan
    half = users.astype(np.float16)
    assert (half.dropna().astype(float) == users.dropna()).all()  # every id below 2**11 is exact
    np.testing.assert_array_equal(raw_id_hashes(pa.array(half)), raw_id_hashes(pa.array(users.astype("Int64"))))
    encoded = []
    for name, column in (("half", pa.array(half)), ("ints", pa.array(users.astype("Int64")))):
        pq.write_table(pa.table({"price": rows.price, "user": column, "clicked": rows.clicked}),
                       tmp_path / f"{name}.parquet")
        convert(spec, "parquet", [tmp_path / f"{name}.parquet"], tmp_path / name)
        encoded.append(pq.read_table(tmp_path / name).column("user").to_pylist())
    assert encoded[0] == encoded[1]
    big = half.copy()
    big.iloc[int(rng.integers(0, len(big)))] = np.float16(2 ** 11 + 2 * int(rng.integers(0, 100)))
    pq.write_table(pa.table({"price": rows.price, "user": pa.array(big), "clicked": rows.clicked}),
                   tmp_path / "big.parquet")
    with pytest.raises(DataError, match=r"column user: id [0-9.]+ at row [0-9]+ \(1-based\) is a float of magnitude "
                                        r"2\*\*11 or more"):
        convert(spec, "parquet", [tmp_path / "big.parquet"], tmp_path / "big")


def test_forms_of_zero_padded_ids() -> None:
    """Ids written zero-padded to one width are a form of their own; plain integers of one width,
    or padded and plain ids mixed, are integers; a sample narrower than the padded training ids
    is told from them, one as wide is not (a few wide padded ids none of which starts with 0)."""
    from flowrec.data.encode import Encoder
    from flowrec.data.id_forms import ZEROS, unpadded
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    width = int(rng.integers(4, 9))
    ids = rng.zipf(1.3, 2_000) % 10 ** (width - 1)
    padded = [f"{i:0{width}d}" for i in ids]
    assert written_form(pa.array(padded)) == (ZEROS, next(t for t in padded if t.startswith("0")))
    assert written_form(pa.array([str(i) for i in ids]))[0] == "integers"
    assert written_form(pa.array(padded[:5] + [str(i) for i in ids[5:]]))[0] == "integers"  # mixed widths
    wide = [str(10 ** (width - 1) + int(i)) for i in ids]  # one width, none starting with 0
    assert written_form(pa.array(wide))[0] == "integers"
    rule = {"form": ZEROS, "example": padded[0]}
    assert other_form(ZEROS, "integers") and other_form(ZEROS, "integral floats")
    assert not other_form("integers", ZEROS)  # a run recorded before padded ids were told: no warning
    short = next(str(i) for i in ids if len(str(i)) < width)
    assert unpadded(rule, "integers", short) and not unpadded(rule, "integers", wide[0])
    forms = IdForms()
    encoder = Encoder(spec_from_dict(_spec("hashed")), {}, {}, {})
    forms.observe(encoder, pa.table({"user": padded}))
    assert forms.record()["user"]["form"] == ZEROS
    forms.observe(encoder, pa.table({"user": wide}))  # a later chunk of ids as wide, none starting with 0: padded
    assert forms.record()["user"]["form"] == ZEROS
    forms.observe(encoder, pa.table({"user": [short]}))  # a later chunk of a narrower id: integers
    assert forms.record()["user"] == {"form": "integers", "example": short, "type": "string"}


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_zero_padded_ids_read_by_pandas_as_numbers_are_said(table: str, tmp_path: Path) -> None:
    """A CSV of ids padded with zeros (00123) trains on their text, but `pd.read_csv` of it makes
    them numbers (123), so `model.predict(pd.read_csv(...))`, or data a pandas round trip wrote
    (`eval --data`), scored each as an id never seen (a managed table: a new id) without a word.
    Each says so in one line; the CSV itself, and a few padded ids none of which starts with a
    zero, say nothing."""
    import warnings

    import flowrec.serving.predict as serving

    rng = np.random.default_rng()
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps(_spec(table)))
    width = int(rng.integers(5, 9))
    rows = _rows(rng, int(rng.integers(200, 400)))
    rows["user"] = [f"{int(u) % 10 ** (width - 1):0{width}d}" for u in rows.user]
    rows.to_csv(tmp_path / "rows.csv", index=False)
    pd.read_csv(tmp_path / "rows.csv").to_csv(tmp_path / "lost.csv", index=False)  # a pandas round trip
    lost = pd.read_csv(tmp_path / "lost.csv", dtype={"user": "string"}).user
    assert not lost.str.startswith("0").any() and lost.str.len().min() < width  # the zeros gone
    for args in (["data", "convert", "csv", tmp_path / "rows.csv", tmp_path / "ds", "--spec", spec, "-q"],
                 ["data", "convert", "csv", tmp_path / "lost.csv", tmp_path / "lost", "--spec", spec, "-q"],
                 ["train", spec, "--data", tmp_path / "ds", "--out", tmp_path / "run", "--max-steps", "3",
                  "--device", "cpu", "-q"],
                 ["export", tmp_path / "run", tmp_path / "pkg", "-q"]):
        made = runner.invoke(app, [str(a) for a in args])
        assert made.exit_code == 0, made.output
    said = "the ids of feature user are written as integers"
    for data, lines in (("lost", 1), ("ds", 0)):
        scored = runner.invoke(app, ["eval", str(tmp_path / "run"), "--data", str(tmp_path / data)])
        assert scored.exit_code == 0, scored.output
        found = [x for x in scored.output.splitlines() if said in x]
        assert len(found) == lines, scored.output
        assert all("zero-padded integers" in x and "read_csv" in x for x in found)
    scored = runner.invoke(app, ["predict", str(tmp_path / "pkg"), str(tmp_path / "rows.csv"), "--format", "csv",
                                 "--out", str(tmp_path / "scores.csv"), "-q"])
    assert scored.exit_code == 0 and "warning" not in scored.output, scored.output
    model = serving.load_model(tmp_path / "pkg")
    with pytest.warns(UserWarning, match=f"column user: {said} .*zero-padded integers"):
        model.predict(pd.read_csv(tmp_path / "rows.csv").drop(columns="clicked"))
    wide = rows.head(int(rng.integers(1, 5))).copy()  # as wide as the training ids, none starting with 0
    wide["user"] = [str(10 ** (width - 1) + int(i)) for i in rng.integers(0, 10 ** (width - 1), len(wide))]
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        serving.load_model(tmp_path / "pkg").predict(wide.drop(columns="clicked"))


def test_ids_that_lost_their_zeros_in_a_later_sample_are_told() -> None:
    """Ids written as integers were told from zero-padded training ids by their first sample's
    example alone: a first chunk (or predict call) of padded ids as wide as training's, none
    starting with 0, hid every later chunk whose ids had lost their zeros. The narrowest id of
    every sample written as integers is kept, and the line shows it."""
    from flowrec.data.encode import Encoder
    from flowrec.data.id_forms import ZEROS
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    width = int(rng.integers(5, 9))
    encoder = Encoder(spec_from_dict(_spec("hashed")), {}, {}, {})
    training = IdForms()
    ids = rng.zipf(1.3, 3_000) % 10 ** (width - 1)
    training.observe(encoder, pa.table({"user": [f"{i:0{width}d}" for i in ids]}))
    rule = training.record()
    assert rule["user"]["form"] == ZEROS
    new = IdForms()
    wide = rng.integers(10 ** (width - 1), 10 ** width, int(rng.integers(1, 50)))
    new.observe(encoder, pa.table({"user": [str(i) for i in wide]}))  # padded ids, none starting with 0
    assert new.lines(encoder, rule) == []
    later = IdForms()  # a later call's (or chunk's) rows: the zeros gone
    lost = rng.zipf(1.3, int(rng.integers(50, 500))) % 10 ** (width - 1)
    later.observe(encoder, pa.table({"user": [str(i) for i in lost]}))
    new.add(later)
    (line,) = new.lines(encoder, rule)
    narrowest = min((str(i) for i in lost), key=len)
    assert f"written as integers ({narrowest!r})" in line and "zero-padded integers" in line


def test_an_id_column_of_values_without_text_is_one_line_naming_it() -> None:
    """An id column of intervals (pandas' DateOffset objects, in a frame or an Arrow table given to
    `model.predict`) was Arrow's 'Unsupported cast from month_day_nano_interval to utf8': ids are
    their text, and such values have none. It is one line naming the column; ids of other types
    (half floats, durations, decimals, dates) pass the check."""
    from flowrec.data.layout import DataError
    from flowrec.data.raw_ids import check_ids

    rng = np.random.default_rng()
    months = [pd.DateOffset(months=int(m)) for m in rng.zipf(1.5, int(rng.integers(2, 40))) % 24]
    frame = pd.DataFrame({"price": rng.lognormal(1.0, 1.5, len(months)), "user": months})
    column = pa.Table.from_pandas(frame).column("user")
    assert pa.types.is_interval(column.type)
    with pytest.raises(DataError, match=r"^column user holds month_day_nano_interval values, which have no text"):
        check_ids(column, "user", False)
    with pytest.raises(DataError, match=r"^column user holds list<item: month_day_nano_interval> values, which have"):
        check_ids(pa.array([[m] for m in column.to_pylist()], pa.list_(column.type)), "user", True)
    ints = rng.zipf(1.3, 50) % 1000
    for fine in (pa.array(ints.astype(np.float16)), pa.array(ints.astype("timedelta64[s]")),
                 pa.array([str(i) for i in ints]).cast(pa.decimal128(10, 0)), pa.array(ints.astype("datetime64[D]"))):
        check_ids(fine, "user", False)


@pytest.mark.parametrize("table", ["hashed", "managed"])
def test_zero_padding_is_judged_from_ids_all_over_a_dataset_not_its_first(table: str, tmp_path: Path) -> None:
    """Zero padding was judged from a dataset's first ids: a training file whose first rows (a
    chunk's first 1,024 ids) happen to start with no 0 and whose later rows are padded recorded
    'integers', and a dataset for `eval --data`, `--init-from` or `--follow` whose first id is as
    wide as training's but whose later ids lost their zeros was told by that first id: neither was
    said. The sample is spread over each chunk and the record of integers carries their narrowest."""
    from flowrec.data.convert import convert
    from flowrec.data.id_forms import ZEROS, changed_forms
    from flowrec.data.layout import read_meta
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    width = int(rng.integers(5, 9))
    model = spec_from_dict(_spec(table))
    n_wide, n_padded = int(rng.integers(1_100, 2_000)), int(rng.integers(300, 600))
    wide = rng.integers(10 ** (width - 1), 10 ** width, n_wide)  # as wide as the padded ids, none starting with 0
    small = rng.zipf(1.3, n_padded) % 10 ** (width - 2) + 1
    rows = _rows(rng, n_wide + n_padded)
    rows["user"] = [str(i) for i in wide] + [f"{i:0{width}d}" for i in small]  # only the later rows padded
    rows.to_csv(tmp_path / "train.csv", index=False)
    convert(model, "csv", [tmp_path / "train.csv"], tmp_path / "ds")
    trained = read_meta(tmp_path / "ds").source["encoder"]["id_forms"]
    assert trained["user"]["form"] == ZEROS and trained["user"]["example"].startswith("0")
    rows["user"] = [str(i) for i in wide] + [str(i) for i in small]  # pandas' round trip: the zeros gone
    rows.to_csv(tmp_path / "lost.csv", index=False)
    convert(model, "csv", [tmp_path / "lost.csv"], tmp_path / "lost")
    seen = read_meta(tmp_path / "lost").source["encoder"]["id_forms"]
    narrowest = min(len(str(i)) for i in small)
    assert seen["user"]["form"] == "integers" and len(seen["user"]["example"]) == narrowest
    assert int(seen["user"]["example"]) in set(small.tolist())  # a later row's id, its zeros lost
    (line,) = changed_forms(model, {}, trained, seen)
    assert line.startswith("column user: the ids of feature user are written as integers") and "read_csv" in line
    assert changed_forms(model, {}, trained, trained) == []  # the training rows' own form says nothing


class _CountedRows:
    """An Arrow table that counts the asks of its column names (Arrow builds the list anew at each
    ask: asked once per feature, a 1,000-field model's one-row predict spent half its time there)."""

    def __init__(self, table: pa.Table) -> None:
        self.table, self.asked = table, 0

    @property
    def column_names(self) -> list[str]:
        self.asked += 1
        return self.table.column_names

    def __getattr__(self, name: str) -> Any:
        return getattr(self.table, name)


def test_the_rows_column_names_are_asked_once_a_call_not_once_a_feature() -> None:
    """The unseen-id count, the id forms, the standardized values' check and the separators' check
    asked the rows for their column names once per feature (quadratic for a wide model's wide
    rows); each asks once a call, and says what it said before."""
    from flowrec.data.encode import DenseStats, Encoder, UnseenIds
    from flowrec.data.layout import DataError
    from flowrec.data.separators import check_sequence_separators
    from flowrec.spec import spec_from_dict

    rng = np.random.default_rng()
    k, n = int(rng.integers(20, 60)), int(rng.integers(5, 50))
    doc = _spec("hashed")
    doc["features"] = ([{"name": f"p{i}", "type": "dense", "transform": "standardize"} for i in range(4)]
                       + [{"name": f"h{i}", "type": "categorical", "hash_buckets": 97, "dim": 4} for i in range(k)]
                       + [{"name": f"v{i}", "type": "categorical", "vocab": 50, "dim": 4} for i in range(k)]
                       + [{"name": f"m{i}", "type": "categorical", "hash_buckets": 97, "dim": 4, "max_len": 3}
                          for i in range(4)])
    spec = spec_from_dict(doc)
    vocabs = {spec.table(f.table).name: pa.array([f"{f.name}_{j}" for j in range(50)])
              for f in spec.sparse_features if f.name.startswith("v")}
    stats = {f"p{i}": DenseStats(float(rng.normal()), float(rng.lognormal()) / 1000) for i in range(4)}
    encoder = Encoder(spec, {}, vocabs, stats,
                      id_forms={f"h{i}": {"form": "integers", "example": "7"} for i in range(k)})
    cols = {f"p{i}": rng.lognormal(1.0, 1.5, n) for i in range(4)}
    cols["p0"][int(rng.integers(0, n))] = 3e37  # standardized by a std below 0.01: beyond float32
    cols.update({f"h{i}": [f"{z}.0" for z in rng.zipf(1.4, n)] for i in range(k)})
    cols.update({f"v{i}": [f"v{i}_{z % 70}" for z in rng.zipf(1.3, n)] for i in range(k)})
    cols.update({f"m{i}": ["^".join(str(z) for z in rng.zipf(1.5, 3)) for _ in range(n)] for i in range(4)})
    rows = pa.table(cols)
    plain, counted = UnseenIds(encoder), UnseenIds(encoder)
    plain.observe(rows)
    asked = _CountedRows(rows)
    counted.observe(asked)
    assert asked.asked <= 2 and counted.counts == plain.counts and counted.lines() == plain.lines()  # (+ its forms)
    assert any("h0" in line for line in plain.lines())  # the hashed ids' other form is said, as before
    forms, asked = IdForms(), _CountedRows(rows)
    forms.observe(encoder, asked, encoder.id_forms)
    assert asked.asked <= 1 and forms.seen == plain.forms.seen
    asked = _CountedRows(rows)
    unencodable = encoder.unencodable(asked)
    assert unencodable == encoder.unencodable(rows) and len(unencodable) == 1 and asked.asked <= 1
    asked = _CountedRows(rows)
    check_sequence_separators(asked, spec, {}, {})  # lists written with '^', the separator: no word
    assert asked.asked <= 1
    with pytest.raises(DataError, match="m0"):  # written with '|': said as before
        check_sequence_separators(rows.set_column(rows.column_names.index("m0"), "m0",
                                                  pa.array([v.replace("^", "|") for v in cols["m0"]])), spec, {}, {})


def test_blank_ids_are_neither_the_narrowest_id_nor_a_width():
    """A sample of integer ids holding a blank ('  ', no id) recorded '' as its narrowest id and a
    width of 0, so zero-padded ids of one width among blanks looked unpadded (serve7's find)."""
    import random


    from flowrec.data.id_forms import _widths, narrowest_id

    rng = random.Random()
    width = rng.randint(3, 8)
    ids = [str(rng.randint(0, 10 ** width - 1)).zfill(width) for _ in range(rng.randint(5, 50))]
    sample = ids + [" " * rng.randint(1, 4) for _ in range(rng.randint(1, 5))] + [None]
    rng.shuffle(sample)
    assert _widths(pa.array(sample)) == (width, width)
    plain = [i.lstrip("0") or "0" for i in ids]
    narrowest = narrowest_id(pa.array(plain + ["   "]))
    assert narrowest in plain and len(narrowest) == min(len(p) for p in plain)
