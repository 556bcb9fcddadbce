"""Embedding modules by placement: where a packed group's table lives and how it is looked up.

`device`: the packed table on the compute device. `host`: the packed table in host memory
(pinned where CUDA is present); lookups gather on the host, the pooled rows travel to the device
and their gradients come back for the fused update on the host (the CPU-GPU hybrid baseline).

Example:
    >>> module = group_embedding(group, seed=0, device=torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import torch
from torch import nn

from flowrec.graph.types import PackedGroup
from operators.embedding import PackedEmbeddingBag


def table_device(group: PackedGroup, device: torch.device) -> torch.device:
    """Where a group's packed table lives: host placement keeps it in host memory."""
    return torch.device("cpu") if group.placement == "host" else device


def group_embedding(group: PackedGroup, seed: int, device: torch.device) -> nn.Module:
    """The embedding module of one packed group for its placement.

    Raises:
        ValueError: for a placement this runtime cannot run.
    """
    if group.placement not in ("device", "host"):
        raise ValueError(f"group {group.name}: placement {group.placement!r} is not supported by this runtime")
    module = PackedEmbeddingBag(group, seed=seed, device=table_device(group, device))
    if group.placement == "host" and device.type == "cuda":
        module.weight = module.weight.pin_memory()
    return module
