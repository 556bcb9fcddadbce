"""`flowrec data inspect`: rows, partitions, columns, dtypes, metadata, missing/unique summary, and
what conversion saw in the raw data (`_flowrec_stats.json`: raw missing counts of dense columns,
which are filled before storage; label means; distinct raw values vs occupied rows of hashed tables)
and the form the rows wrote the ids of hashed and managed tables in (`recorded_forms`).

Returns data only; the CLI prints it. ``rows`` counts the rows of the part files, ``meta_rows``
what ``_flowrec.json`` records (they differ only for a damaged dataset, which training refuses).
Missing means row 0 for id columns, an empty list for list columns, NaN for float columns.
Unique counts are exact over the scanned rows.

Example:
    >>> info = inspect_dataset("data/criteo")  # doctest: +SKIP
    >>> info["rows"], info["partitions"]  # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import asdict
import os
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flowrec.data.dataset import parquet_files
from flowrec.data.id_forms import checked_forms
from flowrec.data.layout import DataError, read_meta
from flowrec.data.parquet_folder import unread_lines
from flowrec.data.rawstats import MERGE_WARN, STATS_FILE, merged_values, read_stats

SCAN_ROWS = 1_000_000  # rows scanned for the per-column summary


def inspect_dataset(path: str | Path, scan_rows: int = SCAN_ROWS) -> dict[str, Any]:
    """Summary of an encoded dataset directory (raises DataError if it is not one)."""
    meta = read_meta(path)
    files = parquet_files(path)
    parts, scanned, rows_per_file = [], 0, []
    try:
        for f in files:  # (one by one: a comprehension that failed left none counted, naming the first file)
            rows_per_file.append(pq.ParquetFile(f).metadata.num_rows)
        schema = pq.read_schema(files[0])
        for f in files:
            if scanned >= scan_rows:
                break
            parts.append(pq.read_table(f).slice(0, scan_rows - scanned))
            scanned += parts[-1].num_rows
    except (pa.ArrowException, OSError) as exc:
        where = files[len(rows_per_file)] if len(rows_per_file) < len(files) else files[len(parts)]
        raise DataError(f"{where}: unreadable Parquet part ({str(exc).splitlines()[0]})") from None
    table = pa.concat_tables(parts)
    raw = read_stats(Path(path))
    raw_ids = {name for name, enc in meta.encoding.items() if isinstance(enc, dict) and enc.get("rows") == 0}
    columns = [_with_raw(_column(name, table.column(name), name in raw_ids), raw) for name in schema.names]
    return {"path": str(path), "rows": int(sum(rows_per_file)), "meta_rows": meta.rows, "partitions": len(files),
            "rows_per_partition": {"min": min(rows_per_file), "max": max(rows_per_file)},
            "scanned_rows": scanned, "columns": columns, "meta": asdict(meta), "raw": raw,
            "id_forms": in_column_order(recorded_forms(meta.source), schema.names),
            "warnings": unread_lines(Path(path), raw=False) + hashing_warnings(raw, schema.names)
            + _damaged_stats(Path(path), raw)}


def in_column_order(by_feature: dict[str, Any], names: list[str]) -> dict[str, Any]:
    """`by_feature` in the order of the dataset's columns (the column table's), others after them by
    name: C1, C2, ..., C10, not the text order C1, C10, C11, ..., C2 a JSON record keeps.

    >>> list(in_column_order({"C10": 1, "C2": 2, "x": 3, "C1": 4}, ["label", "C1", "C2", "C10"]))
    ['C1', 'C2', 'C10', 'x']
    """
    place = {name: i for i, name in enumerate(names)}
    return dict(sorted(by_feature.items(), key=lambda item: (place.get(item[0], len(place)), item[0])))


def recorded_forms(source: Any) -> dict[str, dict[str, str]]:
    """feature -> {"form", "example", "type", "column"}: the form conversion recorded its hashed or
    managed ids written in (`flowrec.data.id_forms`; `_flowrec.json`'s `source.encoder.id_forms`,
    none for a dataset converted before forms were), with the raw column it was read from."""
    encoder = source.get("encoder") if isinstance(source, dict) else None
    encoder = encoder if isinstance(encoder, dict) else {}
    columns = encoder.get("columns") if isinstance(encoder.get("columns"), dict) else {}
    return {name: {**rule, "column": str(columns.get(name, name))}
            for name, rule in checked_forms(encoder.get("id_forms")).items()}


def form_line(name: str, rule: dict[str, str]) -> str:
    """One short line of a feature's recorded id form (`recorded_forms`): `data inspect`'s."""
    column = f" (column {rule['column']})" if rule.get("column", name) != name else ""
    read = f", read as {rule['type']}" if rule.get("type") else ""
    return f"ids of feature {name}{column}: written as {rule['form']} ({rule.get('example', '')!r}{read})"


def _with_raw(column: dict[str, Any], raw: dict[str, Any] | None) -> dict[str, Any]:
    """A column's summary with what conversion saw before encoding (raw missing, label mean, hashing)."""
    if raw is None:
        return column
    name = column["name"]
    if name in raw.get("dense_missing", {}):
        column["raw_missing"] = raw["dense_missing"][name]["missing"]
    if name in raw.get("label_mean", {}):
        column["label_mean"] = raw["label_mean"][name]
    if name in raw.get("hashed", {}):
        entry = raw["hashed"][name]
        column.update(distinct_raw=entry["distinct_values"], occupied_rows=entry["occupied_rows"],
                      merged=merged_values(entry))
    return column


def _damaged_stats(path: Path, raw: dict[str, Any] | None) -> list[str]:
    """A warning when the dataset holds a raw-statistics file that cannot be used (it is ignored)."""
    if raw is not None or not os.path.lexists(path / STATS_FILE):
        return []
    return [f"{path / STATS_FILE} is damaged (not the statistics conversion writes): ignored"]


def hashing_warnings(raw: dict[str, Any] | None, names: list[str] = ()) -> list[str]:
    """One line per hashed feature whose hashing merges more than MERGE_WARN of its distinct values,
    in the order of the columns `names` (`in_column_order`)."""
    out = []
    for name, entry in in_column_order((raw or {}).get("hashed", {}), list(names)).items():
        distinct, merged = int(entry["distinct_values"]), merged_values(entry)
        if distinct and merged / distinct > MERGE_WARN:
            out.append(f"{name}: hashing merges {merged:,} of {distinct:,} distinct raw values "
                       f"({merged / distinct:.1%}) into {entry['occupied_rows']:,} of {entry['rows']:,} rows; "
                       f"give table {entry['table']!r} more hash_buckets to keep them apart")
    return out


def _column(name: str, col: pa.ChunkedArray, raw_ids: bool = False) -> dict[str, Any]:
    """A column's type and missing / unique counts; `raw_ids`: a managed table's column, whose 0 is
    the missing value and no id (`unique` counts its distinct raw ids, as docs/managed.md says)."""
    col = col.combine_chunks()
    out: dict[str, Any] = {"name": name, "type": str(col.type)}
    if pa.types.is_list(col.type):
        lengths = pc.list_value_length(col).to_numpy(zero_copy_only=False)
        values = pc.list_flatten(col).to_numpy(zero_copy_only=False)
        out.update(missing=int((lengths == 0).sum()), unique=int(len(np.unique(values))),
                   mean_len=float(lengths.mean()) if len(lengths) else 0.0)
    elif pa.types.is_integer(col.type):
        x = col.to_numpy(zero_copy_only=False)
        out.update(missing=int((x == 0).sum()), unique=int(len(np.unique(x[x != 0] if raw_ids else x))),
                   min=int(x.min()) if len(x) else None, max=int(x.max()) if len(x) else None)
    else:
        x = col.to_numpy(zero_copy_only=False).astype(np.float64)
        out.update(missing=int(np.isnan(x).sum()), unique=int(len(np.unique(x))),
                   mean=float(np.nanmean(x)) if len(x) else None)
    return out
