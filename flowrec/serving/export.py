"""`flowrec export`: write a model package (format: `flowrec.serving.package`) from a trained run.

Example:
    >>> report = write_package(trained, Path("pkg"), "fp32", encoder, metrics)  # doctest: +SKIP
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import shutil
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import pyarrow as pa
import torch

from flowrec.version import __version__
from flowrec.data.encoder_record import EncoderRecord, write_record
from flowrec.data.layout import is_multi
from flowrec.graph.plan_io import plan_json
from flowrec.serving.managed import Maps, maps_of, remap_inputs, write_maps
from flowrec.serving.package import (MANIFEST_FILE, MODEL_FILE, PACKAGE_FORMAT, PACKAGE_VERSION, PLAN_FILE,
                                     SPEC_FILE, encoded_inputs, file_digests)
from flowrec.serving.pt2_save import movable, save_program
from flowrec.serving.retrieval import retrieval_export
from flowrec.serving.retrieval_index import HEADS_FILE
from flowrec.serving.trained import ServingModel, Trained
from flowrec.spec.model import ModelSpec

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


def _example(spec: ModelSpec) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    b = EXAMPLE_BATCH
    sparse = {}
    for f in spec.sparse_features:
        per = 2 if is_multi(f) else 1
        sparse[f.name] = (torch.zeros(b * per, dtype=torch.int64), torch.arange(b + 1) * per)
    return torch.zeros(b, len(spec.dense_features)), sparse


def export_program(serving: ServingModel, spec: ModelSpec) -> torch.export.ExportedProgram:
    """`torch.export` of the serving model with a dynamic batch and dynamic ids per feature; no
    node makes or checks a tensor on a device fixed at export, and its constants move with
    `.to(device)` (`movable`), so the loaded module runs on the device its inputs and weights are on."""
    batch = torch.export.Dim("batch", min=1, max=1 << 30)
    shapes = ({0: batch}, {f.name: ({0: torch.export.Dim(f"nnz_{i}", min=0, max=1 << 34)}, {0: batch + 1})
                           for i, f in enumerate(spec.sparse_features)})
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):  # a batch of one row is no special case
        return movable(torch.export.export(serving.eval(), _example(spec), dynamic_shapes=shapes, strict=False))


@contextlib.contextmanager
def _tracing_quietly() -> Iterator[None]:
    """torch.export without its printouts of a failed trace: on a data-dependent guard (a custom
    module's `if x.sum() > 0:`) it printed the partial graph, a hundred lines, and a symbolic-shapes
    warning on stderr before the one-line error `flowrec export` gives. What a successful trace
    writes on stderr is written out after it."""
    shapes_log = logging.getLogger("torch.fx.experimental.symbolic_shapes")
    level = shapes_log.level
    shapes_log.setLevel(logging.ERROR)
    written = io.StringIO()
    try:
        with contextlib.redirect_stderr(written):
            yield
    finally:
        shapes_log.setLevel(level)
    sys.stderr.write(written.getvalue())


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
        index: a retrieval run's item index: auto, exact or faiss (`flowrec.serving.retrieval`).
    """
    started = time.perf_counter()
    spec = trained.spec
    out.mkdir(parents=True)
    retrieval = retrieval_export(trained, encoder, index)  # the catalogue, before the tables move
    maps = maps_of(trained.model)
    write_maps(maps, out)  # the managed maps: scoring remaps raw ids as evaluation does
    trained.model.managed = None
    serving = ServingModel(spec, trained.model, mapped)
    serving.requires_grad_(False)  # the program's scores then need no torch.no_grad() (.numpy() works)
    serving.eval()  # before a half dtype's comparison: no dropout, batch norm's running statistics kept
    diff, rows = _cast(serving, DTYPES[dtype], spec, compare, maps) if dtype != "fp32" else (None, 0)
    with _tracing_quietly():
        program = export_program(serving, spec) if retrieval is None else retrieval.export_program(serving, spec)
    save_program(program, out / MODEL_FILE)  # torch.export.save without a copy of each table
    del program
    if retrieval is not None and retrieval.other_heads:  # the heads beside the retrieval head: a second program
        with _tracing_quietly():
            program = retrieval.heads_program(serving, spec)
        save_program(program, out / HEADS_FILE)
        del program
    write_record(encoder, out, verified=encoder is trained.encoder)  # load_trained checked the run's vocabularies
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


def remove_partial(out: Path) -> None:
    """Remove a package folder a failed export left half written."""
    shutil.rmtree(out, ignore_errors=True)
