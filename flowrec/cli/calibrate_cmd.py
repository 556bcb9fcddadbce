"""`flowrec calibrate`: measure this machine and save a device profile for the cost model."""
from __future__ import annotations

import json
import platform
import time
from pathlib import Path
from typing import Optional

import typer

from flowrec.cli.common import (bound_files, check_byte_size, check_env_switches, check_one_gpu_per_rank, fail, guard_outputs,
                                 planned_spec_or_exit, say, write_output)

FALLBACK_SHAPES = [(4096, 512, 256), (4096, 256, 64)]  # without a spec: DLRM-sized layers
MIN_SECONDS, MAX_SECONDS = 0.01, 10.0  # --seconds per measured kernel
CALIBRATE_HELP = """Measure this machine for the planner's cost model and save a device profile.

How long: without SPEC about a minute; with one, 1-10 minutes on a 2-core CPU (the longer its
training step, the longer); `--nproc N` adds several minutes (dlrm_criteo with --nproc 2 took 11
minutes on a busy 2-core machine). Each stage is named on stderr as it starts.

Measures: GEMMs (fixed cost, FLOP rate and bandwidth fitted over the
spec's dense-layer shapes, forward and backward, and a grid; bf16 at the spec's shapes),
elementwise passes, the per-kernel overhead of autograd, the project's sparse path (lookup, then
casting and fused update per sparse optimizer, fitted per id and per unique row), each dense
optimizer's step, random row gathers and scatters by embedding dim, memory bandwidth and, with
CUDA, host<->device bandwidth. With a spec, also the spec itself: each of its dense ops as a
whole operator (fixed + per-sample time, forward and backward), the per-step framework cost
(real training steps at tiny batch sizes minus their predicted compute), managed tables' own work
per lookup in the trainer's step (row resets, map replay) and, on the CPU, what
staging its batches adds to a step. With `--nproc N` (N >= 2) it also starts N processes (gloo on
CPU, NCCL with one GPU each) and fits the collectives' bandwidth and per-call cost; sharded plans
(`--world-size` up to one node) are then priced with them instead of the datasheet link. With a
spec on the CPU it also steps the spec on N processes at once (B / N samples each, staged, then
fed live by the batch pipeline): what ranks sharing the cores cost each other's compute and
staging, which the cost model applies to a rank of a run with more than one, and the spec's
world-size plan (`--device-budget` as the runs give it) stepped by the N processes with its real
collectives: what a collective call costs inside the ranks' steps. Saves a
profile (default: the user's cache folder, one per
device kind) recording each constant and how it was measured; use it with
`flowrec plan SPEC --target FILE` and `flowrec train SPEC --target FILE`.

\b
Examples:
  flowrec calibrate specs/dlrm_criteo.yaml
  flowrec calibrate specs/movielens.yaml --device cuda --out h100.json
  flowrec calibrate specs/dlrm_criteo.yaml --nproc 2 --out cpu2.json
"""


def register(app: typer.Typer) -> None:
    """Add the `calibrate` command to the `flowrec` app."""
    app.command("calibrate", help=CALIBRATE_HELP)(calibrate)


def calibrate(
    spec: Optional[Path] = typer.Argument(None, metavar="SPEC", help="Spec whose dense layers, ops, steps and staging to measure (default: DLRM-sized layers only)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    out: Optional[Path] = typer.Option(None, "--out", help="Profile file to write (default: the user's cache folder)."),
    seconds: float = typer.Option(0.5, "--seconds", help="Seconds spent per measured kernel, 0.01 to 10."),
    nproc: int = typer.Option(1, "--nproc", min=1, max=64,
                              help="Processes whose collectives to measure (1: none; CUDA: one GPU each)."),
    device_budget: Optional[str] = typer.Option(None, "--device-budget", help="With --nproc and a spec on the CPU: the device budget of the runs whose sharded plan the processes step (as `flowrec train --device-budget`; it decides the plan's shardings and so its collective calls); without SPEC, --nproc N or the CPU it is refused."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --out file when it exists (the default profile is always replaced)."),
) -> None:
    from flowrec.runtime.session import resolve_device

    check_env_switches()
    if not MIN_SECONDS <= seconds <= MAX_SECONDS:  # NaN fails both: typer's range said "should be <= 10" of nan
        fail(f"--seconds must be a number of seconds from {MIN_SECONDS} to {MAX_SECONDS:g}, not {seconds}")
    model = planned_spec_or_exit(spec, check_given=True) if spec is not None else None  # custom modules measured
    if out is not None:
        from flowrec.planner.calibration import PROFILE_FORMAT

        guard_outputs([out], [spec, *(bound_files(spec, model) if model is not None else [])], overwrite,
                      [(PROFILE_FORMAT, "a device profile `flowrec calibrate` wrote")])
    check_byte_size("--device-budget", device_budget)
    shapes = gemm_shapes(model) if model is not None else FALLBACK_SHAPES
    try:
        dev = resolve_device(device)
    except RuntimeError as exc:
        fail(str(exc))
    check_one_gpu_per_rank(nproc, dev.type)
    if device_budget is not None and not (nproc > 1 and model is not None and dev.type == "cpu"):
        # it only shapes the sharded plan the processes step (`_shared_cores`): elsewhere it was ignored
        fail(f"--device-budget sets the plan that --nproc N processes step for a spec on the CPU; this calibration "
             f"({'no SPEC' if model is None else 'no --nproc N' if nproc <= 1 else f'device {dev.type}'}) "
             f"steps none: give SPEC and --nproc N (2 or more) on the CPU, or leave --device-budget out")
    from flowrec.runs.errors import EXIT_INTERRUPTED
    from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted

    try:  # SIGTERM as Ctrl-C: one line, exit 130 (Python's default ended it without a word, status 143)
        with terminated_as_interrupted():
            path, doc, details = _measure_and_write(spec, model, dev, shapes, seconds, nproc, device_budget, out,
                                                     overwrite or out is None)  # the default: always replaced
    except KeyboardInterrupt as exc:
        fail(f"interrupted ({interrupt_name(exc)}); no device profile was written", EXIT_INTERRUPTED)
    for key, entry in sorted(doc["measured"].items()):
        typer.echo(f"{key:24s} {shown_value(entry['value']):>12s}  ({entry['how']})")
    timing = details["timing"]
    typer.echo(f"timed {timing['rounds']} rounds, {timing['rejected_rounds']} delayed by other processes or the hypervisor "
               f"({timing['extrapolated_measurements']} of {timing['measurements']} measurements without clean "
               f"rounds: their median less its delay); load average {', '.join(f'{x:.2f}' for x in timing['loadavg_1min'])}")
    say(f"measured in {details['seconds']:.1f} s; wrote {path} (use: flowrec plan SPEC --target {path})")


def _measure_and_write(spec: Optional[Path], model, dev, shapes, seconds: float, nproc: int,
                       device_budget: Optional[str], out: Optional[Path], overwrite: bool) -> tuple[Path, dict, dict]:
    """`flowrec calibrate` once its options are checked: measure and write the profile; its path,
    the profile and the details of the measurement."""
    from flowrec.measure.calibrate import calibrate as measure
    from flowrec.planner.calibration import default_profile_path, profile_document
    from flowrec.runs.plan import cost_target
    from flowrec.measure import robust

    started = time.perf_counter()
    log = robust.reset_log()
    stages = 1 + (model is not None) + (nproc > 1) + (nproc > 1 and model is not None and dev.type == "cpu")
    typer.echo(f"[1/{stages}] timing kernels on {dev.type}: {len(shapes)} GEMM shapes, elementwise passes, the sparse "
               "path, optimizers, row gathers and memory ...", err=True)
    measured, details = measure(dev, shapes, seconds)
    if model is not None:
        from flowrec.measure.spec import spec_constants

        typer.echo(f"[2/{stages}] timing the spec's dense ops, its training steps and staging ...", err=True)
        own, own_details = spec_constants(model, dev, measured, seconds / 4)
        measured.update(own)
        details.update(own_details)
    if nproc > 1:
        measured.update(_collectives(nproc, dev.type, details, f"[{2 + (model is not None)}/{stages}] "))
        if model is not None and dev.type == "cpu":
            measured.update(_shared_cores(spec, model, nproc, measured, details, device_budget, f"[{stages}/{stages}] "))
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    machine = f"{platform.machine()} {platform.processor() or platform.platform()}, {dev.type}"
    details["seconds"] = round(time.perf_counter() - started, 3)
    log.note_load()
    details["timing"] = log.summary()
    doc = profile_document(cost_target(dev), measured, machine, created, details)
    path = out or default_profile_path(dev.type)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot write device profile {path}: {exc.strerror or exc}")
    write_output(path, lambda tmp: tmp.write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n", encoding="utf-8"),
                 overwrite)
    return path, doc, details


def shown_value(value) -> str:
    """A measured constant as `flowrec calibrate` prints it; per-optimizer tables one line each; a vector
    (`epoch_lean_us`) on one line."""
    if value is None:
        return "n/a"
    if isinstance(value, list):
        return " ".join(f"{x:.4g}" for x in value)
    if isinstance(value, dict):
        return "".join(f"\n  {name:22s} " + " ".join(f"{x:.4g}" for x in numbers)
                       for name, numbers in sorted(value.items()))
    return f"{value:.4g}"


def gemm_shapes(spec) -> list[tuple[int, int, int]]:
    """(rows, in, out) of every dense layer of the spec at its batch size, as the cost model lists
    them (`flowrec.planner.op_work`: MLP, cross, linear and head layers, the attention unit on
    batch x sequence rows), without repeats; batched small GEMMs (the dot's) are left out."""
    from flowrec.graph.build import build_graph
    from flowrec.planner.op_work import RULES, op_work

    graph = build_graph(spec)
    batch = spec.training.batch_size
    shapes: list[tuple[int, int, int]] = []
    for node in graph:
        op = graph.nodes[node]["op"]
        if op.kind not in RULES:
            continue
        for m, k, n, count in op_work(op, batch, graph.in_degree(node)).forward.gemms:
            if count == 1 and (m, k, n) not in shapes:
                shapes.append((m, k, n))
    return shapes or FALLBACK_SHAPES


def _collectives(nproc: int, device_kind: str, details: dict, stage: str = "") -> dict:
    """Measured collective constants of `nproc` processes (exits with one line if they fail); `stage`
    starts the line that names the step."""
    from flowrec.measure.collective import SIZES, CollectiveError, measure_collectives

    typer.echo(f"{stage}timing collectives of {nproc} processes ...", err=True)
    try:
        fit = measure_collectives(nproc, device_kind)
    except CollectiveError as exc:
        fail(str(exc), code=1)
    how = (f"{nproc} processes over {fit.backend}: all_to_all_single and all_reduce of {SIZES[0] >> 10} KiB to "
           f"{SIZES[-1] >> 20} MiB per rank, slowest rank's median; t = fixed + bytes one rank sends / bandwidth")
    details["collective_seconds_by_call"] = fit.points
    return {"collective_gbps": (fit.gbps, how), "collective_us": (fit.us, how),
            "collective_world_size": (nproc, "processes the collectives were measured with")}


def _shared_cores(spec_path: Path, model, nproc: int, measured: dict, details: dict,
                  device_budget: str | None = None, stage: str = "") -> dict:
    """Constants of `nproc` ranks sharing this host's cores (`flowrec.measure.concurrent`, the
    world-size plan under `device_budget`; exits with one line if its processes fail); `stage` starts
    the line that names the step."""
    from flowrec.measure.concurrent import ConcurrentError, shared_core_constants

    typer.echo(f"{stage}timing the spec's steps on {nproc} processes at once ...", err=True)
    try:
        constants, details["shared_cores"] = shared_core_constants(spec_path, model, nproc, measured, device_budget)
    except ConcurrentError as exc:
        fail(str(exc), code=1)
    return constants
