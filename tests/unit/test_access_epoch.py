"""What one pass over the data reads (`flowrec.data.profile.RowsRead`, `dataset_counts`) and what the
planner prices from it (`flowrec.planner.access.EpochCounts`): the distinct rows of a stretch of
the epoch and the rows a lookahead scratchpad fetches, checked against the data itself and against
the runtime's scratchpad (victims by next use in the horizon, `NextUseFirst`) on fresh skewed
synthetic data each run."""
from __future__ import annotations

import json
from dataclasses import replace
from math import ceil

import numpy as np
import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.packed_ids import column_arrays, pack_group
from flowrec.data.profile import count_histogram, profile_access
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.kinds import HORIZON_WINDOWS
from flowrec.graph.packing import group_layout
from flowrec.planner.access import BEYOND_HORIZON_SAVED, EpochCounts, group_model, retained_fetches
from flowrec.planner.cost import group_access, new_rows_per_batch
from flowrec.planner.manager import load_profile
from flowrec.planner.passes.cache import LOOKAHEAD_MARGIN
from flowrec.runtime.caches import LookaheadEmbedding
from flowrec.spec import spec_from_dict
from flowrec.testing.caches import CPU, head_weights, loss_of

DOC = {
    "name": "epoch",
    "features": [{"name": f"c{i}", "type": "categorical", "hash_buckets": v, "dim": 4}
                 for i, v in enumerate([300, 8_000, 50_000, 200_000])],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    "training": {"batch_size": 256, "seed": 0},
    "plan": {"window": 4},
}


def _data(seed: int, rows: int):
    spec = spec_from_dict(DOC)
    (group,) = group_layout(spec)
    table = synth_table(spec, rows, SynthConfig(seed=seed))
    return spec, group, table, MemorySource(split_table(table, 3))


def _reads(spec, group, table) -> np.ndarray:
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    return np.bincount(pack_group(group, cols, table.num_rows)[0], minlength=group.rows)


def test_a_profile_counts_every_read_of_the_whole_data(tmp_path):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed, 30_000)
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile_access(spec, source, sample_rate=0.05, seed=seed)))
    prof = load_profile(path)  # the schema holds the new figures
    reads = _reads(spec, group, table)
    for slot in group.tables:
        mine = reads[slot.row_offset:slot.row_offset + slot.rows]
        entry = prof["tables"][slot.table]
        assert entry["dataset_distinct"] == int((mine > 0).sum())
        hist = entry["dataset_counts"]
        assert sum(r for _, r in hist) == entry["dataset_distinct"]
        assert sum(c * r for c, r in hist) == pytest.approx(float(mine.sum()), rel=1e-9)
        exact = {int(c): r for c, r in hist if c <= 16}
        for c in range(1, 17):
            assert exact.get(c, 0) == int((mine == c).sum())
        if entry["unseen"]["share"] > 0:  # the rows the sample missed: exactly the rest of those read
            assert entry["unseen"]["rows"] == entry["dataset_distinct"] - entry["distinct"]


@pytest.mark.parametrize("bad", [[[0.5, 3]], [[2, -1]], [[1, 2, 3]], [["x", 1]]])
def test_a_profile_with_broken_read_counts_is_refused_in_one_line(tmp_path, bad):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, _, source = _data(seed, 5_000)
    doc = profile_access(spec, source, seed=seed)
    doc["tables"]["c2"]["dataset_counts"] = bad
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="dataset_counts") as err:
        load_profile(path)
    assert "\n" not in str(err.value)


def test_count_histogram_bins_beyond_the_exact_counts():
    counts = np.array([0, 1, 1, 2, 16, 17, 17, 40, 41, 1000])
    hist = count_histogram(counts)
    assert hist[:3] == [[1, 2], [2, 1], [16, 1]]
    assert sum(r for _, r in hist) == 9
    assert sum(c * r for c, r in hist) == pytest.approx(float(counts.sum()))
    assert all(a[0] < b[0] for a, b in zip(hist, hist[1:]))


def test_distinct_rows_of_a_stretch_of_the_epoch_match_the_data():
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed, 40_000)
    prof = profile_access(spec, source, seed=seed)
    model = group_access(group, prof)
    assert model.epoch is not None
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    ids = pack_group(group, cols, table.num_rows)[0].reshape(table.num_rows, -1)
    order = np.random.default_rng(seed).permutation(table.num_rows)
    per_sample = ids.shape[1]
    for samples in (256, 2_048, 12_000):
        # every stretch of `samples` in the first 36,000 rows, not three: three stretches of 256
        # samples put their mean 3.2% from the model's expectation once (a flaky failure in CI;
        # over 25 seeds the three stretches missed it by up to 4.3%, every stretch by up to 0.5%)
        got = np.mean([len(np.unique(ids[order[k:k + samples]])) for k in range(0, 36_001 - samples, samples)])
        assert model.distinct(samples * per_sample) == pytest.approx(got, rel=0.02)
    assert model.distinct(10 * ids.size) == pytest.approx(float((np.bincount(ids.ravel()) > 0).sum()))


def test_a_profile_without_counts_keeps_the_sampled_model():
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, _, source = _data(seed, 20_000)
    prof = profile_access(spec, source, seed=seed)
    for entry in prof["tables"].values():
        entry.pop("dataset_counts")
    members = [(t.table, t.rows, 1.0) for t in group.tables]
    assert group_model(members, prof)[0].epoch is None


def test_rows_read_once_are_fetched_whatever_the_cache_holds():
    once = EpochCounts(((1.0, 1000.0),))
    # 1,000 rows read once in an epoch of 100 batches of 10 reads: 10 fetches a batch, any slots
    assert once.fetches(10.0, 4, 0.0) == pytest.approx(10.0)
    assert once.fetches(10.0, 4, 1e6) == pytest.approx(10.0)
    twice = EpochCounts(((2.0, 500.0),))
    window_only, kept = twice.fetches(10.0, 4, 0.0), twice.fetches(10.0, 4, 400.0)
    assert 5.0 < kept < window_only < 10.0  # spare slots keep a row between its two reads
    # the horizon bounds what Belady's rule keeps: past W + H batches a gap is fetched again, less
    # the share the slots beyond it save by ranking rows by their reads
    beyond = 5.0 * (1.0 - 4 * (1 + HORIZON_WINDOWS) / 100.0) ** 2
    assert 5.0 + beyond - BEYOND_HORIZON_SAVED * beyond <= kept < 5.0 + beyond
    assert twice.fetches(10.0, 4, 1e6) == pytest.approx(5.0)  # every row fits: never evicted, fetched once
    assert twice.fetches(10.0, 4, 500.0) == pytest.approx(5.0)
    assert EpochCounts(((2.0, 500.0),)).fetches(10.0, 4, 150.0) > kept  # fewer slots, fewer kept


def test_spare_slots_cut_fetches_monotonically():
    terms_of = EpochCounts(tuple((float(c), 2000.0 / c) for c in range(1, 30)))
    draws, window = 200.0, 4
    fetched = [terms_of.fetches(draws, window, cap) for cap in (0, 500, 1000, 2000, 4000, 1e9)]
    assert all(a >= b - 1e-9 for a, b in zip(fetched, fetched[1:]))
    assert fetched[-1] < fetched[0]
    assert retained_fetches(lambda t: (1.0, 7.0), window, 0.0) == 7.0


@pytest.mark.parametrize("spare", [LOOKAHEAD_MARGIN, 2.0])
def test_priced_fetches_match_the_runtimes_scratchpad(spare):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed, 16_384)
    prof = profile_access(spec, source, seed=seed)
    batch, window = spec.training.batch_size, spec.plan.window
    model = group_access(group, prof)
    capacity = ceil(model.distinct(batch * len(group.fields) * (window + 1)) * spare)
    planned = replace(group, cache_rows=capacity, dtype="fp64")
    opts = StagingOptions(batch_size=batch, shuffle_buffer=4096, workers=1, lookahead=window,
                          horizon=HORIZON_WINDOWS * window)
    with iterate_batches(spec, MemorySource(split_table(table, 3)), opts) as it:
        batches = list(it)
    module = LookaheadEmbedding(planned, seed=3, device=CPU, interleave=False)
    w = head_weights(planned)
    for b in batches:
        loss_of(module.forward_group(b.groups[group.name]), w).backward()
    module.close()
    measured = module.counters.rows_fetched / len(batches)
    priced = new_rows_per_batch(planned, batch, window, prof)
    window_only = new_rows_per_batch(replace(planned, cache_rows=0), batch, window, prof)
    assert priced == pytest.approx(measured, rel=0.06)
    assert window_only > 1.15 * measured  # the spare slots matter on this data: the window alone over-prices


def test_groups_with_managed_tables_are_not_counted():
    """A managed table's rows come from its map, not the ids read: its group keeps the sampled model."""
    doc = {**DOC, "tables": [{"name": "users", "dim": 8, "managed": {"rows": 500, "admit_min_count": 2}}],
           "features": [*DOC["features"], {"name": "u", "type": "categorical", "table": "users"}]}
    spec = spec_from_dict(doc)
    seed = int(np.random.default_rng().integers(1 << 30))
    prof = profile_access(spec, MemorySource(split_table(synth_table(spec, 6_000, SynthConfig(seed=seed)), 2)), seed=seed)
    managed = next(g for g in group_layout(spec) if any(t.table == "users" for t in g.tables))
    for slot in managed.tables:
        assert "dataset_counts" not in prof["tables"][slot.table]
    assert group_access(managed, prof).epoch is None
    counted = [g for g in group_layout(spec) if g.name != managed.name]
    assert counted  # the other tables are a group of their own (dim 4), and counted
    for g in counted:
        assert group_access(g, prof).epoch is not None


def _scratchpad_fetches(spec, group, source, capacity: int, epochs: int) -> float:
    """Rows the runtime's lookahead scratchpad fetches a batch over `epochs` epochs of `source`,
    each shuffled anew, one scratchpad throughout (as the trainer runs it)."""
    batch, window = spec.training.batch_size, spec.plan.window
    planned = replace(group, cache_rows=capacity, dtype="fp64")
    opts = StagingOptions(batch_size=batch, shuffle_buffer=4096, workers=1, lookahead=window,
                          horizon=HORIZON_WINDOWS * window)
    module = LookaheadEmbedding(planned, seed=3, device=CPU, interleave=False)
    w = head_weights(planned)
    batches = 0
    for epoch in range(epochs):
        with iterate_batches(spec, source, opts, epoch) as it:
            for b in it:
                loss_of(module.forward_group(b.groups[group.name]), w).backward()
                batches += 1
    module.close()
    return module.counters.rows_fetched / batches


@pytest.mark.parametrize("spare", [LOOKAHEAD_MARGIN, 2.0])
def test_later_epochs_fetches_priced_as_the_scratchpad_keeps_rows_across_epochs(spare):
    """A small dataset (24 batches an epoch) over 3 epochs: the scratchpad keeps its rows from one
    epoch to the next, so it fetches far fewer rows a batch than one epoch's price; the price over
    the run's epochs follows it."""
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed, 6_144)
    prof = profile_access(spec, source, seed=seed)
    batch, window = spec.training.batch_size, spec.plan.window
    capacity = ceil(group_access(group, prof).distinct(batch * len(group.fields) * (window + 1)) * spare)
    planned = replace(group, cache_rows=capacity)
    measured = _scratchpad_fetches(spec, group, MemorySource(split_table(table, 3)), capacity, 3)
    priced = new_rows_per_batch(planned, batch, window, prof, epochs=3)
    one_epoch = new_rows_per_batch(planned, batch, window, prof)
    assert priced == pytest.approx(measured, rel=0.06), (seed, priced, measured, one_epoch)
    assert one_epoch > 1.15 * measured  # the one-epoch price over-prices such a run (1.23-1.53x, 6 seeds)


def test_a_cache_that_holds_every_row_fetches_each_once_in_the_run():
    counts = EpochCounts(((1.0, 600.0), (3.0, 200.0), (40.0, 5.0)))  # 805 rows, 1,400 reads an epoch
    draws = 100.0  # 14 batches an epoch
    for epochs in (1, 2, 5):
        assert counts.fetches(draws, 2, 805.0, epochs) == pytest.approx(805.0 / (14.0 * epochs))
        assert counts.fetches(draws, 2, 1e9, epochs) == pytest.approx(805.0 / (14.0 * epochs))
    # fewer slots than rows: more fetches than that, fewer over more epochs, never fewer than once a row
    tight = [counts.fetches(draws, 2, 400.0, e) for e in (1, 2, 5)]
    assert tight[0] > tight[1] > tight[2] > 805.0 / (14.0 * 5)
    assert counts.fetches(draws, 2, 400.0) == tight[0]  # one epoch: the default


def test_run_epochs_follow_the_settings_and_max_steps():
    from flowrec.runs.plan import run_epochs

    spec = spec_from_dict({**DOC, "training": {"batch_size": 256, "seed": 0, "epochs": 4}})
    data = {"dataset_rows": 2_560}  # 10 batches an epoch
    assert run_epochs(spec, data, None, None) == 4
    assert run_epochs(spec, data, 7, None) == 7
    assert run_epochs(spec, data, None, 25) == 2  # two whole epochs before the 25th step ends the run
    assert run_epochs(spec, data, 7, 9) == 1  # not even one: priced as the first
    assert run_epochs(spec, None, 3, 9) == 3  # the data's rows unknown: the epochs asked for


def test_flowrec_plan_prices_lookahead_traffic_over_the_runs_epochs(tmp_path):
    """`flowrec plan --epochs N` (and `flowrec train`'s epochs, through `plan_for_run`) prices a
    lookahead group's traffic over N epochs of the profiled data: fewer bytes a step on a small
    dataset; `--epochs 1` is the spec's default here."""
    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.spec.load import to_dict

    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed, 6_144)
    profile = tmp_path / "profile.json"
    profile.write_text(json.dumps(profile_access(spec, source, seed=seed)))
    path = tmp_path / "spec.json"
    path.write_text(json.dumps({**to_dict(spec), "plan": {**to_dict(spec)["plan"], "cache": "lookahead"}}))
    bytes_of, groups = {}, {}
    for epochs in (None, 1, 3):
        out = tmp_path / f"plan{epochs}.json"
        args = ["plan", str(path), "--profile", str(profile), "--device-budget", "3MiB", "--target", "a100",
                "--json", str(out), "--quiet", *(["--epochs", str(epochs)] if epochs else [])]
        result = CliRunner().invoke(app, args)
        assert result.exit_code == 0, result.output
        doc = json.loads(out.read_text())
        assert [g["placement"] for g in doc["groups"]] == ["lookahead"]
        bytes_of[epochs] = doc["cost"]["h2d_bytes_per_step"]
        assert doc["cost"]["access_profile"].endswith("; lookahead traffic over 3 epochs") == (epochs == 3)
        groups[epochs] = doc["groups"][0]["cache_rows"]
    assert bytes_of[None] == bytes_of[1]
    assert groups[1] == groups[3]  # the same scratchpad: only the traffic's price differs
    planned = replace(group, cache_rows=groups[1])
    batch, window = spec.training.batch_size, spec.plan.window
    from flowrec.planner.cost import lookahead_rows_per_batch

    rows = {e: sum(lookahead_rows_per_batch(planned, batch, window, load_profile(profile), epochs=e)) for e in (1, 3)}
    assert rows[3] < 0.97 * rows[1]  # the scratchpad (the window's slots) keeps some rows across epochs
    assert bytes_of[1] - bytes_of[3] == pytest.approx((rows[1] - rows[3]) * group.row_bytes(), rel=0.01, abs=2)
    refused = CliRunner().invoke(app, ["plan", str(path), "--epochs", "0"])
    assert refused.exit_code == 2


def test_reads_are_counted_id_by_id_as_a_whole_bincount_counts_them():
    """`RowsRead` counts each partition's ids in one pass over the ids (`_count_into`): the counts
    equal numpy's bincount of all the ids, partition after partition, whether the ids are many
    (a Zipf stream over few rows) or few over many rows; an id outside the group stops the count
    and names its position instead of writing past the counts."""
    from flowrec.data.profile import _count_into

    rng = np.random.default_rng()
    for rows, n in ((1_000, 200_000), (5_000_000, 3_000)):
        counts = np.zeros(rows, np.uint32)
        parts = [(rng.zipf(1.3, n) % rows).astype(np.int64) for _ in range(3)]
        for ids in parts:
            assert _count_into(counts, ids, 0) == -1
        assert np.array_equal(counts, np.bincount(np.concatenate(parts), minlength=rows))
    counts = np.zeros(10, np.uint32)
    assert _count_into(counts, np.array([3, 9, 10, 2], np.int64), 0) == 2
    assert _count_into(counts, np.array([1, -1], np.int64), 0) == 1
    assert _count_into(counts, np.array([0, 1, 4], np.int32), 6) == 2  # a table's ids at its offset: row 10 is out
    assert counts.tolist() == [0, 1, 0, 1, 0, 0, 1, 1, 0, 1]


def test_reads_of_lists_and_sequences_are_counted_as_packed():
    """A group with a list field and a sequence (pooled by "none": its first max_len ids only) is
    counted from its packed ids, a group of one-hot fields column by column: both as a bincount of
    the whole data's packed ids, table by table (fresh skewed data, several partitions, each column
    in two chunks as a Parquet file's row groups read)."""
    doc = {
        "name": "lists",
        "tables": [{"name": "items", "hash_buckets": 3_000, "dim": 8}],
        "features": [
            {"name": "item", "type": "categorical", "table": "items"},
            {"name": "history", "type": "sequence", "table": "items", "max_len": 5, "pooling": "none"},
            {"name": "tags", "type": "sequence", "hash_buckets": 700, "dim": 8, "max_len": 9, "pooling": "sum"},
            {"name": "user", "type": "categorical", "hash_buckets": 20_000, "dim": 4},
            {"name": "city", "type": "categorical", "hash_buckets": 60, "dim": 4}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    }
    spec = spec_from_dict(doc)
    groups = group_layout(spec)
    seed = int(np.random.default_rng().integers(1 << 30))
    table = synth_table(spec, 6_000, SynthConfig(seed=seed))
    import pyarrow as pa

    parts = [pa.concat_tables([p.slice(0, 700), p.slice(700)]) for p in split_table(table, 3)]  # columns of 2 chunks
    assert all(p.column("user").num_chunks == 2 for p in parts)
    prof = profile_access(spec, MemorySource(parts), sample_rate=0.2, seed=seed, planner_only=True)
    assert sorted(len(g.fields) for g in groups) == [2, 3]  # a group with lists and a one-hot group
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    for group in groups:
        reads = np.bincount(pack_group(group, cols, table.num_rows)[0], minlength=group.rows)
        for slot in group.tables:
            mine = reads[slot.row_offset:slot.row_offset + slot.rows]
            entry = prof["tables"][slot.table]
            assert entry["dataset_distinct"] == int((mine > 0).sum()) > 0
            assert sum(c * r for c, r in entry["dataset_counts"]) == pytest.approx(float(mine.sum()), rel=1e-9)
            exact = {int(c): r for c, r in entry["dataset_counts"] if c <= 16}
            assert all(exact.get(c, 0) == int((mine == c).sum()) for c in range(1, 17))
