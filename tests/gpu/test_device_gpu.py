"""operators/device.py on a real GPU: pinned buffers, side-stream ordering, the CuPy launch equal to
its NumPy twin, and the doctor's training check (skipped without CUDA)."""
from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from test_kernels_nvrtc import _case, _twin  # noqa: E402

from flowrec.planner.manager import make_plan  # noqa: E402
from flowrec.measure.doctor import check_training  # noqa: E402
from operators.cupy_kernels import fused_rowwise_update, rowwise_launch  # noqa: E402
from operators.device import CudaRuntime, cupy_usable, runtime_for  # noqa: E402
from operators.sparse_optim import make_optimizer  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def test_cuda_runtime_pins_and_orders_the_side_stream():
    rt = runtime_for(CUDA)
    assert isinstance(rt, CudaRuntime)
    assert rt.pin(torch.arange(8.0)).is_pinned()
    x = torch.ones(1 << 22, device=CUDA)
    x.mul_(3)  # queued on the compute stream
    side = rt.side_stream()
    ready = rt.record_current()
    with side.use():
        side.wait(ready)
        y = x * 2  # must see the multiplied x
        done = side.record()
    rt.wait_current(done)
    assert float(y.sum()) == 6.0 * (1 << 22)
    with pytest.raises(TypeError):
        rt.wait_current(runtime_for("cpu").record_current())


@pytest.mark.parametrize("dim", [1, 33, 200, 1024])
def test_cupy_kernel_equals_its_twin(dim):
    if not cupy_usable():
        pytest.skip("cupy sees no CUDA device")
    weight, state, grad, casting = _case(dim)
    want_w, want_s = _twin(weight, state, grad, casting, 0.05, 1e-6, 0.01,
                           rowwise_launch(casting.unique_ids.numel(), dim))
    w, s = weight.to(CUDA), state.to(CUDA)
    opt = make_optimizer(("rowwise_adagrad", 0.05, (("eps", 1e-6), ("weight_decay", 0.01))))
    fused_rowwise_update(w, s, opt, grad.to(CUDA), casting.to(CUDA))
    torch.testing.assert_close(s.cpu(), want_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("dim", [33])
def test_cupy_launch_runs_on_torchs_current_stream_without_deprecated_calls(dim):
    """The launch goes on the stream torch is using (a side stream here), after the work queued
    there, through CuPy's current stream API (`Stream.from_external` where CuPy has it; CuPy 14
    warns on `ExternalStream`)."""
    if not cupy_usable():
        pytest.skip("cupy sees no CUDA device")
    import cupy

    weight, state, grad, casting = _case(dim)
    want_w, want_s = _twin(weight, state, grad, casting, 0.05, 1e-6, 0.01,
                           rowwise_launch(casting.unique_ids.numel(), dim))
    opt = make_optimizer(("rowwise_adagrad", 0.05, (("eps", 1e-6), ("weight_decay", 0.01))))
    rt = runtime_for(CUDA)
    side = torch.cuda.Stream(CUDA)
    big = torch.rand(1 << 24, device=CUDA)
    torch.cuda.synchronize()
    with torch.cuda.stream(side), warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        w, s = (weight * 2).to(CUDA), state.to(CUDA)
        g, c = grad.to(CUDA), casting.to(CUDA)
        for _ in range(20):  # keeps the side stream busy: a launch on another stream runs first
            big.mul_(1.0000001)
        # w becomes the weight only after the busy work: a kernel on another stream sees 2 x weight
        w.copy_(w * 0.5 + 0.0 * big[: w.numel()].view_as(w))
        fused_rowwise_update(w, s, opt, g, c)
        assert rt._cupy_stream(cupy, side.cuda_stream).ptr == side.cuda_stream
    side.synchronize()
    torch.testing.assert_close(s.cpu(), want_s, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w.cpu(), want_w, rtol=1e-5, atol=1e-6)


def test_doctor_training_on_the_gpu_equals_the_cpu():
    checks = check_training(["cuda:0"], lambda spec: make_plan(spec, target="cpu"))
    assert [c.status for c in checks] == ["pass", "pass"], [c.detail for c in checks]


def test_calibration_times_the_transfer_stages_own_copies():
    """`upload_cost` times `DeviceRuntime.upload` (pageable copies, what the transfer stage sends
    a batch with): the copies land on the GPU equal to their source, and the fit gives a finite
    rate and a non-negative fixed part that the cost model can use."""
    import math

    from flowrec.measure.calibrate import UPLOAD_BYTES, upload_cost

    rt = runtime_for(CUDA)
    host = torch.randn(UPLOAD_BYTES[0] // 4)
    sent = rt.upload(host)
    assert sent.device.type == "cuda" and not host.is_pinned() and torch.equal(sent.cpu(), host)
    gbps, us = upload_cost(CUDA, 0.1)
    assert math.isfinite(gbps) and gbps > 0 and math.isfinite(us) and us >= 0
