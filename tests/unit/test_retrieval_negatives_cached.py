"""Sampled negatives staged in the data stage: the item group on a cached placement (lookahead,
static_hot, FAE's hot and cold batches) and on the host trains what it trains on the device.

The reference is the same model with every group on placement device, trained on the same staged
batches (the caching invariant: same batch order, same parameters); the drawn items are checked
against the one seeded draw (`draw_negatives`) and against the item group's appended samples.
Fresh random seeds and skewed (Zipf) synthetic ids every run.
"""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.caches import hottest_rows
from flowrec.runtime.caches.fae_batches import HotColdBatcher
from flowrec.runtime.lowering import lower
from flowrec.runtime.retrieval import batch_items, draw_negatives, item_counts, sampler
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict

BATCH = 32
NUM = 24  # negatives per step
WINDOW = 3


def spec_doc(seed: int) -> dict:
    return {
        "name": "two_tower_cached",
        "features": [
            {"name": "user", "type": "categorical", "vocab": 200, "dim": 8},
            {"name": "age", "type": "categorical", "vocab": 5, "dim": 8},
            {"name": "item", "type": "categorical", "vocab": 300, "dim": 8},
        ],
        "modules": [
            {"name": "user_tower", "kind": "mlp", "inputs": ["user", "age"], "layers": [8]},
            {"name": "item_tower", "kind": "mlp", "inputs": ["item"], "layers": [8]},
            {"name": "score", "kind": "similarity", "inputs": ["user_tower", "item_tower"], "metric": "cosine",
             "temperature": 0.2},
        ],
        "heads": [{"name": "retrieve", "input": "score", "task": "retrieval", "logq_correction": True,
                   "negatives": {"kind": "sampled", "num": NUM, "distribution": "unigram"}}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.2}, "sparse": {"name": "adagrad", "lr": 0.2}},
        "training": {"batch_size": BATCH, "seed": seed},
    }


def setup(placement: str = "device", steps: int = 14):
    seed = random.randrange(1 << 30)
    spec = spec_from_dict(spec_doc(seed % 1000))
    plan = make_plan(spec, target="cpu")
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.3))
    source = MemorySource(split_table(table, 3))
    counts = item_counts(source, "item")
    return seed, spec, plan, source, counts


def placed(plan, placement: str, cache_rows: int = 0):
    groups = tuple(replace(g, placement=placement, cache_rows=cache_rows) for g in plan.meta.groups)
    return plan.with_meta(replace(plan.meta, groups=groups))


def model_of(plan, spec, counts):
    model = lower(plan, spec, "cpu")
    model.retrieval.set_counts(counts, torch.device("cpu"))
    return model, make_dense_optimizer(model, "sgd", 0.2, {})


def stage(spec, plan, source, negatives, window: int = WINDOW, epoch: int = 0):
    opts = StagingOptions(batch_size=BATCH, shuffle=True, shuffle_buffer=BATCH * 4, workers=2, lookahead=window)
    with iterate_batches(spec, source, opts, epoch, 0, plan.meta.groups, negatives=negatives) as it:
        return list(it)


def train(model, optimizer, batches) -> list[float]:
    return [train_step(model, optimizer, b) for b in batches]


def tables(model) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in model.embeddings.items():
        weight, state = module.full_tables() if hasattr(module, "full_tables") else (module.weight, module.state)
        out[name + ".weight"], out[name + ".state"] = weight.detach().clone(), state.detach().clone()
    return out


def assert_same_model(a, b, msg: str) -> None:
    for (name, p), (_, q) in zip(a.ops.named_parameters(), b.ops.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=lambda m: f"{msg}: {name}: {m}")
    ta, tb = tables(a), tables(b)
    for name in ta:
        assert not torch.equal(ta[name], torch.zeros_like(ta[name])) or "state" in name
        torch.testing.assert_close(ta[name], tb[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{msg}: {name}: {m}")


def check_staged(model, batches) -> None:
    """Every batch carries its seeded draw, appended to the item group after the batch's samples."""
    binding = model.retrieval
    for b in batches:
        want = draw_negatives(binding, model.noise_seed, b)
        assert torch.equal(b.negatives, want)
        gids = b.groups[binding.group]
        assert gids.offsets.numel() == (b.size + NUM) * binding.bags + 1
        assert torch.equal(gids.ids[-NUM:], want + binding.row_offset)
        assert batch_items(binding, b).numel() == b.size
        assert torch.isin(want + binding.row_offset, gids.window_unique).all()  # the window sees them


@pytest.mark.parametrize("placement", ["lookahead", "static_hot", "host"])
def test_sampled_negatives_on_a_placement_train_what_the_device_trains(placement):
    seed, spec, plan, source, counts = setup()
    reference, ref_opt = model_of(plan, spec, counts)
    batches = stage(spec, plan, source, sampler(reference.retrieval, reference.noise_seed))
    check_staged(reference, batches)
    group = plan.meta.groups[0]
    ids = torch.cat([b.groups[group.name].ids for b in batches])
    need = max(b.groups[group.name].window_unique.numel() for b in batches)
    cache_rows = {"lookahead": need, "static_hot": group.rows // 4, "host": 0}[placement]
    assert placement != "lookahead" or need < group.rows  # a cache smaller than the table: evictions
    model, opt = model_of(placed(plan, placement, cache_rows), spec, counts)
    if placement == "static_hot":
        model.embeddings[group.name].set_hot_rows(hottest_rows(torch.bincount(ids, minlength=group.rows),
                                                               cache_rows))
    ours, theirs = train(model, opt, batches), train(reference, ref_opt, batches)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, err_msg=f"seed {seed}")
    assert_same_model(model, reference, f"seed {seed} {placement}")
    counters = getattr(model.embeddings[group.name], "counters", None)
    if placement == "lookahead":  # only the first batch waited (pipeline fill): later negatives were prefetched
        assert counters.demand_rows == batches[0].groups[group.name].unique.numel(), f"seed {seed}"
        assert counters.snapshot()["hit_rate"] == 1.0
    if placement == "static_hot":
        assert 0 < counters.snapshot()["hit_rate"] < 1  # hot rows from the device, cold ones from the host


def test_fae_hot_and_cold_batches_draw_their_own_negatives_and_train_what_the_device_trains():
    """The trainer's FAE path: hot/cold batches formed from staged batches, then each gets the
    draw of its own (epoch, index), casting and window recomputed; static_hot equals device."""
    seed, spec, plan, source, counts = setup(steps=20)
    group = plan.meta.groups[0]
    reference, ref_opt = model_of(plan, spec, counts)
    staged = stage(spec, plan, source, None, window=1)
    hot_rows = hot_rows_for_both_kinds(group, staged)
    model, opt = model_of(placed(plan, "static_hot", hot_rows.numel()), spec, counts)
    model.embeddings[group.name].set_hot_rows(hot_rows)
    flags = {group.name: model.embeddings[group.name].is_hot()}
    draw = sampler(reference.retrieval, reference.noise_seed)
    batches = [draw.attach(b, group) for b in HotColdBatcher(staged, flags, plan.meta.groups, BATCH, 2, 1)]
    check_staged(reference, batches)
    assert [b.index for b in batches] == list(range(len(batches)))
    for b in batches:  # the casting was recomputed over the batch and its negatives
        gids = b.groups[group.name]
        assert torch.equal(gids.casting.unique_ids, torch.unique(gids.ids))
    kinds = ["hot" if bool(flags[group.name][b.groups[group.name].ids].all()) else "cold" for b in batches]
    assert {"hot", "cold"} <= set(kinds), f"seed {seed}: {kinds}"
    ours, theirs = train(model, opt, batches), train(reference, ref_opt, batches)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, err_msg=f"seed {seed}")
    assert_same_model(model, reference, f"seed {seed} fae")
    turns = sum(a != b for a, b in zip(kinds, kinds[1:]))
    assert model.embeddings[group.name].switches == turns, f"seed {seed}: {kinds}"


def hot_rows_for_both_kinds(group, staged) -> torch.Tensor:
    """Hot rows under which both batch kinds occur whatever the random stream: every item row (the
    drawn negatives are items, so a batch of hot samples stays hot with its negatives), every age
    row, and the most frequent users up to about 60% of the samples; the other users are cold."""
    offsets = group.row_offsets
    user_rows = torch.cat([b.groups[group.name].ids for b in staged])
    user_rows = user_rows[(user_rows >= offsets["user"]) & (user_rows < offsets["user"] + 200)]
    seen, freq = torch.unique(user_rows, return_counts=True)
    order = torch.argsort(freq, descending=True, stable=True)
    covered = torch.cumsum(freq[order], 0)
    take = int((covered < 0.6 * user_rows.numel()).sum()) + 1
    assert take < seen.numel()  # some seen users are cold: cold batches
    fixed = [torch.arange(offsets[t], offsets[t] + n) for t, n in (("item", 300), ("age", 5))]
    return torch.sort(torch.cat([*fixed, seen[order[:take]]])).values


def test_a_batch_staged_without_a_sampler_draws_the_same_negatives_at_the_step():
    """Hand-made batches (no sampler in the data stage) train exactly as staged ones."""
    seed, spec, plan, source, counts = setup(steps=6)
    staged_model, opt_a = model_of(plan, spec, counts)
    plain_model, opt_b = model_of(plan, spec, counts)
    with_draws = stage(spec, plan, source, sampler(staged_model.retrieval, staged_model.noise_seed))
    without = stage(spec, plan, source, None)
    assert all(b.negatives is None for b in without)
    assert train(staged_model, opt_a, with_draws) == train(plain_model, opt_b, without), f"seed {seed}"
    assert_same_model(staged_model, plain_model, f"seed {seed}")


def test_cached_placements_and_several_ranks_are_no_longer_refused():
    """Lowering a sampled head on lookahead or static_hot succeeds (it was refused before); a
    cached placement under several ranks stays refused in one line, as for every group."""
    from flowrec.runtime.distributed.model import ShardingError, sharded_embeddings

    spec = spec_from_dict(spec_doc(0))
    plan = make_plan(spec, target="cpu")
    for placement in ("lookahead", "static_hot"):
        model = lower(placed(plan, placement, 64), spec, "cpu")
        assert model.retrieval.sampled and model.embeddings[plan.meta.groups[0].name].takes_group_ids

    class World:
        size, rank, embedding_group = 2, 0, None

    with pytest.raises(ShardingError) as err:
        sharded_embeddings(placed(plan, "lookahead", 64).meta.groups, 0, torch.device("cpu"), World())
    assert "\n" not in str(err.value) and "lookahead" in str(err.value)
