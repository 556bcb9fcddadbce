"""Serving a retrieval model: the query tower as the package's program, every item's vector, an index.

`flowrec export` of a run with a retrieval head writes, beside the usual package files:

- ``model.pt2``: the query tower: (dense, sparse of every feature but the item id) -> the query
  vectors (B, D) (`QueryTower`; torch alone runs it, as any package program);
- ``items.parquet``: one row per catalogue item (table rows 1 .. vocab): ``item`` (the raw item id
  the encoder maps to that row; null for a row no value was fitted to), ``row``, ``vector`` (its
  item-tower vector, float32);
- ``items.faiss`` (only with the ``ann`` extra, faiss-cpu, and index ``faiss``): an exact flat
  inner-product index of the vectors (unit-normalised first for a cosine metric).

The manifest's ``retrieval`` entry records the head, the metric and temperature, the dimension, the
items and the index kind (``exact`` or ``faiss_flat_ip``); loading refuses a package whose index
does not match it (kind, metric, size or dimension).

Example:
    >>> pkg = load_model("pkg/tt")                 # doctest: +SKIP
    >>> pkg.recommend(users, k=10)                 # doctest: +SKIP
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from flowrec.data.encoder_record import EncoderRecord, read_vocab
from flowrec.data.layout import is_multi
from flowrec.runtime.retrieval import catalogue_vectors
from operators.retrieval import pair_scores

ITEMS_FILE = "items.parquet"
INDEX_FILE = "items.faiss"
INDEX_KINDS = ("exact", "faiss_flat_ip")
EXAMPLE_BATCH = 4  # rows of the example inputs the query program is traced with (the batch is dynamic)


def faiss_module() -> Any:
    """faiss, when the optional `ann` extra is installed, else None."""
    try:
        import faiss
    except ImportError:
        return None
    return faiss


class QueryTower(nn.Module):
    """The query tower of a serving model: its retrieval head's query columns, the item id fed
    as row 0 (the item tower's output is dropped).  # -> (B, Dq)"""

    def __init__(self, serving: nn.Module, item_feature: str, columns: tuple[int, int]) -> None:
        super().__init__()
        self.serving, self.item_feature, self.columns = serving, item_feature, columns

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        b = dense.shape[0]
        item = (torch.zeros(b, dtype=torch.int64), torch.arange(b + 1))
        out = self.serving(dense, {**sparse, self.item_feature: item})
        return out[:, self.columns[0]:self.columns[1]]


@dataclass
class RetrievalExport:
    """What a retrieval run adds to its package (computed before the tables move to serving)."""

    head: str
    item_feature: str
    metric: str
    temperature: float
    vectors: np.ndarray  # (V, D) float32, item r at row r - 1
    raw_items: pa.Array  # (V,) raw item ids (string; null where no value was fitted)
    index: str
    query_columns: tuple[int, int]

    def query_features(self, spec: Any) -> list[Any]:
        return [f for f in spec.sparse_features if f.name != self.item_feature]

    def export_program(self, serving: nn.Module, spec: Any) -> torch.export.ExportedProgram:
        """`torch.export` of the query tower with a dynamic batch and dynamic ids per feature."""
        tower = QueryTower(serving, self.item_feature, self.query_columns).eval()
        features = self.query_features(spec)
        batch = torch.export.Dim("batch", min=1, max=1 << 30)
        shapes = ({0: batch}, {f.name: ({0: torch.export.Dim(f"nnz_{i}", min=0, max=1 << 34)}, {0: batch + 1})
                               for i, f in enumerate(features)})
        b = EXAMPLE_BATCH
        example = {f.name: (torch.zeros(b * (2 if is_multi(f) else 1), dtype=torch.int64),
                            torch.arange(b + 1) * (2 if is_multi(f) else 1)) for f in features}
        from torch.fx.experimental import _config as fx_config

        with fx_config.patch(backed_size_oblivious=True):
            return torch.export.export(tower, (torch.zeros(b, len(spec.dense_features)), example),
                                       dynamic_shapes=shapes, strict=False)

    def write(self, out: Path) -> dict[str, Any]:
        """items.parquet (and items.faiss); the manifest's `retrieval` entry."""
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(self.vectors.reshape(-1), pa.float32()),
                                                    self.vectors.shape[1])
        rows = pa.array(np.arange(1, len(self.vectors) + 1, dtype=np.int64))
        pq.write_table(pa.table({"item": self.raw_items, "row": rows, "vector": vectors}), out / ITEMS_FILE)
        if self.index == "faiss_flat_ip":
            faiss = faiss_module()
            index = faiss.IndexFlatIP(self.vectors.shape[1])
            index.add(_for_index(self.vectors, self.metric))
            faiss.write_index(index, str(out / INDEX_FILE))
        return {"head": self.head, "item_feature": self.item_feature, "metric": self.metric,
                "temperature": self.temperature, "dim": int(self.vectors.shape[1]),
                "items": len(self.vectors), "items_file": ITEMS_FILE,
                "index": {"kind": self.index, "file": INDEX_FILE if self.index == "faiss_flat_ip" else None}}


def retrieval_export(trained: Any, encoder: EncoderRecord, index: str = "auto") -> RetrievalExport | None:
    """The retrieval part of a run's package (None without a retrieval head).

    Args:
        trained: the restored run (its lowered model still holds its packed tables).
        encoder: the run's encoder (the item table's vocabulary gives the raw ids).
        index: ``auto`` (faiss_flat_ip when faiss is importable, else exact), ``exact`` or ``faiss``.

    Raises:
        ValueError: index ``faiss`` without faiss installed (one line).
    """
    binding = trained.model.retrieval
    if binding is None:
        return None
    if index not in ("auto", "exact", "faiss"):
        raise ValueError(f"index {index!r}: use auto, exact or faiss")
    if index == "faiss" and faiss_module() is None:
        raise ValueError("index faiss needs faiss-cpu: pip install 'flowrec[ann]' (or -c constraints.txt faiss-cpu)")
    kind = "exact" if index == "exact" or (index == "auto" and faiss_module() is None) else "faiss_flat_ip"
    vectors = catalogue_vectors(trained.model, binding).cpu().numpy().astype(np.float32)
    table = next(f.table for f in trained.spec.sparse_features if f.name == binding.item_feature)
    vocab = read_vocab(Path(encoder.vocab_files[table])) if table in encoder.vocab_files else pa.array([], pa.string())
    raw = vocab.to_pylist()[: len(vectors)]
    raw += [None] * (len(vectors) - len(raw))
    spec_head = trained.spec.heads[binding.head]
    start = sum(w for w in trained.model.head_widths[: binding.head])
    half = trained.model.head_widths[binding.head] // 2
    return RetrievalExport(spec_head.name, binding.item_feature, binding.attrs["metric"],
                           float(binding.attrs["temperature"]), vectors, pa.array(raw, pa.string()), kind,
                           (start, start + half))


def _for_index(vectors: np.ndarray, metric: str) -> np.ndarray:
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

    def top_k(self, query: torch.Tensor, k: int) -> tuple[np.ndarray, np.ndarray]:
        """The k best items of each query, best first: (rows into the items, scores = the
        similarity over the temperature).  # (B, k) int64, (B, k) float32"""
        k = min(k, len(self.vectors))
        if self.faiss_index is not None:
            scores, rows = self.faiss_index.search(_for_index(query.numpy(), self.metric), k)
            return rows.astype(np.int64), (scores / self.temperature).astype(np.float32)
        scores = pair_scores(query.float(), self.vectors, self.metric, self.temperature)  # (B, V)
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
        index = faiss.read_index(str(path / INDEX_FILE))
        if (index.metric_type != faiss.METRIC_INNER_PRODUCT or index.ntotal != len(vectors)
                or index.d != vectors.shape[1]):
            raise ValueError(f"{path / INDEX_FILE} does not match the package (metric, items or dimension); "
                             "export the run again")
    return ItemIndex(table.column("item").to_pylist(), torch.from_numpy(vectors), entry["metric"],
                     float(entry["temperature"]), index)
