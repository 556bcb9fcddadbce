"""Backend choice: cupy is used only when it imports and sees a device; otherwise torch runs."""
from __future__ import annotations

import sys
import types

import torch

from operators import backends
from operators.casting import compute_casting
from operators.sparse_optim import make_optimizer


def _fake_cupy(available: bool) -> types.ModuleType:
    mod = types.ModuleType("cupy")
    mod.cuda = types.SimpleNamespace(is_available=lambda: available)
    return mod


def test_cupy_without_driver_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(False))
    assert backends.cupy_usable() is False
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(True))
    assert backends.cupy_usable() is True


def test_cupy_import_error_falls_back(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", None)  # import raises ImportError
    assert backends.cupy_usable() is False


def test_cpu_tables_always_use_torch(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupy", _fake_cupy(True))
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    weight = torch.randn(20, 3, generator=gen)
    ref = weight.clone()
    opt = make_optimizer(("rowwise_adagrad", 0.1, ()))
    state, ref_state = opt.initial_state(20, 3, torch.float32), opt.initial_state(20, 3, torch.float32)
    ids = torch.randint(0, 20, (12,), generator=gen)
    offsets = torch.tensor([0, 3, 3, 7, 12])
    grad = torch.randn(4, 3, generator=gen)
    casting = compute_casting(ids, offsets)
    assert backends.fused_backward(weight, state, opt, grad, casting, use_cupy=True) == "torch"
    rows = casting.unique_ids
    g = torch.nn.functional.embedding_bag(casting.sorted_bags, grad, casting.unique_offsets,
                                          mode="sum", include_last_offset=True)
    opt.step(ref, ref_state, rows, g)
    assert torch.equal(weight, ref) and torch.equal(state, ref_state)
