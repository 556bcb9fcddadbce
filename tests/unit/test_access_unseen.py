"""A sample's view of row accesses, corrected for what it missed (`flowrec.data.profile.good_turing`,
`flowrec.planner.access`): the rows a sample counted take less of the whole data's accesses than
the sample says, and a static hot set holds only rows FAE's profiling sample counted. Checked
against the whole dataset, on fresh skewed synthetic data each run."""
from __future__ import annotations

import numpy as np
import pytest

from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.packed_ids import column_arrays, pack_group
from flowrec.data.profile import good_turing, hit_cdf, hot_cdf, profile_access, sample_rows, unseen_rows
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.graph.packing import group_layout
from flowrec.planner import access
from flowrec.planner.access import cdf_model, group_model
from flowrec.runtime.caches.static_hot import hottest_rows
from flowrec.spec import spec_from_dict

DOC = {
    "name": "unseen",
    "features": [{"name": f"c{i}", "type": "categorical", "hash_buckets": v, "dim": 8}
                 for i, v in enumerate([200, 5_000, 60_000, 400_000])],
    "modules": [{"name": "top", "kind": "mlp", "inputs": ["@sparse"], "layers": [8]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
}
ROWS = 120_000  # 60,000 rows: the 5 % sample's corrected shares missed by over 0.05 about once in 40,000 runs
# (an exponential fit to the worst misses of 1,100 seeds); 120,000: about once in 2.5 million (400 seeds)


def _data(seed: int, rows: int = ROWS):
    spec = spec_from_dict(DOC)
    (group,) = group_layout(spec)
    table = synth_table(spec, rows, SynthConfig(seed=seed))
    return spec, group, table, MemorySource(split_table(table, 3))


def _counts(spec, group, table) -> np.ndarray:
    ids, _ = pack_group(group, {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features},
                        table.num_rows)
    return np.bincount(ids, minlength=group.rows)


def _table_counts(spec, group, table, name: str) -> np.ndarray:
    """One member table's counts (its slot of the packed rows)."""
    slot = next(s for s in group.tables if s.table == name)
    return _counts(spec, group, table)[slot.row_offset:slot.row_offset + slot.rows]


# how far the corrected shares may miss the whole data's, by sample rate: over 2,000 seeds of 60,000
# rows the worst miss was 0.041 at a 5 % sample (22 seeds over 0.03, the tolerance before) and 0.015
# at 30 %; of 120,000 rows, 0.027 and 0.011 over 400 seeds, the sample's own shares missing by at
# least 0.31 and 0.156
TOLERANCE = {0.05: 0.05, 0.3: 0.025}


@pytest.mark.parametrize("rate", sorted(TOLERANCE))
def test_corrected_shares_match_the_whole_data_where_the_samples_own_do_not(rate):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed)
    name = "c3"  # the widest table: most of its rows go unseen by a small sample
    full = _table_counts(spec, group, table, name)
    part = _table_counts(spec, group, sample_rows(spec, source, rate, seed), name)
    seen = part > 0
    order = np.argsort(-part, kind="stable")  # the sample's ranking, as hot_cdf's
    reads, total = np.cumsum(full[order[:int(seen.sum())]]), full.sum()  # exact integers, summed once, not per k
    truth = {k: float(reads[k - 1] / total) for k in range(1, int(seen.sum()) + 1)}

    missed = 1.0 - full[seen].sum() / full.sum()
    assert missed > 0.05  # the case this is about: the sample misses a real share
    tolerance = TOLERANCE[rate]
    _, unseen = good_turing(part[seen], rate)
    assert abs(unseen - missed) <= tolerance, (seed, unseen, missed)
    raw = dict((int(k), s) for k, s in hot_cdf(part[seen]))
    corrected = dict((int(k), s) for k, s in hit_cdf(part[seen], rate))
    assert raw.keys() == corrected.keys()
    assert raw[int(seen.sum())] == pytest.approx(1.0)  # the sample's own shares: everything seen
    assert abs(raw[int(seen.sum())] - truth[int(seen.sum())]) > 4 * tolerance  # far off, where the corrected are not
    for k, share in corrected.items():
        assert abs(share - truth[k]) <= tolerance, (seed, k, share, truth[k])


def test_a_sample_of_every_row_misses_nothing():
    counts = np.random.default_rng().zipf(1.3, 5_000) % 997 + 1
    shares, unseen = good_turing(counts, 1.0)
    assert unseen == 0.0
    np.testing.assert_allclose(shares, counts / counts.sum())
    np.testing.assert_allclose(np.array(hit_cdf(counts, 1.0)), np.array(hot_cdf(counts)))
    assert unseen_rows(counts, 10 * len(counts), 1.0) == {"share": 0.0, "rows": 0.0}


def test_unseen_rows_are_bounded_by_the_table():
    counts = np.ones(500, np.int64)  # every row counted once: Chao1 without doubletons is large
    assert unseen_rows(counts, 800, 0.1)["rows"] == 300.0
    assert unseen_rows(counts, 500, 0.1) == {"share": 0.0, "rows": 0.0}  # nothing left unseen
    assert hit_cdf(counts, 0.1, 500)[-1][1] == pytest.approx(1.0)  # so the counted rows take it all
    assert hit_cdf(counts, 0.1, 800)[-1][1] == pytest.approx(1.0 - unseen_rows(counts, 800, 0.1)["share"])


def test_the_model_spreads_the_unseen_share_over_the_unseen_rows_only():
    model = cdf_model(1_000, [[1, 0.4], [10, 0.7]], {"share": 0.3, "rows": 90.0}, findable=10.0)
    assert sum(r * p for r, p in model.segments) == pytest.approx(1.0)
    assert model.rows == pytest.approx(1_000)
    assert model.hit_rate(10) == pytest.approx(0.7)
    assert model.hit_rate(100) == pytest.approx(1.0)
    assert model.hit_rate(model.hot_rows(100)) == pytest.approx(0.7)  # the hot set holds what it saw
    assert model.distinct(1e9) == pytest.approx(100.0)  # 900 rows are never read
    old = cdf_model(1_000, [[1, 0.4], [10, 1.0]])  # a profile from before hit_cdf
    assert old.findable is None and old.hot_rows(100) == 100.0 and old.hit_rate(10) == pytest.approx(1.0)


def test_the_planned_hit_rate_of_a_hot_set_matches_the_whole_data(monkeypatch):
    """The plan's static_hot hit rate against the one FAE's sample gives on the whole data, with
    FAE's sample (5 %) larger than the planner's (4 %), as on a dataset of 500,000 rows."""
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed, 200_000)  # the planner samples 8,000 rows (a run: 20,000)
    plan_rate, fae_rate = 0.04, 0.05
    monkeypatch.setattr(access, "hot_sample_rate", lambda total: fae_rate)
    profile = profile_access(spec, source, sample_rate=plan_rate, seed=seed)
    model, origin = group_model(((t.table, t.rows, 1.0) for t in group.tables), profile)
    assert origin == "profile"

    full = _counts(spec, group, table)
    fae = _counts(spec, group, sample_rows(spec, source, fae_rate, seed))
    planner = _counts(spec, group, sample_rows(spec, source, plan_rate, seed))
    assert ((planner > 0) <= (fae > 0)).all()  # the same seed: the planner's sample is part of FAE's
    found = int((fae > 0).sum())
    assert found > 1.1 * (planner > 0).sum()  # FAE's sample meets rows the planner's did not
    assert abs(model.findable - found) <= 0.05 * found
    for cache_rows in (found // 20, found // 3, group.rows):
        hot = hottest_rows(fae, cache_rows).numpy()
        measured = float(full[hot].sum() / full.sum())
        predicted = model.hit_rate(model.hot_rows(cache_rows))
        assert abs(predicted - measured) <= 0.03, (cache_rows, predicted, measured)
    assert model.hit_rate(group.rows) == pytest.approx(1.0)  # every row cached: nothing misses
    assert model.hit_rate(model.hot_rows(group.rows)) < 0.97  # but FAE's hot set holds what it counted


def test_a_run_plans_from_the_very_rows_fae_counts(monkeypatch, tmp_path):
    """`flowrec train --data` profiles FAE's own sample (rate and seed): the planner's counted rows
    are the rows a static hot set is chosen from, so nothing is extrapolated, and the planned hit
    rate matches the whole data's at every cache size. FAE's floor of 20,000 rows is lowered to
    1,000 so that a 200,000-row dataset is sampled at FAE's 5 % (a run's floor is the planner's too)."""
    from flowrec.graph import kinds
    from flowrec.runs.plan import sampled_access_profile
    from flowrec.runtime import session

    seed = int(np.random.default_rng().integers(1 << 30))
    spec = spec_from_dict({**DOC, "training": {"seed": seed}})
    (group,) = group_layout(spec)
    rows = 200_000
    table = synth_table(spec, rows, SynthConfig(seed=seed))
    monkeypatch.setattr(kinds, "HOT_SAMPLE_ROWS", 1_000)
    monkeypatch.setattr(session, "open_dataset", lambda path, spec: MemorySource(split_table(table, 3)))
    lines: list[str] = []
    profile = sampled_access_profile(spec, str(tmp_path), lines.append)
    rate = kinds.hot_sample_rate(rows)
    assert rate == kinds.FAE_SAMPLE_RATE and profile["sample_rate"] == rate
    fae_table = sample_rows(spec, MemorySource(split_table(table, 3)), rate, seed)  # as assign_hot_rows draws it
    assert profile["samples"] == fae_table.num_rows and profile["dataset_rows"] == rows
    assert lines == [f"access profile: sampled {fae_table.num_rows:,} of {rows:,} rows of {tmp_path} (seed {seed}) "
                     "to predict cache traffic"]
    fae = _counts(spec, group, fae_table)
    found = int((fae > 0).sum())
    assert sum(profile["tables"][t.table]["distinct"] for t in group.tables) == found
    model, _ = group_model(((t.table, t.rows, 1.0) for t in group.tables), profile)
    assert model.findable == pytest.approx(found)  # the same rows: no extrapolation
    full = _counts(spec, group, table)
    for cache_rows in (found // 30, found // 4, found, group.rows):
        hot = hottest_rows(fae, cache_rows).numpy()
        measured = float(full[hot].sum() / full.sum())
        # every counted row cached: the share of the sample's rows, which the unseen rows' average
        # (hotter than the sample's once-counted rows) must not enter; the top rows: noisier ranks
        tolerance = 0.008 if cache_rows >= found else 0.02
        assert abs(model.hot_set_hit_rate(cache_rows) - measured) <= tolerance, (cache_rows, measured)


def test_a_hot_set_fills_with_counted_rows_before_hotter_unseen_ones():
    """The unseen rows of a table are, on average, hotter than rows its sample counted once; a
    static hot set still holds only counted rows (then those FAE's larger sample finds), in a
    table's model and in a group's merged one, and its cold traffic is the rest."""
    from flowrec.planner.fae_traffic import split_segments

    # 100 counted rows: 10 take 0.5, 90 take 0.2 (0.0022 each); unseen: 0.3 over 50 rows (0.006 each)
    wide = cdf_model(1_000, [[10, 0.5], [100, 0.7]], {"share": 0.3, "rows": 50}, findable=120)
    assert wide.hit_rate(60) == pytest.approx(0.5 + 0.3)  # the true hottest 60: 10 counted, 50 unseen
    assert wide.hot_set_hit_rate(60) == pytest.approx(0.5 + 50 * 0.2 / 90)  # FAE's: 60 counted rows
    assert wide.hot_set_hit_rate(100) == pytest.approx(0.7)
    assert wide.hot_set_hit_rate(110) == pytest.approx(0.7 + 10 * 0.3 / 50)  # then 20 found unseen ones
    assert wide.hot_set_hit_rate(1_000) == pytest.approx(0.7 + 20 * 0.3 / 50)
    hot, cold = split_segments(wide, wide.hot_rows(60))
    assert sum(r for r, _ in hot) == pytest.approx(60) and sum(r * p for r, p in hot) == pytest.approx(0.5 + 50 * 0.2 / 90)
    assert sum(r * p for r, p in hot) + sum(r * p for r, p in cold) == pytest.approx(1.0)

    small = cdf_model(20, [[20, 1.0]], findable=20)  # every row counted
    merged = access.merge([(wide, 3.0), (small, 1.0)])  # wide takes 3/4 of the group's lookups
    assert merged.findable == pytest.approx(140)
    assert merged.hit_rate(1_020) == pytest.approx(1.0)
    assert merged.hot_set_hit_rate(120) == pytest.approx(0.25 + 0.75 * 0.7)  # counted rows of both
    assert merged.hot_set_hit_rate(1_020) == pytest.approx(0.25 + 0.75 * (0.7 + 20 * 0.3 / 50))


def test_findable_rows_take_the_datasets_rows_not_an_estimate_from_the_sample():
    """A profile at FAE's own rate finds nothing more; before profiles recorded their dataset's rows,
    samples / rate (a Bernoulli estimate) could put FAE's rate above the sample's and extrapolate."""
    entry = {"distinct": 14_000, "accesses": 80_000, "unseen": {"share": 0.2, "rows": 30_000}}
    rate = access.hot_sample_rate(120_000)  # 20,000 of 120,000 rows
    short = {"sample_rate": rate, "samples": 19_800}  # 118,800 rows by the estimate: FAE's rate above r
    assert access.dataset_rows(short) == 118_800
    assert access.findable_rows(entry, short) > 14_100
    assert access.findable_rows(entry, {**short, "dataset_rows": 120_000}) == 14_000
    assert access.dataset_rows({**short, "dataset_rows": 120_000}) == 120_000
    assert access.dataset_rows({}) is None and access.dataset_rows({"samples": 5}) is None
