"""Training with managed tables equals a plain reference: a dict-based map and plain embedding
bags (torch.optim Adagrad, optimizer state reset by hand), on fresh random Zipf-skewed raw ids;
under the lookahead cache, eviction equals device-resident training bitwise (float64)."""
from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.managed import NO_ROW
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.caches.lookahead_cache import LookaheadEmbedding
from flowrec.runtime.caches.static_hot import StaticHotEmbedding
from flowrec.runtime.lowering import lower
from flowrec.runtime.managed_state import ManagedState, fresh_rows
from flowrec.measure.reference import ReferenceModel, reference_optimizers, reference_step
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict
from flowrec.testing.managed_ref import DictMap, ShardedDictMap
from operators.embedding import PackedEmbeddingBag

BATCH, STEPS = 48, 14


def managed_spec(seed: int, evict: str = "lfu", items: int = 50, shards: int = 1):
    return spec_from_dict({
        "name": "managed_ref",
        "features": [
            {"name": "x", "type": "dense"},
            {"name": "user", "type": "categorical", "table": "users"},
            {"name": "friends", "type": "sequence", "table": "users", "max_len": 3, "pooling": "mean"},
            {"name": "item", "type": "categorical", "hash_buckets": items, "dim": 4},
        ],
        "tables": [{"name": "users", "dim": 4,
                    "managed": {"rows": 30, "admit_min_count": 2, "evict": evict, "every_steps": 3,
                                "ttl_steps": 7, "shards": shards}}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.05}, "sparse": {"name": "adagrad", "lr": 0.1}},
        "training": {"batch_size": BATCH, "seed": seed},
    })


def raw_and_batches(spec, seed: int, window: int, groups):
    table = synth_table(spec, BATCH * STEPS, SynthConfig(seed=seed, alpha=1.3))
    state = ManagedState(spec, groups, spec.training.seed)
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=window, workers=2)
    with iterate_batches(spec, MemorySource(split_table(table, 3)), opts, 0, 0, groups,
                         remap=state.remapper(train=True)) as it:
        batches = [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]
    return table, batches


def reference_fields(spec, group, raw, ref_map: DictMap | ShardedDictMap):
    """Plain per-field (local ids, offsets) of one raw batch; the managed table through the dict map."""
    users = raw.column("user").to_pylist()
    friends = raw.column("friends").to_pylist()
    rows, resets = ref_map.step(users + [u for lst in friends for u in lst])
    user_rows, friend_rows = rows[:len(users)], iter(rows[len(users):])
    per_field = {"user": [[r] if r != NO_ROW else [] for r in user_rows],
                 "friends": [[r for r in (next(friend_rows) for _ in lst) if r != NO_ROW] for lst in friends],
                 "item": [[i] for i in raw.column("item").to_pylist()]}
    out = []
    for f in group.fields:
        bags = per_field[f.feature]
        offsets = np.concatenate([[0], np.cumsum([len(b) for b in bags])])
        out.append((torch.tensor([r for b in bags for r in b], dtype=torch.int64), torch.from_numpy(offsets)))
    return out, resets


def reset_reference(ref, table_opt, resets, seed: int, clock: int) -> None:
    weight = ref.table("users").weight
    with torch.no_grad():
        weight[resets] = fresh_rows(seed, "users", weight.shape[0], len(resets), weight.shape[1], clock).double()
    state = table_opt.state.get(weight)
    if state:
        state["sum"][resets] = 0.0


@pytest.mark.parametrize("evict, shards", [("lfu", 1), ("decayed_lfu", 1), ("lru", 1), ("lfu", 4), ("lru", 3)])
def test_managed_training_equals_plain_reference(evict, shards):
    seed = random.randrange(1 << 30)
    spec = managed_spec(seed % 1000, evict, shards=shards)
    plan = make_plan(spec, target="cpu")
    groups = plan.meta.groups
    assert len(groups) == 1  # users and item pack together: rows of both in one table
    table, batches = raw_and_batches(spec, seed, 2, groups)
    model = lower(plan, spec, "cpu").double()
    opt = make_dense_optimizer(model, "sgd", 0.05, {})
    ref = ReferenceModel(plan, spec).double()
    optimizers = reference_optimizers(ref, spec)
    managed = spec.table("users").managed
    ref_map = DictMap(managed) if shards == 1 else ShardedDictMap(managed)
    resets_seen = defaults = 0
    for k, batch in enumerate(batches):
        raw = table.slice(k * BATCH, BATCH)
        fields, resets = reference_fields(spec, groups[0], raw, ref_map)
        assert batch.managed.resets.get(groups[0].name, torch.zeros(0)).tolist() == \
            [r + groups[0].row_offsets["users"] for r in resets]
        reset_reference(ref, optimizers[1], resets, spec.training.seed, ref_map.clock - 1)
        model.managed.before_step(model.embeddings, batch)
        loss = train_step(model, opt, batch)
        model.managed.after_step(batch)
        ref_loss = reference_step(ref, optimizers, batch, fields={groups[0].name: fields})
        assert loss == pytest.approx(ref_loss, rel=1e-9, abs=1e-12)
        resets_seen += len(resets)
        defaults += batch.managed.defaults
    assert resets_seen > 0 and defaults > 0  # eviction and the default row were exercised
    for t in ("users", "item"):
        torch.testing.assert_close(model.embeddings[groups[0].name].table_rows(t), ref.table(t).weight.detach(),
                                   rtol=1e-9, atol=1e-11, msg=lambda m: f"seed {seed}, table {t}: {m}")
    model.managed.sync()
    if shards == 1:
        committed = model.managed.maps["users"].state()
        assert committed["keys"].tolist() == sorted(ref_map.ids)
        assert committed["free"].tolist() == ref_map.free
    else:
        entries = model.managed.maps["users"].entries()
        assert entries.keys.tolist() == ref_map.keys()
        held = entries.row != NO_ROW
        assert dict(zip(entries.keys[held].tolist(), entries.row[held].tolist())) == ref_map.held()


def _cache(kind: str, group, seed: int):
    if kind == "lookahead":
        return LookaheadEmbedding(group, seed, torch.device("cpu"), capacity=130, record=True)
    hot = torch.arange(0, group.rows, 3)  # every third row hot: batches mix hot and cold rows
    return StaticHotEmbedding(replace(group, cache_rows=len(hot)), seed, torch.device("cpu"), hot_rows=hot)


@pytest.mark.parametrize("kind, shards", [("lookahead", 1), ("static_hot", 1), ("lookahead", 4)])
def test_caches_serve_no_evicted_row(kind, shards):
    seed = random.randrange(1 << 30)
    spec = managed_spec(seed % 1000, items=400, shards=shards)
    plan = make_plan(spec, target="cpu")
    group = replace(plan.meta.groups[0], dtype="fp64")
    window = 2  # a window pins at most 2 * BATCH item rows and the 30 user rows: 126 < 130 slots < 430 rows
    _, batches = raw_and_batches(spec, seed, window, (group,))
    resident = PackedEmbeddingBag(group, seed=spec.training.seed)
    cache = _cache(kind, group, spec.training.seed)
    states = [ManagedState(spec, (group,), spec.training.seed) for _ in range(2)]
    head = torch.randn(group.bags_per_sample, group.dim, dtype=torch.float64)
    reset = 0
    for batch in batches:
        gids = batch.groups[group.name]
        for state, module in zip(states, ({group.name: resident}, {group.name: cache})):
            state.before_step(module, batch)
            state.after_step(batch)
        reset += len(batch.managed.resets.get(group.name, []))
        torch.tanh(resident(gids.ids, gids.offsets, gids.casting) * head).sum().backward()
        torch.tanh(cache.forward_group(gids) * head).sum().backward()
    if kind == "lookahead":
        cache.close()
        assert any(x.evicted for x in cache.pad.log)  # the cache evicted rows too
        assert cache.counters.demand_rows <= 2 * group.bags_per_sample * BATCH  # only the pipeline fill missed
    assert reset > 0
    for s in states:
        s.sync()  # the replays agreed with the data stage
    weight, state = cache.full_tables()
    assert torch.equal(weight, resident.weight) and torch.equal(state, resident.state)
