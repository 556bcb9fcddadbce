"""Row ownership of a row-wise sharded packed table, and the embedding process group.

Packed row R of a row-wise group lives on rank R mod W at local row R div W: a pure function of
the world size W, so every table of the group spreads over all ranks and uneven counts are fine.

Example:
    >>> local_row_count(10, 3, 0), local_row_count(10, 3, 2)
    (4, 3)
    >>> owned_rows(10, 3, 1).tolist()
    [1, 4, 7]
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist


def local_row_count(rows: int, world_size: int, rank: int) -> int:
    """Rows of a `rows`-row packed table that `rank` owns."""
    return len(range(rank, rows, world_size))


def owned_rows(rows: int, world_size: int, rank: int) -> torch.Tensor:
    """Packed ids of the rows `rank` owns, in local-row order.  # (local_rows,) int64"""
    return torch.arange(rank, max(rank, rows), world_size, dtype=torch.int64)  # empty when rank >= rows


def owner_of(packed: torch.Tensor, world_size: int) -> torch.Tensor:
    """Owning rank of each packed row.  # like packed, int64"""
    return torch.remainder(packed, world_size)


def local_index(packed: torch.Tensor, world_size: int) -> torch.Tensor:
    """Local row of each packed row on its owner.  # like packed, int64"""
    return torch.div(packed, world_size, rounding_mode="floor")


def embedding_group(timeout_s: float) -> dist.ProcessGroup:
    """A process group of every rank for the embedding exchanges, with its own timeout.

    Its collectives never interleave with those of the default group (where DDP's bucket
    all-reduces run). Every rank must call it, in the same order as its other `new_group` calls.

    Args:
        timeout_s: seconds after which a collective waiting for a dead or hung rank fails.
    """
    return dist.new_group(backend=dist.get_backend(), timeout=timedelta(seconds=timeout_s))
