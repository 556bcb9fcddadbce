"""`operators.lowp`: bf16 matrix products as fp32 products of bf16 values on a CPU without bf16
kernels. Each product against the widened fp32 product rounded once (bitwise), against torch's own
bf16 autocast (within a bf16 rounding) and float64; gradients rounded to bf16 once; every other
op, fp32 code outside autocast and float64 left alone; a bf16 training run against torch's own
autocast. Fresh skewed inputs, never zeros; the emulation is forced on (and off) by patching the
per-process probe, so these run alike on every CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from operators import lowp

CPU = torch.device("cpu")


def _skewed(gen: torch.Generator, *shape: int) -> torch.Tensor:
    scale = torch.rand(*shape, generator=gen).pow(4) * 8 + 0.05
    return torch.randn(*shape, generator=gen) * scale


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.bfloat16().float()


@pytest.fixture
def emulating(monkeypatch):
    monkeypatch.setattr(lowp, "_EMULATED", True)


def test_product_is_the_fp32_product_of_bf16_values_rounded_once() -> None:
    gen = torch.Generator().manual_seed(3)
    a, b, bias = _skewed(gen, 64, 40), _skewed(gen, 40, 24), _skewed(gen, 24)
    x, y = _skewed(gen, 5, 16, 8), _skewed(gen, 5, 8, 12)
    cases = [
        (torch.mm, (a, b), (_rounded(a) @ _rounded(b))),
        (torch.addmm, (bias, a, b), torch.addmm(_rounded(bias), _rounded(a), _rounded(b))),
        (F.linear, (a, b.t(), bias), F.linear(_rounded(a), _rounded(b.t()), _rounded(bias))),
        (torch.bmm, (x, y), torch.bmm(_rounded(x), _rounded(y))),
        (torch.matmul, (x.bfloat16(), y), torch.matmul(_rounded(x), _rounded(y))),  # a bf16 operand as is
    ]
    for func, args, fp32 in cases:
        got = lowp.product(func, *args)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, fp32.bfloat16()), func
        assert not torch.equal(got, (fp32 * 1.01).bfloat16())  # equality is informative
        exact = func(*(t.double() for t in args))
        assert torch.allclose(got.double(), exact, rtol=2e-2, atol=2e-2 * float(exact.abs().max()))


def test_matmul_takes_the_product_only_for_bf16_operands_where_emulated(monkeypatch) -> None:
    gen = torch.Generator().manual_seed(5)
    a, b = _skewed(gen, 30, 20), _skewed(gen, 20, 10)
    monkeypatch.setattr(lowp, "_EMULATED", True)
    assert torch.equal(lowp.matmul(torch.mm, a, b), a @ b)  # fp32 operands: torch's own fp32 product
    assert torch.equal(lowp.matmul(torch.mm, a.bfloat16(), b.bfloat16()),
                       (_rounded(a) @ _rounded(b)).bfloat16())
    monkeypatch.setattr(lowp, "_EMULATED", False)
    with torch.autocast("cpu", enabled=False):
        want = torch.mm(a.bfloat16(), b.bfloat16())
    assert torch.equal(lowp.matmul(torch.mm, a.bfloat16(), b.bfloat16()), want)  # torch's bf16 kernel


def test_emulated_is_the_probe_taken_at_import_and_never_cuda(monkeypatch) -> None:
    """The CPU is probed once, when the module is imported (never inside a trace, where the probe,
    an operator of torch's, would be recorded into an exported program): a copy of the module
    imported under each answer of `bf16_native` holds it."""
    import importlib.util

    from operators import device as device_module

    for native in (False, True):
        monkeypatch.setattr(device_module, "bf16_native", lambda device, answer=native: answer)
        spec = importlib.util.spec_from_file_location("lowp_copy", lowp.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        assert copy.emulated(CPU) is (not native)
        assert copy.emulated(torch.device("cuda")) is False  # a device with its own bf16 kernels


@pytest.mark.usefixtures("emulating")
def test_layers_under_flowrecs_autocast_match_torch_autocast_and_round_gradients_once() -> None:
    """nn.Linear (as attention, experts and custom modules use it), `@` and bmm under
    `autocast_bf16`: bf16 outputs within one bf16 rounding of torch's own autocast, fp32 weight
    gradients that are bf16 values (rounded once), close to float64."""
    gen = torch.Generator().manual_seed(11)
    torch.manual_seed(11)
    layer = nn.Linear(48, 32)
    x = _skewed(gen, 96, 48).requires_grad_()
    q = _skewed(gen, 96, 32)

    def forward() -> torch.Tensor:
        h = torch.relu(layer(x))  # (B, 32)
        s = h @ q.t()  # (B, B)
        return torch.bmm(h.unsqueeze(1), s[:, :32].unsqueeze(2)).squeeze()  # (B,)

    with lowp.autocast_bf16(CPU):
        got = forward()
    (got.float() * torch.linspace(0.5, 2, 96)).sum().backward()
    got_grads = [layer.weight.grad.clone(), layer.bias.grad.clone(), x.grad.clone()]
    layer.zero_grad()
    x.grad = None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = forward()
    (want.float() * torch.linspace(0.5, 2, 96)).sum().backward()
    want_grads = [layer.weight.grad, layer.bias.grad, x.grad]
    assert got.dtype == want.dtype == torch.bfloat16
    scale = float(want.float().abs().max())
    assert torch.allclose(got.float(), want.float(), rtol=5e-2, atol=2e-2 * scale)
    for g, w in zip(got_grads, want_grads):
        assert g.dtype == torch.float32
        s = float(w.abs().max())
        assert torch.allclose(g, w, rtol=5e-2, atol=3e-2 * s)
        assert not torch.allclose(g, w + 0.2 * s, rtol=5e-2, atol=3e-2 * s)  # the check can fail
    weight_grad = got_grads[0]
    assert torch.equal(weight_grad, _rounded(weight_grad))  # a bf16 value: rounded once, then widened


@pytest.mark.usefixtures("emulating")
@pytest.mark.parametrize("relu,bias,add", [(True, True, False), (False, True, False), (True, False, False),
                                           (False, True, True), (False, False, True)])
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
def test_flowrecs_fused_linear_emulates_bf16_in_one_rounding(relu: bool, bias: bool, add: bool,
                                                             x_dtype: torch.dtype, monkeypatch) -> None:
    """`operators.onednn.linear` in training under emulated bf16 (`_LowLinear`: oneDNN on the
    operands' bf16 values in fp32, the bias and ReLU inside the GEMM): the output is the float64
    product of the bf16 values rounded to bf16 once (within one bf16 step of that rounding: the
    fp32 sums' order), and equals the mode's own product (`lowp.product` through
    `nn.functional.linear`) within one bf16 rounding; every gradient likewise, each a bf16 value
    in its input's dtype. Inference and float64 keep the plain path."""
    from operators import onednn

    if not onednn.available():
        pytest.skip("oneDNN's linear is not usable in this torch")
    gen = torch.Generator().manual_seed(41)
    few = _skewed(gen, onednn.LOW_LINEAR_MIN_ROWS - 1, 70)
    with lowp.autocast_bf16(CPU):
        assert not onednn.emulates(few.requires_grad_(), torch.ones(40, 70))  # few rows: the mode's products
    monkeypatch.setattr(onednn, "LOW_LINEAR_MIN_ROWS", 300)
    x = _skewed(gen, 300, 70).to(x_dtype).requires_grad_()
    w = _skewed(gen, 40, 70).requires_grad_()
    b = _skewed(gen, 40).requires_grad_() if bias else None
    acc = _skewed(gen, 300, 40).bfloat16().requires_grad_() if add else None
    grad = _skewed(gen, 300, 40).bfloat16()
    leaves = [t for t in (x, w, b, acc) if t is not None]

    def run(fused: bool):
        with lowp.autocast_bf16(CPU):
            assert onednn.emulates(x, w)
            if fused:
                y = onednn.linear(x, w, b, relu=relu, add=acc)
            else:  # the mode's products, as before `_LowLinear`
                y = F.linear(x, w, b) if acc is None else (torch.addmm(acc, x, w.t()) if b is None
                                                             else torch.addmm(acc + b, x, w.t()))
                y = torch.relu(y) if relu else y
        return y, torch.autograd.grad(y, leaves, grad)

    got, got_grads = run(True)
    assert got.dtype == torch.bfloat16 and type(got.grad_fn).__name__ == "_LowLinearBackward"
    want, want_grads = run(False)
    x64, w64 = _rounded(x.detach().float()).double(), _rounded(w.detach()).double()
    exact = x64 @ w64.t()
    if b is not None:
        exact = exact + _rounded(b.detach()).double()
    if acc is not None:
        exact = exact + acc.detach().double()
    exact = exact.clamp_min(0) if relu else exact
    step = exact.abs() * 2 ** -7 + 1e-30  # one bf16 step at each value
    assert bool(((got.double() - exact).abs() <= step).all())
    summed = 0.0 if acc is None or b is None else (acc.detach().double().abs() + b.detach().double().abs()) * 2 ** -7
    assert bool(((got.double() - want.double()).abs() <= 2 * step + summed).all())  # the old path rounds acc + b first
    assert not bool(((got.double() + 0.05 * float(exact.abs().max()) - exact).abs() <= step).all())  # can fail
    for leaf, g, h in zip(leaves, got_grads, want_grads):
        assert g.dtype == leaf.dtype and torch.equal(g.float(), _rounded(g.float()))  # bf16 values
        s = float(h.abs().max())
        assert torch.allclose(g.float(), h.float(), rtol=2 ** -6, atol=2 ** -7 * s)
        assert not torch.allclose(g.float(), h.float() + 0.1 * s, rtol=2 ** -6, atol=2 ** -7 * s)
    mask = (exact > 0).double() if relu else torch.ones_like(exact)
    g64 = grad.double() * mask
    assert torch.allclose(got_grads[1].double(), g64.t() @ x64, rtol=2 ** -6, atol=2 ** -7 * float((g64.t() @ x64).abs().max()))
    with torch.no_grad(), lowp.autocast_bf16(CPU):
        assert not onednn.emulates(x, w)  # inference: the plain kernel (exported packages run it)
    with lowp.autocast_bf16(CPU):
        assert not onednn.emulates(x.detach().double(), w.detach().double())


@pytest.mark.usefixtures("emulating")
def test_attention_and_mode_leave_everything_else_alone() -> None:
    gen = torch.Generator().manual_seed(13)
    q, k, v = (_skewed(gen, 4, 2, 10, 8) for _ in range(3))
    mask = torch.rand(4, 1, 10, 10, generator=gen) > 0.3
    mask[..., 0] = True
    with lowp.autocast_bf16(CPU):
        got = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        soft = torch.softmax(q, -1)  # autocast's policy: softmax in fp32
        with torch.autocast("cpu", enabled=False):
            plain = q.flatten(0, 2) @ k.flatten(0, 2).t()  # fp32 code outside autocast stays fp32
        wide = q.double().flatten(0, 2) @ k.double().flatten(0, 2).t()  # float64 untouched
    want = F.scaled_dot_product_attention(_rounded(q), _rounded(k), _rounded(v), attn_mask=mask).bfloat16()
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert soft.dtype == torch.float32 and torch.equal(soft, torch.softmax(q, -1))
    assert plain.dtype == torch.float32 and torch.equal(plain, q.flatten(0, 2) @ k.flatten(0, 2).t())
    assert wide.dtype == torch.float64
    out = torch.empty(8, 8, dtype=torch.bfloat16)
    a, b = q[0, 0, :8].bfloat16(), k[0, 0, :8].bfloat16()
    with lowp.autocast_bf16(CPU):
        returned = torch.mm(a, b.t(), out=out)  # into the given tensor, as torch writes it
    assert returned.data_ptr() == out.data_ptr() and torch.allclose(out.float(), _rounded(a) @ _rounded(b).t(),
                                                                     rtol=2e-2, atol=2e-2)


@pytest.mark.usefixtures("emulating")
def test_the_mode_routes_each_product_kind(monkeypatch) -> None:
    """Under `autocast_bf16` each product kind reaches `product` once: nn.Linear, `@`, the
    `matmul` method, bmm, baddbmm, addmm, scaled dot-product attention; an elementwise op does not."""
    seen = []
    real = lowp.product

    def counted(func, *args, **kwargs):
        seen.append(func)
        return real(func, *args, **kwargs)

    monkeypatch.setattr(lowp, "product", counted)
    gen = torch.Generator().manual_seed(19)
    x, layer = _skewed(gen, 6, 4), nn.Linear(4, 3)
    with lowp.autocast_bf16(CPU):
        layer(x)
        _ = x @ x.t()
        x.matmul(x.t())
        torch.bmm(x[None], x.t()[None])
        torch.baddbmm(x[None, :, :1], x[None], x.t()[None, :, :1])
        torch.addmm(x[:, 0], x, x.t())
        F.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None])
        torch.exp(x)
    assert len(seen) == 7, seen
    assert seen[0] is F.linear and seen[3] is torch.bmm and seen[-1] is F.scaled_dot_product_attention


def test_without_emulation_flowrecs_autocast_is_torchs(monkeypatch) -> None:
    monkeypatch.setattr(lowp, "_EMULATED", False)
    gen = torch.Generator().manual_seed(17)
    a, b = _skewed(gen, 40, 24), _skewed(gen, 24, 16)
    with lowp.autocast_bf16(CPU):
        got = a @ b
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = a @ b
    assert torch.equal(got, want)


def test_a_bf16_training_run_matches_torchs_autocast(monkeypatch) -> None:
    """Steps of a small model with a Dot, target attention, a linear part and MLPs through
    `linear_sources` in bf16 (`train_step`): with the emulation forced on, every loss within bf16
    noise of torch's own autocast (forced off) from the same start, the dense parameters moved
    alike; and the emulation ran (at these small widths the two can agree bitwise: one fp32 sum
    order)."""
    import copy
    from dataclasses import replace

    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.step import make_dense_optimizer, train_step
    from flowrec.spec import spec_from_dict
    from flowrec.testing.specs import TINY

    modules = [m for m in TINY["modules"] if m["name"] != "t2"]  # one binary head
    spec = spec_from_dict({**TINY, "modules": modules, "heads": [{"name": "h1", "input": "final"}],
                           "training": {"batch_size": 128, "seed": 4, "precision": "bf16"}})
    plan = make_plan(spec, target="cpu")
    table = synth_table(spec, 128 * 4, SynthConfig(seed=4, alpha=1.2))
    opts = StagingOptions(batch_size=128, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        batches = list(it)
    assert len(batches) == 4
    start = lower(plan, spec, "cpu")
    runs, calls = {}, {}
    count = {"product": 0, "linear": 0, "dot": 0}

    def counted(kind, func):
        def call(*args, **kwargs):
            count[kind] += 1
            return func(*args, **kwargs)
        return call

    from operators import interaction, onednn

    monkeypatch.setattr(onednn, "LOW_LINEAR_MIN_ROWS", 1)  # this run's 128 rows take flowrec's fused linear
    monkeypatch.setattr(lowp, "product", counted("product", lowp.product))  # the mode's products
    monkeypatch.setattr(onednn._LowLinear, "apply", counted("linear", onednn._LowLinear.apply))  # MLP layers
    monkeypatch.setattr(interaction._TriuDot, "apply", counted("dot", interaction._TriuDot.apply))
    for on in (True, False):
        monkeypatch.setattr(lowp, "_EMULATED", on)
        count.update(product=0, linear=0, dot=0)
        model = copy.deepcopy(start)
        opt = make_dense_optimizer(model, "adam", 0.01, {})
        losses = [train_step(model, opt, b, precision="bf16") for b in batches]
        calls[on] = dict(count)
        runs[on] = (losses, {n: p.detach().clone() for n, p in model.named_parameters()})
    (got, got_params), (want, want_params) = runs[True], runs[False]
    for a, b in zip(got, want):
        assert abs(a - b) <= 0.03 * abs(b) + 1e-3, (got, want)
    moved = 0
    for name, p in want_params.items():
        before = dict(start.named_parameters())[name].detach()
        step = (p - before).abs().max()
        if step > 0:
            moved += 1
            assert float((got_params[name] - p).abs().max()) <= 0.5 * float(step) + 1e-4, name
    assert moved > 5
    # the emulation ran, only when on: the mode's products (attention, linear part), flowrec's fused
    # linear in every MLP layer and its fp32 Dot, each step
    assert calls[True]["product"] >= 4 * 2 and calls[True]["linear"] >= 4 * 3 and calls[True]["dot"] == 4, calls
    assert calls[False] == {"product": 0, "linear": 0, "dot": 0}, calls
