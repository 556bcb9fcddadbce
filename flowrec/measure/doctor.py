"""`flowrec doctor`: what this machine has, and quick self-checks of what it can run.

Versions (flowrec, Python, torch and its CUDA, CuPy, NCCL, NVRTC, dask, pyarrow, numpy), devices
and their memory, then checks, each passed, failed or skipped with the reason:

- `kernels`: every CUDA kernel compiles with NVRTC for sm_80 and sm_90 and every launch
  configuration meets its kernel's assumptions (needs the `gpucheck` extra);
- `train/<device>`: 20 training steps of a small spec; on the CPU against the plain-PyTorch
  reference model (`flowrec.measure.reference`), on every CUDA device against the CPU result;
- `collective/gloo`, `collective/nccl`: two processes (`torch.distributed`, a free port chosen
  now, a timeout) all-reduce a tensor; nccl needs two GPUs.

Example:
    >>> report = run_doctor()  # doctest: +SKIP
    >>> report.ok, [c.name for c in report.checks if c.status == "skip"]  # doctest: +SKIP
"""
from __future__ import annotations

import importlib.metadata
import os
import platform
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

from flowrec.runtime.distributed.launch import free_port, run_local_ranks

TRAIN_STEPS = 20
TRAIN_BATCH = 64  # samples per step
TRAIN_RTOL, TRAIN_ATOL = 1e-3, 1e-4  # fp32 parameters after TRAIN_STEPS steps, device vs reference
COLLECTIVE_TIMEOUT_S = 60  # wall limit of the two-process check
PACKAGES = {"dask": "dask", "pyarrow": "pyarrow", "numpy": "numpy"}
# CuPy ships one wheel per CUDA major version (cupy-cuda12x for CUDA 12, cupy-cuda13x for 13, ...)
# and `cupy` built from source; the first one installed is reported, with its name
CUPY_DISTRIBUTIONS = ("cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x", "cupy")


@dataclass(frozen=True)
class Check:
    """One self-check.

    Args:
        name: e.g. `train/cpu`.
        status: pass, fail or skip.
        detail: what was compared, or why it failed or was skipped.
        seconds: wall time, s.
    """

    name: str
    status: str
    detail: str
    seconds: float = 0.0


@dataclass(frozen=True)
class DoctorReport:
    """Versions, devices and checks; `ok` when no check that ran failed."""

    versions: dict[str, str | None]
    devices: tuple[dict[str, Any], ...]
    checks: tuple[Check, ...]

    @property
    def ok(self) -> bool:
        return all(c.status != "fail" for c in self.checks)

    def to_dict(self) -> dict[str, Any]:
        return {"ok": self.ok, "versions": self.versions, "devices": list(self.devices),
                "checks": [asdict(c) for c in self.checks],
                "not_checked": [f"{c.name}: {c.detail}" for c in self.checks if c.status == "skip"]}


def _dist_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def versions() -> dict[str, str | None]:
    """Versions of flowrec and what it runs on (None: not installed)."""
    import torch

    from operators.device import nccl_version
    from operators.nvrtc import nvrtc_module

    module, note = nvrtc_module()
    out = {"flowrec": _dist_version("flowrec"), "python": platform.python_version(), "torch": torch.__version__,
           "torch_cuda": torch.version.cuda, "nccl": nccl_version(), "nvrtc": note if module else None}
    out.update({key: _dist_version(dist) for key, dist in PACKAGES.items()})
    out["cupy"] = cupy_version()
    return out


def cupy_version() -> str | None:
    """The installed CuPy's version and wheel, e.g. `14.2.0 (cupy-cuda13x)` (None: not installed)."""
    for dist in CUPY_DISTRIBUTIONS:
        version = _dist_version(dist)
        if version is not None:
            return version if dist == "cupy" else f"{version} ({dist})"
    return None


def devices() -> tuple[dict[str, Any], ...]:
    """The CPU and every CUDA device, with memory in bytes."""
    import torch

    from operators.device import bf16_native, cuda_devices

    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    cpu = {"device": "cpu", "name": platform.processor() or platform.machine(), "cores": os.cpu_count(),
           "memory_bytes": pages * os.sysconf("SC_PAGE_SIZE") if pages else None,
           "bf16": "native" if bf16_native(torch.device("cpu")) else "emulated", **cpu_gemm()}
    return (cpu, *({"device": f"cuda:{d.index}", "name": d.name, "capability": d.capability,
                    "memory_bytes": d.total_bytes, "free_bytes": d.free_bytes} for d in cuda_devices()))


def cpu_gemm() -> dict[str, str]:
    """The CPU's vendor and the library its fp32 training GEMMs run through (`operators.onednn.
    gemm_library`: "mkl" on Intel's CPUs, else "onednn"; $FLOWREC_CPU_GEMM forces one). An invalid
    $FLOWREC_CPU_GEMM is reported here (training would refuse it), not raised."""
    from operators.onednn import cpu_vendor, gemm_library

    try:
        library = gemm_library()
    except ValueError as exc:
        library = f"invalid ({exc})"
    return {"vendor": cpu_vendor() or "unknown", "gemm": library}


def timed(name: str, fn: Callable[[], tuple[str, str]]) -> Check:
    """Run a check; an exception is a failure with its one-line message."""
    start = time.perf_counter()
    try:
        status, detail = fn()
    except Exception as exc:  # a check that crashes failed; the report says how
        status, detail = "fail", f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return Check(name, status, detail, round(time.perf_counter() - start, 2))


def check_kernels() -> tuple[str, str]:
    """Every kernel compiled for every architecture; every launch over dims 1..max checked."""
    from operators.cupy_kernels import CASTED_ROWWISE_ADAGRAD, KERNELS, MAX_DIM, check_launch, rowwise_launch
    from operators.nvrtc import ARCHS, compile_all, nvrtc_module

    module, note = nvrtc_module()
    if module is None:
        return "skip", note
    failed = [f"{r.kernel} sm_{r.arch}: {r.log.splitlines()[0] if r.log else 'failed'}"
              for r in compile_all(KERNELS) if not r.ok]
    bad = [f"dim {d}: {p}" for d in range(1, MAX_DIM + 1)
           for p in check_launch(CASTED_ROWWISE_ADAGRAD, rowwise_launch(1, d), d)]
    if failed or bad:
        return "fail", "; ".join(failed + bad[:3])
    return "pass", (f"{len(KERNELS)} kernel(s) compiled for sm_{', sm_'.join(ARCHS)} with NVRTC {note}; "
                    f"launches for dims 1..{MAX_DIM} valid")


def small_spec() -> Any:
    """The doctor's model: shared and multi-hot tables, a dot interaction, rowwise Adagrad."""
    from flowrec.spec import spec_from_dict

    return spec_from_dict({
        "name": "doctor",
        "features": [
            {"name": "x0", "type": "dense", "transform": "log1p"},
            {"name": "x1", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 500, "dim": 16},
            {"name": "item", "type": "categorical", "table": "items"},
            {"name": "recent", "type": "sequence", "table": "items", "max_len": 4, "pooling": "mean"},
            {"name": "site", "type": "categorical", "hash_buckets": 30, "dim": 16},
        ],
        "tables": [{"name": "items", "vocab": 800, "dim": 16}],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense"], "layers": [32, 16]},
            {"name": "inter", "kind": "dot", "inputs": ["bottom", "user", "item", "recent", "site"]},
            {"name": "top", "kind": "mlp", "inputs": ["inter", "bottom"], "layers": [32]},
        ],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "rowwise_adagrad", "lr": 0.05}},
        "training": {"batch_size": TRAIN_BATCH, "seed": 7},
    })


def training_batches(spec: Any, groups: Any) -> list[Any]:
    """TRAIN_STEPS staged batches of synthetic data (lookahead castings, as training stages them)."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table

    table = synth_table(spec, TRAIN_BATCH * TRAIN_STEPS, SynthConfig(seed=7, alpha=1.2))
    opts = StagingOptions(batch_size=TRAIN_BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, groups) as it:
        return list(it)


def train_on(device: Any, spec: Any, plan: Any, batches: list[Any]) -> tuple[dict[str, Any], list[float]]:
    """TRAIN_STEPS flowrec steps of `plan` on `device` through the transfer stage; (parameters on the
    CPU, losses). The same plan runs on every device (all tables resident)."""
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.pipeline import TransferStage
    from flowrec.runtime.step import make_dense_optimizer, train_step

    model = lower(plan, spec, device)
    opt = spec.dense_optimizer
    optimizer = make_dense_optimizer(model, opt.name, opt.lr, dict(opt.params))
    with TransferStage(iter(batches), model.device, 2) as staged:
        losses = [train_step(model, optimizer, batch) for batch in staged]
    params = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    model.close()
    return params, losses


def reference_params(spec: Any, plan: Any, batches: list[Any]) -> dict[str, Any]:
    """The plain-PyTorch reference trained on the same batches, in flowrec's state-dict keys."""
    import torch

    from flowrec.measure.reference import ReferenceModel, reference_optimizers, reference_step

    ref = ReferenceModel(plan, spec)
    optimizers = reference_optimizers(ref, spec)
    for batch in batches:
        reference_step(ref, optimizers, batch)
    out = {f"ops.{k}": v.detach() for k, v in ref.dense_model.ops.named_parameters()}
    for group in plan.meta.groups:
        out[f"embeddings.{group.name}.weight"] = torch.cat([ref.table(t.table).weight.detach()
                                                            for t in group.tables])
    return out


def compare(got: dict[str, Any], want: dict[str, Any]) -> tuple[str, float]:
    """(first key not allclose or "", max abs difference over the keys of `want`)."""
    import torch

    worst, bad = 0.0, ""
    for key, value in want.items():
        diff = float((got[key].to(value.dtype) - value).abs().max()) if value.numel() else 0.0
        worst = max(worst, diff)
        if not bad and not torch.allclose(got[key].to(value.dtype), value, rtol=TRAIN_RTOL, atol=TRAIN_ATOL):
            bad = key
    return bad, worst


def check_training(devices_to_check: list[str], plan_of: Callable[[Any], Any]) -> list[Check]:
    """`train/cpu` against the reference, then `train/cuda:i` against the CPU result.

    Args:
        devices_to_check: CUDA devices to train on besides the CPU.
        plan_of: the planner (spec -> all-resident plan); the runtime does not plan.
    """
    import torch

    spec = small_spec()
    plan = plan_of(spec)
    batches = training_batches(spec, plan.meta.groups)
    cpu: dict[str, Any] = {}

    def cpu_check() -> tuple[str, str]:
        params, losses = train_on(torch.device("cpu"), spec, plan, batches)
        cpu.update(params)
        bad, worst = compare(params, reference_params(spec, plan, batches))
        if bad:
            return "fail", f"{bad} differs from the plain-PyTorch reference (max abs diff {worst:.2e})"
        return "pass", (f"{TRAIN_STEPS} steps equal the plain-PyTorch reference (max abs diff {worst:.1e}); "
                        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}")

    def device_check(name: str) -> Callable[[], tuple[str, str]]:
        def run() -> tuple[str, str]:
            if not cpu:
                return "fail", "the CPU result it is compared with failed"
            params, _ = train_on(torch.device(name), spec, plan, batches)
            bad, worst = compare(params, cpu)
            if bad:
                return "fail", f"{bad} differs from the CPU result (max abs diff {worst:.2e})"
            return "pass", f"{TRAIN_STEPS} steps equal the CPU result (max abs diff {worst:.1e})"
        return run

    checks = [timed("train/cpu", cpu_check)]
    checks += [timed(f"train/{name}", device_check(name)) for name in devices_to_check]
    return checks


def check_collective(backend: str, world: int = 2) -> tuple[str, str]:
    """`world` processes all-reduce their rank + 1 over `backend`; each must see the sum."""
    port = free_port()
    try:
        outputs = run_local_ranks("flowrec.measure.doctor", backend, world, port, COLLECTIVE_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return "fail", f"{backend}: no result within {COLLECTIVE_TIMEOUT_S} s"
    want = str(float(world * (world + 1) // 2))
    bad = [f"rank {r}: exit {code}, {out or (err.splitlines()[-1:] or [''])[0]}"
           for r, (code, out, err) in enumerate(outputs) if code != 0 or out != want]
    if bad:
        return "fail", f"{backend} all_reduce: " + "; ".join(bad)
    return "pass", f"{world} processes, {backend} all_reduce = {want} on port {port}"


def collective_worker(backend: str, rank: int, world: int, port: int) -> None:
    """One rank of `check_collective`: prints the all-reduced value."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S // 2))
    try:
        value = torch.tensor([float(rank + 1)], device=device)
        dist.all_reduce(value)
        print(float(value.cpu()[0]), flush=True)
    finally:
        dist.destroy_process_group()


def run_doctor(plan_of: Callable[[Any], Any], status: Callable[[str], None] = lambda _: None) -> DoctorReport:
    """Versions, devices and every check this machine can run (`plan_of`: spec -> plan, the planner)."""
    status("versions and devices")
    found = devices()
    gpus = [d["device"] for d in found if d["device"].startswith("cuda")]
    status("kernel compilation")
    checks = [timed("kernels", check_kernels)]
    status("training")
    checks += check_training(gpus, plan_of)
    if not gpus:
        checks.append(Check("train/cuda", "skip", "no CUDA device on this machine"))
    status("collectives")
    checks.append(timed("collective/gloo", lambda: check_collective("gloo")))
    if len(gpus) >= 2:
        checks.append(timed("collective/nccl", lambda: check_collective("nccl")))
    else:
        checks.append(Check("collective/nccl", "skip", f"needs 2 or more CUDA devices (found {len(gpus)})"))
    return DoctorReport(versions(), found, tuple(checks))


def _main(argv: list[str]) -> None:
    backend, rank, world, port = argv
    collective_worker(backend, int(rank), int(world), int(port))


if __name__ == "__main__":
    _main(sys.argv[1:])
