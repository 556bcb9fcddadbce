"""Embedding modules by placement: where a packed group's table lives and how it is looked up.

`device`: the packed table on the compute device. `host`: the packed table in host memory
(pinned where CUDA is present); lookups gather on the host, the pooled rows travel to the device
and their gradients come back for the fused update on the host (the CPU-GPU hybrid baseline).
`static_hot` (FAE) and `lookahead` (ScratchPipe) keep a host master table and some rows on the
device (`flowrec.runtime.caches`). Every placement but `device` keeps traffic counters.

Example:
    >>> module = group_embedding(group, seed=0, device=torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import torch
from torch import nn

from flowrec.graph.kinds import PLACEMENTS
from flowrec.graph.types import PackedGroup
from flowrec.runtime.caches import CACHE_MODULES
from operators.embedding import PackedEmbeddingBag

HOST_SIDE = frozenset(name for name, info in PLACEMENTS.items() if info.host_side)  # ids stay on the host


def table_device(group: PackedGroup, device: torch.device) -> torch.device:
    """Where a group's packed (master) table lives: every placement but device keeps it on the host."""
    return torch.device("cpu") if group.placement in HOST_SIDE else device


def group_embedding(group: PackedGroup, seed: int, device: torch.device) -> nn.Module:
    """The embedding module of one packed group for its placement.

    Raises:
        ValueError: for a placement this runtime cannot run.
    """
    if group.placement not in PLACEMENTS:
        raise ValueError(f"group {group.name}: placement {group.placement!r} is not supported by this "
                         f"runtime (known: {', '.join(PLACEMENTS)})")
    if group.placement == "device":
        return PackedEmbeddingBag(group, seed=seed, device=device)
    return CACHE_MODULES[group.placement](group, seed, torch.device(device))
