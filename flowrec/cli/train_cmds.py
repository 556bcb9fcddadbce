"""`flowrec train`, `flowrec eval` and `flowrec export`: run a plan, score and export checkpoints.

torch and the data stack are imported inside the commands, so other commands start fast.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from flowrec.cli.common import fail, load_spec_or_exit

CACHE_POLICIES = ("auto", "none", "static_hot", "lookahead")
RUN_FILE = "run.json"  # how the run's data was resolved, so --resume finds the same data


def _say(message: str) -> None:
    typer.echo(message, err=True)


def _new_run_dir(name: str) -> Path:
    base = Path("runs") / name
    candidate, n = base, 1
    while candidate.exists() and any(candidate.iterdir()):
        n += 1
        candidate = Path(f"{base}-{n}")
    return candidate


def train(
    spec_path: Path = typer.Argument(..., help="Model spec (YAML or JSON)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Encoded dataset folder (from `flowrec data convert` or `flowrec data synth`); DIR/train and DIR/test when split. Default: the spec's data binding, else synthetic data."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Encoded evaluation dataset folder."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="Epochs (default: the spec's training.epochs)."),
    device: str = typer.Option("auto", "--device", help="auto (cuda if available, else cpu), cpu or cuda."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: runs/<spec name>, numbered if taken)."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder exactly where it stopped."),
    device_budget: Optional[str] = typer.Option(None, "--device-budget", help="Device memory budget for the planner, e.g. 4GiB."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Train exactly this plan (from `flowrec plan SPEC --json FILE`, possibly edited: placements, cache rows, micro-batches, prefetch, group order), checked against the spec."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Cache policy for tables that do not fit the budget: auto, none (host), static_hot (FAE) or lookahead (ScratchPipe). Default: the spec's plan.cache."),
    rows: int = typer.Option(400_000, "--rows", min=1, help="Synthetic training rows when no data is given or bound (+20% for evaluation)."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Stop after this many steps."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", min=0, help="Evaluate every N steps (default: the spec's training.eval_every; 0 = at the end)."),
    checkpoint_every: int = typer.Option(0, "--checkpoint-every", min=0, help="Also checkpoint every N steps (always at the end and on Ctrl-C)."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the spec's training seed."),
    dask: Optional[str] = typer.Option(None, "--dask", help="Read data partitions through Dask: a scheduler address (tcp://host:8786) of an existing cluster, or 'local' for a local cluster. Default: direct pyarrow reads (faster on one machine)."),
    no_interleave: bool = typer.Option(False, "--no-interleave", help="Sequential schedule (no micro-batches, cache exchanges inline) to compare with the planned overlap; same parameters."),
    report: bool = typer.Option(False, "--report", help="After training, show measured step time, stage seconds, host<->device bytes and hit rates next to the planner's predictions."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    json_out: bool = typer.Option(False, "--json", help="Print the final result as JSON on stdout."),
) -> None:
    """Train a spec end to end: plan, stage data, train, evaluate, checkpoint.

    \b
    Examples:
      flowrec train specs/dlrm_criteo.yaml                 # synthetic data from the spec
      flowrec train specs/movielens.yaml --epochs 5        # real data bound in the spec
      flowrec train specs/dlrm_criteo.yaml --data data/criteo/ --device cuda --out runs/exp1
      flowrec train specs/dlrm_criteo.yaml --resume runs/exp1
      flowrec train specs/dlrm_criteo.yaml --plan p.json   # a saved (edited) plan
    """
    spec = load_spec_or_exit(spec_path)
    run_dir = resume or out or _new_run_dir(spec.name)
    recorded = _read_run_file(run_dir) if resume else {}
    cache = cache or recorded.get("cache")
    if cache is not None:
        if cache not in CACHE_POLICIES:
            fail(f"--cache must be one of {', '.join(CACHE_POLICIES)}, not {cache!r}")
        from dataclasses import replace

        spec = replace(spec, plan=replace(spec.plan, cache=cache))
    if resume is not None and not (run_dir / "checkpoint.pt").is_file():
        fail(f"nothing to resume: {run_dir}/checkpoint.pt does not exist")
    settings = {
        "data": str(data) if data else recorded.get("data"),
        "eval_data": str(eval_data) if eval_data else recorded.get("eval_data"),
        "rows": recorded.get("rows", rows),
        "seed": recorded.get("seed", seed),
        "device_budget": device_budget or recorded.get("device_budget"),
        "dask": dask or recorded.get("dask"),
        "cache": cache,
        "plan": str(plan_file) if plan_file else recorded.get("plan"),
    }
    _run(spec, spec_path, run_dir, settings, device, epochs, max_steps, eval_every, checkpoint_every,
         quiet, json_out, resume is not None, not no_interleave, report)


def _read_run_file(run_dir: Path) -> dict:
    path = run_dir / RUN_FILE
    return json.loads(path.read_text()) if path.is_file() else {}


def _run(spec, spec_path: Path, run_dir: Path, settings: dict, device: str, epochs, max_steps,
         eval_every, checkpoint_every: int, quiet: bool, json_out: bool, resuming: bool,
         interleave: bool = True, report: bool = False) -> None:
    import torch

    from flowrec.cli.run_plan import plan_for_run
    from flowrec.data.layout import DataError
    from flowrec.graph.plan_io import plan_json
    from flowrec.runtime.session import SessionOptions, prepare
    from flowrec.runtime.trainer import TrainConfig, Trainer, resume_state
    from flowrec.spec.load import to_dict

    opts = SessionOptions(
        data=Path(settings["data"]) if settings["data"] else None,
        eval_data=Path(settings["eval_data"]) if settings["eval_data"] else None,
        device=device, device_budget=settings["device_budget"], synthetic_rows=settings["rows"],
        seed=settings["seed"], workdir=run_dir, dask=settings["dask"],
    )
    plan_file = Path(settings["plan"]) if settings.get("plan") and not resuming else None
    plan, dev = plan_for_run(spec, device, settings["device_budget"], plan_file, _say)
    if resuming:  # the stored plan, unchanged
        plan = _stored_plan_or_exit(run_dir, plan)
    if spec.training.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        session = prepare(spec, spec_path, opts, plan, dev, status=_say)
    except (DataError, RuntimeError, ValueError) as exc:
        fail(str(exc))
    _say(session.data_note)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / RUN_FILE).write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")
    config = TrainConfig(epochs=epochs, out_dir=run_dir, eval_every=eval_every, max_steps=max_steps,
                         checkpoint_every=checkpoint_every, progress=not quiet, interleave=interleave)
    trainer = Trainer(session.spec, session.plan, session.model, config, plan_json(session.plan))
    if resuming:
        state = resume_state(run_dir)
        if state["spec"] != json.dumps(to_dict(session.spec), sort_keys=True):  # as Trainer.state writes it
            fail(f"{spec_path} differs from the spec the run in {run_dir} was trained with (see {run_dir}/spec.json)")
        trainer.load_state(state)
        _say(f"resuming {run_dir} at epoch {trainer.position.epoch}, batch {trainer.position.batch} "
             f"(step {trainer.position.step})")
    try:
        result = trainer.fit(session.train, session.eval)
    except DataError as exc:
        fail(str(exc))
    _report(result, run_dir, json_out)
    if report:
        from flowrec.runtime.report import run_report

        spec = session.spec
        for line in run_report(result, session.plan, spec.training.batch_size, len(spec.dense_features),
                               len(spec.heads)):
            _say(line)
    if result.interrupted:
        _say(f"interrupted: checkpoint saved; continue with  flowrec train {spec_path} --resume {run_dir}")
        raise typer.Exit(130)


def _stored_plan_or_exit(run_dir: Path, fresh):
    """The plan a resumed run was trained with (its checkpoint's), so it continues unchanged."""
    from flowrec.runtime.checkpoint import load_checkpoint
    from flowrec.runtime.serving import stored_plan

    try:
        stored = stored_plan(load_checkpoint(run_dir), str(run_dir / "checkpoint.pt"))
    except (ValueError, OSError) as exc:
        fail(str(exc))
    if stored.spec_fingerprint != fresh.spec_fingerprint:
        fail(f"the spec's model differs from the one the run in {run_dir} was trained with")
    return stored


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
    except (DataError, FileNotFoundError, ValueError, RuntimeError) as exc:
        fail(str(exc))
    if json_out:
        sys.stdout.write(json.dumps(metrics, indent=2, sort_keys=True) + "\n")
        return
    for head, m in metrics.items():
        shown = ", ".join(f"{k} {v:.4f}" for k, v in m.items() if k != "samples")
        typer.echo(f"{head}: {shown} ({m['samples']:,} samples)")


def export(
    run_dir: Path = typer.Argument(..., help="Run folder (with checkpoint.pt)."),
    out: Path = typer.Argument(..., help="Output file for the serving model (e.g. model.pt)."),
) -> None:
    """Export a trained model for serving.

    A plain torch module with one embedding table per logical table (no packing, no optimizer
    state), loadable with `flowrec.runtime.serving.load_serving(path)`.
    """
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.serving import export_serving, load_trained

    try:
        trained = load_trained(run_dir, "cpu", scoring_plan)
        export_serving(trained, out)
    except (FileNotFoundError, ValueError) as exc:
        fail(str(exc))
    typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("eval")(evaluate_run)
    app.command("export")(export)
