"""Starting a run, the same way for `flowrec train` and `flowrec.train`: its settings (run.json),
its training configuration, its session (data and model of the plan) and its encoder.

Every step raises `RunError` (one line, an exit status) and prints nothing: status lines go to the
`status` callable the caller gives.

Example:
    >>> settings, notes = run_settings({"max_steps": 5}, spec)  # doctest: +SKIP
    >>> session = start_session(spec, spec_path, settings, folder, plan, device)  # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import torch

from flowrec.data.convert import INDEX_SPLIT_RULE, SPLIT_RULE
from flowrec.data.cores import local_ranks
from flowrec.data.encoder_record import EncoderRecord
from flowrec.data.hostmemory import available_memory_bytes
from flowrec.data.layout import DataError
from flowrec.graph.types import Plan
from flowrec.planner.fit import host_fit, host_misfit, host_share, misfit
from flowrec.runs.encoder import adopt_encoder, data_encoder, eval_form_lines
from flowrec.runs.errors import EXIT_OUT_OF_MEMORY, RunError
from flowrec.runs.settings import merge_settings
from flowrec.runtime.messages import first_line, out_of_memory
from flowrec.runtime.session import Session, SessionOptions, prepare
from flowrec.runtime.trainer import TrainConfig
from flowrec.spec.model import ModelSpec
from operators.device import free_memory



def memory_hint() -> str:
    """What to change after running out of memory, for this machine."""
    if torch.cuda.is_available():
        return "Give a smaller --device-budget (more tables on host or cache placements) or use --device cpu"
    return "Use a machine with more memory, or a smaller model or batch size"


def check_plan_fits(plan: Plan, device: torch.device, world: Any = None) -> None:
    """Refuse a plan whose estimated peak memory exceeds the memory of the device it would run on
    (`flowrec.planner.fit`, with its margin), before anything is built or written: on the CPU this
    rank's share of the host memory available (`host_share`: the ranks of this machine share it,
    the rule `flowrec plan --world-size` applies too), on CUDA the device's free memory and, for
    the rows the plan keeps on the host, the same share of the host memory.
    A `RunError` (exit 2) naming the peak, the limit and the largest contributors."""
    ranks = local_ranks() if world is not None else 1
    available = available_memory_bytes()
    if device.type == "cuda":
        problem = misfit(plan, free_memory(device), f"free memory on {device}")
        if problem is None and available is not None:
            problem = host_misfit(plan, *host_share(available, ranks))
    else:
        if available is None:
            return
        problem = host_fit(plan, available, ranks)
    if problem is not None:
        raise RunError(f"{problem}; nothing was built. {memory_hint()}")


def run_settings(given: dict[str, Any], spec: ModelSpec, recorded: dict[str, Any] | None = None,
                 init_from: Path | str | None = None, fresh_optimizer: bool = False,
                 ) -> tuple[dict[str, Any], list[str]]:
    """The settings a run records in run.json: every given value, else the recorded one (a resumed
    run), else the default; with its parent run (`init_from`) and optimizer choice. Returns
    (settings, notes), the notes saying what was restored or overridden."""
    defaults = {"epochs": spec.training.epochs, "eval_every": spec.training.eval_every}
    settings, notes = merge_settings(given, recorded, defaults, spec.data is not None and spec.data.bound)
    settings["init_from"] = str(init_from) if init_from else None
    settings["fresh_optimizer"] = bool(fresh_optimizer)
    # the rule its bound data is split by when encoded again (a resumed run of before rule 3 records none)
    settings["split_rule"] = SPLIT_RULE if recorded is None else recorded.get("split_rule", INDEX_SPLIT_RULE)
    return settings, notes


def session_options(settings: dict[str, Any], folder: Path | None, resumed: bool = False,
                    python: bool = False) -> SessionOptions:
    """The session's options of a run with these settings (`python`: `flowrec.train`'s, in its words)."""
    return SessionOptions(
        data=Path(settings["data"]) if settings["data"] else None,
        eval_data=Path(settings["eval_data"]) if settings["eval_data"] else None,
        device=settings["device"], device_budget=settings["device_budget"], synthetic_rows=settings["rows"],
        seed=settings["seed"], workdir=folder, resumed=resumed, dask=settings["dask"],
        init_from=Path(settings["init_from"]) if settings.get("init_from") else None,
        split_rule=settings.get("split_rule"), python=python)


def train_config(settings: dict[str, Any], folder: Path | None, progress: bool) -> TrainConfig:
    """The trainer's configuration of a run with these settings."""
    return TrainConfig(epochs=settings["epochs"], out_dir=folder, eval_every=settings["eval_every"],
                       max_steps=settings["max_steps"], checkpoint_every=settings["checkpoint_every"],
                       checkpoint_full_every=settings["checkpoint_full_every"], progress=progress,
                       interleave=settings["interleave"], compile_dense=bool(settings.get("compile")),
                       nan_policy=settings["nan_policy"], cache_data=settings["cache_data"])


def start_session(spec: ModelSpec, spec_path: Path, settings: dict[str, Any], folder: Path | None, plan: Plan,
                  device: torch.device, status: Callable[[str], None] = lambda _: None,
                  world: Any = None, before: Callable[[], None] = lambda: None,
                  after: Callable[[], None] = lambda: None, resumed: bool = False, python: bool = False) -> Session:
    """The run's data and the model of `plan` on `device` (`before`/`after`: the ranks' barriers
    around building it; `resumed`: the run in `folder` continues, its encoded bound data kept as it
    is). Raises `RunError` for data that does not fit, for running out of memory and
    for early stopping without evaluations during training (the options named as `flowrec.train`'s
    keywords where `python`, else as `flowrec train`'s flags)."""
    check_plan_fits(plan, device, world)
    check_synthetic_rows(spec, settings, python)
    if spec.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    before()
    try:
        session = prepare(spec, spec_path, session_options(settings, folder, resumed, python), plan, device,
                          status=status, world=world)
    except (DataError, RuntimeError, ValueError, MemoryError) as exc:
        if out_of_memory(exc):
            raise RunError(f"out of memory building the model: {first_line(exc)}. {memory_hint()}",
                           EXIT_OUT_OF_MEMORY) from None
        raise RunError(str(exc), cause=exc) from None
    after()
    check_early_stopping(session, settings, python)
    return session


def record_encoder(session: Session, folder: Path | None, resuming: bool, parent: str | Path | None,
                   status: Callable[[str], None] = lambda _: None) -> EncoderRecord:
    """Record the run's encoder (its training data's) in the run folder (none: `flowrec.train(out=None)`)
    and return it; data of another encoder is a `RunError` (the model is closed first). `status`
    gets a warning line where data of a run started from another, or evaluation data, writes ids in
    another form."""
    try:
        if folder is None:
            record = data_encoder(session.spec, session.train, session.eval)
            for line in eval_form_lines(session.spec, record, session.eval):
                status(line)
            return record
        return adopt_encoder(session.spec, folder, session.train, session.eval, resuming,
                             Path(parent) if parent else None, status)
    except DataError as exc:
        session.model.close()
        raise RunError(str(exc), cause=exc) from None


def check_early_stopping(session: Session, settings: dict[str, Any], python: bool = False) -> None:
    """Early stopping needs evaluations during training: an evaluation set and `eval_every`
    (`flowrec train` and `flowrec.train` alike, each in its words: `python`). Raises `RunError` (the
    model is closed first)."""
    if session.spec.training.early_stopping is None:
        return
    problem = None
    if session.eval is None:
        problem = (f"training.early_stopping needs an evaluation set: give {'eval_data=' if python else '--eval-data'},"
                   " or data with a test split")
    elif not settings["eval_every"]:
        problem = ("training.early_stopping needs evaluations during training: set training.eval_every in the "
                   f"spec or give {'eval_every=N' if python else '--eval-every N'}")
    if problem is not None:
        session.model.close()
        raise RunError(problem)


def synthetic_bytes(spec: ModelSpec, rows: int) -> int:
    """An upper estimate of the memory `rows` synthetic training rows (+20% for evaluation) take:
    8 bytes per dense value and label, 8 per id of a sparse feature plus its list offset."""
    from flowrec.runtime.session import EVAL_FRACTION

    per_row = 8 * (len(spec.dense_features) + len(spec.heads)) + sum(8 * f.max_len + 4 for f in spec.sparse_features)
    return int(rows * (1 + EVAL_FRACTION)) * per_row


def check_synthetic_rows(spec: ModelSpec, settings: dict[str, Any], python: bool = False) -> None:
    """Synthetic rows are generated in memory (their peak about `synthetic_bytes`): more than this
    machine's memory cannot fit (the run would swap or be killed after minutes, or seem to hang),
    so it is a `RunError` at once, naming `rows=` where `python` (`flowrec.train`), else `--rows`."""
    if settings.get("data") or (spec.data is not None and spec.data.bound):
        return
    try:
        memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return
    need = synthetic_bytes(spec, settings["rows"])
    if memory > 0 and need > memory:
        rows = f"rows={settings['rows']}" if python else f"--rows {settings['rows']:,}"
        raise RunError(f"{rows} synthetic rows take about {need / 2**30:,.1f} GiB in "
                       f"memory, more than this machine's {memory / 2**30:,.1f} GiB: give fewer "
                       f"{'rows=' if python else '--rows'}, or a dataset (`flowrec data synth SPEC --rows N --out DIR` "
                       "writes one to disk)")
