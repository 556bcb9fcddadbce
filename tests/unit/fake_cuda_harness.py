"""The fake-CUDA tier's subprocess: a training step's explicit parts on fake CUDA tensors.

Run as `python tests/unit/fake_cuda_harness.py SPEC... [--placements ...] [--plant FILE]`; prints
one JSON line per (spec, placement) with the findings. Host tensors stay real (the caches'
bookkeeping needs their values); every tensor created on or moved to `cuda` is a FakeTensor
(`torch._subclasses.fake_tensor`), so a CPU tensor meeting a CUDA one raises
`FakeTensorDeviceMismatchError`, and a value read from a CUDA tensor (`.item()`, `.tolist()`,
`.numpy()`, a boolean mask's data-dependent shape) cannot be produced. Findings:

- `device mismatch`: tensors on different devices in one op;
- `host sync`: a CUDA tensor's value read on the host, or a device-to-host copy (`.cpu()`,
  `.to("cpu")`) outside the copies the plan accounts for (`ACCOUNTED_D2H`: write-backs and
  gradients of host-side rows, counted by the caches' d2h counters);
- `error`: anything else that stopped the step.
Each names the innermost project frame (file:line, function).

Autograd on fake CUDA tensors aborts the process on a CPU-only torch, so the step runs its parts
explicitly: the transfer stage's move, the packed lookups (custom autograd Functions are taped
instead of recorded), the dense forward and loss under no_grad, then each taped Function's
backward (casted gather-reduce + fused sparse update, cache write-backs) with a gradient of ones.
The schedule is the sequential one (`set_interleave(False)`): fake-tensor dispatch is not
thread-safe; the threaded schedule is checked on the CPU runtime (test_fake_cuda_runtime.py).
Streams, events and pinned buffers are `operators.device`'s; here its CUDA runtime is replaced
by a recording one, and tests/unit/test_fake_cuda_static.py checks no other module uses them.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

import torch
from torch._subclasses.fake_tensor import (DataDependentOutputException, DynamicOutputShapeException,
                                           FakeTensor, FakeTensorDeviceMismatchError, FakeTensorMode)
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from operators import device as device_module  # noqa: E402

CUDA = torch.device("cuda", 0)
PLACEMENTS = ("device", "host", "static_hot", "lookahead")
MAX_ROWS = 2_000  # rows per shrunken table
BATCH = 48  # samples per batch
STEPS = 4  # batches per (spec, placement)
WINDOW = 2  # lookahead window, batches (fewer than STEPS: rows are evicted and written back)
FAKE_DEVICE_NAME = "NVIDIA H100 80GB HBM3"  # what the planner's cost target sees
ACCOUNTED_D2H = {  # (file, function) -> why the plan counts this device-to-host copy
    ("flowrec/runtime/caches/scratchpad.py", "_write_back"): "victim rows written back (d2h counter)",
    ("flowrec/runtime/caches/scratchpad.py", "flush"): "rows written back for a checkpoint (d2h counter)",
    ("flowrec/runtime/caches/static_hot.py", "update"): "cold-row gradients to the host (d2h counter)",
    ("flowrec/runtime/caches/static_hot.py", "_sync_dirty"): "hot rows synced at a switch (d2h counter)",
}
NOT_LINKED = "not linked with support for cuda devices"  # a CPU-only torch's CUDA device guard
SCALAR_READS = ("item", "tolist", "numpy", "__float__", "__int__", "__bool__", "__index__")
OWN_FILES = (str(Path(__file__).resolve()), str(Path(torch.__file__).parent), os.path.dirname(os.__file__))


@dataclass(frozen=True)
class Finding:
    """One problem found in a step."""

    kind: str
    where: str
    function: str
    message: str


class HostSync(RuntimeError):
    """A CUDA tensor's value was needed on the host."""


def project_frame(frames: list[traceback.FrameSummary]) -> tuple[str, str]:
    """(file:line, function) of the innermost frame outside torch, the stdlib and this harness."""
    for frame in reversed(frames):
        if not frame.filename.startswith(OWN_FILES):
            path = Path(frame.filename)
            shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
            return f"{shown}:{frame.lineno}", frame.name
    return "?", "?"


def _is_cuda(value: Any) -> bool:
    return isinstance(value, torch.Tensor) and value.device.type == "cuda"


def _host_twin(value: Any) -> Any:
    return torch.ops.aten._to_copy(value, device=torch.device("cpu")) if _is_cuda(value) else value


def _cuda_twin(value: Any) -> Any:
    return torch.ops.aten._to_copy(value, device=CUDA) if isinstance(value, torch.Tensor) else value


def _wants_cuda(args: tuple, kwargs: dict) -> bool:
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.device) and value.type == "cuda":
            return True
        if isinstance(value, str) and value.startswith("cuda"):
            return True
    return False


class FakeCuda(TorchFunctionMode):
    """Real host tensors, fake CUDA tensors, and a record of host syncs (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.fake = FakeTensorMode(allow_non_fake_inputs=True)
        self.findings: list[Finding] = []
        self.accounted: dict[str, int] = {}  # accounted device-to-host copies by place
        self.in_step = False  # host syncs are findings inside a step (building the model may sync)

    def note(self, kind: str, message: str) -> Finding:
        where, function = project_frame(traceback.extract_stack()[:-2])
        finding = Finding(kind, where, function, message)
        self.findings.append(finding)
        return finding

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in SCALAR_READS and args and _is_cuda(args[0]):
            if not self.in_step:
                raise HostSync(f".{name}() reads a cuda tensor while building the model")
            raise HostSync(self.note("host sync", f".{name}() reads a cuda tensor on the host").message)
        if name in ("to", "cpu", "cuda") and args and isinstance(args[0], torch.Tensor):
            return self._to(name, args[0], args[1:], kwargs)
        if name == "pin_memory":
            self.note("cuda api", "pin_memory() outside operators/device.py")
            return args[0]
        if _wants_cuda(args, kwargs) or any(isinstance(a, FakeTensor) for a in args):
            try:
                with self.fake:
                    return func(*args, **kwargs)
            except RuntimeError as exc:
                if NOT_LINKED not in str(exc):
                    raise
            return self._via_host(func, args, kwargs)
        return func(*args, **kwargs)

    def _via_host(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """An op whose Python binding needs a CUDA device guard (indexing, `copy_`): run on fake host
        twins of the cuda tensors, results moved back to cuda (in-place ops return their target)."""
        target = args[0]
        with self.fake:
            host_args, host_kwargs = pytree.tree_map(_host_twin, (args, kwargs))
            out = func(*host_args, **host_kwargs)
            name = getattr(func, "__name__", "")
            if name == "__setitem__" or (name.endswith("_") and not name.startswith("__")):
                return target
            return pytree.tree_map(_cuda_twin, out)

    def _to(self, name: str, tensor: torch.Tensor, args: tuple, kwargs: dict) -> torch.Tensor:
        """`Tensor.to/.cpu/.cuda` through `aten._to_copy` (a CPU-only torch refuses `.to("cuda")`)."""
        if name == "cpu":
            device, dtype = torch.device("cpu"), None
        elif name == "cuda":
            device, dtype = CUDA, None
        else:
            device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        device = tensor.device if device is None else torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = CUDA
        dtype = tensor.dtype if dtype is None else dtype
        if device == tensor.device and dtype == tensor.dtype:
            return tensor
        if tensor.device.type == "cuda" and device.type == "cpu" and self.in_step:
            finding = self.note("host sync", f".{name}() copies a cuda tensor to the host")
            key = (finding.where.rsplit(":", 1)[0], finding.function)
            if key in ACCOUNTED_D2H:
                self.findings.pop()
                self.accounted[f"{key[0]}:{key[1]}"] = self.accounted.get(f"{key[0]}:{key[1]}", 0) + 1
        with self.fake:
            return torch.ops.aten._to_copy(tensor, dtype=dtype, device=device)


class RecordingCudaRuntime(device_module.CpuRuntime):
    """Stands in for `operators.device.CudaRuntime` (no CUDA streams on this machine): events
    complete when recorded; pinned buffers must be host tensors."""

    def pin(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.device.type != "cpu":
            raise RuntimeError(f"pinning a {tensor.device} tensor: only host tensors can be pinned")
        return tensor

    def upload(self, tensor: torch.Tensor) -> torch.Tensor:
        """As CUDA's: a staged host tensor copied to the device."""
        if tensor.device.type != "cpu":
            raise RuntimeError(f"uploading a {tensor.device} tensor: the transfer stage sends host tensors")
        return tensor.to(self.device)


class Tape:
    """Custom autograd Functions run forward-only and replayed backward explicitly."""

    def __init__(self) -> None:
        self.entries: list[tuple[Any, Any, torch.Tensor]] = []
        self._apply = vars(torch.autograd.Function)["apply"]

    def __enter__(self) -> "Tape":
        tape = self

        def apply(cls: Any, *args: Any) -> Any:
            ctx = SimpleNamespace()
            with torch.no_grad():
                out = cls.forward(ctx, *args)
            tape.entries.append((cls, ctx, out))
            return out

        torch.autograd.Function.apply = classmethod(apply)
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.Function.apply = self._apply

    def backward(self) -> None:
        for cls, ctx, out in reversed(self.entries):
            cls.backward(ctx, torch.ones_like(out))
        self.entries.clear()


def shrunk(spec: Any) -> Any:
    """The spec with every table capped at MAX_ROWS rows and a small batch; a managed table admits
    at first sight and expires ids unseen for a step at a pass every 2 steps, so that rows are
    freed and reset within the STEPS steps (the resets run on the fake device too)."""
    def small(t: Any) -> Any:
        if t.managed is not None:
            return replace(t, managed=replace(t.managed, admit_min_count=1, every_steps=2, ttl_steps=1))
        return replace(t, rows=min(t.rows, MAX_ROWS))

    tables = tuple(small(t) for t in spec.tables)
    return replace(spec, tables=tables, training=replace(spec.training, batch_size=BATCH))


def lowered_for_cuda(spec: Any, placement: str, cache_rows: Callable[[Any], int]) -> Any:
    """The one use of the plan/lowering APIs: plan `spec` for a CUDA device, put every group in
    `placement` (with `cache_rows(group)` device rows), lower it for `cuda`."""
    from flowrec.graph.kinds import PLACEMENTS
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.lowering import lower

    plan = make_plan(spec, target="h100")
    groups = tuple(replace(g, placement=placement, cache_rows=cache_rows(g) if PLACEMENTS[placement].cached
                           else 0) for g in plan.meta.groups)
    return lower(plan.with_meta(replace(plan.meta, groups=groups)), spec, CUDA)


def staged_batches(spec: Any, groups: Any, remap: Any = None) -> list[Any]:
    """STEPS staged batches with lookahead (castings and window rows computed by the data stage;
    managed tables' raw ids remapped by `remap`, the data stage's copy of the model's maps)."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table

    table = synth_table(spec, BATCH * STEPS, SynthConfig(seed=5))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, workers=1, lookahead=WINDOW)
    with iterate_batches(spec, MemorySource(split_table(table, 1)), opts, groups=groups, remap=remap) as it:
        return list(it)


def run_step(model: Any, batch: Any, host_groups: frozenset[str]) -> None:
    """One step's explicit parts on `model` (a LoweredModel on fake cuda)."""
    from flowrec.runtime.pipeline import TransferStage

    stage = TransferStage(iter(()), CUDA, 1, host_groups)
    stage.close()
    moved = stage._move(batch)  # staging transfer
    managed = getattr(model, "managed", None)
    if managed is not None:  # rows the batch's eviction pass freed are reset where they live
        managed.before_step(model.embeddings, moved)
    with Tape() as tape:
        emb = model.embed(moved)  # packed lookups, cache exchanges
    with torch.no_grad():
        logits = model.dense_forward(moved.dense, emb, model.sequence_masks(moved))  # dense forward
        model.loss(logits, moved.labels)
    for name, out in emb.items():
        if out.device.type != "cuda":
            raise RuntimeError(f"group {name}: lookup output on {out.device}, not on the compute device")
    tape.backward()  # casted backward + fused sparse update
    if managed is not None:
        managed.after_step(moved)  # the model's maps replay the batch's map step


def check_spec(spec_path: Path, placements: list[str], mode: FakeCuda) -> list[dict[str, Any]]:
    """Every finding of STEPS steps of `spec_path` with every group in each placement."""
    from flowrec.spec import load_spec

    spec = shrunk(load_spec(spec_path))
    state: dict[str, Any] = {}
    out = []
    for placement in ("device", *[p for p in placements if p != "device"]):
        start = time.perf_counter()
        mode.findings, mode.accounted, mode.in_step = [], {}, False
        try:
            with mode:
                check_placement(spec, placement, state, mode)
        except FakeTensorDeviceMismatchError as exc:
            mode.findings.append(_finding("device mismatch", exc, str(exc).splitlines()[0]))
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            mode.findings.append(_finding("host sync", exc, f"the value or shape of a cuda tensor is needed "
                                                            f"on the host ({exc})"))
        except HostSync as exc:
            if not mode.in_step:  # inside a step it was noted where it happened
                mode.findings.append(_finding("error", exc, str(exc)))
        except Exception as exc:  # reported with its place, never swallowed
            mode.findings.append(_finding("error", exc, f"{type(exc).__name__}: {exc}"))
        if placement in placements:
            out.append({"spec": spec_path.name, "placement": placement,
                        "findings": [asdict(f) for f in mode.findings], "accounted_d2h": mode.accounted,
                        "reset_rows": state.get("resets", 0),
                        "seconds": round(time.perf_counter() - start, 2)})
    return out


def _finding(kind: str, exc: BaseException, message: str) -> Finding:
    where, function = project_frame(traceback.extract_tb(exc.__traceback__))
    return Finding(kind, where, function, message)


def check_placement(spec: Any, placement: str, state: dict[str, Any], mode: FakeCuda) -> None:
    """STEPS steps with every group in `placement`; the device placement runs first and stages
    the batches (kept in `state`) and the window sizes the caches are given."""
    from flowrec.runtime.caches import hottest_rows
    from flowrec.runtime.placement import HOST_SIDE

    if placement == "device":
        model = lowered_for_cuda(spec, "device", lambda g: 0)
        managed = getattr(model, "managed", None)
        state["batches"] = staged_batches(spec, model.groups, managed.remapper(True) if managed else None)
        state["window"] = {g.name: max(b.groups[g.name].window_unique.numel() for b in state["batches"])
                           for g in model.groups}
    else:
        model = lowered_for_cuda(spec, placement, lambda g: max(state["window"][g.name], 1))
    batches = state["batches"]
    model.set_interleave(False)
    if placement == "static_hot":
        for name, module in model.embeddings.items():
            ids = torch.cat([b.groups[name].ids for b in batches])
            module.set_hot_rows(hottest_rows(torch.bincount(ids, minlength=module.group.rows),
                                             max(module.group.cache_rows // 2, 1)))
    host = frozenset(g.name for g in model.groups if g.placement in HOST_SIDE)
    mode.in_step = True
    for batch in batches:
        run_step(model, batch, host)
    mode.in_step = False
    model.close()
    state["resets"] = sum(int(rows.numel()) for b in batches if b.managed is not None
                          for rows in b.managed.resets.values())


def load_plant(path: Path) -> None:
    """Import a file that changes the code under test (the tests plant misplaced tensors this way)."""
    spec = importlib.util.spec_from_file_location("fake_cuda_plant", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("specs", nargs="+", type=Path)
    parser.add_argument("--placements", nargs="+", default=list(PLACEMENTS), choices=PLACEMENTS)
    parser.add_argument("--plant", type=Path, default=None)
    args = parser.parse_args(argv)
    torch.cuda.get_device_name = lambda *a: FAKE_DEVICE_NAME
    device_module.CudaRuntime = RecordingCudaRuntime
    if args.plant is not None:
        load_plant(args.plant)
    mode = FakeCuda()
    for spec_path in args.specs:
        for result in check_spec(spec_path, args.placements, mode):
            print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
