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
    """A checkpoint written at `step` to `path` (RUN/checkpoint.pt, or RUN/best/checkpoint.pt)."""

    step: int
    path: Path


Callback = Callable[[Any], Union[bool, None]]  # return True to stop the run after this step


@dataclass
class Run:
    """A trained model with its spec, run folder and metrics.

    Args:
        spec: the model spec.
        run_dir: the run folder (None for a run trained with `out=None`: nothing on disk).
        result: what `train` returned (None for a loaded run).
        trained: the model as scored (`flowrec.runtime.serving.Trained`).
    """

    spec: ModelSpec
    run_dir: Path | None
    result: TrainResult | None
    trained: Any = field(repr=False)

    @property
    def metrics(self) -> Metrics:
        """The final evaluation per head (empty when the run had no evaluation set)."""
        if self.result is not None:
            return self.result.eval
        finals = [r for r in self.history if r.get("event") == "eval"]
        return finals[-1]["metrics"] if finals else {}

    @property
    def history(self) -> list[dict[str, Any]]:
        """The records of the run's metrics.jsonl: one per step (loss, learning rates), evaluation, end."""
        if self.run_dir is None:
            return []
        from flowrec.runtime.metrics import read_records
        from flowrec.runtime.rundir import METRICS_FILE

        return read_records(self.run_dir / METRICS_FILE)

    def evaluate(self, data: str | Path, group_by: str | None = None) -> Metrics:
        """Score an encoded dataset (a folder from `flowrec data convert` / `synth`, or a run's
        data/test): exact metrics per head; with `group_by` (a one-id categorical feature) also gAUC."""
        return self.trained.evaluate_dataset(Path(data), group_by or self.spec.training.eval_group_by)


def load(run_dir: str | Path, device: str = "auto") -> Run:
    """A finished run (or a checkpoint file, or RUN/best) loaded for scoring.

    Raises:
        flowrec.runtime.checkpoint.CheckpointError: a damaged or foreign checkpoint.
    """
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.checkpoint import checkpoint_path
    from flowrec.runtime.serving import load_trained

    trained = load_trained(Path(run_dir), device, scoring_plan)
    folder = checkpoint_path(Path(run_dir)).parent
    return Run(trained.spec, folder, None, trained)


def train(spec: str | Path | ModelSpec, *, data: str | Path | None = None, eval_data: str | Path | None = None,
          out: str | Path | None = None, overwrite: bool = False, epochs: int | None = None,
          max_steps: int | None = None, eval_every: int | None = None, checkpoint_every: int = 0,
          device: str = "auto", device_budget: str | None = None, rows: int = 400_000, seed: int | None = None,
          progress: bool = False, on_step: Callback | None = None, on_eval: Callback | None = None,
          on_checkpoint: Callback | None = None) -> Run:
    """Train a spec end to end, as `flowrec train` does, and return the run.

    Args:
        spec: a spec file (YAML/JSON) or a loaded `ModelSpec` (its data binding is then relative
            to the current folder).
        data: encoded dataset folder (DIR/train + DIR/test when split); default: the spec's data
            binding, else `rows` synthetic rows (+20% for evaluation).
        eval_data: encoded evaluation dataset folder.
        out: run folder (checkpoint.pt, metrics.jsonl, best/, TensorBoard); None writes nothing.
            A folder holding a run needs `overwrite=True`; `flowrec train SPEC --resume OUT`
            continues a run started here.
        overwrite: replace the run in `out`.
        epochs, max_steps, eval_every, checkpoint_every, device, device_budget, seed: as the
            `flowrec train` options of the same names.
        rows: synthetic training rows when there is no data.
        progress: show the progress bar.
        on_step: called with a `StepEvent` after every step.
        on_eval: called with an `EvalEvent` after every evaluation.
        on_checkpoint: called with a `CheckpointEvent` after every checkpoint.

    Raises:
        flowrec.spec.errors.SpecError: the spec is not valid (every problem listed).
        flowrec.runtime.rundir.RunFolderError: `out` is in use, holds a run, or is not a run folder.
        flowrec.data.layout.DataError: the data does not fit the spec.
        flowrec.runtime.nonfinite.TrainingStopped: a non-finite loss stopped training.
    """
    from flowrec.graph.plan_io import plan_json
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.rundir import RunFolderError, clear_run_files, foreign_entries, has_run, open_folder
    from flowrec.runtime.session import SessionOptions, cost_target, prepare, resolve_device
    from flowrec.runtime.trainer import TrainConfig, Trainer
    from flowrec.runtime.custom import resolve_custom
    from flowrec.spec.load import load_spec

    spec_path = Path(spec) if not isinstance(spec, ModelSpec) else Path.cwd() / f"{spec.name}.yaml"
    model_spec = resolve_custom(load_spec(spec_path) if not isinstance(spec, ModelSpec) else spec)
    folder = Path(out) if out is not None else None
    lock = None
    if folder is not None:
        foreign = foreign_entries(folder)
        if foreign:
            raise RunFolderError(f"{folder} is not empty and is not a flowrec run folder (it holds {foreign[0]})")
        lock = open_folder(folder)
    try:
        if folder is not None:
            if has_run(folder) and not overwrite:
                raise RunFolderError(f"{folder} already holds a run (checkpoint.pt); give overwrite=True to "
                                     f"replace it")
            clear_run_files(folder)
        dev = resolve_device(device if device != "auto" else model_spec.plan.device)
        plan = make_plan(model_spec, target=cost_target(dev), device_budget=device_budget)
        opts = SessionOptions(data=_path(data), eval_data=_path(eval_data), device=device,
                              device_budget=device_budget, synthetic_rows=rows, seed=seed, workdir=folder)
        session = prepare(model_spec, spec_path, opts, plan, dev)
        config = TrainConfig(epochs=epochs, out_dir=folder, eval_every=eval_every, max_steps=max_steps,
                             checkpoint_every=checkpoint_every, progress=progress)
        trainer = Trainer(session.spec, session.plan, session.model, config, plan_json(session.plan))
        if folder is not None:
            _write_settings(folder, trainer, data, eval_data, rows, seed, device, device_budget, max_steps,
                            checkpoint_every)
        result = trainer.fit(session.train, session.eval, hooks=_hooks(trainer, on_step, on_eval, on_checkpoint))
    finally:
        if lock is not None:
            lock.release()
    from flowrec.runtime.serving import Trained

    return Run(session.spec, folder, result, Trained(session.spec, session.model, session.plan))


def _path(value: str | Path | None) -> Path | None:
    return Path(value) if value is not None else None


def _hooks(trainer: Any, on_step: Callback | None, on_eval: Callback | None,
           on_checkpoint: Callback | None) -> Hooks:
    """Trainer hooks calling the user's callbacks with events; True from one requests a stop."""
    def stop_if(answer: bool | None) -> None:
        if answer is True:
            trainer.request_stop()

    def step(pos: Position, loss: float | None) -> None:
        stop_if(on_step(StepEvent(pos.step, pos.epoch, pos.samples, loss)))

    def evaluation(event: EvalEvent) -> None:
        stop_if(on_eval(event))

    def checkpoint(at: int, path: Path) -> None:
        stop_if(on_checkpoint(CheckpointEvent(at, path)))

    return Hooks(step if on_step else None, evaluation if on_eval else None,
                      checkpoint if on_checkpoint else None)


def _write_settings(folder: Path, trainer: Any, data: Any, eval_data: Any, rows: int, seed: int | None,
                    device: str, device_budget: str | None, max_steps: int | None, checkpoint_every: int) -> None:
    """run.json as `flowrec train` writes it, so `flowrec train SPEC --resume OUT` continues the run."""
    import json

    from flowrec.runtime.rundir import RUN_FILE, write_text

    settings = {"data": str(data) if data is not None else None,
                "eval_data": str(eval_data) if eval_data is not None else None, "rows": rows, "seed": seed,
                "device": device, "device_budget": device_budget, "dask": None, "cache": None, "plan": None,
                "epochs": trainer.epochs, "max_steps": max_steps, "eval_every": trainer.eval_every,
                "checkpoint_every": checkpoint_every, "interleave": True, "compile": False, "nan_policy": "stop"}
    write_text(folder / RUN_FILE, json.dumps(settings, indent=2, sort_keys=True) + "\n")
