"""Virtual shards of a managed map (`managed.shards`): S independent maps equal S dict references
on fresh random Zipf-skewed streams; the shard of an id is a stable function of it alone."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from flowrec.data.managed import NO_ROW, ManagedMap, ShardedMap, new_map, shard_of, shard_rows
from flowrec.data.raw_ids import MISSING_ID
from flowrec.testing.managed_ref import ShardedDictMap, dict_shard
from test_managed_map import SPECS, zipf_stream


def test_shard_of_equals_python_ints_and_spreads():
    rng = np.random.default_rng()
    ids = rng.integers(-(1 << 63), (1 << 63) - 1, 2000)
    for shards in (2, 3, 7):
        got = shard_of(ids, shards)
        assert got.tolist() == [dict_shard(int(k), shards) for k in ids]
        counts = np.bincount(got, minlength=shards)
        assert counts.min() > len(ids) / shards / 2  # every shard takes a share
    consecutive = shard_of(np.arange(1, 401), 4)  # neighbouring raw ids do not land in one shard
    assert len(np.unique(consecutive)) == 4
    assert shard_of(ids, 1).tolist() == [0] * len(ids)


def test_shard_rows_cover_the_table():
    for rows in (1, 5, 12, 13):
        for shards in range(1, rows + 1):
            assert sum(shard_rows(rows, shards, s) for s in range(shards)) == rows
            assert all(shard_rows(rows, shards, s) == len(range(s, rows, shards)) for s in range(shards))


@pytest.mark.parametrize("shards", [2, 3, 4])
@pytest.mark.parametrize("buffer_ids", [1 << 16, 5])
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.evict}-admit{s.admit_min_count}-ttl{s.ttl_steps}")
def test_sharded_map_equals_sharded_dict_reference(spec, buffer_ids, shards):
    spec = replace(spec, rows=spec.rows + 1, shards=shards)  # rows not a multiple of every S
    rng = np.random.default_rng()
    fast, ref = new_map(spec, buffer_ids), ShardedDictMap(spec)
    assert isinstance(fast, ShardedMap)
    evicted = defaults = 0
    for ids in zipf_stream(rng, steps=60, batch=50, distinct=400):
        got = fast.step(ids)
        rows, resets = ref.step(ids.tolist())
        assert got.rows.tolist() == rows
        assert got.resets.tolist() == resets
        held = got.rows != NO_ROW
        assert ((got.rows[held] % shards) == shard_of(ids[held], shards)).all()  # a shard's rows only
        for row in np.unique(got.rows[held]):  # a row holds one id at a time: no collisions
            assert len(np.unique(ids[held][got.rows[held] == row])) == 1
        evicted += len(resets)
        defaults += int((~held).sum() - (ids == MISSING_ID).sum())
    assert evicted > 0 and defaults > 0
    e = fast.entries()
    assert dict(zip(e.keys[e.row != NO_ROW].tolist(), e.row[e.row != NO_ROW].tolist())) == ref.held()
    assert fast.lookup(e.keys).tolist() == e.row.tolist()
    assert fast.occupied == len(ref.held())
    report = fast.report()
    assert (report["rows"], report["held"], report["shards"]) == (spec.rows, len(ref.held()), shards)
    assert {m.clock for m in fast.shards} == {60}  # every shard stepped at every batch


def test_one_shard_is_the_plain_map():
    spec = SPECS[1]
    assert type(new_map(spec)) is ManagedMap and type(new_map(replace(spec, shards=1))) is ManagedMap


def test_sharded_state_round_trip_continues_identically():
    spec = replace(SPECS[2], shards=3)
    rng = np.random.default_rng()
    stream = list(zipf_stream(rng, steps=30, batch=40, distinct=200))
    whole, half = ShardedMap(spec, buffer_ids=7), ShardedMap(spec, buffer_ids=7)
    for ids in stream[:15]:
        whole.step(ids)
        half.step(ids)
    state = half.state()
    assert sorted(state) == sorted(half.state_keys())
    kept = {k: v.copy() for k, v in state.items()}
    resumed = ShardedMap(spec, buffer_ids=7).load(state)
    copied = half.copy()
    for ids in stream[15:]:
        a, b, c = whole.step(ids), resumed.step(ids), copied.step(ids)
        assert a.rows.tolist() == b.rows.tolist() == c.rows.tolist()
        assert a.resets.tolist() == b.resets.tolist() == c.resets.tolist()
    assert all(np.array_equal(state[k], kept[k]) for k in kept)  # loading took copies: stepping left them
    bad = dict(state)
    bad["shard1.clock"] = bad["shard1.clock"] + 1
    with pytest.raises(ValueError, match="clocks"):
        ShardedMap(spec).load(bad)
    with pytest.raises(ValueError, match="shard 0 of 3"):
        ShardedMap(replace(spec, rows=spec.rows + 30)).load(state)


@pytest.mark.parametrize("world", [2, 3, 5])
def test_owned_shards_together_equal_the_whole_map(world):
    """Maps of the shards each of `world` ranks owns (s % world == rank; with 4 shards and 5 ranks
    rank 4 owns none), each stepped on its shards' ids, give the whole map's rows and resets;
    their states together load into the whole map, and any of them loads from the whole map's."""
    from flowrec.data.managed import owner_shards

    spec = replace(SPECS[3], rows=37, shards=4)
    rng = np.random.default_rng()
    whole = ShardedMap(spec, buffer_ids=9)
    parts = [ShardedMap(spec, buffer_ids=9, owned=owner_shards(4, world, w)) for w in range(world)]
    assert sorted(s for p in parts for s in p.owned) == [0, 1, 2, 3]
    for ids in zipf_stream(rng, steps=40, batch=60, distinct=300):
        valid = ids[ids != MISSING_ID]
        unique, counts = np.unique(valid, return_counts=True)
        freed, rows = whole.step_counts(unique, counts)
        owner = shard_of(unique, 4) % world
        got_rows = np.full(len(unique), -7, np.int64)
        got_freed = []
        for w, p in enumerate(parts):
            mine = owner == w
            f, r = p.step_counts(unique[mine], counts[mine])
            got_rows[mine] = r
            got_freed.append(f)
        assert got_rows.tolist() == rows.tolist()
        assert np.sort(np.concatenate(got_freed)).tolist() == freed.tolist()
    assert {p.clock for p in parts} == {whole.clock} == {40}
    merged = {k: v for p in parts for k, v in p.state().items()}
    assert sorted(merged) == sorted(whole.state_keys())
    again = ShardedMap(spec).load(merged)
    assert again.entries().keys.tolist() == whole.entries().keys.tolist()
    assert again.entries().row.tolist() == whole.entries().row.tolist()
    for w in range(world):
        part = ShardedMap(spec, owned=owner_shards(4, world, w)).load(whole.state())
        assert part.clock == 40 and part.state_keys() == parts[w].state_keys()
        assert all(np.array_equal(part.state()[k], parts[w].state()[k]) for k in part.state_keys())
    report = {k: sum(p.report()[k] for p in parts) for k in ("held", "admitted", "evicted", "expired")}
    assert report == {k: whole.report()[k] for k in report}
