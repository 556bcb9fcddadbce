"""Lookahead extraction: per batch and packed group, unique rows, casting index, window rows.

Computed on CPU in the staging threads, ahead of the trainer (ScratchPipe's lookahead; the
casting of Kwon et al., HPCA 2021): the window of batch i is batches i..i+W-1 of the epoch
(shorter at the end of the epoch). With a horizon H the rows of batches i+W..i+W+H-1 are
attached too, each with the distance to its first use there, so that the lookahead cache can
evict by next use. The casting comes from `operators.casting.compute_casting` with the group's
mean-pooling flags per bag position.

Example:
    >>> win = LookaheadWindow(2)
    >>> ready = list(win.push(batch0)) + list(win.push(batch1)) + list(win.flush())  # doctest: +SKIP
"""
from __future__ import annotations

from collections import deque
from dataclasses import replace
from typing import Any, Collection, Iterable, Iterator

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


def first_uses(parts: list[torch.Tensor], first: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted unique rows, index of the first part using each, plus `first`) of sorted unique
    tensors `parts`.  # (K,), (K,) int64

    Example:
        >>> rows, at = first_uses([torch.tensor([2, 5]), torch.tensor([1, 5])], first=3)
        >>> rows.tolist(), at.tolist()
        ([1, 2, 5], [4, 3, 3])
    """
    if not parts:
        return torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    rows = np.concatenate([p.numpy() for p in parts])
    at = np.repeat(np.arange(first, first + len(parts)), [len(p) for p in parts])
    order = np.argsort(rows, kind="stable")  # the earliest part first among equal rows
    rows, at = rows[order], at[order]
    keep = np.empty(len(rows), bool)
    keep[:1] = True
    np.not_equal(rows[1:], rows[:-1], out=keep[1:])
    return torch.from_numpy(rows[keep]), torch.from_numpy(at[keep])


class LookaheadWindow:
    """Holds the last W + H batches; emits a batch once the W + H - 1 batches after it are known.

    Args:
        window: W, batches per window (the batch itself included).
        horizon: H, batches after the window whose rows are attached with their next use (0: none).
        groups: the groups to attach windows to (default: every group of the batches).
    """

    def __init__(self, window: int, horizon: int = 0, groups: Collection[str] | None = None):
        self.window = max(int(window), 1)
        self.horizon = max(int(horizon), 0)
        self.groups = None if groups is None else frozenset(groups)
        self._held: deque = deque()

    def push(self, batch: Any) -> Iterator[Any]:
        self._held.append(batch)
        if len(self._held) >= self.window + self.horizon:
            yield self._emit()

    def flush(self) -> Iterator[Any]:
        while self._held:
            yield self._emit()

    def _emit(self) -> Any:
        head = self._held[0]
        held = list(self._held)
        inside, beyond = held[:self.window], held[self.window:]
        groups = dict(head.groups)
        for name, g in head.groups.items():
            if self.groups is not None and name not in self.groups:
                continue
            rows = union_sorted([b.groups[name].unique for b in inside])
            groups[name] = replace(g, window_unique=rows)
            if self.horizon:
                later, nxt = first_uses([b.groups[name].unique for b in beyond], self.window)
                groups[name] = replace(groups[name], horizon_rows=later, horizon_next=nxt)
        self._held.popleft()
        return replace(head, groups=groups)


def windowed(batches: Iterable[Any], window: int, horizon: int, groups: Collection[str]) -> Iterator[Any]:
    """`batches` in their order, each with the lookahead extras of `groups` (window and horizon)
    computed from the batches that follow it in this order: for batches formed after staging
    (FAE's hot/cold batches), whose order is not the staged one.

    Example:
        >>> from flowrec.data.batches import Batch, GroupIds
        >>> def batch(i, rows):
        ...     ids = torch.tensor(rows)
        ...     g = GroupIds(ids, torch.tensor([0, len(rows)]), unique=ids)
        ...     return Batch(torch.zeros(1, 0), torch.zeros(1, 1), {"g": g}, 0, i, 1)
        >>> out = list(windowed([batch(0, [1]), batch(1, [2, 3]), batch(2, [4])], 2, 1, ["g"]))
        >>> [b.groups["g"].window_unique.tolist() for b in out]
        [[1, 2, 3], [2, 3, 4], [4]]
        >>> out[0].groups["g"].horizon_rows.tolist(), out[0].groups["g"].horizon_next.tolist()
        ([4], [2])
    """
    win = LookaheadWindow(window, horizon, groups)
    for batch in batches:
        yield from win.push(batch)
    yield from win.flush()
