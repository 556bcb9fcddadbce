"""`flowrec train`, `flowrec eval` and `flowrec export`: run a plan, score and export checkpoints.

torch and the data stack are imported inside the commands, so other commands start fast.
"""
from __future__ import annotations

import json
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import typer

from flowrec.cli.common import fail, load_spec_or_exit

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_OUT_OF_MEMORY = 3


def _say(message: str) -> None:
    typer.echo(message, err=True)


@dataclass(frozen=True)
class RunRequest:
    """What the command line asked for: the spec, where to run, and the settings given."""

    spec_path: Path
    out: Path | None
    resume: Path | None
    overwrite: bool
    given: dict
    quiet: bool
    json_out: bool
    report: bool


def train(
    spec_path: Path = typer.Argument(..., help="Model spec (YAML or JSON)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Encoded dataset folder (from `flowrec data convert` or `flowrec data synth`); DIR/train and DIR/test when split. Default: the spec's data binding, else synthetic data."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Encoded evaluation dataset folder."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="Epochs (default: the spec's training.epochs)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto (cuda if available, else cpu), cpu or cuda. Default: auto."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: runs/<spec name>, numbered if taken). A folder holding a run is refused unless --resume or --overwrite."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder exactly where it stopped, with the settings it was started with (flags given again override them)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in the --out folder (its checkpoint and metrics) with a new one."),
    device_budget: Optional[str] = typer.Option(None, "--device-budget", help="Device memory budget for the planner, e.g. 4GiB."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Train exactly this plan (from `flowrec plan SPEC --json FILE`, possibly edited: placements, cache rows, micro-batches, prefetch, group order), checked against the spec."),
    target: Optional[str] = typer.Option(None, "--target", help="Cost-model device the plan is made for: cpu, a100, h100 (datasheet constants) or a profile FILE from `flowrec calibrate`. Default: the datasheet profile of --device."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Cache policy for tables that do not fit the budget: auto, none (host), static_hot (FAE) or lookahead (ScratchPipe). Default: the spec's plan.cache."),
    rows: Optional[int] = typer.Option(None, "--rows", min=1, help="Synthetic training rows when no data is given or bound (+20% for evaluation). Default: 400000."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Stop after this many steps in total."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", min=0, help="Evaluate every N steps (default: the spec's training.eval_every; 0 = at the end)."),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", min=0, help="Also checkpoint every N steps (always at the end and on Ctrl-C). Default: 0."),
    checkpoint_full_every: Optional[int] = typer.Option(None, "--checkpoint-full-every", min=1, help="A full checkpoint every K checkpoints; in between, incremental ones (only the rows touched since the previous checkpoint), all written in the background. Default: 1 (every checkpoint full, written inline)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the spec's training seed (0 .. 2^63-1)."),
    dask: Optional[str] = typer.Option(None, "--dask", help="Read data partitions through Dask: a scheduler address (tcp://host:8786) of an existing cluster, or 'local' for a local cluster. Default: direct pyarrow reads (faster on one machine)."),
    interleave: Optional[bool] = typer.Option(None, "--interleave/--no-interleave", help="--no-interleave: sequential schedule (no micro-batches, cache exchanges inline) to compare with the planned overlap; same parameters."),
    nan_policy: Optional[str] = typer.Option(None, "--nan-policy", help="On a non-finite loss: stop (exit 2, the last checkpoint kept) or skip-batch (skip that batch's update and count it). Default: stop."),
    report: bool = typer.Option(False, "--report", help="After training, show measured step time, stage seconds, host<->device bytes and hit rates next to the planner's predictions."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    json_out: bool = typer.Option(False, "--json", help="Print the final result as JSON on stdout."),
) -> None:
    """Train a spec end to end: plan, stage data, train, evaluate, checkpoint.

    A run owns its folder (a second run into it is refused); `--resume DIR` restores everything
    the run was started with from DIR/run.json.

    \b
    Examples:
      flowrec train specs/dlrm_criteo.yaml                 # synthetic data from the spec
      flowrec train specs/movielens.yaml --epochs 5        # real data bound in the spec
      flowrec train specs/dlrm_criteo.yaml --data data/criteo/ --device cuda --out runs/exp1
      flowrec train specs/dlrm_criteo.yaml --resume runs/exp1
      flowrec train specs/dlrm_criteo.yaml --plan p.json   # a saved (edited) plan
    """
    given = {"data": _text(data), "eval_data": _text(eval_data), "rows": rows, "seed": seed,
             "device": device, "device_budget": device_budget, "dask": dask, "cache": cache,
             "plan": _text(plan_file), "target": target,
             "epochs": epochs, "max_steps": max_steps, "eval_every": eval_every,
             "checkpoint_every": checkpoint_every, "checkpoint_full_every": checkpoint_full_every,
             "interleave": interleave, "nan_policy": nan_policy}
    request = RunRequest(spec_path, out, resume, overwrite, given, quiet, json_out, report)
    try:
        _check_options(request)
        run_training(request)
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C) before training started; nothing was trained", EXIT_INTERRUPTED)


def _text(path: Optional[Path]) -> Optional[str]:
    return str(path) if path is not None else None


def _check_options(request: RunRequest) -> None:
    from flowrec.cli.run_settings import CACHE_POLICIES, MAX_SEED
    from flowrec.runtime.nonfinite import NAN_POLICIES

    given = request.given
    if given["seed"] is not None and not 0 <= given["seed"] <= MAX_SEED:
        fail(f"--seed must be in 0..{MAX_SEED} (2^63-1), not {given['seed']}")
    if given["cache"] is not None and given["cache"] not in CACHE_POLICIES:
        fail(f"--cache must be one of {', '.join(CACHE_POLICIES)}, not {given['cache']!r}")
    if given["nan_policy"] is not None and given["nan_policy"] not in NAN_POLICIES:
        fail(f"--nan-policy must be one of {', '.join(NAN_POLICIES)}, not {given['nan_policy']!r}")
    if request.resume is not None and request.overwrite:
        fail("--resume continues a run and --overwrite replaces it; give one of them")
    if request.resume is not None and request.out is not None and request.out != request.resume:
        fail(f"--out {request.out} and --resume {request.resume} name different run folders")


def run_training(request: RunRequest) -> None:
    """Own the run folder for the whole run (lock), then resolve the settings and train."""
    from flowrec.runtime.rundir import RunFolderError

    spec = load_spec_or_exit(request.spec_path)
    try:
        folder, lock = _claim_folder(request, spec.name)
    except RunFolderError as exc:
        fail(str(exc))
    try:
        _train_in(request, spec, folder)
    finally:
        lock.release()


def _claim_folder(request: RunRequest, name: str):
    from flowrec.runtime.rundir import (
        RUN_FILE,
        RunFolderError,
        claim_new_folder,
        foreign_entries,
        has_run,
        open_folder,
    )

    if request.resume is not None:
        folder = request.resume
        if folder.exists() and not folder.is_dir():
            raise RunFolderError(f"{folder} is a file, not a run folder")
        if not folder.is_dir():
            raise RunFolderError(f"nothing to resume: {folder} does not exist")
        if not has_run(folder) and not (folder / RUN_FILE).is_file():
            raise RunFolderError(f"nothing to resume: {folder} has no checkpoint.pt or run.json")
        return folder, open_folder(folder)
    if request.out is None:
        return claim_new_folder(Path("runs"), name)
    foreign = foreign_entries(request.out)
    if foreign:
        raise RunFolderError(f"{request.out} is not empty and is not a flowrec run folder (it holds "
                             f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give an empty "
                             f"or new folder")
    lock = open_folder(request.out)
    if has_run(request.out) and not request.overwrite:
        lock.release()
        raise RunFolderError(f"{request.out} already holds a run (checkpoint.pt): continue it with "
                             f"--resume {request.out}, or replace it with --overwrite")
    return request.out, lock


def _train_in(request: RunRequest, spec, folder: Path) -> None:
    """Settings, checkpoint, session, then training, in a folder this process owns."""
    from dataclasses import replace

    from flowrec.cli.run_settings import merge_settings, read_run_file
    from flowrec.runtime.checkpoint import CHECKPOINT_NAME, CheckpointError, load_checkpoint
    from flowrec.runtime.rundir import RunFolderError

    resuming = request.resume is not None
    has_checkpoint = resuming and (folder / CHECKPOINT_NAME).is_file()
    try:
        recorded = read_run_file(folder) if resuming else None
        state = load_checkpoint(folder / CHECKPOINT_NAME) if has_checkpoint else None
    except (RunFolderError, CheckpointError) as exc:
        fail(str(exc))
    defaults = {"epochs": spec.training.epochs, "eval_every": spec.training.eval_every}
    settings, notes = merge_settings(request.given, recorded, defaults)
    for note in notes:
        _say(note)
    if resuming and state is None:
        _say(f"{folder} has no checkpoint yet: starting it again from step 0 with its recorded settings")
    if settings["cache"] is not None:
        spec = replace(spec, plan=replace(spec.plan, cache=settings["cache"]))
    _run(request, spec, folder, settings, state)


def _run(request: RunRequest, spec, folder: Path, settings: dict, state: dict | None) -> None:
    import torch

    from flowrec.cli.run_plan import plan_for_run
    from flowrec.cli.run_settings import write_run_file
    from flowrec.data.layout import DataError
    from flowrec.graph.plan_io import plan_json
    from flowrec.runtime.checkpoint import CHECKPOINT_NAME, CheckpointError
    from flowrec.runtime.metrics import MetricsError
    from flowrec.runtime.nonfinite import TrainingStopped
    from flowrec.runtime.rundir import RunFolderError, clear_run_files
    from flowrec.runtime.session import SessionOptions, prepare
    from flowrec.runtime.trainer import TrainConfig, Trainer
    from flowrec.spec.load import to_dict

    opts = SessionOptions(
        data=Path(settings["data"]) if settings["data"] else None,
        eval_data=Path(settings["eval_data"]) if settings["eval_data"] else None,
        device=settings["device"], device_budget=settings["device_budget"], synthetic_rows=settings["rows"],
        seed=settings["seed"], workdir=folder, dask=settings["dask"],
    )
    plan_file = Path(settings["plan"]) if settings.get("plan") and state is None else None
    plan, device = plan_for_run(spec, settings["device"] or "auto", settings["device_budget"], plan_file, _say,
                                settings["target"], settings["data"] if state is None else None)
    if state is not None:  # a resumed run continues with the plan it was trained with, unchanged
        plan = _stored_plan_or_exit(state, folder, plan)
    if spec.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        session = prepare(spec, request.spec_path, opts, plan, device, status=_say)
    except (DataError, RuntimeError, ValueError) as exc:
        fail(str(exc))
    except torch.OutOfMemoryError as exc:
        fail(f"out of memory building the model: {_one_line(exc)}. {_memory_hint()}", EXIT_OUT_OF_MEMORY)
    _say(session.data_note)
    if state is not None and state["spec"] != json.dumps(to_dict(session.spec), sort_keys=True):
        fail(f"{request.spec_path} differs from the spec the run in {folder} was trained with "
             f"(see {folder}/spec.json)")
    config = TrainConfig(epochs=settings["epochs"], out_dir=folder, eval_every=settings["eval_every"],
                         max_steps=settings["max_steps"], checkpoint_every=settings["checkpoint_every"],
                         checkpoint_full_every=settings["checkpoint_full_every"],
                         progress=not request.quiet, interleave=settings["interleave"],
                         nan_policy=settings["nan_policy"])
    trainer = Trainer(session.spec, session.plan, session.model, config, plan_json(session.plan))
    resume_cmd = (f"flowrec train {shlex.quote(str(request.spec_path))} "
                  f"--resume {shlex.quote(str(folder))}")
    try:
        if state is not None:
            trainer.load_state(state, folder / CHECKPOINT_NAME)
            if trainer.finished(session.train):
                session.model.close()
                _say(_finished_line(folder, trainer, settings))
                return
            _say(f"resuming {folder} at epoch {trainer.position.epoch}, batch {trainer.position.batch} "
                 f"(step {trainer.position.step})")
        else:
            clear_run_files(folder)
        write_run_file(folder, settings)
        _say(f"run folder {folder}; if it stops, continue with  {resume_cmd}")
        result = trainer.fit(session.train, session.eval)
    except (DataError, CheckpointError, MetricsError, RunFolderError, TrainingStopped) as exc:
        fail(str(exc))
    except KeyboardInterrupt:
        fail(f"interrupted (Ctrl-C) at step {trainer.position.step}; continue with  {resume_cmd}",
             EXIT_INTERRUPTED)
    except torch.OutOfMemoryError as exc:
        fail(f"out of memory at step {trainer.position.step + 1} on {session.device}: {_one_line(exc)}; "
             f"{trainer.checkpoint_note()}. {_memory_hint()}", EXIT_OUT_OF_MEMORY)
    _report(result, folder, request.json_out)
    if request.report:
        from flowrec.runtime.report import run_report

        spec = session.spec
        for line in run_report(result, session.plan, spec.training.batch_size, len(spec.dense_features),
                               len(spec.heads)):
            _say(line)
    if result.interrupted:
        _say(f"interrupted: checkpoint saved; continue with  {resume_cmd}")
        raise typer.Exit(EXIT_INTERRUPTED)


def _stored_plan_or_exit(state: dict, folder: Path, fresh):
    """The plan a resumed run was trained with (its checkpoint's), checked against the spec's model."""
    from flowrec.runtime.checkpoint import CheckpointError
    from flowrec.runtime.serving import stored_plan

    try:
        stored = stored_plan(state, str(folder / "checkpoint.pt"))
    except CheckpointError as exc:
        fail(str(exc))
    if stored.spec_fingerprint != fresh.spec_fingerprint:
        fail(f"the spec's model differs from the one the run in {folder} was trained with")
    return stored


def _memory_hint() -> str:
    import torch

    if torch.cuda.is_available():
        return "Give a smaller --device-budget (more tables on host or cache placements) or use --device cpu"
    return "Use a machine with more memory, or a smaller model or batch size"


def _finished_line(folder: Path, trainer, settings: dict) -> str:
    pos = trainer.position
    limit = f", --max-steps {settings['max_steps']}" if settings["max_steps"] is not None else ""
    return (f"{folder} is finished: step {pos.step}, epoch {pos.epoch} of {trainer.epochs}{limit}; "
            f"nothing to train (give a larger --epochs or --max-steps to train further)")


def _report(result, run_dir: Path, json_out: bool) -> None:
    from dataclasses import asdict

    lines = [f"steps {result.steps}, {result.samples:,} samples in {result.seconds:.1f} s "
             f"({result.samples_per_s:,.0f} samples/s)"]
    for head, metrics in result.eval.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if k != "samples")
        lines.append(f"eval {head}: {shown} ({metrics['samples']:,} samples)")
    lines.append(f"run folder: {run_dir} (checkpoint.pt, metrics.jsonl, plan.json)")
    for line in lines:
        _say(line)
    if json_out:
        sys.stdout.write(json.dumps({**asdict(result), "run_dir": str(run_dir)}, indent=2, sort_keys=True,
                                    default=str) + "\n")


def evaluate_run(
    run_dir: Path = typer.Argument(..., help="Run folder (with checkpoint.pt) or a checkpoint file."),
    data: Path = typer.Option(..., "--data", help="Encoded dataset folder to score."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    json_out: bool = typer.Option(False, "--json", help="Print metrics as JSON on stdout."),
) -> None:
    """Score a trained checkpoint on a dataset.

    Exact AUC and logloss per binary head, MSE per regression head.

    \b
    Example:
      flowrec eval runs/exp1 --data data/criteo_test/
    """
    from flowrec.data.layout import DataError
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.serving import load_trained

    try:
        trained = load_trained(run_dir, device, scoring_plan)
        metrics = trained.evaluate_dataset(data)
    except (DataError, OSError, ValueError, RuntimeError) as exc:
        fail(_one_line(exc))
    except KeyboardInterrupt:
        fail("interrupted (Ctrl-C)", EXIT_INTERRUPTED)
    if json_out:
        sys.stdout.write(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return
    for head, m in metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k != "samples")
        typer.echo(f"{head}: {shown} ({m['samples']:,} samples)")


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def export(
    run_dir: Path = typer.Argument(..., help="Run folder (with checkpoint.pt) or a checkpoint file."),
    out: Path = typer.Argument(..., help="Output file for the serving model (e.g. model.pt); never a run's own file."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT when it exists (never a run's checkpoint or other files)."),
) -> None:
    """Export a trained model for serving.

    A plain torch module with one embedding table per logical table (no packing, no optimizer
    state), loadable with `flowrec.runtime.serving.load_serving(path)`. The file is written whole
    (temp file, then rename).
    """
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.serving import export_serving, load_trained

    _check_export_target(run_dir, out, overwrite)
    try:
        trained = load_trained(run_dir, "cpu", scoring_plan)
        export_serving(trained, out)
    except (OSError, ValueError, RuntimeError) as exc:
        fail(f"cannot export to {out}: {_one_line(exc)}" if isinstance(exc, OSError) else _one_line(exc))
    except KeyboardInterrupt:
        fail(f"interrupted (Ctrl-C); {out} was not written", EXIT_INTERRUPTED)
    typer.echo(f"wrote {out}")


def _check_export_target(run_dir: Path, out: Path, overwrite: bool) -> None:
    """Never over a checkpoint or another file of a run; an existing file only with --overwrite."""
    from flowrec.runtime.checkpoint import checkpoint_path
    from flowrec.runtime.rundir import is_inside_run

    if out.is_dir():
        fail(f"{out} is a folder; give a file name for the serving model, e.g. {out / 'model.pt'}")
    source = checkpoint_path(run_dir)
    if is_inside_run(out) or (out.exists() and source.exists() and out.samefile(source)):
        fail(f"refusing to write {out}: it is a file of a training run (only that run writes there)")
    if out.exists() and not overwrite:
        fail(f"{out} exists; give --overwrite to replace it")
    if not out.parent.is_dir():
        fail(f"cannot export to {out}: folder {out.parent} does not exist")


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("eval")(evaluate_run)
    app.command("export")(export)
