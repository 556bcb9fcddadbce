"""Linear layers on the CPU through oneDNN: `linear(x, weight, bias, relu)`.

torch's fp32 `addmm`/`mm` on the CPU call MKL's sgemm. MKL picks its kernels by CPU vendor; on
the AMD CPUs it does not recognise it runs a path without AVX-512 (measured on this project's
2-core AMD EPYC with AVX-512: 4096 x 512 x 256 in 9.7 ms with one thread, oneDNN 4.3 ms). oneDNN,
which ships inside torch (`torch.ops.mkldnn`), dispatches by instruction set on every vendor. So
on the CPU, fp32 linear layers run their three GEMMs in one autograd node of their own: the
forward with the bias and the ReLU fused into the GEMM (one pass over the output, no separate
clamp), the backward's input gradient and weight gradient; the ReLU mask is read from the saved
output and the bias gradient is one column sum. On Intel's CPUs, where MKL runs its own AVX-512
and AMX kernels, the same node calls MKL through torch's `mm`/`addmm` instead (`gemm_library`:
DLRM's training step 1.16x and wide_1000's 1.18x faster there than through oneDNN). Same
function, sums in another order: allclose to `nn.Linear` + ReLU, not bitwise.

Under CPU bf16 autocast on a CPU without bf16 kernels (`operators.lowp.emulating_autocast`), a
training layer runs the same oneDNN calls on its operands' bf16 values widened to fp32 (`_LowLinear`):
the bias and the ReLU inside the fp32 GEMM, the output rounded to bf16 once, each gradient an fp32
product of bf16 values rounded to bf16 once, as `operators.lowp.product` computes them (the same
values up to the order of the fp32 sums), without its separate casts, clamp and bias sums in bf16.

Everything else (float64; bf16 where the CPU has bf16 kernels, where torch's `mm` already calls
oneDNN: routing bf16 layers here measured 12% slower than autocast's own linear; CUDA; a torch
without oneDNN, code being traced by `torch.compile` or `torch.export`) takes
`nn.functional.linear` and an in-place ReLU: the same results as before this module existed.

Example:
    >>> x, w, b = torch.randn(8, 5), torch.randn(3, 5), torch.randn(3)
    >>> torch.allclose(linear(x, w, b, relu=True), torch.relu(x @ w.t() + b), atol=1e-6)
    True
"""
from __future__ import annotations

import contextlib
import os
from typing import Iterator

import torch

from operators.lowp import emulating_autocast, matmul, widened

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
    with torch.autocast("cpu", enabled=False):  # probed in fp32 whatever the caller runs under
        return _probe_fp32()


def _probe_fp32() -> bool:
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
_LIBRARY: str | None = None  # `gemm_library`, decided at first use
GEMM_LIBRARY_ENV = "FLOWREC_CPU_GEMM"  # auto (default), onednn or mkl


def gemm_library() -> str:
    """Which library runs the GEMMs of this module's fp32 layers on this machine: "onednn" or
    "mkl" (torch's `mm`/`addmm`, which call MKL's sgemm).

    MKL picks its kernels by CPU vendor: on Intel's CPUs it runs its AVX-512 (and AMX) paths, on
    others a slower generic one. So "mkl" where the CPU is Intel's (`cpu_vendor`), "onednn"
    elsewhere. On a 2-vCPU Intel Xeon with AVX-512 and AMX (issue 28, Round 34) DLRM's whole
    training step took 141 ms through oneDNN and 121 ms through MKL (median of five alternating
    blocks, one process); on the AMD EPYC of earlier rounds oneDNN was 2.3x MKL on a 4096 x 512 x
    256 GEMM. $FLOWREC_CPU_GEMM (onednn, mkl) overrides the choice. It is fixed for the process,
    so a run and its resume compute alike on one machine; the two libraries sum in different
    orders (allclose, not bitwise)."""
    global _LIBRARY
    if _LIBRARY is None:
        asked = os.environ.get(GEMM_LIBRARY_ENV, "auto").strip().lower() or "auto"
        if asked not in ("auto", "onednn", "mkl"):
            raise ValueError(f"{GEMM_LIBRARY_ENV}={asked!r}: use auto, onednn or mkl")
        _LIBRARY = asked if asked != "auto" else ("mkl" if cpu_vendor() == "GenuineIntel" else "onednn")
    return _LIBRARY


@contextlib.contextmanager
def torch_gemms() -> Iterator[None]:
    """Within it, this module's fp32 layers run torch's `mm`/`addmm` (`gemm_library` "mkl")
    whatever the CPU: the GEMMs that code traced by `torch.compile` or `torch.export` runs (it
    takes `nn.functional.linear`), so an eager result compares bitwise with a compiled or exported
    one. On a CPU that is not Intel's the eager layers otherwise run oneDNN's GEMMs, which sum in
    another order (allclose, not bitwise). For checks, one thread at a time: it sets the module's
    choice for the process and restores it at the end."""
    global _LIBRARY
    saved = gemm_library()
    _LIBRARY = "mkl"
    try:
        yield
    finally:
        _LIBRARY = saved


def cpu_vendor() -> str:
    """The CPU's vendor string ("GenuineIntel", "AuthenticAMD", ...) from /proc/cpuinfo; "" where
    it cannot be read (not Linux): then oneDNN, as before this choice existed."""
    return _cpuinfo("vendor_id")


def cpu_family() -> int:
    """The CPU's family number from /proc/cpuinfo ("cpu family"); -1 where it cannot be read."""
    family = _cpuinfo("cpu family")
    return int(family) if family.isdigit() else -1


def _cpuinfo(field: str) -> str:
    """The first value of `field` in /proc/cpuinfo; "" where there is none or it cannot be read."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(field):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""

_WEIGHT_GRADS_BY_ONEDNN: bool | None = None  # decided at first use (`_weight_grad`)


def _onednn_weight_grads() -> bool:
    """Whether weight gradients run through oneDNN (a CPU with AVX-512) or torch's `mm` (below)."""
    global _WEIGHT_GRADS_BY_ONEDNN
    if _WEIGHT_GRADS_BY_ONEDNN is None:
        try:
            capability = torch.backends.cpu.get_cpu_capability()
        except Exception:  # noqa: BLE001 - an older torch: as before this choice existed
            capability = "AVX512"
        _WEIGHT_GRADS_BY_ONEDNN = str(capability).upper().startswith("AVX512")
    return _WEIGHT_GRADS_BY_ONEDNN


def takes(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs (x, weight) through oneDNN: fp32 CPU tensors, eager code, training
    (grad enabled). Inference (evaluation, scoring under no_grad) takes `nn.functional.linear`, the
    kernel an exported package runs (`torch.export` traces the plain path), so `flowrec eval` and
    `flowrec predict` give bitwise the same scores (a contract of docs/production.md)."""
    return (x.device.type == "cpu" and weight.device.type == "cpu" and x.dtype == torch.float32
            and weight.dtype == torch.float32 and x.dim() == 2 and torch.is_grad_enabled() and not torch.compiler.is_compiling()
            and not torch.is_autocast_enabled("cpu") and available())


LOW_LINEAR_MIN_ROWS = 1024  # below, `_LowLinear` measured slower than the mode's products (MKL's GEMMs)


def emulates(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs (x, weight) as `_LowLinear`: training (grad enabled, eager code) under
    CPU bf16 autocast on a CPU without bf16 kernels, fp32 or bf16 input of at least
    LOW_LINEAR_MIN_ROWS rows, an fp32 weight. Fewer rows take the mode's products: on an AVX2 EPYC
    oneDNN's GEMMs of a few hundred rows ran slower than MKL's (DLRM's layers at batch 256: the
    step 9% slower through `_LowLinear`; equal at 1024, 6-8% faster at 2048-4096). The rule is
    fixed by shapes, so a run and its resume compute alike."""
    # traced code (torch.compile, torch.export) is ruled out before the row count is read: a
    # symbolic batch compared with a constant would constrain an exported package's batch dimension
    return (not torch.compiler.is_compiling() and torch.is_grad_enabled() and x.dim() == 2
            and x.dtype in (torch.float32, torch.bfloat16) and weight.dtype == torch.float32 and _widens(x))


def _widens(x: torch.Tensor) -> bool:
    """The emulated-bf16 part of `emulates`, shared with `_Sources`: bf16 autocast emulated on x's
    CPU, oneDNN usable, at least LOW_LINEAR_MIN_ROWS rows (read last; callers rule out traced code)."""
    return emulating_autocast(x.device) and available() and x.shape[0] >= LOW_LINEAR_MIN_ROWS


def _round(t: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An fp32 result rounded to bf16 once, in `dtype` (fp32: the bf16 values widened back)."""
    out = t.to(torch.bfloat16)
    return out if dtype == torch.bfloat16 else out.to(dtype)


def _gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, post: str = "none") -> torch.Tensor:
    """x weight^T (+ bias) (-> post-op) in one oneDNN call; `weight` may be a transposed view
    (`gemm_library` "mkl": torch's `addmm`/`mm`, the ReLU in place on the fresh output; also an
    empty product, 0 rows or a 0-long sum, which oneDNN refuses: a rank's empty slice). Where
    oneDNN's fused ReLU turns a NaN into 0 (`relu_keeps_nan`), the ReLU runs in place after the
    GEMM, as torch's does.  # (B, Out)"""
    if gemm_library() == "mkl" or 0 in x.shape:
        y = torch.mm(x, weight.t()) if bias is None else torch.addmm(bias, x, weight.t())
        return torch.relu_(y) if post == "relu" else y
    if post == "relu" and not relu_keeps_nan():
        return torch.relu_(_POINTWISE(x, weight, bias, "none", [], ""))
    return _POINTWISE(x, weight, bias, post, [], "")


_RELU_KEEPS_NAN: bool | None = None  # probed at first use (`relu_keeps_nan`)


def relu_keeps_nan() -> bool:
    """Whether oneDNN's ReLU fused into its GEMM keeps a NaN a NaN, as `torch.relu` does.

    Its AVX-512 kernels on an AMD EPYC (family 25) clamp with a max that returns 0 for NaN: a
    layer after a module that returned NaN rows gave zero rows there, the loss stayed finite, and
    the run stopped steps later on a non-finite weight (the NaN came back through the weight
    gradient, 0 x NaN), never naming the module; on an Intel CPU (torch's GEMM and ReLU) the same
    spec stopped at once on its non-finite loss. Where it does not keep NaN, `_gemm` runs the ReLU
    as a pass of its own (one read and write of the output)."""
    global _RELU_KEEPS_NAN
    if _RELU_KEEPS_NAN is None:
        try:
            with torch.autocast("cpu", enabled=False):  # a tiny and a blocked kernel's shape
                _RELU_KEEPS_NAN = all(_fused_relu_keeps_nan(*shape) for shape in ((3, 4, 5), (512, 256, 128)))
        except Exception:  # noqa: BLE001 - no fused ReLU to trust: the separate pass
            _RELU_KEEPS_NAN = False
    return _RELU_KEEPS_NAN


def _fused_relu_keeps_nan(rows: int, fan_in: int, out: int) -> bool:
    """Whether oneDNN's fused ReLU of a (rows, fan_in) x (fan_in, out) GEMM whose row 1 holds a NaN
    gives NaN on that row and nowhere else."""
    x = torch.ones(rows, fan_in)
    x[1, 2] = float("nan")
    y = _POINTWISE(x, torch.ones(out, fan_in), torch.zeros(out), "relu", [], "")
    return bool(torch.isnan(y[1]).all()) and int(torch.isnan(y).sum()) == out


def _gemm_accumulate(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """y += x weight^T, in place where torch's `addmm` runs it (`gemm_library` "mkl"): the same
    BLAS call as `_gemm_add(x, y, weight, None)`, bitwise, without its copy of `y` into a fresh
    output (wide_1000's first layer: five (B, 512) copies a step); else `_gemm_add`.  # (B, Out)"""
    if gemm_library() == "mkl" or 0 in x.shape:
        return y.addmm_(x, weight.t())
    return _gemm_add(x, y, weight, None)


def _gemm_add(x: torch.Tensor, add: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """add + x weight^T (+ bias): the sum fused into oneDNN's GEMM, or torch's `addmm` (also an
    empty product, as `_gemm`).  # (B, Out)"""
    if gemm_library() == "mkl" or 0 in x.shape:
        return torch.addmm(add if bias is None else add + bias, x, weight.t())
    return _MKLDNN._linear_pointwise.binary(x, add, weight, bias, "add")


class _Linear(torch.autograd.Function):
    """y = act(x W^T + b) by oneDNN, with a direct backward (three GEMMs at most, each skipped
    when its input needs no gradient)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool,
                add: torch.Tensor | None) -> torch.Tensor:
        if add is None:
            y = _gemm(x, weight, bias, "relu" if relu else "none")  # (B, Out)
        else:  # add + x weight^T (+ bias), the sum fused into the GEMM
            y = _gemm_add(x, add, weight, bias)
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


class _LowLinear(torch.autograd.Function):
    """`_Linear` under emulated CPU bf16 autocast (`emulates`): y = round(act(x' W'^T + b')) with
    x', W', b' the operands' bf16 values in fp32 (`operators.lowp.widened`) and one fp32 oneDNN
    call; the output is bf16, as autocast's linear gives it. Backward: the ReLU mask read from the
    bf16 output (as autograd of the in-place ReLU reads it), then each gradient an fp32 product of
    bf16 values rounded to bf16 once, in its input's dtype (the fp32 weight and bias get bf16
    values), as autograd of `operators.lowp.product` computes them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, relu: bool,
                add: torch.Tensor | None) -> torch.Tensor:
        with torch.autocast("cpu", enabled=False):
            xw, ww = widened(x), widened(weight)  # (B, In), (Out, In)
            bw = None if bias is None else widened(bias)
            if add is None:
                y = _gemm(xw, ww, bw, "relu" if relu else "none").to(torch.bfloat16)  # (B, Out)
            else:
                y = _gemm_add(xw, widened(add), ww, bw).to(torch.bfloat16)
        ctx.relu, ctx.has_bias, ctx.x_dtype = relu, bias is not None, x.dtype
        ctx.add_dtype = None if add is None else add.dtype
        ctx.save_for_backward(xw, ww, y if relu else None)
        return y

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        xw, ww, y = ctx.saved_tensors
        need_x, need_w, need_b = ctx.needs_input_grad[:3]
        with torch.autocast("cpu", enabled=False):
            grad = grad.to(torch.bfloat16).contiguous()
            if ctx.relu:
                grad = torch.ops.aten.threshold_backward(grad, y, 0)  # 0 where the bf16 output is
            g = grad.float()  # (B, Out): bf16 values, exact
            grad_x = _round(_gemm(g, ww.t(), None), ctx.x_dtype) if need_x else None  # (B, In)
            grad_w = _round(_weight_grad(g, xw)) if need_w else None  # (Out, In)
            grad_b = _round(g.sum(0)) if need_b and ctx.has_bias else None  # (Out,)
            grad_add = grad.to(ctx.add_dtype) if ctx.needs_input_grad[4] else None
        return grad_x, grad_w, grad_b, None, grad_add


_WEIGHT_GRADS_BY_SHAPE: bool | None = None  # decided at first use (`_shape_weight_grads`)
HALF_WIDTH_FAMILIES = {"AuthenticAMD": (25,)}  # CPU families whose AVX-512 runs on 256-bit units (Zen 4)
MM_WEIGHT_GRAD_MIN_DIM = 16  # `mm_weight_grad`: a layer at least this wide and tall ...
MM_WEIGHT_GRAD_MAX_ELEMS = 1 << 19  # ... of at most this many weights takes torch's mm on such a CPU


def _shape_weight_grads() -> bool:
    """Whether a weight gradient that would take oneDNN takes torch's `mm` instead where its shape
    says so (`mm_weight_grad`): a CPU whose AVX-512 instructions run on 256-bit units (AMD's Zen 4,
    family 25: HALF_WIDTH_FAMILIES). There oneDNN's AVX-512 GEMMs are no faster than MKL's AVX2
    path (Round 39, a Zen 4 VM: 0.86-0.92x mm's time on DLRM's 4096-row layers, against 0.45x on Zen
    5), so the transposed copies oneDNN needs cost more than they save: a 4096-row weight gradient
    of 256 x 512 took 8.6 ms through oneDNN and its copies, 6.3 ms through `mm`, which reads the
    transposed operands in place. Decided once per process (`cpu_vendor`, `cpu_family`), so a
    run and its resume compute alike on one machine."""
    global _WEIGHT_GRADS_BY_SHAPE
    if _WEIGHT_GRADS_BY_SHAPE is None:
        _WEIGHT_GRADS_BY_SHAPE = cpu_family() in HALF_WIDTH_FAMILIES.get(cpu_vendor(), ())
    return _WEIGHT_GRADS_BY_SHAPE


def mm_weight_grad(out: int, fan_in: int) -> bool:
    """Whether an `out` x `fan_in` layer's weight gradient takes torch's `mm` on a CPU of
    `_shape_weight_grads`: the layers of a few thousand to half a million weights, at least
    MM_WEIGHT_GRAD_MIN_DIM each way. Larger ones are GEMM-bound, where oneDNN's faster kernels
    outrun the copies (wide_1000's 512 x 10,472: 214 ms against 254 through `mm`), and narrow ones
    hit a slow path of MKL (DLRM's 512 x 13: 1.44 ms against 0.57; a 1 x 256 head: 0.10 against
    0.06). Fixed by the shape, so a run and its resume compute alike.

    Example:
        >>> [mm_weight_grad(o, i) for o, i in ((256, 512), (16, 64), (512, 13), (1, 256), (512, 10472))]
        [True, True, False, False, False]
    """
    return min(out, fan_in) >= MM_WEIGHT_GRAD_MIN_DIM and out * fan_in <= MM_WEIGHT_GRAD_MAX_ELEMS


def _weight_grad(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad^T x.  # (Out, In)

    On a CPU with AVX-512: oneDNN, which reads its first operand contiguous, so one transposed
    operand is copied: the narrower one (grad^T x with grad^T copied, or (x^T grad)^T with x^T
    copied); MKL's sgemm there runs a path without AVX-512 on AMD CPUs. Below AVX-512 (AVX2) both
    libraries run the same instructions and the copy is pure cost: torch's `mm`, which reads the
    transposed operands in place (AVX2 EPYC, batch 4096, median ms: 256 x 512 12.3 against 19.0,
    512 x 367 13.1 against 18.1, 512 x 1000 31.7 against 94.6). The choice is fixed per machine
    (`torch.backends.cpu.get_cpu_capability`), so a run and its resume compute alike. Where
    `gemm_library` is "mkl" (Intel's CPUs), torch's `mm` always; on a CPU whose AVX-512 runs on
    256-bit units (`_shape_weight_grads`), `mm` for the mid-size layers (`mm_weight_grad`)."""
    if (gemm_library() == "mkl" or not _onednn_weight_grads()
            or (_shape_weight_grads() and mm_weight_grad(grad.shape[1], x.shape[1]))):
        return _weight_layout(torch.mm(grad.t(), x))
    if grad.shape[1] <= x.shape[1]:
        return _weight_layout(_gemm(grad.t(), x.t(), None))
    return _weight_layout(_gemm(x.t(), grad.t(), None).t())


def _weight_layout(grad_w: torch.Tensor) -> torch.Tensor:
    """An (Out, In) weight gradient with a contiguous weight's strides (In, 1) where its bytes are
    laid out so already and only the stride of a size-1 dimension differs: a transposed product of
    a one-input layer is (Out, 1) with strides (1, Out). Autograd keeps such a gradient as it is
    (it ignores the strides of size-1 dimensions), but DistributedDataParallel compares every
    stride with the parameter's and warned "Grad strides do not match bucket view strides" on each
    rank. The same tensor and bytes (a view); a gradient of another layout is left to autograd,
    which copies it into the parameter's. # (Out, In)"""
    strides = (grad_w.shape[1], 1)
    if grad_w.stride() != strides and grad_w.is_contiguous():
        return grad_w.as_strided(grad_w.shape, strides)
    return grad_w


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           relu: bool = False, add: torch.Tensor | None = None) -> torch.Tensor:
    """`relu(x @ weight.T + bias)` (without the ReLU when `relu` is False; `add`: plus this
    (B, Out) tensor, no ReLU), by oneDNN where `takes(x, weight)` (fp32) or `emulates(x, weight)`
    (bf16 values in fp32, a bf16 output), else `nn.functional.linear` / `addmm` (ReLU in place on
    the fresh output).  # (B, Out)

    A weight that is a column slice of a larger one (a source MLP's part of its first layer) is
    copied contiguous first: oneDNN reads such a strided weight so slowly that one 4096 x 1000 x
    512 GEMM did not finish in 100 s (30 ms contiguous)."""
    if relu and add is not None:
        raise ValueError("linear: relu and add together are not supported")
    if emulates(x, weight):
        return _LowLinear.apply(x, weight, bias, relu, add)
    if takes(x, weight):
        weight = weight if weight.is_contiguous() or weight.t().is_contiguous() else weight.contiguous()
        return _Linear.apply(x, weight, bias, relu, add)
    if add is not None:
        return torch.addmm(add, x, weight.t()) if bias is None else torch.addmm(add + bias, x, weight.t())
    y = torch.nn.functional.linear(x, weight, bias)
    return torch.relu_(y) if relu else y


def linear_sources(flats: list[torch.Tensor], weight: torch.Tensor, bias: torch.Tensor | None,
                   inverse: torch.Tensor | None) -> torch.Tensor | None:
    """`cat(flats, 1) @ weight[:, inverse]^T + bias` (inverse None: columns in order), as one
    autograd node on the CPU: one GEMM per source accumulated into the output, and a backward that
    writes each source's weight-gradient columns straight into one full gradient. None where it
    does not apply (the caller runs its per-source `linear` chain): no grad, traced code, not the
    CPU, a float64 layer, or widths that do not cover the weight.  # (B, Out)

    Per-source `linear` calls on column slices of a permuted weight make autograd build the
    weight's gradient as, per source, a zero-filled full-size tensor with the slice copied in,
    summed over sources, then an `index_add` into another zero-filled one (wide_1000's first layer,
    512 x 10,472: five full-size adds, six zero fills and an index_add per step, ~55 ms of one
    core at batch 1024, batch-independent). Here: one `index_select` of the weight's columns per
    source in the forward, one `index_copy_` per source in the backward, each column written once.
    fp32 (grad enabled, no autocast) runs oneDNN as `linear` does, bitwise its results; under CPU
    autocast every operand is cast to the autocast dtype as autocast's `addmm` would cast it
    (values bitwise; weight gradients rounded once to the autocast dtype, then widened), the
    products by `operators.lowp.matmul`; where the CPU has no bf16 kernels, `_LowLinear`'s oneDNN
    calls on the widened operands, one bf16 rounding after each source as in that chain.
    """
    if not (flats and flats[0].device.type == "cpu" and torch.is_grad_enabled()
            and not torch.compiler.is_compiling() and weight.dtype == torch.float32
            and sum(f.shape[1] for f in flats) == weight.shape[1]):
        return None
    low = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else None
    if low is None and not (all(f.dtype == torch.float32 for f in flats) and available()):
        return None
    return _Sources.apply(weight, bias, inverse, low, *flats)


class _Sources(torch.autograd.Function):
    """y = sum_i flats_i W_i^T + b, W_i the weight's columns of source i (see `linear_sources`)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, bias: torch.Tensor | None, inverse: torch.Tensor | None,
                low: torch.dtype | None, *flats: torch.Tensor) -> torch.Tensor:
        bounds, start = [], 0
        for f in flats:
            bounds.append((start, start + f.shape[1]))
            start += f.shape[1]
        cols = [None if inverse is None else inverse[a:b] for a, b in bounds]
        parts = [weight[:, a:b].contiguous() if c is None else weight.index_select(1, c)
                 for (a, b), c in zip(bounds, cols)]  # (Out, w_i) each
        wide = low == torch.bfloat16 and _widens(flats[0])
        with torch.autocast("cpu", enabled=False):
            if wide:  # bf16 emulated: `_LowLinear`'s calls, one rounding per source as autocast's addmm chain
                xs, parts = [widened(f) for f in flats], [widened(p) for p in parts]
                y = _gemm(xs[0], parts[0], None if bias is None else widened(bias)).to(low)
                for x, p in zip(xs[1:], parts[1:]):
                    y = _gemm_add(x, y.float(), p, None).to(low)
            elif low is not None:
                xs = [f.to(low) for f in flats]
                parts = [p.to(low) for p in parts]
                y = (matmul(torch.addmm, bias.to(low), xs[0], parts[0].t()) if bias is not None
                     else matmul(torch.mm, xs[0], parts[0].t()))
                for x, p in zip(xs[1:], parts[1:]):
                    y = matmul(torch.addmm, y, x, p.t())
            else:
                xs = list(flats)
                y = _gemm(xs[0], parts[0], bias)
                for x, p in zip(xs[1:], parts[1:]):
                    y = _gemm_accumulate(y, x, p)
        ctx.bounds, ctx.cols, ctx.low, ctx.wide, ctx.has_bias = bounds, cols, low, wide, bias is not None
        ctx.dtypes = [f.dtype for f in flats]
        ctx.save_for_backward(*xs, *parts)
        return y  # (B, Out)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        saved = ctx.saved_tensors
        count = len(ctx.bounds)
        xs, parts = saved[:count], saved[count:]
        grad = grad.contiguous()
        need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grads_x: list[torch.Tensor | None] = []
        full = None
        with torch.autocast("cpu", enabled=False):
            if ctx.wide:
                return _Sources.wide_backward(ctx, grad.to(ctx.low).float(), xs, parts)
            if ctx.low is not None:
                grad = grad.to(ctx.low)
            if need_w:
                full = torch.empty(parts[0].shape[0], sum(b - a for a, b in ctx.bounds), dtype=torch.float32)
            for i, (x, p, (a, b), c) in enumerate(zip(xs, parts, ctx.bounds, ctx.cols)):
                if ctx.needs_input_grad[4 + i]:
                    gx = matmul(torch.mm, grad, p) if ctx.low is not None else _gemm(grad, p.t(), None)  # (B, w_i)
                    grads_x.append(gx.to(ctx.dtypes[i]))
                else:
                    grads_x.append(None)
                if full is not None:
                    gw = matmul(torch.mm, grad.t(), x) if ctx.low is not None else _weight_grad(grad, x)  # (Out, w_i)
                    if c is None:
                        full[:, a:b] = gw
                    else:
                        full.index_copy_(1, c, gw.float())
            grad_b = grad.sum(0).float() if need_b and ctx.has_bias else None
        return (full, grad_b, None, None, *grads_x)

    @staticmethod
    def wide_backward(ctx, g: torch.Tensor, xs: tuple, parts: tuple) -> tuple:
        """The backward under emulated bf16 (`ctx.wide`): `g`, the output gradient's bf16 values in
        fp32, and the widened operands; `_LowLinear`'s GEMMs and roundings per source."""
        full = None
        if ctx.needs_input_grad[0]:
            full = torch.empty(parts[0].shape[0], sum(b - a for a, b in ctx.bounds), dtype=torch.float32)
        grads_x: list[torch.Tensor | None] = []
        for i, (x, p, (a, b), c) in enumerate(zip(xs, parts, ctx.bounds, ctx.cols)):
            grads_x.append(_round(_gemm(g, p.t(), None), ctx.dtypes[i]) if ctx.needs_input_grad[4 + i] else None)
            if full is not None:
                gw = _round(_weight_grad(g, x))  # (Out, w_i)
                if c is None:
                    full[:, a:b] = gw
                else:
                    full.index_copy_(1, c, gw)
        grad_b = _round(g.sum(0)) if ctx.needs_input_grad[1] and ctx.has_bias else None
        return (full, grad_b, None, None, *grads_x)
