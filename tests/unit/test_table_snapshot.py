"""A full checkpoint's table copy, made on another thread while training changes rows, equals
the tables at the moment it was taken (copy-on-write through `TableSnapshot.before_write`)."""
from __future__ import annotations

import threading

import pytest
import torch

from flowrec.runtime.checkpoint.incremental import TableSnapshot
from flowrec.runtime.nonfinite import all_finite, all_finite_here, first_non_finite


def _tables(gen: torch.Generator, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, ...]]:
    return {"a": (torch.randn(5000, 8, generator=gen, dtype=dtype), torch.rand(5000, 1, generator=gen, dtype=dtype)),
            "b": (torch.randn(700, 4, generator=gen, dtype=dtype), torch.zeros(700, 0, dtype=dtype))}


def _step(tables: dict[str, tuple[torch.Tensor, ...]], snap: TableSnapshot, gen: torch.Generator) -> None:
    """One 'training step': skewed ids with repeats, saved first, then changed in place."""
    for name, (weight, state) in tables.items():
        ids = (torch.rand(300, generator=gen) ** 3 * weight.shape[0]).long()
        snap.before_write(name, ids)
        weight.index_add_(0, ids, torch.randn(ids.numel(), weight.shape[1], generator=gen, dtype=weight.dtype))
        if state.shape[1]:
            state.index_add_(0, ids, torch.ones(ids.numel(), state.shape[1], dtype=state.dtype))


def _assert_equal(copies: dict, expected: dict) -> None:
    assert copies.keys() == expected.keys()
    for name in expected:
        assert all(torch.equal(c, e) for c, e in zip(copies[name], expected[name], strict=True))


@pytest.mark.parametrize("seed, dtype", [(0, torch.float64), (1, torch.float32), (2, torch.float32)])
def test_a_copy_made_while_rows_change_equals_the_tables_when_taken(seed: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(seed)
    tables = _tables(gen, dtype)
    expected = {name: tuple(t.clone() for t in tensors) for name, tensors in tables.items()}
    snap = TableSnapshot(tables, chunk_rows=3)
    out: dict = {}
    copier = threading.Thread(target=lambda: out.update(snap.copy()))
    copier.start()
    during = 0
    while copier.is_alive() or during == 0:  # at least one step runs while the copy is under way
        _step(tables, snap, gen)
        during += copier.is_alive()
    copier.join(30)
    _assert_equal(out, expected)
    assert not torch.equal(tables["a"][0], expected["a"][0])  # training did change the live rows


def test_steps_before_and_after_the_copy_are_not_in_it():
    gen = torch.Generator().manual_seed(4)
    tables = _tables(gen, torch.float64)
    snap = TableSnapshot(tables)
    expected = {name: tuple(t.clone() for t in tensors) for name, tensors in tables.items()}
    _step(tables, snap, gen)  # after the snapshot was taken, before its copy started
    changed = {name: tuple(t.clone() for t in tensors) for name, tensors in tables.items()}
    _assert_equal(snap.copy(), expected)
    _step(tables, snap, gen)  # after the copy: nothing saved any more
    assert not any(stream.held().numel() for stream in snap._parts["a"])
    assert not torch.equal(tables["a"][0], changed["a"][0])


def test_all_finite_is_exact_also_when_the_sum_overflows():
    big = torch.full((1000, 4), 3e38)  # every value finite, their float32 sum is inf
    assert all_finite(big) and first_non_finite({"big": big}) is None
    for bad in (float("nan"), float("inf"), -float("inf")):
        t = torch.randn(300, 7, dtype=torch.float64)
        t[123, 5] = bad
        assert not all_finite(t) and first_non_finite({"ok": torch.zeros(2), "t": t}) == "t"
    assert all_finite(torch.zeros(0, 3))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_writer_thread_check_equals_isfinite_on_every_dtype(dtype: torch.dtype, seed: int):
    """`all_finite_here` (numpy, the writers' chunk check) against torch.isfinite().all() on skewed
    random chunks: finite ones, ones whose sum overflows, and a NaN / inf / -inf at a random place."""
    gen = torch.Generator().manual_seed(seed)
    big = torch.finfo(dtype).max / 4
    for rows in (1, 37, 4096):
        values = (torch.randn(rows, 16, generator=gen) ** 3).to(dtype)
        cases = [values, torch.full((rows, 16), big, dtype=dtype), values.clone()[: rows // 2]]
        for bad in (float("nan"), float("inf"), -float("inf")):
            t = values.clone()
            t.view(-1)[int(torch.randint(t.numel(), (1,), generator=gen))] = bad
            cases.append(t)
        for t in cases:
            expected = bool(torch.isfinite(t).all())
            assert all_finite_here(t) is expected and all_finite(t) is expected
    assert not all_finite_here(torch.tensor([[1.0, float("nan")]]).t())  # strided: torch's own check
