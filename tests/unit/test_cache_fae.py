"""FAE: hot remap bijection, hot/cold batches cover the epoch once, host and device agree at switches,
training over the hot/cold order equals device training over the same order."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrec.runtime.caches import StaticHotEmbedding, hottest_rows
from flowrec.runtime.caches.fae_batches import HotColdBatcher, hot_samples, select_samples
from flowrec.testing.caches import CPU, assert_same, cache_spec, groups_of, head_weights, loss_of, staged, train_reference


def hot_modules(spec, batches, share: float, dtype: str = "fp64"):
    out = {}
    for group in groups_of(spec, dtype):
        ids = torch.cat([b.groups[group.name].ids for b in batches])
        cap = int(group.rows * share)
        module = StaticHotEmbedding(replace(group, cache_rows=cap), seed=3, device=CPU)
        module.set_hot_rows(hottest_rows(torch.bincount(ids, minlength=group.rows), cap))
        out[group.name] = module
    return out


def sample_keys(batch):
    """A per-sample fingerprint: dense values and labels (distinct synthetic rows)."""
    return [tuple(r) for r in torch.cat([batch.dense, batch.labels], 1).tolist()]


def test_hot_remap_is_a_bijection_onto_the_slots():
    spec = cache_spec()
    batches = staged(spec, window=1)
    for module in hot_modules(spec, batches, 0.2).values():
        slots = module.hot_slot[module.hot_rows]
        assert sorted(slots.tolist()) == list(range(module.hot.weight.shape[0]))
        assert int(module.is_hot().sum()) == module.hot_rows.numel() == module.group.cache_rows
        assert torch.equal(module.hot.weight, module.master.weight[module.hot_rows])


@pytest.mark.parametrize("hot_run,cold_run", [(4, 1), (1, 1), (2, 3)])
def test_hot_and_cold_batches_cover_the_epoch_once(hot_run, cold_run):
    spec = cache_spec()
    batches = staged(spec, window=1)
    modules = hot_modules(spec, batches, 0.3)
    hot = {n: m.is_hot() for n, m in modules.items()}
    groups = [m.group for m in modules.values()]
    batcher = HotColdBatcher(batches, hot, groups, 32, hot_run, cold_run)
    out = list(batcher)
    bags = {g.name: g.bags_per_sample for g in groups}
    kinds = [bool(hot_samples(b, hot, bags).all()) for b in out]
    assert all(bool(hot_samples(b, hot, bags).any()) == k for b, k in zip(out, kinds))  # pure batches
    assert sum(kinds) == batcher.emitted["hot"] > 0 and len(kinds) - sum(kinds) == batcher.emitted["cold"] > 0
    assert sorted(sum((sample_keys(b) for b in out), [])) == sorted(sum((sample_keys(b) for b in batches), []))
    assert [b.index for b in out] == list(range(len(out)))
    assert all(b.size == 32 for b in out[:-2])


@pytest.mark.parametrize("hot_run,cold_run", [(4, 1), (2, 3)])
def test_every_formed_batch_carries_the_casting_of_its_own_ids(hot_run, cold_run):
    """The pools' parts carry no extras (they are cast once, as a batch is emitted): each emitted
    batch's casting and unique rows are those of its own ids and offsets, none left from a part."""
    from flowrec.data.lookahead import mean_flags
    from operators.casting import compute_casting

    spec = cache_spec()
    batches = staged(spec, window=1)
    modules = hot_modules(spec, batches, 0.3)
    hot = {n: m.is_hot() for n, m in modules.items()}
    groups = {m.group.name: m.group for m in modules.values()}
    out = list(HotColdBatcher(batches, hot, groups.values(), 32, hot_run, cold_run))
    assert len(out) > 3
    fields = ("unique_ids", "counts", "unique_offsets", "sorted_bags")
    for batch in out:
        for name, g in batch.groups.items():
            want = compute_casting(g.ids, g.offsets, mean_flags(groups[name]))
            assert want.num_bags == g.casting.num_bags == batch.size * groups[name].bags_per_sample
            for field in fields:
                assert torch.equal(getattr(g.casting, field), getattr(want, field)), (name, field)
            assert torch.equal(g.unique, want.unique_ids) and torch.equal(g.window_unique, want.unique_ids)


def test_select_samples_repacks_ids_and_offsets():
    spec = cache_spec()
    batch = staged(spec, window=1)[0]
    groups = {g.name: g for g in groups_of(spec, "fp32")}
    index = torch.tensor([5, 0, 17])
    sub = select_samples(batch, index, groups)
    for name, g in batch.groups.items():
        s = groups[name].bags_per_sample
        want_ids, want_len = [], []
        for b in index.tolist():
            lo, hi = int(g.offsets[b * s]), int(g.offsets[(b + 1) * s])
            want_ids += g.ids[lo:hi].tolist()
            want_len += (g.offsets[b * s + 1:(b + 1) * s + 1] - g.offsets[b * s:(b + 1) * s]).tolist()
        assert sub.groups[name].ids.tolist() == want_ids
        assert (sub.groups[name].offsets[1:] - sub.groups[name].offsets[:-1]).tolist() == want_len
        assert sub.groups[name].casting.unique_ids.tolist() == sorted(set(want_ids))


def test_fae_training_equals_device_on_the_same_order():
    spec = cache_spec("rowwise_adagrad")
    batches = staged(spec, window=1)
    modules = hot_modules(spec, batches, 0.3)
    hot = {n: m.is_hot() for n, m in modules.items()}
    order = list(HotColdBatcher(batches, hot, [m.group for m in modules.values()], 32, 3, 1))
    for name, module in modules.items():
        w = head_weights(module.group)
        for batch in order:
            loss_of(module.forward_group(batch.groups[name]), w).backward()
        assert module.switches > 0
        assert_same(module.full_tables(), train_reference(replace(module.group, cache_rows=0), order), "fp64")


def test_switch_sync_makes_host_and_device_agree():
    spec = cache_spec()
    batches = staged(spec, window=1)
    modules = hot_modules(spec, batches, 0.15)
    name, module = next(iter(modules.items()))
    hot = {name: module.is_hot()}
    order = list(HotColdBatcher(batches, hot, [m.group for m in modules.values()], 32, 2, 1))
    w = head_weights(module.group)
    checked = 0
    for batch in order:
        kind_before = module.last_kind
        out = module.forward_group(batch.groups[name])
        if kind_before and module.last_kind != kind_before:
            checked += 1
            assert torch.equal(module.master.weight[module.hot_rows], module.hot.weight)
            assert torch.equal(module.master.state[module.hot_rows], module.hot.state)
        loss_of(out, w).backward()
    assert checked == module.switches >= 2


def test_assign_hot_rows_fills_every_static_hot_group():
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.runtime.caches.static_hot import assign_hot_rows
    from flowrec.runtime.lowering import lower
    from test_cache_model import plan_with

    spec = cache_spec()
    plan = plan_with(spec, "static_hot", {g.name: 40 for g in groups_of(spec, "fp32")})
    model = lower(plan, spec, "cpu")
    source = MemorySource(split_table(synth_table(spec, 400, SynthConfig(seed=2)), 2))
    flags = assign_hot_rows(model, spec, source, sample_rate=1.0)
    assert set(flags) == set(model.embeddings)
    assert all(int(f.sum()) == 40 for f in flags.values())
