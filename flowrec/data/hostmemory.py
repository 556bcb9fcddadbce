"""The host memory this process can still take: what a run may allocate before the kernel's
OOM killer or the container's limit stops it.

- `/proc/meminfo` MemAvailable (the kernel's estimate of memory available without swapping:
  free memory plus reclaimable page cache), not MemTotal: memory other processes hold is gone.
- capped by the process's memory cgroup and each parent up to the root: v2 `memory.max` minus
  `memory.current`, v1 `memory.limit_in_bytes` minus `memory.usage_in_bytes` (a container's limit
  is reached long before the machine's memory runs out).

Example:
    >>> available_memory_bytes()  # doctest: +SKIP
    23622320128
"""
from __future__ import annotations

from pathlib import Path

from flowrec.data.cores import CGROUP_ROOT, PROC_CGROUP, cgroup_folders

MEMINFO = Path("/proc/meminfo")


def available_memory_bytes(meminfo: Path = MEMINFO, cgroup_root: Path = CGROUP_ROOT,
                           proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """Bytes this process can still allocate (see the module docstring), or None where the
    platform says nothing (no /proc)."""
    known = [b for b in (_mem_available(meminfo), *_cgroup_room(cgroup_root, proc_cgroup)) if b is not None]
    return max(0, min(known)) if known else None


def _mem_available(meminfo: Path) -> int | None:
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024  # kB
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(cgroup_root: Path, proc_cgroup: Path) -> list[int | None]:
    """Limit minus usage of every memory cgroup of this process (v2 and v1)."""
    found = cgroup_folders("memory", cgroup_root, proc_cgroup)
    if found is None:
        return []
    v2, v1 = found
    return ([_room(f / "memory.max", f / "memory.current") for f in v2]
            + [_room(f / "memory.limit_in_bytes", f / "memory.usage_in_bytes") for f in v1])


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def _room(limit_file: Path, usage_file: Path) -> int | None:
    try:
        limit, usage = limit_file.read_text().strip(), usage_file.read_text().strip()
        if limit == "max" or int(limit) >= UNLIMITED:
            return None
        return int(limit) - int(usage)
    except (OSError, ValueError):
        return None
