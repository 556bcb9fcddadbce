"""Lookahead extraction against a plain recomputation; synthetic data determinism and learnability."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.encode import hash_rows
from flowrec.data.synth import SynthConfig, hidden_weight, synth_table
from flowrec.spec import spec_from_dict

casting_mod = pytest.importorskip("operators.casting")


def spec_with(max_len: int = 3, pooling: str = "mean"):
    return spec_from_dict({
        "name": "la",
        "features": [
            {"name": "d", "type": "dense", "transform": "log1p"},
            {"name": "a", "type": "categorical", "hash_buckets": 200, "dim": 8},
            {"name": "b", "type": "categorical", "vocab": 50, "dim": 8},
            {"name": "s", "type": "sequence", "vocab": 80, "dim": 8, "max_len": max_len, "pooling": pooling},
        ],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "h", "input": "m"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
    })


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("pooling", ["mean", "none", "sum"])
def test_lookahead_equals_recomputation(window, pooling):
    spec = spec_with(pooling=pooling)
    table = synth_table(spec, 700, SynthConfig(seed=5, alpha=1.2))
    src = MemorySource(split_table(table, 3))
    opts = StagingOptions(batch_size=64, shuffle_buffer=256, workers=2, lookahead=window)
    with iterate_batches(spec, src, opts) as it:
        batches = list(it)
    with iterate_batches(spec, src, StagingOptions(batch_size=64, shuffle_buffer=256)) as it:
        plain = list(it)
    assert [b.index for b in batches] == list(range(len(plain)))
    for i, (b, p) in enumerate(zip(batches, plain)):
        for name, g in b.groups.items():
            assert torch.equal(g.ids, p.groups[name].ids) and torch.equal(g.offsets, p.groups[name].offsets)
            assert g.unique.tolist() == sorted(set(g.ids.tolist()))
            ahead = set().union(*(set(q.groups[name].ids.tolist()) for q in plain[i:i + window]))
            assert g.window_unique.tolist() == sorted(ahead)
            ref = casting_mod.compute_casting(g.ids, g.offsets)
            assert torch.equal(g.casting.unique_ids, ref.unique_ids)
            assert torch.equal(g.casting.counts, ref.counts)
            assert torch.equal(g.casting.sorted_bags, ref.sorted_bags)
            _check_casting_by_hand(g)
            if pooling == "mean":
                assert g.casting.sorted_scale is not None


def _check_casting_by_hand(g):
    ids, offsets = g.ids.numpy(), g.offsets.numpy()
    bags = np.repeat(np.arange(len(offsets) - 1), np.diff(offsets))
    order = np.argsort(ids, kind="stable")
    assert g.casting.sorted_bags.tolist() == bags[order].tolist()
    u, c = np.unique(ids, return_counts=True)
    assert g.casting.unique_ids.tolist() == u.tolist() and g.casting.counts.tolist() == c.tolist()


def test_synth_is_deterministic_and_skewed():
    spec = spec_with()
    a = synth_table(spec, 5000, SynthConfig(seed=7))
    assert a.equals(synth_table(spec, 5000, SynthConfig(seed=7)))
    assert not a.equals(synth_table(spec, 5000, SynthConfig(seed=8)))
    ids = a.column("a").to_numpy()
    assert ids.min() >= 1 and ids.max() < 200
    _, counts = np.unique(ids, return_counts=True)
    top = np.sort(counts)[::-1]
    assert top[:2].sum() > 0.2 * len(ids)  # Zipf: a few rows take a large share
    hottest = np.unique(ids)[np.argmax(counts)]
    assert hottest != 1  # hot rows are scattered, not the lowest ids
    lengths = np.diff(a.column("s").combine_chunks().offsets.to_numpy())
    assert lengths.max() <= 3 and lengths.min() == 0


def _auc(score: np.ndarray, y: np.ndarray) -> float:
    order = np.argsort(score)
    ranks = np.empty(len(score))
    ranks[order] = np.arange(1, len(score) + 1)
    pos = y == 1
    return (ranks[pos].sum() - pos.sum() * (pos.sum() + 1) / 2) / (pos.sum() * (~pos).sum())


def test_synth_labels_are_learnable():
    spec = spec_with(max_len=1, pooling="sum")
    t = synth_table(spec, 40000, SynthConfig(seed=2))
    y = t.column("label").to_numpy()
    assert 0.1 < y.mean() < 0.6
    train, test = slice(0, 30000), slice(30000, None)
    score = np.zeros(len(y))
    for name in ("a", "b", "s"):  # a per-id click-rate model fitted on the train split
        ids = t.column(name).to_numpy() if name != "s" else t.column(name).combine_chunks().flatten().to_numpy()
        if len(ids) != len(y):
            continue
        num = np.bincount(ids[train], weights=y[train], minlength=ids.max() + 1)
        den = np.bincount(ids[train], minlength=ids.max() + 1)
        rate = (num + y[train].mean() * 5) / (den + 5)
        score += np.log(rate[ids] / (1 - rate[ids]))
    assert _auc(score[test], y[test]) > 0.6
    assert hidden_weight(np.array([3, 3]), np.uint64(1)).std() == 0


def test_hash_is_stable_and_in_range():
    import pyarrow as pa

    values = pa.array(["68fd1e64", "80e26c9b", None, "", "68fd1e64"])
    rows = hash_rows(values, 1000)
    assert rows[2] == rows[3] == 0 and rows[0] == rows[4] and 1 <= rows[0] < 1000
    assert hash_rows(pa.array([12]), 1000)[0] == hash_rows(pa.array(["12"]), 1000)[0]
    assert hash_rows(values, 1000).tolist() == rows.tolist()
