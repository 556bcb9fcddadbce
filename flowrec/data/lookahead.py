"""Lookahead extraction: per batch and packed group, unique rows, casting index, window rows.

Computed on CPU in the staging threads, ahead of the trainer (ScratchPipe's lookahead; the
casting of Kwon et al., HPCA 2021): the window of batch i is batches i..i+W-1 of the epoch
(shorter at the end of the epoch). The casting comes from `operators.casting.compute_casting`
with the group's mean-pooling flags per bag position.

Example:
    >>> win = LookaheadWindow(2)
    >>> ready = list(win.push(batch0)) + list(win.push(batch1)) + list(win.flush())  # doctest: +SKIP
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any, Iterator

import numpy as np
import torch

from flowrec.graph.types import PackedGroup


def mean_flags(group: PackedGroup) -> torch.Tensor | None:
    """Mean-pooling flag per bag position of a sample (S,), or None when no field pools by mean."""
    flags = []
    for f in group.fields:
        width = f.max_len if f.pooling == "none" else 1
        flags += [f.pooling == "mean"] * width
    return torch.tensor(flags, dtype=torch.bool) if any(flags) else None


def batch_extras(group: PackedGroup, ids: torch.Tensor, offsets: torch.Tensor,
                 with_casting: bool) -> tuple[Any, torch.Tensor]:
    """(casting or None, sorted unique rows (U,)) of one batch of one group."""
    if not with_casting:
        return None, torch.unique(ids)
    from operators.casting import compute_casting

    casting = compute_casting(ids, offsets, mean_flags(group))
    return casting, casting.unique_ids


def union_sorted(parts: list[torch.Tensor]) -> torch.Tensor:
    """Sorted union of sorted unique tensors.

    A stable numpy sort of the concatenation is a timsort that merges the sorted runs in
    O(n log k); much faster than torch.unique's full sort here.
    """
    if len(parts) == 1:
        return parts[0]
    x = np.sort(np.concatenate([p.numpy() for p in parts]), kind="stable")
    keep = np.empty(len(x), bool)
    keep[:1] = True
    np.not_equal(x[1:], x[:-1], out=keep[1:])
    return torch.from_numpy(x[keep])


class LookaheadWindow:
    """Holds the last W batches; emits a batch once the W-1 batches after it are known.

    Args:
        window: W, batches per window (the batch itself included).
    """

    def __init__(self, window: int):
        self.window = max(int(window), 1)
        self._held: deque = deque()

    def push(self, batch: Any) -> Iterator[Any]:
        self._held.append(batch)
        if len(self._held) >= self.window:
            yield self._emit()

    def flush(self) -> Iterator[Any]:
        while self._held:
            yield self._emit()

    def _emit(self) -> Any:
        head = self._held[0]
        groups = {}
        for name, g in head.groups.items():
            rows = union_sorted([b.groups[name].unique for b in self._held])
            groups[name] = replace(g, window_unique=rows)
        self._held.popleft()
        return replace(head, groups=groups)
