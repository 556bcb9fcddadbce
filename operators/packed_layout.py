"""The packed-table layout the operators read: plain records, defined here, so that `operators`
depends on nothing of flowrec.

A packed layout concatenates logical tables into one packed table (each table's packed rows are
``[row_offset, row_offset + rows)``) and lists the fields looked up in it, in the order of the
(B, S, D) output: one bag per pooled field, `max_len` single-id bags per unpooled sequence. Any
record with these attributes is a layout (flowrec's planner records are); `Layout` is the plain
one for direct use.

Example:
    >>> g = Layout("g", 4, "fp32", ("sgd", 0.1, ()), (TableRange("t", 10, 0),), (BagField("f", "t", 1, "sum"),))
    >>> g.rows, g.bags_per_sample
    (10, 1)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence

OptimizerConfig = tuple[str, float, tuple[tuple[str, float], ...]]  # (name, lr, sorted params)


class TableRangeLike(Protocol):
    table: str
    rows: int
    row_offset: int


class BagFieldLike(Protocol):
    feature: str
    table: str
    max_len: int
    pooling: str  # sum | mean | none


class PackedLayout(Protocol):
    """What an operator reads of a packed group."""

    name: str
    dim: int
    dtype: str  # fp32 | fp16 | bf16 | fp64
    optimizer: OptimizerConfig

    @property
    def tables(self) -> Sequence[TableRangeLike]: ...

    @property
    def fields(self) -> Sequence[BagFieldLike]: ...

    @property
    def rows(self) -> int: ...

    @property
    def bags_per_sample(self) -> int: ...


@dataclass(frozen=True)
class TableRange:
    """A logical table's packed rows [row_offset, row_offset + rows)."""

    table: str
    rows: int
    row_offset: int


@dataclass(frozen=True)
class BagField:
    """One looked-up field: its table, bag length and pooling (sum, mean, none = sequence)."""

    feature: str
    table: str
    max_len: int
    pooling: str


@dataclass(frozen=True)
class Layout:
    """A plain packed layout (see the module docstring)."""

    name: str
    dim: int
    dtype: str
    optimizer: OptimizerConfig
    tables: tuple[TableRange, ...]
    fields: tuple[BagField, ...]

    @property
    def rows(self) -> int:
        return sum(t.rows for t in self.tables)

    @property
    def bags_per_sample(self) -> int:
        return sum(f.max_len if f.pooling == "none" else 1 for f in self.fields)
