"""The lookahead cache's victims (`NextUseFirst`) against a plain simulation of the policy on
fresh Zipf-skewed and drifting traces; the staged horizon against a recomputation; training with
a horizon against the resident table."""
from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

from flowrec.data.batches import Batch, GroupIds, StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.lookahead import LookaheadWindow, batch_extras, windowed
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.runtime.caches import LookaheadEmbedding
from flowrec.runtime.caches.counters import CacheCounters
from flowrec.runtime.caches.scratchpad import Scratchpad
from flowrec.runtime.caches.victims import Horizon, NextUseFirst
from flowrec.testing.caches import (
    CPU, assert_same, cache_spec, groups_of, head_weights, loss_of, train_cached, train_reference, window_rows,
)
from operators.embedding import PackedEmbeddingBag

SAMPLES = 24  # samples per batch of the synthetic traces
BATCHES = 30


def zipf_ids(rng: np.random.Generator, rows: int) -> list[np.ndarray]:
    """Per batch, SAMPLES ids of a Zipf(1.3) law over rows 1..rows-1 at random places."""
    perm = rng.permutation(rows - 1) + 1
    return [perm[np.minimum(rng.zipf(1.3, SAMPLES) - 1, rows - 2)] for _ in range(BATCHES)]


def drifting_ids(rng: np.random.Generator, rows: int) -> list[np.ndarray]:
    """Like `zipf_ids`, but each id comes from a second popularity order with a share rising 0 -> 1."""
    old, new = rng.permutation(rows - 1) + 1, rng.permutation(rows - 1) + 1
    out = []
    for b in range(BATCHES):
        ranks = np.minimum(rng.zipf(1.3, SAMPLES) - 1, rows - 2)
        out.append(np.where(rng.random(SAMPLES) < b / (BATCHES - 1), new[ranks], old[ranks]))
    return out


TRACES = {"zipf": zipf_ids, "drifting": drifting_ids}


def stage(group, id_batches: list[np.ndarray], window: int, horizon: int) -> list[Batch]:
    """Batches of one id per sample through the data stage's lookahead window with a horizon."""
    win = LookaheadWindow(window, horizon)
    out = []
    for i, ids in enumerate(id_batches):
        ids_t = torch.from_numpy(ids.astype(np.int64))
        offsets = torch.arange(len(ids) + 1)
        gids = GroupIds(ids_t, offsets, *batch_extras(group, ids_t, offsets, True))
        batch = Batch(torch.zeros(len(ids), 0), torch.zeros(len(ids), 1), {group.name: gids}, 0, i, len(ids))
        out += list(win.push(batch))
    return out + list(win.flush())


def reference_exchanges(id_batches: list[np.ndarray], capacity: int, window: int,
                        horizon: int) -> list[tuple[int, list[int], list[int]]]:
    """Plain simulation of the policy: (stamp, rows fetched, rows evicted in order) per exchange.

    Per batch b (stamp b + 1): the batch's own rows first when any is missing, then its window's;
    victims are resident rows outside the window, ranked: not used in the horizon first, then
    furthest next use, fewest uses since fetched, least recent use, lowest row. Then the batch's
    rows are used.
    """
    rows = [set(map(int, ids)) for ids in id_batches]
    resident: dict[int, list[int]] = {}  # row -> [uses, last use]
    log = []
    for b in range(len(rows)):
        stamp, pinned = b + 1, set().union(*rows[b:b + window])
        nxt: dict[int, int] = {}
        for t in range(b + window, min(len(rows), b + window + horizon)):
            for r in rows[t]:
                nxt.setdefault(r, t - b)

        def rank(r: int) -> tuple:
            return (r in nxt, -nxt.get(r, 0), resident[r][0], resident[r][1], r)

        for needed in ([rows[b]] if rows[b] - resident.keys() else []) + [pinned]:
            missing = sorted(needed - resident.keys())
            if not missing:
                continue
            over = len(resident) + len(missing) - capacity
            gone = sorted((r for r in resident if r not in pinned), key=rank)[:max(over, 0)]
            for r in gone:
                del resident[r]
            resident.update({r: [0, stamp] for r in missing})
            log.append((stamp, missing, gone))
        for r in rows[b]:
            resident[r] = [resident[r][0] + 1, stamp]
    return log


@pytest.mark.parametrize("trace", sorted(TRACES))
@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("window,horizon,slack,interleave", [(1, 0, 4, False), (2, 3, 0, True),
                                                             (3, 6, 9, False), (4, 12, 2, True)])
def test_exchanges_equal_the_plain_simulation(trace, seed, window, horizon, slack, interleave):
    group = groups_of(cache_spec(), "fp64")[0]
    rng = np.random.default_rng([seed, window, len(trace)])
    id_batches = TRACES[trace](rng, group.rows)
    batches = stage(group, id_batches, window, horizon)
    capacity = window_rows(batches, group.name) + slack
    module = LookaheadEmbedding(replace(group, cache_rows=capacity), seed=3, device=CPU,
                                interleave=interleave, record=True)
    w = head_weights(group)
    for batch in batches:
        loss_of(module.forward_group(batch.groups[group.name]), w).backward()
    module.close()
    got = [(e.stamp, sorted(e.fetched), list(e.evicted)) for e in module.pad.log]
    expected = reference_exchanges(id_batches, capacity, window, horizon)
    assert got == expected
    assert sum(len(e[2]) for e in expected) > 0  # the traces do evict
    assert module.counters.snapshot()["hit_rate"] == 1.0


@pytest.mark.parametrize("window,horizon", [(1, 2), (3, 4), (2, 40)])
def test_horizon_is_each_rows_first_use_after_the_window(window, horizon):
    group = groups_of(cache_spec(), "fp64")[0]
    id_batches = zipf_ids(np.random.default_rng(window * 7 + horizon), group.rows)
    batches = stage(group, id_batches, window, horizon)
    assert len(batches) == len(id_batches)
    for b, batch in enumerate(batches):
        first: dict[int, int] = {}
        for t in range(b + window, min(len(id_batches), b + window + horizon)):
            for r in id_batches[t].tolist():
                first.setdefault(r, t - b)
        g = batch.groups[group.name]
        assert g.horizon_rows.tolist() == sorted(first)
        assert g.horizon_next.tolist() == [first[r] for r in sorted(first)]
        assert g.window_unique.tolist() == sorted(set(np.concatenate(id_batches[b:b + window]).tolist()))


def test_windows_of_batches_formed_after_staging_follow_their_order():
    """FAE's hot/cold batches come in another order than the staged one: `windowed` takes a
    lookahead group's window and horizon of the batches as they come, and leaves other groups as
    they are (a static_hot group's window is the batch itself)."""
    spec = cache_spec()
    groups = groups_of(spec, "fp64")
    look, other = groups[0].name, groups[1].name
    rng = np.random.default_rng()
    staged_batches = stage_all(spec, rows=480)
    order = rng.permutation(len(staged_batches)).tolist()
    formed = [replace(staged_batches[i], index=k) for k, i in enumerate(order)]
    window, horizon = 3, 4
    out = list(windowed(iter(formed), window, horizon, [look]))
    assert [b.index for b in out] == list(range(len(formed)))
    rows = [b.groups[look].unique.tolist() for b in formed]
    for b, batch in enumerate(out):
        g = batch.groups[look]
        assert g.window_unique.tolist() == sorted(set().union(*rows[b:b + window]))
        first: dict[int, int] = {}
        for t in range(b + window, min(len(rows), b + window + horizon)):
            for r in rows[t]:
                first.setdefault(r, t - b)
        assert g.horizon_rows.tolist() == sorted(first)
        assert g.horizon_next.tolist() == [first[r] for r in sorted(first)]
        assert batch.groups[other] is formed[b].groups[other]  # untouched
    assert any(len(set().union(*rows[b:b + window])) > len(rows[b]) for b in range(len(rows)))


def stage_all(spec, rows: int) -> list[Batch]:
    """Staged batches of a seeded synthetic table, every group's unique rows attached (window 1)."""
    table = synth_table(spec, rows, SynthConfig(seed=5, alpha=1.2))
    opts = StagingOptions(batch_size=spec.training.batch_size, workers=1, lookahead=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts) as it:
        return list(it)


def test_victims_in_the_policys_order():
    group = groups_of(cache_spec(), "fp64")[0]
    pad = Scratchpad(PackedEmbeddingBag(group, seed=1), 4, CPU, CacheCounters(), record=True,
                     victims=NextUseFirst())
    rows = torch.tensor([1, 2, 3, 4])
    pad.exchange(rows, rows, 1)
    pad.touch(rows, 1)
    pad.touch(torch.tensor([1]), 2)  # row 1: two uses; rows 2, 3, 4: one
    soon = Horizon(torch.tensor([2, 3]), torch.tensor([5, 7]))
    pad.exchange(torch.tensor([9]), torch.tensor([9]), 3, soon)
    pad.exchange(torch.tensor([10, 11]), torch.tensor([10, 11]), 4, soon)
    pad.exchange(torch.tensor([12, 13, 14]), torch.tensor([12, 13, 14]), 5, soon)
    assert [e.evicted for e in pad.log[1:]] == [
        (4,),  # not in the horizon, fewer uses than row 1
        (9, 1),  # not in the horizon: no uses yet (9) before two uses (1); 2 and 3 are needed later
        (10, 11, 3),  # then the row used furthest in the horizon: 3 (at 7) before 2 (at 5)
    ]


@pytest.mark.parametrize("interleave", [False, True])
def test_training_with_a_horizon_equals_the_resident_table(interleave):
    spec = cache_spec("rowwise_adagrad")
    table = synth_table(spec, 960, SynthConfig(seed=21, alpha=1.2))
    opts = StagingOptions(batch_size=spec.training.batch_size, shuffle_buffer=128, workers=1,
                          lookahead=3, horizon=5)
    with iterate_batches(spec, MemorySource(split_table(table, 3)), opts) as it:
        batches = list(it)
    for group in groups_of(spec, "fp64"):
        module = LookaheadEmbedding(replace(group, cache_rows=window_rows(batches, group.name)), seed=3,
                                    device=CPU, interleave=interleave, record=True)
        assert_same(train_cached(module, group, batches), train_reference(group, batches), "fp64")
        module.close()
        assert module.counters.snapshot()["hit_rate"] == 1.0
        assert sum(len(e.evicted) for e in module.pad.log) > 0
