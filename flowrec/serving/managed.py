"""Managed maps in a model package: written by `flowrec export`, applied by `flowrec predict`.

A package of a model with managed tables holds ``managed/<table>.parquet``: the raw ids that
hold a row and their rows (sorted by raw id), the map as of the exported checkpoint. Scoring
encodes raw values to their 64-bit hashes as training did, looks them up there, and drops ids
without a row from their bags, exactly as evaluation does (`flowrec.data.managed_stage`): an
unknown, never admitted or evicted id reads the default (nothing).

Example:
    >>> write_maps(maps_of(trained.model), Path("pkg"))   # doctest: +SKIP
    >>> sparse = remap_inputs(spec, sparse, read_maps(Path("pkg"), spec))  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

from flowrec.data.managed import NO_ROW
from flowrec.spec.model import ModelSpec

MANAGED_DIR = "managed"

Maps = dict[str, tuple[np.ndarray, np.ndarray]]  # table -> (sorted raw ids, their rows)


def maps_of(model: Any) -> Maps:
    """The held ids and rows of every managed map of a lowered model (none without managed tables)."""
    managed = getattr(model, "managed", None)
    if managed is None:
        return {}
    managed.sync()
    entries = {table: m.entries() for table, m in managed.maps.items()}
    return {table: (e.keys[e.row != NO_ROW], e.row[e.row != NO_ROW]) for table, e in entries.items()}


def write_maps(maps: Maps, out: Path) -> None:
    """Write `maps` (`maps_of`) into `out/managed/`, one Parquet file per managed table."""
    if not maps:
        return
    (out / MANAGED_DIR).mkdir()
    for table, (keys, rows) in maps.items():
        pq.write_table(pa.table({"key": keys, "row": rows}), out / MANAGED_DIR / f"{table}.parquet")


def read_maps(folder: Path, spec: ModelSpec) -> Maps:
    """The maps of a package's managed tables (none without managed tables).

    Raises:
        ValueError: a managed table's map file is missing or damaged (one line).
    """
    out: Maps = {}
    for t in spec.tables:
        if t.managed is None:
            continue
        path = Path(folder) / MANAGED_DIR / f"{t.name}.parquet"
        try:
            table = pq.read_table(path, columns=["key", "row"])
            # int64 without nulls, as export writes them: nulls read as NaN floats, and uint64 ids
            # are searched as floats beside the int64 hashes of raw values (both wrong rows)
            if not all(table.schema.field(c).type == pa.int64() and table.column(c).null_count == 0
                       for c in ("key", "row")):
                raise KeyError("key and row must be int64 without nulls")
            keys, rows = table.column("key").to_numpy(), table.column("row").to_numpy()
        except (OSError, KeyError, pa.ArrowException):
            raise ValueError(f"{path}: the map of managed table {t.name!r} is missing or damaged") from None
        if (len(keys) > 1 and bool((keys[1:] <= keys[:-1]).any())) or (len(rows) and (rows.min() < 0 or rows.max() >= t.rows)) \
                or len(np.unique(rows)) != len(rows):
            raise ValueError(f"{path}: the map of managed table {t.name!r} is damaged (ids unsorted, rows "
                             f"outside [0, {t.rows}) or a row held by two ids)")
        out[t.name] = (keys, rows)
    return out


def remap_inputs(spec: ModelSpec, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]], maps: Maps
                 ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Program inputs with managed features' raw ids replaced by rows, ids without one dropped."""
    if not maps:
        return sparse
    out = dict(sparse)
    for f in spec.sparse_features:
        if f.table not in maps:
            continue
        keys, rows = maps[f.table]
        ids, offsets = (x.numpy() for x in sparse[f.name])
        found = _lookup(keys, rows, ids)
        keep = found != NO_ROW
        lengths = np.diff(offsets)
        kept = np.bincount(np.repeat(np.arange(len(lengths)), lengths)[keep], minlength=len(lengths))
        new_offsets = np.zeros(len(offsets), np.int64)
        np.cumsum(kept, out=new_offsets[1:])
        out[f.name] = (torch.from_numpy(found[keep].astype(np.int64)), torch.from_numpy(new_offsets))
    return out


def _lookup(keys: np.ndarray, rows: np.ndarray, ids: np.ndarray) -> np.ndarray:
    if not len(keys):
        return np.full(len(ids), NO_ROW, np.int64)
    pos = np.minimum(np.searchsorted(keys, ids), len(keys) - 1)
    return np.where(keys[pos] == ids, rows[pos], NO_ROW)
