"""Serving a retrieval model: the query tower as the package's program, every item's vector, an index.

`flowrec export` of a run with a retrieval head writes, beside the usual package files:

- ``model.pt2``: the query tower: (dense, sparse of every feature but the item id) -> the query
  vectors (B, D) (`QueryTower`; torch alone runs it, as any package program);
- ``items.parquet``: one row per catalogue item (table rows 1 .. vocab): ``item`` (the raw item id
  the encoder maps to that row; null for a row no value was fitted to), ``row``, ``vector`` (its
  item-tower vector, float32);
- ``items.faiss`` (only with the ``ann`` extra, faiss-cpu, and index ``faiss``): an exact flat
  inner-product index of the vectors (unit-normalised first for a cosine metric);
- ``heads.pt2`` (only for a model with heads beside the retrieval head, e.g. an auxiliary binary
  head): (dense, sparse of every feature, the item id included) -> those heads' scores
  (`OtherHeads`), which `predict --top-k` writes beside each row's items.

The manifest's ``retrieval`` entry records the head, the metric and temperature, the dimension, the
items and the index kind (``exact`` or ``faiss_flat_ip``), and with heads beside the retrieval head
their names and program (``heads``); loading refuses a package whose index does not match it (kind,
metric, size or dimension), or whose heads are not the spec's.

Example:
    >>> pkg = load_model("pkg/tt")                 # doctest: +SKIP
    >>> pkg.recommend(users, k=10)                 # doctest: +SKIP
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from torch import nn

from flowrec.data.encoder_record import EncoderRecord
from flowrec.data.layout import is_multi
from flowrec.runtime.evaluation.scores import head_columns
from flowrec.runtime.retrieval import catalogue_ids, catalogue_vectors
from flowrec.serving.lookups import positions
from flowrec.serving.pt2_save import movable
from flowrec.serving.retrieval_index import HEADS_FILE, INDEX_FILE, ITEMS_FILE, faiss_module, for_index, id_type

EXAMPLE_BATCH = 4  # rows of the example inputs the query program is traced with (the batch is dynamic)


class QueryTower(nn.Module):
    """The query tower of a serving model: its retrieval head's query columns, the item id fed
    as row 0 (the item tower's output is dropped).  # -> (B, Dq)"""

    def __init__(self, serving: nn.Module, item_feature: str, columns: tuple[int, int]) -> None:
        super().__init__()
        self.serving, self.item_feature, self.columns = serving, item_feature, columns

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        b = dense.shape[0]
        item = (dense.new_zeros(b, dtype=torch.int64), positions(dense, b + 1))  # (on the inputs' device)
        out = self.serving(dense, {**sparse, self.item_feature: item})
        return out[:, self.columns[0]:self.columns[1]]


class OtherHeads(nn.Module):
    """The scores of the heads beside a serving model's retrieval head, side by side in head
    order (the retrieval head's query and item vectors left out).  # -> (B, sum of their widths)"""

    def __init__(self, serving: nn.Module, columns: tuple[tuple[int, int], ...]) -> None:
        super().__init__()
        self.serving, self.columns = serving, columns

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        out = self.serving(dense, sparse)
        return torch.cat([out[:, lo:hi] for lo, hi in self.columns], dim=1)


def _export(module: nn.Module, spec: Any, features: list[Any]) -> torch.export.ExportedProgram:
    """`torch.export` of `module` over (dense, sparse of `features`) with a dynamic batch and
    dynamic ids per feature."""
    batch = torch.export.Dim("batch", min=1, max=1 << 30)
    shapes = ({0: batch}, {f.name: ({0: torch.export.Dim(f"nnz_{i}", min=0, max=1 << 34)}, {0: batch + 1})
                           for i, f in enumerate(features)})
    b = EXAMPLE_BATCH
    example = {f.name: (torch.zeros(b * (2 if is_multi(f) else 1), dtype=torch.int64),
                        torch.arange(b + 1) * (2 if is_multi(f) else 1)) for f in features}
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):
        return movable(torch.export.export(module.eval(), (torch.zeros(b, len(spec.dense_features)), example),
                                           dynamic_shapes=shapes, strict=False))


@dataclass
class RetrievalExport:
    """What a retrieval run adds to its package (computed before the tables move to serving)."""

    head: str
    item_feature: str
    metric: str
    temperature: float
    vectors: np.ndarray  # (V, D) float32, item r at row r - 1
    raw_items: pa.Array  # (V,) raw item ids (`item_ids`: int64 or string; null where no value was fitted)
    index: str
    query_columns: tuple[int, int]
    other_heads: tuple[str, ...] = ()  # the heads beside the retrieval head, in head order
    other_columns: tuple[tuple[int, int], ...] = ()  # their columns of the serving model's output

    def query_features(self, spec: Any) -> list[Any]:
        return [f for f in spec.sparse_features if f.name != self.item_feature]

    def export_program(self, serving: nn.Module, spec: Any) -> torch.export.ExportedProgram:
        """`torch.export` of the query tower with a dynamic batch and dynamic ids per feature."""
        return _export(QueryTower(serving, self.item_feature, self.query_columns), spec, self.query_features(spec))

    def heads_program(self, serving: nn.Module, spec: Any) -> torch.export.ExportedProgram | None:
        """`torch.export` of the heads beside the retrieval head over every feature (None: none)."""
        if not self.other_heads:
            return None
        return _export(OtherHeads(serving, self.other_columns), spec, list(spec.sparse_features))

    def write(self, out: Path) -> dict[str, Any]:
        """items.parquet (and items.faiss); the manifest's `retrieval` entry."""
        vectors = pa.FixedSizeListArray.from_arrays(pa.array(self.vectors.reshape(-1), pa.float32()),
                                                    self.vectors.shape[1])
        rows = pa.array(np.arange(1, len(self.vectors) + 1, dtype=np.int64))
        pq.write_table(pa.table({"item": self.raw_items, "row": rows, "vector": vectors}), out / ITEMS_FILE)
        if self.index == "faiss_flat_ip":
            faiss = faiss_module()
            index = faiss.IndexFlatIP(self.vectors.shape[1])
            index.add(for_index(self.vectors, self.metric))
            faiss.write_index(index, str(out / INDEX_FILE))
        return {"head": self.head, "item_feature": self.item_feature, "metric": self.metric,
                "temperature": self.temperature, "dim": int(self.vectors.shape[1]),
                "items": len(self.vectors), "items_file": ITEMS_FILE,
                "index": {"kind": self.index, "file": INDEX_FILE if self.index == "faiss_flat_ip" else None},
                **({"heads": {"names": list(self.other_heads), "file": HEADS_FILE}} if self.other_heads else {})}


INDEX_CHOICES = ("auto", "exact", "faiss")  # `flowrec export --index`
INTEGER_ID = re.compile(r"^(0|-?[1-9][0-9]{0,18})$")  # an integer as a number column writes it (no 007, no +7)
WRITTEN_INTEGER = re.compile(r"^(0|-?[1-9][0-9]*)$")  # any integer so written (uint64's 20 digits too)


def item_ids(raw: list[str | None], read_as: str | None = None) -> pa.Array:
    """The raw item ids of items.parquet, in the type the training rows held them in: `read_as`,
    the Arrow type a Parquet source held the item column in (`EncoderRecord.id_types`): text for
    a string column, even of digits ("123", which int64 would no longer join back to), that
    integer type for an integer column. Without one (CSV rows, whose ids have no type but their
    spelling; a record of before types were recorded; a type of no id kind, as float or date)
    int64 where every fitted id is an integer as a number column writes it (MovieLens's, a CSV's
    integer column read by pandas: then ints, which join back to the rows' own int item column),
    else text (zero-padded ids, words). The vocabulary holds every id as text.

    >>> item_ids(["286", None, "-3"]).type, item_ids(["286", "007"]).type
    (DataType(int64), DataType(string))
    >>> item_ids(["286", "77"], "string").type, item_ids(["286", "77"], "int32").type
    (DataType(string), DataType(int32))
    """
    kind = id_type(read_as)
    if kind is not None and pa.types.is_string(kind):
        return pa.array(raw, pa.string())
    named = [v for v in raw if v is not None]
    if kind is not None and all(WRITTEN_INTEGER.match(v) for v in named):
        try:  # (an id past the recorded type: a hand-edited record; the guess below)
            return pa.array([None if v is None else int(v) for v in raw], kind)
        except (OverflowError, pa.ArrowInvalid):
            pass
    if named and all(INTEGER_ID.match(v) and -(1 << 63) <= int(v) < (1 << 63) for v in named):
        return pa.array([None if v is None else int(v) for v in raw], pa.int64())
    return pa.array(raw, pa.string())


def retrieval_export(trained: Any, encoder: EncoderRecord, index: str = "auto") -> RetrievalExport | None:
    """The retrieval part of a run's package (None without a retrieval head).

    Args:
        trained: the restored run (its lowered model still holds its packed tables).
        encoder: the run's encoder (the item table's vocabulary gives the raw ids).
        index: ``auto`` (faiss_flat_ip when faiss is importable, else exact), ``exact`` or ``faiss``.

    Raises:
        ValueError: an unknown index, ``exact`` or ``faiss`` for a run without a retrieval head, or
            ``faiss`` without faiss installed (one line).
    """
    if index not in INDEX_CHOICES:
        raise ValueError(f"index {index!r}: use auto, exact or faiss")
    binding = trained.model.retrieval
    if binding is None:
        if index != "auto":
            raise ValueError(f"index {index!r}: only a run with a retrieval head has an item index")
        return None
    if index == "faiss" and faiss_module() is None:
        raise ValueError("index faiss needs faiss-cpu: pip install 'flowrec[ann]' (or -c constraints.txt faiss-cpu)")
    kind = "exact" if index == "exact" or (index == "auto" and faiss_module() is None) else "faiss_flat_ip"
    vectors = catalogue_vectors(trained.model, binding).cpu().numpy().astype(np.float32)
    raw = catalogue_ids(encoder, binding.table, len(vectors)) or [None] * len(vectors)
    read_as = encoder.id_types.get(binding.item_feature)  # (none: a CSV's, or a record of before types)
    spec_head = trained.spec.heads[binding.head]
    columns = head_columns(trained.model.head_widths)[binding.head]
    start, half = columns.start, (columns.stop - columns.start) // 2
    others = [i for i in range(len(trained.spec.heads)) if i != binding.head]
    everything = head_columns(trained.model.head_widths)
    return RetrievalExport(spec_head.name, binding.item_feature, binding.attrs["metric"],
                           float(binding.attrs["temperature"]), vectors, item_ids(raw, read_as), kind,
                           (start, start + half), tuple(trained.spec.heads[i].name for i in others),
                           tuple((everything[i].start, everything[i].stop) for i in others))
