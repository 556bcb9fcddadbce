"""The options the benchmarks that time one spec's steps share (`tools/bench_host_noise.py`,
`tools/bench_calibration_noise.py`): the spec, the compute threads and the plan's device budget,
and the threads applied as `tools/bench_costmodel.py --threads` applies them.

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
from pathlib import Path

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
