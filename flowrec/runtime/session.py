"""Everything `flowrec train` / `flowrec eval` need, resolved from a spec and the options:
the device, the plan, the lowered model and the train / evaluation data.

Data, in order of precedence: `--data DIR` (an encoded dataset; `DIR/train` + `DIR/test` when
split), the spec's data binding (raw files converted once into the run folder), or synthetic data
generated from the spec (the embedded default job).

Example:
    >>> s = prepare(Path("specs/dlrm_criteo.yaml"), SessionOptions(synthetic_rows=10_000))  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable

import torch

from flowrec.data.dataset import MemorySource, ParquetSource, split_table
from flowrec.data.layout import DataError, META_FILE, check_spec, read_meta
from flowrec.graph.types import PlanMeta
from flowrec.planner.manager import make_plan
from flowrec.planner.report import plan_json
from flowrec.runtime.lowering import LoweredModel, lower
from flowrec.spec.model import ModelSpec

SYNTH_ROWS = 400_000  # default synthetic training rows of the embedded job
EVAL_FRACTION = 0.2  # synthetic evaluation rows, as a fraction of the training rows
SYNTH_PARTITIONS = 8


@dataclass(frozen=True)
class SessionOptions:
    """How to resolve a run.

    Args:
        data: encoded dataset folder (overrides the spec's binding).
        eval_data: encoded evaluation dataset folder.
        device: auto, cpu or cuda.
        device_budget: device memory budget for the planner (e.g. "4GiB").
        synthetic_rows: rows of synthetic training data when no data is given or bound.
        seed: overrides the spec's training seed.
        workdir: where bound raw data is converted (the run folder).
        dask: read partitions through Dask: a scheduler address, or "local" for a local cluster
            (None: direct pyarrow reads, the faster default; see docs/data.md).
    """

    data: Path | None = None
    eval_data: Path | None = None
    device: str = "auto"
    device_budget: str | None = None
    synthetic_rows: int = SYNTH_ROWS
    seed: int | None = None
    workdir: Path | None = None
    dask: str | None = None


@dataclass
class Session:
    spec: ModelSpec
    plan: Any
    plan_document: str
    model: LoweredModel
    device: torch.device
    train: Any
    eval: Any | None
    data_note: str


def resolve_device(name: str) -> torch.device:
    """auto -> cuda when available, else cpu; cuda without CUDA is a clear error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise RuntimeError("--device cuda was asked for, but CUDA is not available on this machine")
    return torch.device(name)


def cost_target(device: torch.device) -> str:
    """The cost-model profile of a device (cpu, a100, h100)."""
    if device.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(device).lower()
    return "a100" if "a100" in name else "h100"


def runnable_groups(plan: Any) -> tuple[Any, list[str]]:
    """Placements the runtime runs: device, host, static_hot and lookahead (`flowrec.runtime.caches`).

    A cache placement planned without device rows runs as host; every cache group gets a note.
    """
    notes, groups = [], []
    for g in plan.meta.groups:
        if g.placement in ("static_hot", "lookahead"):
            if g.cache_rows < 1:
                notes.append(f"group {g.name}: placement {g.placement} has no cache rows; runs as host")
                g = replace(g, placement="host")
            else:
                notes.append(f"group {g.name}: placement {g.placement} with {g.cache_rows:,} device rows")
        groups.append(g)
    meta: PlanMeta = replace(plan.meta, groups=tuple(groups))
    return replace(plan, meta=meta), notes


def plan_for(spec: ModelSpec, device: torch.device, device_budget: str | None = None,
             status: Callable[[str], None] = lambda _: None) -> tuple[Any, str]:
    """The plan the runtime runs on `device`, and the planner's own plan as JSON text.

    On a CPU every table is resident unless a device budget is given (then the planner's
    placements run as they would on a GPU, which shows their traffic on any machine).
    """
    plan = make_plan(spec, target=cost_target(device), device_budget=device_budget)
    plan_document = plan_json(plan)
    budgeted = device_budget is not None or spec.plan.device_budget_bytes is not None
    if device.type == "cpu" and not budgeted:  # host memory is the device: every table is resident
        plan = replace(plan, meta=replace(plan.meta, groups=tuple(
            replace(g, placement="device") for g in plan.meta.groups)))
    plan, notes = runnable_groups(plan)
    for note in notes:
        status(note)
    return plan, plan_document


def prepare(spec: ModelSpec, spec_path: Path, opts: SessionOptions,
            status: Callable[[str], None] = lambda _: None) -> Session:
    """Resolve device, plan, model and data for a run."""
    if opts.seed is not None:
        spec = replace(spec, training=replace(spec.training, seed=opts.seed))
    device = resolve_device(opts.device if opts.device != "auto" else spec.plan.device)
    plan, plan_document = plan_for(spec, device, opts.device_budget, status)
    train, evaluation, note = resolve_data(spec, spec_path, opts, status)
    if spec.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    status(f"building model on {device} ({len(plan.meta.groups)} packed groups)")
    try:
        model = lower(plan, spec, device)
    except (torch.OutOfMemoryError, RuntimeError) as exc:
        if "memory" not in str(exc).lower():
            raise
        raise RuntimeError(out_of_memory_message(plan, device, exc)) from None
    return Session(spec, plan, plan_document, model, device, train, evaluation, note)


def out_of_memory_message(plan: Any, device: torch.device, exc: BaseException) -> str:
    """Name the tables that were being placed and the budget the planner assumed."""
    from flowrec.spec.units import format_bytes

    groups = sorted(plan.meta.groups, key=lambda g: -g.bytes)
    placed = ", ".join(f"{g.name} ({len(g.tables)} tables, {format_bytes(g.bytes)} with optimizer state, "
                       f"placement {g.placement})" for g in groups[:5])
    return (f"out of memory building the model on {device}: {placed}; the planner assumed a device "
            f"budget of {format_bytes(plan.device_budget_bytes)}. Give a smaller --device-budget so "
            f"more tables go to host or cache placements, or use --device cpu. ({str(exc).splitlines()[0]})")


def resolve_data(spec: ModelSpec, spec_path: Path, opts: SessionOptions,
                 status: Callable[[str], None]) -> tuple[Any, Any | None, str]:
    """(train source, eval source or None, a note saying where the data came from)."""
    if opts.data is not None:
        train, evaluation = dataset_pair(Path(opts.data), spec, opts.dask)
        if opts.eval_data is not None:
            evaluation = open_dataset(Path(opts.eval_data), spec, opts.dask)
        return train, evaluation, f"data: {opts.data}"
    if spec.data is not None:
        folder = bound_dataset(spec, spec_path, opts.workdir, status)
        train, evaluation = dataset_pair(folder, spec, opts.dask)
        return train, evaluation, f"data: {spec.data.format} at {spec.data.path} (encoded in {folder})"
    return synthetic_sources(spec, opts.synthetic_rows, status)


def open_dataset(path: Path, spec: ModelSpec, dask: str | None = None) -> Any:
    """An encoded dataset checked against the spec, read directly or through Dask."""
    check_spec(read_meta(path), spec)
    if dask is None:
        return ParquetSource(path)
    from flowrec.data.dataset import DaskSource

    return DaskSource(path, address=None if dask == "local" else dask)


def dataset_pair(path: Path, spec: ModelSpec, dask: str | None = None) -> tuple[Any, Any | None]:
    """A dataset folder, or its train/ and test/ parts when it was split."""
    if (path / "train" / META_FILE).is_file():
        test = path / "test"
        evaluation = open_dataset(test, spec, dask) if (test / META_FILE).is_file() else None
        return open_dataset(path / "train", spec, dask), evaluation
    return open_dataset(path, spec, dask), None


def bound_dataset(spec: ModelSpec, spec_path: Path, workdir: Path | None,
                  status: Callable[[str], None]) -> Path:
    """Encode the spec's bound raw data once (reused while it exists)."""
    from flowrec.data.convert import convert

    assert spec.data is not None
    raw = (spec_path.parent / spec.data.path).resolve()
    if spec.data.format == "parquet":
        return raw
    if not raw.exists():
        raise DataError(f"the spec's data binding points to {raw}, which does not exist")
    out = (workdir or Path("runs") / spec.name) / "data"
    if (out / META_FILE).is_file() or (out / "train" / META_FILE).is_file():
        return out
    status(f"encoding {spec.data.format} data from {raw} into {out}")
    convert(spec, spec.data.format, [raw], out)
    return out


def synthetic_sources(spec: ModelSpec, rows: int, status: Callable[[str], None]) -> tuple[Any, Any, str]:
    """Synthetic train and evaluation data from the spec (same hidden model, disjoint rows)."""
    from flowrec.data.synth import SynthConfig, synth_table

    eval_rows = max(int(rows * EVAL_FRACTION), 1)
    status(f"generating {rows:,} + {eval_rows:,} synthetic rows from the spec (Zipf ids, hidden-model labels)")
    table = synth_table(spec, rows + eval_rows, SynthConfig(seed=spec.training.seed))
    train = MemorySource(split_table(table.slice(0, rows), SYNTH_PARTITIONS))
    evaluation = MemorySource(split_table(table.slice(rows, eval_rows), 2))
    return train, evaluation, f"data: synthetic, {rows:,} train + {eval_rows:,} eval rows"
