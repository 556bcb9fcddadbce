"""FAE's batcher: classify samples as hot (every id hot) or cold and form hot and cold batches.

`HotColdBatcher` takes the staged batches of an epoch, splits each by sample into its hot and cold
samples, pools them, and emits full batches of one kind at a time: up to `hot_run` hot batches,
then up to `cold_run` cold batches (the hot:cold interleaving rate), switching earlier when the
pool of one kind runs short; the partial rest of each pool comes at the end. Every sample of the
epoch is in exactly one emitted batch. Per-group lookahead extras are recomputed for the new
batches (the casting index and unique rows; the window is the batch itself, since the order of
batches changed: the trainer takes a lookahead group's window and horizon of the emitted batches,
`flowrec.data.lookahead.windowed`), once per emitted batch: the pools' parts (a staged batch's hot
and cold samples, their concatenation, the rest a batch leaves) carry their ids and offsets only.
Recomputing them at every split and join cast each sample's ids four to five times: 23 ms of
deepfm_criteo's 176 ms profiled step at batch 4,096 (a 64 MiB budget, one compute thread, AMD
EPYC; py-spy), on the step's thread then.

Example:
    >>> hot = {g: emb.is_hot() for g, emb in cached.items()}  # doctest: +SKIP
    >>> for batch in HotColdBatcher(staged, hot, batch_size=2048): ...  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Iterable, Iterator, Mapping

import torch

from flowrec.data.lookahead import mean_flags
from flowrec.graph.types import PackedGroup
from operators.casting import compute_casting

HOT_RUN = 4  # hot batches in a row before a cold batch may come (measured in docs/caching.md)
COLD_RUN = 1  # cold batches in a row before hot batches may come


def hot_samples(batch: Any, hot: Mapping[str, torch.Tensor], bags_per_sample: Mapping[str, int]) -> torch.Tensor:
    """Per sample: every id of every group in `hot` is a hot row.  # (B,) bool

    Args:
        batch: a staged `Batch`.
        hot: per group, the hot flag of each packed row.  # {group: (R,) bool}
        bags_per_sample: per group, S.
    """
    keep = torch.ones(batch.size, dtype=torch.bool)
    for name, flags in hot.items():
        g = batch.groups[name]
        lengths = g.offsets[1:] - g.offsets[:-1]  # (B*S,)
        sample = torch.repeat_interleave(torch.arange(lengths.numel()) // bags_per_sample[name], lengths)
        cold = ~flags[g.ids]
        keep[sample[cold]] = False
    return keep


def select_samples(batch: Any, index: torch.Tensor, groups: Mapping[str, PackedGroup], extras: bool = True) -> Any:
    """The sub-batch of samples `index` (in that order), extras recomputed (`extras`; else left
    as `batch`'s, stale: for a part that `with_extras` completes before it is used).

    Args:
        batch: a staged `Batch`.
        index: sample positions.  # (n,) int64
        groups: the packed groups by name.
        extras: recompute the casting index and unique rows of the sub-batch.
    """
    out = {}
    for name, g in batch.groups.items():
        s = groups[name].bags_per_sample
        lengths = (g.offsets[1:] - g.offsets[:-1]).view(-1, s)  # (B, S)
        starts = g.offsets[:-1].view(-1, s)[:, 0]  # (B,)
        per_sample = lengths.sum(1)  # (B,)
        take = per_sample[index]
        pos = torch.repeat_interleave(starts[index] - torch.cumsum(take, 0) + take, take, output_size=int(take.sum()))
        ids = g.ids[pos + torch.arange(pos.numel())]
        offsets = torch.zeros(index.numel() * s + 1, dtype=torch.int64)
        torch.cumsum(lengths[index].reshape(-1), 0, out=offsets[1:])
        part = replace(g, ids=ids, offsets=offsets)
        out[name] = _extras(part, groups[name]) if extras else part
    return replace(batch, dense=batch.dense[index], labels=batch.labels[index], groups=out,
                   size=int(index.numel()))


def concat_batches(parts: list[Any]) -> Any:
    """One batch of the samples of `parts`, in order; its extras left as the first part's (stale:
    `with_extras` completes the batch a pool emits)."""
    if len(parts) == 1:
        return parts[0]
    out = {}
    for name in parts[0].groups:
        ids = torch.cat([p.groups[name].ids for p in parts])
        offs, base = [torch.zeros(1, dtype=torch.int64)], 0
        for p in parts:
            o = p.groups[name].offsets
            offs.append(o[1:] + base)
            base += int(o[-1])
        out[name] = replace(parts[0].groups[name], ids=ids, offsets=torch.cat(offs))
    return replace(parts[0], dense=torch.cat([p.dense for p in parts]), labels=torch.cat([p.labels for p in parts]),
                   groups=out, size=sum(p.size for p in parts))


def with_extras(batch: Any, groups: Mapping[str, PackedGroup]) -> Any:
    """`batch` with every group's extras (casting index, unique rows) computed from its ids."""
    return replace(batch, groups={name: _extras(g, groups[name]) for name, g in batch.groups.items()})


def _extras(g: Any, group: PackedGroup) -> Any:
    if g.casting is None and g.unique is None:
        return g
    casting = compute_casting(g.ids, g.offsets, mean_flags(group)) if g.casting is not None else None
    unique = casting.unique_ids if casting is not None else torch.unique(g.ids)
    return replace(g, casting=casting, unique=unique, window_unique=unique)


class _Pool:
    """Samples of one kind waiting to form batches."""

    def __init__(self) -> None:
        self.parts: list[Any] = []
        self.size = 0

    def add(self, part: Any) -> None:
        if part.size:
            self.parts.append(part)
            self.size += part.size

    def take(self, n: int, groups: Mapping[str, PackedGroup]) -> Any:
        """The first `n` samples waiting, as a batch with its extras; the rest wait on (no extras)."""
        whole = concat_batches(self.parts)
        n = min(n, whole.size)
        head = select_samples(whole, torch.arange(n), groups, extras=False) if n < whole.size else whole
        rest = select_samples(whole, torch.arange(n, whole.size), groups, extras=False) if n < whole.size else None
        self.parts = [rest] if rest is not None else []
        self.size -= n
        return with_extras(head, groups)


class HotColdBatcher:
    """Hot and cold batches from staged batches (see the module docstring).

    Args:
        batches: staged batches of one epoch.
        hot: per static_hot group, the hot flag of each packed row.  # {group: (R,) bool}
        groups: every packed group of the batches (by name or as a sequence).
        batch_size: samples per emitted batch.
        hot_run: hot batches in a row (the interleaving rate, with `cold_run`).
        cold_run: cold batches in a row.
    """

    def __init__(self, batches: Iterable[Any], hot: Mapping[str, torch.Tensor], groups: Iterable[PackedGroup],
                 batch_size: int, hot_run: int = HOT_RUN, cold_run: int = COLD_RUN):
        self.batches, self.hot, self.batch_size = batches, hot, batch_size
        self.groups = {g.name: g for g in groups}
        self.runs = {"hot": max(hot_run, 1), "cold": max(cold_run, 1)}
        self.emitted = {"hot": 0, "cold": 0}  # batches of each kind
        self.switches = 0

    def __iter__(self) -> Iterator[Any]:
        pools = {"hot": _Pool(), "cold": _Pool()}
        kind, run, index = "hot", 0, 0
        bags = {n: g.bags_per_sample for n, g in self.groups.items()}
        last = ""
        for batch in self.batches:
            mask = hot_samples(batch, self.hot, bags)
            pools["hot"].add(select_samples(batch, mask.nonzero().flatten(), self.groups, extras=False))
            pools["cold"].add(select_samples(batch, (~mask).nonzero().flatten(), self.groups, extras=False))
            while any(p.size >= self.batch_size for p in pools.values()):
                other = "cold" if kind == "hot" else "hot"
                if pools[kind].size < self.batch_size or (run >= self.runs[kind]
                                                          and pools[other].size >= self.batch_size):
                    kind, run = other, 0
                out = pools[kind].take(self.batch_size, self.groups)
                run += 1
                last = self._count(kind, last)
                yield replace(out, index=index)
                index += 1
        for k in ("hot", "cold"):
            while pools[k].size:
                out = pools[k].take(self.batch_size, self.groups)
                last = self._count(k, last)
                yield replace(out, index=index)
                index += 1

    def _count(self, kind: str, last: str) -> str:
        self.emitted[kind] += 1
        self.switches += int(bool(last) and last != kind)
        return kind
