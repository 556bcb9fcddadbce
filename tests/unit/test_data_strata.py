"""Stratified chunk layout: every row once, each batch drawn from every stratum, a rank's share."""
from __future__ import annotations

import numpy as np
import pytest

from flowrec.data.batches import rank_slice
from flowrec.data.strata import chunk_layout, needed_range, stratum_rows, widths


@pytest.mark.parametrize("rows,batch,strata", [(1000, 64, 8), (999, 37, 64), (10, 4, 3), (130, 64, 64)])
def test_every_row_of_the_chunk_is_in_exactly_one_batch(rows, batch, strata):
    layout = chunk_layout(rows, batch, strata, np.random.default_rng(5))
    assert [len(b) for b in layout] == [min(batch, rows - k) for k in range(0, rows, batch)]
    assert sorted(np.concatenate(layout).tolist()) == list(range(rows))


def test_each_batch_takes_its_share_of_every_stratum():
    rows, batch, strata = 1000, 64, 8
    bounds = np.concatenate([[0], np.cumsum(stratum_rows(rows, batch, strata))])
    layout = chunk_layout(rows, batch, strata, np.random.default_rng(2))
    for k, b in enumerate(layout):
        share = widths(len(b), strata)
        per_stratum = np.searchsorted(bounds, b, side="right") - 1
        assert np.bincount(per_stratum, minlength=strata).tolist() == share.tolist()
        # the batch lists stratum 0's rows first, then stratum 1's, ...
        assert np.all(np.diff(per_stratum) >= 0)


def test_the_layout_is_shuffled_and_reproducible():
    a = chunk_layout(512, 64, 8, np.random.default_rng(1))
    b = chunk_layout(512, 64, 8, np.random.default_rng(1))
    c = chunk_layout(512, 64, 8, np.random.default_rng(2))
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))
    assert not np.array_equal(np.sort(a[0]), np.arange(64))  # not the first 64 rows in order


@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_a_rank_needs_exactly_its_strata_when_the_world_divides_them(world):
    rows, batch, strata = 4096, 256, 64
    layout = chunk_layout(rows, batch, strata, np.random.default_rng(3))
    for rank in range(world):
        slices = [rank_slice(len(b), world, rank) for b in layout]
        lo, hi = needed_range(layout, slices)
        assert (lo, hi) == (rank * rows // world, (rank + 1) * rows // world)


def test_a_rank_needs_about_its_share_for_uneven_sizes():
    rows, batch, strata, world = 131072, 1000, 64, 3
    layout = chunk_layout(rows, batch, strata, np.random.default_rng(4))
    spans = [needed_range(layout, [rank_slice(len(b), world, r) for b in layout]) for r in range(world)]
    assert all((hi - lo) / rows < 1 / world + 2 / strata for lo, hi in spans)
    assert spans[0][0] == 0 and spans[-1][1] == rows


def test_needed_range_of_a_rank_without_rows_is_empty():
    layout = chunk_layout(2, 2, 4, np.random.default_rng(0))
    assert needed_range(layout, [(0, 0)]) == (0, 0)


def _layout_by_strata(rows: int, batch: int, strata: int, rng: np.random.Generator) -> list[np.ndarray]:
    """The layout as first written (one permutation per stratum, sliced and concatenated per
    batch): the reference `chunk_layout` must equal draw for draw."""
    full, last = divmod(rows, batch)
    per_batch, per_last = widths(batch, strata), widths(last, strata)
    sizes = full * per_batch + per_last
    starts = np.concatenate([[0], np.cumsum(sizes)])
    perms = [starts[s] + rng.permutation(int(sizes[s])) for s in range(strata)]
    out = []
    if full:
        out.extend(np.concatenate([p[:full * per_batch[s]].reshape(full, per_batch[s]) for s, p in enumerate(perms)],
                                  axis=1))
    if last:
        out.append(np.concatenate([p[full * per_batch[s]:] for s, p in enumerate(perms)]))
    return out


def test_the_layout_equals_the_per_stratum_reference():
    """Random chunk shapes (batches full or not, fewer rows than strata, one-row strata): the
    same batches, the same dtype, and the generator left in the same state."""
    shapes = np.random.default_rng(7)
    for _ in range(400):
        rows, batch, strata = (int(v) for v in (shapes.integers(1, 3000), shapes.integers(1, 400), shapes.integers(1, 80)))
        a, b = np.random.default_rng([rows, batch]), np.random.default_rng([rows, batch])
        got, want = chunk_layout(rows, batch, strata, a), _layout_by_strata(rows, batch, strata, b)
        assert len(got) == len(want), (rows, batch, strata)
        assert all(x.dtype == y.dtype == np.int64 and np.array_equal(x, y) for x, y in zip(got, want)), (rows, batch, strata)
        assert a.integers(1 << 62) == b.integers(1 << 62)
    assert [len(b) for b in chunk_layout(131072, 4096, 64, np.random.default_rng(0))] == [4096] * 32
