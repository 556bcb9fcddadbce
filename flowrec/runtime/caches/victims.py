"""Which resident rows a scratchpad evicts: its victim policies.

A policy orders the candidate slots (resident, not pinned) from first to last to go; the
scratchpad evicts the head of that order. The scratchpad keeps the bookkeeping per slot: the
stamp of the last use (`last_use`) and the batches that used the row since it was fetched
(`uses`); the lookahead cache also passes the data stage's `Horizon`.

  LeastRecent   least recently used first (the demand-fetch LRU baseline)
  NextUseFirst  the lookahead cache's policy: rows no batch of the horizon uses first, fewest
                uses first (the frequency estimate beyond the horizon), then least recently
                used, then lowest row; then rows the horizon uses, furthest next use first
                (Belady's rule inside the known future)

Example:
    >>> pad = Scratchpad(master, 1024, torch.device("cpu"), CacheCounters(), victims=NextUseFirst())  # doctest: +SKIP
    >>> pad.exchange(window, window, stamp, Horizon(rows, next_use))  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch


@dataclass(frozen=True)
class Horizon:
    """Rows that batches after the window use, with the batches until each one's next use.

    Args:
        rows: sorted unique rows.  # (K,) int64
        next_use: batches from the current one to the row's first use.  # (K,) int64
    """

    rows: torch.Tensor
    next_use: torch.Tensor

    def next_use_of(self, rows: torch.Tensor) -> torch.Tensor:
        """Next use of each of `rows` within the horizon, 0 where the horizon does not use it.  # (n,) int64"""
        if not self.rows.numel():
            return torch.zeros_like(rows)
        at = torch.searchsorted(self.rows, rows).clamp_max(self.rows.numel() - 1)
        return torch.where(self.rows[at] == rows, self.next_use[at], torch.zeros_like(rows))


@dataclass(frozen=True)
class SlotState:
    """What a policy may read of the candidate slots (all (n,) int64, in candidate order).

    Args:
        rows: the resident row of each slot.
        last_use: stamp of its last use (or of its fetch).
        uses: batches that used it since it was fetched.
    """

    rows: torch.Tensor
    last_use: torch.Tensor
    uses: torch.Tensor


class VictimPolicy(Protocol):
    def order(self, state: SlotState, horizon: Horizon | None) -> torch.Tensor:
        """Positions of the candidates, first victim first.  # (n,) int64"""


class LeastRecent:
    """Least recently used first; ties keep the candidates' (slot) order."""

    def order(self, state: SlotState, horizon: Horizon | None) -> torch.Tensor:
        return torch.argsort(state.last_use, stable=True)


class NextUseFirst:
    """The lookahead cache's victims (see the module docstring); fully determined by the rows'
    bookkeeping, whatever slots they occupy."""

    def order(self, state: SlotState, horizon: Horizon | None) -> torch.Tensor:
        nxt = horizon.next_use_of(state.rows) if horizon is not None else torch.zeros_like(state.rows)
        keys = (state.rows.numpy(), state.last_use.numpy(), state.uses.numpy(), -nxt.numpy(),
                (nxt > 0).numpy())
        return torch.from_numpy(np.lexsort(keys))  # the last key sorts first
