"""The host memory this process can still take: what a run may allocate before the kernel's
OOM killer or the container's limit stops it.

- `/proc/meminfo` MemAvailable (the kernel's estimate of memory available without swapping:
  free memory plus reclaimable page cache), not MemTotal: memory other processes hold is gone.
- capped by the process's memory cgroup and each parent up to the root: v2 `memory.max` minus
  `memory.current`, v1 `memory.limit_in_bytes` minus `memory.usage_in_bytes` (a container's limit
  is reached long before the machine's memory runs out), plus the cgroup's inactive file pages
  (`memory.stat` `inactive_file`, v1 `total_inactive_file`): the usage counts the page cache of
  every file the cgroup read or wrote, which the kernel reclaims before it refuses memory (the
  working set of docker stats and the kubelet), so a container that just converted a dataset is
  not taken for full. A limit that is not a number >= 0 says nothing.

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
                kib = int(line.split()[1])
                return kib * 1024 if kib >= 0 else None  # kB; a negative count says nothing
    except (OSError, ValueError, IndexError):
        return None
    return None


def _cgroup_room(cgroup_root: Path, proc_cgroup: Path) -> list[int | None]:
    """Limit minus usage of every memory cgroup of this process (v2 and v1)."""
    found = cgroup_folders("memory", cgroup_root, proc_cgroup)
    if found is None:
        return []
    v2, v1 = found
    return ([_room(f / "memory.max", f / "memory.current", "inactive_file") for f in v2]
            + [_room(f / "memory.limit_in_bytes", f / "memory.usage_in_bytes", "total_inactive_file") for f in v1])


UNLIMITED = 1 << 60  # cgroup v1 writes "no limit" as a page-rounded 2^63 - 1


def _room(limit_file: Path, usage_file: Path, reclaimable: str) -> int | None:
    """Limit minus usage of one cgroup, plus its `reclaimable` page cache (a `memory.stat` field
    of the same folder; 0 when unreadable); None without a limit or with one that is no count."""
    try:
        limit, usage = limit_file.read_text().strip(), usage_file.read_text().strip()
        if limit == "max" or int(limit) >= UNLIMITED or int(limit) < 0:
            return None
        used = int(usage)
    except (OSError, ValueError):
        return None
    return int(limit) - used + min(max(0, used), _stat_field(limit_file.parent / "memory.stat", reclaimable))


def _stat_field(stat: Path, name: str) -> int:
    """A byte count of a cgroup's `memory.stat` (``name value`` lines), 0 when absent or unreadable."""
    try:
        for line in stat.read_text().splitlines():
            fields = line.split()
            if len(fields) == 2 and fields[0] == name:
                return max(0, int(fields[1]))
    except (OSError, ValueError):
        return 0
    return 0
