"""`CompiledCall` falls back to eager for good when compiling fails or torch.compile is missing,
and passes the caller's own errors through (the compiled equality: test_compiled_dense)."""
from __future__ import annotations

import pytest
import torch

from operators import device
from operators.device import CompiledCall, runtime_for


def fn(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return torch.relu(x @ w) * 3.0 + x.sum(1, keepdim=True)


def failing_backend(gm, example_inputs):
    raise RuntimeError("no C++ compiler here\nsecond line")


def inputs():
    g = torch.Generator().manual_seed(torch.randint(1 << 30, ()).item())
    return torch.randn(5, 4, generator=g) * 3, torch.randn(4, 4, generator=g)


def test_failing_backend_falls_back_to_eager_once():
    x, w = inputs()
    call = CompiledCall(fn, backend=failing_backend)
    assert call.active and call.failure is None
    with pytest.warns(UserWarning, match="runs eagerly: .*no C\\+\\+ compiler here$"):
        out = call(x, w)
    assert torch.equal(out, fn(x, w))
    assert not call.active and "no C++ compiler here" in call.failure and call.calls == 0
    assert torch.equal(call(x * 2, w), fn(x * 2, w))  # eager from now on, no second warning


def test_missing_torch_compile_runs_eager(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("torch.compile is not supported on this Python")

    monkeypatch.setattr(torch, "compile", refuse)
    x, w = inputs()
    call = runtime_for("cpu").compile(fn)
    assert not call.active and call.failure == "RuntimeError: torch.compile is not supported on this Python"
    assert torch.equal(call(x, w), fn(x, w))


def test_callers_errors_propagate():
    call = CompiledCall(fn, backend="eager")  # compiles (dynamo only) fine
    x, w = inputs()
    assert torch.equal(call(x, w), fn(x, w)) and call.calls == 1
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied|size mismatch|must match"):
        call(x, torch.randn(3, 4))  # eager raises the same error: it is the caller's
    assert call.active and call.failure is None  # and compiling stays on
    assert torch.equal(call(x, w), fn(x, w)) and call.calls == 2


def test_runtime_compile_is_the_device_modules():
    assert isinstance(runtime_for("cpu").compile(fn, backend="eager"), device.CompiledCall)
