"""Linear layers on the CPU through oneDNN: `linear(x, weight, bias, relu)`.

torch's fp32 `addmm`/`mm` on the CPU call MKL's sgemm. MKL picks its kernels by CPU vendor; on
the AMD CPUs it does not recognise it runs a path without AVX-512 (measured on this project's
2-core AMD EPYC with AVX-512: 4096 x 512 x 256 in 9.7 ms with one thread, oneDNN 4.3 ms). oneDNN,
which ships inside torch (`torch.ops.mkldnn`), dispatches by instruction set on every vendor. So
on the CPU, fp32 linear layers run their three GEMMs there: the forward with the bias and the
ReLU fused into the GEMM (one pass over the output, no separate clamp), the backward's input
gradient and weight gradient; the ReLU mask is read from the saved output and the bias gradient
is one column sum. Same function, sums in another order: allclose to `nn.Linear` + ReLU, not
bitwise.

Everything else (float64; bf16, where torch's `mm` already calls oneDNN: routing bf16 layers here
measured 12% slower than autocast's own linear; CUDA; a torch without
oneDNN, code being traced by `torch.compile` or `torch.export`) takes `nn.functional.linear`
and an in-place ReLU: the same results as before this module existed.

Example:
    >>> x, w, b = torch.randn(8, 5), torch.randn(3, 5), torch.randn(3)
    >>> torch.allclose(linear(x, w, b, relu=True), torch.relu(x @ w.t() + b), atol=1e-6)
    True
"""
from __future__ import annotations

import torch

_MKLDNN = getattr(torch.ops, "mkldnn", None)
_POINTWISE = getattr(_MKLDNN, "_linear_pointwise", None) if _MKLDNN is not None else None


def available() -> bool:
    """oneDNN's linear is in this torch and works on this CPU: the op exists (it is internal to
    torch and may go or change), and a small call with every post-op this module uses and a
    transposed weight equals `nn.functional.linear` (a build or CPU where it is missing, raises or
    disagrees takes the plain path instead, never an error mid-training)."""
    global _AVAILABLE
    if _AVAILABLE is None:
        _AVAILABLE = _POINTWISE is not None and torch.backends.mkldnn.is_available() and _probe()
    return _AVAILABLE


def _probe() -> bool:
    gen = torch.Generator().manual_seed(7)
    x, w, b = (torch.randn(*shape, generator=gen) for shape in ((5, 3), (4, 3), (4,)))
    add = torch.randn(5, 4, generator=gen)
    want = torch.nn.functional.linear(x, w, b)
    try:
        got = (_POINTWISE(x, w, b, "none", [], ""), _POINTWISE(x, w, b, "relu", [], ""),
               _POINTWISE(x, w.t().contiguous().t(), None, "none", [], ""),
               _MKLDNN._linear_pointwise.binary(x, add, w, b, "add"))
    except Exception:  # noqa: BLE001 - any failure means: not usable here
        return False
    close = lambda a, e: a.shape == e.shape and bool(torch.allclose(a, e, rtol=1e-5, atol=1e-5))  # noqa: E731
    return (close(got[0], want) and close(got[1], torch.relu(want)) and close(got[2], want - b)
            and close(got[3], want + add))


_AVAILABLE: bool | None = None  # probed at first use


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs (x, weight) through oneDNN: fp32 CPU tensors, eager code, training
    (grad enabled). Inference (evaluation, scoring under no_grad) takes `nn.functional.linear`, the
    kernel an exported package runs (`torch.export` traces the plain path), so `flowrec eval` and
    `flowrec predict` give bitwise the same scores (a contract of docs/production.md)."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and x.dim() == 2 and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu") and available())


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str = "none") -> torch.Tensor:
    """x weight^T (+ bias) (-> post-op) in one oneDNN call; `weight` may be a transposed view.  # (B, Out)"""
    return _POINTWISE(x, weight, bias, post, [], "")


class _Linear(torch.autograd.Function):
    """y = act(x W^T + b) by oneDNN, with a direct backward (three GEMMs at most, each skipped
    when its input needs no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool,
                add: torch.Tensor | None) -> torch.Tensor:
        if add is None:
            y = _gemm(x, weight, bias, "relu" if relu else "none")  # (B, Out)
        else:  # add + x weight^T (+ bias), the sum fused into the GEMM
            y = _MKLDNN._linear_pointwise.binary(x, add, weight, bias, "add")
        ctx.relu = relu
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, y if relu else None)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight, y = ctx.saved_tensors
        grad = grad.contiguous()
        if ctx.relu:
            grad = torch.ops.aten.threshold_backward(grad, y, 0)  # 0 where the output was clamped
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        grad_x = _gemm(grad, weight.t(), None) if need_x else None  # (B, In)
        grad_w = _weight_grad(grad, x) if need_w else None  # (Out, In)
        grad_b = grad.sum(0) if need_b and ctx.has_bias else None  # (Out,)
        grad_add = grad if ctx.needs_input_grad[4] else None
        return grad_x, grad_w, grad_b, None, grad_add


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad^T x.  # (Out, In)

    oneDNN reads its first operand contiguous, so one transposed operand is copied: the narrower
    one (grad^T x with grad^T copied, or (x^T grad)^T with x^T copied)."""
    if grad.shape[1] <= x.shape[1]:
        return _gemm(grad.t(), x.t(), None)
    return _gemm(x.t(), grad.t(), None).t()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           relu: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """`relu(x @ weight.T + bias)` (without the ReLU when `relu` is False; `add`: plus this
    (B, Out) tensor, no ReLU), by oneDNN where `takes(x, weight)`, else `nn.functional.linear` /
    `addmm` (ReLU in place on the fresh output).  # (B, Out)

    A weight that is a column slice of a larger one (a source MLP's part of its first layer) is
    copied contiguous first: oneDNN reads such a strided weight so slowly that one 4096 x 1000 x
    512 GEMM did not finish in 100 s (30 ms contiguous)."""
    if relu and add is not None:
        raise ValueError("linear: relu and add together are not supported")
    if takes(x, weight):
        weight = weight if weight.is_contiguous() or weight.t().is_contiguous() else weight.contiguous()
        return _Linear.apply(x, weight, bias, relu, add)
    if add is not None:
        return torch.addmm(add, x, weight.t()) if bias is None else torch.addmm(add + bias, x, weight.t())
    y = torch.nn.functional.linear(x, weight, bias)
    return torch.relu_(y) if relu else y
