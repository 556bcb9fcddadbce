"""The items of a retrieval package and their search, for scoring (`flowrec predict --top-k`):
reading and checking `items.parquet` (and the optional faiss index) against the manifest, and the
exact top-k. Nothing here imports the training runtime (`flowrec.serving.retrieval` writes them),
and no index file is parsed: the exact flat faiss index is rebuilt from the checked vectors.

Example:
    >>> index = load_items(Path("pkg/tt"), manifest, spec)   # doctest: +SKIP
    >>> rows, scores = index.top_k(queries, 10)              # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch

from operators.retrieval import UnitRows, pair_scores

ITEMS_FILE = "items.parquet"
INDEX_FILE = "items.faiss"
INDEX_KINDS = ("exact", "faiss_flat_ip")


def faiss_module() -> Any:
    """faiss, when the optional `ann` extra is installed, else None."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


def for_index(vectors: np.ndarray, metric: str) -> np.ndarray:
    """What the inner-product index holds: the vectors, unit-normalised for cosine.  # (N, D) float32"""
    v = np.ascontiguousarray(vectors, dtype=np.float32)
    if metric == "cosine":
        v = v / np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
    return np.ascontiguousarray(v, dtype=np.float32)


@dataclass
class ItemIndex:
    """A package's items and how to search them."""

    raw_items: list[Any]
    vectors: torch.Tensor  # (V, D) float32
    metric: str
    temperature: float
    faiss_index: Any = None  # a faiss index (exact, flat inner product), or None: exact torch search
    units: UnitRows = field(default_factory=UnitRows, repr=False)  # cosine: the vectors normalised once

    def top_k(self, query: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best items of each query, best first: (rows into the items, scores = the
        similarity over the temperature).  # (B, k) int64, (B, k) float32"""
        k = min(k, len(self.vectors))
        if self.faiss_index is not None:
            scores, rows = self.faiss_index.search(for_index(query.numpy(), self.metric), k)
            return rows.astype(np.int64), (scores / self.temperature).astype(np.float32)
        cosine = self.metric == "cosine"
        vectors = self.units(self.vectors) if cosine else self.vectors
        scores = pair_scores(query.float(), vectors, self.metric, self.temperature, cosine)  # (B, V)
        best = torch.topk(scores, k, dim=1)
        return best.indices.numpy(), best.values.numpy()


def load_items(path: Path, manifest: dict[str, Any], spec: Any) -> ItemIndex:
    """The items (and index) of a retrieval package, checked against its manifest and spec.

    Raises:
        ValueError: a missing or mismatched items file or index (kind, metric, size, dimension),
            one line.
    """
    entry = manifest["retrieval"]
    head = next((h for h in spec.heads if h.name == entry.get("head")), None)
    if head is None or head.task != "retrieval":
        raise ValueError(f"{path}: the manifest's retrieval head {entry.get('head')!r} is not a retrieval head "
                         "of its spec")
    similarity = next(m for m in spec.modules if m.name == head.input)
    if entry.get("metric") != similarity.param("metric", "dot"):
        raise ValueError(f"{path}: the index's metric {entry.get('metric')!r} is not the model's "
                         f"({similarity.param('metric', 'dot')!r}); export the run again")
    table = pq.read_table(path / ITEMS_FILE)
    vectors = np.stack(table.column("vector").to_numpy(zero_copy_only=False)).astype(np.float32) \
        if table.num_rows else np.zeros((0, entry["dim"]), np.float32)
    if vectors.shape != (entry["items"], entry["dim"]):
        raise ValueError(f"{path / ITEMS_FILE}: {vectors.shape} vectors, the manifest records "
                         f"({entry['items']}, {entry['dim']})")
    kind = entry["index"]["kind"]
    if kind not in INDEX_KINDS:
        raise ValueError(f"{path}: index kind {kind!r} is not one this flowrec reads ({', '.join(INDEX_KINDS)})")
    index = None
    faiss = faiss_module()
    if kind == "faiss_flat_ip" and faiss is not None:
        # the exact flat index is rebuilt from the checked vectors: an index file from a package is
        # untrusted input, and faiss's reader is C++ parsing it; items.faiss is for other programs
        index = faiss.IndexFlatIP(vectors.shape[1])
        index.add(for_index(vectors, entry["metric"]))
    return ItemIndex(table.column("item").to_pylist(), torch.from_numpy(vectors), entry["metric"],
                     float(entry["temperature"]), index)
