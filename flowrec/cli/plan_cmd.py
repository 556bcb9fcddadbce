"""`flowrec plan`: compile a spec, run the planner passes and show the plan."""
from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path
from typing import Optional, get_args

import typer

from flowrec.cli.common import (bound_files, check_byte_size, fail, misnamed_output, guard_outputs, launch_env, missing_parents, planned_spec_or_exit, remove_empty,
                                write_output)
from flowrec.planner.calibration import is_profile_path
from flowrec.render import to_dot, to_png, to_svg
from flowrec.planner.manager import STAGES, PassFailure, load_profile, make_plan
from flowrec.graph.plan_io import plan_json
from flowrec.planner.fit import host_fit, host_is_device, misfit
from flowrec.planner.report import managed_report, text_report
from flowrec.spec.model import CachePolicy
from flowrec.spec.schema_errors import did_you_mean

PLAN_HELP = """Compile a spec into an optimized plan and report it.

Builds the operator graph of SPEC, runs the passes (pack, cache, interleave) and reports the plan:
packed groups, placements, stages, predicted step time and memory.

\b
Examples:
  flowrec plan specs/dlrm_criteo.yaml
  flowrec plan specs/dlrm_criteo.yaml --target h100 --device-budget 1GiB --cache lookahead
  flowrec plan specs/wide_1000.yaml --json plan.json --svg plan.svg
  flowrec plan specs/wide_1000.yaml --world-size 64 --target h100 --json p.json
  flowrec plan specs/two_task.yaml --until packed --dot - | dot -Tpng > plan.png
"""


def register(app: typer.Typer) -> None:
    """Add the `plan` command to the `flowrec` app."""
    app.command("plan", help=PLAN_HELP)(plan)


def plan(
    spec: Path = typer.Argument(..., metavar="SPEC", help="Spec file (YAML or JSON)."),
    until: str = typer.Option("interleaved", "--until", help=f"Last stage: {', '.join(STAGES)}."),
    device_budget: Optional[str] = typer.Option(None, "--device-budget", help="Device memory, e.g. 4GiB."),
    target: Optional[str] = typer.Option(None, "--target", help="Cost-model device: cpu, a100, h100 (datasheet constants), or a profile FILE from `flowrec calibrate`."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Cache policy for tables that do not fit the budget: auto, none (host), static_hot (FAE) or lookahead (ScratchPipe). Default: the spec's plan.cache."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Access profile JSON (flowrec data profile)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="Epochs of the run the plan prices (default: the spec's training.epochs): a lookahead cache keeps its rows from one epoch to the next, so with a profile that counts an epoch's reads, a small dataset's traffic per step falls over more epochs."),
    world_size: Optional[int] = typer.Option(None, "--world-size", min=1, max=1_000_000, help="Ranks to plan for (GPUs or CPU processes): per-rank memory, exchange bytes and step time. On a host target (cpu) each rank's peak is checked against its share of this machine's available host memory (divided by --local-ranks), the rule `flowrec train --nproc N` applies. Default: WORLD_SIZE of the launch environment, else 1."),
    local_ranks: Optional[int] = typer.Option(None, "--local-ranks", min=1, max=1_000_000, help="Ranks of the --world-size that share one machine's host memory (a host target's memory check divides the available host memory by it, as `flowrec train --nproc N` does). Default: LOCAL_WORLD_SIZE of the launch environment, else the world size (every rank on this machine, as `--nproc` runs them)."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Write the plan JSON to PATH, or - for stdout."),
    dot: Optional[str] = typer.Option(None, "--dot", help="Write DOT text to PATH, or - for stdout."),
    svg: Optional[Path] = typer.Option(None, "--svg", help="Write an SVG drawing to PATH."),
    png: Optional[Path] = typer.Option(None, "--png", help="Write a PNG drawing to PATH (matplotlib)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No text report (only the files asked for)."),
    managed_from: Optional[Path] = typer.Option(None, "--managed-from", help="A trained run of this spec: the report adds, per managed table, what its map held and did at the run's end (rows held, ids waiting, admitted, evicted, expired, lookups that read the default row)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace output files that exist (never a file of a run, package or dataset, nor an input)."),
) -> None:
    if json_out == "-" and dot == "-":
        fail("--json - and --dot - would both write to stdout, one after the other; write one of them to a file")
    for flag, path in (("--svg", svg), ("--png", png)):
        if path is not None and str(path) == "-":
            fail(f"{flag} writes a file, not stdout: give a file name (--json - and --dot - write to stdout)")
    for flag, path in (("--json", json_out), ("--dot", dot), ("--svg", svg), ("--png", png)):
        if path is not None and str(path) != "-" and (problem := misnamed_output(flag, Path(path))):
            fail(problem)
    check_byte_size("--device-budget", device_budget)
    model = planned_spec_or_exit(spec)
    outputs = [(p, kind) for p, kind in ((json_out, ("flowrec-plan", "a plan `flowrec plan --json` wrote")),
                                         (dot, ("dot", "a Graphviz graph")), (svg, ("svg", "an SVG drawing")),
                                         (png, ("png", "a PNG image"))) if p is not None and str(p) != "-"]
    files = [Path(p) for p, _ in outputs]
    made = missing_parents(*files)  # the guard makes them; a plan that fails takes them back
    guard_outputs(files, [spec, *bound_files(spec, model), profile,
                          Path(target) if target and is_profile_path(target) else None], overwrite,
                  [kind for _, kind in outputs])
    try:
        trained = run_managed(managed_from, model) if managed_from is not None else None  # before any output
        if until not in STAGES:
            fail(f"--until must be one of {', '.join(STAGES)}, not {until!r}{did_you_mean(until, STAGES)}")
        if cache is not None:
            if cache not in get_args(CachePolicy):
                fail(f"--cache must be one of {', '.join(get_args(CachePolicy))}, not {cache!r}"
                     f"{did_you_mean(cache, get_args(CachePolicy))}")
            model = replace(model, plan=replace(model.plan, cache=cache))
        if epochs is not None:
            model = replace(model, training=replace(model.training, epochs=epochs))
        try:
            result = make_plan(model, until=until, device_budget=device_budget, target=target,
                               profile=load_profile(profile, model), world_size=world_size or launch_env()[0])
        except (ValueError, OSError, PassFailure) as exc:
            fail(str(exc))
        warning = memory_warning(result, plan_local_ranks(local_ranks, result.meta.world_size))
        for dest, text in ((json_out, lambda: plan_json(result)), (dot, lambda: to_dot(result.graph))):
            if dest == "-":
                typer.echo(text(), nl=False)
            elif dest is not None:
                write_output(Path(dest), lambda tmp, text=text: tmp.write_text(text(), encoding="utf-8"), overwrite)
        if svg is not None:
            write_output(svg, lambda tmp: tmp.write_text(to_svg(result), encoding="utf-8"), overwrite)
        if png is not None:
            write_output(png, lambda tmp: to_png(result, tmp), overwrite)
        if "-" not in (json_out, dot) and not quiet:
            report = text_report(result)
            typer.echo("\n".join(report[:1] + ([warning] if warning else []) + report[1:]
                                  + managed_report(model, trained, result.meta.world_size)))
        elif warning:
            typer.echo(warning, err=True)
    except typer.Exit:
        remove_empty(made)  # `plan SPEC --profile missing.json --json new/p.json` left new/ behind
        raise


def plan_local_ranks(given: int | None, world_size: int) -> int:
    """The ranks of a plan for `world_size` ranks that share this machine's host memory: `given`
    (--local-ranks), else LOCAL_WORLD_SIZE of the launch environment, else all of them (as
    `flowrec train --nproc W` runs them); at most `world_size`. Exit 2 when `given` exceeds it."""
    if given is not None:
        if given > world_size:
            fail(f"--local-ranks {given}: more than the {world_size} rank{'s' if world_size != 1 else ''} planned for (--world-size); "
                 "the ranks of one machine are some of the world's")
        return given
    text = os.environ.get("LOCAL_WORLD_SIZE", "")
    return min(int(text), world_size) if text.isdigit() and int(text) > 0 else world_size


def memory_warning(plan, local_ranks: int | None = None) -> str | None:
    """A line when the plan's estimated peak memory exceeds its target's memory (with the margin of
    `flowrec.planner.fit`): on a host target (cpu) one rank's share of this machine's available
    memory (`host_share` over `local_ranks`, default the plan's world size: the rule of `flowrec
    train`), on a GPU target the plan's device budget; None when it fits."""
    from flowrec.data.hostmemory import available_memory_bytes

    if host_is_device(plan):
        limit = available_memory_bytes()
        if limit is None:
            return None
        problem = host_fit(plan, limit, plan.meta.world_size if local_ranks is None else local_ranks)
    else:
        problem = misfit(plan, plan.device_budget_bytes, f"device budget on {plan.target}")
    return f"warning: {problem}: it cannot run there (`flowrec train` refuses it)" if problem else None


MANAGED_COUNTS = ("rows", "held", "waiting", "admitted", "evicted", "expired")  # every table of a report
MANAGED_OPTIONAL = ("lookups", "default_lookups")  # counted by later runs


def run_managed(run: Path, spec) -> dict:
    """The managed report of a run's last end event in RUN/metrics.jsonl, read within the JSON
    limits (`flowrec.runtime.run_log.read_records`); exit 2 when it has none, when it is damaged
    (a table's counts not non-negative integers) or when it lacks a managed table of `spec`."""
    from flowrec.cli.streams import refuse_stream_folder
    from flowrec.runtime.run_log import read_records

    refuse_stream_folder(run, "give --managed-from")  # its metrics.jsonl holds the days' scores, no end record
    if not any(t.managed is not None for t in spec.tables):  # the report would show nothing of the run
        fail(f"--managed-from {run}: spec {spec.name} has no managed tables, so the plan has nothing of the run's "
             "maps to show; leave --managed-from out, or give a spec with managed tables")
    path = run / "metrics.jsonl"
    if not run.is_dir() or not path.is_file():
        fail(f"--managed-from {run}: not a run folder (no metrics.jsonl)")
    try:
        records = read_records(path)
    except OSError as exc:
        fail(f"--managed-from {run}: cannot read {path}: {exc.strerror or exc}")
    found = None
    for event in records:
        if event.get("event") == "end" and isinstance(event.get("managed"), dict):
            found = event["managed"]
    if found is None:
        fail(f"--managed-from {run}: the run recorded no managed tables (none in its spec, or it never ended)")
    tables = found.get("tables")
    if not isinstance(tables, dict):
        fail(f"--managed-from {run}: {path} is damaged (its managed report lists no tables)")
    for name, counts in tables.items():
        problem = _counts_problem(counts)
        if problem is not None:
            fail(f"--managed-from {run}: {path} is damaged (managed table {str(name)[:60]!r}: {problem})")
    wanted = [t.name for t in spec.tables if t.managed is not None]
    missing = [name for name in wanted if name not in tables]
    if missing:
        fail(f"--managed-from {run}: the run has no managed table {missing[0]!r} of spec {spec.name} (it has "
             f"{', '.join(map(str, tables)) or 'none'}); give a run of this spec")
    return found


def _counts_problem(counts) -> str | None:
    """Why one table of a managed report cannot be shown, or None."""
    if not isinstance(counts, dict):
        return "not an object"
    for key in MANAGED_COUNTS + MANAGED_OPTIONAL:
        if key not in counts and key in MANAGED_OPTIONAL:
            continue
        value = counts.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            return f"{key} is {value!r:.40}, not a non-negative integer"
    return None

