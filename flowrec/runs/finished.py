"""A resumed run that is finished already, told from its checkpoint alone.

`train --resume RUN` of a run at its end (all epochs, `--max-steps`, or an early stop) read its
data, built its model and loaded every table to say "RUN is finished" (45-54 s on dlrm_criteo).
Its checkpoint answers that: its position and early-stopping state say it is at its end, and the
same checks the load makes (every tensor of the spec's model there, of its shape and dtype, the
state dict loaded strictly, a dense optimizer state for the same parameters, a loop state of the
right form) are made against the model lowered on the meta device, no table drawn or copied.

Where the answer is not sure, `finished_run` says nothing (None) and the run is loaded as before,
which says what is wrong in its own words: a checkpoint that does not fit the model, a spec with
custom modules (user code), or anything unexpected on the meta device. A run resumed on N ranks
(`train --resume RUN --nproc N`) is asked before the ranks are launched, its tables left as their
shards (checked by shape and dtype, never assembled).
`FLOWREC_RESUME_FULL_LOAD=1` asks for that load always (the path before af9be63c, which
`tools/bench_resume.py` times against this one; docs/runs.md).

Example:
    >>> done = finished_run(state, spec, plan, settings, folder / "checkpoint.pt")  # doctest: +SKIP
    >>> done.position.step if done else None                                         # doctest: +SKIP
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from flowrec.graph.types import Plan
from flowrec.spec.model import ModelSpec

FULL_LOAD_ENV = "FLOWREC_RESUME_FULL_LOAD"  # "1": a finished run is loaded whole to be told finished


def full_load_asked() -> bool:
    """Whether `FLOWREC_RESUME_FULL_LOAD` asks that a finished run be loaded whole (its data read,
    its model built, its tables loaded) to be told finished: "1" yes, "0" or unset no.

    Raises:
        ValueError: any other value, in one line naming the variable.
    """
    value = os.environ.get(FULL_LOAD_ENV, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{FULL_LOAD_ENV} must be 1 (a finished run is loaded whole to be told finished, as "
                         f"before the checkpoint told it) or 0, not {value!r}")
    return value == "1"


@dataclass(frozen=True)
class FinishedRun:
    """Where a finished run stands: its checkpoint's position, the epochs it trains, and its early
    stopper where the spec has one (`stopper.state.stopped`: it stopped early)."""

    position: Any  # flowrec.runtime.trainer.Position
    epochs: int
    stopper: Any = None  # flowrec.runtime.evaluation.early_stop.EarlyStopper


def finished_run(state: dict[str, Any], spec: ModelSpec, plan: Plan, settings: dict[str, Any],
                 source: Path) -> FinishedRun | None:
    """The finished run of a loaded checkpoint `state` (checked by `load_checkpoint` already), or
    None where it is not finished or the full load must decide (see the module docstring).

    Args:
        state: the checkpoint, as `load_checkpoint` gives it (deltas applied, shards assembled).
        spec: the spec the run resumes with (checked against the checkpoint's by the caller).
        plan: the run's stored plan, for one process.
        settings: the run's settings (`epochs`, `max_steps` as run.json and the command line say).
        source: the checkpoint file, named in the load's messages.
    """
    from flowrec.runtime.checkpoint.store import CheckpointError
    from flowrec.runtime.evaluation.early_stop import EarlyStopper
    from flowrec.runtime.trainer import Position

    if full_load_asked():
        return None  # the full load asked for (FLOWREC_RESUME_FULL_LOAD=1)
    if _custom(spec):
        return None  # a custom module's own code builds and loads it: the full load runs it once
    epochs = _epochs(settings, spec)
    position = Position(**state["position"])
    stopper = None
    if spec.training.early_stopping is not None:
        stopper = EarlyStopper.of(spec.training.early_stopping, spec.heads[0].name)
        stopping = state.get("early_stopping")
        if isinstance(stopping, dict):
            try:
                stopper.load_state_dict(stopping)
            except TypeError:
                return None  # damaged: the full load says so
    max_steps = settings.get("max_steps")
    at_end = position.epoch >= epochs or (max_steps is not None and position.step >= max_steps)
    if not (at_end or (stopper is not None and stopper.state.stopped)):
        return None
    try:
        fits = _fits_model(state, spec, plan, source)
    except CheckpointError:
        return None
    return FinishedRun(position, epochs, stopper) if fits else None


def looks_finished(folder: Path, given: dict[str, Any], spec: ModelSpec) -> bool:
    """A first look, cheap and unchecked, at whether the run in `folder` stands at its end: the
    position (or early stop) of its newest checkpoint file, mapped, no digest taken, against the
    epochs and --max-steps its run.json records and the command line (`given`) sets. False on any
    doubt. `train --resume RUN --nproc N` looks before it asks `finished_run` (which hashes the
    whole checkpoint), so a run that is not finished is launched as before, at no cost. A spec with
    custom modules is never said finished from its checkpoint (`finished_run`): False."""
    from flowrec.runs.settings import read_run_file
    from flowrec.runs.start import run_settings
    from flowrec.runtime.checkpoint.delta import delta_files
    from flowrec.runtime.checkpoint.format import read_torch_file
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME

    if _custom(spec):
        return False
    try:
        settings, _ = run_settings(given, spec, read_run_file(folder))
        base = folder / CHECKPOINT_NAME
        state = read_torch_file(([path for _, path in delta_files(base)] or [base])[-1], mmap=True)
        position, stopping = state["position"], state.get("early_stopping")
        epochs = _epochs(settings, spec)
        max_steps = settings.get("max_steps")
        return (position["epoch"] >= epochs or (max_steps is not None and position["step"] >= max_steps)
                or (isinstance(stopping, dict) and stopping.get("stopped") is True))
    except Exception:  # noqa: BLE001 - a damaged or missing file, an odd record: the ranks' load says it
        return False


def _custom(spec: ModelSpec) -> bool:
    return any(m.kind == "custom" for m in spec.modules)


def _epochs(settings: dict[str, Any], spec: ModelSpec) -> int:
    """The epochs the run trains: its --epochs (recorded or given), else the spec's."""
    return settings["epochs"] if settings.get("epochs") is not None else spec.training.epochs


def _fits_model(state: dict[str, Any], spec: ModelSpec, plan: Plan, source: Path) -> bool:
    """The checks of `Trainer.load_state`, against the model lowered on the meta device: its
    tensors assigned the checkpoint's (no copy), strictly; False where the meta model cannot be
    made or loaded (the full load then decides, on the real device)."""
    import torch

    from flowrec.runtime.checkpoint.shards import ShardRows
    from flowrec.runtime.checkpoint.store import check_tensors
    from flowrec.runtime.lowering import lower
    from flowrec.runtime.trainer import check_optimizer_state, checked_horizon
    from operators.embedding import restoring_tables

    saved = state.get("dense_optimizer")
    if not isinstance(saved, dict) or not isinstance(saved.get("param_groups"), list) \
            or len(saved["param_groups"]) != 1:
        return False  # the trainer's optimizer has one group: torch's load says what else is wrong
    try:
        with restoring_tables():
            model = lower(plan, spec, "meta")
    except Exception:  # noqa: BLE001 - anything the meta device cannot do: the full load decides
        return False
    try:
        check_tensors(source, "model", model.state_dict(), state["model"])
        dense = model.dense_parameters() or [torch.zeros(0)]  # `make_dense_optimizer`'s placeholder
        check_optimizer_state(source, SimpleNamespace(param_groups=[{"params": dense}]), saved)
        try:  # a distributed run's tables, left as their shards (`ShardRows`), fitted by shape and dtype
            model.load_state_dict({k: torch.empty(v.shape, dtype=v.dtype, device="meta")
                                   if isinstance(v, ShardRows) else v for k, v in state["model"].items()},
                                  assign=True)
        except (RuntimeError, ValueError, KeyError, TypeError):
            return False
        checked_horizon(source, state)
    finally:
        model.close()
    return True
