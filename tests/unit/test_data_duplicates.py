"""Exact duplicate rows of a raw input (`flowrec.data.duplicates`): a file joined to itself (`cat
a.csv a.csv > b.csv`) was converted without a word, and a seeded split put each copy on a side of
its own, so the same rows were in train and test (a test AUC of rows the model trained on). The
conversion says how many rows copy an earlier one, their share, and where the first copy is (they
are kept: a click log's equal rows are events of their own), and the seeded
split (rule 3) draws a row's side from its values: copies land on their row's side. A run of
before rule 3 whose bound data is encoded again keeps its split (rule 2)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from flowrec.data.convert import INDEX_SPLIT_RULE, SPLIT_RULE, convert, split_mask
from flowrec.data.duplicates import Duplicates, row_hashes
from flowrec.data.layout import read_meta
from flowrec.spec import spec_from_dict


def _spec(path: str = "x", **options):
    return spec_from_dict({
        "name": "dups",
        "features": [{"name": "c", "type": "categorical", "hash_buckets": 997, "dim": 4},
                     {"name": "rid", "type": "dense"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse", "@dense"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "data": {"format": "csv", "path": path, "options": options},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})


def _rows(rng: np.random.Generator, n: int) -> list[str]:
    """Skewed rows, each its own (`rid`), Zipf categories and a rare label."""
    return [f"c{rng.zipf(1.5) % 300},{r},{int(rng.random() < 0.2)}" for r in range(n)]


def _written_rids(out: Path, part: str) -> list[int]:
    return pq.read_table(out / part, columns=["rid"]).column("rid").to_numpy().astype(np.int64).tolist()


@pytest.mark.parametrize("seed", [0, 5, (1 << 64) - 1])
def test_a_file_joined_to_itself_is_named_and_its_copies_never_straddle_the_split(tmp_path: Path, seed: int):
    rng = np.random.default_rng()
    n = int(rng.integers(300, 600))  # 150 rows' test share left 15-45 % once in 200,000 (4 sd); 300: 1e-9
    rows = _rows(rng, n)
    path = tmp_path / "b.csv"
    path.write_text("c,rid,label\n" + "\n".join(rows + rows) + "\n")  # cat a.csv a.csv, the header once
    report = convert(_spec(test_fraction=0.3, split_seed=seed), "csv", [path], tmp_path / "out")
    train, test = _written_rids(tmp_path / "out", "train"), _written_rids(tmp_path / "out", "test")
    assert not set(train) & set(test)  # no row in both
    assert sorted(train + test) == sorted(list(range(n)) * 2)  # every row and copy written once
    assert 0.15 * n < len(set(test)) < 0.45 * n
    said = [w for w in report.warnings if "repeat an earlier row" in w]
    assert len(said) == 1 and f": {n:,} rows (50.0% of the {2 * n:,} rows read) repeat" in said[0], report.warnings
    assert f"first: line {n + 2} repeats line 2)" in said[0] and "none is in both train and test" in said[0]
    assert read_meta(tmp_path / "out" / "train").split["split_rule"] == SPLIT_RULE


def test_rows_copied_here_and_there_are_counted_and_the_first_copy_named(tmp_path: Path):
    rng = np.random.default_rng()
    n = int(rng.integers(200, 500))
    rows = _rows(rng, n)
    picked = sorted(set(rng.integers(0, n, int(rng.integers(5, 40))).tolist()))
    copies = [rows[i] for i in picked]
    rng.shuffle(copies)
    at = int(rng.integers(picked[-1] + 1, n + 1))  # the copies go in after the last row they copy
    lines = rows[:at] + copies + rows[at:]
    path = tmp_path / "rows.csv"
    path.write_text("c,rid,label\n" + "\n".join(lines) + "\n")
    report = convert(_spec(), "csv", [path], tmp_path / "out")
    said = [w for w in report.warnings if "an earlier row in every column" in w]
    first = rows.index(copies[0])
    count = f"{len(copies)} rows (" if len(copies) > 1 else "1 row ("
    assert len(said) == 1 and count in said[0] and f"of the {n + len(copies):,} rows read)" in said[0], said
    assert f"first: line {at + 2} repeats line {first + 2})" in said[0]
    clean = tmp_path / "clean.csv"
    clean.write_text("c,rid,label\n" + "\n".join(rows) + "\n")
    assert not [w for w in convert(_spec(), "csv", [clean], tmp_path / "c").warnings if "earlier row" in w]


def test_copies_in_a_second_input_file_name_both_files(tmp_path: Path):
    rng = np.random.default_rng()
    rows = _rows(rng, int(rng.integers(50, 120)))
    a, b = tmp_path / "a.csv", tmp_path / "b.csv"
    a.write_text("c,rid,label\n" + "\n".join(rows) + "\n")
    b.write_text("c,rid,label\n" + "\n".join(rows[3:7]) + "\n")
    said = [w for w in convert(_spec(), "csv", [a, b], tmp_path / "out").warnings if "earlier row" in w]
    assert len(said) == 1 and said[0].startswith(f"{b}: 4 rows") and f"line 2 repeats line 5 of {a})" in said[0]


def test_the_count_is_estimated_from_a_share_of_hashes_beyond_the_limit():
    """Beyond its limit the counter keeps the rows of a share of hash values: copies share their
    hash, so the share's copies, scaled, estimate the whole (said as 'about')."""
    rng = np.random.default_rng()
    n = int(rng.integers(20_000, 40_000))
    hashes = rng.integers(0, 1 << 63, n, dtype=np.int64).astype(np.uint64) * np.uint64(2) + np.uint64(1)
    doubled = rng.random(n) < 0.6  # the share's copies: 0.3 drew few enough to miss by 35 % once in 400,000
    stream = np.concatenate([hashes, hashes[doubled]])
    lines = np.arange(2, len(stream) + 2)
    exact, small = Duplicates(), Duplicates(limit=2_000)
    for start in range(0, len(stream), 4_096):
        for counter in (exact, small):
            counter.observe("x.csv", stream[start:start + 4_096], lines[start:start + 4_096])
    assert exact.count() == (int(doubled.sum()), False)
    estimate, estimated = small.count()
    assert estimated and abs(estimate - doubled.sum()) < 0.35 * doubled.sum() + 64
    assert "about" in small.line()


def test_row_hashes_tell_rows_apart_by_every_value_and_missing_from_empty():
    t = pa.table({"a": ["x", "x", "x", None, "", "x"], "b": [1.5, 1.5, 2.5, 1.5, 1.5, -0.0],
                  "n": pa.array([1, 1, 1, 1, 1, 1], pa.int64())})
    h = row_hashes(t).tolist()
    assert h[0] == h[1] and len({h[0], h[2], h[3], h[4], h[5]}) == 5
    assert row_hashes(t.slice(1)).tolist() == h[1:]  # a row's hash is its own, wherever the chunk starts
    swapped = pa.table({"a": ["1.5"], "b": ["x"]})
    assert row_hashes(swapped)[0] != row_hashes(pa.table({"a": ["x"], "b": ["1.5"]}))[0]


def test_a_click_log_s_repeated_events_are_kept_and_said_as_a_share_not_a_fault(tmp_path: Path):
    """A click log of (user, item, label) repeats rows that are events of their own: the line said
    'exact copies ... a file joined to itself ...: remove copies made by mistake' of them, with no
    share to judge by. It now gives the share of the rows read, says they are kept (none dropped) and
    on one side of the split, and names the first copy's line."""
    rng = np.random.default_rng()
    n = int(rng.integers(2_000, 5_000))
    users, items = rng.zipf(1.6, n) % 60, rng.zipf(1.4, n) % 40
    labels = (rng.random(n) < 0.1).astype(int)
    lines = [f"u{u},i{i},{y}" for u, i, y in zip(users, items, labels)]
    first_seen: dict[str, int] = {}
    repeats, first = 0, None
    for k, line in enumerate(lines):
        if line in first_seen:
            repeats += 1
            first = first or (k + 2, first_seen[line] + 2)
        first_seen.setdefault(line, k)
    path = tmp_path / "clicks.csv"
    path.write_text("user,item,label\n" + "\n".join(lines) + "\n")
    spec = spec_from_dict({
        "name": "clicks",
        "features": [{"name": "user", "type": "categorical", "vocab": 80, "dim": 4},
                     {"name": "item", "type": "categorical", "vocab": 60, "dim": 4}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "data": {"format": "csv", "path": "x", "options": {"test_fraction": 0.2, "split_seed": 1}},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})
    report = convert(spec, "csv", [path], tmp_path / "out")
    assert report.split["train"] + report.split["test"] == n  # no row dropped
    said = [w for w in report.warnings if "earlier row" in w]
    assert len(said) == 1, report.warnings
    assert said[0].startswith(f"{path}: {repeats:,} rows ({repeats / n:.1%} of the {n:,} rows read) repeat an earlier")
    assert f"(first: line {first[0]} repeats line {first[1]})" in said[0]
    assert "all kept" in said[0] and "copies on its side, so none is in both train and test" in said[0]


def test_a_run_of_before_rule_3_encodes_its_bound_data_again_with_its_own_split(tmp_path: Path):
    """Rule 2 (by row index) is still made where asked for: the bound data of a run of before rule
    3, encoded again when gone, splits as the run's did; its record names rule 2."""
    rng = np.random.default_rng()
    n = int(rng.integers(200, 400))
    path = tmp_path / "rows.csv"
    path.write_text("c,rid,label\n" + "\n".join(_rows(rng, n)) + "\n")
    convert(_spec(test_fraction=0.25, split_seed=7), "csv", [path], tmp_path / "old", split_rule=INDEX_SPLIT_RULE)
    assert sorted(_written_rids(tmp_path / "old", "test")) == np.flatnonzero(split_mask(0, n, 0.25, 7)).tolist()
    assert read_meta(tmp_path / "old" / "test").split["split_rule"] == INDEX_SPLIT_RULE


def test_a_resumed_run_encodes_its_gone_bound_data_by_its_own_rule(tmp_path: Path):
    """run.json records the rule a run's bound data is split by (a new run: rule 3; a run of before,
    resumed, recorded none: rule 2), and a resumed run whose RUN/data is gone encodes it again by
    that rule, so it goes on in the rows it trained on; a new run's data is split by rule 3."""
    from flowrec.runs.start import run_settings, session_options
    from flowrec.runtime.session import bound_dataset

    rng = np.random.default_rng()
    n = int(rng.integers(200, 400))
    (tmp_path / "rows.csv").write_text("c,rid,label\n" + "\n".join(_rows(rng, n)) + "\n")
    spec = _spec("rows.csv", test_fraction=0.3, split_seed=3)
    new, _ = run_settings({}, spec)
    assert new["split_rule"] == SPLIT_RULE
    recorded = {k: v for k, v in new.items() if k != "split_rule"}  # a run.json of before rule 3
    old, _ = run_settings({}, spec, recorded)
    assert old["split_rule"] == INDEX_SPLIT_RULE
    assert run_settings({}, spec, new)[0]["split_rule"] == SPLIT_RULE  # a run of rule 3 keeps it
    for name, settings, resumed, rule in (("old", old, True, INDEX_SPLIT_RULE), ("fresh", old, False, SPLIT_RULE),
                                          ("new", new, True, SPLIT_RULE)):
        run = tmp_path / name
        out = bound_dataset(spec, tmp_path / "spec.yaml", run, lambda _: None, resumed,
                            split_rule=session_options(settings, run, resumed).split_rule)
        assert read_meta(out / "train").split["split_rule"] == rule, name
        test = _written_rids(out, "test")
        if rule == INDEX_SPLIT_RULE:
            assert sorted(test) == np.flatnonzero(split_mask(0, n, 0.3, 3)).tolist()


def test_a_wide_chunk_hashes_the_columns_of_a_type_at_once_and_alike(monkeypatch):
    """A chunk of one row of 100,000 columns took 12 s to hash, 100,000 rounds of Arrow calls (the
    conversion of that row 7 s without the hash): a chunk of few rows hashes the columns of one type
    as one array, each row's hash what a chunk of many rows gives it column by column."""
    from flowrec.data import duplicates

    rng = np.random.default_rng()
    width, many = int(rng.integers(300, 700)), duplicates.JOIN_ROWS + int(rng.integers(1, 50))
    columns = {f"s{i}": [f"v{v}" if v % 7 else None for v in rng.zipf(1.3, many)] for i in range(width)}
    columns.update({f"x{i}": rng.lognormal(size=many) for i in range(width // 3)})
    columns["tags"] = [[int(v)] for v in rng.integers(0, 9, many)]
    table = pa.table(columns)
    wide = row_hashes(table)  # (many,): column by column
    calls = []
    hashes = duplicates.column_hashes
    monkeypatch.setattr(duplicates, "column_hashes", lambda column: calls.append(1) or hashes(column))
    few = int(rng.integers(1, 8))
    assert row_hashes(table.slice(0, few)).tolist() == wide[:few].tolist()
    assert len(calls) == 3  # the text columns, the float columns, the list column


def test_the_copy_counter_holds_a_bounded_share_of_memory():
    """The counter held up to 1.5 million records of 56 bytes between merges (246 MB at its peak with
    the merge's copies, beside a conversion's own memory); it holds at most about 22 MB of them."""
    rng = np.random.default_rng()
    counter = Duplicates()
    most = 0
    for start in range(0, 1_400_000, 65_536):
        hashes = rng.integers(0, 1 << 64, 65_536, dtype=np.uint64)
        counter.observe("x.csv", hashes, np.arange(start, start + 65_536) + 2)
        held = sum(v.nbytes for v in counter._kept.values()) + sum(v.nbytes for p in counter._pending
                                                                    for v in p.values())
        most = max(most, held)
    assert most <= 24 << 20, most
    assert counter.count() == (0, True)


@pytest.mark.parametrize("item", ["int64", "int8", "uint64", "string", "large_string"])
@pytest.mark.parametrize("outer", ["list", "large_list"])
def test_a_list_column_s_texts_are_python_s_for_every_row(item: str, outer: str):
    """A column of lists (multi-hot ids) is hashed by each row's Python text, `repr` of its list: it
    was written by Python row by row (2.8 s a 200,000-row column); Arrow's kernels now write lists of
    integers and of plain text, Python only the rows whose text `repr` escapes or quotes otherwise. The
    bytes must stay the same (a row's hash draws its train/test side)."""
    from flowrec.data.duplicates import column_hashes, value_texts

    rng = np.random.default_rng()
    n = int(rng.integers(50, 400))
    lengths = rng.integers(0, 9, n)
    size = int(lengths.sum())
    if item.startswith("int") or item.startswith("uint"):
        kind = getattr(pa, item)()
        info = np.iinfo(item)
        values = (rng.zipf(1.3, size) % 1000).astype(item)
        values[rng.random(size) < 0.05] = info.max  # the widest texts, and the most negative for signed
        if info.min < 0:
            values[rng.random(size) < 0.05] = info.min
            values[rng.random(size) < 0.2] *= -1
        items = pa.array(values, kind, mask=rng.random(size) < 0.05)
    else:
        odd = ["it's", 'say "hi"', "back\\slash", "caf\u00e9", "tab\there", "new\nline", "nul\0", "", " ", "\u2028",
               "both ' and \"", "\U0001f600", "~"]
        words = [odd[int(rng.integers(len(odd)))] if rng.random() < 0.1 else f"i{rng.zipf(1.3)}" for _ in range(size)]
        items = pa.array([None if rng.random() < 0.05 else w for w in words], getattr(pa, item)())
    offsets = np.concatenate([[0], np.cumsum(lengths)])
    make = pa.ListArray if outer == "list" else pa.LargeListArray
    lists = make.from_arrays(pa.array(offsets, pa.int32() if outer == "list" else pa.int64()), items,
                             mask=pa.array(rng.random(n) < 0.1))
    start = int(rng.integers(0, n // 3))
    for column in (lists, lists.slice(start, n - start - int(rng.integers(0, n // 3)))):  # a view into the rows too
        expected = pa.array([None if v is None else repr(v) for v in column.to_pylist()], pa.large_string())
        assert value_texts(column).equals(expected), (item, outer)
    # and so each row's hash is the one of its Python text
    expected = column_hashes(pa.array([None if v is None else repr(v) for v in lists.to_pylist()], pa.large_string()))
    assert np.array_equal(column_hashes(lists), expected)
