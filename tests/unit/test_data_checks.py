"""Partition checks against a plain reference on random skewed data; labels; atomic output; synth bounds."""
from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.checks import ColumnRule, check_partition, partition_rules
from flowrec.data.dataset import MemorySource
from flowrec.data.error_log import ErrorLog
from flowrec.data.labels import check_labels, label_spaces, label_tasks
from flowrec.data.layout import DataError
from flowrec.data.output import staged_output
from flowrec.data.sources import LINE_COLUMN
from flowrec.data.synth import SynthConfig, rank_to_row, synth_table
from flowrec.spec import spec_from_dict
from flowrec.testing.processes import run_bounded

OPT = {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}


def two_table_spec(task: str = "binary"):
    return spec_from_dict({
        "name": "t", "optimizer": OPT, "training": {"batch_size": 8},
        "features": [{"name": "d", "type": "dense"},
                     {"name": "a", "type": "categorical", "hash_buckets": 30, "dim": 4},
                     {"name": "b", "type": "categorical", "hash_buckets": 7, "dim": 4},
                     {"name": "s", "type": "sequence", "hash_buckets": 11, "dim": 4, "max_len": 4}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m", "task": task}]})


def skewed_ids(rng: np.random.Generator, n: int, rows: int) -> np.ndarray:
    return np.minimum(rng.zipf(1.3, n) - 1, rows - 1).astype(np.int64)


def reference_first_bad(values: list, rows: int) -> int | None:
    """First row index holding an id outside [0, rows): plain Python."""
    for i, v in enumerate(values):
        for x in (v if isinstance(v, list) else [v]):
            if x < 0 or x >= rows:
                return i
    return None


@pytest.mark.parametrize("seed", range(12))
def test_id_check_matches_a_plain_reference(seed: int):
    rng = np.random.default_rng(seed)
    rows, n = int(rng.integers(2, 500)), int(rng.integers(1, 300))
    flat = skewed_ids(rng, n, rows)
    lengths = rng.integers(0, 5, n)
    nested = [skewed_ids(rng, k, rows).tolist() for k in lengths]
    for _ in range(int(rng.integers(0, 3))):  # inject bad ids at random places, or none
        bad = int(rng.choice([-1, rows, rows + 17, 2 ** 62, -(2 ** 40)]))
        flat[rng.integers(n)] = bad
        row = int(rng.integers(n))
        nested[row] = nested[row] + [bad]
    for values in (flat.tolist(), nested):
        table = pa.table({"c": pa.array(values, pa.list_(pa.int64()) if values is nested else pa.int64())})
        expect = reference_first_bad(values, rows)
        rule = ColumnRule("c", "ids", rows=rows, table="tc")
        if expect is None:
            check_partition(table, [rule], "p")
            continue
        with pytest.raises(DataError, match=rf"^p: column 'c': id -?\d+ outside \[0, {rows}\) of table 'tc' "
                                            rf"at row {expect} \(0-based\)$"):
            check_partition(table, [rule], "p")


@pytest.mark.parametrize("seed", range(8))
def test_finite_and_binary_checks_match_a_plain_reference(seed: int):
    rng = np.random.default_rng(100 + seed)
    n = int(rng.integers(1, 400))
    x = rng.standard_normal(n).astype(np.float32)
    y = (rng.random(n) < 0.3).astype(np.float32)
    for _ in range(int(rng.integers(0, 3))):
        x[rng.integers(n)] = rng.choice([np.nan, np.inf, -np.inf])
        y[rng.integers(n)] = rng.choice([np.nan, 2.0, -1.0, 0.5, np.inf])
    table = pa.table({"x": x, "y": y})
    bad_x = next((i for i, v in enumerate(x.tolist()) if v != v or abs(v) == float("inf")), None)
    bad_y = next((i for i, v in enumerate(y.tolist()) if v not in (0.0, 1.0)), None)
    for rule, bad in ((ColumnRule("x", "finite"), bad_x), (ColumnRule("y", "binary", table="h"), bad_y)):
        if bad is None:
            check_partition(table, [rule], "p")
        else:
            with pytest.raises(DataError, match=rf"^p: column '{rule.name}': .* at row {bad} \(0-based\)"):
                check_partition(table, [rule], "p")


def test_types_nulls_and_float64_overflow_are_refused():
    id_rule, x_rule = ColumnRule("c", "ids", rows=5, table="t"), ColumnRule("x", "finite")
    for table, rule, match in (
        (pa.table({"c": pa.array([1.0, 2.0])}), id_rule, "expected int64"),
        (pa.table({"c": pa.array([1, None])}), id_rule, "null id at row 1"),
        (pa.table({"c": pa.array([[1], None], pa.list_(pa.int64()))}), id_rule, "null list at row 1"),
        (pa.table({"c": pa.array([[1], [2, None]], pa.list_(pa.int64()))}), id_rule, "null id at row 1"),
        (pa.table({"x": pa.array(["a"])}), x_rule, "expected float32"),
        (pa.table({"x": pa.array([0.5, None], pa.float32())}), x_rule, "null value at row 1"),
        (pa.table({"x": pa.array([1.0, 1e300])}), x_rule, "value beyond float32 1e\\+300 at row 1"),
        (pa.table({"y": pa.array([1.0])}), x_rule, "column 'x' missing"),
    ):
        with pytest.raises(DataError, match=match):
            check_partition(table, [rule], "p")
    check_partition(pa.table({"x": pa.array([1, 2**40]), "c": pa.array([0, 4], pa.uint8())}), [x_rule, id_rule], "p")


def test_rules_follow_the_spec():
    rules = {r.name: r for r in partition_rules(two_table_spec())}
    assert (rules["a"].kind, rules["a"].rows, rules["b"].rows, rules["s"].rows) == ("ids", 30, 7, 11)
    assert (rules["d"].kind, rules["label"].kind) == ("finite", "binary")
    assert {r.name: r.kind for r in partition_rules(two_table_spec("regression"))}["label"] == "finite"
    assert [r.name for r in partition_rules(two_table_spec(), ["b", "label"])] == ["b", "label"]


def test_a_negative_sample_weight_in_an_encoded_dataset_is_refused():
    """An encoded dataset written by another tool (or edited) with sample weights of -3 trained
    without a word, each such row's loss flipped into gradient ascent, where data convert refuses a
    negative weight: the column was checked as finite only."""
    spec = spec_from_dict({
        "name": "t", "optimizer": OPT, "training": {"batch_size": 8},
        "features": [{"name": "d", "type": "dense"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m", "sample_weight": "w"}]})
    rules = partition_rules(spec)
    table = pa.table({"d": pa.array([1.0] * 4, pa.float32()), "label": pa.array([0.0, 1.0, 0.0, 1.0], pa.float32()),
                      "w": pa.array([1.0, 0.0, 2.5, 0.5], pa.float32())})
    check_partition(table, rules, "p")  # zero and positive weights pass
    for bad, says in ((-3.0, r"sample weight -3\.0 at row 2 \(0-based\) is negative \(head h\)"),
                      (float("nan"), r"non-finite value nan at row 2")):
        w = pa.array([1.0, 0.0, bad, 0.5], pa.float32())
        with pytest.raises(DataError, match=says):
            check_partition(table.set_column(2, "w", w), rules, "p")


def test_a_one_id_column_stored_as_lists_is_refused():
    """An encoded dataset whose one-hot column was rewritten as list<int64> (by hand, another tool)
    passed the checks: rows of two ids trained as a summed bag and empty lists as no id, without a
    word (`flowrec eval` gave other metrics). Now a list other than of one id is one line naming
    its row; lists of one id still read, and a multi-hot or sequence column takes any lists."""
    rng = np.random.default_rng()
    rules = {r.name: r for r in partition_rules(two_table_spec())}
    assert (rules["a"].one, rules["b"].one, rules["s"].one) == (True, True, False)
    lists = [skewed_ids(rng, int(k), 30).tolist() for k in rng.integers(1, 3, 40)]
    lists[int(rng.integers(40))] = []
    first = min(i for i, v in enumerate(lists) if len(v) != 1)
    table = pa.table({"a": pa.array(lists, pa.list_(pa.int64()))})
    with pytest.raises(DataError, match=rf"^p: column 'a': {len(lists[first])} ids at row {first + 5} \(0-based\), "
                                        r"where the spec's feature takes one id per row"):
        check_partition(table, [rules["a"]], "p", first_row=5)
    ones = [[v[0]] if v else [0] for v in lists]  # lists of one id each (as a list-typed writer gives): read
    check_partition(pa.table({"a": pa.array(ones, pa.list_(pa.int64()))}), [rules["a"]], "p")
    check_partition(pa.table({"a": pa.array([v[0] for v in ones], pa.int64())}), [rules["a"]], "p")
    check_partition(pa.table({"s": pa.array([[x % 11 for x in v] for v in lists], pa.list_(pa.int64()))}),
                    [rules["s"]], "p")


def test_batches_never_wrap_an_id_into_the_neighbouring_table():
    spec = two_table_spec()
    table = synth_table(spec, 64)
    ids = table.column("b").to_numpy().copy()
    ids[37] = 7  # one past table b: packed, it would be row 0 of the next table
    bad = table.set_column(table.column_names.index("b"), "b", pa.array(ids))
    source = MemorySource([table.slice(0, 32), bad.slice(32, 32)])
    with pytest.raises(DataError, match=r"^partition 1: column 'b': id 7 outside \[0, 7\) .* at row 5 \(0-based\)"):
        with iterate_batches(spec, source, StagingOptions(shuffle=False, batch_size=8)) as it:
            for _ in it:
                pass
    source = MemorySource([table.slice(0, 32), table.slice(32, 32)])
    with iterate_batches(spec, source, StagingOptions(batch_size=8, lookahead=2)) as it:
        assert sum(b.size for b in it) == 64


@pytest.mark.parametrize("seed", range(4))
def test_shuffled_batches_report_the_first_bad_row_of_the_partition(seed: int):
    spec = two_table_spec()
    table = synth_table(spec, 96, SynthConfig(seed=seed))
    rng = np.random.default_rng(seed)
    rows = sorted(rng.choice(np.arange(32, 64), 3, replace=False))
    labels = table.column("label").to_numpy().copy()
    labels[rows] = [2.0, np.nan, -1.0]
    bad = table.set_column(table.column_names.index("label"), "label", pa.array(labels))
    source = MemorySource([bad.slice(0, 32), bad.slice(32, 32), bad.slice(64, 32)])
    with pytest.raises(DataError, match=rf"^partition 1: column 'label': label .* at row {rows[0] - 32} \(0-based\)"):
        with iterate_batches(spec, source, StagingOptions(batch_size=8, shuffle_buffer=16, seed=seed)) as it:
            for _ in it:
                pass


def test_a_float32_sum_overflow_is_no_error():
    spec = two_table_spec()
    table = synth_table(spec, 32)
    big = table.set_column(table.column_names.index("d"), "d", pa.array(np.full(32, 3e38, np.float32)))
    with iterate_batches(spec, MemorySource([big]), StagingOptions(batch_size=8)) as it:
        assert [float(b.dense.max()) for b in it] == [float(np.float32(3e38))] * 4


def test_labels_binary_regression_and_plus_minus():
    raw = pa.table({"y": [1.0, -1.0, 0.0, 2.0, None, 0.5], LINE_COLUMN: [1, 2, 3, 4, 5, 6]})
    log = ErrorLog("skip", "f")
    table, mapped = check_labels(raw, {"y": "binary"}, log, plus_minus=True)
    assert table.column("y").to_pylist() == [1.0, 0.0, 0.0] and mapped == 1
    assert [(e.line, e.reason.split(" in ")[0]) for e in log.examples] == [
        (4, "label 2.0"), (5, "missing label"), (6, "label 0.5")]
    table, mapped = check_labels(raw, {"y": "binary"}, ErrorLog("skip"), plus_minus=False)
    assert table.column("y").to_pylist() == [1.0, 0.0] and mapped == 0
    table, _ = check_labels(raw, {"y": "regression"}, ErrorLog("skip"), plus_minus=True)
    assert table.column("y").to_pylist() == [1.0, -1.0, 0.0, 2.0, 0.5]
    with pytest.raises(DataError, match=r"f:4: label 2.0"):
        check_labels(raw, {"y": "binary"}, ErrorLog("fail", "f"), plus_minus=True)
    spec = two_table_spec("regression")
    assert label_tasks(spec, {"label": "clk"}) == {"clk": "regression"}


def multiclass_spec(classes: int):
    return spec_from_dict({"name": "t", "optimizer": OPT, "training": {"batch_size": 8},
           "features": [{"name": "d", "type": "dense"},
                        {"name": "a", "type": "categorical", "hash_buckets": 30, "dim": 4}],
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
           "heads": [{"name": "genre", "input": "m", "task": "multiclass", "num_classes": classes,
                      "loss": "softmax_ce"}]})


@pytest.mark.parametrize("bad", [-1.0, 5.0, 2.5, float("nan"), 1e9])
def test_multiclass_labels_are_class_indices(bad):
    """A multiclass label outside 0 .. N-1, or not whole, names its row (never a torch error at
    the loss); labels drawn at random, skewed to the low classes, pass."""
    rng = np.random.default_rng()
    spec = multiclass_spec(5)
    (rule,) = [r for r in partition_rules(spec) if r.name == "label"]
    assert (rule.kind, rule.rows, rule.table) == ("classes", 5, "genre")
    y = np.minimum(rng.zipf(1.5, 200) - 1, 4).astype(np.float32)
    check_partition(pa.table({"label": y}), [rule], "p")
    row = int(rng.integers(0, 200))
    y[row] = bad
    with pytest.raises(DataError, match=rf"p: column 'label': label .* at row {row + 10} \(0-based\) is not a class "
                                        rf"index 0 \.\. 4 \(multiclass head genre\)"):
        check_partition(pa.table({"label": y}), [rule], "p", first_row=10)


def test_multiclass_labels_at_conversion():
    raw = pa.table({"y": [0.0, 4.0, 5.0, -1.0, 1.5, None, 2.0], LINE_COLUMN: [1, 2, 3, 4, 5, 6, 7]})
    log = ErrorLog("skip", "f")
    table, _ = check_labels(raw, {"y": "multiclass:5"}, log, plus_minus=True)
    assert table.column("y").to_pylist() == [0.0, 4.0, 2.0]
    assert [e.line for e in log.examples] == [3, 4, 5, 6]
    assert "not a class index 0 .. 4 for a multiclass head" in log.examples[0].reason
    assert label_tasks(multiclass_spec(5), {}) == {"label": "multiclass:5"}


def test_multiclass_labels_numbered_from_1_say_so_and_not_to_skip_them():
    """Star ratings 1 .. 5 for a 5-class head: the first 5 said 'not a class index 0 .. 4 ... (use
    --on-error skip to skip such rows)', which drops every row of that class and trains a 4-class
    model; a label of exactly num_classes says classes look numbered from 1, the two fixes, and
    gives no hint to skip. Other bad labels keep the hint."""
    rng = np.random.default_rng()
    classes = int(rng.integers(2, 12))
    y = (np.minimum(rng.zipf(1.4, 300), classes)).astype(np.float64)  # 1-based, skewed to class 1
    y[int(rng.integers(0, 300))] = classes  # at least one row of the last class
    raw = pa.table({"y": y, LINE_COLUMN: np.arange(1, 301)})
    with pytest.raises(DataError) as caught:
        check_labels(raw, {"y": f"multiclass:{classes}"}, ErrorLog("fail", "f"), plus_minus=False)
    line = str(caught.value)
    assert f"f:{int(np.argmax(y == classes)) + 1}: label {float(classes)!r} in column y" in line, line
    assert (f"classes numbered 1 .. {classes}? a class index counts from 0: write each label less 1 (0 .. "
            f"{classes - 1}; e.g. in pandas: df['y'] = df['y'] - 1); num_classes: {classes + 1} would read them "
            "as they are, at a cost: a class 0 that no row holds") in line and "--on-error skip" not in line, line
    assert line.index("write each label less 1") < line.index(f"num_classes: {classes + 1}"), line  # relabel first
    raw = pa.table({"y": [0.0, float(classes + 1)], LINE_COLUMN: [1, 2]})
    with pytest.raises(DataError, match="--on-error skip") as caught:
        check_labels(raw, {"y": f"multiclass:{classes}"}, ErrorLog("fail", "f"), plus_minus=False)
    assert "numbered 1" not in str(caught.value)


def esmm_doc() -> dict:
    """click on every row; conversion (weighted) and a 3-class category on clicked rows only."""
    return {"name": "t", "optimizer": OPT, "training": {"batch_size": 8},
           "features": [{"name": "a", "type": "categorical", "hash_buckets": 30, "dim": 4}],
           "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
           "heads": [{"name": "click", "input": "m", "label": "click"},
                     {"name": "conv", "input": "m", "label": "conv", "sample_weight": "w",
                      "trained_where": {"label": "click", "equals": 1}},
                     {"name": "cat", "input": "m", "task": "multiclass", "num_classes": 3, "label": "cat",
                      "trained_where": {"label": "click", "equals": 1}}]}


def test_labels_outside_a_task_space_may_be_missing():
    """ESMM rows: conversion, its weight and the category are empty (or -1) where there was no
    click. No head reads them there: the rows convert (kept as 0), where they were malformed and
    --on-error skip dropped every row not clicked from the click head too. A clicked row still
    needs them."""
    spec = spec_from_dict(esmm_doc())
    spaces = label_spaces(spec, {})
    assert spaces == {"conv": (("click", 1.0),), "w": (("click", 1.0),), "cat": (("click", 1.0),)}
    raw = pa.table({"click": [1.0, 0.0, 0.0, 1.0, 1.0, None], "conv": [1.0, None, -1.0, None, 0.0, 1.0],
                    "w": [0.5, None, -3.0, 1.0, 1.0, 1.0], "cat": [2.0, None, -1.0, 1.0, 7.0, 0.0],
                    LINE_COLUMN: [1, 2, 3, 4, 5, 6]})
    log = ErrorLog("skip", "f")
    table, _ = check_labels(raw, label_tasks(spec, {}), log, plus_minus=False, spaces=spaces)
    assert sorted(e.line for e in log.examples) == [4, 5, 6]  # click missing; in the space: no conv, class 7
    assert table.to_pydict() == {"click": [1.0, 0.0, 0.0], "conv": [1.0, 0.0, 0.0], "w": [0.5, 0.0, 0.0],
                                 "cat": [2.0, 0.0, 0.0], LINE_COLUMN: [1, 2, 3]}
    doc = esmm_doc()
    doc["heads"][0]["sample_weight"] = "w"  # the click head reads w on every row
    assert set(label_spaces(spec_from_dict(doc), {})) == {"conv", "cat"}


def test_staged_output_swaps_only_a_complete_folder(tmp_path):
    out = tmp_path / "ds"
    with staged_output(out, overwrite=False) as tmp:
        (tmp / "a").write_text("old")
    assert [p.name for p in out.iterdir()] == ["a"]
    with pytest.raises(DataError, match="not empty"):
        with staged_output(out, overwrite=False):
            pass
    with pytest.raises(RuntimeError):
        with staged_output(out, overwrite=True) as tmp:
            (tmp / "b").write_text("new")
            raise RuntimeError("interrupted")
    assert [p.name for p in out.iterdir()] == ["a"] and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    with staged_output(out, overwrite=True) as tmp:
        (tmp / "b").write_text("new")
    assert [p.name for p in out.iterdir()] == ["b"] and sorted(p.name for p in tmp_path.iterdir()) == ["ds"]
    with pytest.raises(DataError, match="inside the output folder"):
        with staged_output(out, overwrite=True, inputs=[out / "b"]):
            pass
    (tmp_path / "file").write_text("x")
    with pytest.raises(DataError, match="not a folder"):
        with staged_output(tmp_path / "file", overwrite=True):
            pass


@pytest.mark.parametrize("rows", [1, 2, 3, 5, 1 << 20])
def test_synth_rows_stay_inside_the_table(rows: int):
    ranks = np.arange(max(rows - 1, 1) * 3) % max(rows - 1, 1)
    out = rank_to_row(ranks, rows, np.uint64(12345))
    assert out.min() >= min(1, rows - 1) and out.max() < rows
    spec = two_table_spec()
    table = synth_table(spec, 500)
    check_partition(table, partition_rules(spec), "synth")


def test_each_part_file_is_checked_once_until_it_changes(tmp_path, monkeypatch):
    from flowrec.data import batches
    from flowrec.data.checked import RECORD_FILE
    from flowrec.data.dataset import ParquetSource
    from flowrec.data.synth import synth_dataset

    spec = two_table_spec()
    synth_dataset(spec, tmp_path / "d", 96, rows_per_file=32)
    calls = []
    real = batches.check_partition
    monkeypatch.setattr(batches, "check_partition", lambda t, r, w, *row: calls.append(w) or real(t, r, w, *row))

    def epoch(source, epoch=0):
        with iterate_batches(spec, source, StagingOptions(batch_size=8), epoch=epoch) as it:
            return sum(b.size for b in it)

    source = ParquetSource(tmp_path / "d")
    assert epoch(source) == epoch(source, 1) == 96 and len(calls) == 3  # once per partition
    assert (tmp_path / "d" / RECORD_FILE).is_file()
    assert epoch(ParquetSource(tmp_path / "d")) == 96 and len(calls) == 3  # recorded: a new run skips it
    part = sorted((tmp_path / "d").glob("part-*.parquet"))[1]
    table = pq.read_table(part)
    ids = table.column("a").to_numpy().copy()
    ids[4] = 30
    pq.write_table(table.set_column(table.column_names.index("a"), "a", pa.array(ids)), part)
    with pytest.raises(DataError, match=rf"{part.name}: column 'a': id 30 .* at row 4 "):
        epoch(ParquetSource(tmp_path / "d"))
    assert calls[3:] == [str(part)]  # only the changed file was checked again
    (tmp_path / "d" / RECORD_FILE).write_text("{not json")
    other = two_table_spec("regression")
    with pytest.raises(DataError, match="id 30"):
        with iterate_batches(other, ParquetSource(tmp_path / "d"), StagingOptions(batch_size=8)) as it:
            list(it)


def test_a_check_record_temp_file_a_kill_left_is_removed_by_the_next_save(tmp_path):
    """The check record (`_flowrec_checked.json`) was written through a temp file named with the
    PID only; a kill -9 between its write and rename left `._flowrec_checked.json.PID-X` in the
    dataset folder for good. It is now written as every output is (`atomic_output`): the temp
    name carries the process and machine, and the next save removes one a dead process of this
    machine left, never a live process's, nor the record."""
    import sys

    from flowrec.data.checked import RECORD_FILE
    from flowrec.data.dataset import ParquetSource
    from flowrec.data.output_guard import host_tag
    from flowrec.data.synth import synth_dataset

    spec = two_table_spec()
    rng = np.random.default_rng()
    rows = int(rng.integers(40, 120))
    synth_dataset(spec, tmp_path / "d", rows, rows_per_file=16)
    dead = run_bounded([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                       text=True, timeout_s=60, check=True).stdout.strip()  # a PID that no longer runs
    stem, suffix = RECORD_FILE.rsplit(".", 1)
    left = tmp_path / "d" / f".{stem}.{dead}-{host_tag()}-{rng.bytes(4).hex()}.tmp.{suffix}"
    left.write_text('{"half": ')
    live = tmp_path / "d" / f".{stem}.{os.getpid()}-{host_tag()}-{rng.bytes(4).hex()}.tmp.{suffix}"
    live.write_text('{"half": ')
    with iterate_batches(spec, ParquetSource(tmp_path / "d"), StagingOptions(batch_size=8)) as it:
        assert sum(b.size for b in it) == rows
    assert (tmp_path / "d" / RECORD_FILE).is_file()
    assert not left.exists() and live.exists()
    assert sorted(p.name for p in (tmp_path / "d").glob(f".{stem}*")) == [live.name]
