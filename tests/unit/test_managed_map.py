"""The managed map equals a plain dict-based reference on fresh random Zipf-skewed id streams."""
from __future__ import annotations

import numpy as np
import pytest

from flowrec.data.managed import BUFFER_IDS, NO_ROW, Entries, ManagedMap
from flowrec.testing.managed_ref import DictMap
from flowrec.data.raw_ids import MISSING_ID
from flowrec.spec.model import ManagedSpec


def zipf_stream(rng: np.random.Generator, steps: int, batch: int, distinct: int, alpha: float = 1.2):
    """Batches of raw 64-bit ids: Zipf ranks over `distinct` values, scrambled, some missing."""
    keys = rng.integers(-(1 << 62), 1 << 62, distinct)
    for _ in range(steps):
        ranks = np.minimum(rng.zipf(alpha, batch) - 1, distinct - 1)
        ids = keys[ranks]
        ids[rng.random(batch) < 0.05] = MISSING_ID
        yield ids


SPECS = [
    ManagedSpec(rows=40, admit_min_count=1, evict="lfu", every_steps=3),
    ManagedSpec(rows=40, admit_min_count=3, evict="lru", every_steps=4, ttl_steps=6),
    ManagedSpec(rows=15, admit_min_count=2, evict="decayed_lfu", decay=0.8, every_steps=2),
    ManagedSpec(rows=60, admit_min_count=2, evict="lfu", every_steps=5, ttl_steps=3),
]


@pytest.mark.parametrize("buffer_ids", [BUFFER_IDS, 5])  # 5: the buffer of new ids merges between passes too
@pytest.mark.parametrize("spec", SPECS, ids=lambda s: f"{s.evict}-admit{s.admit_min_count}-ttl{s.ttl_steps}")
def test_map_equals_dict_reference(spec, buffer_ids):
    rng = np.random.default_rng()  # fresh ids each run: the rule must hold for any stream
    fast, ref = ManagedMap(spec, buffer_ids), DictMap(spec)
    evicted = admitted_late = 0
    for ids in zipf_stream(rng, steps=60, batch=50, distinct=400):
        got = fast.step(ids)
        rows, resets = ref.step(ids.tolist())
        assert got.rows.tolist() == rows
        assert got.resets.tolist() == resets
        evicted += len(resets)
        assigned = got.rows[got.rows != NO_ROW]
        keys = ids[got.rows != NO_ROW]
        for row in np.unique(assigned):  # a row holds one id at a time: no collisions
            assert len(np.unique(keys[assigned == row])) == 1
        admitted_late += int((got.rows == NO_ROW).sum() - (ids == MISSING_ID).sum())
    assert evicted > 0 and admitted_late > 0  # the stream exercised eviction and the default row
    state = fast.state()
    assert state["keys"].tolist() == sorted(ref.ids)
    assert state["row"].tolist() == [NO_ROW if ref.ids[k][0] is None else ref.ids[k][0] for k in sorted(ref.ids)]
    assert state["free"].tolist() == ref.free


def test_state_round_trip_continues_identically():
    spec = SPECS[2]
    rng = np.random.default_rng()
    stream = list(zipf_stream(rng, steps=30, batch=40, distinct=200))
    whole, half = ManagedMap(spec, buffer_ids=7), ManagedMap(spec, buffer_ids=7)
    for ids in stream[:15]:
        whole.step(ids)
        half.step(ids)
    resumed = ManagedMap(spec, buffer_ids=7).load(half.state())  # buffer merged into the state
    for ids in stream[15:]:
        a, b = whole.step(ids), resumed.step(ids)
        assert a.rows.tolist() == b.rows.tolist() and a.resets.tolist() == b.resets.tolist()


def test_lookup_neither_counts_nor_admits():
    m = ManagedMap(ManagedSpec(rows=4, admit_min_count=2))
    m.step(np.array([11, 11, 12]))
    before = m.state()
    assert m.lookup(np.array([11, 12, 13, MISSING_ID])).tolist() == [0, NO_ROW, NO_ROW, NO_ROW]
    after = m.state()
    assert all(np.array_equal(before[k], after[k]) for k in before)


def test_load_refuses_a_map_of_another_capacity():
    m = ManagedMap(ManagedSpec(rows=4))
    m.step(np.array([1, 2, 3]))
    with pytest.raises(ValueError, match="does not fit"):
        ManagedMap(ManagedSpec(rows=8)).load(m.state())


def test_load_takes_ids_further_apart_than_int64_differences_reach():
    """Sorted raw ids at both ends of the 64-bit range (their difference overflows int64) load;
    unsorted ones are refused."""
    m = ManagedMap(ManagedSpec(rows=2))
    far = np.array([-(1 << 63) + 5, (1 << 63) - 3, -7 * (1 << 60), 7 * (1 << 60)], np.int64)
    m.step(far)
    again = ManagedMap(ManagedSpec(rows=2)).load(m.state())
    assert again.lookup(far).tolist() == m.lookup(far).tolist() and (m.lookup(far) >= 0).sum() == 2
    state = m.state()
    state["keys"] = state["keys"][::-1].copy()
    with pytest.raises(ValueError, match="not sorted and distinct"):
        ManagedMap(ManagedSpec(rows=2)).load(state)


def test_entries_merge_equals_a_sort_of_both():
    """The buffer's merge (insertion at searched positions, no sort) equals sorting both sets."""
    rng = np.random.default_rng()
    keys = rng.choice(np.arange(-(1 << 40), 1 << 40, 7919), 900, replace=False)
    cols = (keys, rng.integers(-1, 50, 900), rng.random(900) * 9, rng.integers(0, 99, 900))
    split = rng.random(900) < 0.3
    parts = []
    for mask in (~split, split):
        order = np.argsort(cols[0][mask])
        parts.append(Entries(*(c[mask][order] for c in cols)))
    got = parts[0].merged(parts[1])
    order = np.argsort(keys)
    for mine, want in zip((got.keys, got.row, got.count, got.last), cols):
        assert mine.tolist() == want[order].tolist()
    grown = Entries(*(c.copy() for c in (parts[0].keys, parts[0].row, parts[0].count, parts[0].last)))
    grown.add(parts[1].keys, parts[1].count, 5)
    assert grown.keys.tolist() == keys[order].tolist()
    assert grown.row[np.isin(grown.keys, parts[1].keys)].tolist() == [NO_ROW] * int(split.sum())


def test_an_eviction_pass_merges_freed_rows_without_sorting_every_free_row(monkeypatch):
    """Every pass sorted the whole free list again (a concatenation of every free row and the
    freed ones): a table of 20M rows, mostly free, took 3 s a pass in the data stage and again in
    the model's replay, with every_steps 1 at every step. The freed rows now merge into it."""
    import flowrec.data.managed as managed

    spec = ManagedSpec(rows=1000, every_steps=2, ttl_steps=1)
    fast, ref = ManagedMap(spec), DictMap(spec)
    sorted_sizes: list[int] = []
    real_sort = np.sort

    def counted_sort(a, *args, **kwargs):
        sorted_sizes.append(len(a))
        return real_sort(a, *args, **kwargs)

    monkeypatch.setattr(managed.np, "sort", counted_sort)
    freed = 0
    for ids in ([5, 6, 7], [8], [], [9, 5], [], [], [], [10]):  # 5, 6, 7 expire, then 8, then 9 and 5 again
        got = fast.step(np.array(ids, np.int64))
        rows, resets = ref.step(ids)
        assert got.rows.tolist() == rows and got.resets.tolist() == resets
        freed += len(resets)
    assert freed == 6 and fast.free.tolist() == ref.free and fast.free.tolist() == sorted(set(fast.free.tolist()))
    assert max(sorted_sizes, default=0) < 100  # the freed rows, never the ~1,000 free ones
