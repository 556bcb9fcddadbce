"""Tensor casting: the casted index and the casted gather-reduce equal autograd's embedding-bag gradient."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators.casting import casted_row_grads, compute_casting
from operators.random_batches import random_batch, zipf_ids


def _group(dim: int = 4, pooling: str = "sum") -> PackedGroup:
    tables = (TableSlot("a", 50, 0), TableSlot("one", 1, 50), TableSlot("b", 200, 51))
    fields = (GroupField("fa", "a", 1, "sum"), GroupField("fone", "one", 3, pooling),
              GroupField("fb", "b", 5, pooling), GroupField("fseq", "a", 4, "none"))
    return PackedGroup("g", dim, "fp32", ("sgd", 0.1, ()), tables, fields)


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))


def test_synth_batch_layout_and_skew():
    gen = _seed()
    group = _group()
    batch = random_batch(group, 64, gen)
    S = group.bags_per_sample
    assert batch.offsets.numel() == 64 * S + 1
    lengths = (batch.offsets[1:] - batch.offsets[:-1]).reshape(64, S)
    assert (lengths[:, 0] == 1).all()
    assert (lengths[:, 3:] <= 1).all()  # sequence positions are single-id bags
    a_ids = batch.ids[batch.offsets[:-1].reshape(64, S)[:, 0]]
    assert ((a_ids >= 0) & (a_ids < 50)).all()
    b_bags = torch.arange(64) * S + 2
    for bag in b_bags.tolist():
        seg = batch.ids[batch.offsets[bag]:batch.offsets[bag + 1]]
        assert ((seg >= 51) & (seg < 251)).all()
    ids = zipf_ids(1000, 20000, 1.1, gen)
    top = torch.bincount(ids, minlength=1000).sort(descending=True).values
    assert top[0] > 20 * top[500]  # skewed, not uniform


def test_casting_fields_match_definition():
    gen = _seed()
    batch = random_batch(_group(), 32, gen)
    c = compute_casting(batch.ids, batch.offsets)
    order = sorted(range(batch.ids.numel()), key=lambda p: (int(batch.ids[p]), p))
    bag_of = torch.repeat_interleave(torch.arange(batch.offsets.numel() - 1),
                                      batch.offsets[1:] - batch.offsets[:-1])
    assert c.sorted_bags.tolist() == [int(bag_of[p]) for p in order]
    uniq, counts = torch.unique(batch.ids, return_counts=True)
    assert torch.equal(c.unique_ids, uniq) and torch.equal(c.counts, counts)
    assert c.unique_offsets[-1] == batch.ids.numel() and c.sorted_scale is None


@pytest.mark.parametrize("dim", [1, 7, 16])
@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_casted_grads_equal_autograd_embedding_bag(dim, pooling):
    gen = _seed()
    group = _group(dim, pooling)
    batch = random_batch(group, 48, gen, empty_prob=0.3)
    S = group.bags_per_sample
    mean_flags = torch.tensor([f.pooling == "mean" for f in group.fields for _ in
                               range(f.max_len if f.pooling == "none" else 1)])
    weight = torch.randn(group.rows, dim, generator=gen, dtype=torch.float64, requires_grad=True)
    lengths = batch.offsets[1:] - batch.offsets[:-1]
    scale = torch.where(mean_flags.repeat(48), 1.0 / lengths.clamp_min(1).double(),
                        torch.ones(48 * S, dtype=torch.float64))
    psw = torch.repeat_interleave(scale, lengths)
    out = F.embedding_bag(batch.ids, weight, batch.offsets, mode="sum",
                          per_sample_weights=psw, include_last_offset=True)  # (NB, D)
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    out.backward(grad_out)
    c = compute_casting(batch.ids, batch.offsets, mean_flags if pooling == "mean" else None)
    rows = casted_row_grads(grad_out, c)  # (U, D)
    assert rows.shape == (c.unique_ids.numel(), dim)
    torch.testing.assert_close(rows, weight.grad[c.unique_ids])
    untouched = torch.ones(group.rows, dtype=torch.bool)
    untouched[c.unique_ids] = False
    assert (weight.grad[untouched] == 0).all()


def test_mean_flags_per_bag_equal_per_position():
    gen = _seed()
    group = _group(3, "mean")
    batch = random_batch(group, 8, gen)
    S = group.bags_per_sample
    flags = torch.rand(S, generator=gen) < 0.5
    flags[0] = True
    a = compute_casting(batch.ids, batch.offsets, flags)
    b = compute_casting(batch.ids, batch.offsets, flags.repeat(8))
    torch.testing.assert_close(a.sorted_scale, b.sorted_scale, rtol=0, atol=0)
    with pytest.raises(ValueError):
        compute_casting(batch.ids, batch.offsets, torch.ones(5, dtype=torch.bool))  # 5 does not divide 8 * 7
