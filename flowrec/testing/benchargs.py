"""The options the benchmarks that time one spec's steps share (`tools/bench_host_noise.py`,
`tools/bench_calibration_noise.py`): the spec, the compute threads and the plan's device budget,
and the threads applied as `tools/bench_costmodel.py --threads` applies them; and what the
start-up benchmarks share (`tools/bench_startup.py`, `tools/bench_startup_sample.py`): a
temporary folder for the run and the spec of `--spec` / `--quick`; and how every benchmark that
makes temporary folders or child processes runs its `main` (`run_stoppable`).

Example:
    >>> import argparse
    >>> parser = argparse.ArgumentParser()
    >>> add_spec_step_arguments(parser, "spec whose step is timed")
    >>> args = parser.parse_args(["--device-budget", "none"])
    >>> args.spec.name, args.threads, device_budget(args)
    ('movielens.yaml', 1, None)
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
THREAD_VARIABLES = ("OMP_NUM_THREADS", "NUMBA_NUM_THREADS")  # as bench_costmodel's --threads sets them


def add_spec_step_arguments(parser: argparse.ArgumentParser, spec_help: str) -> None:
    """--spec (default specs/movielens.yaml, a ~10 ms step), --threads (default 1) and
    --device-budget (default 64MiB; "none": no cap)."""
    parser.add_argument("--spec", type=Path, default=REPO / "specs/movielens.yaml",
                        help=f"{spec_help} (default: specs/movielens.yaml, a ~10 ms step)")
    parser.add_argument("--threads", type=int, default=1,
                        help="compute threads (default 1, as bench_costmodel's --threads 1)")
    parser.add_argument("--device-budget", default="64MiB", help="the plan's device budget (default 64MiB; none: no cap)")


def device_budget(args: argparse.Namespace) -> str | None:
    """The plan's device budget of `args`: None for "none" (no cap)."""
    return None if args.device_budget == "none" else args.device_budget


def use_threads(threads: int) -> None:
    """Compute on `threads` threads: the environment variables for the processes and libraries
    that read them, and torch's own count in this process."""
    for name in THREAD_VARIABLES:
        os.environ[name] = str(threads)
    import torch

    torch.set_num_threads(threads)


def in_temp_folder(run: Callable[[Path], T], prefix: str) -> T:
    """`run(folder)` in a new temporary folder, removed afterwards, with torch's inductor cache and
    dask's temporary files inside it (where the environment names none)."""
    tmp = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(tmp / "inductor"))
        os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(tmp / "dask"))
        return run(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def bench_spec(path: str | None, quick: dict[str, Any] | None, default: str = "specs/dlrm_criteo.yaml") -> Any:
    """The spec a benchmark runs: `quick` (a built-in spec document, for --quick) where no file is
    given, else the file `path` (default `default`, in this repository). A spec that cannot be
    loaded ends the process with the loader's message (it names the file and the problem)."""
    from flowrec.spec import load_spec, spec_from_dict

    try:
        return spec_from_dict(quick) if quick is not None and path is None else load_spec(path or REPO / default)
    except Exception as exc:  # the loader's own errors name the file and the problem
        sys.exit(f"error: {exc}")


def add_start_arguments(parser: argparse.ArgumentParser, rows_default: str) -> None:
    """--spec, --rows, --rounds and --json of a start-up benchmark (`rows_default`: the help's
    default synthetic rows, e.g. "1,000,000")."""
    parser.add_argument("--spec", default=None, help="spec file (default specs/dlrm_criteo.yaml; quick: a small built-in one)")
    parser.add_argument("--rows", type=int, default=None, help=f"synthetic rows (default {rows_default}; quick 30,000)")
    parser.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    parser.add_argument("--json", default=None, help="write the figures to this JSON file")


def refuse_below_one(parser: argparse.ArgumentParser, args: argparse.Namespace, *names: str) -> None:
    """A usage error (exit 2) for each option of `names` given below 1 (--rows-per-file for
    "rows_per_file")."""
    for name in names:
        value = getattr(args, name)
        if value is not None and value < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def run_stoppable(main: Callable[[], T]) -> T:
    """`main()` with SIGTERM and SIGHUP raised as Ctrl-C is (`flowrec.runtime.signals`), so that a
    benchmark stopped by `kill`, `timeout` or a closed terminal unwinds as a Ctrl-C does: its child
    processes' trees killed (`flowrec.testing.processes.run_tree`), its temporary folders removed
    (their `with` blocks and `finally` clauses run), one line on stderr and exit 130. Python's
    default for SIGTERM ended the process at once: a stopped `tools/bench_costmodel.py` left its
    synthetic data and runs behind (16 GiB, which filled the disk of a later run) and its
    `flowrec train` child running."""
    from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted

    try:
        with terminated_as_interrupted():
            return main()
    except KeyboardInterrupt as exc:
        print(f"{Path(sys.argv[0]).name}: stopped ({interrupt_name(exc)}): its child processes were stopped "
              f"and its temporary folders removed; nothing was written", file=sys.stderr)
        raise SystemExit(130) from None
