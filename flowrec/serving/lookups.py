"""The embedding lookups of the serving model: one `embedding_bag` per packed group (per run of its
pooled fields of one pooling), over the group's tables laid one after another, not one per field.

A 1,000-field model's program held an `embedding_bag` per field, each with four outputs (three
unused) that `torch.export.load` made a fake tensor for: 4,000 of the 7,053 tensor values of its
graph, 19.2 s of 51 s of its load under cProfile. A group's pooled fields are now one lookup: their
ids are concatenated and each shifted by its table's first row in the group's table, their bags
laid out field by field (bag k * B + b), and the (K * B, D) output read as (B, K, D). Each bag sums
(or averages) the same rows in the same order as the lookup of its own table did, so the scores
are bitwise those of one lookup per field. An id outside its own table is refused, as that lookup
refused it (a packed table would otherwise read a neighbour's row without a word), and so are a
feature's offsets that are not its bags' bounds (0 first, never decreasing, its id count last): a
field's bags are found in the joined ids from its offsets, so offsets that end before or past its
ids took ids of the next field (or left its own to the next), with a sum or mean and no error,
where the lookup of its own table erred or kept them apart. Each id carries its field's number in
the bits above its row (`FIELD_BITS`), so the check counts each field's ids from the joined ids at
run time, with a few graph nodes per lookup and none per field (each field's id count read as a
size took two nodes per field: 404 more in a 200-field group).

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

OUT_OF_RANGE = "an id is outside its table (ids are table-local: 0 <= id < the table's rows)"
BAD_OFFSETS = ("a feature's offsets are not its bags' bounds (B + 1 of them: 0 first, never decreasing, "
               "its number of ids last)")
FIELD_BITS = 40  # bits of a coded id that hold its row in the group's table; the bits above, its field in the run
PROBE = 0.5  # a tensor's `new_full` of it is 0 (integers), True (bools) or 0.5 (floats): twice it is 1 for floats alone


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
        Raises RuntimeError (one line: `OUT_OF_RANGE`, `BAD_OFFSETS`) for an id outside its
        field's table, or a field's offsets that are not its bags' bounds.
    """

    def __init__(self, fields: Any, places: dict[str, tuple[int, int]]) -> None:
        super().__init__()
        self.runs = runs_of(fields)
        self.places = {f.feature: places[f.table] for f in fields}  # (first row, rows) of each field's table
        rows = sum(n for _, n in places.values())
        if rows >> FIELD_BITS or len(self.places) >> (62 - FIELD_BITS):  # a coded id must fit in 62 bits
            raise ValueError(f"a packed group of {len(self.places)} fields over {rows} rows is too large to "
                             f"serve (at most {(1 << FIELD_BITS) - 1} rows and {(1 << (62 - FIELD_BITS)) - 1} fields)")
        for i, run in enumerate(self.runs):  # the rows of each field's table in the run: (K,)
            limits = [self.places[f][1] for f in run.features]
            self.register_buffer(f"limits_{i}", torch.tensor(limits, dtype=torch.int64), persistent=False)

    def forward(self, weight: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        parts = []
        for i, run in enumerate(self.runs):
            limits = getattr(self, f"limits_{i}")
            if run.mode == "none":
                ids, offsets = sparse[run.features[0]]
                check_integers(run.features, ids, offsets)
                ids, offsets = as_int64(ids), as_int64(offsets)
                first, rows = self.places[run.features[0]]
                check_bags(ids, torch.zeros_like(ids), limits, offsets.unsqueeze(0))
                parts.append(sequence(ids, offsets, weight[first:first + rows], run.max_len))  # (B, L, D)
            else:
                firsts = [self.places[f][0] for f in run.features]
                pooled = _pooled(weight, sparse, run.features, firsts, limits, run.mode)  # (B, K, D)
                parts.append(as_float32(pooled))
        return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


def not_integers(features: tuple[str, ...]) -> str:
    """The one line that refuses float ids or offsets of one of a run's `features` (a run's are
    checked together: the first three named).

    >>> not_integers(("user", "item"))
    "sparse['user'], sparse['item']: ids and offsets must be integers (int64; int32, int16, int8, uint8 and bool are read as int64), not floats"
    """
    named = ", ".join(f"sparse[{f!r}]" for f in features[:3])
    more = f" or another of the {len(features)} features looked up with them" if len(features) > 3 else ""
    return (f"{named}{more}: ids and offsets must be integers (int64; int32, int16, int8, uint8 and bool are "
            "read as int64), not floats")


def check_integers(features: tuple[str, ...], *tensors: torch.Tensor) -> None:
    """Refuse (RuntimeError, one line: `not_integers(features)`) `tensors`, the ids or offsets of
    `features` (a run's joined ones: joining promotes, a float among them makes the join float),
    unless they hold integers (or bools). A torch-only caller may pass any dtype: the program's
    graph holds the int64 the inputs were traced with, not a check of it, so float ids met torch's
    own errors deep inside a lookup. A tensor's `new_full` of `PROBE` is made in its dtype at run
    time."""
    probes = torch.cat([t.new_full([1], PROBE) for t in tensors])  # (len(tensors),) in their promoted dtype
    torch._assert_async((probes * 2 != 1).all(), not_integers(features))


def as_int64(tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` (integers or bools, any dtype at run time) as int64: `.long()` of the int64 it is
    traced with is no graph node, so an int32 id's add of its field's code wrapped, and a uint8 id
    indexed a sequence's table as a mask."""
    return torch.ops.aten._to_copy.default(tensor, dtype=torch.int64)


def bad_dense(width: int) -> str:
    """The one line that refuses a dense input of another dtype than float32 or another width.

    >>> bad_dense(2)
    "dense: the dense input must be float32 of shape (B, 2), the spec's dense features in order (cast it with .float())"
    """
    return (f"dense: the dense input must be float32 of shape (B, {width}), the spec's dense features in order "
            "(cast it with .float())")


def bad_sparse(feature: str, ids: Any, offsets: Any, rows: int | None = None) -> str:
    """The one line that refuses a sparse input that is not a pair of 1-d tensors (ids, offsets),
    or whose offsets are not one more than `rows`, the dense input's rows.

    >>> bad_sparse("user", torch.zeros(2, 3), torch.zeros(4))
    "sparse['user']: must be (ids, offsets), tensors of shape (nnz,) and (B + 1,) (given shapes (2, 3) and (4,))"
    >>> bad_sparse("user", torch.zeros(3), torch.zeros(4), rows=5)
    "sparse['user']: must be (ids, offsets), tensors of shape (nnz,) and (B + 1,) = (6,) for the dense input's 5 rows (given shapes (3,) and (4,))"
    """
    def shape(value: Any) -> str:
        return str(tuple(value.shape)) if isinstance(value, torch.Tensor) else f"a {type(value).__name__}"

    bound = "" if rows is None else f" = ({rows + 1},) for the dense input's {rows} rows"
    return (f"sparse[{feature!r}]: must be (ids, offsets), tensors of shape (nnz,) and (B + 1,){bound} "
            f"(given shapes {shape(ids)} and {shape(offsets)})")


def check_dense(dense: torch.Tensor, width: int) -> None:
    """Refuse (RuntimeError, one line: `bad_dense(width)`) a dense input that is not float32 or not
    `width` columns wide. float64 met torch's dtype error in the first layer; half floats and
    integers scored without a word (1 + 2**-20 + 2**-30 is 1 + 2**-20 in float32 alone, as the
    probe made in the input's dtype finds), and so did a wider input where torch's guards are not
    run (`load_model(...).program`). Its width is counted from its first 0 rows (no value read)."""
    probe = dense.new_full([1], 1 + 2 ** -20 + 2 ** -30)
    columns = (dense[:0].sum(0) + 1).sum()  # () its width, at run time
    torch._assert_async(((probe + -1) * 2 ** 20 == 1).all() & (columns == width), bad_dense(width))


def as_float32(rows: torch.Tensor) -> torch.Tensor:
    """Looked-up rows of a table (fp32, or fp16 / bf16) as float32. `.float()` is exported with a
    check that the tensor is on the CPU it was traced on (`_assert_tensor_metadata`), even where
    it changes nothing.  # same shape"""
    return rows if rows.dtype == torch.float32 else torch.ops.aten._to_copy.default(rows, dtype=torch.float32)


def positions(like: torch.Tensor, n: int) -> torch.Tensor:
    """0, 1, ..., n - 1 on the device of `like` at run time: an exported `torch.arange` holds the
    device it was traced on (cpu) as a constant, so a program moved to another device made its
    ranges on the CPU.  # (n,) int64"""
    return like.new_ones(n, dtype=torch.int64).cumsum(0) - 1


def check_bags(ids: torch.Tensor, field: torch.Tensor, limits: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Refuse (RuntimeError, one line) the ids of K fields side by side (`ids`, table-local; `field`:
    each one's field, non-decreasing) unless each is inside its field's table (`limits`: its rows)
    and each field's offsets (`offsets`) are its bags' bounds: 0 first, never decreasing, its
    number of ids last. Returns each field's number of ids.  # (K,)"""
    torch._assert_async(((ids >= 0) & (ids < limits.index_select(0, field))).all(), OUT_OF_RANGE)
    ends = torch.searchsorted(field, positions(field, offsets.shape[0] + 1))  # (K + 1,) each field's first id
    counts = ends[1:] - ends[:-1]  # (K,)
    torch._assert_async((offsets[:, 0] == 0).all() & (offsets[:, 1:] >= offsets[:, :-1]).all()
                        & (offsets[:, -1] == counts).all(), BAD_OFFSETS)
    return counts


def _pooled(weight: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]], features: tuple[str, ...],
            firsts: list[int], limits: torch.Tensor, mode: str) -> torch.Tensor:
    """One `embedding_bag` over the bags of K fields (`features`, their (ids, offsets) in `sparse`), each field's
    ids shifted by its table's first row (`firsts`; `limits`: each field's table's rows).  # (B, K, D)

    Each field's code (its number above `FIELD_BITS`, its table's first row below) is an add of its
    own, found again for each id as the difference of the coded and the plain ids side by side
    (exact even where a hostile id's add wraps). No symbolic size: the shift of each id found from
    the concatenated ids' K sizes took a graph node per field and their sum, and torch's guard code
    over it at load; from their cumulative sum, minutes of export."""
    codes = [k << FIELD_BITS | first for k, first in enumerate(firsts)]
    inputs = [sparse[f] for f in features]
    ids = torch.cat([i for i, _ in inputs])  # (N,) table-local, of the inputs' (promoted) dtype
    offsets = torch.stack([o for _, o in inputs])  # (K, B + 1)
    check_integers(features, ids, offsets)
    ids = as_int64(ids)  # (a bool id subtracts as an int)
    coded = torch.cat([as_int64(i) + code if code else as_int64(i) for (i, _), code in zip(inputs, codes)])  # (N,) int64
    code = coded - ids  # (N,) each id's field's code
    counts = check_bags(ids, code >> FIELD_BITS, limits, offsets)  # (K,) ids per field
    rows = ids + (code & ((1 << FIELD_BITS) - 1))  # (N,) rows of the group's table
    starts = counts.cumsum(0) - counts  # (K,) each field's first id in `rows`
    bags = torch.cat([(offsets[:, :-1] + starts.unsqueeze(1)).reshape(-1), counts.sum().reshape(1)])  # (K * B + 1,)
    out = F.embedding_bag(rows, weight, bags, mode=mode, include_last_offset=True)  # (K * B, D)
    by_field = out.view(len(inputs), offsets.shape[1] - 1, weight.shape[1])  # (K, B, D)
    return by_field.transpose(0, 1).clone(memory_format=torch.contiguous_format)  # (.contiguous() guards B != 1)


def sequence(ids: torch.Tensor, offsets: torch.Tensor, weight: torch.Tensor, max_len: int) -> torch.Tensor:
    """Padded sequence lookup: the first max_len ids of each bag; padding rows are zeros.  # (B, L, D)"""
    lengths = (offsets[1:] - offsets[:-1]).clamp(max=max_len)  # (B,)
    places = positions(ids, max_len)  # (L,)
    valid = places.unsqueeze(0) < lengths.unsqueeze(1)  # (B, L)
    padded = torch.cat([ids, ids.new_zeros(1)])  # index nnz: the padding id of short sequences
    index = (offsets[:-1].unsqueeze(1) + places.unsqueeze(0)).clamp(max=ids.numel())  # (B, L)
    rows = torch.where(valid, padded[index], 0)  # (B, L)
    return as_float32(weight[rows]) * valid.unsqueeze(2)  # padding positions are zeros
