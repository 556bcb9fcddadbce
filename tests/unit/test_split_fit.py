"""A split conversion fits its encoder on its train rows alone: a value seen only in test rows has
no vocabulary row, a `standardize` feature's mean and std are those of the train rows (computed
here from the raw CSV with numpy), for a seeded split, a `split_by` time cutoff and with
`--encoder-from` growth; the split itself is the one `split_mask` (rule 2, by row index: the rows
here are made for their side, so the rule that a run of before rule 3 still splits by) or the cutoff
draws, as before."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data.convert import INDEX_SPLIT_RULE, convert, split_mask
from flowrec.data.encode import DenseStats, Encoder
from flowrec.data.layout import DataError, read_meta
from flowrec.spec import spec_from_dict

ROWS = 300


def _spec(**options):
    doc = {"name": "leak",
           "features": [{"name": "c", "type": "categorical", "vocab": 500, "dim": 4},
                        {"name": "x", "type": "dense", "transform": "standardize"},
                        {"name": "rid", "type": "dense"}],
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse", "@dense"], "layers": [4]}],
           "heads": [{"name": "h", "input": "m"}],
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}}
    if options:
        doc["data"] = {"format": "csv", "path": "x", "options": options}
    return spec_from_dict(doc)


def _csv(tmp: Path, test: np.ndarray, day: np.ndarray | None = None) -> Path:
    """Rows whose `c` is one of 5 shared values on train rows and a value of its own ("only<r>") on
    the rows of `test`; `x` is far larger on the test rows (a fit that saw them moves the mean);
    `rid` the row's index, to find each written row's raw row."""
    rng = np.random.default_rng(3)
    x = np.where(test, 1000.0 + rng.normal(0, 50, len(test)), rng.normal(5, 2, len(test)))
    lines = ["c,x,rid,label" + (",day" if day is not None else "")]
    for r in range(len(test)):
        c = f"only{r}" if test[r] else f"v{r % 5}"
        lines.append(f"{c},{float(x[r])!r},{r},{r % 2}" + (f",{day[r]}" if day is not None else ""))
    path = tmp / "rows.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def _written(out: Path, part: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    t = pq.read_table(out / part, columns=["c", "x", "rid"])
    return (t.column("rid").to_numpy().astype(np.int64), t.column("c").to_numpy(), t.column("x").to_numpy())


def _check_fitted_on_train(out: Path, raw: Path, test: np.ndarray) -> None:
    """The encoder of `out` (both parts) is the one fitted on the rows of ~test alone."""
    lines = raw.read_text().splitlines()[1:]
    values = np.array([float(line.split(",")[1]) for line in lines])
    names = [line.split(",")[0] for line in lines]
    for part in ("train", "test"):
        meta = read_meta(out / part)
        dense = meta.dense["x"]
        assert dense["mean"] == pytest.approx(float(values[~test].mean()), rel=1e-9)
        assert dense["std"] == pytest.approx(float(values[~test].std()), rel=1e-9)
        vocab = set(pq.read_table(out / part / "_vocab" / "c.parquet").column("value").to_pylist())
        assert vocab == {names[r] for r in np.flatnonzero(~test)}
        assert meta.split["fit_on"] == "train"
    rid, c, _ = _written(out, "test")
    assert sorted(rid.tolist()) == np.flatnonzero(test).tolist()  # the split: exactly these rows
    assert (c == 0).all()  # each test row's value was never seen in training: the unknown row
    rid, c, x = _written(out, "train")
    assert sorted(rid.tolist()) == np.flatnonzero(~test).tolist() and (c > 0).all()
    assert abs(float(x.mean())) < 1e-3  # standardized by the train rows' own mean


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_a_seeded_split_fits_on_its_train_rows_and_splits_as_before(tmp_path, seed):
    test = split_mask(0, ROWS, 0.25, seed)  # rule 2, which flowrecs of 2026-12-05 and 06 split by
    raw = _csv(tmp_path, test)
    report = convert(_spec(test_fraction=0.25, split_seed=seed), "csv", [raw], tmp_path / "out",
                     rows_per_file=37, split_rule=INDEX_SPLIT_RULE)  # part files of other sizes than the read chunks
    assert report.split == {"train": int((~test).sum()), "test": int(test.sum())}
    _check_fitted_on_train(tmp_path / "out", raw, test)


def test_a_time_cutoff_fits_on_the_rows_before_it(tmp_path):
    day = np.random.default_rng(5).integers(0, 40, ROWS)
    times = np.sort(day)
    cutoff = times[len(times) - round(len(times) * 0.2)]  # the newest fifth: rows at the cutoff go to test
    test = day >= cutoff
    raw = _csv(tmp_path, test, day)
    convert(_spec(test_fraction=0.2, split_by="day"), "csv", [raw], tmp_path / "out")
    _check_fitted_on_train(tmp_path / "out", raw, test)
    assert read_meta(tmp_path / "out" / "train").split["cutoff"] == float(cutoff)


def test_growth_with_a_given_encoder_takes_values_of_train_rows_only(tmp_path):
    spec = spec_from_dict({
        "name": "grow", "features": [{"name": "c", "type": "categorical", "table": "t"},
                                     {"name": "rid", "type": "dense"}],
        "tables": [{"name": "t", "vocab": 5, "vocab_spare": 400, "dim": 4}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})
    test = split_mask(0, ROWS, 0.25, 0)
    raw = _csv(tmp_path, test)
    given = Encoder(spec, {}, {"t": pa.array(["v0", "v1"], pa.string())}, {})
    report = convert(spec, "csv", [raw], tmp_path / "out", encoder=given,
                     options={"test_fraction": 0.25, "split_seed": 0}, split_rule=INDEX_SPLIT_RULE)
    assert report.growth[0].added == 3  # v2, v3, v4: no test row's own value
    vocab = pq.read_table(tmp_path / "out" / "train" / "_vocab" / "t.parquet").column("value").to_pylist()
    assert vocab == ["v0", "v1", "v2", "v3", "v4"]
    assert read_meta(tmp_path / "out" / "test").split["fit_on"] == "given"  # fitted elsewhere, grown on train


def test_a_row_dropped_as_unencodable_keeps_the_other_rows_sides(tmp_path):
    """A row that a given encoder's std scales past float32 is dropped as malformed; the rows after
    it keep the side of their row index (it was counted after the drop: they drew other sides)."""
    test = split_mask(0, 60, 0.5, 0)
    raw = _csv(tmp_path, test)
    lines = raw.read_text().splitlines()
    first = lines[4].split(",")
    lines[4] = ",".join([first[0], "1e38", *first[2:]])  # row 3: (1e38 - 0) / 0.001 is beyond float32
    raw.write_text("\n".join(lines) + "\n")
    spec = _spec()
    given = Encoder(spec, {}, {"c": pa.array(["v0"], pa.string())},
                    {"x": DenseStats(0.0, 1e-3)})
    report = convert(spec, "csv", [raw], tmp_path / "out", encoder=given, grow=False, on_error="skip",
                     options={"test_fraction": 0.5, "split_seed": 0}, split_rule=INDEX_SPLIT_RULE)
    assert report.errors == 1
    kept = np.ones(60, bool)
    kept[3] = False
    assert sorted(_written(tmp_path / "out", "test")[0].tolist()) == np.flatnonzero(test & kept).tolist()
    assert sorted(_written(tmp_path / "out", "train")[0].tolist()) == np.flatnonzero(~test & kept).tolist()
    assert read_meta(tmp_path / "out" / "train").split["fit_on"] == "given"  # nothing was fitted here


def test_a_split_of_only_test_rows_is_the_empty_train_split_line(tmp_path):
    test = split_mask(0, 3, 0.99, 0)
    assert test.all()
    raw = _csv(tmp_path, test)
    with pytest.raises(DataError, match="into the train split: test_fraction 0.99 leaves 0.03 of its 3 rows for train"):
        convert(_spec(test_fraction=0.99, split_seed=0), "csv", [raw], tmp_path / "out", split_rule=INDEX_SPLIT_RULE)
    assert not (tmp_path / "out").exists()


def test_a_malformed_row_is_counted_once_over_the_cutoff_fit_and_write_passes(tmp_path):
    day = np.arange(ROWS) % 30
    raw = _csv(tmp_path, day >= 24, day)
    lines = raw.read_text().splitlines()
    lines[10] = lines[10].rsplit(",", 1)[0] + ","  # no time: malformed under split_by
    lines[20] = "v1,not-a-number,19,0,3"
    raw.write_text("\n".join(lines) + "\n")
    report = convert(_spec(test_fraction=0.2, split_by="day"), "csv", [raw], tmp_path / "out", on_error="skip")
    assert report.errors == 2 and report.rows == ROWS - 2


def test_a_split_of_only_malformed_rows_counts_each_once(tmp_path):
    (tmp_path / "bad.csv").write_text("c,x,rid,label\nv1,inf,0,0\nv2,inf,1,1\nv3,inf,2,0\n")
    with pytest.raises(DataError, match="all 3 rows were malformed"):
        convert(_spec(test_fraction=0.3, split_seed=0), "csv", [tmp_path / "bad.csv"], tmp_path / "out",
                on_error="skip")
