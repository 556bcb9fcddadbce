"""`operators.onednn.linear` (oneDNN GEMMs on the CPU) equals nn.Linear (+ ReLU): forward and every
gradient, on fresh random skewed inputs; the MLP that uses it equals a plain nn.Linear stack."""
from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
from torch import nn

from operators import onednn
from operators.dense import MLP
from operators.lowp import autocast_bf16


def _skewed(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Heavy-tailed values with a few large rows (never zeros)."""
    x = torch.randn(*shape, generator=gen) * torch.rand(shape[0], 1, generator=gen).pow(4).mul(20).add(0.1)
    return x + 1e-3


def _reference(x, w, b, relu):
    y = nn.functional.linear(x, w, b)
    return torch.relu(y) if relu else y


@pytest.mark.parametrize("weight_grads", ["onednn", "mm", "by_shape"])
@pytest.mark.parametrize("relu", [True, False])
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("seed", [0, 1])
def test_linear_equals_reference_fp32(relu: bool, bias: bool, seed: int, weight_grads: str, monkeypatch) -> None:
    """Every weight-gradient path (oneDNN with a transposed copy, torch's mm, the choice by shape
    of a CPU with half-width AVX-512: `_weight_grad`); seed 0's layer is narrow (oneDNN by shape),
    seed 1's mid-size (mm by shape)."""
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_ONEDNN", weight_grads != "mm")
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_SHAPE", weight_grads == "by_shape")
    gen = torch.Generator().manual_seed(seed)
    batch, fan_in, out = 257 + seed * 64, 37 + seed * 13, 9 + seed * 17
    if weight_grads == "by_shape":  # the two seeds take the two paths
        assert onednn.mm_weight_grad(out, fan_in) is (seed == 1)
    x = _skewed(gen, batch, fan_in).requires_grad_()
    w = (torch.randn(out, fan_in, generator=gen) * 0.3).requires_grad_()
    b = torch.randn(out, generator=gen).requires_grad_() if bias else None
    assert onednn.takes(x, w) == onednn.available()
    y = onednn.linear(x, w, b, relu)
    grad = _skewed(gen, batch, out)
    got = torch.autograd.grad(y, [t for t in (x, w, b) if t is not None], grad)
    ref_in = [t.detach().double().requires_grad_() for t in (x, w, b) if t is not None]
    xr, wr, br = ref_in[0], ref_in[1], ref_in[2] if bias else None
    yr = _reference(xr, wr, br, relu)
    want = torch.autograd.grad(yr, ref_in, grad.double())
    if relu:
        assert (yr == 0).any() and (yr > 0).any()  # both sides of the ReLU are exercised
    scale = yr.detach().abs().max()
    assert torch.allclose(y.double(), yr, atol=1e-5 * float(scale), rtol=1e-5)
    for g, r in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.allclose(g.double(), r, atol=1e-5 * float(r.detach().abs().max()), rtol=1e-4)


@pytest.mark.parametrize("capability, by_onednn", [("AVX512", True), ("AVX512_BF16", True), ("AVX2", False),
                                                   ("DEFAULT", False)])
def test_weight_gradients_take_onednn_only_with_avx512(monkeypatch, capability: str, by_onednn: bool) -> None:
    """Below AVX-512 MKL runs the same instructions as oneDNN and reads transposed operands in
    place, so the weight gradient skips oneDNN's transposed copy; decided once per process."""
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_ONEDNN", None)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert onednn._onednn_weight_grads() is by_onednn
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2" if by_onednn else "AVX512")
    assert onednn._onednn_weight_grads() is by_onednn  # fixed: a run computes alike throughout


@pytest.mark.parametrize("vendor, family, by_shape", [("AuthenticAMD", 25, True), ("AuthenticAMD", 26, False),
                                                      ("AuthenticAMD", 23, False), ("GenuineIntel", 25, False),
                                                      ("", -1, False)])
def test_weight_gradients_choose_by_shape_only_where_avx512_runs_half_width(monkeypatch, vendor, family,
                                                                             by_shape) -> None:
    """AMD's family 25 (Zen 4) runs AVX-512 on 256-bit units: its mid-size weight gradients take
    torch's mm (`mm_weight_grad`); Zen 5 (26), other vendors and an unreadable cpuinfo keep the
    machine's one path; decided once per process."""
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_SHAPE", None)
    monkeypatch.setattr(onednn, "cpu_vendor", lambda: vendor)
    monkeypatch.setattr(onednn, "cpu_family", lambda: family)
    assert onednn._shape_weight_grads() is by_shape
    monkeypatch.setattr(onednn, "cpu_family", lambda: 25 if not by_shape else 26)
    assert onednn._shape_weight_grads() is by_shape  # fixed: a run computes alike throughout


def test_weight_gradient_paths_by_shape_on_a_half_width_cpu(monkeypatch) -> None:
    """On such a CPU a mid-size layer's weight gradient is torch's mm, a narrow or a huge one
    oneDNN's, each equal to the plain product (float64 reference) on fresh skewed inputs."""
    if not onednn.available():
        pytest.skip("oneDNN is not available in this torch build")
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_ONEDNN", True)
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_SHAPE", True)
    monkeypatch.setattr(onednn, "gemm_library", lambda: "onednn")
    gen = torch.Generator().manual_seed(7)
    calls = []
    real_mm = torch.mm
    monkeypatch.setattr(torch, "mm", lambda a, b: calls.append(tuple(a.shape)) or real_mm(a, b))
    for out, fan_in, by_mm in ((64, 48, True), (40, 9, False), (600, 1000, False)):
        grad, x = _skewed(gen, 300, out), _skewed(gen, 300, fan_in)
        calls.clear()
        got = onednn._weight_grad(grad, x)
        assert bool(calls) is by_mm
        want = grad.double().t() @ x.double()
        assert torch.allclose(got.double(), want, atol=1e-5 * float(want.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("weight_grads", ["onednn", "mm"])
@pytest.mark.parametrize("out,fan_in", [(8, 1), (1, 8), (8, 3), (3, 8)], ids=["one_input", "one_output", "wide",
                                                                            "narrow"])
def test_weight_gradients_have_the_weights_strides(weight_grads: str, out: int, fan_in: int, monkeypatch) -> None:
    # a layer of one input got an (8, 1) weight gradient with strides (1, 8) from oneDNN's transposed
    # product: autograd kept it, and DDP warned "Grad strides do not match bucket view strides" on each rank
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_ONEDNN", weight_grads == "onednn")
    monkeypatch.setattr(onednn, "_WEIGHT_GRADS_BY_SHAPE", False)
    monkeypatch.setattr(onednn, "gemm_library", lambda: "onednn")
    gen = torch.Generator().manual_seed(3)
    x = _skewed(gen, 64, fan_in)
    w = (torch.randn(out, fan_in, generator=gen) * 0.3).requires_grad_()
    grad = _skewed(gen, 64, out)
    onednn.linear(x, w, None, relu=True).backward(grad)
    assert w.grad.stride() == w.stride()
    wr = w.detach().double().requires_grad_()
    torch.relu(nn.functional.linear(x.double(), wr)).backward(grad.double())
    assert torch.allclose(w.grad.double(), wr.grad, atol=1e-5 * float(wr.grad.abs().max()), rtol=1e-4)


def test_linear_float64_is_plain_linear_bitwise() -> None:
    """Float64 (no oneDNN kernel) takes nn.functional.linear: bitwise the plain layer, gradients too."""
    gen = torch.Generator().manual_seed(3)
    x = _skewed(gen, 50, 9).double().requires_grad_()
    w = torch.randn(6, 9, generator=gen, dtype=torch.float64, requires_grad=True)
    b = torch.randn(6, generator=gen, dtype=torch.float64, requires_grad=True)
    assert not onednn.takes(x, w)
    y = onednn.linear(x, w, b, relu=True)
    yr = torch.relu(nn.functional.linear(x, w, b))
    assert torch.equal(y, yr)
    g = torch.randn(50, 6, generator=gen, dtype=torch.float64)
    for a, c in zip(torch.autograd.grad(y, (x, w, b), g), torch.autograd.grad(yr, (x, w, b), g)):
        assert torch.equal(a, c)


def test_strided_weight_view_and_no_input_grad() -> None:
    """A column slice of a larger weight (as `MLP.forward_sources` passes) and an input without a
    gradient: the right columns get gradients, the others none, and x gets none."""
    gen = torch.Generator().manual_seed(5)
    full = torch.randn(11, 30, generator=gen, requires_grad=True)
    x = _skewed(gen, 64, 17)
    y = onednn.linear(x, full[:, 4:21], None)
    grad = _skewed(gen, 64, 11)
    y.backward(grad)
    ref = full.detach()[:, 4:21].double()
    assert torch.allclose(y.double(), x.double() @ ref.t(), rtol=1e-5, atol=1e-4)
    assert torch.allclose(full.grad[:, 4:21].double(), grad.double().t() @ x.double(), rtol=1e-5, atol=1e-3)
    assert torch.count_nonzero(full.grad[:, :4]) == 0 and torch.count_nonzero(full.grad[:, 21:]) == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_mlp_equals_plain_linear_stack(dtype: torch.dtype) -> None:
    """The DLRM-shaped MLP (fused linear + ReLU per layer) against nn.Linear + ReLU layers with the
    same weights: logits and every parameter gradient (fp32 allclose, fp64 1e-12)."""
    gen = torch.Generator().manual_seed(7)
    torch.manual_seed(11)
    mlp = MLP(13, [64, 32, 8]).to(dtype)
    plain = nn.Sequential(*[m for layer in mlp.layers for m in (nn.Linear(layer.in_features, layer.out_features),
                                                                  nn.ReLU())]).to(dtype)
    with torch.no_grad():
        for layer, ref in zip(mlp.layers, plain[::2]):
            ref.weight.copy_(layer.weight)
            ref.bias.copy_(layer.bias)
    x = _skewed(gen, 513, 13).to(dtype)
    y, yr = mlp(x), plain(x)
    grad = _skewed(gen, 513, 8).to(dtype)
    y.backward(grad)
    yr.backward(grad)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-4)
    assert torch.allclose(y, yr, **tol)
    for layer, ref in zip(mlp.layers, plain[::2]):
        assert torch.allclose(layer.weight.grad, ref.weight.grad, **tol)
        assert torch.allclose(layer.bias.grad, ref.bias.grad, **tol)


def test_small_cpu_optimizer_steps_on_one_thread_bitwise() -> None:
    """`make_dense_optimizer` on a small CPU model: its steps run with one thread and restore the
    count after, and the parameters are bitwise those of the same optimizer stepping on all threads."""
    from flowrec.runtime import step as step_mod

    gen = torch.Generator().manual_seed(13)
    params = [torch.nn.Parameter(_skewed(gen, 64, 33)) for _ in range(3)]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]

    class _Model:
        def __init__(self, ps):
            self.ps = ps

        def dense_parameters(self):
            return self.ps

    threads = torch.get_num_threads()
    seen: list[int] = []
    opt = step_mod.make_dense_optimizer(_Model(params), "adam", 1e-2, {})
    opt.register_step_pre_hook(lambda *a: seen.append(torch.get_num_threads()))
    plain = torch.optim.Adam(twins, lr=1e-2, fused=True)
    for _ in range(3):
        grads = [_skewed(gen, 64, 33) for _ in params]
        for p, q, g in zip(params, twins, grads):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        plain.step()
        assert torch.get_num_threads() == threads
    assert seen == [1, 1, 1]
    for p, q in zip(params, twins):
        assert torch.equal(p, q)
        assert not torch.equal(p, q.detach() + 1)  # equality is informative



@pytest.fixture(params=[False, True], ids=["bf16-kernels", "bf16-emulated"])
def emulated(request, monkeypatch) -> bool:
    """Both bf16 worlds on any CPU: with bf16 kernels (torch's own bf16 products) and without
    (`operators.lowp` emulates them: fp32 products of bf16 values), by patching the probe."""
    from operators import lowp

    monkeypatch.setattr(lowp, "_EMULATED", request.param)
    monkeypatch.setattr(onednn, "LOW_LINEAR_MIN_ROWS", 1)  # these few rows take the fused path too
    return request.param


@pytest.mark.parametrize("fields_count", [1, 2, 26])
def test_dot_under_cpu_autocast_equals_autocast_ops(fields_count: int, emulated: bool) -> None:
    """DLRM's Dot under CPU bf16 autocast: bitwise the values of autocast's own bmm + upper-triangle
    gather, close to the float64 pairs, and field gradients close to autograd of those plain ops
    (one bf16 rounding of (G + G^T) x where autograd rounds G x and G^T x, then their sum). Where
    bf16 is emulated, the Dot's fp32 path (`_TriuDot` on the widened fields, rounded once) is bitwise the mode's products too."""
    from operators import interaction
    from operators.interaction import Dot

    gen = torch.Generator().manual_seed(19)
    bottom = _skewed(gen, 200, 16).requires_grad_()
    scale = torch.rand(200, fields_count, 1, generator=gen).pow(3) * 4
    fields = (torch.randn(200, fields_count, 16, generator=gen) * scale + 1e-3).requires_grad_()
    num = fields_count + 1
    rows, cols = torch.triu_indices(num, num, offset=1)
    wide = []
    apply = interaction._TriuDot.apply
    interaction._TriuDot.apply = lambda *a: wide.append(1) or apply(*a)
    try:
        with autocast_bf16(torch.device("cpu")):  # flowrec's autocast (`operators.lowp`)
            out = Dot()(bottom, fields)
            x = torch.cat([bottom.unsqueeze(1), fields], 1)
            plain = torch.bmm(x, x.transpose(1, 2))[:, rows, cols]
    finally:
        interaction._TriuDot.apply = apply
    assert len(wide) == int(emulated)  # the fp32 path exactly where bf16 is emulated
    assert out.dtype == plain.dtype == torch.bfloat16 and out.shape == (200, num * (num - 1) // 2)
    assert torch.equal(out, plain)
    exact = torch.cat([bottom.detach().double().unsqueeze(1), fields.detach().double()], 1)
    exact = torch.bmm(exact, exact.transpose(1, 2))[:, rows, cols]
    assert torch.allclose(out.double(), exact, rtol=1e-2, atol=1e-2 * float(exact.abs().max()))
    grad = _skewed(gen, 200, out.shape[1]).bfloat16()
    got = torch.autograd.grad(out, (bottom, fields), grad)
    want = torch.autograd.grad(plain, (bottom, fields), grad)
    for g, w in zip(got, want):
        assert g.dtype == torch.float32
        scale = float(w.abs().max())
        assert torch.allclose(g, w, rtol=2e-2, atol=2e-2 * scale)
        assert not torch.allclose(g, w + 0.1 * scale, rtol=2e-2, atol=2e-2 * scale)  # the check can fail


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_linear_add_and_column_slices(dtype: torch.dtype) -> None:
    """`linear(x, w_slice, add=acc)` (a source MLP's accumulation) equals acc + x w_slice^T: value
    and every gradient (the full weight's, the accumulator's, x's)."""
    gen = torch.Generator().manual_seed(23)
    full = torch.randn(12, 50, generator=gen, dtype=dtype, requires_grad=True)
    x1, x2 = _skewed(gen, 90, 20).to(dtype).requires_grad_(), _skewed(gen, 90, 30).to(dtype).requires_grad_()
    b = torch.randn(12, generator=gen, dtype=dtype, requires_grad=True)
    y = onednn.linear(x2, full[:, 20:], add=onednn.linear(x1, full[:, :20], b))
    yr = torch.addmm(torch.addmm(b, x1, full[:, :20].t()), x2, full[:, 20:].t())
    grad = _skewed(gen, 90, 12).to(dtype)
    got = torch.autograd.grad(y, (full, x1, x2, b), grad)
    want = torch.autograd.grad(yr, (full, x1, x2, b), grad)
    tol = dict(rtol=1e-12, atol=1e-12) if dtype == torch.float64 else dict(rtol=1e-4, atol=1e-3)
    assert torch.allclose(y, yr, **tol)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, **tol)
    with pytest.raises(ValueError):
        onednn.linear(x1, full[:, :20], relu=True, add=y)


@pytest.mark.parametrize("fused", ["as_probed", "separate"])
def test_a_nan_row_stays_nan_through_a_relu_layer_as_in_torch(fused: str, monkeypatch) -> None:
    """oneDNN's ReLU fused into the GEMM gave 0 for NaN on an AMD EPYC: the NaN rows a module
    returned became zero rows, the loss stayed finite and a run stopped steps later on a weight,
    never naming the module. Through oneDNN (forced, on any CPU) NaN rows stay NaN forward and the
    gradients are torch's: NaN where torch's are, the same values elsewhere."""
    if not onednn.available():
        pytest.skip("oneDNN's linear is not usable in this torch")
    monkeypatch.setattr(onednn, "_LIBRARY", "onednn")
    if fused == "separate":
        monkeypatch.setattr(onednn, "_RELU_KEEPS_NAN", False)
    gen = torch.Generator().manual_seed(5)
    x, w, b = _skewed(gen, 96, 23), _skewed(gen, 17, 23), _skewed(gen, 17, 1).flatten()
    bad = torch.randperm(96, generator=gen)[:7]
    x[bad, torch.randint(0, 23, (7,), generator=gen)] = float("nan")
    xs, ws, bs = (t.clone().requires_grad_(True) for t in (x, w, b))
    xr, wr, br = (t.clone().requires_grad_(True) for t in (x, w, b))
    y, ref = onednn.linear(xs, ws, bs, relu=True), _reference(xr, wr, br, True)
    assert torch.equal(torch.isnan(y), torch.isnan(ref)) and bool(torch.isnan(y[bad]).all())
    good = torch.ones(96, dtype=torch.bool)
    good[bad] = False
    torch.testing.assert_close(y[good], ref[good], rtol=1e-5, atol=1e-5)
    grad = _skewed(gen, 96, 17)
    y.backward(grad)
    ref.backward(grad)
    for got, want in ((xs.grad, xr.grad), (ws.grad, wr.grad), (bs.grad, br.grad)):
        assert torch.equal(torch.isnan(got), torch.isnan(want))
        torch.testing.assert_close(torch.nan_to_num(got), torch.nan_to_num(want), rtol=1e-4, atol=1e-4)


def test_a_onednn_that_fails_its_probe_takes_the_plain_path(monkeypatch) -> None:
    """Where torch's internal oneDNN op is missing, raises or disagrees on this CPU, `linear`
    runs nn.functional.linear (probed once, at first use), with the same results."""
    from operators import onednn

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(33, 17, generator=gen).pow(3)  # skewed
    w, b = torch.randn(9, 17, generator=gen), torch.randn(9, generator=gen)
    want = torch.relu(torch.nn.functional.linear(x, w, b))
    for broken in ("raises", "disagrees", "missing"):
        def raising(*a, **k):
            raise RuntimeError("no oneDNN kernel here")

        def wrong(x, w, b, *rest):
            return torch.zeros(x.shape[0], w.shape[0])

        monkeypatch.setattr(onednn, "_AVAILABLE", None)
        monkeypatch.setattr(onednn, "_POINTWISE", {"raises": raising, "disagrees": wrong, "missing": None}[broken])
        assert onednn.available() is False, broken
        assert not onednn.takes(x, w)
        assert torch.equal(onednn.linear(x, w, b, relu=True), want), broken
    monkeypatch.setattr(onednn, "_AVAILABLE", None)
    monkeypatch.undo()
    onednn._AVAILABLE = None
    assert onednn.available() is (onednn._POINTWISE is not None and torch.backends.mkldnn.is_available())


def test_inference_takes_the_plain_kernel_an_exported_package_runs() -> None:
    """Under no_grad (evaluation, scoring) `linear` is nn.functional.linear bitwise, the kernel a
    torch.export package runs, so eval and predict agree exactly; with grad it is oneDNN (not
    bitwise the plain kernel on this CPU, allclose)."""
    from operators import onednn

    gen = torch.Generator().manual_seed(5)
    x = _skewed(gen, 257, 96)
    w, b = _skewed(gen, 48, 96), _skewed(gen, 48, 1).reshape(-1)
    plain = torch.relu(torch.nn.functional.linear(x, w, b))
    with torch.no_grad():
        assert not onednn.takes(x, w)
        assert torch.equal(onednn.linear(x, w, b, relu=True), plain)
    wg = w.clone().requires_grad_(True)
    assert onednn.takes(x, wg) is onednn.available()
    assert torch.allclose(onednn.linear(x, wg, b, relu=True), plain, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("permuted", [True, False])
@pytest.mark.parametrize("autocast", [False, True])
def test_linear_sources_equals_the_per_source_chain(permuted: bool, autocast: bool, emulated: bool) -> None:
    """`linear_sources` (a source MLP's first layer as one node) against the per-source `linear`
    chain over column slices of the permuted weight that it replaces: bitwise the same output and
    gradients (weight, bias, each source; a source without a gradient gets none), fp32 through
    oneDNN and under bf16 autocast; and close to the float64 product with the permuted columns."""
    gen = torch.Generator().manual_seed(29)
    weight = torch.randn(7, 20, generator=gen, requires_grad=True)
    bias = torch.randn(7, generator=gen, requires_grad=True)
    perm = torch.randperm(20, generator=gen)
    inverse = torch.empty_like(perm)
    inverse[perm] = torch.arange(20)
    inverse = inverse if permuted else None
    flats = [_skewed(gen, 50, 3).requires_grad_(), _skewed(gen, 50, 12).requires_grad_(), _skewed(gen, 50, 5)]

    def chain() -> torch.Tensor:
        w = weight if inverse is None else weight.index_select(1, inverse)
        y, start = None, 0
        for f in flats:
            part = w[:, start:start + f.shape[1]]
            start += f.shape[1]
            y = onednn.linear(f, part, bias) if y is None else onednn.linear(f, part, add=y)
        return y

    with autocast_bf16(torch.device("cpu")) if autocast else nullcontext():  # flowrec's autocast
        got, want = onednn.linear_sources(flats, weight, bias, inverse), chain()
    assert got.dtype == want.dtype == (torch.bfloat16 if autocast else torch.float32)
    assert got.grad_fn.wide is (autocast and emulated)  # the widened oneDNN path exactly where bf16 is emulated
    assert torch.equal(got, want)
    cols = perm if permuted else torch.arange(20)
    exact = torch.cat(flats, 1).detach().double()[:, cols] @ weight.detach().double().t() + bias.detach().double()
    assert torch.allclose(got.double(), exact, rtol=2e-2 if autocast else 1e-5, atol=1e-2 * float(exact.abs().max()))
    grad = _skewed(gen, 50, 7).to(got.dtype)
    leaves = [weight, bias, flats[0], flats[1]]
    for g, w in zip(torch.autograd.grad(got, leaves, grad), torch.autograd.grad(want, leaves, grad)):
        assert g.dtype == torch.float32 and torch.equal(g, w) and torch.count_nonzero(w) > 0


def test_linear_sources_declines_what_it_does_not_cover() -> None:
    """float64, no grad, and widths that do not add up to the weight's columns take the caller's
    per-source chain (None)."""
    gen = torch.Generator().manual_seed(31)
    weight = torch.randn(4, 9, generator=gen)
    flats = [_skewed(gen, 8, 4), _skewed(gen, 8, 5)]
    assert onednn.linear_sources(flats, weight, None, None) is not None
    assert onednn.linear_sources([f.double() for f in flats], weight.double(), None, None) is None
    assert onednn.linear_sources(flats[:1], weight, None, None) is None
    with torch.no_grad():
        assert onednn.linear_sources(flats, weight, None, None) is None


def test_an_mlp_exports_with_a_dynamic_batch() -> None:
    """`linear`'s path choice reads no row count in traced code: an MLP exports with a symbolic
    batch (a comparison of the batch with a constant would constrain it), and the package scores
    another batch size like the eager layers."""
    from torch.export import Dim, export

    gen = torch.Generator().manual_seed(37)
    torch.manual_seed(37)
    mlp = MLP(12, [16, 8])
    with torch.no_grad():
        program = export(mlp, (_skewed(gen, 64, 12),), dynamic_shapes={"x": {0: Dim("batch", min=2)}})
        x = _skewed(gen, 1500, 12)
        assert torch.allclose(program.module()(x), mlp(x), rtol=1e-5, atol=1e-5)
    with torch.enable_grad():
        program = export(mlp, (_skewed(gen, 64, 12),), dynamic_shapes={"x": {0: Dim("batch", min=2)}})
        assert program.module()(x).shape == (1500, 8)


def test_torch_gemms_runs_torch_s_gemm_and_restores_the_choice(monkeypatch) -> None:
    """Within `torch_gemms` an fp32 layer is torch's `addmm` (+ ReLU) bitwise, what traced code
    runs; the machine's choice comes back after it, also after an error."""
    monkeypatch.setattr(onednn, "_LIBRARY", "onednn")
    gen = torch.Generator().manual_seed(11)
    x, w, b = _skewed(gen, 300, 40), _skewed(gen, 24, 40), _skewed(gen, 24, 1).flatten()
    with onednn.torch_gemms():
        assert onednn.gemm_library() == "mkl"
        got = onednn.linear(x.clone().requires_grad_(True), w, b, relu=True)
    assert torch.equal(got, torch.relu(torch.addmm(b, x, w.t())))
    assert onednn.gemm_library() == "onednn"
    with pytest.raises(KeyError), onednn.torch_gemms():
        raise KeyError("inside")
    assert onednn.gemm_library() == "onednn"
