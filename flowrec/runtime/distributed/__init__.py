"""Scale-out runtime on torch.distributed: sharded and replicated packed embeddings.

A plan's `row_wise` group runs as a `ShardedPackedEmbedding` (packed row R on rank R mod W), a
`replicated` group as a `ReplicatedPackedEmbedding` (several row-wise groups together, their
exchanges overlapped: `ShardedLookups`); both take this rank's slice of the global
batch and give the single-process output of those samples. Their collectives run on the
process group given to them (`embedding_group`: its own timeout, apart from DDP's group).

Example:
    >>> from flowrec.runtime.distributed import local_row_count
    >>> local_row_count(7, 2, 1)
    3
"""
from __future__ import annotations

from flowrec.runtime.distributed.groups import (embedding_group, local_index, local_row_count,
                                                owned_rows, owner_of)
from flowrec.runtime.distributed.replicated import ReplicatedPackedEmbedding
from flowrec.runtime.distributed.schedule import ShardedLookups, lookup_groups
from flowrec.runtime.distributed.sharded import Route, ShardedPackedEmbedding

__all__ = ["ReplicatedPackedEmbedding", "Route", "ShardedLookups", "ShardedPackedEmbedding",
           "embedding_group", "local_index", "local_row_count", "lookup_groups", "owned_rows", "owner_of"]
