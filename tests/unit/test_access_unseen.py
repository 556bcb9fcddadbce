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
ROWS = 60_000


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


@pytest.mark.parametrize("rate", [0.05, 0.3])
def test_corrected_shares_match_the_whole_data_where_the_samples_own_do_not(rate):
    seed = int(np.random.default_rng().integers(1 << 30))
    spec, group, table, source = _data(seed)
    name = "c3"  # the widest table: most of its rows go unseen by a small sample
    full = _table_counts(spec, group, table, name)
    part = _table_counts(spec, group, sample_rows(spec, source, rate, seed), name)
    seen = part > 0
    order = np.argsort(-part, kind="stable")  # the sample's ranking, as hot_cdf's
    truth = {k: float(full[order[:k]].sum() / full.sum()) for k in range(1, int(seen.sum()) + 1)}

    missed = 1.0 - full[seen].sum() / full.sum()
    assert missed > 0.05  # the case this is about: the sample misses a real share
    _, unseen = good_turing(part[seen], rate)
    assert abs(unseen - missed) <= 0.03
    raw = dict((int(k), s) for k, s in hot_cdf(part[seen]))
    corrected = dict((int(k), s) for k, s in hit_cdf(part[seen], rate))
    assert raw.keys() == corrected.keys()
    assert raw[int(seen.sum())] == pytest.approx(1.0)  # the sample's own shares: everything seen
    assert abs(raw[int(seen.sum())] - truth[int(seen.sum())]) > 0.05
    for k, share in corrected.items():
        assert abs(share - truth[k]) <= 0.03, (k, share, truth[k])


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
