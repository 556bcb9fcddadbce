"""The Python API: train a spec, load a finished run, evaluate it on data, read its metrics, and follow
training with callbacks. It does what `flowrec train` / `flowrec eval` do (plan with the planner,
run the plan unchanged), with Python values in and out and nothing printed.

Callbacks receive one event each (`StepEvent`, `EvalEvent`, `CheckpointEvent`); a callback that
returns True asks the run to stop after the current step (it then evaluates, checkpoints and
returns, resumable like a run stopped by Ctrl-C).

Example:
    >>> import flowrec
    >>> run = flowrec.train("specs/movielens.yaml", out="runs/ml", epochs=1)  # doctest: +SKIP
    >>> run.metrics["rating_ge_4"]["auc"]  # doctest: +SKIP
    0.77
    >>> flowrec.load("runs/ml").evaluate("runs/ml/data/test", group_by="user_id")  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Union

from flowrec.runtime.trainer import EvalEvent, Hooks, Position, TrainResult
from flowrec.spec.model import ModelSpec

Metrics = dict[str, dict[str, float]]  # head -> metric -> value


@dataclass(frozen=True)
class StepEvent:
    """A finished training step: its number (1-based), epoch, samples so far, and loss (None when
    the batch was skipped for a non-finite loss)."""

    step: int
    epoch: int
    samples: int
    loss: float | None


@dataclass(frozen=True)
class CheckpointEvent:
    """A checkpoint taken at `step` for `path` (RUN/checkpoint.pt, or RUN/best/checkpoint.pt).

    RUN/checkpoint.pt is written in the background (docs/runs.md): the file holds `step` at the
    latest when the next checkpoint is taken or the run returns; RUN/best/checkpoint.pt is on
    disk when the event comes.
    """

    step: int
    path: Path


Callback = Callable[[Any], Union[bool, None]]  # return True (or np.True_) to stop the run after this step
DEFAULT_ROWS = 400_000  # synthetic rows of a run on no data (`flowrec train --rows`'s default)


@dataclass
class Run:
    """A trained model with its spec, run folder and metrics.

    Args:
        spec: the model spec.
        run_dir: the run folder (None for a run trained with `out=None`: nothing on disk).
        result: what `train` returned (None for a loaded run).
        trained: the model as scored (`flowrec.serving.trained.Trained`).
        loaded: what `flowrec.load` was given (the run folder, RUN/best or a checkpoint file; None for
            a trained run): `run_dir` is the run it belongs to, whose history and data it reads.
    """

    spec: ModelSpec
    run_dir: Path | None
    result: TrainResult | None
    trained: Any = field(repr=False)
    loaded: Path | None = None

    def __repr__(self) -> str:
        """One line a notebook can show: the spec's name, the folder, the steps and the final metrics
        (the dataclass's repr printed the whole spec and training result, thousands of characters)."""
        folder = str(self.run_dir) if self.run_dir is not None else None
        if self.result is None:  # a loaded run: its checkpoint's step (its metrics are read from its folder)
            source = "" if self.loaded is None or self.loaded == self.run_dir else f", loaded={str(self.loaded)!r}"
            return f"Run({self.spec.name!r}, run_dir={folder!r}{source}, step={getattr(self.trained, 'step', None)})"
        shown = {head: {name: round(value, 4) if isinstance(value, float) else value for name, value in values.items()}
                 for head, values in self.result.eval.items()}
        return f"Run({self.spec.name!r}, run_dir={folder!r}, steps={self.result.steps}, metrics={shown})"

    @property
    def metrics(self) -> Metrics:
        """The final evaluation per head (empty when the run had no evaluation set); of a loaded
        run, its last evaluation up to the checkpoint's step (RUN/best: the best evaluation)."""
        if self.result is not None:
            return self.result.eval
        step = getattr(self.trained, "step", None)  # a loaded RUN/best: its evaluation's, not the last
        finals = [r for r in self.history if r.get("event") == "eval" and (
            step is None or not isinstance(r.get("step"), int) or r["step"] <= step)]
        if not finals or not isinstance(finals[-1]["metrics"], dict):
            return finals[-1]["metrics"] if finals else {}
        # metrics.jsonl writes an undefined metric (NaN) as null: NaN again, as a trained run's and
        # evaluate's (a loaded run's None made `run.metrics["ctr"]["auc"] > 0.7` a TypeError)
        # and a count an older flowrec wrote as a float (k 5.0) an integer, as a trained run's
        from flowrec.runtime.evaluation.classes import counts_as_integers

        return {head: counts_as_integers({name: float("nan") if value is None else value
                                          for name, value in values.items()})
                if isinstance(values, dict) else values for head, values in finals[-1]["metrics"].items()}

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run's metrics.jsonl: one per step (loss, learning rates), evaluation, end."""
        if self.run_dir is None:
            return []
        from flowrec.runtime.run_log import read_records
        from flowrec.runtime.rundir import METRICS_FILE

        return read_records(self.run_dir / METRICS_FILE)

    def evaluate(self, data: str | Path | None = None, group_by: str | None = None,
                 seen: str | Path | None = None) -> Metrics:
        """Score an encoded dataset (a folder from `flowrec data convert` / `synth`, or a run's
        data/test): exact metrics per head; with `group_by` (a one-id categorical feature) also gAUC.
        Without `data`, the data the run evaluated on (as `flowrec eval RUN`; a run on synthetic
        rows: its evaluation rows, drawn again from its seed). `seen` (a retrieval head with
        exclude_seen): the training dataset whose (user, item) pairs are left out of each user's
        ranking, as `flowrec eval --seen`; by default the run's recorded training data.

        Raises:
            DataError: no `data` and the run recorded no evaluation data (or it moved).
        """
        _check_kinds(data=(data, "a dataset folder path (str or pathlib.Path) or None"),
                     group_by=(group_by, "a categorical feature's name or None"),
                     seen=(seen, "a training dataset folder path (str or pathlib.Path) or None"))
        from flowrec.runs.recorded import recorded_train_data

        if seen is not None and not self.trained.excludes_seen:
            from flowrec.runs.errors import RunError

            raise RunError("seen= applies to a retrieval head with exclude_seen: true; this run has none "
                           "(its evaluation leaves nothing out)")
        seen = Path(seen).expanduser() if seen is not None else None
        grouping = group_by or self.spec.training.eval_group_by
        if data is None:
            from flowrec.data.layout import DataError
            from flowrec.runs.recorded import eval_data_to_score, split_since, synthetic_rows

            if self.run_dir is None:
                raise DataError("this run has no run folder (out=None), so it recorded no evaluation data: give data=")
            drawn = synthetic_rows(self.run_dir, self.trained.spec, "data=")
            if drawn is not None:  # a run on synthetic rows: the evaluation rows it drew, drawn again
                return _warn_covered_classes(self.trained.evaluate_drawn(drawn, grouping, seen))
            data = eval_data_to_score(self.run_dir, "data=")
            if (line := split_since(self.run_dir, "data=")) is not None:
                import warnings

                warnings.warn(line, UserWarning, stacklevel=2)
        if seen is None and self.run_dir is not None and self.trained.excludes_seen:  # as `flowrec eval`: the
            # pairs of the run's training data (run.json read only for such a head: data= scores without it)
            seen = recorded_train_data(self.run_dir)
        lines: list[str] = []  # same fingerprint, ids written otherwise
        metrics = self.trained.evaluate_dataset(Path(data).expanduser(), grouping, seen, lines.append)
        import warnings

        for line in lines:
            warnings.warn(line, UserWarning, stacklevel=2)
        return _warn_covered_classes(metrics)


def load(run_dir: str | Path, device: str = "auto") -> Run:
    """A finished run (or a checkpoint file, or RUN/best) loaded for scoring.

    Raises:
        flowrec.runtime.checkpoint.store.CheckpointError: a damaged or foreign checkpoint.
        flowrec.runs.errors.RunError: `run_dir` not a path, or `device` not auto, cpu or cuda[:N] (or cuda
            on a machine without CUDA).
    """
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.rundir import run_folder_of
    from flowrec.serving.trained import load_trained, missing_encoder

    _check_kinds(run_dir=(run_dir, "a run folder or checkpoint path (str or pathlib.Path)"),
                 device=(device, "a device name (auto, cpu, cuda)"))
    _check_device(device)

    run_dir = Path(run_dir).expanduser()  # '~/runs/x' as pandas reads it (it was ./~/runs/x)
    trained = load_trained(run_dir, device, scoring_plan)
    import warnings

    for line in trained.notes:  # a moved run's class file, found in its new place
        warnings.warn(line, UserWarning, stacklevel=2)
    if (line := missing_encoder(run_dir, trained)) is not None:
        warnings.warn(line, UserWarning, stacklevel=2)
    _warn_small_catalogue(trained.model)
    folder = run_folder_of(run_dir)  # RUN/best's history and evaluation data are its run's
    return Run(trained.spec, folder, None, trained, run_dir)


def train(spec: str | Path | ModelSpec, *, data: str | Path | None = None, eval_data: str | Path | None = None,
          out: str | Path | None = None, overwrite: bool = False, resume: str | Path | None = None,
          epochs: int | None = None,
          max_steps: int | None = None, eval_every: int | None = None, checkpoint_every: int = 0,
          device: str = "auto", device_budget: str | None = None, rows: int = DEFAULT_ROWS, seed: int | None = None,
          cache_data: str | None = None, progress: bool = False, on_step: Callback | None = None, on_eval: Callback | None = None,
          on_checkpoint: Callback | None = None, nproc: int = 1, max_restarts: int = 0) -> Run:
    """Train a spec end to end, as `flowrec train` does, and return the run.

    Args:
        spec: a spec file (YAML/JSON) or a loaded `ModelSpec` (its data binding is then relative
            to the current folder).
        data: encoded dataset folder (DIR/train + DIR/test when split); default: the spec's data
            binding, else `rows` synthetic rows (+20% for evaluation).
        eval_data: encoded evaluation dataset folder (instead of a split's test part; needs
            `data` or data bound in the spec, not synthetic rows).
        out: run folder (checkpoint.pt, metrics.jsonl, best/, TensorBoard); None writes no run
            folder (raw data bound in the spec is still encoded into runs/<spec name>/data, as
            `flowrec train` encodes it for its default folder; once: a call started meanwhile
            waits for it, then reuses it; after the raw files changed, a DataError says to remove it).
            A folder holding a run needs `overwrite=True`, or `resume=` to continue it.
        overwrite: replace the run in `out`.
        resume: a run folder (of `flowrec.train` or `flowrec train`, also one trained with `--nproc N`)
            to continue exactly where it stopped, with the settings it was started with (its run.json);
            options given again override them (an option left at its default keeps the run's value), and
            the spec must be the one it was trained with. A finished run trains nothing: a UserWarning says
            it is finished and the run is returned as `flowrec.load` gives it. Not with `out` naming
            another folder, nor with `overwrite`.
        epochs, max_steps, eval_every, checkpoint_every, device, device_budget, seed: as the
            `flowrec train` options of the same names.
        rows: synthetic training rows when there is no data.
        cache_data: keep the data's decoded rows in memory after their first pass, as `flowrec
            train --cache-data`: "auto" (the default: when they fit half the available memory),
            "on", "off", or a byte size such as "2GiB" (auto with that budget).
        progress: show the progress bar.
        on_step: called with a `StepEvent` after every step.
        on_eval: called with an `EvalEvent` after every evaluation.
        on_checkpoint: called with a `CheckpointEvent` after every checkpoint.
        nproc: train on N local processes (ranks), as `flowrec train SPEC --nproc N` does (the same
            ranks, so the same checkpoint, bitwise): torch.distributed's launcher starts them, this
            call waits for them and returns the run as `flowrec.load(out)` gives it. With N > 1 the
            ranks write the run folder, so `out=` (or `resume=`) must name it, the spec must be a
            file (each rank reads it), and callbacks are refused (they cannot run inside the ranks);
            `progress=True` shows the ranks' output (bar and lines) on stderr. The checks of
            options, spec, data and folder are made here, before any rank starts; `resume=RUN,
            nproc=N` continues a run on N ranks as `flowrec train SPEC --resume RUN --nproc N` does.
        max_restarts: with nproc > 1: restart every rank up to this many times after a failure, as
            `--max-restarts`; the run continues from its last checkpoint.

    Raises:
        flowrec.spec.errors.SpecError: the spec is not valid (every problem listed).
        flowrec.runtime.rundir.RunFolderError: `out` is in use, holds a run, or is not a run folder;
            `resume` does not exist, holds no run, or its run.json is damaged.
        flowrec.runtime.checkpoint.store.CheckpointError: `resume`'s checkpoint is damaged.
        flowrec.data.layout.DataError: the data does not fit the spec.
        flowrec.runtime.nonfinite.TrainingStopped: a non-finite loss stopped training.
        KeyboardInterrupt: Ctrl-C, SIGTERM or SIGHUP stopped training (with nproc > 1, also such a
            signal to a rank); its checkpoint is saved in `out` (the message says how to load and
            continue it: `flowrec.train(SPEC, resume=OUT)`).
        flowrec.runs.errors.RunError: an argument of the wrong kind or out of range (epochs=0, seed=-1,
            a callback that is not callable, nproc=0), or the device, the plan or the memory of this machine
            cannot run it; `resume` with `overwrite` or another `out`, or with a spec, seed or plan option
            other than the run's; with nproc > 1, no `out`, a `ModelSpec` or a callback.
        flowrec.runs.launch.RanksFailed: a rank of nproc > 1 failed (a `RunError`: the rank's error
            line, its last output lines in `lines` and as a note).
    """
    from flowrec.graph.plan_io import plan_json
    from flowrec.runs.errors import RunError
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runs.plan import plan_for_run
    from flowrec.runtime.progress import reading_bar
    from flowrec.runs.settings import given_problem, write_run_file
    from flowrec.runs.start import record_encoder, run_settings, start_session, train_config
    from flowrec.runtime.rundir import clear_run_files, folder_state
    from flowrec.runtime.trainer import Trainer
    from flowrec.serving.trained import Trained
    from flowrec.spec.load import load_spec

    _check_arguments(spec=spec, data=data, eval_data=eval_data, out=out, resume=resume, on_step=on_step,
                     on_eval=on_eval, on_checkpoint=on_checkpoint, overwrite=overwrite, progress=progress, device=device,
                     device_budget=device_budget)
    nproc = _ranks_asked(spec, out, resume, _whole(nproc), _whole(max_restarts),
                         on_step=on_step, on_eval=on_eval, on_checkpoint=on_checkpoint)
    continued = _resumed_folder(resume, out, overwrite)
    if isinstance(spec, ModelSpec):
        _check_model_spec(spec)
    spec_path = Path(spec).expanduser() if not isinstance(spec, ModelSpec) else Path.cwd() / f"{spec.name}.yaml"
    loaded = load_spec(spec_path) if not isinstance(spec, ModelSpec) else spec
    if continued is not None:  # its custom class files as the run finds them (as `flowrec train --resume`)
        loaded = _run_class_files(loaded, continued)
    model_spec = _with_custom_widths(loaded, str(spec_path) if not isinstance(spec, ModelSpec)
                                     else f"ModelSpec {spec.name!r}")
    folder = Path(out).expanduser() if out is not None else None  # '~/runs/x' made a folder named ~ here
    _warn_session_classes(model_spec, folder or continued)
    given = {"data": _text(data), "eval_data": _text(eval_data), "rows": _whole(rows), "seed": _whole(seed),
             "device": device, "device_budget": device_budget, "epochs": _whole(epochs),
             "max_steps": _whole(max_steps), "eval_every": _whole(eval_every),
             "checkpoint_every": _whole(checkpoint_every), "cache_data": cache_data}
    for key, value in given.items():
        problem = given_problem(key, value)
        if problem is not None:
            raise RunError(f"{key} {problem}")
    if nproc > 1:
        return _train_on_ranks(spec, model_spec, folder, continued, overwrite, given, progress, nproc,
                              _whole(max_restarts))
    if continued is not None:
        return _train_resumed(spec, spec_path, model_spec, continued, given, progress,
                              lambda trainer: _hooks(trainer, on_step, on_eval, on_checkpoint))
    settings, _ = run_settings(given, model_spec)
    _warn_rows_ignored(rows, settings, model_spec)
    found = folder_state(folder)
    lock = claim_run_folder(folder, None, overwrite, model_spec.name, "overwrite=True",
                            _resume_command(spec, folder))[1] if folder else None
    with _RunGuard(lock, found) as guard:
        # the same plan as `flowrec train` (sampled access profile of the data included) and the same run.json
        plan, dev = plan_for_run(model_spec, settings["device"], settings["device_budget"], None,
                                 data=settings["data"], epochs=settings.get("epochs"),
                                 max_steps=settings.get("max_steps"), progress=reading_bar(progress))
        session = guard.session = start_session(model_spec, spec_path, settings, folder, plan, dev, python=True)
        _warn_label_warnings(session)
        # the returned Run scores only data of this encoder, as a loaded one (it scored any, silently)
        encoder = record_encoder(session, folder, False, None, _warn_line)  # eval_data= of ids written otherwise
        if folder is not None:
            clear_run_files(folder)
        trainer = guard.trainer = Trainer(session.spec, session.plan, session.model,
                                          train_config(settings, folder, progress), plan_json(session.plan))
        if folder is not None:
            settings["train_rows"] = sum(session.train.partition_rows())  # as `flowrec train` records it
            write_run_file(folder, settings, session.spec)
        result = trainer.fit(session.train, session.eval, hooks=_hooks(trainer, on_step, on_eval, on_checkpoint))
    if result.interrupted:  # Ctrl-C (a notebook's interrupt) or SIGTERM: checkpointed, then stops the caller
        # too, as `flowrec train` exits 130 (returning, it let a loop of runs or the cell's next lines go on)
        raise KeyboardInterrupt(_interrupted_line(result.steps, spec, folder))
    _warn_small_catalogue(session.model)
    _warn_covered_classes(result.eval)
    return Run(session.spec, folder, result, Trained(session.spec, session.model, session.plan, encoder, result.steps))


def _ranks_asked(spec: Any, out: Any, resume: Any, nproc: Any, max_restarts: Any, **callbacks: Any) -> int:
    """`nproc` checked (a `RunError`, one line, before anything is read): a whole number, 1 or more;
    `max_restarts` a whole number, 0 or more, given only with ranks. With more than one rank the run
    folder is named (`out=` or `resume=`: every rank writes it), the spec is a file (every rank reads
    it) and no callback is given (it could not run inside the ranks)."""
    from flowrec.runs.errors import RunError

    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise RunError(f"nproc must be a whole number of ranks, 1 or more, not {_shown(nproc)}")
    if isinstance(max_restarts, bool) or not isinstance(max_restarts, int) or max_restarts < 0:
        raise RunError(f"max_restarts must be a whole number, 0 or more, not {_shown(max_restarts)}")
    if max_restarts and nproc == 1:
        raise RunError(f"max_restarts={max_restarts} restarts the ranks of nproc=N after a failure: give nproc=2 or "
                       "more, or leave max_restarts out")
    if nproc == 1:
        return nproc
    if given := [name for name, callback in callbacks.items() if callback is not None]:
        raise RunError(f"{', '.join(given)} cannot follow a run on nproc={nproc} ranks: the ranks train in processes "
                       f"of their own, where no callback of this one runs; leave {'it' if len(given) == 1 else 'them'} "
                       "out (the returned run's history holds every step and evaluation), or train with nproc=1")
    if isinstance(spec, ModelSpec):
        raise RunError(f"nproc={nproc} starts ranks that each read the spec from its file, and a ModelSpec has none: "
                       "write the spec to a YAML or JSON file and give its path")
    if out is None and resume is None:
        raise RunError(f"nproc={nproc} trains in a run folder that every rank writes, and out=None keeps none: give "
                       "out='runs/NAME' (flowrec.load(out) then scores it)")
    return nproc


# train()'s defaults that mean "not given": a resume keeps the run's own, the ranks get no flag for them
GIVEN_DEFAULTS = {"rows": DEFAULT_ROWS, "device": "auto", "checkpoint_every": 0}


def _train_on_ranks(spec: str | Path, model_spec: ModelSpec, folder: Path | None, continued: Path | None,
                    overwrite: bool, given: dict[str, Any], progress: bool, nproc: int, max_restarts: int) -> Run:
    """`train(..., nproc=N)`: the ranks of `flowrec train SPEC --nproc N` (the same processes, so the
    same run), after the checks of a launch and of the run folder in Python's words, before any rank
    starts. Their `warning:` lines become UserWarnings; a rank's failure is one `RanksFailed`; an
    interrupt stops every rank (they checkpoint) and is raised again, saying how to continue."""
    import sys
    import warnings

    from flowrec.runs.errors import EXIT_INTERRUPTED, RunError
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runs.launch import (RanksFailed, check_ranks_cache, check_ranks_data, check_ranks_fit,
                                     check_ranks_have_gpus, python_words, run_launch)
    from flowrec.runtime.rundir import folder_state

    if continued is not None:
        given = _given_again(given)
    try:
        check_ranks_have_gpus(model_spec, given["device"], nproc, python=True)
        check_ranks_fit(nproc, python=True)
        if continued is None:
            check_ranks_cache(model_spec, None, nproc, python=True)
        check_ranks_data(model_spec, given)
    except RunError as exc:
        raise _typed(exc) from None
    bound = model_spec.data is not None and model_spec.data.bound
    if continued is not None:
        folder = continued
        finished, data = _ranks_resumption(spec, model_spec, folder, given)
        if finished is not None:
            return _finished(folder, finished, given["device"])
    else:  # refused here as one process refuses it (a run there without overwrite=True, a foreign folder)
        found = folder_state(folder)
        claim_run_folder(folder, None, overwrite, model_spec.name, "overwrite=True",
                         _resume_command(spec, folder, nproc))[1].release_as_found(found)
        data = given["data"]
        _warn_rows_ignored(given["rows"], {"data": data}, model_spec, stacklevel=4)
    args = _rank_args(spec, folder, continued is not None, overwrite, given, progress, bool(data or bound))
    launch = run_launch(nproc, max_restarts, args, sys.stderr.write if progress else None)
    for line in launch.warnings:  # in this call's words (`max_steps=`), as one process says them
        warnings.warn(python_words(line), UserWarning, stacklevel=3)
    if launch.interrupt is not None:
        raise KeyboardInterrupt(_ranks_interrupted_line(launch, spec, folder, nproc, continued is not None))
    if launch.status == EXIT_INTERRUPTED:  # a signal to the ranks, not to this process (`kill` of a rank): they
        # checkpointed and stopped, as on an interrupt here (it was a RanksFailed: 'no rank said why')
        raise KeyboardInterrupt(_ranks_interrupted_line(launch, spec, folder, nproc, continued is not None,
                                                        "a signal to a rank"))
    if launch.status != 0:
        raise RanksFailed(nproc, launch.status, launch.lines)
    return load(folder, given["device"] or "auto")


def _ranks_resumption(spec: str | Path, model_spec: ModelSpec, folder: Path,
                      given: dict[str, Any]) -> tuple[str | None, str | None]:
    """The run in `folder` checked to go on, as `train(spec, resume=folder)` checks it in one process
    (`flowrec.runs.resume`, in Python's words; the folder left as it was): (its finished line, None
    where it is not finished; the data it trains on, None for synthetic rows or the spec's binding)."""
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runs.resume import finished_line, read_resumption, stream_folder_problem
    from flowrec.runtime.messages import shell_word
    from flowrec.runtime.rundir import RunFolderError, folder_state

    label = str(spec)
    if (problem := stream_folder_problem(folder, shell_word(label))):
        raise RunFolderError(problem)
    found = folder_state(folder)
    try:
        folder, lock = claim_run_folder(None, folder, False, model_spec.name, "overwrite=True")
    except RunFolderError:
        if (told := _finished_read_only(folder, given, model_spec, label)) is not None:
            return told, None
        raise
    with _RunGuard(lock, found):
        if (started_from := _unstarted_init_from(folder)) is not None:  # the ranks start it from that run again,
            # as `flowrec train SPEC --resume RUN --nproc N` does (one process refuses it: `init_from_unstarted_line`)
            return None, given["data"] or started_from.get("data")
        run = read_resumption(folder, given, model_spec, label)
        if run.finished is not None:
            return finished_line(folder, run.finished.position, run.finished.epochs, run.settings,
                                 run.finished.stopper, python=True), None
        if given["rows"] is not None:
            _warn_rows_ignored(given["rows"], run.settings, run.spec, stacklevel=5)
            _warn_other_synthetic_rows(given["rows"], folder, run.settings, run.spec,
                                       (run.recorded or {}).get("rows"), stacklevel=5)
    return None, run.settings["data"]


def _unstarted_init_from(folder: Path) -> dict[str, Any] | None:
    """The run.json of the run in `folder` where it was started from another (`flowrec train
    --init-from`) and stopped before its first checkpoint, else None. Its ranks' `flowrec train SPEC
    --resume RUN` starts it from that run again, with the checks of the command line (in its words,
    said in the call's by `python_words`); flowrec.train on one process cannot (it takes no init_from=)."""
    from flowrec.runs.settings import read_run_file
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME

    if (folder / CHECKPOINT_NAME).is_file():
        return None
    recorded = read_run_file(folder)
    return recorded if recorded and recorded.get("init_from") else None


def _rank_args(spec: str | Path, folder: Path, resumed: bool, overwrite: bool, given: dict[str, Any],
               progress: bool, on_data: bool) -> list[str]:
    """The `flowrec train` arguments of the ranks of `train(...)`'s call: the options it was given
    (one at its default left out, as the command line leaves it; `rows` too where the run trains on
    data), `-q` without `progress`.

    >>> _rank_args("-s.yaml", Path("runs/a"), False, True, {"rows": 100, "seed": 3}, False, True)
    ['./-s.yaml', '--out=runs/a', '--overwrite', '--seed=3', '-q']
    """
    word = str(Path(spec).expanduser())
    args = ["./" + word if word.startswith("-") else word, f"{'--resume' if resumed else '--out'}={folder}"]
    args += ["--overwrite"] if overwrite else []
    from flowrec.runs.launch import OPTION_FLAGS

    for key, flag in OPTION_FLAGS.items():
        value = given.get(key)
        if value is None or (key in GIVEN_DEFAULTS and value == GIVEN_DEFAULTS[key]) or (key == "rows" and on_data):
            continue
        args.append(f"{flag}={value}")
    return args + ([] if progress else ["-q"])


def _ranks_interrupted_line(launch: Any, spec: str | Path, folder: Path, nproc: int, resumed: bool,
                            how: str | None = None) -> str:
    """What a `KeyboardInterrupt` out of `train(..., nproc=N)` says: where the ranks stopped, what was
    kept and how to go on (rank 0's note tells whether training had started, or ended whole); `how`
    they were stopped, by default the interrupt of this process."""
    from flowrec.runtime.signals import interrupt_name

    how = how or interrupt_name(launch.interrupt)
    if launch.note is None:  # rank 0 had not begun training: the folder is as it was
        kept = f"; the run is as it was: {_resume_command(spec, folder, nproc)} continues it" if resumed else ""
        return f"training on {nproc} ranks interrupted ({how}) before training started; nothing was trained{kept}"
    if launch.note or launch.status == 0:  # the run ended whole before the interrupt reached its ranks
        return (f"interrupted ({how}) after the run finished: {folder} holds all of it; "
                f"flowrec.load({str(folder)!r}) scores it")
    step = _checkpoint_step(folder)
    if step is None:
        return (f"training on {nproc} ranks interrupted ({how}) before its first checkpoint: "
                f"{_resume_command(spec, folder, nproc)} starts it again")
    return _interrupted_line(step, spec, folder, nproc)


def _checkpoint_step(folder: Path) -> int | None:
    """The step of the checkpoint in `folder`, None where there is none (or it cannot be read)."""
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME, CheckpointError, load_checkpoint

    if not (folder / CHECKPOINT_NAME).is_file():
        return None
    try:
        step = load_checkpoint(folder / CHECKPOINT_NAME, mmap=True, lazy_shards=True)["position"]["step"]
    except (CheckpointError, OSError, KeyError, TypeError):
        return None
    return step if isinstance(step, int) else None


def _given_again(given: dict[str, Any]) -> dict[str, Any]:
    """The options of a resume as given: one left at its default is None (the run keeps its own)."""
    return {key: None if key in GIVEN_DEFAULTS and value == GIVEN_DEFAULTS[key] else value
            for key, value in given.items()}


def _warn_rows_ignored(rows: int, settings: dict[str, Any], spec: ModelSpec, stacklevel: int = 3) -> None:
    """A UserWarning where `rows` (given, not the default) is ignored: the run trains on data (`data=`,
    recorded or given, or the spec's binding), every row of it, as `flowrec train --rows N` says."""
    import warnings  # as `flowrec train --rows N` with data says: it trained on every row without a word

    if rows != DEFAULT_ROWS and (settings["data"] or (spec.data is not None and spec.data.bound)):
        warnings.warn(f"rows={rows} is ignored: it sets the rows of synthetic data, and this run trains on every "
                      f"row of {'data=' + str(settings['data']) if settings['data'] else 'the data the spec binds'} "
                      "(max_steps=N stops it sooner)", UserWarning, stacklevel=stacklevel)


def _warn_other_synthetic_rows(rows: int, folder: Path, settings: dict[str, Any], spec: ModelSpec,
                               recorded: int | None, stacklevel: int = 4) -> None:
    """A UserWarning where `rows=` given to the resume of a run on synthetic rows differs from the
    rows it was started with (`recorded`, its run.json's): it goes on from its checkpoint's place in
    other rows (`flowrec train --resume RUN --rows N` says so in a note; Python said nothing)."""
    import warnings

    if settings["data"] or (spec.data is not None and spec.data.bound):
        return  # a dataset's run: `_warn_rows_ignored` says rows= is ignored
    if recorded is not None and recorded != rows:
        warnings.warn(f"rows={rows} overrides the run's rows={recorded}: the run in {folder} goes on from its "
                      f"checkpoint's place in {rows:,} synthetic rows, not the {recorded:,} it started on (leave "
                      "rows= out to keep them)", UserWarning, stacklevel=stacklevel)


def _warn_other_data(data: str | None, rows: int, folder: Path, recorded: dict[str, Any] | None,
                     state: dict[str, Any]) -> None:
    """A UserWarning where `data=` given to a resume names other data than the run's, of another number
    of rows than it started on (its run.json's `train_rows`): the run goes on from its checkpoint's
    place, a place in the old rows, in these. `flowrec train --resume RUN --data DIR` notes that the
    flag overrides the run's data; Python said nothing (data moved to a new folder, the same rows,
    is not said)."""
    import warnings

    started = (recorded or {}).get("train_rows")
    if data is None or not isinstance(started, int) or isinstance(started, bool) or started == rows:
        return
    at = state.get("position") or {}
    warnings.warn(f"data={data!r} overrides the run's data={(recorded or {}).get('data')!r}: it holds {rows:,} "
                  f"training rows, the run started on {started:,}, and goes on from its checkpoint's place (epoch "
                  f"{at.get('epoch')} batch {at.get('batch')}) in them (leave data= out, or give the run's data, to "
                  "continue it as it was)", UserWarning, stacklevel=4)


def _resumed_folder(resume: str | Path | None, out: str | Path | None, overwrite: bool) -> Path | None:
    """The run folder `resume=` names ('~' expanded), None without it; with `overwrite=True`, or
    `out=` naming another folder, a `RunError` in the words `flowrec train --resume` refuses its flags in."""
    from flowrec.runs.errors import RunError

    if resume is None:
        return None
    folder = Path(resume).expanduser()
    if overwrite:
        raise RunError("resume= continues a run and overwrite=True replaces it; give one of them")
    if out is not None and Path(out).expanduser().absolute() != folder.absolute():
        raise RunError(f"out={str(out)!r} and resume={str(resume)!r} name different run folders")
    return folder


def _run_class_files(spec: ModelSpec, folder: Path) -> ModelSpec:
    """`spec` with its custom class files as the run in `folder` finds them (a relative one of an
    older run, an absolute one gone with the moved run), each moved file said in a UserWarning."""
    import warnings

    from flowrec.runs.errors import RunError
    from flowrec.spec.class_paths import run_class_files

    try:
        spec, notes = run_class_files(spec, folder)
    except ValueError as exc:
        raise RunError(str(exc)) from None
    for line in notes:
        warnings.warn(line, UserWarning, stacklevel=3)
    return spec


def _train_resumed(spec: str | Path | ModelSpec, spec_path: Path, model_spec: ModelSpec, folder: Path,
                   given: dict[str, Any], progress: bool, hooks: Callable[[Any], Hooks]) -> Run:
    """`train(spec, resume=folder)`: the run in `folder` continued where it stopped, as `flowrec
    train SPEC --resume RUN` continues it in one process (`flowrec.runs.resume`): its recorded
    settings, `given`'s options over them (one left at its default keeps the run's), its checkpoint's
    plan, its data checked to be the rows it started on. A finished run is said in a UserWarning
    and returned loaded, nothing written; a refused one leaves its folder as it was."""
    from contextlib import nullcontext

    from flowrec.graph.plan_io import plan_json
    from flowrec.runs.errors import RunError
    from flowrec.runs.folder import claim_run_folder
    from flowrec.runs.plan import plan_for_run
    from flowrec.runs.resume import (changed_data_line, finished_line, read_resumption, resumed_device,
                                     stream_folder_problem)
    from flowrec.runs.settings import write_run_file
    from flowrec.runs.start import record_encoder, start_session, train_config
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME
    from flowrec.runtime.messages import shell_word
    from flowrec.runtime.progress import reading_bar
    from flowrec.runtime.rundir import RunFolderError, clear_run_files, folder_state
    from flowrec.runtime.trainer import Trainer
    from flowrec.serving.trained import Trained
    from operators.embedding import restoring_tables

    given = _given_again(given)  # not given: the run's own
    label = str(spec) if not isinstance(spec, ModelSpec) else f"ModelSpec {spec.name!r}"
    if (problem := stream_folder_problem(folder, shell_word(label) if not isinstance(spec, ModelSpec) else "SPEC")):
        raise RunFolderError(problem)  # not "nothing to resume: it has no checkpoint.pt or run.json"
    found, finished = folder_state(folder), None
    try:
        folder, lock = claim_run_folder(None, folder, False, model_spec.name, "overwrite=True")
    except RunFolderError:
        if (told := _finished_read_only(folder, given, model_spec, label)) is not None:
            return _finished(folder, told, given["device"])
        raise
    with _RunGuard(lock, found, f"; the run is as it was: {_resume_command(spec, folder)} continues it") as guard:
        run = read_resumption(folder, given, model_spec, label)
        settings, state = run.settings, run.state
        if run.finished is not None:  # told from its checkpoint: nothing read, built or written
            finished = finished_line(folder, run.finished.position, run.finished.epochs, settings,
                                     run.finished.stopper, python=True)
            return _finished(folder, finished, given["device"])
        if given["rows"] is not None:
            _warn_rows_ignored(given["rows"], settings, run.spec, stacklevel=4)
            _warn_other_synthetic_rows(given["rows"], folder, settings, run.spec, (run.recorded or {}).get("rows"))
        if state is None:  # stopped before its first checkpoint: from step 0, with its recorded settings
            plan, dev = plan_for_run(run.spec, settings["device"] or "auto", settings["device_budget"], None,
                                     data=settings["data"], epochs=settings.get("epochs"),
                                     max_steps=settings.get("max_steps"), progress=reading_bar(progress))
        else:
            plan, dev = run.plan, resumed_device(given["device"], run.spec, settings, folder, python=True)
        with restoring_tables() if state is not None else nullcontext():  # every table from the checkpoint
            session = guard.session = start_session(run.spec, spec_path, settings, folder, plan, dev, resumed=True,
                                                        python=True)
        _warn_label_warnings(session)
        rows = sum(session.train.partition_rows())
        if state is not None and settings.get("train_rows") not in (None, rows):
            session.model.close()
            raise RunError(changed_data_line(settings, rows, folder, state, python=True))
        if state is not None and settings.get("train_rows") is None:  # data= other than the run's: not checked
            _warn_other_data(given["data"], rows, folder, run.recorded, state)
        settings["train_rows"] = rows
        encoder = record_encoder(session, folder, True, None, _warn_line)
        trainer = guard.trainer = Trainer(session.spec, session.plan, session.model,
                                          train_config(settings, folder, progress), plan_json(session.plan))
        if state is not None:
            trainer.load_state(state, folder / CHECKPOINT_NAME)
            state.clear()  # the model has its copy: release the checkpoint's (memory-mapped) tensors
            if trainer.finished(session.train):  # where the checkpoint alone could not tell (custom modules)
                session.model.close()
                finished = finished_line(folder, trainer.position, trainer.epochs, settings, trainer.stopper,
                                         python=True)
        else:
            clear_run_files(folder)
        if finished is None:
            write_run_file(folder, settings, run.spec)
            result = trainer.fit(session.train, session.eval, hooks=hooks(trainer))
    if finished is not None:
        return _finished(folder, finished, given["device"])
    if result.interrupted:
        raise KeyboardInterrupt(_interrupted_line(result.steps, spec, folder))
    _warn_small_catalogue(session.model)
    _warn_covered_classes(result.eval)
    return Run(session.spec, folder, result, Trained(session.spec, session.model, session.plan, encoder, result.steps))


class _RunGuard:
    """The error routing and clean-up around a run of `train` (new or resumed), as `flowrec train`
    has them: a `RunError` re-raised as its documented type; a run refused (a usage error, or the
    errors `flowrec train` exits 2 for) leaves no folder it made and an empty one empty (`lock`,
    None without a run folder, released as `found`); a custom module's own error reaches the caller
    as its own type with `flowrec train`'s line as a note (`trainer`, once there is one); the data
    sources of `session` closed (reader threads, Dask cluster, row cache; check record saved) and the
    kept sample forgotten, whatever happened. An interrupt before the trainer is made (planning,
    reading or generating the data, building the model) is a KeyboardInterrupt saying so, as
    `flowrec train` says it (`kept`: what a resumed run's line adds); it was a bare one, with no
    word of what was kept."""

    def __init__(self, lock: Any, found: Any, kept: str = "") -> None:
        self.lock, self.found, self.kept = lock, found, kept
        self.trainer: Any = None
        self.session: Any = None

    def __enter__(self) -> "_RunGuard":
        return self

    def __exit__(self, kind: Any, exc: BaseException | None, tb: Any) -> None:
        from flowrec.data.layout import DataError
        from flowrec.data.profile import forget_kept_sample
        from flowrec.runs.errors import EXIT_USAGE, RunError
        from flowrec.runtime.checkpoint.store import CheckpointError
        from flowrec.runtime.nonfinite import TrainingStopped
        from flowrec.runtime.run_log import MetricsError
        from flowrec.runtime.rundir import RunFolderError
        from flowrec.runtime.signals import Terminated, interrupt_name

        exit_two = (DataError, RunFolderError, CheckpointError, MetricsError, TrainingStopped)  # `flowrec train`'s
        refused = isinstance(exc, exit_two) or (isinstance(exc, RunError) and exc.code == EXIT_USAGE)
        try:
            if isinstance(exc, Exception) and not isinstance(exc, (RunError, *exit_two)) and self.trainer is not None:
                _note_custom(exc, self.trainer)  # where it stopped, whose code, what was kept
        finally:
            if self.session is not None:
                self.session.close_data()
            forget_kept_sample()  # a run that stopped before its hot set was chosen holds no sample
            if self.lock is not None:
                self.lock.release_as_found(self.found, refused)
        if isinstance(exc, exit_two):  # a RunError is made in the call's words (`python=True`); a lower
            _in_python_words(exc)  # layer's error, raised or reported by one (`_typed`), is not
        if isinstance(exc, RunError):
            typed = _typed(exc)
            raise (exc if typed is exc else _in_python_words(typed)) from None
        if isinstance(exc, KeyboardInterrupt) and self.trainer is None and (not exc.args or isinstance(exc, Terminated)):
            raise KeyboardInterrupt(f"interrupted ({interrupt_name(exc)}) before training started; nothing was "
                                    f"trained{self.kept}") from None


def _in_python_words(exc: BaseException) -> BaseException:
    """`exc` (flowrec's own one-line error, raised below `flowrec.train`) with its line in the words of
    the Python call (`launch.python_words`: `--eval-data DIR` as `eval_data=DIR`, a `flowrec train`
    command as the `flowrec.train(...)` call), as the ranks of `nproc=N` have their lines said; one
    process said the command line's flags (`give --eval-data DIR (eval_data=)`, `start over with
    --out RUN --overwrite`). An error of another shape (several arguments) is left as it is."""
    from flowrec.runs.launch import python_words

    if len(exc.args) == 1 and isinstance(exc.args[0], str):
        exc.args = (python_words(exc.args[0]),)
    return exc


def _finished_read_only(folder: Path, given: dict[str, Any], spec: ModelSpec, label: str) -> str | None:
    """The finished line of a finished run in a folder this process cannot write (an archived run, a
    read-only mount: its lock cannot be made), told from its checkpoint as in a folder it can lock
    (`flowrec train --resume` says it alike); None where it is not told so: the lock's error stands."""
    from flowrec.data.layout import DataError
    from flowrec.runs.errors import RunError
    from flowrec.runs.resume import finished_line, finished_looking_read_only, read_resumption
    from flowrec.runtime.checkpoint.store import CheckpointError
    from flowrec.runtime.rundir import RunFolderError

    if not finished_looking_read_only(folder, given, spec):
        return None
    try:
        run = read_resumption(folder, given, spec, label)
    except (RunError, RunFolderError, CheckpointError, DataError):
        return None
    if run.finished is None:
        return None
    return finished_line(folder, run.finished.position, run.finished.epochs, run.settings, run.finished.stopper,
                         python=True)


def _finished(folder: Path, line: str, device: str | None) -> Run:
    """A resumed run found at its end: `line` said in a UserWarning, the run loaded as `load` gives it."""
    import warnings

    warnings.warn(line, UserWarning, stacklevel=4)  # the caller of `train`
    return load(folder, device or "auto")


def _note_custom(exc: BaseException, trainer: Any) -> None:
    """Add to `exc` the line `flowrec train` says where a custom module's code raised it in training
    or evaluation (its forward, the model's backward, its state code): the step, the module and its
    class, what the run kept. Python 3.11+ shows notes under the traceback; 3.10 has none."""
    line = trainer.custom_failure_line(exc)
    if line is not None and hasattr(exc, "add_note"):
        exc.add_note(f"flowrec: {line}")


def _warn_small_catalogue(model: Any) -> None:
    """A UserWarning when a retrieval head's top_k reaches the items its catalogue holds (hr@K is
    then 1.0 whatever the model), as `flowrec train` and `flowrec eval` warn on the console."""
    import warnings

    from flowrec.runtime.retrieval import small_catalogue

    if model.retrieval is not None:
        line = small_catalogue(model.retrieval, model.head_names[model.retrieval.head])
        if line is not None:
            warnings.warn(line, UserWarning, stacklevel=3)


def _warn_session_classes(spec: ModelSpec, folder: Path | None) -> None:
    """A UserWarning per custom module whose class is one of this Python session (`__main__:Gate`,
    defined in the notebook or script), where the run is kept in `folder`: the run trained, but no
    other session could load, resume or export it (`cannot import '__main__:Gate'`) unless it
    defined the class again, which nothing said until a restarted kernel met it."""
    import warnings

    if folder is None:
        return
    for module in spec.modules:
        path = module.param("class") if module.kind == "custom" else None
        if isinstance(path, str) and path.startswith("__main__:"):
            name = path.removeprefix("__main__:")
            warnings.warn(f"custom module {module.name!r} is {path}, a class of this Python session: the run in {folder} "
                          "is loaded, resumed and exported only where __main__ defines it again (a restarted kernel "
                          f"does not); put the class in a file and give its path ('blocks.py:{name}')",
                          UserWarning, stacklevel=3)


def _warn_label_warnings(session: Any) -> None:
    """A UserWarning per binary head whose training labels are all one class or per weight column
    whose training weights are all 0 (`label_warnings`), as `flowrec train` warns on the console."""
    import warnings

    from flowrec.runtime.session import label_warnings

    for line in label_warnings(session.spec, session.train):
        warnings.warn(line, UserWarning, stacklevel=3)


def _warn_line(line: str) -> None:
    """A console warning line of a run's start (`warning: ...`) as a UserWarning (`flowrec.train`)."""
    import warnings

    warnings.warn(line.removeprefix("warning: "), UserWarning, stacklevel=2)


def _warn_covered_classes(metrics: Metrics) -> Metrics:
    """`metrics`, after a UserWarning for each head whose metrics are NaN (NaN scores, naming the
    custom module that returned them; one class of labels) and for each multiclass head whose k of
    accuracy@k reaches the classes its evaluation rows hold (accuracy_at_k then 1.0 for any model
    that ranks the others last), as `flowrec train` and `flowrec eval` say on the console."""
    import warnings

    from flowrec.runtime.evaluation.classes import top_k_covers_classes
    from flowrec.runtime.evaluation.undefined import PYTHON, undefined_notes

    for line in undefined_notes(metrics, PYTHON) + top_k_covers_classes(metrics):
        warnings.warn(line, UserWarning, stacklevel=3)
    return metrics


def _resume_command(spec: str | Path | ModelSpec, folder: Path, nproc: int = 1) -> str:
    """The Python call that continues the run in `folder` (a `ModelSpec` is named `spec`), on
    `nproc` ranks where it ran on more than one.

    >>> _resume_command("tiny.yaml", Path("runs/tiny")), _resume_command("t.yaml", Path("r"), 2)
    ("`flowrec.train('tiny.yaml', resume='runs/tiny')`", "`flowrec.train('t.yaml', resume='r', nproc=2)`")
    """
    ranks = f", nproc={nproc}" if nproc > 1 else ""
    return (f"`flowrec.train({repr(str(spec)) if not isinstance(spec, ModelSpec) else 'spec'}, "
            f"resume={str(folder)!r}{ranks})`")


def _interrupted_line(step: int, spec: str | Path | ModelSpec, folder: Path | None, nproc: int = 1) -> str:
    """What a `KeyboardInterrupt` out of `train` says: where the run stopped and how to go on.

    >>> _interrupted_line(5, "tiny.yaml", Path("runs/tiny"))
    "training interrupted after step 5; its checkpoint is in runs/tiny: flowrec.load('runs/tiny') scores it, `flowrec.train('tiny.yaml', resume='runs/tiny')` continues it"
    """
    if folder is None:
        return f"training interrupted after step {step} (out=None: nothing was kept)"
    return (f"training interrupted after step {step}; its checkpoint is in {folder}: flowrec.load({str(folder)!r}) "
            f"scores it, {_resume_command(spec, folder, nproc)} continues it")


def _check_kinds(**arguments: tuple[Any, str]) -> None:
    """A `RunError` naming the first argument that is not a path (str / os.PathLike) or text as
    wanted (`name=(value, wanted)`; None is allowed where `wanted` ends with 'or None')."""
    import os

    from flowrec.runs.errors import RunError

    for name, (value, wanted) in arguments.items():
        kinds = (str, os.PathLike) if "path" in wanted else (str,)
        if not isinstance(value, kinds) and not (value is None and wanted.endswith("or None")):
            raise RunError(f"{name} must be {wanted}, not {_shown(value)}")
        if "path" in wanted:
            _refuse_empty_path(name, value)
        elif value == "":  # `group_by=""` was read as no group_by: scored without gAUC, as `--group-by ""` was
            raise RunError(f"{name} is empty: give {wanted.removesuffix(' or None')}, or leave it out for its default")


def _refuse_empty_path(name: str, value: Any) -> None:
    """A `RunError` for a path given as "" (`os.environ.get("OUT", "")`), which `Path` reads as '.':
    `train(out="")` trained into the working folder, as `flowrec train --out ""` did before the CLI
    refused an empty path; or for a path flowrec cannot use (`unusable_path`: a name that is not
    UTF-8, as `os.listdir` gives a latin-1 name, or one too long), which was a UnicodeEncodeError
    writing run.json, or an OSError, after the run folder was made."""
    import os

    from flowrec.runs.errors import RunError
    from flowrec.data.paths import unusable_path

    if isinstance(value, str) and value == "":
        raise RunError(f"{name} is an empty path: give a file or folder name ('.' for the working folder)")
    if isinstance(value, (str, os.PathLike)) and (problem := unusable_path(Path(value).expanduser())):
        raise RunError(f"{name}: {problem}")


def _shown(value: Any) -> str:
    """A refused argument in one line: its repr (80 characters at most), or its type where the repr
    spans lines (a DataFrame's table, whose rows would read as more lines of the error).

    >>> _shown("runs/a"), _shown(3.0)
    ("'runs/a'", '3.0')
    """
    text = repr(value)
    if "\n" not in text:
        return f"{text:.80}"
    kind = type(value)
    frame = kind.__module__.startswith("pandas") or kind.__module__.startswith("pyarrow")
    return (f"a {kind.__module__.split('.')[0]}.{kind.__qualname__}" +
            (" (rows are read from a dataset folder: write them to Parquet and `flowrec data convert parquet` "
             "them; flowrec.load_model(PACKAGE).predict scores rows in memory)" if frame else ""))


def _check_arguments(**arguments: Any) -> None:
    """Refuse an argument of the wrong kind before anything is read or written (a `RunError`, one
    line naming it): paths are str or os.PathLike, callbacks callable, switches bool."""
    import os
    from collections.abc import Mapping

    from flowrec.runs.errors import RunError

    def refuse(name: str, wanted: str) -> None:
        raise RunError(f"{name} must be {wanted}, not {_shown(arguments[name])}")

    if isinstance(arguments["spec"], Mapping):  # its repr, cut at 80 characters, named no way to a ModelSpec
        raise RunError("spec must be a spec file path or a ModelSpec, not a dict: flowrec.spec.spec_from_dict(spec) "
                       "makes a ModelSpec of it (checked as a spec file is)")
    if not isinstance(arguments["spec"], (str, os.PathLike, ModelSpec)):
        refuse("spec", "a spec file path or a ModelSpec")
    if isinstance(arguments["spec"], str) and "\n" in arguments["spec"]:  # was "cannot read the file: File name too long"
        raise RunError("spec must be a spec file path or a ModelSpec, not the text of a spec: write it to a "
                       "file and give its path")
    _refuse_empty_path("spec", arguments["spec"])
    for name in ("data", "eval_data", "out", "resume"):
        if arguments[name] is not None and not isinstance(arguments[name], (str, os.PathLike)):
            refuse(name, "a folder path (str or pathlib.Path) or None")
        _refuse_empty_path(name, arguments[name])
    for name, event in (("on_step", "StepEvent"), ("on_eval", "EvalEvent"), ("on_checkpoint", "CheckpointEvent")):
        if arguments[name] is not None and not callable(arguments[name]):
            refuse(name, "a callable or None")
        if arguments[name] is not None and (problem := _call_problem(arguments[name])) is not None:
            raise RunError(f"{name} must take one argument, the {event} (def {name}(event): ...); {problem}")
    for name in ("overwrite", "progress"):
        if not isinstance(arguments[name], bool):
            refuse(name, "True or False")
    if not isinstance(arguments["device"], str):
        refuse("device", "a device name (auto, cpu, cuda)")
    _check_device(arguments["device"])
    if arguments["device_budget"] is not None and not isinstance(arguments["device_budget"], str):
        refuse("device_budget", "a byte size such as '4GiB', or None")


def _call_problem(callback: Callable[..., Any]) -> str | None:
    """Why `callback` cannot be called with the one event a run gives it (its signature's binding
    refused, in Python's words), else None (also where Python cannot tell its signature: a builtin).
    A callback of no argument was a TypeError at the first step, after the data was read, the model
    built and the run folder written.

    >>> _call_problem(lambda event: None), _call_problem(print)
    (None, None)
    >>> _call_problem(lambda: None)
    'it takes no argument'
    """
    import inspect

    try:
        signature = inspect.signature(callback)
    except (TypeError, ValueError):  # no signature Python can read: called as given
        return None
    try:
        signature.bind(None)
    except TypeError as exc:
        return "it takes no argument" if not signature.parameters else f"calling it with one event: {exc}"
    return None


def _check_device(device: str) -> None:
    """A `RunError` naming the argument for a device torch does not read (`device="tpu"`), one torch
    reads but flowrec does not run on (`device="meta"`, "mps"), or a CUDA device on a machine
    without CUDA (they were torch's RuntimeError, and the session's naming the CLI's `--device`)."""
    import torch

    from flowrec.runs.errors import RunError
    from flowrec.runtime.session import device_problem

    problem = device_problem(device)
    if problem is not None:
        raise RunError(f"device {problem}")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise RunError(f"device {device!r} was asked for, but CUDA is not available on this machine: "
                       "give device=\"cpu\" (or \"auto\")")


def _with_custom_widths(spec: ModelSpec, source: str) -> ModelSpec:
    """`resolve_custom`, its `SpecError` (a custom class that fails its dry run) naming the spec as
    a spec file's problems do (`my.yaml: 1 error(s)`), where it began ': 1 error(s)'."""
    from flowrec.runtime.custom import resolve_custom
    from flowrec.spec.errors import SpecError

    try:
        return resolve_custom(spec)
    except SpecError as exc:
        raise SpecError(exc.issues, exc.source or source) from None


def _check_model_spec(spec: ModelSpec) -> None:
    """A `ModelSpec` built or changed in Python (`dataclasses.replace`) is held to the rules of a
    spec file: `SpecError` with every problem (batch_size 0 divided by zero, epochs 0 trained nothing)."""
    from flowrec.runs.errors import RunError
    from flowrec.spec.errors import SpecError
    from flowrec.spec.load import to_dict
    from flowrec.spec.validate import validate_document

    try:
        issues = validate_document(to_dict(spec))
    except (TypeError, ValueError, AttributeError, KeyError) as exc:  # a field of the wrong kind
        raise RunError(f"spec {getattr(spec, 'name', '?')!r} cannot be read as a spec: {exc}") from None
    if issues:
        raise SpecError(issues, f"ModelSpec {spec.name!r}")


def _typed(exc: Any) -> BaseException:
    """The documented exception of a lifecycle error: the lower layer's own (a `DataError` for data
    that does not fit) when it reports one, else the `RunError` (a ValueError: device, plan)."""
    return exc.cause if exc.cause is not None else exc


def _whole(value: Any) -> Any:
    """A whole number of another integer type (numpy's `np.int64(3)`, from a frame's `len` or a
    computation in a notebook) as a Python int, which run.json records; anything else unchanged, for
    `given_problem` to judge (a bool stays one: it is refused).

    >>> import numpy as np
    >>> _whole(np.int64(3)), _whole(True), _whole(2.0)
    (3, True, 2.0)
    """
    import numbers

    if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
        return int(value)
    return value


def _text(value: str | Path | None) -> str | None:
    """A path argument as run.json records it, '~' expanded (as pandas does; the shell does it for the CLI)."""
    return str(Path(value).expanduser()) if value is not None else None


def _hooks(trainer: Any, on_step: Callback | None, on_eval: Callback | None,
           on_checkpoint: Callback | None) -> Hooks:
    """Trainer hooks calling the user's callbacks with events; True (or np.True_) from one requests a stop,
    and so does another value that is true (`return 1`), said once per callback in a UserWarning."""
    import copy
    from dataclasses import replace

    import numpy as np

    warned: set[str] = set()

    def stop_if(name: str, answer: Any) -> None:
        # True, or numpy's True (`return np.mean(losses[-10:]) < 0.3` gives np.True_, which `is True` missed)
        if answer is None or isinstance(answer, (bool, np.bool_)):
            if answer:
                trainer.request_stop()
            return
        # another value (`return 1`, `return "stop"`, a 0-d tensor) was ignored without a word: the run went on
        truth = _truth(name, answer, trainer.position.step)
        if name not in warned:
            import warnings

            warned.add(name)
            warnings.warn(f"{name} returned {_shown(answer)} ({type(answer).__name__}), read as {truth}: "
                          f"{'the run stops after' if truth else 'the run goes on after'} step "
                          f"{trainer.position.step}; return True to stop it, None or False to go on",
                          UserWarning, stacklevel=2)
        if truth:
            trainer.request_stop()

    def step(pos: Position, loss: float | None) -> None:
        stop_if("on_step", on_step(StepEvent(pos.step, pos.epoch, pos.samples, loss)))

    def evaluation(event: EvalEvent) -> None:
        # the callback's own copy of the metrics: one that rounded or popped them changed the run's
        # final metrics and the final record of metrics.jsonl (the trainer's dict, shared)
        stop_if("on_eval", on_eval(replace(event, metrics=copy.deepcopy(event.metrics))))

    def checkpoint(at: int, path: Path) -> None:
        stop_if("on_checkpoint", on_checkpoint(CheckpointEvent(at, path)))

    return Hooks(step if on_step else None, evaluation if on_eval else None,
                      checkpoint if on_checkpoint else None)


def _truth(name: str, answer: Any, step: int) -> bool:
    """Whether a callback's answer other than None or a bool asks for a stop: its truth, or a
    `RunError` where it has none (an array of several values; the run folder is kept as it is)."""
    from flowrec.runs.errors import RunError

    try:
        return bool(answer)
    except Exception:  # numpy's and torch's ambiguous truth, or a __bool__ of the user's that raises
        raise RunError(f"{name} returned {_shown(answer)} at step {step}, which is neither true nor false: return "
                       "True to stop the run after this step, None or False to go on", code=1) from None
