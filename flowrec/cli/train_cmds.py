"""`flowrec train` and `flowrec eval`: run a plan, score checkpoints (`flowrec export`: export_cmd).

torch and the data stack are imported inside the commands, so other commands start fast.
"""
from __future__ import annotations

import json
import re
import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, Optional

import typer

from flowrec.cli.common import (EXIT_INVALID, check_byte_size, check_env_switches, check_seed_option,
                                 exit_without_teardown, fail, is_lead_rank, load_spec_or_exit, output_stream,
                                 planned_spec_or_exit, say, stdout_reserved, warn)
from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted
from flowrec.runtime.messages import first_line, one_line, out_of_memory, shell_word
from flowrec.spec.schema_errors import did_you_mean

if TYPE_CHECKING:  # the annotation of _fail_if_custom (torch is imported inside the commands)
    from flowrec.runtime.trainer import Trainer

EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_OUT_OF_MEMORY = 3
EXIT_RANK_FAILED = 4  # another rank died or hung: this one stopped at the --dist-timeout
MAX_DIST_TIMEOUT_S = 7 * 24 * 3600  # a week: the largest --dist-timeout (torch's timedelta overflows far above)
MAX_FOLLOW_WAIT_S = 7 * 24 * 3600  # a week: the longest --follow-wait (inf would wait forever)


def _say(message: str) -> None:
    """A status line on stderr (rank 0 only, in a multi-rank launch)."""
    if is_lead_rank():
        typer.echo(one_line(message), err=True)  # a run folder named with a line break: one line


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
    init_from: Path | None = None
    fresh_optimizer: bool = False
    dist_timeout: float = 300.0
    continue_command: str | None = None  # what continues an interrupted run (a --follow stream's own command)
    json_lines: bool = False  # --json as one line per run (each day of a --follow stream)
    finished_only: int = 0  # N >= 1: only say a finished run, for N ranks (`_said_if_finished`); else _Unanswered


class _Unanswered(Exception):
    """A resume not said finished from its checkpoint where only that was asked (`finished_only`)."""


def train(
    spec_path: Path = typer.Argument(..., metavar="SPEC", help="Model spec (YAML or JSON)."),
    data: Optional[Path] = typer.Option(None, "--data", help="Encoded dataset folder (from `flowrec data convert` or `flowrec data synth`); DIR/train and DIR/test when split. Default: the spec's data binding, else synthetic data."),
    eval_data: Optional[Path] = typer.Option(None, "--eval-data", help="Encoded evaluation dataset folder (instead of a split's test part; needs --data or data bound in the spec, not synthetic rows)."),
    epochs: Optional[int] = typer.Option(None, "--epochs", min=1, help="Epochs (default: the spec's training.epochs)."),
    device: Optional[str] = typer.Option(None, "--device", help="auto (cuda if available, else cpu), cpu or cuda. Default: auto."),
    out: Optional[Path] = typer.Option(None, "--out", help="Run folder (default: runs/<spec name>, numbered if taken). A folder holding a run is refused unless --resume or --overwrite."),
    resume: Optional[Path] = typer.Option(None, "--resume", help="Continue the run in this folder exactly where it stopped, with the settings it was started with (flags given again override them)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the run in the --out folder (its checkpoint and metrics) with a new one."),
    device_budget: Optional[str] = typer.Option(None, "--device-budget", help="Device memory budget for the planner, e.g. 4GiB."),
    plan_file: Optional[Path] = typer.Option(None, "--plan", help="Train exactly this plan (from `flowrec plan SPEC --json FILE`, possibly edited: placements, cache rows, micro-batches, prefetch, group order), checked against the spec."),
    target: Optional[str] = typer.Option(None, "--target", help="Cost-model device the plan is made for: cpu, a100, h100 (datasheet constants) or a profile FILE from `flowrec calibrate`. Default: the datasheet profile of --device."),
    cache: Optional[str] = typer.Option(None, "--cache", help="Cache policy for tables that do not fit the budget: auto, none (host), static_hot (FAE) or lookahead (ScratchPipe). Default: the spec's plan.cache."),
    profile: Optional[Path] = typer.Option(None, "--profile", help="Access profile JSON (flowrec data profile --json) for the planner's placements, as `flowrec plan --profile`."),
    rows: Optional[int] = typer.Option(None, "--rows", min=1, help="Synthetic training rows when no data is given or bound (+20% for evaluation); with data, a line says it is ignored (--max-steps shortens such a run). Default: 400000."),
    max_steps: Optional[int] = typer.Option(None, "--max-steps", min=1, help="Stop after this many steps in total."),
    eval_every: Optional[int] = typer.Option(None, "--eval-every", min=0, help="Evaluate every N steps (default: the spec's training.eval_every; 0 = at the end)."),
    checkpoint_every: Optional[int] = typer.Option(None, "--checkpoint-every", min=0, help="Also checkpoint every N steps (always at the end and on Ctrl-C). Default: 0."),
    checkpoint_full_every: Optional[str] = typer.Option(None, "--checkpoint-full-every", metavar="auto|K", help="How often a checkpoint is full; the others are incremental (only the rows touched since the previous checkpoint, applied on the full one at --resume). auto (the default): full, unless the previous full checkpoint is still being written or was written less than 4 times its write time ago, then incremental, so training never waits for a big table's write (where checkpoints are more than 5 full writes apart, every one is full); K: one full checkpoint in K (1: every checkpoint full, waiting for the previous full write when it is still going). Every checkpoint is written in the background while training goes on (a full one streamed from a copy-on-write snapshot of the tables; with --nproc > 1 each rank its rows); a failed write stops the run at the next checkpoint or at the end, the checkpoint before it kept."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Override the spec's training seed (0 .. 2^63-1)."),
    dask: Optional[str] = typer.Option(None, "--dask", help="Read data partitions through Dask: a scheduler address (tcp://host:8786) of an existing cluster, or 'local' for a local cluster. Synthetic rows have no partitions: with them a line says it is ignored. Default: direct pyarrow reads (faster on one machine)."),
    interleave: Optional[bool] = typer.Option(None, "--interleave/--no-interleave", help="--no-interleave: sequential schedule (no micro-batches, cache exchanges inline) to compare with the planned overlap; same parameters."),
    compile_dense: Optional[bool] = typer.Option(None, "--compile/--no-compile", help="Compile the dense stage (torch.compile, inductor; eager where compiling fails): faster steps after a one-off compile of tens of seconds, so for long runs; on a CPU the eager fp32 stage (oneDNN linear layers) can be faster: compare. Same parameters (allclose). Default: off."),
    cache_data: Optional[str] = typer.Option(None, "--cache-data", help="Keep the data's decoded rows (training and evaluation sets) in memory after their first pass, so later epochs and evaluations read and decode no files: auto (a Parquet dataset whose rows, as staged, fit half the memory still available; synthetic rows are in memory already), on (any dataset, any size), off (read every epoch), or a byte size such as 2GiB (auto with that budget). Costs 4 bytes per dense value, label and sparse id of every row (8 per id of a packed table of more than 2^31 rows), a row padded to a cache line where that saves one (about 229 MiB per 1.5M Criteo rows, 160 bytes each) for the whole run. Only one-id-per-field data (DLRM, DCN, W&D) is kept; sequences and managed tables are read every epoch. Default: auto."),
    nan_policy: Optional[str] = typer.Option(None, "--nan-policy", help="On a non-finite loss: stop (exit 2, the last checkpoint kept) or skip-batch (skip that batch's update and count it). Default: stop."),
    init_from: Optional[Path] = typer.Option(None, "--init-from", help="Start from this trained run (folder or checkpoint): its tables, dense parameters and optimizer state, its plan and its encoder (the data must be encoded with it: `flowrec data convert ... --encoder-from RUN`). The run starts at step 0 and records its parent in run.json. The spec may change training settings (learning rates, optimizers, dropout, batch size), not the weights' layout (docs/runs.md)."),
    fresh_optimizer: bool = typer.Option(False, "--fresh-optimizer", help="With --init-from: start the optimizer state afresh (parameters only)."),
    report: bool = typer.Option(False, "--report", help="After training, show measured step time, stage seconds, host<->device bytes and hit rates next to the planner's predictions."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    json_out: bool = typer.Option(False, "--json", help="Print the final result as JSON on stdout (with --follow: one line of JSON per day trained); an undefined metric (NaN) is null, as in eval --json."),
    nproc: int = typer.Option(1, "--nproc", show_default=False, min=1, help="Train on N local processes (ranks) through torch.distributed's launcher: row-wise sharded tables, data-parallel dense part, rank r trains slice r of every global batch (same parameters as one process, to rounding). For many nodes launch `torchrun ... -m flowrec train ...` instead. Default: 1."),
    dist_timeout: float = typer.Option(300.0, "--dist-timeout", show_default=False, help="Seconds a rank waits for the others in a collective (1 .. 604800, a week): a rank that died or hung makes the others exit (status 4) within this time, naming themselves; the ranks' start waits this or 300 s, whichever is longer. Default: 300."),
    max_restarts: int = typer.Option(0, "--max-restarts", show_default=False, min=0, help="With --nproc: restart every rank up to N times after a failure; the run continues from its last checkpoint. Default: 0."),
    follow_dir: Optional[Path] = typer.Option(None, "--follow", help="Continuous training: train each day partition (an encoded dataset folder) under this folder in order of name (numbers as numbers: day2 before day10) into --out/days/<day>, each from the day before (--init-from), after scoring the day before's model on it (progressive validation in --out/metrics.jsonl); resumes a day cut short, never trains a day twice."),
    follow_wait: float = typer.Option(0.0, "--follow-wait", show_default=False, help="With --follow: seconds to wait for a new day partition to land before stopping (0 .. 604800, a week). Default: 0 (stop when none is waiting)."),
    follow_once: bool = typer.Option(False, "--follow-once", help="With --follow: train at most one new day, then stop."),
    follow_order: str = typer.Option("name", "--follow-order", show_default=False, help="With --follow: the order of the day partitions: `name` (default), or `date:COLUMN`, by the first date of COLUMN that conversion recorded for each day (data option date_column, or split_by) or of a stored numeric column COLUMN; ties by name."),
    follow_export: bool = typer.Option(False, "--follow-export", help="With --follow: after each day, write its model package to --out/export/<day> (as `flowrec export`)."),
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
      flowrec train specs/movielens.yaml --nproc 2         # two ranks on this machine
      flowrec train specs/movielens.yaml --resume runs/movielens --nproc 1   # continue on one
      flowrec train my_model.yaml --data data/clicks/ --out runs/first   # your data: DIR/train, DIR/test
      flowrec train my_model.yaml --init-from runs/first --data data/day2 --out runs/day2   # new data
      flowrec train specs/managed_movielens.yaml --follow days/ --out runs/stream   # each day as it lands
    """
    full_every = _full_every(checkpoint_full_every)
    given = {"data": _text(data), "eval_data": _text(eval_data), "rows": rows, "seed": seed,
             "device": device, "device_budget": device_budget, "dask": dask, "cache": cache,
             "plan": _text(plan_file), "profile": _text(profile), "target": target,
             "epochs": epochs, "max_steps": max_steps, "eval_every": eval_every,
             "checkpoint_every": checkpoint_every, "checkpoint_full_every": full_every,
             "interleave": interleave, "compile": compile_dense, "nan_policy": nan_policy,
             "cache_data": cache_data}
    from flowrec.cli.ranks import share_cores

    share_cores()  # several ranks on this machine: their share of the cores, before numba is imported
    request = RunRequest(spec_path, out, resume, overwrite, given, quiet, json_out, report, init_from,
                         fresh_optimizer, dist_timeout)
    try:
        with terminated_as_interrupted(), stdout_reserved(json_out):  # the JSON alone on stdout
            _train_command(request, nproc, max_restarts, follow_dir, follow_wait, follow_once, follow_export,
                           follow_order)
    except KeyboardInterrupt as exc:
        if _launcher_says_it():  # a line per rank; the launcher's one line says what was kept
            raise typer.Exit(EXIT_INTERRUPTED)
        fail(f"interrupted ({interrupt_name(exc)}) before training started; nothing was trained", EXIT_INTERRUPTED)


def _launcher_says_it() -> bool:
    """A rank of `flowrec train --nproc N` interrupted where its launcher says the line (before
    training, and on every rank but 0 until the end: `flowrec.cli.ranks._stopped`)."""
    from flowrec.cli.ranks import launched_nproc

    return bool(launched_nproc()) and _launch_size() > 1


def _train_command(request: RunRequest, nproc: int, max_restarts: int, follow_dir, follow_wait: float,
                   follow_once: bool, follow_export, follow_order: str) -> None:
    """`flowrec train` once its options are read (a KeyboardInterrupt out of it: before training)."""
    _check_options(request)
    if max_restarts and nproc <= 1:  # it restarts the ranks of --nproc; one process would fail without a restart
        fail(f"--max-restarts {max_restarts} restarts the ranks of --nproc N after a failure: give --nproc N (2 or "
             f"more), or leave --max-restarts out (under torchrun, give torchrun's own --max-restarts)")
    if not 0.0 <= follow_wait <= MAX_FOLLOW_WAIT_S:  # NaN fails both comparisons
        fail(f"--follow-wait must be a number of seconds in 0..{MAX_FOLLOW_WAIT_S} (a week), not {follow_wait!r}")
    if follow_dir is None:  # each of these only shapes a --follow stream: alone it would be ignored
        alone = [flag for flag, given in (("--follow-wait", follow_wait != 0.0), ("--follow-once", follow_once),
                                          ("--follow-export", follow_export),
                                          ("--follow-order", follow_order != "name")) if given]
        if alone:
            fail(f"{', '.join(alone)} {'shapes' if len(alone) == 1 else 'shape'} the stream of --follow DAYS, "
                 f"which this run is not: give --follow DAYS, or leave {'it' if len(alone) == 1 else 'them'} out")
    if follow_dir is not None:
        _check_follow(request, nproc)
        from flowrec.cli.follow import follow

        follow(request, follow_dir, follow_wait, follow_once, run_training, follow_export,
               _follow_order(follow_order))
        return
    if nproc > 1 and _launch_size() == 1:
        raise typer.Exit(_launch(request, nproc, max_restarts))
    run_training(_restarted(request))


def _follow_order(text: str):
    """--follow-order as a `DayOrder` (exit 2 on a bad form)."""
    from flowrec.data.days import parse_order

    try:
        return parse_order(text)
    except ValueError as exc:
        fail(f"--follow-order: {exc}")


def _check_follow(request: RunRequest, nproc: int) -> None:
    """--follow takes its data from the day folders and its runs from --out."""
    clashes = [flag for flag, given in (("--data", request.given.get("data")), ("--resume", request.resume),
                                        ("--init-from", request.init_from), ("--nproc", nproc > 1)) if given]
    if clashes:
        fail(f"--follow trains each day folder into --out/days/<day> from the day before: "
             f"it takes no {', '.join(clashes)}")
    if _launch_size() > 1:  # under torchrun every rank followed the stream: rank 1 found rank 0's
        # lock ('in use by another flowrec train --follow') and rank 0 waited for it in its first collective
        fail(f"--follow trains each day in one process; this is a launch of {_launch_size()} ranks "
             "(WORLD_SIZE, torchrun): run flowrec train --follow without torchrun")


def _launch_size() -> int:
    from flowrec.cli.common import launch_env

    return launch_env()[0]


def _launch(request: RunRequest, nproc: int, max_restarts: int) -> int:
    """Run this command on `nproc` local ranks (the run folder chosen here when none is named)."""
    from flowrec.cli.ranks import launch_ranks
    from flowrec.runtime.rundir import RunFolderError, claim_new_folder

    spec = load_spec_or_exit(request.spec_path)
    _check_ranks(spec, request, nproc)
    if request.resume is not None and _finished_before_launch(request, spec, nproc):
        return 0
    folder = None
    if request.out is None and request.resume is None:
        try:
            folder, lock = claim_new_folder(Path("runs"), spec.name)
        except RunFolderError as exc:
            fail(str(exc))
        lock.release()  # rank 0 locks it again
    _say(f"launching {nproc} ranks (torch.distributed.run, gloo on CPU / nccl on CUDA)")
    resumed = (f"flowrec train {shell_word(str(request.spec_path))} --resume {shell_word(str(request.resume))} "
               f"--nproc {nproc}") if request.resume is not None else None
    try:
        return launch_ranks(nproc, max_restarts, folder, resumed)
    finally:
        if folder is not None:
            _drop_unused_folder(folder)


def _finished_before_launch(request: RunRequest, spec, nproc: int) -> bool:
    """`--resume RUN --nproc N` of a finished run, said as one process says it (its notes, its
    line, its --json document, status 0), from its checkpoint, before any rank starts: each rank
    read the run's data and built its model to say it (13.6 s of CPU for a tiny run, against 3.5 s
    for one process). Only where the run looks finished (`looks_finished`: no digest) and the
    checkpoint's answer is sure (`finished_run`); anything else, a refusal included, is left to the
    ranks as before, the lines this process would have said unsaid."""
    from dataclasses import replace

    from flowrec.runs.finished import looks_finished

    if not looks_finished(request.resume, request.given, spec):  # (never a spec with custom modules)
        return False
    return _said_if_finished(lambda: run_training(replace(request, finished_only=nproc)))


def _said_if_finished(resume) -> bool:
    """Run `resume` (a `--resume` with `finished_only` set): True where it said the run is finished,
    its lines then written out; False for anything else (`_Unanswered`, a refusal, any error), its
    lines unsaid, so the caller goes on as it would have (the ranks, or the lock's line, say it)."""
    import io
    from contextlib import redirect_stderr

    said = io.StringIO()
    try:
        with redirect_stderr(said):
            resume()
    except Exception:  # noqa: BLE001 - _Unanswered, a refusal (typer.Exit), anything: said elsewhere as before
        return False
    sys.stderr.write(said.getvalue())
    return True


def _drop_unused_folder(folder: Path) -> None:
    """Remove the run folder this launch named for its ranks (no --out) when no rank wrote in it:
    a launch stopped before rank 0 claimed it left `runs/NAME` holding its lock alone, and the next
    run took `runs/NAME-2`. A folder a rank still holds, or one with anything in it, stays."""
    from flowrec.runtime.rundir import RunFolderError, RunLock

    if not folder.is_dir():
        return
    try:
        lock = RunLock.acquire(folder)
    except RunFolderError:
        return
    lock.release_and_remove_if_unused()


def _check_ranks(spec, request: RunRequest, nproc: int) -> None:
    """Exit 2 (the one line of `flowrec.runs.launch`'s checks) when `nproc` ranks cannot run this
    request, before the launch: each rank found it after starting and said the same line. The GPUs
    of a run on CUDA, the memory for the ranks, the cache policy of a new run (a resumed run, one
    started from another or from a plan file trains a plan whose check is its own), and a given
    --data or --eval-data (only the folder's record is read here; the ranks open the data)."""
    from flowrec.runs.errors import RunError
    from flowrec.runs.launch import check_ranks_cache, check_ranks_data, check_ranks_fit, check_ranks_have_gpus

    try:
        check_ranks_have_gpus(spec, request.given["device"], nproc)
        check_ranks_fit(nproc)
        if request.resume is None and request.init_from is None and request.given.get("plan") is None:
            check_ranks_cache(spec, request.given.get("cache"), nproc)
        check_ranks_data(spec, request.given)
    except RunError as exc:
        fail(str(exc), exc.code)


def _restarted(request: RunRequest) -> RunRequest:
    """A rank restarted by the launcher (--max-restarts) continues the run from its checkpoint."""
    from dataclasses import replace

    from flowrec.cli.ranks import restart_count
    from flowrec.runtime.rundir import has_run

    restart = restart_count()
    if not restart or request.resume is not None:
        return request
    if request.out is not None and has_run(request.out):
        _say(f"restart {restart}: continuing {request.out} from its last checkpoint")
        return replace(request, resume=request.out, out=None, overwrite=False)
    _say(f"restart {restart}: no checkpoint was taken before the failure; training "  # nothing to continue
         f"{request.out if request.out is not None else 'the run'} again from step 0")
    return request


def _text(path: Optional[Path]) -> Optional[str]:
    return str(path) if path is not None else None


def _full_every(text: Optional[str]) -> Optional[int]:
    """`--checkpoint-full-every`: auto (recorded as 0, `Checkpointer`'s AUTO) or K >= 1; None: not given."""
    if text is None:
        return None
    word = text.strip().lower()
    if word == "auto":
        return 0
    if re.fullmatch(r"[0-9]{1,18}", word) and int(word) >= 1:
        return int(word)
    fail(f"--checkpoint-full-every must be auto or a whole number K >= 1 (one full checkpoint in K), not {text!r}")


def _check_options(request: RunRequest) -> None:
    from flowrec.data.rowcache import parse_cache_data
    from flowrec.runs.settings import CACHE_POLICIES
    from flowrec.runtime.nonfinite import NAN_POLICIES
    from flowrec.runtime.session import device_problem

    check_env_switches()  # $FLOWREC_CPU_GEMM, ..._CHECKPOINT_WRITES, ..._MALLOC_TUNING, ..._DATA_PRIORITY
    given = request.given
    check_seed_option("--seed", given["seed"])
    if given["device"] is not None and device_problem(given["device"]):  # `or "auto"` would hide ""
        fail(f"--device {device_problem(given['device'])}")
    check_byte_size("--device-budget", given["device_budget"])
    if given["cache"] is not None and given["cache"] not in CACHE_POLICIES:
        fail(f"--cache must be one of {', '.join(CACHE_POLICIES)}, not {given['cache']!r}"
             f"{did_you_mean(given['cache'], CACHE_POLICIES)}")
    if given["nan_policy"] is not None and given["nan_policy"] not in NAN_POLICIES:
        fail(f"--nan-policy must be one of {', '.join(NAN_POLICIES)}, not {given['nan_policy']!r}"
             f"{did_you_mean(given['nan_policy'], NAN_POLICIES)}")
    if given.get("cache_data") is not None:
        try:
            parse_cache_data(given["cache_data"])
        except ValueError as exc:
            fail(str(exc))
    if given["dask"] is not None:
        from flowrec.data.dataset import dask_address_problem

        if problem := dask_address_problem(given["dask"]):
            fail(f"--dask {problem}")
    if not 1.0 <= request.dist_timeout <= MAX_DIST_TIMEOUT_S:  # NaN fails both comparisons
        fail(f"--dist-timeout must be a number of seconds in 1..{MAX_DIST_TIMEOUT_S} (a week), "
             f"not {request.dist_timeout!r}")
    if request.resume is not None and request.overwrite:
        fail("--resume continues a run and --overwrite replaces it; give one of them")
    from flowrec.cli.streams import refuse_stream_folder
    from flowrec.runs.resume import stream_folder_problem

    if request.resume is not None and (problem := stream_folder_problem(request.resume, shell_word(
            str(request.spec_path)))):  # not "no checkpoint.pt or run.json"
        fail(problem)
    if request.init_from is not None:
        refuse_stream_folder(request.init_from, "start from")
    if request.init_from is not None and request.resume is not None:
        fail("--init-from starts a new run and --resume continues one; give one of them")
    if request.fresh_optimizer and request.init_from is None:
        fail("--fresh-optimizer applies to --init-from RUN only")
    if request.init_from is not None and request.out is not None and _within(request.init_from, request.out):
        fail(f"--init-from {request.init_from} lies in --out {request.out}: the new run would replace the run "
             f"it starts from (its checkpoint is removed when the new run starts); give another --out")
    if request.resume is not None and request.out is not None and request.out != request.resume:
        fail(f"--out {request.out} and --resume {request.resume} name different run folders")


def _within(path: Path, folder: Path) -> bool:
    """Whether `path` is `folder` or lies in it, links resolved."""
    path, folder = path.resolve(), folder.resolve()
    return path == folder or folder in path.parents


def run_training(request: RunRequest) -> None:
    """Own the run folder for the whole run (lock), then resolve the settings and train."""
    from flowrec.runtime.rundir import RunFolderError, folder_state

    # a resumed run's spec (its spec.json) may name a class file relative to the folder the run was
    # started from (a flowrec that recorded them as given), or one gone with the moved run: found as the run
    # finds it, and so is the spec of a run started from another (--init-from), each file used said alike
    run = request.resume if request.resume is not None else _run_folder(request.init_from)
    spec = planned_spec_or_exit(request.spec_path, run, note=lambda line: _say(f"note: {line}"))
    given = request.resume or request.out
    if _launch_size() > 1:
        _train_as_rank(request, spec, given)
        _exit_finished_rank()
    found = folder_state(given)
    try:
        folder, lock = _claim_folder(request, spec.name)
    except RunFolderError as exc:
        if request.resume is not None and _finished_in_read_only(request, spec):
            return
        fail(str(exc))
    refused = False
    try:
        _train_in(request, spec, folder)
    except typer.Exit as stop:
        refused = stop.exit_code == EXIT_INVALID  # bad input: not an interrupt, OOM, a lost rank
        raise
    finally:
        lock.release_as_found(found, refused)


def _finished_in_read_only(request: RunRequest, spec) -> bool:
    """`--resume RUN` of a finished run in a folder this process cannot write (an archived run, a
    read-only mount), whose lock cannot be made there: said from its checkpoint as in a folder it
    can lock (nothing is written, and nobody writes in a read-only folder meanwhile). False where the
    folder is writable, holds no run.json, or the run is not said finished: the lock's line stands."""
    from dataclasses import replace

    from flowrec.runs.resume import finished_looking_read_only

    folder = request.resume
    if not finished_looking_read_only(folder, request.given, spec):
        return False
    only = replace(request, finished_only=max(request.finished_only, 1))
    return _said_if_finished(lambda: _train_in(only, spec, folder))


def _run_folder(given: Path | None) -> Path | None:
    """The run folder of a run given as a folder, its RUN/best or a checkpoint file (--init-from's):
    where its run.json records the digests of its class files."""
    from flowrec.runtime.rundir import run_folder_of

    return run_folder_of(given) if given is not None else None


def _train_as_rank(request: RunRequest, spec, folder: Path | None) -> None:
    """One rank of a launch: join the others; rank 0 owns the run folder (lock), the others wait
    for it, then every rank trains its part."""
    from flowrec.runs.errors import RunError
    from flowrec.runs.plan import device_for_run
    from flowrec.cli.common import launch_env
    from flowrec.runtime.distributed.world import LaunchEnvError, WorldError, join_world, leave_world
    from flowrec.runtime.rundir import RunFolderError, folder_state

    from flowrec.cli.ranks import stop_with_launcher
    from flowrec.cli.rank_reports import note_for_launcher

    stop_with_launcher()  # a launcher killed by SIGKILL left its ranks training on as orphans
    note_for_launcher(None)  # rank 0 (of a restart too): nothing trained yet, the launcher's line
    if folder is None:
        fail("every rank must write to the same run folder: give --out DIR (or --resume DIR), or launch "
             "with `flowrec train --nproc N`, which chooses one")
    try:
        device = device_for_run(spec, request.given["device"] or "auto")
    except RunError as exc:
        fail(str(exc), exc.code)
    try:
        world = join_world(*launch_env(), request.dist_timeout, device)
    except WorldError as exc:
        fail(str(exc), EXIT_INVALID if isinstance(exc, LaunchEnvError) else EXIT_RANK_FAILED)
    try:
        lock, refusal = None, None
        if world.lead:
            found = folder_state(folder)
            try:
                folder, lock = _claim_folder(request, spec.name)
            except RunFolderError as exc:
                refusal = str(exc)
        try:  # the others wait for the run folder and learn whether rank 0 refused it
            refused = world.any(refusal is not None)
        except RuntimeError as exc:
            _fail_lost(world, exc, note=" while waiting for the run folder")
        if refusal is not None:
            fail(refusal)
        if refused:  # rank 0's one line says why; the launch's status is its 2 (this rank's 0 adds no failure)
            raise typer.Exit(0)
        refused = False
        try:
            _train_in_world(request, spec, folder, world)
        except typer.Exit as stop:
            refused = stop.exit_code == EXIT_INVALID  # bad input: not an interrupt, OOM, a lost rank
            raise
        finally:
            if lock is not None:
                lock.release_as_found(found, refused)
    except typer.Exit as stop:
        if stop.exit_code == EXIT_RANK_FAILED:  # its line is out; gloo's threads may still read the dead rank's
            exit_without_teardown(EXIT_RANK_FAILED)  # sockets: destroying its groups aborted the rank now and then
        raise
    finally:
        _ignore_stop_signals()  # this rank's line is out: a signal now said "before training started"
        leave_world()


def _ignore_stop_signals() -> None:
    """Ignore Ctrl-C, SIGTERM and SIGHUP from here on: a rank whose run is over (its line said, or the
    run finished) only leaves the process groups and exits, which a signal would cut short with a
    wrong line ('interrupted ... before training started; nothing was trained'); torch's launcher
    kills a rank that does not exit in its shutdown time."""
    import signal

    from flowrec.data.interrupts import stop_signals

    for sig in (signal.SIGINT, *stop_signals()):
        signal.signal(sig, signal.SIG_IGN)


def _train_in_world(request: RunRequest, spec, folder: Path, world) -> None:
    """`_train_in` on a rank: a collective that failed outside training's own handling (building
    the model's parallel parts, loading a checkpoint) because another rank stopped on an error of
    its own (bad data on that rank, a plan it refused) is this rank's one line naming that rank,
    with its status, and one lost without a word (killed as it loaded its data) a lost rank's
    line, status 4, not a traceback of gloo's closed connection."""
    from flowrec.runtime.distributed.world import lost_peer

    try:
        _train_in(request, spec, folder, world)
    except typer.Exit:  # a line already said (click's Exit is a RuntimeError)
        raise
    except RuntimeError as exc:
        if world.stopped_rank() is None and not lost_peer(exc):
            raise
        _fail_lost(world, exc, "stopped before training: ")


def _exit_finished_rank() -> None:
    """End a rank that finished its run (every file closed, process groups destroyed) at once.

    Interpreter teardown could still free gloo work objects that gloo's own threads hold, and
    that aborts the process now and then ("terminate called without an active exception", status
    -6: seen once in about 25 runs here), which the launcher reports as a failed run although
    everything was written. So the rank flushes its output and exits without the teardown.
    """
    exit_without_teardown(0)


def _rank_agree(world, flag: bool, what: str) -> bool:
    """Whether any rank's `flag` is set, once every rank has come here (a barrier that tells the
    others of a failure); a rank that died or hung is one line and exit status 4."""
    try:
        return world.any(flag)
    except RuntimeError as exc:
        _fail_lost(world, exc, note=f" while waiting for {what}")


def _fail_lost(world, exc: BaseException, where: str = "", note: str = "") -> NoReturn:
    """This rank's line after a collective failed (`where` before, `note` after the cause): the
    rank that stopped first on an error of its own (it recorded its status, `report_stop`), with
    that status (2 for bad input: the run folder left as one process leaves it), its own line
    saying why; else another rank died or hung (status 4, the collective's words)."""
    stopped = world.stopped_rank()
    if stopped is not None:
        rank, status = stopped
        fail(f"{where}rank {rank} stopped first (its line says why){note}", status, follows=True)
    fail(f"{where}{_rank_lost(world, exc)}{note}", EXIT_RANK_FAILED)


def _rank_lost(world, exc: BaseException) -> str:
    """What a failed collective says of the other ranks: a timeout is "did not answer within T s",
    anything else (a closed connection: the rank died) is "failed"; the collective's own first line
    follows in brackets under torchrun. Under `flowrec train --nproc N` it does not: the launcher's
    last line names the rank that failed and how, and gloo's words ('Connection reset by peer ...
    GLHF!') reached the terminal before it."""
    from flowrec.cli.ranks import launched_nproc

    text = first_line(exc)
    timed_out = "timeout" in text.lower() or "timed out" in text.lower()
    what = (f"another rank did not answer within {world.timeout_s:g} s" if timed_out
            else "another rank failed")
    return what if launched_nproc() else f"{what} ({text})"


def _claim_folder(request: RunRequest, name: str):
    from flowrec.runs.folder import claim_run_folder

    return claim_run_folder(request.out, request.resume, request.overwrite, name)


def _train_in(request: RunRequest, spec, folder: Path, world=None) -> None:
    """Train in a folder this process owns; a `RunError` of the run lifecycle is its one line."""
    from flowrec.runs.errors import RunError

    try:
        _train_in_folder(request, spec, folder, world)
    except RunError as exc:
        fail(str(exc), exc.code)


def _train_in_folder(request: RunRequest, spec, folder: Path, world=None) -> None:
    """Settings, checkpoint, session, then training, in a folder this process owns."""
    from dataclasses import replace

    from flowrec.runs.settings import lost_relative_path, read_run_file, recorded_train_rows, same_setting
    from flowrec.runs.start import run_settings
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME, CheckpointError, load_checkpoint
    from flowrec.runtime.rundir import RunFolderError

    resuming = request.resume is not None
    has_checkpoint = resuming and (folder / CHECKPOINT_NAME).is_file()
    problem = None
    try:
        recorded = read_run_file(folder) if resuming else None
        # the checkpoint is mapped, not read into memory (a finished run's answer copies no table), and
        # ranks copy only their rows (no rank assembles whole tables)
        ranks = world is not None or request.finished_only > 0
        state = load_checkpoint(folder / CHECKPOINT_NAME, mmap=True, lazy_shards=ranks) if has_checkpoint else None
    except (RunFolderError, CheckpointError) as exc:
        problem = str(exc)
    if world is not None and resuming and _rank_agree(world, world.lead and problem is not None, "the checkpoint"):
        _refuse(problem or "", world)  # every rank reads the same files: rank 0's line alone (it was one per rank)
    if problem is not None:
        fail(problem)
    for key in ("data", "eval_data") + (("init_from",) if state is None and not request.init_from else ()):
        if request.given.get(key) is None and (problem := lost_relative_path(folder, recorded, key)):
            fail(problem)
    parent = request.init_from or ((recorded or {}).get("init_from") if state is None else None)
    _refuse_plan_flags(request.given, recorded if state is not None else None, parent if state is None else None)
    settings, notes = run_settings(request.given, spec, recorded, parent,
                                   request.fresh_optimizer or bool((recorded or {}).get("fresh_optimizer")))
    if state is not None:  # before the notes, which would say that --seed S overrides the run's seed
        _check_resumed_seed(settings["seed"], state, folder, world)
    for note in notes:
        _say(note)
    if resuming and state is None:  # with a checkpoint: once the run is not said finished from it (`_run`)
        _check_recorded_data(request.given, settings, folder, world)
    if state is not None:
        bound = spec.data is not None and spec.data.bound
        settings["train_rows"] = recorded_train_rows(request.given, recorded, not settings["data"] and not bound)
        if "train_rows" not in (recorded or {}):  # a run of before 2026-12-05 (see _refuse_older_split_again)
            if bound and not settings["data"]:
                _refuse_older_split_again(spec, folder)
            elif settings["data"] and same_setting("data", settings["data"], (recorded or {}).get("data")):
                _refuse_split_since(Path(settings["data"]), folder)
    if resuming and state is None:
        _say(f"{folder} has no checkpoint yet: starting it again from step 0 with its recorded settings")
    if settings["cache"] is not None:
        spec = replace(spec, plan=replace(spec.plan, cache=settings["cache"]))
    _run(request, spec, folder, settings, state, world)


def _refuse_older_split_again(spec, folder: Path) -> None:
    """A run of an older flowrec on its spec's bound data split by a seed, whose RUN/data is gone
    (`flowrec.runs.resume.older_split_problem`): one line and exit 2, before anything is encoded."""
    from flowrec.runs.resume import older_split_problem

    if (problem := older_split_problem(spec, folder)) is not None:
        fail(problem)


def _refuse_split_since(data: Path, folder: Path) -> None:
    """A run of a flowrec of before 2026-12-05 resumed on its --data folder, split since by this flowrec
    (`flowrec.runs.resume.split_since_problem`): one line and exit 2."""
    from flowrec.runs.resume import split_since_problem

    if (problem := split_since_problem(data, folder)) is not None:
        fail(problem)


def _check_recorded_data(given: dict, settings: dict, folder: Path, world=None) -> None:
    """Exit 2 when the --data or --eval-data a resumed run recorded (run.json) is gone: it said only
    'dataset directory not found: PATH', a path the user did not give on this command line (under
    --nproc N, rank 0's line alone)."""
    from flowrec.runs.resume import recorded_data_problem

    if (problem := recorded_data_problem(given, settings, folder)) is not None:
        _refuse(problem, world)


def _refuse_plan_flags(given: dict, recorded: dict | None, parent: Path | str | None) -> None:
    """A run resumed from its checkpoint (`recorded`: its run.json) trains the plan it was trained
    with, one started from a `parent` run trains the parent's: a flag that makes a plan would change
    nothing, and was ignored without a word (--resume even said it overrides the recorded value).
    One line and exit 2 naming them (`flowrec.runs.resume.plan_options_problem`)."""
    from flowrec.runs.resume import plan_options_problem

    if (problem := plan_options_problem(given, recorded, parent)) is not None:
        fail(problem)


def _refuse(message: str, world=None) -> None:
    """Refuse the run in one line, where every rank of a launch refuses it alike (the same spec,
    run folder and checkpoint): rank 0's line alone; the other ranks stop without one of their own
    (status 0: the launch's status is rank 0's 2), as for a run folder rank 0 refuses."""
    if world is not None and not world.lead:
        raise typer.Exit(0)
    fail(message)


def _check_resumed_seed(seed: int | None, state: dict, folder: Path, world=None) -> None:
    """A resumed run keeps the seed it was trained with (its data order, synthetic rows and dropout
    follow from it): another --seed is refused here, in its own words, before any data is read."""
    from flowrec.runs.resume import seed_problem

    if (problem := seed_problem(seed, state, folder)) is not None:
        _refuse(problem, world)


def _run(request: RunRequest, spec, folder: Path, settings: dict, state: dict | None, world=None) -> None:
    from flowrec.runs.plan import device_for_run, plan_for_run
    from flowrec.runs.resume import changed_data_line, resumed_device, spec_changed_line
    from flowrec.runtime.progress import reading_bar
    from flowrec.runs.settings import write_run_file
    from flowrec.data.layout import DataError
    from flowrec.graph.plan_io import plan_json
    from flowrec.data.profile import forget_kept_sample
    from flowrec.runtime.caches.base import CacheCapacityError
    from flowrec.runtime.checkpoint.store import CHECKPOINT_NAME, CheckpointError
    from flowrec.runtime.run_log import MetricsError
    from flowrec.runtime.nonfinite import TrainingStopped
    from flowrec.runtime.rundir import RunFolderError, clear_run_files
    from flowrec.runs.start import memory_hint, record_encoder, start_session, train_config
    from flowrec.runtime.trainer import Trainer
    from dataclasses import replace

    from operators.embedding import restoring_tables

    if request.finished_only and state is None:
        raise _Unanswered()  # no checkpoint: nothing to say finished
    plan_file = Path(settings["plan"]) if settings.get("plan") and state is None else None
    profile = Path(settings["profile"]) if settings.get("profile") else None
    parent = _parent_or_exit(settings) if state is None else None
    ranks = world.size if world is not None else max(request.finished_only, 1)
    if state is not None:  # a resumed run continues with the plan it was trained with, unchanged
        device = None  # once it is not said finished from its checkpoint (below), which needs none
        plan = _for_ranks(_stored_plan_or_exit(state, folder, spec, world=world), spec, ranks)
    elif parent is not None:  # a run started from another trains its plan (same model and layout)
        device = device_for_run(spec, settings["device"] or "auto")
        plan = _init_from_plan_or_exit(parent, settings, spec, world, ranks, request.quiet)
    else:
        plan, device = plan_for_run(spec, settings["device"] or "auto", settings["device_budget"], plan_file, _say,
                                    profile, settings["target"], settings["data"], ranks, settings.get("epochs"),
                                    settings.get("max_steps"), reading_bar(not request.quiet and is_lead_rank()),
                                    cache=settings["cache"])
    if world is not None:
        device = world.device  # cuda:LOCAL_RANK for each rank on CUDA
    if state is not None:  # the spec the session trains (`session.prepare`), checked before any data is read
        trained = spec if settings["seed"] is None else replace(spec, training=replace(spec.training,
                                                                                         seed=settings["seed"]))
        if not _spec_matches_run(state, folder, trained, world):
            _refuse(spec_changed_line(request.spec_path, folder, state, trained), world)
        if world is None and _said_finished(request, folder, state, spec, plan, settings):
            return  # told from its checkpoint, before its data is read and its model built
        if request.finished_only:
            raise _Unanswered()
        _check_recorded_data(request.given, settings, folder, world)  # a finished run reads none
        resumed_on = resumed_device(request.given.get("device"), spec, settings, folder)  # refused where
        # this machine lacks it
        device = device if world is not None else resumed_on  # a rank's device is its world's

    preparing = [False]  # rank 0 between `before` and `after`: the others wait to learn how its data went

    def before() -> None:  # rank 0 encodes bound data into the run folder first
        if world is not None and not world.lead and _rank_agree(world, False, "rank 0 to prepare the data"):
            raise typer.Exit(0)  # rank 0 refused the data in its line; the launch's status is its 2
        preparing[0] = world is not None and world.lead

    def after() -> None:
        if world is not None and world.lead:
            preparing[0] = False
            _rank_agree(world, False, "the other ranks to build their model")

    # a resumed run, or one started from another (the same plan), loads every table from a checkpoint
    # next (each rank its rows: a sharded checkpoint's shards cover every row once): nothing is drawn
    try:
        with restoring_tables() if state is not None or parent is not None else nullcontext():
            session = start_session(spec, request.spec_path, settings, folder, plan, device, _say, world, before,
                                    after, resumed=request.resume is not None)
    except Exception:
        if preparing[0]:  # rank 0's data failed (a file of no test rows, a malformed row): its line alone says so,
            try:  # where each other rank added 'another rank failed (gloo's words)' while it waited
                world.any(True)
            except RuntimeError:
                pass
        raise
    _say(session.data_note)
    rows = sum(session.train.partition_rows())
    if state is not None and settings.get("train_rows") not in (None, rows):
        fail(changed_data_line(settings, rows, folder, state))
    settings["train_rows"] = rows  # recorded in run.json: a resume checks its data against it
    _check_loop_settings(session, settings.get("data"))
    if world is None or world.lead:
        record_encoder(session, folder, request.resume is not None,
                       settings.get("init_from") if state is None else None, _say)
    config = train_config(settings, folder, progress=not request.quiet)
    trainer = Trainer(session.spec, session.plan, session.model, config, plan_json(session.plan))
    hooks = _console_hooks(trainer, request.quiet) if trainer.lead else None
    resume_cmd = request.continue_command or _resume_command(request.spec_path, folder)
    from flowrec.cli.rank_reports import note_for_launcher

    note_for_launcher("")  # rank 0 of --nproc N: from here its own line says where it stopped
    try:
        if state is not None:
            trainer.load_state(state, folder / CHECKPOINT_NAME)
            state.clear()  # the model has its copy: release the checkpoint's (memory-mapped) tensors
            if trainer.finished(session.train):
                session.model.close()
                _say_finished(request, folder, trainer.position, trainer.epochs, settings, trainer.stopper)
                return
            _say(f"resuming {folder} at epoch {trainer.position.epoch}, batch {trainer.position.batch} "
                 f"(step {trainer.position.step})")
        else:
            if parent is not None:
                _start_from(trainer, parent, settings)
            if trainer.lead:
                clear_run_files(folder)
        if trainer.lead:
            write_run_file(folder, settings, spec)
        _say(f"run folder {folder}; if it stops, continue with  {resume_cmd}")
        if world is not None:
            _say(f"{world.size} ranks: {_sharding_line(session.plan)}")
        first_step = trainer.position.step  # a resumed run's step count goes on from here
        result = trainer.fit(session.train, session.eval, hooks=hooks)
    except (DataError, CheckpointError, MetricsError, RunFolderError, TrainingStopped) as exc:
        fail(*_own_or_followed(exc, world))
    except CacheCapacityError as exc:
        fail(f"at step {trainer.position.step + 1}: {exc}; {trainer.checkpoint_note()}")
    except KeyboardInterrupt as exc:
        if not trainer.lead and _launcher_says_it():  # rank 0's line says it, once
            raise typer.Exit(EXIT_INTERRUPTED)
        fail(f"interrupted ({interrupt_name(exc)}) at step {trainer.position.step}; continue with  {resume_cmd}",
             EXIT_INTERRUPTED)
    except (RuntimeError, MemoryError) as exc:
        if out_of_memory(exc):  # torch's CUDA error, or the CPU allocator's RuntimeError
            fail(f"out of memory at step {trainer.position.step + 1} on {session.device}: {first_line(exc)}; "
                 f"{trainer.checkpoint_note()}. {memory_hint()}", EXIT_OUT_OF_MEMORY)
        _fail_if_custom(exc, trainer)
        if world is None:
            raise
        where = (f"stopped at the end of the run, after its last step ({trainer.position.step})"
                 if trainer.finished(session.train) else f"stopped at step {trainer.position.step + 1}")
        _fail_lost(world, exc, f"{where}: ", f"; {trainer.checkpoint_note()}")
    except Exception as exc:  # a user's custom module may raise anything in training or evaluation
        _fail_if_custom(exc, trainer)
        raise
    finally:
        session.close_data()
        forget_kept_sample()  # a run that stopped before its hot set was chosen holds no sample
    if not trainer.lead:
        return
    from flowrec.runtime.trainer import GracefulInterrupt

    with GracefulInterrupt(say=True, finishing="the run's closing lines") as late:  # the run is whole: a signal now must not cut its closing lines short
        _report(result, folder, request.json_out, request.json_lines, first_step)
        if request.report:
            from flowrec.runtime.run_report import run_report

            spec = session.spec
            for line in run_report(result, session.plan, spec.training.batch_size, len(spec.dense_features),
                                   len(spec.heads), first_step):
                _say(line)
    if result.interrupted:
        _say(f"interrupted: checkpoint saved; continue with  {resume_cmd}")
        raise typer.Exit(EXIT_INTERRUPTED)
    whole = (f"interrupted after the run finished: {folder} holds all of it, its checkpoint of step "
             f"{trainer.position.step} included; nothing to continue")
    if late.requested:  # it said "before training started; nothing was trained"
        _say(whole)
        raise typer.Exit(EXIT_INTERRUPTED)
    note_for_launcher(whole)  # a signal to --nproc N's launcher as it winds up ended it with no line


def _own_or_followed(exc: Exception, world) -> tuple[str, int, bool]:
    """`fail`'s arguments for a run's error: a checkpoint that failed on another rank (its
    `failed_rank`: a shard it could not write) is that rank's error, which this rank only follows,
    and its line says whose it is (rank 0's bare 'No space left on device' read as its own disk)."""
    failed = getattr(exc, "failed_rank", None) if world is not None else None
    if failed is None or failed == world.rank:
        return str(exc), EXIT_INVALID, False
    from flowrec.runtime.checkpoint.store import CheckpointError

    return (f"rank {failed} stopped first: {exc}" if isinstance(exc, CheckpointError) else str(exc)), EXIT_INVALID, True


def _fail_if_custom(exc: BaseException, trainer: "Trainer") -> None:
    """One line naming the custom module whose forward raised `exc` in training or evaluation
    (its own traceback is the user's code: `flowrec train` showed a traceback through flowrec's), or
    the custom modules of a model whose backward raised it, or the one whose state code raised it
    (a checkpoint's state_dict, a resume's load). Under `--nproc N` the other ranks learn it
    (`fail` records it: `flowrec.cli.rank_reports.report_stop`), so the run ends with status 2 on every
    rank, its folder as one process leaves it."""
    line = trainer.custom_failure_line(exc)
    if line is not None:
        fail(line)


def _resume_command(spec_path: Path, folder: Path) -> str:
    """The command that continues this run as it was launched (`--nproc N` for N local ranks)."""
    from flowrec.cli.ranks import launched_nproc

    nproc = launched_nproc()
    return (f"flowrec train {shell_word(str(spec_path))} --resume {shell_word(str(folder))}"
            f"{f' --nproc {nproc}' if nproc and nproc > 1 else ''}")


def _for_ranks(plan, spec, ranks: int):
    """A stored plan for this launch's ranks: sharded again when its world size differs."""
    if plan.meta.world_size == ranks:
        return plan
    from flowrec.planner.contract import PlanError, resharded

    try:
        plan = resharded(plan, spec, ranks)
    except PlanError as exc:
        fail(str(exc))
    _say(f"the run's plan was for {plan.meta.passes[-1].notes[0]}")
    return plan


def _sharding_line(plan) -> str:
    """How the plan spreads its groups over the ranks, in a few words."""
    kinds = [g.sharding for g in plan.meta.groups]
    return ", ".join(f"{kinds.count(k)} group(s) {k}" for k in dict.fromkeys(kinds)) \
        or "no embedding groups (dense parameters replicated)"


def _check_loop_settings(session, data: str | None = None) -> None:
    """Say what the run will not do: evaluate (no test split), log to TensorBoard (not installed).
    (Early stopping without evaluations is refused when the session starts: `runs.start`.) `data`:
    --data, whose split's test part beside it (`--data DIR/train`) is named as the folder to give."""
    from flowrec.data.owners import META_FILE
    from flowrec.runtime.run_log import tensorboard_available

    if session.eval is None:
        test = Path(data).parent / "test" if data and Path(data).name == "train" else None
        give = (f"give --eval-data {test} (the test part beside {data}), or --data {test.parent} for both parts"
                if test is not None and (test / META_FILE).is_file() else "give --eval-data DIR to evaluate")
        _say(f"no evaluation set (the data has no test split and no --eval-data was given): evaluation is "
             f"skipped; {give}")
    if not tensorboard_available():
        _say("TensorBoard is not installed: metrics go to metrics.jsonl only "
             "(pip install 'flowrec[tensorboard]' to also log them for TensorBoard)")
    if (line := training_rows_evaluated(session.train, session.eval)) is not None and is_lead_rank():
        warn(line)


def training_rows_evaluated(train: Any, evaluation: Any | None) -> str | None:
    """The warning owed when the evaluation rows are training rows: `--eval-data D` of the folder
    --data trains on (or of its split's train part, `--data D --eval-data D/train`) gave the fit to
    the training rows as the run's AUC and logloss (0.75 where its test rows gave 0.53), without a
    word. Told by the part files both read (resolved: a link to them too); None when they share none."""
    files = getattr(train, "files", None)
    scored = getattr(evaluation, "files", None)
    if not files or not scored:
        return None
    trained = {Path(f).resolve() for f in files}
    shared = [f for f in scored if Path(f).resolve() in trained]
    if not shared:
        return None
    path = getattr(evaluation, "path", "the evaluation data")
    share = "every one" if len(shared) == len(scored) else f"{len(shared):,} of the {len(scored):,}"
    return (f"the evaluation data {path} is training data: the run trains on {share} of its part files, "
            "so its metrics measure the fit to rows the model learnt, not to new ones; give --eval-data of "
            "other rows (a split's test part: `flowrec data convert ... --test-fraction F`)")


def _console_hooks(trainer, quiet: bool):
    """Hooks that print a metrics table at every evaluation (and early stopping's decisions)."""
    from flowrec.cli.metrics_table import metrics_table, number_cell
    from flowrec.runtime.evaluation.undefined import undefined_notes
    from flowrec.runtime.trainer import Hooks

    shown: list[int] = []  # steps whose metrics are on the console
    noted: set[str] = set()  # the lines of metrics undefined on the evaluation rows, said once
    warned: list[bool] = []

    def on_eval(event) -> None:
        if not warned:  # the catalogue is known once training starts (its data's encoder)
            warned.append(True)
            _warn_small_catalogue(trainer.model)
            _warn_covered_classes(event.metrics)  # the evaluation rows are the same at every evaluation
        if (quiet and not event.final) or (event.final and shown and shown[-1] == event.step):
            return
        shown.append(event.step)
        title = "final evaluation" if event.final else "evaluation"
        note = ""
        if trainer.stopper is not None and not event.final:
            state = trainer.stopper.state
            note = (" (new best: saved to best/)" if event.best else
                    f" (best {trainer.stopper.watched} {number_cell(state.best)} at step {state.best_step})"
                    if state.best is not None else
                    f" ({trainer.stopper.watched} undefined, as for evaluation labels of one class: not counted by "
                    f"early stopping, no best yet)")
        _say(f"{title} at step {event.step}{note}")
        for line in metrics_table(event.metrics):
            _say("  " + line)
        for line in undefined_notes(event.metrics):
            if line not in noted and is_lead_rank():  # every evaluation of a run has the same rows
                noted.add(line)
                warn(line)
        if event.stop:
            _say(f"early stopping: {trainer.stopper.watched} did not improve in {trainer.stopper.patience} "
                 f"evaluations; the best (step {trainer.stopper.state.best_step}) is in best/")

    return Hooks(on_eval=on_eval)


def _warn_small_catalogue(model) -> None:
    """Warn when a retrieval head's top_k reaches its catalogue (hr@K is then 1.0 whatever the model)."""
    from flowrec.runtime.retrieval import small_catalogue

    if model.retrieval is not None:
        line = small_catalogue(model.retrieval, model.head_names[model.retrieval.head])
        if line is not None:
            warn(line)


def _warn_covered_classes(metrics: dict) -> None:
    """Warn when a multiclass head's k of accuracy@k reaches the classes its evaluation rows hold
    (accuracy_at_k is then 1.0 for any model that ranks the others last)."""
    from flowrec.runtime.evaluation.classes import top_k_covers_classes

    for line in top_k_covers_classes(metrics):
        warn(line)


def _parent_or_exit(settings: dict) -> dict | None:
    """The checkpoint of the --init-from run (None without one)."""
    from flowrec.runtime.checkpoint.store import CheckpointError, load_checkpoint

    if not settings.get("init_from"):
        return None
    try:
        return load_checkpoint(Path(settings["init_from"]))
    except CheckpointError as exc:
        fail(f"--init-from: {exc}")


def _start_from(trainer, parent: dict, settings: dict) -> None:
    """Load the parent run's parameters (and optimizer state) into the trainer, at step 0: an
    optimizer of the kind the parent's was keeps its state (with the spec's hyper-parameters), one
    of another kind starts fresh, said in a note."""
    from flowrec.runs.changes import recorded_spec
    from flowrec.runs.init_from import optimizer_kinds, starting_state

    old = recorded_spec(parent)
    dense_kind, sparse_kind = optimizer_kinds(old, trainer.spec) if old is not None else (False, set())
    own = trainer.optimizer.state_dict()
    fresh = own if settings["fresh_optimizer"] or dense_kind else None
    groups = {f"{g.name}." for g in trainer.plan.meta.groups if any(t.table in sparse_kind for t in g.tables)}
    model_state = trainer.model_state_like(initial_states=fresh is not None or bool(groups))
    if settings["fresh_optimizer"]:
        trainer.load_state(starting_state(parent, model_state, fresh), settings["init_from"])
    else:
        trainer.load_state(starting_state(parent, model_state, fresh, own,
                                          lambda key: any(f".{g}" in f".{key}" for g in groups)),
                           settings["init_from"])
    if old is not None and not settings["fresh_optimizer"] and (dense_kind or sparse_kind):
        kinds = ([f"the dense optimizer is {trainer.spec.dense_optimizer.name} in the spec, "
                  f"{old.dense_optimizer.name} in the run"] if dense_kind else []) + \
            ([_sparse_kinds(old, trainer.spec, sorted(sparse_kind))] if sparse_kind else [])
        _say(f"note: {'; '.join(kinds)}: its state starts fresh (the other optimizer state is the run's)")
    carried = "" if settings["fresh_optimizer"] else \
        " and optimizer state" if not (dense_kind or sparse_kind) else " and the optimizer state of the same kinds"
    _say(f"starting from {settings['init_from']} (parameters{carried}), at step 0")


def _parent_plan_settings(source: Path, settings: dict) -> dict:
    """The plan flags (--device-budget, --cache, --target, --profile) the run at `source` recorded,
    which a run started from it plans with (they are refused given with --init-from): settings'
    own where run.json is unreadable or records none, a profile file gone left out."""
    from flowrec.runs.settings import read_run_file
    from flowrec.runtime.rundir import run_folder_of

    try:
        recorded = read_run_file(run_folder_of(source)) or {}
    except Exception:  # a damaged run.json: planned as the flags say (none given)
        recorded = {}
    made = {key: recorded.get(key, settings.get(key)) for key in ("device_budget", "cache", "target", "profile")}
    if made["profile"] and not Path(made["profile"]).is_file():
        made["profile"] = None
    return made


def _sparse_kinds(old, new, tables: list[str]) -> str:
    """E.g. "the sparse optimizer of table 'user' is rowwise_adagrad in the spec, adagrad in the run"."""
    def kind(spec, name: str) -> str:
        table = next(t for t in spec.tables if t.name == name)
        return (table.optimizer or spec.sparse_optimizer).name

    return "; ".join(f"the sparse optimizer of table {t!r} is {kind(new, t)} in the spec, {kind(old, t)} in the run"
                     for t in tables)


def _init_from_plan_or_exit(parent: dict, settings: dict, spec, world, ranks: int, quiet: bool):
    """The plan a run started from `parent` trains: the parent's (the same model), or, for a spec
    that differs from the parent's in training settings alone (lr, optimizer kinds, dropout, batch
    size, precision: `flowrec.runs.init_from.training_view`), the spec's own plan, whose packed
    groups must be the parent's (the checkpoint's layout); anything else is refused in one line
    naming what differs."""
    from flowrec.graph.plan_io import model_fingerprint
    from flowrec.runs.changes import document_differences, listed, _model_doc
    from flowrec.runs.errors import RunError
    from flowrec.runs.init_from import group_differences, training_view
    from flowrec.runs.plan import plan_for_run
    from flowrec.runtime.progress import reading_bar
    from flowrec.serving.trained import stored_plan
    from flowrec.runtime.checkpoint.store import CheckpointError

    source = Path(settings["init_from"])
    # the run's class files where it finds them: a moved or copied file of the same content is the same model
    old, notes = _run_spec_class_files(parent, source, spec, world)
    if old is None or model_fingerprint(old) == model_fingerprint(spec) \
            or model_fingerprint(training_view(old, spec)) != model_fingerprint(old):
        return _for_ranks(_stored_plan_or_exit(parent, source, spec, True, world), spec, ranks)
    for line in notes:  # (`_stored_plan_or_exit` says them on its path)
        _say(f"note: {line}")
    made = _parent_plan_settings(source, settings)  # planned as the run was: its budget, cache, target, profile
    try:
        stored = stored_plan(parent, str(source / "checkpoint.pt"))
        plan, _ = plan_for_run(spec, settings["device"] or "auto", made["device_budget"], None, _say,
                               Path(made["profile"]) if made.get("profile") else None, made["target"],
                               settings["data"], ranks, settings.get("epochs"), settings.get("max_steps"),
                               reading_bar(not quiet and is_lead_rank()), cache=made["cache"])
    except (CheckpointError, RunError) as exc:
        _refuse(str(exc), world)
    moved = group_differences(stored, plan)
    if moved:
        _refuse(f"the spec's model differs from the one the run in {source} was trained with: its training "
                f"settings pack the tables otherwise, and the checkpoint's layout is the run's: {listed(moved)} "
                f"(compare the spec with {source}/spec.json)", world)
    changed = document_differences(_model_doc(old), _model_doc(spec))
    _say(f"note: the spec's training settings differ from the run's, its weights' layout is the run's: "
         f"{listed(changed)}")
    return plan


def _stored_plan_or_exit(state: dict, folder: Path, spec, starting_from: bool = False, world=None):
    """The plan a run was trained with (its checkpoint's), checked against the spec's model
    (`flowrec.runs.resume.stored_run_plan`); a changed model is refused in one line naming the managed
    settings that differ. `starting_from`: the run is --init-from's, not --resume's."""
    from flowrec.runs.errors import RunError
    from flowrec.runs.resume import stored_run_plan

    try:
        return stored_run_plan(state, folder, spec, starting_from, note=lambda line: _say(f"note: {line}"))
    except RunError as exc:
        _refuse(str(exc), world)


def _spec_matches_run(state: dict, folder: Path, spec, world=None) -> bool:
    """`flowrec.runs.resume.spec_matches_run`, a class file that is not the run's refused in one line."""
    from flowrec.runs.errors import RunError
    from flowrec.runs.resume import spec_matches_run

    try:
        return spec_matches_run(state, folder, spec)
    except RunError as exc:
        _refuse(str(exc), world)


def _run_spec_class_files(state: dict, folder: Path, spec, world=None) -> tuple[Any, list[str]]:
    """`flowrec.runs.resume.run_spec_class_files`, a class file that is not the run's refused in one line."""
    from flowrec.runs.errors import RunError
    from flowrec.runs.resume import run_spec_class_files

    try:
        return run_spec_class_files(state, folder, spec)
    except RunError as exc:
        _refuse(str(exc), world)


def _say_finished(request: RunRequest, folder: Path, position, epochs: int, settings: dict, stopper=None) -> None:
    """A resumed run at its end: its line (`_finished_line`) and, with --json, its document on stdout
    (a script reading it got nothing): the run folder, its step and epoch, `finished: true`, the line."""
    from flowrec.runs.resume import finished_line

    line = finished_line(folder, position, epochs, settings, stopper)
    _say(line)
    if request.json_out and is_lead_rank():
        _print_json({"run_dir": str(folder), "finished": True, "steps": position.step, "epoch": position.epoch,
                     "trained_steps": 0, "message": line}, request.json_lines)


def _print_json(doc: dict, json_lines: bool) -> None:
    """A run's JSON document on stdout: indented, or on one line (`json_lines`: a --follow stream's
    days, a JSON Lines stream, where indented documents one after the other were no JSON a reader
    could load)."""
    output_stream().write(json.dumps(doc, indent=None if json_lines else 2, sort_keys=True, default=str) + "\n")


def _said_finished(request: RunRequest, folder: Path, state: dict, spec, plan, settings: dict) -> bool:
    """Say a resumed run is finished where its checkpoint shows it (`flowrec.runs.resume.finished_from_checkpoint`),
    as the loaded run says it: reading its data, building its model and loading its tables took 45-54 s on
    dlrm_criteo. False where the run must be loaded to tell (a checkpoint that does not fit says so there)."""
    from flowrec.runs.resume import finished_from_checkpoint

    done = finished_from_checkpoint(state, spec, plan, settings, folder)
    if done is None:
        return False
    _say_finished(request, folder, done.position, done.epochs, settings, done.stopper)
    return True


def _listing(folder: Path) -> list[str]:
    """What a run folder holds, for the closing line: its files and folders (folders with a /),
    not its hidden ones (the lock, temporary writes)."""
    try:
        return sorted(p.name + ("/" if p.is_dir() else "") for p in folder.iterdir() if not p.name.startswith("."))
    except OSError:
        return []


def _report(result, run_dir: Path, json_out: bool, json_lines: bool = False, first_step: int = 0) -> None:
    """The closing lines of a run, and with `json_out` its result as JSON on stdout (`_print_json`,
    on one line with `json_lines`). `first_step`: the step a
    resumed run went on from (its samples and seconds are those of the steps after it)."""
    from dataclasses import asdict

    steps = f"steps {result.steps}"
    if first_step:  # the run's step count, where samples and seconds are this session's
        steps += f" ({result.steps - first_step:,} since the resume at step {first_step:,})"
    lines = [f"{steps}, {result.samples:,} samples in {result.seconds:.1f} s "
             f"({result.samples_per_s:,.0f} samples/s)"]
    if result.stopped_early:
        lines.append(f"stopped early at step {result.steps}; best checkpoint (step {result.best_step}): "
                     f"{run_dir / 'best'}")
    elif result.stop_requested:
        lines.append(f"stopped at step {result.steps} on request")
    from flowrec.planner.report import managed_lines

    lines += managed_lines(result.managed)
    lines.append(f"run folder: {run_dir} ({', '.join(_listing(run_dir))})")
    for line in lines:
        _say(line)
    if result.skipped_batches and is_lead_rank():  # the updates the model lacks: never in silence
        warn(f"{result.skipped_batches:,} of {result.steps:,} batches had a non-finite loss and were skipped "
             f"(--nan-policy skip-batch): the model learned from the other {result.steps - result.skipped_batches:,} "
             f"only (metrics.jsonl marks the skipped steps)")
    if result.skipped_rows and is_lead_rank():  # batches a custom module cannot train on (batch norm of one row)
        warn(f"custom module {'; '.join(result.one_row_refusers)}: {result.skipped_rows:,} "
             f"of {result.samples:,} rows were skipped, in batches that gave it one row (an epoch's or a day's last "
             "batch, a rank's share under --nproc; metrics.jsonl marks the skipped steps)")
    if json_out:
        from flowrec.runtime.run_log import jsonable

        # an undefined metric (NaN: the AUC of labels all 0) as null, as eval --json writes it: NaN is no JSON
        _print_json(jsonable({**asdict(result), "run_dir": str(run_dir)}), json_lines)


def evaluate_run(
    run_dir: Path = typer.Argument(..., metavar="RUN", help="Run folder (with checkpoint.pt) or a checkpoint file."),
    data: Optional[Path] = typer.Option(None, "--data", help="Encoded dataset folder to score. Default: the data the run evaluated on (its --eval-data, else the test part of its split dataset; a run on synthetic rows: its evaluation rows, drawn again from its seed)."),
    device: str = typer.Option("auto", "--device", help="auto, cpu or cuda."),
    group_by: Optional[str] = typer.Option(None, "--group-by", help="A one-id categorical feature (e.g. user_id): also report gAUC, the AUC of each of its values weighted by its samples. Default: the spec's training.eval_group_by."),
    json_out: Optional[str] = typer.Option(None, "--json", help="Also write the metrics as JSON to this file ('-': stdout, instead of the table)."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No table on stdout (with --json FILE: only the file)."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace the --json FILE when it holds metrics an earlier eval wrote (never another file, nor one of a run, package or dataset)."),
    seen: Optional[Path] = typer.Option(None, "--seen", help="Retrieval heads with exclude_seen: the training dataset whose (user, item) pairs are left out of each user's ranking. Default: the run's training data."),
) -> None:
    """Score a trained checkpoint on a dataset.

    Exact, per head: AUC, PR-AUC (average precision), logloss, NE (logloss over the entropy of the
    label mean), calibration (mean prediction over mean label) and, with --group-by, gAUC for binary
    heads; MSE and MAE for regression heads; hr@K, recall@K, ndcg@K and mrr over the whole item
    catalogue for retrieval heads.

    \b
    Examples:
      flowrec eval runs/exp1
      flowrec eval runs/exp1 --data data/criteo_test/
      flowrec eval runs/ml --data runs/ml/data/test --group-by user_id --json m.json
      flowrec eval runs/ml/best --data runs/ml/data/test --json -
    """
    from flowrec.runtime.session import device_problem

    if device_problem(device) is not None:  # before the run is read (torch's words otherwise)
        fail(f"--device {device_problem(device)}")
    from flowrec.cli.streams import refuse_stream_folder

    refuse_stream_folder(run_dir, "eval")
    with terminated_as_interrupted():  # SIGTERM as Ctrl-C: one line, exit 130, no --json temp file left
        _evaluate_run(run_dir, data, device, group_by, json_out, quiet, overwrite, seen)


def _evaluate_run(run_dir: Path, data: Optional[Path], device: str, group_by: Optional[str],
                  json_out: Optional[str], quiet: bool, overwrite: bool, seen: Optional[Path]) -> None:
    """`flowrec eval` once its paths are checked."""
    from flowrec.data.layout import DataError
    from flowrec.data.output_guard import check_file_output
    from flowrec.data.parquet_folder import unread_lines
    from flowrec.planner.contract import scoring_plan
    from flowrec.runs.recorded import (eval_data_to_score, group_by_problem, recorded_train_data, split_since,
                                       synthetic_rows)
    from flowrec.serving.trained import load_trained, missing_encoder
    from operators.custom import custom_failure

    with stdout_reserved(json_out == "-"):  # the JSON alone on stdout: a custom module's prints to stderr
        try:
            if json_out not in (None, "-"):  # before the run's checkpoint is read (GiB of tables digested)
                check_file_output(Path(json_out), [run_dir] + ([data] if data is not None else []), overwrite)
                refuse_replacing_other_than_metrics(Path(json_out))
            if group_by is not None and (line := group_by_problem(run_dir, group_by)) is not None:
                raise ValueError(line)  # from the run's spec.json, before its checkpoint is read
            trained = load_trained(run_dir, device, scoring_plan)
            for line in trained.notes:
                say(f"note: {line}", err=True)
            if (line := missing_encoder(run_dir, trained)) is not None:
                warn(line)
            _warn_small_catalogue(trained.model)
            drawn = synthetic_rows(run_dir, trained.spec) if data is None else None
            if data is None and drawn is None:
                data = eval_data_to_score(run_dir)
                if (line := split_since(run_dir)) is not None:
                    warn(line)
                if not quiet:
                    _say(f"scoring {data} (the data {run_dir} evaluated on; --data scores another)")
                if json_out not in (None, "-"):  # the output checked again against the data the run names
                    check_file_output(Path(json_out), [run_dir, data], overwrite)
            for line in unread_lines(Path(data), raw=False) if data is not None else ():  # a job still writing
                warn(line)
            if seen is not None and not trained.excludes_seen:
                raise ValueError(f"--seen applies to a retrieval head with exclude_seen: true; {run_dir} has none "
                                 "(its evaluation leaves nothing out)")
            grouping = group_by or trained.spec.training.eval_group_by
            if drawn is not None:  # a run on synthetic rows: the evaluation rows it drew, drawn again
                from flowrec.runtime.session import synthetic_eval_rows

                if not quiet:
                    _say(f"scoring the {synthetic_eval_rows(drawn):,} synthetic evaluation rows {run_dir} evaluated on "
                         f"(drawn again from seed {trained.spec.training.seed}; --data scores another dataset)")
                metrics = trained.evaluate_drawn(drawn, grouping, seen)
            else:
                if seen is None and trained.excludes_seen:  # run.json read only for such a head: a damaged one
                    seen = recorded_train_data(run_dir)  # refused eval --data of any run ('cannot be resumed')
                metrics = trained.evaluate_dataset(data, grouping, seen, warn)  # ids written otherwise: warned
        except (DataError, OSError, ValueError, RuntimeError) as exc:
            fail(custom_failure(exc) or first_line(exc))
        except KeyboardInterrupt as exc:
            fail(f"interrupted ({interrupt_name(exc)})", EXIT_INTERRUPTED)
        except Exception as exc:  # a user's custom module may raise anything while scoring
            if custom_failure(exc) is None:
                raise
            fail(custom_failure(exc))
    _warn_covered_classes(metrics)
    try:
        _write_metrics(metrics, json_out, quiet, overwrite)
    except KeyboardInterrupt as exc:
        written = f"; {json_out} was not written" if json_out not in (None, "-") else ""
        fail(f"interrupted ({interrupt_name(exc)}){written}", EXIT_INTERRUPTED)


EVAL_JSON_LIMIT = 1 << 24  # bytes of an existing --json file read to tell a previous eval's metrics (16 MiB)


def refuse_replacing_other_than_metrics(out: Path) -> None:
    """Raise ValueError (one line) when `--json OUT --overwrite` would replace an existing file
    that is not metrics `flowrec eval --json` wrote (an empty file is replaced): eval reads
    neither the spec nor the raw files its data was converted from, so the output guard did not
    know them, and --overwrite replaced s.yaml or the training CSV with metrics."""
    from flowrec.data.output_guard import check_replacing_own_output, holds_json
    from flowrec.spec.read import is_eval_metrics

    check_replacing_own_output(out, lambda path: holds_json(path, is_eval_metrics, EVAL_JSON_LIMIT),
                               "metrics `flowrec eval --json` wrote")


def _write_metrics(metrics: dict, json_out: Optional[str], quiet: bool = False, overwrite: bool = False) -> None:
    """The table on stdout, and the JSON (NaN as null) to a file or, for '-', stdout instead (a file
    another process wrote since the command checked it replaced only with `overwrite`)."""
    from flowrec.cli.metrics_table import metrics_table
    from flowrec.runtime.evaluation.undefined import undefined_notes
    from flowrec.runtime.run_log import jsonable

    text = json.dumps(jsonable(metrics), indent=2, sort_keys=True) + "\n"
    if json_out == "-":
        sys.stdout.write(text)
    for line in [] if quiet or json_out == "-" else metrics_table(metrics):
        typer.echo(line)
    for line in undefined_notes(metrics):  # a '-' (or a null, on stderr beside --json -) of one class of labels
        warn(line)
    if json_out == "-":
        return
    if json_out is not None:
        from flowrec.data.output_guard import OutputError, atomic_output

        try:
            with atomic_output(Path(json_out), overwrite, lambda line: say(line, err=True)) as tmp:
                tmp.write_text(text, encoding="utf-8")
        except OutputError as exc:
            fail(str(exc))
        except OSError as exc:
            fail(f"cannot write {json_out}: {exc.strerror or exc}")



def register(app: typer.Typer) -> None:
    app.command("train")(train)
    app.command("eval")(evaluate_run)
