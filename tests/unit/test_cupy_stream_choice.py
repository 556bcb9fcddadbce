"""How the CUDA runtime hands torch's stream to CuPy, checked without a GPU: through
`Stream.from_external` and the CUDA stream protocol where CuPy has it (CuPy 14 deprecates
`ExternalStream`), through `ExternalStream` on older CuPy, one wrapper per stream handle.
The launch on a real GPU is tests/gpu/test_device_gpu.py's."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from operators.device import CudaRuntime


class _Wrapped:
    def __init__(self, ptr: int, device_id: int, how: str):
        self.ptr, self.device_id, self.how = ptr, device_id, how


def _cupy(with_from_external: bool) -> SimpleNamespace:
    calls: list[str] = []

    class Stream:
        if with_from_external:
            @staticmethod
            def from_external(obj):
                calls.append("from_external")
                version, handle = obj.__cuda_stream__()
                assert version == 0
                return _Wrapped(handle, -1, "from_external")  # the protocol carries the handle alone

    def external_stream(ptr, device_id=-1):
        calls.append("ExternalStream")
        return _Wrapped(ptr, device_id, "ExternalStream")

    return SimpleNamespace(cuda=SimpleNamespace(Stream=Stream, ExternalStream=external_stream), calls=calls)


def test_new_cupy_wraps_torchs_stream_through_the_stream_protocol_once_per_handle():
    cupy = _cupy(with_from_external=True)
    rt = CudaRuntime(torch.device("cuda:1"))
    first = rt._cupy_stream(cupy, 0x7F00AB)
    assert (first.ptr, first.how) == (0x7F00AB, "from_external")
    assert rt._cupy_stream(cupy, 0x7F00AB) is first
    other = rt._cupy_stream(cupy, 0x7F00CD)
    assert other.ptr == 0x7F00CD and other is not first
    assert cupy.calls == ["from_external", "from_external"]


def test_older_cupy_gets_external_stream_with_the_device():
    cupy = _cupy(with_from_external=False)
    rt = CudaRuntime(torch.device("cuda"))
    wrapped = rt._cupy_stream(cupy, 12345)
    assert (wrapped.ptr, wrapped.device_id, wrapped.how) == (12345, 0, "ExternalStream")
    assert cupy.calls == ["ExternalStream"]
