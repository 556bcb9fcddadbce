"""Communication of a sharded plan: interconnect constants per target and the bytes and time one
rank exchanges per step.

Per packed group and rank, with W ranks and a global batch of B samples (each rank trains B / W):

* ``row_wise``: the rank sends the ids of its U distinct rows to their owners (a share (W-1)/W lives
  elsewhere), serves as many rows to the others (by symmetry) and sends the row gradients back:
  ``U * (W-1)/W * (8 + D * elem + D * 4)`` bytes, four all-to-alls (counts, ids, rows, gradients).
  Deduplication is why this beats sending every id out and pooled partial embeddings back
  (TorchRec's row-wise sharding), most of all on skewed ids.
* ``replicated``: every rank holds every row and all-reduces the group's row gradients:
  ``2 (W-1)/W * rows * D * 4`` bytes (ring all-reduce), one collective.
* dense parameters (DistributedDataParallel): ``2 (W-1)/W * dense bytes``, one all-reduce per
  ~25 MiB bucket.

Interconnects (one direction, per rank, achieved): sources in `INTERCONNECTS`. Up to
`GPUS_PER_NODE` ranks talk over the node's NVLink; beyond that the all-to-alls cross nodes and the
per-GPU InfiniBand port bounds them.

Example:
    >>> link_for("h100", 8).name, link_for("h100", 64).name
    ('NVLink 4 (H100 SXM5, NVSwitch)', 'InfiniBand NDR 400 Gb/s, one port per GPU')
"""
from __future__ import annotations

from dataclasses import dataclass

from flowrec.graph.types import DTYPE_BYTES, PackedGroup

INDEX_BYTES = 8  # int64 ids
GRAD_BYTES = 4  # fp32 row gradients
DDP_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket
GPUS_PER_NODE = 8


@dataclass(frozen=True)
class Interconnect:
    """One interconnect (units in the names).

    Args:
        name: what it is.
        gbps: achieved bandwidth of one rank in one direction, GB/s.
        latency_us: cost of one collective call, microseconds.
        source: where the figure comes from.
    """

    name: str
    gbps: float
    latency_us: float
    source: str


INTERCONNECTS: dict[str, Interconnect] = {
    "nvlink4": Interconnect(
        "NVLink 4 (H100 SXM5, NVSwitch)", 360.0, 15.0,
        "NVIDIA H100 datasheet: 900 GB/s bidirectional per GPU = 450 GB/s one way; NCCL all-to-all "
        "reaches about 80% of it"),
    "nvlink3": Interconnect(
        "NVLink 3 (A100 SXM4, NVSwitch)", 240.0, 15.0,
        "NVIDIA A100 datasheet: 600 GB/s bidirectional per GPU = 300 GB/s one way; about 80% achieved"),
    "ib_ndr": Interconnect(
        "InfiniBand NDR 400 Gb/s, one port per GPU", 45.0, 25.0,
        "400 Gb/s = 50 GB/s per port (NVIDIA ConnectX-7); about 90% achieved by NCCL"),
    "ib_hdr": Interconnect(
        "InfiniBand HDR 200 Gb/s, one port per GPU", 22.5, 25.0,
        "200 Gb/s = 25 GB/s per port (ConnectX-6); about 90% achieved"),
    "gloo_loopback": Interconnect(
        "gloo over TCP loopback (2-core CPU machine)", 0.6, 600.0,
        "measured on this project's 2-core build machine: all_to_all_single of 8-64 MiB between 2 "
        "processes, median 0.36-0.65 GB/s one way per rank; tiny calls about 650 us"),
}
TARGET_LINKS: dict[str, tuple[str, str]] = {  # target -> (within a node, across nodes)
    "h100": ("nvlink4", "ib_ndr"),
    "a100": ("nvlink3", "ib_hdr"),
    "cpu": ("gloo_loopback", "gloo_loopback"),
}


def link_for(target: str, world_size: int) -> Interconnect:
    """The interconnect that bounds collectives of `world_size` ranks on `target`."""
    within, across = TARGET_LINKS.get(target, TARGET_LINKS["cpu"])
    return INTERCONNECTS[within if world_size <= GPUS_PER_NODE else across]


def remote_share(world_size: int) -> float:
    """Share of uniformly spread rows that live on another rank."""
    return (world_size - 1) / world_size


def row_wise_bytes(group: PackedGroup, distinct_rows: float, world_size: int) -> float:
    """Bytes one rank sends per step for a row-wise group whose local batch touches `distinct_rows`."""
    per_row = INDEX_BYTES + group.dim * DTYPE_BYTES[group.dtype] + group.dim * GRAD_BYTES
    return distinct_rows * remote_share(world_size) * per_row + world_size * INDEX_BYTES


def replicated_bytes(group: PackedGroup, world_size: int) -> float:
    """Bytes one rank sends per step to all-reduce a replicated group's row gradients (ring)."""
    return 2 * remote_share(world_size) * group.rows * group.dim * GRAD_BYTES


AGREEMENT_CALLS = 1  # per step: the ranks agree on the loss and their flags (`World.agree`, one all_reduce)
GATHER_CALLS = 4  # per step of an in-batch retrieval head over ranks (`gather_over_ranks`): the row counts,
# the item vectors (and their gradients back in the backward), the item ids


def gather_bytes(rows: int, dim: int, world_size: int) -> float:
    """Bytes one rank sends per step to gather an in-batch retrieval head's item vectors (fp32,
    `rows` of this rank's) and ids from every rank, and their gradients back."""
    return (world_size - 1) * rows * (2 * dim * GRAD_BYTES + INDEX_BYTES)


def dense_bytes(param_bytes: int, world_size: int) -> float:
    """Bytes one rank sends per step to all-reduce the dense gradients (ring)."""
    return 2 * remote_share(world_size) * param_bytes


def collectives(group: PackedGroup) -> int:
    """Collective calls per step of a group (row_wise: counts, ids, rows, gradients)."""
    return 4 if group.sharding == "row_wise" else 1


def seconds(nbytes: float, calls: int, link: Interconnect) -> float:
    """Time of `calls` collectives moving `nbytes` from one rank over `link`."""
    return nbytes / (link.gbps * 1e9) + calls * link.latency_us * 1e-6
