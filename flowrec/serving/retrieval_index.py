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


def id_type(read_as: str | None) -> pa.DataType | None:
    """The type items.parquet gives ids of a source column read as `read_as` (an Arrow type's
    text): string for text (string, large string, string view, a dictionary of text), the integer
    type for integers; None (the guess) for anything else.

    >>> id_type("dictionary<values=string, indices=int32, ordered=0>"), id_type("uint16"), id_type("double")
    (DataType(string), DataType(uint16), None)
    """
    if not isinstance(read_as, str):
        return None
    if read_as in ("string", "large_string", "string_view", "utf8", "large_utf8") or \
            (read_as.startswith("dictionary<values=") and
             read_as.split("=", 1)[1].split(",", 1)[0] in ("string", "large_string", "string_view")):
        return pa.string()
    if read_as in INTEGER_TYPES:
        return pa.type_for_alias(read_as)
    return None


INTEGER_TYPES = ("int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64")


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


def load_items(path: Path, manifest: dict[str, Any], spec: Any, vocabs: dict[str, pa.Array] | None = None,
               id_types: dict[str, str] | None = None) -> ItemIndex:
    """The items (and index) of a retrieval package, checked against its manifest, spec and encoder.

    The manifest is not digest-checked (it holds the digests), so each of its retrieval fields is
    checked against the spec or the items file before use; the items' ids against the encoder's
    (`vocabs`: table -> vocabulary; `id_types`: feature -> the type its training column was read
    as, `EncoderRecord.id_types`), as export writes them (`check_item_ids`), where `vocabs` is given.

    Raises:
        ValueError: a missing or mismatched items file or index (kind, metric, temperature, item
            feature, size, dimension), ids that are not the encoder's, or items that cannot be
            scored, one line.
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
    ids, vectors = _read_items(path / ITEMS_FILE, items, dim)
    if vocabs is not None:
        table = next(f.table for f in spec.sparse_features if f.name == entry["item_feature"])
        check_item_ids(path / ITEMS_FILE, ids, vocabs.get(table), (id_types or {}).get(entry["item_feature"]))
    raw_items = ids.to_pylist()
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


def _read_items(file: Path, items: int, dim: int) -> tuple[pa.Array, np.ndarray]:
    """The raw ids and vectors of items.parquet: `items` distinct ids (or nulls), integers or text,
    each with `dim` finite float32 values.  # (V,) ids, (V, D) float32

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
    ids = table.column("item").combine_chunks()
    if pa.types.is_dictionary(ids.type):
        ids = ids.dictionary_decode()
    if not (pa.types.is_integer(ids.type) or pa.types.is_string(ids.type) or pa.types.is_large_string(ids.type)):
        # (a list or struct was a TypeError traceback; floats, bools and bytes came back as such items)
        raise ValueError(f"{file}: column item holds {ids.type}, not item ids (integers or text, as export writes "
                         "them); export the run again")
    named = ids.drop_null()  # null: a row no raw value was fitted to (spare, synthetic)
    if len(pc.unique(named)) != len(named):
        raise ValueError(f"{file}: the item ids are not distinct")
    return ids, np.ascontiguousarray(flat.reshape(items, dim), dtype=np.float32)


def check_item_ids(file: Path, ids: pa.Array, vocab: pa.Array | None, read_as: str | None) -> None:
    """Raise ValueError (one line) unless `ids` (items.parquet's) are what export writes: row r's
    id is the item vocabulary's row r + 1 (null past it, or without a vocabulary), as text or an
    integer written so, and in the type the training column was read as where the encoder
    records it (`read_as`: text for a text column, even of digits). A package whose items name other
    ids than its vocabulary gave them back as recommendations of the model's rows.

    >>> check_item_ids(Path("items.parquet"), pa.array([12, None]), pa.array(["12"]), None)
    >>> check_item_ids(Path("items.parquet"), pa.array([12, None]), pa.array(["12"]), "string")
    Traceback (most recent call last):
    ...
    ValueError: items.parquet: its item ids are int64, where the training rows held the item column as string; export the run again
    """
    texts = ids.cast(pa.string())
    known = pa.array([], pa.string()) if vocab is None else vocab.cast(pa.string())[:len(ids)]
    want = pa.concat_arrays([known, pa.nulls(len(ids) - len(known), pa.string())])
    if not texts.equals(want):
        row = next(i for i, (a, b) in enumerate(zip(texts.to_pylist(), want.to_pylist())) if a != b)
        raise ValueError(f"{file}: its item ids are not the package's vocabulary of the item table (row {row} "
                         f"holds {ids[row].as_py()!r:.40}, the vocabulary {want[row].as_py()!r:.40}); export the run again")
    kind = id_type(read_as)
    if kind is not None and not (ids.type == kind or pa.types.is_string(kind) and pa.types.is_large_string(ids.type)):
        raise ValueError(f"{file}: its item ids are {ids.type}, where the training rows held the item column as "
                         f"{read_as}; export the run again")
