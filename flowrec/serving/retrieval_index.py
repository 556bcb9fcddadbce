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
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
import torch

from operators.retrieval import UnitRows, pair_scores

ITEMS_FILE = "items.parquet"
INDEX_FILE = "items.faiss"
HEADS_FILE = "heads.pt2"  # the scores of the heads beside the retrieval head (`flowrec.serving.retrieval`)
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
    """A package's items and how to search them (the catalogue rows with a raw id: a row no raw
    value was fitted to is never recommended)."""

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

    The manifest is not digest-checked (it holds the digests), so each of its retrieval fields is
    checked against the spec or the items file before use.

    Raises:
        ValueError: a missing or mismatched items file or index (kind, metric, temperature, item
            feature, size, dimension), or items that cannot be scored, one line.
    """
    entry = manifest.get("retrieval")
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: the manifest's retrieval entry is not a mapping")
    head = next((h for h in spec.heads if h.name == entry.get("head")), None)
    if head is None or head.task != "retrieval":
        raise ValueError(f"{path}: the manifest's retrieval head {entry.get('head')!r} is not a retrieval head "
                         "of its spec")
    modules = {m.name: m for m in spec.modules}
    similarity = modules[head.input]
    expected = {"metric": similarity.param("metric", "dot"), "temperature": similarity.param("temperature", 1.0),
                "item_feature": _item_feature(modules, {f.name for f in spec.features}, similarity.inputs[1])}
    for key, value in expected.items():
        if entry.get(key) != value or type(entry.get(key)) is bool:
            raise ValueError(f"{path}: the index's {key} {entry.get(key)!r} is not the model's ({value!r}); "
                             "export the run again")
    items, dim, index = entry.get("items"), entry.get("dim"), entry.get("index")
    if not all(type(n) is int and n >= 1 for n in (items, dim)) or not isinstance(index, dict):
        raise ValueError(f"{path}: the manifest's retrieval entry records no item count, dimension or index")
    kind = index.get("kind")
    if kind not in INDEX_KINDS:
        raise ValueError(f"{path}: index kind {kind!r} is not one this flowrec reads ({', '.join(INDEX_KINDS)})")
    raw_items, vectors = _read_items(path / ITEMS_FILE, items, dim)
    named = [i for i, item in enumerate(raw_items) if item is not None]  # a row no raw value was fitted
    if len(named) < len(raw_items):  # to (a spare row, or one the data left free) is no item to serve
        raw_items, vectors = [raw_items[i] for i in named], np.ascontiguousarray(vectors[named])
    faiss_index = None
    faiss = faiss_module()
    if kind == "faiss_flat_ip" and faiss is not None:
        # the exact flat index is rebuilt from the checked vectors: an index file from a package is
        # untrusted input, and faiss's reader is C++ parsing it; items.faiss is for other programs
        faiss_index = faiss.IndexFlatIP(vectors.shape[1])
        faiss_index.add(for_index(vectors, entry["metric"]))
    return ItemIndex(raw_items, torch.from_numpy(vectors), entry["metric"], float(entry["temperature"]), faiss_index)


def _item_feature(modules: dict[str, Any], features: set[str], token: str) -> str:
    """The one feature an item tower depends on (its first input, down to a feature)."""
    while token not in features:
        token = modules[token].inputs[0]
    return token


def _read_items(file: Path, items: int, dim: int) -> tuple[list[Any], np.ndarray]:
    """The raw ids and vectors of items.parquet: `items` distinct ids (or nulls), each with `dim`
    finite float32 values.  # list of V ids, (V, D) float32

    Raises:
        ValueError: the file does not hold them (one line).
    """
    try:
        table = pq.read_table(file, columns=["item", "vector"])
    except (OSError, ValueError, KeyError, pa.ArrowException) as exc:
        raise ValueError(f"{file} is not an items file of item and vector columns ({type(exc).__name__})") from None
    vector = table.column("vector").combine_chunks()
    kind = vector.type
    lists = pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    if not lists or not (pa.types.is_floating(kind.value_type) or pa.types.is_integer(kind.value_type)):
        raise ValueError(f"{file}: column vector holds {kind}, not lists of numbers")
    lengths = pc.list_value_length(vector).to_numpy(zero_copy_only=False)
    if table.num_rows != items or vector.null_count or (lengths != dim).any():
        raise ValueError(f"{file}: {table.num_rows} vectors of lengths {sorted(set(lengths.tolist()))[:3]}, the "
                         f"manifest records {items} of {dim}")
    flat = vector.flatten().to_numpy(zero_copy_only=False).astype(np.float64)
    if not np.isfinite(flat).all() or (np.abs(flat) > np.finfo(np.float32).max).any():
        raise ValueError(f"{file}: item vectors hold values that are not finite float32 numbers")
    ids = table.column("item").to_pylist()
    named = [i for i in ids if i is not None]  # null: a row no raw value was fitted to (spare, synthetic)
    if len(set(named)) != len(named):
        raise ValueError(f"{file}: the item ids are not distinct")
    return ids, np.ascontiguousarray(flat.reshape(items, dim), dtype=np.float32)
