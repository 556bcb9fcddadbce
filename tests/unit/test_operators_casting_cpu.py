"""The CPU casting kernel (`operators.casting_cpu`) gives torch's casting, element for element."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators.casting import MIN_CPU_KERNEL_IDS, Casting, compute_casting, torch_casting
from operators.casting_cpu import cast_index
from operators.random_batches import random_batch

FIELDS = ("unique_ids", "counts", "unique_offsets", "sorted_bags", "sorted_scale")


def _seed() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))


def _assert_same(got: Casting, want: Casting) -> None:
    assert got.num_bags == want.num_bags
    for name in FIELDS:
        a, b = getattr(got, name), getattr(want, name)
        if b is None:
            assert a is None, name
            continue
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name


def _skewed(n: int, rows: int, gen: torch.Generator) -> torch.Tensor:
    """Zipf-like ids below `rows`: a few rows take most lookups and many repeat (runs of equal ids
    whose order must stay), spread over the whole range (every digit of the sort in use)."""
    span = min(rows, 4 * n)
    return (torch.rand(n, generator=gen).pow(4) * span).long() * (rows // span)


@pytest.mark.parametrize("rows", [7, 1 << 13, 33_762_603, 1 << 40])  # one digit pass .. four
@pytest.mark.parametrize("n", [MIN_CPU_KERNEL_IDS, 5_000, 106_496, 300_000])  # 300,000: 8-bit digits
def test_one_id_per_bag_equals_torch(rows, n):
    gen = _seed()
    ids = _skewed(n, rows, gen)
    offsets = torch.arange(n + 1)
    got = compute_casting(ids, offsets)
    _assert_same(got, torch_casting(ids, offsets))
    assert got.unique_ids.numel() < n  # repeats: the stable order of equal ids was exercised
    assert not torch.equal(got.sorted_bags, torch.arange(n))  # the ids were not already in order


@pytest.mark.parametrize("pooling", ["sum", "mean"])
def test_bags_of_several_ids_and_empty_bags_equal_torch(pooling):
    gen = _seed()
    group = PackedGroup("g", 4, "fp32", ("sgd", 0.1, ()),
                        (TableSlot("a", 50, 0), TableSlot("b", 200_000, 50)),
                        (GroupField("fa", "a", 1, "sum"), GroupField("fb", "b", 6, pooling),
                         GroupField("fseq", "a", 4, "none")))
    batch = random_batch(group, 512, gen)
    lengths = batch.offsets[1:] - batch.offsets[:-1]
    assert batch.ids.numel() >= MIN_CPU_KERNEL_IDS and int(lengths.max()) > 1 and int(lengths.min()) == 0
    flags = torch.tensor([False] + [pooling == "mean"] + [False] * 4)
    got = compute_casting(batch.ids, batch.offsets, flags)
    _assert_same(got, torch_casting(batch.ids, batch.offsets, flags))
    assert (got.sorted_scale is not None) == (pooling == "mean")


def test_int32_ids_and_a_column_slice_are_taken_as_torch_takes_them():
    gen = _seed()
    wide = _skewed(3 * 4_000, 90_000, gen).view(4_000, 3)
    ids = wide[:, 1]  # not contiguous
    offsets = torch.arange(ids.numel() + 1, dtype=torch.int32)
    _assert_same(compute_casting(ids.int(), offsets), torch_casting(ids.int(), offsets))
    _assert_same(compute_casting(ids, offsets), torch_casting(ids, offsets))


def test_all_ids_equal_keep_their_positions():
    ids = torch.full((1_000,), 12345, dtype=torch.int64)
    got = compute_casting(ids, torch.arange(1_001))
    assert got.unique_ids.tolist() == [12345] and got.counts.tolist() == [1_000]
    assert torch.equal(got.sorted_bags, torch.arange(1_000))


def test_input_the_kernel_does_not_take_goes_to_torch():
    ids = torch.arange(600) % 17
    negative = ids.clone()
    negative[5] = -3
    assert cast_index(negative.numpy(), np.arange(601)) is None
    short = np.arange(600)  # the last offset is not the number of ids
    assert cast_index(ids.numpy(), short) is None
    backwards = np.arange(601)
    backwards[10] = 20  # offsets must not decrease
    assert cast_index(ids.numpy(), backwards) is None
    # torch's path then answers as it did: negative ids sort first, bad offsets raise
    got = compute_casting(negative, torch.arange(601))
    assert int(got.unique_ids[0]) == -3
    with pytest.raises(RuntimeError):
        compute_casting(ids, torch.arange(600))


def test_below_the_threshold_torch_computes_it(monkeypatch):
    import operators.casting_cpu as kernel

    calls = []
    real = kernel.cast_index
    monkeypatch.setattr(kernel, "cast_index", lambda *a: calls.append(1) or real(*a))
    gen = _seed()
    small = _skewed(MIN_CPU_KERNEL_IDS - 1, 1_000, gen)
    _assert_same(compute_casting(small, torch.arange(small.numel() + 1)),
                 torch_casting(small, torch.arange(small.numel() + 1)))
    assert not calls
    large = _skewed(MIN_CPU_KERNEL_IDS, 1_000, gen)
    compute_casting(large, torch.arange(large.numel() + 1))
    assert calls == [1]
