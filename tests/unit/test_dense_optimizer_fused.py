"""The dense optimizer is torch's fused kernel where torch has one, with the unfused update rule:
several steps on fresh random parameters and gradients equal the unfused optimizer's (float64
1e-12; float32 allclose)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from flowrec.runtime.step import make_dense_optimizer

CASES = [("adam", {"beta1": 0.8, "weight_decay": 0.01}), ("adagrad", {"initial_accumulator_value": 0.1}),
         ("sgd", {"momentum": 0.9})]


@pytest.mark.parametrize("name,params", CASES)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)])
def test_fused_dense_optimizer_equals_unfused(name, params, dtype, tol):
    seed = random.randrange(1 << 30)
    g = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 1), (1,)]
    start = [torch.randn(s, generator=g, dtype=dtype) * 2 for s in shapes]
    fused = [torch.nn.Parameter(t.clone()) for t in start]
    plain = [torch.nn.Parameter(t.clone()) for t in start]
    opt = make_dense_optimizer(SimpleNamespace(dense_parameters=lambda: fused), name, 0.05, params)
    assert opt.defaults.get("fused") is True, f"{name}: not fused"
    ref = {"adam": lambda p: torch.optim.Adam(p, lr=0.05, betas=(0.8, 0.999), weight_decay=0.01, foreach=False),
           "adagrad": lambda p: torch.optim.Adagrad(p, lr=0.05, initial_accumulator_value=0.1, foreach=False),
           "sgd": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=False)}[name](plain)
    for _ in range(4):
        for a, b in zip(fused, plain):
            grad = torch.randn(a.shape, generator=g, dtype=dtype) * torch.rand((), generator=g, dtype=dtype) * 10
            a.grad, b.grad = grad.clone(), grad.clone()
        opt.step()
        ref.step()
    for a, b, s in zip(fused, plain, start):
        assert not torch.equal(b.detach(), s), "the parameters did not move"
        torch.testing.assert_close(a.detach(), b.detach(), rtol=tol, atol=tol, msg=f"seed {seed}: {name}")


def test_parameters_without_a_fused_kernel_get_the_unfused_optimizer():
    params = [torch.nn.Parameter(torch.randn(3, device="meta"))]  # no fused kernel on this device
    opt = make_dense_optimizer(SimpleNamespace(dense_parameters=lambda: params), "adam", 0.01, {})
    assert not opt.defaults.get("fused")
    mixed = [torch.nn.Parameter(torch.randn(3)), torch.nn.Parameter(torch.randn(2, dtype=torch.float64))]
    opt = make_dense_optimizer(SimpleNamespace(dense_parameters=lambda: mixed), "adam", 0.01, {})
    mixed[0].grad, mixed[1].grad = torch.ones(3), torch.ones(2, dtype=torch.float64)
    before = [p.detach().clone() for p in mixed]
    opt.step()  # mixed dtypes: fused per dtype
    assert all(p.detach().ne(b).all() for p, b in zip(mixed, before))


def test_a_fused_kernel_refused_only_at_the_first_step_gives_the_unfused_optimizer():
    """torch makes `Adagrad(cuda params, fused=True)` and refuses it at the first step (an H200 run of
    `flowrec calibrate --device cuda` died there). A kind that does the same on the CPU gets the
    unfused optimizer, which steps; the probe leaves the real parameters alone."""
    from flowrec.runtime import step as step_module

    class LateRefusal(torch.optim.SGD):
        def step(self, closure=None):
            if self.defaults.get("fused"):
                raise RuntimeError("`fused=True` requires all the params to be ... supported devices")
            return super().step(closure)

    params = [torch.nn.Parameter(torch.randn(4, 3)), torch.nn.Parameter(torch.randn(3))]
    start = [p.detach().clone() for p in params]
    opt = step_module._fused_if_possible(LateRefusal, params, lr=0.1)
    assert not opt.defaults.get("fused")
    assert all(torch.equal(p.detach(), s) for p, s in zip(params, start))  # the probe stepped its own parameter
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    assert all(torch.allclose(p.detach(), s - 0.1) for p, s in zip(params, start))
    assert step_module._fused_if_possible(torch.optim.SGD, params, lr=0.1).defaults.get("fused") is True
