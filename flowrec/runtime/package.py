"""The model package of `flowrec export`: everything needed to score raw rows, torch alone for ids.

A package is a folder:

- ``model.pt2``: a `torch.export` program of the serving model (`ServingModel`) over encoded
  inputs, with a dynamic batch dimension. Load it with ``torch.export.load(path).module()`` (no
  flowrec import) and call it with ``dense`` (B, n_dense) float32 in spec order and ``sparse``, a
  dict feature -> (ids, offsets): int64 table-local ids (nnz,) and bag boundaries (B + 1,), one
  bag per sample. It returns (B, n_heads): probabilities for binary heads, values for regression.
- ``encoder.json`` + ``vocab/``: the encoder that turns raw columns into those inputs.
- ``spec.json``, ``plan.json``: the spec and the plan the run was trained with.
- ``managed/<table>.parquet``: for managed tables, the raw ids holding a row and their rows
  (`flowrec.runtime.managed_serving`); scoring remaps raw ids with them as evaluation does.
- ``manifest.json``: format, flowrec and torch versions, encoder fingerprint, table dtype, the
  inputs in order, the heads, the run's last evaluation metrics and the SHA-256 of every other file
  (``files``): `verify_files` refuses a package any of whose files changed, before any is read.

Example:
    >>> report = write_package(trained, Path("pkg"), "fp32", metrics, run=Path("runs/ml"))  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import torch

from flowrec.version import __version__
from flowrec.data.encoder_record import EncoderRecord, write_record
from flowrec.data.layout import is_multi
from flowrec.data.names import inside
from flowrec.graph.plan_io import plan_json
from flowrec.runtime.managed_serving import Maps, maps_of, remap_inputs, write_maps
from flowrec.runtime.pt2_save import save_program
from flowrec.runtime.retrieval_serving import retrieval_export
from flowrec.runtime.serving import ServingModel, Trained
from flowrec.spec.json_doc import read_json_document
from flowrec.spec.model import ModelSpec

PACKAGE_FORMAT = "flowrec-model"
PACKAGE_VERSION = 2  # 2: manifest.json records the digest of every file
MODEL_FILE = "model.pt2"
MANIFEST_FILE = "manifest.json"
SPEC_FILE = "spec.json"
PLAN_FILE = "plan.json"
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
EXAMPLE_BATCH = 4  # rows of the example inputs the program is traced with (the batch is dynamic)


@dataclass(frozen=True)
class ExportReport:
    """What an export wrote and measured."""

    out: str
    seconds: float
    table_bytes: int  # bytes of the embedding tables in the package (at its dtype)
    max_score_diff: float | None  # largest |score - fp32 score| over the compared rows (half dtypes)
    compared_rows: int  # rows max_score_diff was measured on


def encoded_inputs(spec: ModelSpec, table: pa.Table) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """The model's inputs from an encoded table (the flowrec layout): dense (B, n_dense), and per
    sparse feature (ids (nnz,), offsets (B + 1,))."""
    n = table.num_rows
    dense = [table.column(f.name).to_numpy().astype(np.float32) for f in spec.dense_features]
    dense_t = torch.from_numpy(np.stack(dense, axis=1)) if dense else torch.zeros(n, 0)
    sparse = {}
    for f in spec.sparse_features:
        col = table.column(f.name).combine_chunks()
        if is_multi(f):
            offsets = col.offsets.to_numpy().astype(np.int64)
            ids = col.values.to_numpy().astype(np.int64)[offsets[0]: offsets[-1]]
            sparse[f.name] = (torch.from_numpy(ids), torch.from_numpy(offsets - offsets[0]))
        else:
            sparse[f.name] = (torch.from_numpy(col.to_numpy().astype(np.int64)), torch.arange(n + 1))
    return dense_t, sparse


def _example(spec: ModelSpec) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    b = EXAMPLE_BATCH
    sparse = {}
    for f in spec.sparse_features:
        per = 2 if is_multi(f) else 1
        sparse[f.name] = (torch.zeros(b * per, dtype=torch.int64), torch.arange(b + 1) * per)
    return torch.zeros(b, len(spec.dense_features)), sparse


def export_program(serving: ServingModel, spec: ModelSpec) -> torch.export.ExportedProgram:
    """`torch.export` of the serving model with a dynamic batch and dynamic ids per feature."""
    batch = torch.export.Dim("batch", min=1, max=1 << 30)
    shapes = ({0: batch}, {f.name: ({0: torch.export.Dim(f"nnz_{i}", min=0, max=1 << 34)}, {0: batch + 1})
                           for i, f in enumerate(spec.sparse_features)})
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # a batch of one row is no special case
        return torch.export.export(serving.eval(), _example(spec), dynamic_shapes=shapes, strict=False)


def write_package(trained: Trained, out: Path, dtype: str, encoder: EncoderRecord, metrics: dict[str, Any],
                  compare: Iterator[pa.Table] | None = None, mapped: bool = False, index: str = "auto") -> ExportReport:
    """Write the model package of a trained model into the (new, empty) folder `out`.

    Args:
        trained: the restored run.
        out: the package folder (created).
        dtype: table dtype, fp32, fp16 or bf16.
        encoder: the run's encoder.
        metrics: the run's last evaluation metrics (head -> metric -> value).
        compare: encoded tables to measure the largest score difference of a half dtype on.
        mapped: the trained tables are mapped from the checkpoint file (`load_trained(mmap=True)`).
        index: a retrieval run's item index: auto, exact or faiss (`retrieval_serving`).
    """
    started = time.perf_counter()
    spec = trained.spec
    out.mkdir(parents=True)
    retrieval = retrieval_export(trained, encoder, index)  # the catalogue, before the tables move
    maps = maps_of(trained.model)
    write_maps(maps, out)  # the managed maps: scoring remaps raw ids as evaluation does
    trained.model.managed = None
    serving = ServingModel(spec, trained.model, mapped)
    diff, rows = _cast(serving, DTYPES[dtype], spec, compare, maps) if dtype != "fp32" else (None, 0)
    program = export_program(serving, spec) if retrieval is None else retrieval.export_program(serving, spec)
    save_program(program, out / MODEL_FILE)  # torch.export.save without a copy of each table
    del program
    write_record(encoder, out)
    from flowrec.spec.load import to_dict

    (out / SPEC_FILE).write_text(json.dumps(to_dict(spec), indent=2, sort_keys=True) + "\n")
    (out / PLAN_FILE).write_text(plan_json(trained.plan) + "\n")
    table_bytes = sum(t.numel() * t.element_size() for t in serving.tables)
    manifest = _manifest(spec, dtype, encoder, metrics, table_bytes, diff, rows)
    if retrieval is not None:
        manifest["retrieval"] = retrieval.write(out)
    manifest["files"] = file_digests(out)
    (out / MANIFEST_FILE).write_text(json.dumps(manifest, indent=2, sort_keys=True) + "\n")
    return ExportReport(str(out), time.perf_counter() - started, table_bytes, diff, rows)


def _manifest(spec: ModelSpec, dtype: str, encoder: EncoderRecord, metrics: dict[str, Any],
              table_bytes: int, diff: float | None, rows: int) -> dict[str, Any]:
    return {
        "format": PACKAGE_FORMAT, "version": PACKAGE_VERSION, "flowrec_version": __version__,
        "torch_version": torch.__version__, "encoder_fingerprint": encoder.fingerprint, "dtype": dtype,
        "table_bytes": table_bytes, "model": MODEL_FILE, "spec_name": spec.name,
        "inputs": {"dense": [f.name for f in spec.dense_features],
                   "sparse": [f.name for f in spec.sparse_features]},
        "heads": [{"name": h.name, "task": h.task} for h in spec.heads],
        "metrics_at_export": metrics,
        "half_max_score_diff": None if diff is None else {"value": diff, "rows": rows},
    }


def _cast(serving: ServingModel, dtype: torch.dtype, spec: ModelSpec,
          compare: Iterator[pa.Table] | None, maps: Maps | None = None) -> tuple[float, int]:
    """Cast the tables to `dtype`; the largest |score - fp32 score| over the compared rows (4096
    random rows when no evaluation data is given) and their count."""
    with torch.no_grad():
        inputs = list(_comparison_inputs(spec, compare))
        if compare is not None:  # encoded rows: managed features hold raw ids
            inputs = [(d, remap_inputs(spec, s, maps or {})) for d, s in inputs]
        reference = [serving(dense, sparse) for dense, sparse in inputs]
        serving.cast_tables(dtype)
        worst = max(float((serving(d, s) - r).abs().max()) for (d, s), r in zip(inputs, reference))
    return worst, sum(d.shape[0] for d, _ in inputs)


def _comparison_inputs(spec: ModelSpec, compare: Iterator[pa.Table] | None) -> Iterator[tuple]:
    if compare is not None:
        for table in compare:
            yield encoded_inputs(spec, table)
        return
    gen = torch.Generator().manual_seed(0)
    n = 4096
    dense = torch.randn(n, len(spec.dense_features), generator=gen)
    sparse = {}
    for f in spec.sparse_features:
        per = f.max_len if is_multi(f) else 1
        ids = torch.randint(0, spec.table(f.table).rows, (n * per,), generator=gen)
        sparse[f.name] = (ids, torch.arange(n + 1) * per)
    yield dense, sparse


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a package folder. Raises ValueError (one line) when it is not a package of
    this format version."""
    path = Path(folder) / MANIFEST_FILE
    try:
        doc = read_json_document(path)
    except ValueError as exc:
        raise ValueError(f"{folder} is not a flowrec model package (no readable {MANIFEST_FILE}: {exc}); "
                         "make one with `flowrec export RUN OUT/`") from None
    if not isinstance(doc, dict) or doc.get("format") != PACKAGE_FORMAT:
        raise ValueError(f"{path} is not a flowrec model package manifest")
    if doc.get("version") != PACKAGE_VERSION:
        raise ValueError(f"{path}: package format version {doc.get('version')!r} (this flowrec reads "
                         f"version {PACKAGE_VERSION}); export the run again with this flowrec")
    return doc


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a package folder but its manifest, by path relative to it."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST_FILE}


def verify_files(folder: Path, manifest: dict[str, Any], needed: list[str]) -> None:
    """Raise ValueError (one line) unless every file the manifest lists (and each of `needed`) is a
    plain file inside `folder` whose SHA-256 is the recorded one."""
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(isinstance(d, str) for d in listed.values()):
        raise ValueError(f"{Path(folder) / MANIFEST_FILE} records no file digests")
    for name in needed:
        if name not in listed:
            raise ValueError(f"{folder}: {name} is not among the files its manifest records")
    for name, digest in listed.items():
        path = inside(Path(folder), name, f"file {name!r} of the manifest")
        if not path.is_file():
            raise ValueError(f"{path} is missing (the package is incomplete)")
        if _sha256(path) != digest:
            raise ValueError(f"{path} does not match the digest its manifest records (changed or damaged)")


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def remove_partial(out: Path) -> None:
    """Remove a package folder a failed export left half written."""
    shutil.rmtree(out, ignore_errors=True)
