"""The CPU cores this process may use: its affinity mask, capped by its cgroup's CPU quota.

`os.cpu_count()` counts the machine's cores, not the ones a process may run on: under `taskset`,
a container's cpuset or a CPU quota (`docker --cpus 1.5`, Kubernetes limits, systemd CPUQuota) a
pool sized by it oversubscribes the cores the process really gets, and every parallel region then
waits for threads that are not running. `usable_cores` is what data staging, the reader threads
and the compute threads are sized by (`thread_budget`).

- affinity: `os.sched_getaffinity(0)` (where the platform has it; else `os.cpu_count()`).
- cgroup v2: `cpu.max` ("QUOTA PERIOD" or "max PERIOD") of the process's cgroup (from
  `/proc/self/cgroup`, the line `0::/path`) and of every parent up to the root; the tightest wins.
- cgroup v1: `cpu.cfs_quota_us` / `cpu.cfs_period_us` of the `cpu` controller's cgroup (-1: none),
  and of its parents.

A quota of 1.5 cores gives 1 (whole cores, at least one): a thread per core of quota.

Example:
    >>> usable_cores()  # doctest: +SKIP
    2
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")
DEFAULT_WORKERS = 2  # packing threads of the data stage on a machine with room for them
DEFAULT_READERS = 2  # Parquet reader threads


def allowed_cpus() -> set[int]:
    """The CPUs this process may run on: its affinity mask (every CPU where the platform has none)."""
    if hasattr(os, "sched_getaffinity"):
        return set(os.sched_getaffinity(0))
    return set(range(os.cpu_count() or 1))


def usable_cores(affinity: set[int] | None = None, cgroup_root: Path = CGROUP_ROOT,
                 proc_cgroup: Path = PROC_CGROUP) -> int:
    """Whole cores this process may use: its affinity, capped by its cgroup CPU quota (>= 1).

    Args:
        affinity: the CPUs the process may run on (default: `os.sched_getaffinity(0)`).
        cgroup_root: where the cgroup file systems are mounted.
        proc_cgroup: the process's cgroup membership file.
    """
    if affinity is None:
        affinity = allowed_cpus()
    cores = max(1, len(affinity))
    quota = cgroup_quota(cgroup_root, proc_cgroup)
    if quota is not None:
        cores = min(cores, max(1, math.floor(quota)))
    return cores


def cgroup_quota(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """CPU cores the process's cgroups allow (the tightest of its cgroup and its parents), or None."""
    found = cgroup_folders("cpu", cgroup_root, proc_cgroup)
    if found is None:
        return None
    v2, v1 = found
    quotas = [_v2_quota(f) for f in v2] + [_v1_quota(f) for f in v1]
    known = [q for q in quotas if q is not None]
    return min(known) if known else None


def cgroup_folders(controller: str, cgroup_root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP,
                   ) -> tuple[list[Path], list[Path]] | None:
    """(cgroup v2 folders, cgroup v1 folders of `controller`) of this process's cgroup and each of
    its parents, from `/proc/self/cgroup`; None when that cannot be read."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except (OSError, ValueError):  # ValueError: bytes that are not text (UnicodeDecodeError)
        return None
    v2: list[Path] = []
    v1: list[Path] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # cgroup v2: 0::/path
            v2 += _folders(cgroup_root, path)
        elif controller in controllers.split(","):  # cgroup v1: N:cpu,cpuacct:/path
            mount = cgroup_root / controllers
            if not mount.is_dir():
                mount = cgroup_root / controller
            v1 += _folders(mount, path)
    return v2, v1


def _folders(root: Path, path: str) -> list[Path]:
    """The cgroup folder of `path` under `root` and each of its parents up to `root`."""
    parts = [p for p in path.strip().split("/") if p and p != ".."]
    return [root.joinpath(*parts[:n]) for n in range(len(parts), -1, -1)]


def _v2_quota(folder: Path) -> float | None:
    try:
        fields = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    if len(fields) != 2 or fields[0] == "max":
        return None
    return _ratio(fields[0], fields[1])


def _v1_quota(folder: Path) -> float | None:
    try:
        quota = (folder / "cpu.cfs_quota_us").read_text().strip()
        period = (folder / "cpu.cfs_period_us").read_text().strip()
    except (OSError, ValueError):
        return None
    return _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        q, p = int(quota), int(period)
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


@dataclass(frozen=True)
class ThreadBudget:
    """Threads sized to the usable cores.

    Args:
        cores: usable cores (`usable_cores`).
        workers: data packing threads (`StagingOptions.workers`).
        readers: Parquet reader threads (`ParquetSource(threads=)`).
        compute: torch / numba threads for the step.
    """

    cores: int
    workers: int
    readers: int
    compute: int


def local_ranks() -> int:
    """Ranks of this job on this machine (LOCAL_WORLD_SIZE of a `--nproc` launch; 1 otherwise)."""
    text = os.environ.get("LOCAL_WORLD_SIZE", "1")
    return int(text) if text.isdigit() and int(text) > 0 else 1


def thread_budget(cores: int | None = None, ranks: int | None = None) -> ThreadBudget:
    """Threads for one of `ranks` processes (default: `local_ranks()`) sharing `cores` (default:
    `usable_cores()`).

    The compute threads get the rank's share of the cores; the data threads (mostly waiting on
    reads, or in numpy with the GIL released for short spans) at most that share and at most
    their defaults, so a process on one core runs one of each instead of oversubscribing it.

    Example:
        >>> thread_budget(1)
        ThreadBudget(cores=1, workers=1, readers=1, compute=1)
    """
    cores = usable_cores() if cores is None else max(1, int(cores))
    share = max(1, cores // max(1, local_ranks() if ranks is None else ranks))
    return ThreadBudget(cores, min(DEFAULT_WORKERS, share), min(DEFAULT_READERS, share), share)


def run_threads() -> int:
    """The compute threads of a run in this process: OMP_NUM_THREADS where set (by the user, or by
    torchrun for its ranks), else the process's share of the usable cores (`thread_budget`).
    `flowrec train` sizes torch's threads so (`flowrec.cli.ranks.share_cores`), and calibration
    measures on as many."""
    given = os.environ.get("OMP_NUM_THREADS", "").strip()
    return int(given) if given.isdigit() and int(given) > 0 else thread_budget().compute
