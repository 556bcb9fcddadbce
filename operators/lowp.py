"""bf16 matrix products on a CPU without bf16 matrix kernels, at fp32 speed.

Where oneDNN has no bf16 kernels (an AVX2-only CPU: `operators.device.bf16_native` is False),
torch's bf16 `mm`, `bmm`, `addmm` and `linear` fall back to oneDNN's reference kernels: the DLRM
step took 3.3 s in bf16 against 122 ms in fp32 on an AVX2 EPYC (Round 6 in
docs/benchmarks/training-rounds-3-10.md).
Those kernels widen each bf16 operand to fp32, accumulate in fp32 and round the result to bf16
once. This module runs that arithmetic through the fp32 kernels: every operand rounded to bf16 (as
autocast casts it) and widened to fp32 (exact), the fp32 product, the result rounded to bf16. The
values are those of the emulated bf16 product up to the order of the fp32 sums (allclose within a
bf16 rounding, not bitwise), at the speed of an fp32 product plus the casts.

Gradients go through autograd of the same casts: each gradient product runs in fp32 on bf16
values and is rounded to bf16 once, as autocast's bf16 backward rounds it; a weight's gradient
reaches the fp32 weight as those bf16 values, as under autocast.

* `emulated(device)`: whether this applies (a CPU without bf16 kernels; never on CUDA).
* `product(func, *args, **kwargs)`: one matrix product of torch in this arithmetic.
* `matmul(func, *args, **kwargs)`: `product` where the product would run in bf16 on such a CPU,
  else `func` itself (flowrec's own autograd functions call it; so does the mode below).
* `widened(t)`, `emulating_autocast(device)`: the operand rounding, and whether flowrec's own
  operators take their emulated paths (the fused linear of `operators.onednn` on widened
  operands: bias and ReLU inside the fp32 GEMM, one rounding of each result and gradient).
* `autocast_bf16(device)`: CPU bf16 autocast with `RoundedProducts`, a torch function mode that
  sends the matrix products autocast would run in bf16 (`linear`, `mm`, `addmm`, `bmm`,
  `baddbmm`, `matmul`, `@`, scaled dot-product attention) to `product`; every other op keeps
  autocast's own policy (fp32 losses and softmaxes, bf16 elementwise ops on bf16 inputs).

Example:
    >>> a, b = torch.randn(4, 3), torch.randn(3, 2)
    >>> want = (a.bfloat16().float() @ b.bfloat16().float()).bfloat16()
    >>> torch.equal(product(torch.mm, a, b), want)
    True
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch.overrides import TorchFunctionMode

from operators.device import bf16_native

_CPU = torch.device("cpu")
# The CPU's answer, probed once per process, at import: never inside a trace, where the probe (an
# operator of torch's, `operators.device.bf16_native`) would be recorded into the program
# (`flowrec export` of a model with a Dot, in a process that had not probed yet, wrote a model.pt2
# calling `mkldnn._is_mkldnn_bf16_supported`, which `flowrec predict` refuses).
_EMULATED: bool = not bf16_native(_CPU)


def emulated(device: torch.device) -> bool:
    """Whether bf16 matrix products on `device` run here in fp32 (a CPU without bf16 kernels).
    Decided once per process, so a run and its resume compute alike."""
    return device.type == "cpu" and _EMULATED


def widened(t: torch.Tensor) -> torch.Tensor:
    """An fp32 or bf16 tensor as its bf16 values in fp32: rounded to bf16 (as autocast casts it),
    then widened (exact).  # t's shape, fp32"""
    return (t if t.dtype == torch.bfloat16 else t.to(torch.bfloat16)).float()


def _widened(value: Any) -> Any:
    """`widened` for an fp32 or bf16 tensor; anything else unchanged."""
    if isinstance(value, torch.Tensor) and value.dtype in (torch.float32, torch.bfloat16):
        return widened(value)
    return value


def emulating_autocast(device: torch.device) -> bool:
    """Whether code on `device` runs under CPU bf16 autocast here with bf16 `emulated`: flowrec's
    own operators then run their products as fp32 products of bf16 values themselves (the fused
    oneDNN linear and the Dot's fp32 gather on widened operands, `operators.onednn`,
    `operators.interaction`), each result rounded to bf16 where autocast's product rounds it."""
    return (device.type == "cpu" and torch.is_autocast_enabled("cpu")
            and torch.get_autocast_dtype("cpu") == torch.bfloat16 and emulated(device))


def product(func: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """`func(*args, **kwargs)` (a matrix product) on the operands' bf16 values in fp32, rounded to
    bf16 once.  # the product's shape, bf16"""
    with torch.autocast("cpu", enabled=False):
        out = func(*(_widened(a) for a in args), **{k: _widened(v) for k, v in kwargs.items()})
    return out.to(torch.bfloat16)


def matmul(func: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
    """`func(*args, **kwargs)` (a matrix product): by `product` where it would run in bf16 on a CPU
    without bf16 kernels (`_applies`), else `func` itself."""
    if emulated(_CPU) and _applies(args, kwargs):  # the cached probe first: elsewhere a product pays nothing
        return product(func, *args, **kwargs)
    return func(*args, **kwargs)


_PRODUCTS = frozenset({
    torch.nn.functional.linear, torch.mm, torch.addmm, torch.bmm, torch.baddbmm, torch.matmul,
    torch.Tensor.mm, torch.Tensor.addmm, torch.Tensor.bmm, torch.Tensor.baddbmm, torch.Tensor.matmul,
    torch.Tensor.__matmul__, torch.Tensor.__rmatmul__, torch.nn.functional.scaled_dot_product_attention,
})


class RoundedProducts(TorchFunctionMode):
    """Route the matrix products of code run under it to `product` where autocast would run them
    in bf16 on the CPU (CPU bf16 autocast on, fp32 or bf16 operands) or where an operand is bf16
    (explicit bf16 code); everything else runs as it would without this mode."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        return matmul(func, *args, **kwargs) if func in _PRODUCTS else func(*args, **kwargs)


def _applies(args: tuple, kwargs: dict) -> bool:
    """A product whose floating operands are all CPU fp32 or bf16 and that runs in bf16: under CPU
    bf16 autocast, or with a bf16 operand; not one written into an `out=` tensor."""
    if kwargs.get("out") is not None:  # a product written into a given tensor: torch's own, as asked
        return False
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if not tensors or any(t.device.type != "cpu" or t.dtype not in (torch.float32, torch.bfloat16)
                          for t in tensors):
        return False
    autocast = torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
    return autocast or any(t.dtype == torch.bfloat16 for t in tensors)


@contextmanager
def autocast_bf16(device: torch.device) -> Iterator[None]:
    """bf16 autocast on `device`, with `RoundedProducts` where bf16 is `emulated` there."""
    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):
        if not emulated(device):
            yield
            return
        with RoundedProducts():
            yield
