"""Placement `host` with counters: the packed table in host memory, pooled rows to the device.

Lookups gather and pool on the host (pinned memory where CUDA is present); the pooled rows
(B, S, D) travel to the device and their gradients come back for the fused update on the host.
The state-dict keys are those of a device-resident `PackedEmbeddingBag`.

Example:
    >>> emb = HostEmbedding(group, seed=0, device=torch.device("cpu"))  # doctest: +SKIP
"""
from __future__ import annotations

import torch

from flowrec.graph.types import PackedGroup
from flowrec.runtime.caches.counters import CacheCounters
from operators.casting import Casting
from operators.device import runtime_for
from operators.embedding import PackedEmbeddingBag


class HostEmbedding(PackedEmbeddingBag):
    """A host-resident packed table that counts the bytes it sends and receives.

    Args:
        group: the packed group.
        seed: model seed.
        device: the compute device (the table stays on the host; pinned when this is CUDA).
    """

    def __init__(self, group: PackedGroup, seed: int, device: torch.device):
        super().__init__(group, seed=seed, device="cpu")
        runtime = runtime_for(device)
        self.weight = runtime.pin(self.weight)
        self.state = runtime.pin(self.state)
        self.counters = CacheCounters()

    def forward(self, ids: torch.Tensor, offsets: torch.Tensor, casting: Casting | None = None) -> torch.Tensor:
        out = super().forward(ids, offsets, casting)  # (B, S, D)
        c = self.counters
        if torch.is_grad_enabled():
            c.add_index(ids.numel(), offsets.numel())
            nbytes = out.numel() * out.element_size()
            c.add_h2d(nbytes)
            c.add_d2h(nbytes)  # the gradient of the pooled rows comes back
            c.add_lookups(ids.numel(), 0)
            c.end_step(out.shape[0])
        return out
