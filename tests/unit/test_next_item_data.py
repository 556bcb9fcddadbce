"""Next-item (SASRec) data from MovieLens: the reader's ``sequence: {max_len: L}`` rows and the
conversion's ``split: leave_last_out``, against a plain-Python construction on a slice of the real
u.data (skipped when the shared data is absent), and their one-line errors."""
from __future__ import annotations

import shutil
from collections import defaultdict
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from flowrec.data.convert import convert
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import DataError, read_meta
from flowrec.data.sequences import TEST_COLUMN
from flowrec.data.sources import read_movielens
from flowrec.spec import spec_from_dict

SLICE = 3000  # ratings of the slice (u.data lines, many users, ties in time among them)


def ml_slice(shared: Path, tmp: Path, lines: int = SLICE) -> Path:
    """A MovieLens folder whose u.data holds the first `lines` ratings of the real one."""
    folder = tmp / "ml"
    folder.mkdir()
    for name in ("u.user", "u.item", "u.genre"):
        shutil.copy(shared / "movielens-100k" / name, folder / name)
    head = (shared / "movielens-100k" / "u.data").read_text().splitlines()[:lines]
    (folder / "u.data").write_text("\n".join(head) + "\n")
    return folder


def reference(folder: Path, max_len: int) -> list[tuple[int, int, list[int], bool]]:
    """(user, item, history, last) per next-item example, in plain Python: each user's ratings by
    (time, line); every rating after the first, with the up to max_len items before it."""
    by_user: dict[int, list[tuple[int, int, int]]] = defaultdict(list)
    for line, text in enumerate((folder / "u.data").read_text().splitlines()):
        user, item, _, stamp = (int(x) for x in text.split("\t"))
        by_user[user].append((stamp, line, item))
    out = []
    for user in sorted(by_user):
        items = [item for _, _, item in sorted(by_user[user])]
        for t in range(1, len(items)):
            out.append((user, items[t], items[max(0, t - max_len):t], t == len(items) - 1))
    return out


COMMON = {"optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adam", "lr": 0.01}},
          "training": {"batch_size": 64, "epochs": 1, "seed": 0}}


def spec(max_len: int, **options):
    return spec_from_dict({**COMMON,
        "name": "seq", "features": [
            {"name": "item_id", "type": "categorical", "table": "items"},
            {"name": "history", "type": "sequence", "table": "items", "max_len": max_len, "pooling": "none"}],
        "tables": [{"name": "items", "vocab": 1682, "dim": 8}],
        "modules": [{"name": "enc", "kind": "self_attention", "inputs": ["history"], "causal": True},
                    {"name": "score", "kind": "similarity", "inputs": ["enc", "item_id"], "metric": "dot"}],
        "heads": [{"name": "next", "input": "score", "task": "retrieval"}],
        "data": {"format": "movielens", "path": "x", "label": "label",
                 "options": {"sequence": {"max_len": max_len}, **options}}})


@pytest.mark.parametrize("max_len", [1, 5, 50])
def test_reader_rows_equal_the_plain_python_construction(shared_data, tmp_path, max_len):
    folder = ml_slice(shared_data, tmp_path)
    (table,) = read_movielens(folder, {"sequence": {"max_len": max_len}}, ErrorLog(), set())
    got = list(zip(table.column("user_id").to_pylist(), table.column("item_id").to_pylist(),
                   table.column("history").to_pylist(), table.column(TEST_COLUMN).to_pylist()))
    want = reference(folder, max_len)
    assert len(want) > 2000 and any(len(h) == max_len for _, _, h, _ in want)
    assert got == want
    # each row keeps its target rating's own columns (rating, u.data line)
    lines = (folder / "u.data").read_text().splitlines()
    for i in range(0, table.num_rows, 97):
        user, item, rating, _ = (int(x) for x in lines[table.column("__line__")[i].as_py() - 1].split("\t"))
        assert (user, item, rating) == (got[i][0], got[i][1], table.column("rating")[i].as_py())


def test_leave_last_out_puts_each_users_last_example_in_test(shared_data, tmp_path):
    folder = ml_slice(shared_data, tmp_path)
    report = convert(spec(4, split="leave_last_out"), "movielens", [folder], tmp_path / "out")
    want = reference(folder, 4)
    users = {u for u, _, _, _ in want}
    assert report.split == {"train": len(want) - len(users), "test": len(users)}
    vocab = pq.read_table(tmp_path / "out" / "test" / "_vocab" / "items.parquet").column("value").to_pylist()
    # the vocabulary is fitted on the train rows alone (targets and histories): an item seen only in
    # users' last examples has no row (0, unknown; -1 here)
    trained = {i for _, item, hist, is_last in want if not is_last for i in (item, *hist)}
    assert sorted(int(v) for v in vocab) == sorted(trained)
    unseen = {item for _, item, _, is_last in want if is_last} - trained
    assert unseen  # the slice holds such test items: the check below sees them as unknown
    raw = {0: -1, **{row + 1: int(value) for row, value in enumerate(vocab)}}
    known = {i: i if i in trained else -1 for _, item, hist, _ in want for i in (item, *hist)}
    for part, last in (("test", True), ("train", False)):
        t = pq.read_table(tmp_path / "out" / part, columns=["item_id", "history"])
        got = sorted((raw[i], [raw[h] for h in hist]) for i, hist in zip(t.column("item_id").to_pylist(),
                                                                         t.column("history").to_pylist()))
        assert got == sorted((known[item], [known[h] for h in hist]) for _, item, hist, is_last in want
                             if is_last == last)
        assert read_meta(tmp_path / "out" / part).split == {"split": "leave_last_out", "part": part, "fit_on": "train"}


@pytest.mark.parametrize("options, message", [
    ({"sequence": {"max_len": 0}}, "sequence.max_len must be an integer"),
    ({"sequence": {"max_len": "5"}}, "sequence.max_len must be an integer"),
    ({"sequence": {"max_len": 5, "pad": 1}}, "sequence must be {max_len: L}"),
    ({"sequence": 5}, "sequence must be {max_len: L}"),
    ({"sequence": {"max_len": 5}, "split": "last"}, "unknown data option split 'last'"),
    ({"sequence": {"max_len": 5}, "split": "leave_last_out", "test_fraction": 0.2}, "cannot be combined"),
])
def test_bad_options_are_one_line_errors(shared_data, tmp_path, options, message):
    folder = ml_slice(shared_data, tmp_path, lines=50)
    with pytest.raises(DataError, match=message) as err:
        convert(spec(5), "movielens", [folder], tmp_path / "out", options=options)
    assert "\n" not in str(err.value)
    assert not (tmp_path / "out").exists()


def test_leave_last_out_without_sequences_is_refused(shared_data, tmp_path):
    doc = {**COMMON, "name": "flat", "features": [{"name": "user_id", "type": "categorical", "vocab": 943, "dim": 4},
                                        {"name": "item_id", "type": "categorical", "vocab": 1682, "dim": 4}],
           "modules": [{"name": "score", "kind": "similarity", "inputs": ["user_id", "item_id"], "metric": "dot"}],
           "heads": [{"name": "r", "input": "score", "task": "retrieval"}],
           "data": {"format": "movielens", "path": "x", "label": "label", "options": {"split": "leave_last_out"}}}
    folder = ml_slice(shared_data, tmp_path, lines=50)
    with pytest.raises(DataError, match="leave_last_out needs per-user sequences"):
        convert(spec_from_dict(doc), "movielens", [folder], tmp_path / "out")
