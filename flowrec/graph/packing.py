"""Packed-table layout: which logical tables share a packed table, and at which row offsets.

This is the pure core of the `pack` pass, in the graph layer because the data stage (packed ids)
and the runtime (packed tables) need exactly the same layout as the plan.

Example:
    >>> from flowrec.spec import load_spec
    >>> groups = group_layout(load_spec("specs/dlrm_criteo.yaml"))
    >>> len(groups), groups[0].dim
    (1, 16)
"""
from __future__ import annotations

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from flowrec.spec.model import ModelSpec, OptimizerSpec, TableSpec

GroupKey = tuple[int, str, tuple[str, float, tuple[tuple[str, float], ...]]]


def optimizer_key(opt: OptimizerSpec) -> tuple[str, float, tuple[tuple[str, float], ...]]:
    return (opt.name, float(opt.lr), tuple(sorted(opt.params)))


def table_key(spec: ModelSpec, table: TableSpec) -> GroupKey:
    """Tables pack together iff their (dim, dtype, optimizer) keys are equal."""
    return (table.dim, table.dtype, optimizer_key(spec.table_optimizer(table)))


def group_layout(spec: ModelSpec, packing: bool | None = None) -> tuple[PackedGroup, ...]:
    """Group the spec's tables into packed tables.

    Args:
        spec: the typed model.
        packing: pack tables with equal keys (default: the spec's `plan.packing` hint);
            False gives one group per table.

    Returns:
        Groups ordered by (dim, dtype, optimizer) key, then first table in spec order; member
        tables in spec order with contiguous, disjoint row offsets; fields in spec order.
    """
    packing = spec.plan.packing if packing is None else packing
    sparse = spec.sparse_features
    used = {f.table for f in sparse}
    position = {t.name: i for i, t in enumerate(spec.tables)}  # names are unique
    buckets: dict[object, list[TableSpec]] = {}
    for table in spec.tables:
        if table.name not in used:
            continue
        key = table_key(spec, table) if packing else (table_key(spec, table), table.name)
        buckets.setdefault(key, []).append(table)
    order = sorted(buckets, key=lambda k: (_sort_key(k), position[buckets[k][0].name]))
    group_of = {t.name: i for i, key in enumerate(order) for t in buckets[key]}
    fields: list[list[GroupField]] = [[] for _ in order]  # per group, in spec order
    for f in sparse:  # one pass (not one per group: a spec of n tables unpacked made n^2)
        fields[group_of[f.table]].append(GroupField(f.name, f.table, f.max_len, f.pooling))
    groups = []
    for i, key in enumerate(order):
        members = buckets[key]
        slots, offset = [], 0
        for t in members:
            slots.append(TableSlot(t.name, t.rows, offset))
            offset += t.rows
        first = members[0]
        suffix = f"_{first.name}" if not packing else ""
        groups.append(
            PackedGroup(
                name=f"g{i}_d{first.dim}{suffix}",
                dim=first.dim,
                dtype=first.dtype,
                optimizer=optimizer_key(spec.table_optimizer(first)),
                tables=tuple(slots),
                fields=tuple(fields[i]),
            )
        )
    return tuple(groups)


def _sort_key(key: object) -> tuple:
    base = key[0] if isinstance(key[0], tuple) else key  # unpacked keys carry the table name
    dim, dtype, (opt, lr, params) = base
    return (dim, dtype, opt, lr, params)
