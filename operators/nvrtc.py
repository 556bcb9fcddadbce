"""NVRTC compile check of the CUDA kernels, with no GPU and no driver.

Uses the `cuda-bindings` and `nvidia-cuda-nvrtc-cu12` wheels (the `gpucheck` extra). Each
`KernelSource` in `operators.cupy_kernels.KERNELS` is compiled to PTX for a virtual architecture
(compute_80, compute_90) and to a cubin for the matching real one (sm_80, sm_90: ptxas runs too),
and NVRTC's log (errors with line numbers) comes back in the `CompileResult`.

Example:
    >>> from operators.cupy_kernels import KERNELS
    >>> [r.ok for r in compile_all(KERNELS)]  # doctest: +SKIP
    [True, True]
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Any, Iterable

from operators.device import KernelSource

ARCHS = ("80", "90")  # compute capabilities compiled for: A100 (sm_80), H100 (sm_90)


@dataclass(frozen=True)
class CompileResult:
    """One kernel compiled for one architecture.

    Args:
        kernel: kernel name.
        arch: compute capability, e.g. "90".
        ok: PTX and cubin both compiled.
        log: NVRTC's log (compile errors with file and line), stripped.
        ptx_bytes: size of the PTX, bytes (0 when it failed).
        cubin_bytes: size of the cubin, bytes (0 when it failed).
    """

    kernel: str
    arch: str
    ok: bool
    log: str
    ptx_bytes: int
    cubin_bytes: int


def nvrtc_module() -> tuple[Any | None, str]:
    """(cuda.bindings.nvrtc, its version) or (None, why it is not usable)."""
    try:
        nvrtc = importlib.import_module("cuda.bindings.nvrtc")
        err, major, minor = nvrtc.nvrtcVersion()
    except Exception as exc:  # missing wheel, or the NVRTC library not found
        return None, (f"NVRTC not usable ({type(exc).__name__}: {exc}); "
                      "install it with pip install -e '.[gpucheck]'")
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        return None, f"NVRTC not usable: nvrtcVersion returned {err}"
    return nvrtc, f"{major}.{minor}"


def _compile(nvrtc: Any, kernel: KernelSource, option: str) -> tuple[bool, str, bytes]:
    err, prog = nvrtc.nvrtcCreateProgram(kernel.source.encode(), f"{kernel.name}.cu".encode(), 0, [], [])
    try:
        (result,) = nvrtc.nvrtcCompileProgram(prog, 2, [option.encode(), b"--std=c++17"])
        _, size = nvrtc.nvrtcGetProgramLogSize(prog)
        log = bytearray(size)  # never b" " * size: a 1-byte bytes object is an interned singleton
        nvrtc.nvrtcGetProgramLog(prog, log)
        text = log.rstrip(b"\x00 ").decode(errors="replace").strip()
        if result != nvrtc.nvrtcResult.NVRTC_SUCCESS:
            return False, text, b""
        real = option.split("=")[1].startswith("sm_")
        get_size, get = ((nvrtc.nvrtcGetCUBINSize, nvrtc.nvrtcGetCUBIN) if real
                         else (nvrtc.nvrtcGetPTXSize, nvrtc.nvrtcGetPTX))
        _, size = get_size(prog)
        out = bytearray(size)
        get(prog, out)
        return True, text, out
    finally:
        nvrtc.nvrtcDestroyProgram(prog)


def compile_kernel(kernel: KernelSource, arch: str) -> CompileResult:
    """Compile `kernel` to PTX for compute_<arch> and to a cubin for sm_<arch>.

    Raises:
        RuntimeError: NVRTC is not installed (see `nvrtc_module`).
    """
    nvrtc, note = nvrtc_module()
    if nvrtc is None:
        raise RuntimeError(note)
    ok_ptx, log_ptx, ptx = _compile(nvrtc, kernel, f"--gpu-architecture=compute_{arch}")
    if not ok_ptx:
        return CompileResult(kernel.name, arch, False, log_ptx, 0, 0)
    ok_bin, log_bin, cubin = _compile(nvrtc, kernel, f"--gpu-architecture=sm_{arch}")
    return CompileResult(kernel.name, arch, ok_bin, "\n".join(t for t in (log_ptx, log_bin) if t),
                         len(ptx), len(cubin))


def compile_all(kernels: Iterable[KernelSource], archs: Iterable[str] = ARCHS) -> list[CompileResult]:
    """Every kernel for every architecture."""
    return [compile_kernel(k, a) for k in kernels for a in archs]
