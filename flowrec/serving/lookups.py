"""The embedding lookups of the serving model: one `embedding_bag` per packed group (per run of its
pooled fields of one pooling), over the group's tables laid one after another, not one per field.

A 1,000-field model's program held an `embedding_bag` per field, each with four outputs (three
unused) that `torch.export.load` made a fake tensor for: 4,000 of the 7,053 tensor values of its
graph, 19.2 s of 51 s of its load under cProfile. A group's pooled fields are now one lookup: their
ids are concatenated and each shifted by its table's first row in the group's table, their bags
laid out field by field (bag k * B + b), and the (K * B, D) output read as (B, K, D). Each bag sums
(or averages) the same rows in the same order as the lookup of its own table did, so the scores
are bitwise those of one lookup per field. An id outside its own table is refused, as that lookup
refused it (a packed table would otherwise read a neighbour's row without a word).

Example:
    >>> lookup = GroupLookup(group.fields, {"user": (0, 300), "city": (300, 40)})  # doctest: +SKIP
    >>> lookup(packed_table, {"user": (ids, offsets), "city": (ids, offsets)})  # (B, 2, D)  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

OUT_OF_RANGE = "an id is outside its table, or a feature's offsets do not start at 0"


@dataclass(frozen=True)
class Run:
    """Consecutive fields of a group looked up together: pooled ones of one `mode` (sum, mean), or
    a single sequence field (mode none: its first `max_len` ids, padded)."""

    features: tuple[str, ...]
    mode: str
    max_len: int = 0


def runs_of(fields: Any) -> list[Run]:
    """The runs of a group's fields, in field order: each maximal stretch of pooled fields with one
    pooling is one run; each sequence field a run of its own."""
    runs: list[Run] = []
    for f in fields:
        mode = "none" if f.pooling == "none" else "mean" if f.pooling == "mean" else "sum"
        if mode != "none" and runs and runs[-1].mode == mode:
            runs[-1] = Run((*runs[-1].features, f.feature), mode)
        else:
            runs.append(Run((f.feature,), mode, f.max_len if mode == "none" else 0))
    return runs


class GroupLookup(nn.Module):
    """The lookups of one packed group's fields in its table.

    Args:
        fields: the group's fields in output order (`.feature`, `.table`, `.pooling`, `.max_len`).
        places: table -> (first row in the group's table, rows).

    Forward:
        weight: the group's tables one after another.  # (rows, D)
        sparse: feature -> (ids, offsets): table-local ids and bag boundaries, one bag per
            sample (include_last_offset).  # (nnz,), (B + 1,)
        Returns the fields side by side, float32.  # (B, S, D)
    """

    def __init__(self, fields: Any, places: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.runs = runs_of(fields)
        self.places = {f.feature: places[f.table] for f in fields}  # (first row, rows) of each field's table
        table = {f.feature: f.table for f in fields}
        for i, run in enumerate(self.runs):  # a pooled run's tables' (first row, rows), sorted: (T, 2)
            if run.mode != "none":
                tables = sorted({places[table[f]] for f in run.features})
                self.register_buffer(f"places_{i}", torch.tensor(tables, dtype=torch.int64), persistent=False)

    def forward(self, weight: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        parts = []
        for i, run in enumerate(self.runs):
            if run.mode == "none":
                ids, offsets = sparse[run.features[0]]
                first, rows = self.places[run.features[0]]
                parts.append(sequence(ids, offsets, weight[first:first + rows], run.max_len))  # (B, L, D)
            else:
                firsts = [self.places[f][0] for f in run.features]
                pooled = _pooled(weight, [sparse[f] for f in run.features], firsts, getattr(self, f"places_{i}"),
                                 run.mode)  # (B, K, D)
                parts.append(pooled if pooled.dtype == torch.float32 else pooled.float())
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def _pooled(weight: torch.Tensor, inputs: list[tuple[torch.Tensor, torch.Tensor]], firsts: list[int],
            places: torch.Tensor, mode: str) -> torch.Tensor:
    """One `embedding_bag` over the bags of K fields (`inputs`: their (ids, offsets)), each field's
    ids shifted by its table's first row (`firsts`; `places`: the run's tables' (first row, rows),
    sorted).  # (B, K, D)

    Each field's shift is an add of its own (no symbolic size: the shift of each id found from
    the concatenated ids' K sizes took a graph node per field and their sum, and torch's guard code
    over it at load; from their cumulative sum, minutes of export)."""
    ids = torch.cat([i for i, _ in inputs])  # (N,) table-local
    rows = torch.cat([i if first == 0 else i + first for (i, _), first in zip(inputs, firsts)])  # (N,)
    offsets = torch.stack([o for _, o in inputs])  # (K, B + 1)
    table = torch.searchsorted(places[:, 0].contiguous(), rows - ids)  # (N,) each id's table among `places`
    limit = places[:, 1].index_select(0, table)  # (N,) its table's rows
    torch._assert_async(((ids >= 0) & (ids < limit)).all() & (offsets[:, 0] == 0).all(), OUT_OF_RANGE)
    counts = offsets[:, -1]  # (K,) ids per field
    starts = counts.cumsum(0) - counts  # (K,) each field's first id in `rows`
    bags = torch.cat([(offsets[:, :-1] + starts.unsqueeze(1)).reshape(-1), counts.sum().reshape(1)])  # (K * B + 1,)
    out = F.embedding_bag(rows, weight, bags, mode=mode, include_last_offset=True)  # (K * B, D)
    by_field = out.view(len(inputs), offsets.shape[1] - 1, weight.shape[1])  # (K, B, D)
    return by_field.transpose(0, 1).clone(memory_format=torch.contiguous_format)  # (.contiguous() guards B != 1)


def sequence(ids: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, max_len: int) -> torch.Tensor:
    """Padded sequence lookup: the first max_len ids of each bag; padding rows are zeros.  # (B, L, D)"""
    lengths = (offsets[1:] - offsets[:-1]).clamp(max=max_len)  # (B,)
    positions = torch.arange(max_len)
    valid = positions.unsqueeze(0) < lengths.unsqueeze(1)  # (B, L)
    padded = torch.cat([ids, ids.new_zeros(1)])  # index nnz: the padding id of short sequences
    index = (offsets[:-1].unsqueeze(1) + positions.unsqueeze(0)).clamp(max=ids.numel())  # (B, L)
    rows = torch.where(valid, padded[index], 0)  # (B, L)
    return weight[rows].float() * valid.unsqueeze(2)  # padding positions are zeros
