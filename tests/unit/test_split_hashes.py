"""The seeded split by row hashes (rule 3) over a conversion's two passes: each row is hashed once
(the fit pass's hashes are kept for the write pass, `flowrec.data.kept_hashes`), with the same split
and the same copies' line as hashing every row again; an input of few distinct rows says how far
its test share landed from test_fraction, or why a side is empty (`flowrec.data.split_share`)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from flowrec.data import convert as convert_module
from flowrec.data.convert import convert
from flowrec.data.kept_hashes import KeptHashes
from flowrec.data.layout import DataError
from flowrec.spec import spec_from_dict


def _spec(**options):
    """A spec that needs a fit pass: a vocabulary table and a standardized feature."""
    return spec_from_dict({
        "name": "hashes",
        "features": [{"name": "user", "type": "categorical", "vocab": 400, "dim": 4},
                     {"name": "item", "type": "categorical", "hash_buckets": 997, "dim": 4},
                     {"name": "price", "type": "dense", "transform": "standardize"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse", "@dense"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "data": {"format": "csv", "path": "x", "options": options},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})


def _click_log(path: Path, rng: np.random.Generator, n: int) -> None:
    """Skewed rows (Zipf users and items, lognormal prices, a rare label), some repeated."""
    rows = [f"u{rng.zipf(1.4) % 500},i{rng.zipf(1.2) % 2000},{rng.lognormal(2, 1):.2f},{int(rng.random() < 0.15)}"
            for _ in range(n)]
    rows += [rows[i] for i in rng.integers(0, n, n // 5)]
    path.write_text("user,item,price,label\n" + "\n".join(rows) + "\n")


def test_a_split_conversion_hashes_each_row_once_and_splits_as_hashing_twice(tmp_path: Path, monkeypatch):
    """The fit pass and the write pass each hashed every row (a tenth of a Criteo-like conversion's
    CPU done twice); the write pass now takes the fit pass's hashes: the same part files and lines."""
    rng = np.random.default_rng()
    n = int(rng.integers(3_000, 6_000))
    raw = tmp_path / "log.csv"
    _click_log(raw, rng, n)
    spec = _spec(test_fraction=float(rng.uniform(0.1, 0.4)), split_seed=int(rng.integers(0, 1 << 62)),
                 chunk_bytes=int(rng.integers(2_000, 6_000)))  # many chunks (9 at the least: 15 bytes a row)
    hashed = []
    real = convert_module.row_hashes
    monkeypatch.setattr(convert_module, "row_hashes", lambda chunk: hashed.append(chunk.num_rows) or real(chunk))
    once = convert(spec, "csv", [raw], tmp_path / "once")
    assert len(hashed) > 5 and sum(hashed) == n + n // 5  # every row hashed once, over many chunks
    monkeypatch.setattr(KeptHashes, "take", lambda self, rows: None)  # every row hashed again, as before
    twice = convert(spec, "csv", [raw], tmp_path / "twice")
    assert sum(hashed) == 3 * (n + n // 5)
    assert once.split == twice.split and once.warnings == twice.warnings
    assert any("repeat" in line for line in once.warnings)
    for part in ("train", "test"):
        assert pq.read_table(tmp_path / "once" / part).equals(pq.read_table(tmp_path / "twice" / part))


def test_kept_hashes_come_back_in_order_and_none_once_the_chunks_differ(tmp_path: Path):
    rng = np.random.default_rng()
    sizes = rng.integers(1, 5_000, int(rng.integers(3, 9)))
    chunks = [rng.integers(0, 1 << 64, int(k), dtype=np.uint64) for k in sizes]
    with KeptHashes(tmp_path) as kept:
        for chunk in chunks:
            kept.put(chunk)
        assert kept.take(len(chunks[0])) is None  # not before the pass is done
    with KeptHashes(tmp_path) as kept:
        for chunk in chunks:
            kept.put(chunk)
        kept.done()
        assert not list(tmp_path.iterdir())  # an unnamed file: nothing left in the output folder
        assert kept.take(len(chunks[0])).tolist() == chunks[0].tolist()
        assert kept.take(len(chunks[1]) + 1) is None  # another chunk than the fit pass's
        assert kept.take(len(chunks[2])) is None  # and none after it


def test_a_split_without_a_fit_pass_hashes_in_its_write_pass(tmp_path: Path):
    """A spec of hashed tables alone has no fit pass: its write pass hashes the rows itself."""
    rng = np.random.default_rng()
    spec = spec_from_dict({
        "name": "nofit", "features": [{"name": "item", "type": "categorical", "hash_buckets": 97, "dim": 4}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "data": {"format": "csv", "path": "x", "options": {"test_fraction": 0.5}},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})
    raw = tmp_path / "r.csv"
    rows = int(rng.integers(40, 400))
    raw.write_text("item,label\n" + "".join(f"i{rng.zipf(1.3)},{int(rng.random() < 0.2)}\n" for _ in range(rows)))
    report = convert(spec, "csv", [raw], tmp_path / "out")
    assert report.split["train"] + report.split["test"] == rows and min(report.split.values()) > 0


@pytest.mark.parametrize("table", [{"vocab": 50}, {"hash_buckets": 97}])  # with a fit pass, and without
def test_few_distinct_rows_say_their_test_share_or_refuse_an_empty_side(tmp_path: Path, table: dict):
    """3 distinct rows repeated 1,000 times put 0, 1/3, 2/3 or all of the rows in test whatever the
    test_fraction, without a word (an empty side was 'change test_fraction or split_seed, or convert
    more rows'). A share far from the fraction is one line with both and the distinct rows; an empty
    side is an error naming the distinct rows and rule 3, and nothing is written."""
    rng = np.random.default_rng()
    distinct = int(rng.integers(3, 5))
    counts = rng.integers(200, 900, distinct)
    rows = [f"u{rng.integers(0, 10**6)},{int(rng.random() < 0.3)}" for _ in range(distinct)]
    lines = [rows[k] for k in rng.permutation(np.repeat(np.arange(distinct), counts))]
    raw = tmp_path / "few.csv"
    raw.write_text("user,label\n" + "\n".join(lines) + "\n")
    spec = spec_from_dict({
        "name": "few", "features": [{"name": "user", "type": "categorical", "dim": 4, **table}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}], "data": {"format": "csv", "path": "x", "options": {}},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}}})
    fraction = float(rng.choice([0.1, 0.2, 0.7]))
    said = {"line": 0, "test": 0, "train": 0}
    for seed in range(150):  # 50 seeds, and more until both a line and an empty side were said
        if seed >= 50 and said["line"] and said["test"] + said["train"]:
            break
        out = tmp_path / f"out{seed}"
        try:
            report = convert(spec, "csv", [raw], out, options={"test_fraction": fraction, "split_seed": seed})
        except DataError as exc:
            side = "test" if "into the test split" in str(exc) else "train"
            assert f"its {len(lines):,} rows hold {distinct} distinct rows" in str(exc) and "(rule 3)" in str(exc)
            assert ("none was drawn for test" if side == "test" else "every one was drawn for test") in str(exc)
            assert not out.exists()
            said[side] += 1
            continue
        test, total = report.split["test"], len(lines)
        line = [w for w in report.warnings if "the split put" in w]
        off = abs(test / total - fraction)
        assert not line or off > 0.25 * fraction, line  # said only where far
        if off > 0.25 * fraction and off > 4 * (fraction * (1 - fraction) / total) ** 0.5:  # farther than chance
            assert len(line) == 1 and f"put {test:,} of the {total:,} rows ({test / total:.1%}) in test" in line[0]
            assert f"test_fraction {fraction:g}" in line[0] and f"hold {distinct} distinct rows" in line[0]
            said["line"] += 1
    assert said["line"] and said["test"] + said["train"], said


def test_a_split_of_distinct_rows_says_nothing_of_its_share(tmp_path: Path):
    """Rows each of their own: a small input's share strays by chance alone, not by copies: no line."""
    rng = np.random.default_rng()
    spec = _spec()
    for seed in range(5):
        raw = tmp_path / f"r{seed}.csv"
        n = int(rng.integers(60, 120))  # 20 rows left test empty at 0.3 once in 1,250 (0.7^20): an error
        raw.write_text("user,item,price,label\n" + "".join(f"u{r},i{rng.zipf(1.3)},{rng.lognormal():.3f},{r % 2}\n"
                                                           for r in range(n)))
        report = convert(spec, "csv", [raw], tmp_path / f"o{seed}", options={"test_fraction": 0.3, "split_seed": seed})
        assert not [w for w in report.warnings if "the split put" in w or "earlier row" in w], report.warnings
