"""`operators.onednn.gemm_library`: which library runs the fp32 training GEMMs of `linear` and
`linear_sources` on this machine (oneDNN, or MKL through torch's `mm`/`addmm` on Intel's CPUs).
Each library, forced, equals the float64 reference (forward and every gradient) on fresh random
skewed inputs, and calls only its own kernels; the choice follows the CPU's vendor and the
environment, once per process."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from operators import onednn

pytestmark = pytest.mark.skipif(not onednn.available(), reason="oneDNN's linear is not usable in this torch")


def _skewed(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Heavy-tailed values with a few large rows (never zeros)."""
    x = torch.randn(*shape, generator=gen) * torch.rand(shape[0], 1, generator=gen).pow(4).mul(20).add(0.1)
    return x + 1e-3


class _Counted:
    """Counts the calls of oneDNN's linear ops (`_POINTWISE` and its `.binary`)."""

    def __init__(self) -> None:
        self.calls = 0
        real = onednn._POINTWISE

        def pointwise(*args):
            self.calls += 1
            return real(*args)

        def binary(*args):
            self.calls += 1
            return real.binary(*args)

        pointwise.binary = binary
        self.pointwise = pointwise


@pytest.fixture
def library(request, monkeypatch):
    """Forces `request.param` for the test and counts oneDNN's calls."""
    monkeypatch.setattr(onednn, "_LIBRARY", request.param)
    counted = _Counted()
    monkeypatch.setattr(onednn, "_POINTWISE", counted.pointwise)
    monkeypatch.setattr(onednn._MKLDNN, "_linear_pointwise", counted.pointwise, raising=False)
    return request.param, counted


def _check_grads(got, want) -> None:
    for g, r in zip(got, want):
        assert g.dtype == torch.float32
        assert torch.allclose(g.double(), r, atol=1e-5 * float(r.abs().max()), rtol=1e-4)


@pytest.mark.parametrize("library", ["onednn", "mkl"], indirect=True)
@pytest.mark.parametrize("form", ["relu", "bias", "add", "add_bias"])
def test_each_library_equals_the_reference(library, form: str) -> None:
    name, counted = library
    seed = int(np.random.default_rng().integers(1 << 30))
    gen = torch.Generator().manual_seed(seed)
    batch, fan_in, out = 300, 41, 23
    x = _skewed(gen, batch, fan_in).requires_grad_()
    w = (torch.randn(out, fan_in, generator=gen) * 0.3).requires_grad_()
    b = torch.randn(out, generator=gen).requires_grad_() if form != "add" else None
    add = _skewed(gen, batch, out).requires_grad_() if form.startswith("add") else None
    relu = form == "relu"
    leaves = [t for t in (x, w, b, add) if t is not None]
    y = onednn.linear(x, w, b, relu=relu, add=add)
    grad = _skewed(gen, batch, out)
    got = torch.autograd.grad(y, leaves, grad)
    ref = [t.detach().double().requires_grad_() for t in leaves]
    named = dict(zip([k for k, t in zip("xwba", (x, w, b, add)) if t is not None], ref))
    yr = nn.functional.linear(named["x"], named["w"], named.get("b"))
    yr = torch.relu(yr) if relu else (yr + named["a"] if add is not None else yr)
    if relu:
        assert (yr == 0).any() and (yr > 0).any()  # both sides of the ReLU are exercised
    assert torch.allclose(y.double(), yr, atol=1e-5 * float(yr.detach().abs().max()), rtol=1e-5)
    _check_grads(got, torch.autograd.grad(yr, ref, grad.double()))
    assert (counted.calls > 0) is (name == "onednn")  # each library runs its own kernels only


@pytest.mark.parametrize("library", ["onednn", "mkl"], indirect=True)
@pytest.mark.parametrize("permuted", [False, True])
def test_each_library_equals_the_reference_over_sources(library, permuted: bool) -> None:
    """`linear_sources`: one GEMM per source accumulated, the weight's gradient written per source."""
    name, counted = library
    seed = int(np.random.default_rng().integers(1 << 30))
    gen = torch.Generator().manual_seed(seed)
    widths, out, batch = (7, 12, 5), 17, 260
    flats = [_skewed(gen, batch, k).requires_grad_() for k in widths]
    w = (torch.randn(out, sum(widths), generator=gen) * 0.3).requires_grad_()
    b = torch.randn(out, generator=gen).requires_grad_()
    inverse = torch.randperm(sum(widths), generator=gen) if permuted else None
    y = onednn.linear_sources(flats, w, b, inverse)
    assert y is not None
    grad = _skewed(gen, batch, out)
    got = torch.autograd.grad(y, [*flats, w, b], grad)
    ref = [t.detach().double().requires_grad_() for t in (*flats, w, b)]
    wr = ref[-2] if inverse is None else ref[-2][:, inverse]
    yr = nn.functional.linear(torch.cat(ref[:-2], 1), wr, ref[-1])
    assert torch.allclose(y.double(), yr, atol=1e-5 * float(yr.detach().abs().max()), rtol=1e-5)
    _check_grads(got, torch.autograd.grad(yr, ref, grad.double()))
    assert (counted.calls > 0) is (name == "onednn")


@pytest.mark.parametrize("vendor, chosen", [("GenuineIntel", "mkl"), ("AuthenticAMD", "onednn"),
                                            ("HygonGenuine", "onednn"), ("", "onednn")])
def test_the_choice_follows_the_cpu_vendor_once_per_process(monkeypatch, vendor: str, chosen: str) -> None:
    monkeypatch.delenv(onednn.GEMM_LIBRARY_ENV, raising=False)
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    monkeypatch.setattr(onednn, "cpu_vendor", lambda: vendor)
    assert onednn.gemm_library() == chosen
    other = "AuthenticAMD" if vendor == "GenuineIntel" else "GenuineIntel"
    monkeypatch.setattr(onednn, "cpu_vendor", lambda: other)
    assert onednn.gemm_library() == chosen  # fixed: a run computes alike throughout


@pytest.mark.parametrize("asked", ["onednn", "mkl", " MKL ", "auto"])
def test_the_environment_overrides_the_choice(monkeypatch, asked: str) -> None:
    monkeypatch.setenv(onednn.GEMM_LIBRARY_ENV, asked)
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    monkeypatch.setattr(onednn, "cpu_vendor", lambda: "AuthenticAMD")
    want = asked.strip().lower()
    assert onednn.gemm_library() == ("onednn" if want == "auto" else want)


def test_an_unknown_library_is_refused_in_one_line(monkeypatch) -> None:
    monkeypatch.setenv(onednn.GEMM_LIBRARY_ENV, "openblas")
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    with pytest.raises(ValueError, match="FLOWREC_CPU_GEMM='openblas'") as err:
        onednn.gemm_library()
    assert "\n" not in str(err.value)
    assert onednn._LIBRARY is None  # nothing decided: a corrected environment is read next time


def test_the_vendor_is_read_from_proc_cpuinfo(tmp_path, monkeypatch) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    real_open = open
    monkeypatch.setattr("builtins.open", lambda path, *a, **k: real_open(info if path == "/proc/cpuinfo" else path, *a, **k))
    assert onednn.cpu_vendor() == "AuthenticAMD"
    info.unlink()
    assert onednn.cpu_vendor() == ""  # unreadable: oneDNN, as before the choice existed


def test_doctor_reports_the_choice_and_an_invalid_environment(monkeypatch) -> None:
    from flowrec.measure.doctor import cpu_gemm

    monkeypatch.setattr(onednn, "_LIBRARY", None)
    monkeypatch.setattr(onednn, "cpu_vendor", lambda: "GenuineIntel")
    monkeypatch.delenv(onednn.GEMM_LIBRARY_ENV, raising=False)
    assert cpu_gemm() == {"vendor": "GenuineIntel", "gemm": "mkl"}
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    monkeypatch.setenv(onednn.GEMM_LIBRARY_ENV, "blis")
    got = cpu_gemm()
    assert got["gemm"].startswith("invalid (") and "blis" in got["gemm"]


def test_train_refuses_an_unknown_library_in_one_line_before_writing(monkeypatch, tmp_path) -> None:
    from typer.testing import CliRunner

    from flowrec.cli import app

    monkeypatch.setenv(onednn.GEMM_LIBRARY_ENV, "blis")
    monkeypatch.setattr(onednn, "_LIBRARY", None)
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["train", str(Path(__file__).resolve().parents[2] / "specs" / "movielens.yaml"), "--max-steps", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "FLOWREC_CPU_GEMM='blis'" in result.output
    assert not out.exists()  # nothing written


def test_sources_accumulate_in_place_bitwise_as_the_addmm_chain(monkeypatch) -> None:
    """Under MKL, `linear_sources` adds each source's product into its own output (`addmm_`)
    instead of `addmm` into a fresh copy: bitwise the same chain, one (B, Out) copy fewer a source."""
    monkeypatch.setattr(onednn, "_LIBRARY", "mkl")
    gen = torch.Generator().manual_seed(int(np.random.default_rng().integers(1 << 30)))
    widths, out, batch = (33, 7, 120, 64), 96, 513
    flats = [_skewed(gen, batch, k) for k in widths]
    w = torch.randn(out, sum(widths), generator=gen) * 0.3
    b = torch.randn(out, generator=gen)
    inverse = torch.randperm(sum(widths), generator=gen)
    copies = []
    real_addmm = torch.addmm

    def addmm(*args, **kwargs):
        copies.append(args[0].shape)
        return real_addmm(*args, **kwargs)

    monkeypatch.setattr(torch, "addmm", addmm)
    y = onednn.linear_sources([f.requires_grad_() for f in flats], w.requires_grad_(), b, inverse)
    monkeypatch.setattr(torch, "addmm", real_addmm)
    assert copies == [torch.Size([out])]  # the bias only: no source's sum went through a fresh copy
    parts, start = [], 0
    for k in widths:
        parts.append(w.detach().index_select(1, inverse[start:start + k]))
        start += k
    want = torch.addmm(b, flats[0].detach(), parts[0].t())
    for x, p in zip(flats[1:], parts[1:]):
        want = torch.addmm(want, x.detach(), p.t())
    assert torch.equal(y.detach(), want)
