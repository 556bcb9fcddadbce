"""What conversion saw in the raw data, before encoding filled or hashed it away: missing rates of
the raw dense columns, the label mean of each label, per hashed one-id feature the distinct
raw values next to the rows they occupy (values hashed into one row are merged: collisions), per
managed table the distinct raw ids the data brings (what its map must hold or turn away), and,
with a date column (data option ``date_column``, else ``split_by``), the range of its values
(`flowrec train --follow DAYS --follow-order date:COLUMN` orders day partitions by it).

Written beside the dataset as `_flowrec_stats.json`; `flowrec data inspect` shows it.

Example:
    >>> stats = RawStats(spec, columns)  # doctest: +SKIP
    >>> stats.observe(raw_chunk, encoded_chunk)  # doctest: +SKIP
    >>> stats.write(Path("data/criteo"))  # doctest: +SKIP
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from flowrec.spec.json_doc import read_json_document
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.encode import as_strings
from flowrec.data.layout import DataError, unique_labels
from flowrec.data.packed_ids import column_arrays
from flowrec.data.raw_ids import MISSING_ID
from flowrec.spec.model import ModelSpec

STATS_FILE = "_flowrec_stats.json"
DISTINCT_CAP = 1_000_000  # distinct raw values remembered per feature; beyond it the count is a lower bound
MERGE_WARN = 0.01  # inspect warns when hashing merges more than this fraction of distinct values


class RawStats:
    """Accumulates raw-data statistics chunk by chunk.

    Args:
        spec: the model spec.
        columns: feature / label name -> raw column name (the spec's data.columns).
        date_column: raw column whose range is recorded (None: none).
    """

    def __init__(self, spec: ModelSpec, columns: dict[str, str], date_column: str | None = None) -> None:
        self.spec, self.columns, self.date_column = spec, columns, date_column
        self.dates: list[Any] = []  # the smallest and largest date seen so far (none yet: [])
        self.managed = {t.name: [f.name for f in spec.sparse_features if f.table == t.name]
                        for t in spec.tables if t.managed is not None}
        self.managed_ids: dict[str, set] = {name: set() for name in self.managed}
        self.managed_lookups = {name: 0 for name in self.managed}
        self.managed_capped: set[str] = set()
        self.rows = 0
        self.dense_missing = {f.name: 0 for f in spec.dense_features}
        self.label_sums = {label: 0.0 for label in unique_labels(spec)}
        self.hashed = [f for f in spec.sparse_features if spec.table(f.table).hashed and f.max_len == 1]
        self.distinct: dict[str, set] = {f.name: set() for f in self.hashed}
        self.capped: set[str] = set()
        self.occupied = {f.name: np.zeros(spec.table(f.table).rows, bool) for f in self.hashed}

    def observe(self, raw: pa.Table, encoded: pa.Table) -> None:
        """Take one raw chunk and its encoding (the same rows)."""
        self.rows += raw.num_rows
        for name in self.dense_missing:
            col = raw.column(self.columns.get(name, name))
            missing = col.null_count
            if pa.types.is_floating(col.type):
                missing += int(pc.sum(pc.is_nan(col).fill_null(False)).as_py() or 0)
            self.dense_missing[name] += missing
        for label in self.label_sums:
            self.label_sums[label] += float(pc.sum(encoded.column(label)).as_py() or 0.0)
        for f in self.hashed:
            ids = encoded.column(f.name).to_numpy()
            self.occupied[f.name][ids[ids > 0]] = True
            if f.name in self.capped:
                continue
            values = as_strings(raw.column(self.columns.get(f.name, f.name))).drop_null().unique()
            seen = self.distinct[f.name]
            seen.update(values.to_pylist())
            if len(seen) > DISTINCT_CAP:
                self.capped.add(f.name)
        for table, features in self.managed.items():
            for name in features:
                ids = flat_ids(encoded.column(name))
                ids = ids[ids != MISSING_ID]
                self.managed_lookups[table] += len(ids)
                if table not in self.managed_capped:
                    self.managed_ids[table].update(np.unique(ids).tolist())
                    if len(self.managed_ids[table]) > DISTINCT_CAP:
                        self.managed_capped.add(table)
        if self.date_column is not None:
            self._observe_dates(raw)

    def _observe_dates(self, raw: pa.Table) -> None:
        """Widen the date range by a chunk's date column (numbers, or strings such as ISO dates)."""
        if self.date_column not in raw.column_names:
            raise DataError(f"date_column: column {self.date_column!r} is not in the input (has "
                            f"{[c for c in raw.column_names[:12] if not c.startswith('__')]})")
        col = raw.column(self.date_column)
        col = _as_dates(col)
        lo, hi = (v.as_py() for v in pc.min_max(col).values())
        if lo is None:
            return
        if self.dates and type(lo) is not type(self.dates[0]):
            raise DataError(f"date_column: column {self.date_column!r} holds numbers in some chunks and "
                            "text in others")
        self.dates = [lo, hi] if not self.dates else [min(self.dates[0], lo), max(self.dates[1], hi)]

    def summary(self) -> dict[str, Any]:
        """The statistics as a JSON-able document."""
        n = max(self.rows, 1)
        return {
            "rows": self.rows,
            "dense_missing": {k: {"missing": v, "rate": v / n} for k, v in self.dense_missing.items()},
            "label_mean": {k: v / n for k, v in self.label_sums.items()} if self.rows else {},
            "hashed": {f.name: {"table": f.table, "rows": self.spec.table(f.table).rows,
                                "distinct_values": len(self.distinct[f.name]),
                                "distinct_is_lower_bound": f.name in self.capped,
                                "occupied_rows": int(self.occupied[f.name].sum())} for f in self.hashed},
            **({"managed": {t: {"features": features, "distinct_ids": len(self.managed_ids[t]),
                                "distinct_is_lower_bound": t in self.managed_capped, "lookups": self.managed_lookups[t]}
                            for t, features in self.managed.items()}} if self.managed else {}),
            **({"dates": {"column": self.date_column, "min": self.dates[0], "max": self.dates[1]}}
               if self.dates else {}),
        }

    def write(self, folder: Path) -> None:
        (Path(folder) / STATS_FILE).write_text(json.dumps(self.summary(), indent=1, sort_keys=True) + "\n")


def read_stats(folder: Path) -> dict[str, Any] | None:
    """The raw statistics of a converted dataset, None when it has none (synthetic, older)."""
    path = Path(folder) / STATS_FILE
    if not path.is_file():
        return None
    try:
        doc = read_json_document(path)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) and stats_problem(doc) is None else None


def training_means(folder: Path, columns: dict[str, tuple[float, ...]]) -> tuple[int, dict[str, float]]:
    """(rows, column -> mean) of the label and weight `columns` of the dataset in `folder`: the means
    the conversion counted (`_flowrec_stats.json`), else, for a dataset without them (written by
    another tool, its statistics file removed), the value every row holds of a column whose every
    row holds one of the values `columns` names for it (`constant_columns`); a column holding other
    values is left out. `flowrec.runtime.session.label_warnings` reads them."""
    if not columns:
        return 0, {}
    stats = read_stats(folder)
    means = stats.get("label_mean", {}) if stats and stats.get("rows") else {}
    if all(isinstance(means.get(c), (int, float)) for c in columns):
        return int(stats["rows"]), {c: float(means[c]) for c in columns}  # type: ignore[index]
    return constant_columns(folder, columns)


def constant_columns(folder: Path, columns: dict[str, tuple[float, ...]]) -> tuple[int, dict[str, float]]:
    """(rows, column -> the value every row holds) of the numeric `columns` of the Parquet dataset
    in `folder` whose every row holds one of the values named for the column (a binary label's 0
    or 1, a weight's 0), the others left out. Bounded: each row group is judged by the minimum and
    maximum its footer records, read (that column alone) only where it records none, and no more
    is read once every column was seen to hold another value, or two."""
    import pyarrow.parquet as pq

    from flowrec.data.dataset import parquet_files
    from flowrec.data.layout import read_meta

    rows, bounds, decided = read_meta(folder).rows, {c: (math.inf, -math.inf) for c in columns}, set()
    for file in parquet_files(folder):
        if len(decided) == len(columns):
            break
        with pq.ParquetFile(file) as part:
            meta = part.metadata
            leaves = [meta.schema.column(i).path for i in range(meta.num_columns)]
            decided |= {c for c in columns if c not in leaves}  # not this dataset's: training says so
            for g in range(meta.num_row_groups):
                group = meta.row_group(g)
                for c in columns:
                    if c in decided or group.num_rows == 0:
                        continue
                    kept = group.column(leaves.index(c)).statistics
                    if kept is not None and kept.has_min_max and kept.null_count == 0 \
                            and isinstance(kept.min, (int, float)):
                        lo, hi = float(kept.min), float(kept.max)
                    else:
                        values = part.read_row_group(g, columns=[c]).column(0)
                        lo, hi = (math.nan if v.as_py() is None else float(v.as_py())
                                  for v in pc.min_max(values).values())
                    lo, hi = min(bounds[c][0], lo), max(bounds[c][1], hi)
                    bounds[c] = (lo, hi)
                    if not (lo == hi and lo in columns[c]):  # two values, another value, or a nan
                        decided.add(c)
    return rows, {c: bounds[c][0] for c in columns if c not in decided and rows}


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


# per section: the fields of each entry and the test each must pass (a field absent from an older file passes)
_SECTIONS = {
    "dense_missing": {"missing": _count, "rate": _number},
    "hashed": {"table": lambda v: isinstance(v, str), "rows": _count, "distinct_values": _count,
               "occupied_rows": _count, "distinct_is_lower_bound": lambda v: isinstance(v, bool)},
    "managed": {"features": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
                "distinct_ids": _count, "lookups": _count, "distinct_is_lower_bound": lambda v: isinstance(v, bool)},
}


def stats_problem(doc: dict[str, Any]) -> str | None:
    """Why a raw-statistics document cannot be used as conversion wrote it (a hand-edited or damaged
    file: a count that is text, a section that is a list), or None. `read_stats` treats such a
    file as absent; the first date of `dates` is checked where days are ordered (`flowrec.data.days`)."""
    if "rows" in doc and not _count(doc["rows"]):
        return f"rows is {doc['rows']!r:.40}"
    for section, fields in _SECTIONS.items():
        entries = doc.get(section, {})
        if not isinstance(entries, dict):
            return f"{section} is not an object"
        for name, entry in entries.items():
            if not isinstance(entry, dict):
                return f"{section}.{name} is not an object"
            for key, good in fields.items():
                if key in entry and not good(entry[key]):
                    return f"{section}.{name}.{key} is {entry[key]!r:.40}"
    means = doc.get("label_mean", {})
    if not isinstance(means, dict) or not all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool))
                                              for v in means.values()):
        return "label_mean is not an object of numbers"
    if "dates" in doc and not isinstance(doc["dates"], dict):
        return "dates is not an object"
    return None


def _as_dates(col: pa.ChunkedArray) -> pa.Array:
    """A date column as float64 when it holds numbers (text read from CSV included), else as text
    (ISO dates order as text)."""
    if pa.types.is_integer(col.type) or pa.types.is_floating(col.type):
        return pc.cast(col, pa.float64())
    text = as_strings(col)
    try:
        return pc.cast(text, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        return text


def flat_ids(col: pa.ChunkedArray) -> np.ndarray:
    """The raw ids of a managed column (one id per row, or a list per row) as one array.  # (N,) int64"""
    ids = column_arrays(col)
    return ids[0] if isinstance(ids, tuple) else ids


def merged_values(entry: dict[str, Any]) -> int:
    """Distinct raw values that share a row with another value (distinct minus occupied rows)."""
    return max(int(entry["distinct_values"]) - int(entry["occupied_rows"]), 0)


def space_constant(folder: Path, label: str, where: str, equals: float) -> tuple[int, float | None] | None:
    """(rows, value) of a head's task space (`trained_where`: rows whose `where` column equals
    `equals`) in the Parquet dataset in `folder`: its row count and the one value `label` holds on
    every row of it (None: the space is empty); None when the space holds two values, or the
    dataset lacks either column. The two columns are read row group by row group until the space
    shows two values, so a dataset whose space holds both classes is decided by its first row
    groups; only a space of one class (the case worth a warning) is read to its end."""
    import pyarrow.parquet as pq

    from flowrec.data.dataset import parquet_files

    rows, seen = 0, set()
    for file in parquet_files(folder):
        with pq.ParquetFile(file) as part:
            names = set(part.schema_arrow.names)
            if label not in names or where not in names:
                return None
            for g in range(part.metadata.num_row_groups):
                table = part.read_row_group(g, columns=list(dict.fromkeys([label, where])))
                inside = pc.filter(table.column(label), pc.equal(table.column(where), float(equals)))
                rows += len(inside)
                if len(inside):
                    bounds = pc.min_max(inside)
                    seen |= {bounds["min"].as_py(), bounds["max"].as_py()}
                    if len(seen) > 1 or None in seen:
                        return None
    return rows, (float(seen.pop()) if seen else None)
