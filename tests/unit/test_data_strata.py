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
