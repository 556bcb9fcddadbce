"""Batch iterator: exactly-once epochs, packing against a per-sample reference, resume, shutdown."""
from __future__ import annotations

import threading

import numpy as np
import pyarrow as pa
import pytest
import torch

from flowrec.data import convert
from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, ParquetSource, split_table
from flowrec.data.synth import SynthConfig, synth_dataset, synth_table
from flowrec.graph.packing import group_layout
from flowrec.spec import spec_from_dict

ROWS = 1000


def make_spec() -> object:
    return spec_from_dict({
        "name": "mix",
        "features": [
            {"name": "x", "type": "dense"},
            {"name": "rid", "type": "categorical", "hash_buckets": ROWS + 1, "dim": 4},
            {"name": "a", "type": "categorical", "hash_buckets": 50, "dim": 8},
            {"name": "tags", "type": "sequence", "vocab": 30, "dim": 8, "max_len": 3, "pooling": "mean"},
            {"name": "hist", "type": "sequence", "vocab": 40, "dim": 8, "max_len": 4, "pooling": "none"},
        ],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}, {"name": "r", "input": "m", "task": "regression",
                                                "label": "score"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 64, "seed": 3},
    })


def make_table(spec, rows: int = ROWS) -> pa.Table:
    t = synth_table(spec, rows, SynthConfig(seed=1))
    return t.set_column(t.column_names.index("rid"), "rid", pa.array(np.arange(1, rows + 1)))


def reference_pack(group, rows: dict) -> tuple[list[int], list[int]]:
    """Per-sample, per-field packing written the obvious way."""
    ids, offsets = [], [0]
    for b in range(len(rows["rid"])):
        for f in group.fields:
            base = group.row_offsets[f.table]
            value = rows[f.feature][b]
            if not isinstance(value, list):
                bags = [[value]]
            elif f.pooling == "none":
                bags = [[v] for v in value[: f.max_len]] + [[]] * (f.max_len - min(len(value), f.max_len))
            else:
                bags = [value]
            for bag in bags:
                ids += [v + base for v in bag]
                offsets.append(len(ids))
    return ids, offsets


def rids(batch, spec) -> np.ndarray:
    g = next(g for g in group_layout(spec) if g.fields[0].feature == "rid")
    return batch.groups[g.name].ids.numpy() - g.row_offsets["rid"]


@pytest.mark.parametrize("partitions", [1, 3, 7])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("shuffle", [False, True])
def test_epoch_yields_every_row_once(partitions, workers, shuffle):
    spec = make_spec()
    table = make_table(spec)
    opts = StagingOptions(batch_size=64, shuffle=shuffle, shuffle_buffer=200, workers=workers, prefetch=2)
    with iterate_batches(spec, MemorySource(split_table(table, partitions)), opts) as it:
        batches = list(it)
    seen = np.concatenate([rids(b, spec) for b in batches])
    assert sorted(seen.tolist()) == list(range(1, ROWS + 1))
    assert [b.index for b in batches] == list(range(len(batches)))
    assert [b.size for b in batches] == [64] * (ROWS // 64) + [ROWS % 64]
    assert (seen.tolist() == list(range(1, ROWS + 1))) == (not shuffle)


def test_packing_matches_per_sample_reference():
    spec = make_spec()
    table = make_table(spec)
    by_rid = table.to_pydict()
    opts = StagingOptions(batch_size=50, shuffle=True, shuffle_buffer=120)
    with iterate_batches(spec, MemorySource(split_table(table, 4)), opts) as it:
        for batch in it:
            order = rids(batch, spec) - 1
            rows = {k: [v[i] for i in order] for k, v in by_rid.items()}
            for g in group_layout(spec):
                ids, offsets = reference_pack(g, rows)
                assert batch.groups[g.name].ids.tolist() == ids
                assert batch.groups[g.name].offsets.tolist() == offsets
                assert len(offsets) == batch.size * g.bags_per_sample + 1
            assert batch.dense[:, 0].tolist() == pytest.approx(rows["x"])
            assert batch.labels[:, 0].tolist() == rows["label"]
            assert batch.labels[:, 1].tolist() == pytest.approx(rows["score"])


def test_epochs_differ_and_seed_is_deterministic():
    spec = make_spec()
    src = MemorySource(split_table(make_table(spec), 3))
    opts = StagingOptions(batch_size=64, shuffle_buffer=300)

    def order(epoch):
        with iterate_batches(spec, src, opts, epoch=epoch) as it:
            return np.concatenate([rids(b, spec) for b in it]).tolist()

    assert order(0) == order(0)
    assert order(0) != order(1)


@pytest.mark.parametrize("start", [0, 1, 4, 7, 15])
def test_resume_gives_the_same_remaining_batches(start):
    spec = make_spec()
    src = MemorySource(split_table(make_table(spec), 5))
    opts = StagingOptions(batch_size=64, shuffle_buffer=150, workers=2)
    with iterate_batches(spec, src, opts, epoch=2) as it:
        full = [rids(b, spec).tolist() for b in it]
    with iterate_batches(spec, src, opts, epoch=2, start_batch=start) as it:
        resumed = [(b.index, rids(b, spec).tolist()) for b in it]
    assert resumed == list(enumerate(full))[start:]


def test_drop_last():
    spec = make_spec()
    opts = StagingOptions(batch_size=64, drop_last=True)
    with iterate_batches(spec, MemorySource([make_table(spec)]), opts) as it:
        sizes = [b.size for b in it]
    assert sizes == [64] * (ROWS // 64)


def test_parquet_source_and_early_close_leave_no_threads(tmp_path):
    spec = make_spec()
    synth_dataset(spec, tmp_path / "d", 700, rows_per_file=100)
    src = ParquetSource(tmp_path / "d")
    assert src.partition_rows() == [100] * 7
    it = iterate_batches(spec, src, StagingOptions(batch_size=32, prefetch=1, lookahead=3))
    next(it)
    threads = list(it._threads)
    it.close()
    assert threads and not [t for t in threads if t.is_alive()]
    assert not [t for t in threading.enumerate() if t.name.startswith("flowrec-pack")]
    with iterate_batches(spec, src, StagingOptions(batch_size=32, shuffle=False)) as it:
        total = sum(b.size for b in it)
    src.close()
    assert total == 700


def test_worker_error_reaches_the_consumer():
    spec = make_spec()
    bad = make_table(spec).drop_columns(["a"])
    with pytest.raises(KeyError):
        with iterate_batches(spec, MemorySource([bad]), StagingOptions(batch_size=64)) as it:
            list(it)


def _rank_batches(spec, source, world: int, rank: int, workers: int, epoch: int = 1) -> list:
    opts = StagingOptions(batch_size=64, shuffle_buffer=200, workers=workers, prefetch=2, world_size=world,
                          rank=rank)
    with iterate_batches(spec, source, opts, epoch) as it:
        return list(it)


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("partitions", [1, 7])
@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("group_rows", [None, 16])
def test_ranks_split_the_global_batches_of_one_process(world, partitions, workers, group_rows):
    """Rank r's batch k is slice r of the one-process batch k: together the ranks cover every row
    of the epoch exactly once, in the same global batches, whatever W, partitions, row groups and
    workers."""
    spec = make_spec()
    source = MemorySource(split_table(make_table(spec), partitions), group_rows=group_rows)
    whole = _rank_batches(spec, source, 1, 0, workers)
    ranks = [_rank_batches(spec, source, world, r, workers) for r in range(world)]
    assert all(len(batches) == len(whole) for batches in ranks)  # every rank runs every step
    for k, batch in enumerate(whole):
        parts = [ranks[r][k] for r in range(world)]
        assert [p.index for p in parts] == [k] * world
        assert [p.global_size for p in parts] == [batch.size] * world
        assert sum(p.size for p in parts) == batch.size and max(p.size for p in parts) - min(p.size for p in parts) <= 1
        assert np.concatenate([rids(p, spec) for p in parts]).tolist() == rids(batch, spec).tolist()
        dense = np.concatenate([p.dense.numpy() for p in parts])
        assert np.array_equal(dense, batch.dense.numpy())
    seen = np.concatenate([rids(b, spec) for batches in ranks for b in batches])
    assert sorted(seen.tolist()) == list(range(1, ROWS + 1))


@pytest.mark.parametrize("world", [2, 4])
def test_a_rank_reads_about_its_share_of_a_shuffled_epoch(world):
    """With row groups much smaller than a shuffle chunk, rank r reads about 1/W of the epoch's bytes
    (its strata of each chunk, plus at most a row group at each end); the ranks together read every
    row; one process reads every row once."""
    spec = make_spec()
    tables = split_table(make_table(spec), 3)
    opts = dict(batch_size=64, shuffle_buffer=512, workers=1, prefetch=2)

    def epoch_bytes(rank: int, size: int) -> tuple[int, list]:
        source = MemorySource(tables, group_rows=16)
        with iterate_batches(spec, source, StagingOptions(**opts, world_size=size, rank=rank), 2) as it:
            batches = list(it)
        return source.bytes_read, batches

    whole, _ = epoch_bytes(0, 1)
    assert whole == sum(t.select(sorted(t.column_names)).nbytes for t in tables)
    shares, seen = [], []
    for rank in range(world):
        read, batches = epoch_bytes(rank, world)
        shares.append(read / whole)
        seen += [rid for b in batches for rid in rids(b, spec).tolist()]
    assert sorted(seen) == list(range(1, ROWS + 1))
    assert max(shares) < 1 / world + 0.12, shares  # 512-row chunks, 16-row groups: <= 2 extra groups each
    assert sum(shares) >= 1


def test_parquet_ranks_read_their_row_groups(tmp_path, monkeypatch):
    """Converted part files are cut into row groups; a rank of 2 reads about half the stored bytes
    and gets exactly its slices of the global batches (checked against one process)."""
    monkeypatch.setattr(convert, "ROW_GROUP_ROWS", 32)
    spec = make_spec()
    synth_dataset(spec, tmp_path / "d", ROWS, rows_per_file=400)
    opts = dict(batch_size=64, shuffle_buffer=256, workers=1)
    runs = []
    for world, rank in [(1, 0), (2, 0), (2, 1)]:
        src = ParquetSource(tmp_path / "d")
        assert src.row_groups(0) == [32] * 12 + [16]
        with iterate_batches(spec, src, StagingOptions(**opts, world_size=world, rank=rank), 1) as it:
            runs.append(([b.dense.numpy() for b in it], src.bytes_read))
        src.close()
    (whole, total), (first, read0), (second, read1) = runs
    assert all(np.array_equal(np.concatenate([a, b]), w) for w, a, b in zip(whole, first, second))
    assert read0 / total < 0.65 and read1 / total < 0.65 and read0 + read1 >= total


def test_a_final_batch_smaller_than_the_world_leaves_some_ranks_empty():
    spec = make_spec()
    source = MemorySource(split_table(make_table(spec, 65), 2))  # batches of 64 and 1
    ranks = [_rank_batches(spec, source, 3, r, 2) for r in range(3)]
    assert [[b.size for b in batches] for batches in ranks] == [[21, 0], [21, 0], [22, 1]]
    empty = ranks[0][1]
    assert all(ids.ids.numel() == 0 and ids.offsets.tolist() == [0] for ids in empty.groups.values())
    assert empty.dense.shape == (0, 1) and empty.labels.shape == (0, 2)
    assert [b.global_size for b in ranks[0]] == [64, 1]


def test_row_group_reads_name_bad_rows_within_the_file_and_skip_empty_parts(tmp_path, monkeypatch):
    """Checked row group by row group, a bad id is still named by its row in the part file; an
    empty part file (0 rows) between others is skipped."""
    import pyarrow.parquet as pq

    from flowrec.data.layout import DataError

    monkeypatch.setattr(convert, "ROW_GROUP_ROWS", 32)
    spec = make_spec()
    synth_dataset(spec, tmp_path / "d", ROWS, rows_per_file=400)
    parts = sorted((tmp_path / "d").glob("part-*.parquet"))
    table = pq.read_table(parts[1])
    pq.write_table(table.slice(0, 0), tmp_path / "d" / "part-00001a.parquet")  # sorts between 1 and 2
    with iterate_batches(spec, ParquetSource(tmp_path / "d"), StagingOptions(batch_size=64, world_size=2, rank=1)) as it:
        assert sum(b.size for b in it) == ROWS // 2
    ids = table.column("a").to_numpy().copy()
    ids[70] = 999  # the third row group of the file
    pq.write_table(table.set_column(table.column_names.index("a"), "a", pa.array(ids)), parts[1], row_group_size=32)
    with pytest.raises(DataError, match=rf"^{parts[1]}: column 'a': id 999 outside .* at row 70 \(0-based\)"):
        with iterate_batches(spec, ParquetSource(tmp_path / "d"), StagingOptions(batch_size=64, shuffle=False)) as it:
            list(it)


def make_flat_spec() -> object:
    """One id per field in two packed groups (dims 4 and 8), two heads: staged by row gathers."""
    return spec_from_dict({
        "name": "flat",
        "features": [
            {"name": "x", "type": "dense"},
            {"name": "y", "type": "dense"},
            {"name": "a", "type": "categorical", "hash_buckets": 5000, "dim": 4},
            {"name": "b", "type": "categorical", "hash_buckets": 70, "dim": 4},
            {"name": "c", "type": "categorical", "hash_buckets": 900, "dim": 8},
            {"name": "d", "type": "categorical", "hash_buckets": 33, "dim": 8},
        ],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}, {"name": "r", "input": "m", "task": "regression",
                                                "label": "score"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 64, "seed": 5},
    })


def _staged(spec, source, opts, epoch, start, gather, monkeypatch) -> list:
    from flowrec.data.batches import BatchIterator

    monkeypatch.setattr(BatchIterator, "gather_chunks", gather)
    with iterate_batches(spec, source, opts, epoch, start) as it:
        return list(it)


def _same_batch(a, b) -> None:
    assert (a.index, a.size, a.global_size, a.epoch) == (b.index, b.size, b.global_size, b.epoch)
    for x, y in [(a.dense, b.dense), (a.labels, b.labels)]:
        assert x.dtype == y.dtype and x.shape == y.shape and x.numpy().tobytes() == y.numpy().tobytes()
    assert a.groups.keys() == b.groups.keys()
    for name, ga in a.groups.items():
        gb = b.groups[name]
        for field in ["ids", "offsets", "unique", "window_unique", "horizon_rows", "horizon_next"]:
            x, y = getattr(ga, field), getattr(gb, field)
            assert (x is None) == (y is None), (name, field)
            if x is not None:
                assert x.dtype == y.dtype and torch.equal(x, y), (name, field)
        assert (ga.casting is None) == (gb.casting is None)
        if ga.casting is not None:
            assert ga.casting.num_bags == gb.casting.num_bags
            for field in ["unique_ids", "counts", "unique_offsets", "sorted_bags", "sorted_scale"]:
                x, y = getattr(ga.casting, field), getattr(gb.casting, field)
                assert (x is None) == (y is None) and (x is None or torch.equal(x, y)), (name, field)


@pytest.mark.parametrize("seed", [11, 12])
@pytest.mark.parametrize("world,rank", [(1, 0), (3, 2)])
@pytest.mark.parametrize("shuffle,start,lookahead", [(True, 0, 0), (True, 5, 0), (False, 0, 0), (True, 0, 3)])
def test_gathered_chunks_equal_the_table_path(tmp_path, monkeypatch, seed, world, rank, shuffle, start, lookahead):
    """Staging by row gathers of per-chunk matrices gives bitwise the batches of the per-batch take
    and pack path, on skewed (Zipf) ids over uneven part files and row groups, chunks spanning files,
    rank slices, a resume and lookahead."""
    monkeypatch.setattr(convert, "ROW_GROUP_ROWS", 48)
    spec = make_flat_spec()
    synth_dataset(spec, tmp_path / "d", 1237, SynthConfig(seed=seed), rows_per_file=500)
    opts = StagingOptions(batch_size=100, shuffle=shuffle, shuffle_buffer=300, workers=2, prefetch=3,
                          lookahead=lookahead, world_size=world, rank=rank)
    runs = []
    for gather in [True, False]:
        source = ParquetSource(tmp_path / "d")
        runs.append(_staged(spec, source, opts, seed, start, gather, monkeypatch))
        source.close()
    gathered, taken = runs
    assert len(gathered) == len(taken) == 13 - start
    for a, b in zip(gathered, taken):
        _same_batch(a, b)
    ids = np.concatenate([g.ids.numpy() for bt in gathered for g in bt.groups.values()])
    assert len(np.unique(ids)) > 50 and np.bincount(ids).max() > 20  # skewed, not constant


def test_flat_specs_stage_without_a_table_take(monkeypatch):
    """A spec of one-hot fields never takes a chunk as a table (one gather per batch instead); a
    spec with sequences still does, and both cover every row once."""
    from flowrec.data import batches as staging

    calls = []
    real = staging.take_rows
    monkeypatch.setattr(staging, "take_rows", lambda *a: calls.append(1) or real(*a))
    flat = make_flat_spec()
    table = synth_table(flat, 700, SynthConfig(seed=4))
    with iterate_batches(flat, MemorySource(split_table(table, 3)), StagingOptions(batch_size=64)) as it:
        dense = np.concatenate([b.dense.numpy() for b in it])
    assert not calls
    assert sorted(dense[:, 0].tolist()) == sorted(table.column("x").to_numpy().tolist())
    spec = make_spec()
    with iterate_batches(spec, MemorySource([make_table(spec)]), StagingOptions(batch_size=64)) as it:
        assert sorted(np.concatenate([rids(b, spec) for b in it]).tolist()) == list(range(1, ROWS + 1))
    assert calls
