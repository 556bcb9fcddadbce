"""The one module that uses CUDA-only APIs: streams, events, pinned buffers, kernel launches.

Everything else asks `runtime_for(device)` for a `DeviceRuntime` and schedules through it. The CPU
runtime implements the same interface (no streams, events that complete when recorded, unpinned
buffers, no kernels), so the CPU tests run the scheduling code a GPU run runs; its events also
check the schedule: waiting for an event that was never recorded is an error there (on CUDA it
would silently not wait). `tests/unit/test_fake_cuda_static.py` checks that no other module
calls a CUDA-only API.

Example:
    >>> rt = runtime_for(torch.device("cpu"))
    >>> side = rt.side_stream()
    >>> with side.use():
    ...     side.wait(rt.record_current())
    ...     done = side.record()
    >>> rt.wait_current(done)
"""
from __future__ import annotations

import importlib
import warnings
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch


@dataclass(frozen=True)
class KernelSource:
    """CUDA C source of one RawKernel.

    Args:
        name: short name (reports, compile checks).
        entry: the `extern "C" __global__` function to launch.
        source: the CUDA C text.
        tree_reduction: the kernel reduces over its block with a halving stride (needs a
            power-of-two block).
        max_threads: the largest block the kernel supports.
    """

    name: str
    entry: str
    source: str
    tree_reduction: bool = False
    max_threads: int = 1024


@dataclass(frozen=True)
class LaunchConfig:
    """Grid, block and dynamic shared memory of one launch (1-D).

    Args:
        grid: blocks.
        block: threads per block.
        shared_mem_bytes: dynamic shared memory per block, bytes.
    """

    grid: int
    block: int
    shared_mem_bytes: int


class DeviceEvent(ABC):
    """A point in a stream's work (`torch.cuda.Event` on CUDA)."""


class SideStream(ABC):
    """A second stream for work that overlaps the compute stream (cache exchanges)."""

    @abstractmethod
    def use(self) -> AbstractContextManager:
        """Make this the current stream inside the `with` block."""

    @abstractmethod
    def wait(self, event: DeviceEvent) -> None:
        """Later work on this stream waits for `event`."""

    @abstractmethod
    def record(self) -> DeviceEvent:
        """An event recorded after the work queued on this stream so far."""


class DeviceRuntime(ABC):
    """Streams, events, pinned buffers and kernel launches of one device.

    Args:
        device: the compute device.
    """

    def __init__(self, device: torch.device):
        self.device = torch.device(device)

    @abstractmethod
    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor in memory the device copies from asynchronously (page-locked on CUDA)."""

    @abstractmethod
    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """A staged host tensor (a batch's ids, dense features, casting) on the device, copied by
        the calling thread (the transfer stage's), in stream order with the compute stream."""

    @abstractmethod
    def side_stream(self) -> SideStream:
        """A new side stream."""

    @abstractmethod
    def record_current(self) -> DeviceEvent:
        """An event after the work queued so far on the current (compute) stream."""

    @abstractmethod
    def wait_current(self, event: DeviceEvent) -> None:
        """Later work on the current stream waits for `event`."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the host until the device finished everything queued."""

    @abstractmethod
    def launch(self, kernel: KernelSource, config: LaunchConfig, args: tuple[Any, ...]) -> None:
        """Launch `kernel` on the current stream; tensors in `args` are passed by pointer."""

    def seed(self, seed: int) -> None:
        """Seed the generators code on this device draws from: the host's default generator
        (`torch.rand` without a device, CPU tensors' dropout), and the device's own on a device.
        The same draws as `torch.manual_seed(seed)` on this device and the host, at a fraction of
        its cost: on a CPU-only build `torch.manual_seed` also queues the seeding of every
        accelerator type torch knows, with a formatted stack each time (124 us a call measured
        here, 9 % of a 1.4 ms step when seeded every step; this: 3 us)."""
        torch.default_generator.manual_seed(seed)

    def compile(self, fn: Callable[..., Any], backend: Any = "inductor") -> "CompiledCall":
        """`fn` (the dense stage) compiled for this device, eager where compiling fails.

        CPU: inductor's C++ backend (fused pointwise kernels around the GEMMs). CUDA: inductor's
        Triton backend; the same region is the candidate for CUDA graphs (mode "reduce-overhead").
        """
        return CompiledCall(fn, backend)


class CpuEvent(DeviceEvent):
    """A CPU event: complete once recorded (CPU work is done when the call returns)."""

    def __init__(self, recorded: bool = False):
        self.recorded = recorded

    def check(self) -> None:
        if not self.recorded:
            raise RuntimeError("waited for an event that was never recorded")


class CpuSideStream(SideStream):
    def use(self) -> AbstractContextManager:
        return nullcontext()

    def wait(self, event: DeviceEvent) -> None:
        _cpu_event(event).check()

    def record(self) -> DeviceEvent:
        return CpuEvent(recorded=True)


class CpuRuntime(DeviceRuntime):
    """The CPU device: host memory is the device, work is synchronous, kernels are torch ops."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def side_stream(self) -> SideStream:
        return CpuSideStream()

    def record_current(self) -> DeviceEvent:
        return CpuEvent(recorded=True)

    def wait_current(self, event: DeviceEvent) -> None:
        _cpu_event(event).check()

    def synchronize(self) -> None:
        return None

    def launch(self, kernel: KernelSource, config: LaunchConfig, args: tuple[Any, ...]) -> None:
        raise RuntimeError(f"kernel {kernel.name} is a CUDA kernel; the CPU runs its torch reference")


def _cpu_event(event: DeviceEvent) -> CpuEvent:
    if not isinstance(event, CpuEvent):
        raise TypeError(f"a CPU runtime got a {type(event).__name__}")
    return event


class CudaEvent(DeviceEvent):
    def __init__(self, stream: Any):
        self.event = torch.cuda.Event()
        self.event.record(stream)


class CudaSideStream(SideStream):
    def __init__(self, device: torch.device):
        self.stream = torch.cuda.Stream(device)

    def use(self) -> AbstractContextManager:
        return torch.cuda.stream(self.stream)

    def wait(self, event: DeviceEvent) -> None:
        self.stream.wait_event(_cuda_event(event))

    def record(self) -> DeviceEvent:
        return CudaEvent(self.stream)


class CudaRuntime(DeviceRuntime):
    """A CUDA device: pinned host buffers, side streams, CUDA events, CuPy RawKernel launches."""

    def __init__(self, device: torch.device):
        super().__init__(device)
        self._kernels: dict[tuple[str, str], Any] = {}
        self._streams: dict[int, Any] = {}

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory()

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """Copied from pageable memory, the calling thread waiting for its copy, not pinned first.

        Pinning every staged tensor (`pin_memory()`, then a non-blocking copy) cost the step on
        the other thread: on an H200 (DLRM, batch 4096, the trainer's step over 200 steps, runs
        alternating in one process) 9.0 and 10.2 ms at the median and 20-23 ms at p90 with
        pinning, 5.9 and 5.9 ms (p90 6.8) with this copy, 5.6 and 6.4 ms with no transfer thread
        at all. A batch is a few MB; the thread that waits for the copy is the transfer stage's."""
        return tensor.to(self.device)

    def side_stream(self) -> SideStream:
        return CudaSideStream(self.device)

    def record_current(self) -> DeviceEvent:
        return CudaEvent(torch.cuda.current_stream(self.device))

    def wait_current(self, event: DeviceEvent) -> None:
        torch.cuda.current_stream(self.device).wait_event(_cuda_event(event))

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def seed(self, seed: int) -> None:
        super().seed(seed)
        torch.cuda.manual_seed_all(seed)

    def launch(self, kernel: KernelSource, config: LaunchConfig, args: tuple[Any, ...]) -> None:
        cupy = importlib.import_module("cupy")
        key = (kernel.source, kernel.entry)
        if key not in self._kernels:
            self._kernels[key] = cupy.RawKernel(kernel.source, kernel.entry)
        converted = tuple(cupy.from_dlpack(a.detach()) if isinstance(a, torch.Tensor) else a for a in args)
        stream = self._cupy_stream(cupy, torch.cuda.current_stream(self.device).cuda_stream)
        with cupy.cuda.Device(self.device.index or 0), stream:
            self._kernels[key]((config.grid,), (config.block,), converted,
                               shared_mem=config.shared_mem_bytes)

    def _cupy_stream(self, cupy: Any, handle: int) -> Any:
        """CuPy's view of torch's stream `handle` (kept per handle: torch's streams live on).

        CuPy 14 deprecates `ExternalStream` for `Stream.from_external`, which takes an object
        with the CUDA stream protocol (`__cuda_stream__`); older CuPy has only `ExternalStream`."""
        stream = self._streams.get(handle)
        if stream is None:
            from_external = getattr(cupy.cuda.Stream, "from_external", None)
            if from_external is not None:
                stream = from_external(_TorchStreamHandle(handle))
            else:
                stream = cupy.cuda.ExternalStream(handle, self.device.index or 0)
            self._streams[handle] = stream
        return stream


class _TorchStreamHandle:
    """A raw CUDA stream handle offered through the CUDA stream protocol (version 0)."""

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


def _cuda_event(event: DeviceEvent) -> Any:
    if not isinstance(event, CudaEvent):
        raise TypeError(f"a CUDA runtime got a {type(event).__name__}")
    return event.event


class CompiledCall:
    """`fn` through `torch.compile`, falling back to eager for good when compiling fails.

    Compilation happens on a call (each new input shape or autocast state compiles once more); a
    failure there (no C++ compiler, an unsupported operator, a backend error) or a `torch.compile`
    that is missing or refuses `fn` leaves `failure` set (one line) and the call is run eagerly.
    An error that eager raises as well is the caller's: it propagates unchanged and compiling
    stays on.

    Args:
        fn: the function to compile (tensors in, tensors out).
        backend: torch.compile backend ("inductor"; tests pass a failing one).

    Example:
        >>> call = CompiledCall(lambda x: torch.relu(x) * 2)  # doctest: +SKIP
        >>> call(torch.randn(4)).shape  # doctest: +SKIP
        torch.Size([4])
    """

    def __init__(self, fn: Callable[..., Any], backend: Any = "inductor") -> None:
        self.eager = fn
        self.failure: str | None = None
        self.calls = 0  # calls that ran the compiled code
        try:
            self._compiled: Callable[..., Any] | None = torch.compile(fn, backend=backend, dynamic=False)
        except Exception as exc:  # torch.compile missing, or refusing fn (an unsupported Python)
            self._compiled = None
            self.failure = _first_line(exc)

    @property
    def active(self) -> bool:
        """True while calls run the compiled code."""
        return self._compiled is not None

    def __call__(self, *args: Any) -> Any:
        if self._compiled is None:
            return self.eager(*args)
        try:
            out = self._compiled(*args)
        except Exception as exc:
            out = self.eager(*args)  # raises when the error is the caller's (compiled stays on)
            self._compiled = None  # a compile failure: eager from now on
            self.failure = _first_line(exc)
            warnings.warn(f"torch.compile failed, the dense stage runs eagerly: {self.failure}", stacklevel=2)
            return out
        self.calls += 1
        return out


def _first_line(exc: BaseException) -> str:
    """The root cause of `exc` in one line (a backend's error is wrapped by torch._dynamo)."""
    root, seen = exc, {id(exc)}
    while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None and id(inner) not in seen:
        root = inner
        seen.add(id(inner))
    text = str(root).strip().splitlines()
    return f"{type(root).__name__}: {text[0] if text else ''}"[:300]


def runtime_for(device: torch.device | str) -> DeviceRuntime:
    """The runtime of `device`: CUDA for a cuda device, else the CPU runtime."""
    device = torch.device(device)
    return CudaRuntime(device) if device.type == "cuda" else CpuRuntime(device)


def cupy_usable() -> bool:
    """True when cupy imports and sees a CUDA device."""
    try:
        cupy = importlib.import_module("cupy")
        return bool(cupy.cuda.is_available())
    except Exception:  # an importable cupy without a driver raises various errors
        return False


@dataclass(frozen=True)
class CudaDeviceInfo:
    """One visible CUDA device.

    Args:
        index: device ordinal.
        name: marketing name.
        capability: compute capability, e.g. "9.0".
        total_bytes: device memory, bytes.
        free_bytes: free device memory now, bytes.
    """

    index: int
    name: str
    capability: str
    total_bytes: int
    free_bytes: int


def nccl_version() -> str | None:
    """The NCCL version torch was built with (None without CUDA)."""
    if not torch.cuda.is_available():
        return None
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def cuda_devices() -> list[CudaDeviceInfo]:
    """The visible CUDA devices (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    out = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        free, total = torch.cuda.mem_get_info(index)
        out.append(CudaDeviceInfo(index, props.name, f"{props.major}.{props.minor}", int(total), int(free)))
    return out


def bf16_native(device: torch.device) -> bool:
    """Whether bf16 matrix products run in hardware on `device`: a CUDA device that supports bf16,
    or a CPU where oneDNN has bf16 kernels (AVX-512 BF16, AMX or AVX-512 core, as oneDNN itself
    decides). Elsewhere (an AVX2-only CPU) autocast's bf16 GEMMs fall back to oneDNN's reference
    kernels: the DLRM step measured 24x slower than fp32 on such a CPU (Round 6 in
    docs/benchmarks/training-rounds-3-10.md).
    True when it cannot tell (an older torch without the probe): never a false alarm."""
    if device.type == "cuda":
        return bool(torch.cuda.is_bf16_supported())
    if device.type != "cpu":
        return True
    probe = getattr(getattr(torch.ops, "mkldnn", None), "_is_mkldnn_bf16_supported", None)
    try:
        return True if probe is None else bool(probe())
    except Exception:  # noqa: BLE001 - an internal op of torch: unknown means no warning
        return True


def free_memory(device: torch.device) -> int:
    """Bytes free on a CUDA device now (torch's and every other process's allocations excluded)."""
    free, _ = torch.cuda.mem_get_info(device)
    return int(free)


def device_name(device: torch.device) -> str:
    """The product name of a CUDA device ("" for any other device)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def select_device(device: torch.device) -> None:
    """Make `device` this process's current CUDA device (one rank per GPU); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.set_device(device)


def forked_generators(device: torch.device) -> AbstractContextManager:
    """A block whose use of torch's process generators (the CPU one, and `device`'s when it is a
    CUDA device) leaves them as they were before it."""
    if device.type != "cuda":
        return torch.random.fork_rng(devices=[])
    index = device.index if device.index is not None else torch.cuda.current_device()
    return torch.random.fork_rng(devices=[index])
