"""What conversion saw in the raw data, before encoding filled or hashed it away: missing rates of
the raw dense columns, the label mean of each label, and per hashed one-id feature the distinct
raw values next to the rows they occupy (values hashed into one row are merged: collisions).

Written beside the dataset as `_flowrec_stats.json`; `flowrec data inspect` shows it.

Example:
    >>> stats = RawStats(spec, columns)  # doctest: +SKIP
    >>> stats.observe(raw_chunk, encoded_chunk)  # doctest: +SKIP
    >>> stats.write(Path("data/criteo"))  # doctest: +SKIP
"""
from __future__ import annotations

import json
from pathlib import Path
from flowrec.spec.json_doc import read_json_document
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.encode import as_strings
from flowrec.data.layout import unique_labels
from flowrec.spec.model import ModelSpec

STATS_FILE = "_flowrec_stats.json"
DISTINCT_CAP = 1_000_000  # distinct raw values remembered per feature; beyond it the count is a lower bound
MERGE_WARN = 0.01  # inspect warns when hashing merges more than this fraction of distinct values


class RawStats:
    """Accumulates raw-data statistics chunk by chunk.

    Args:
        spec: the model spec.
        columns: feature / label name -> raw column name (the spec's data.columns).
    """

    def __init__(self, spec: ModelSpec, columns: dict[str, str]) -> None:
        self.spec, self.columns = spec, columns
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
    return doc if isinstance(doc, dict) else None


def merged_values(entry: dict[str, Any]) -> int:
    """Distinct raw values that share a row with another value (distinct minus occupied rows)."""
    return max(int(entry["distinct_values"]) - int(entry["occupied_rows"]), 0)
