"""The model package of `flowrec export`: everything needed to score raw rows, torch alone for ids.

A package is a folder:

- ``model.pt2``: a `torch.export` program of the serving model (`ServingModel`) over encoded
  inputs, with a dynamic batch dimension; its embedding tables are one per packed group of
  plan.json (each group's tables one after another; version 2: one per logical table). Load it
  with ``torch.export.load(path).module()`` (no flowrec import) and call it with ``dense``
  (B, n_dense) float32 in spec order and ``sparse``, a dict feature -> (ids, offsets): int64
  table-local ids (nnz,) and bag boundaries (B + 1,), one bag per sample. It returns
  (B, n_heads): probabilities for binary heads, values for regression.
- ``encoder.json`` + ``vocab/``: the encoder that turns raw columns into those inputs.
- ``spec.json``, ``plan.json``: the spec and the plan the run was trained with.
- ``managed/<table>.parquet``: for managed tables, the raw ids holding a row and their rows
  (`flowrec.serving.managed`); scoring remaps raw ids with them as evaluation does.
- ``manifest.json``: format, flowrec and torch versions, encoder fingerprint, table dtype, the
  inputs in order, the heads, the run's last evaluation metrics and the SHA-256 of every other file
  (``files``): `verify_files` refuses a package any of whose files changed, before any is read.

The format and its checks live here, apart from the writer (`flowrec.serving.export`), so that
scoring a package (`flowrec.serving.predict`) imports nothing of the training runtime.

Example:
    >>> verify_files(Path("pkg"), read_manifest(Path("pkg")), [MODEL_FILE])  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from flowrec.data.layout import is_multi
from flowrec.data.names import inside
from flowrec.spec.json_doc import read_json_document, version_problem
from flowrec.spec.model import ModelSpec
from flowrec.spec.schema_errors import schema_issues
from flowrec.spec.schemas import MODEL_PACKAGE_SCHEMA, load_schema

PACKAGE_FORMAT = "flowrec-model"
PACKAGE_VERSION = 3  # 2: manifest.json records the digest of every file; 3: a table per packed group
READ_VERSIONS = (2, 3)  # the package versions this flowrec loads (a version 2 program: a table per logical table)
MODEL_FILE = "model.pt2"
MANIFEST_FILE = "manifest.json"
SPEC_FILE = "spec.json"
PLAN_FILE = "plan.json"
TABLE_PARAMETER = re.compile(r"(?:serving\.)?tables\.(\d+)")  # ServingModel.tables[i] (QueryTower.serving's)


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


def planned_tables(folder: Path, spec: ModelSpec, version: int = PACKAGE_VERSION) -> list[tuple[str, int, int]]:
    """(what, rows, dim) of the embedding tables of a package's program, in the program's order
    (`ServingModel.tables`: one per group of plan.json, its tables one after another; in a
    `version` 2 package one per logical table, the groups' tables in turn), sized by the spec;
    `what` names the table in words. Raises ValueError (one line) unless plan.json names each of
    the spec's tables once, each group's of one dim."""
    path = Path(folder) / PLAN_FILE
    doc = read_json_document(path)
    groups = doc.get("groups") if isinstance(doc, dict) else None
    layout: list[tuple[str, list[str | None]]] = []
    for group in groups if isinstance(groups, list) else []:
        group = group if isinstance(group, dict) else {}
        slots = group.get("tables") if isinstance(group.get("tables"), list) else []
        names = [slot.get("table") if isinstance(slot, dict) else None for slot in slots]
        layout.append((str(group.get("name")), [name if isinstance(name, str) else None for name in names]))
    names = [name for _, tables in layout for name in tables]
    known = {t.name: t for t in spec.tables}
    if len(names) != len(known) or set(names) != set(known) or \
            any(len({known[t].dim for t in tables}) != 1 for _, tables in layout if tables):
        raise ValueError(f"{path} does not fit the package's spec.json: it does not lay out the spec's "
                         f"{len(known)} tables; export the run again")
    if version < 3:
        return [(f"the spec's table {name!r}", known[name].rows, known[name].dim) for name in names]
    return [(f"plan.json's group {group!r} ({_few(tables)})", sum(known[t].rows for t in tables), known[tables[0]].dim)
            for group, tables in layout if tables]


def _few(tables: list[str]) -> str:
    """A group's tables in words, the first three named."""
    named = ", ".join(repr(t) for t in tables[:3])
    return f"table {named}" if len(tables) == 1 else \
        f"tables {named}{f' and {len(tables) - 3} more' if len(tables) > 3 else ''}"


def check_program(program: torch.export.ExportedProgram, spec: ModelSpec, sparse: list[str], width: int,
                  path: Path, tables: list[tuple[str, int, int]]) -> None:
    """Raise ValueError (one line) unless the exported `program` read from `path` is called as
    this package's spec says: `(dense, {feature: (ids, offsets)})` with the features `sparse` in
    order and one dense column per dense feature, returning (B, `width`): the heads' scores, or a
    retrieval package's query vectors (as wide as its items' vectors); and unless its embedding
    tables are `tables` (`planned_tables`: (what, rows, dim) in the program's order).
    A model.pt2 of another export (its digest entered in the manifest by hand) is refused here
    rather than by torch's pytree message at the first call, or its index error at a lookup past
    a table's end (or scores of another model's tables without a word)."""
    from torch.utils import _pytree

    leaf = torch.empty(0)
    wanted = _pytree.tree_structure(((leaf, {name: (leaf, leaf) for name in sparse}), {}))
    problem = None
    if program.call_spec.in_spec != wanted:
        problem = f"it does not take the spec's sparse features {sparse}"
    else:
        values = {n.name: n.meta.get("val") for n in program.graph.nodes if n.op == "placeholder"}
        dense = values.get(program.graph_signature.user_inputs[0])
        outputs = [a.meta.get("val") for n in program.graph.nodes if n.op == "output" for a in n.args[0]
                   if hasattr(a, "meta")]
        if dense is None or dense.dim() != 2 or dense.shape[1] != len(spec.dense_features):
            problem = f"it does not take the spec's {len(spec.dense_features)} dense features"
        elif len(outputs) != 1 or outputs[0] is None or outputs[0].dim() != 2 or outputs[0].shape[1] != width:
            problem = f"it does not return the {width} values per row of the package's heads"
        else:
            problem = _table_problem(program, tables)
    if problem:
        raise ValueError(f"{path} does not fit the package's spec.json: {problem} (a model.pt2 of another "
                         "export?); export the run again")


def _table_problem(program: torch.export.ExportedProgram, tables: list[tuple[str, int, int]]) -> str | None:
    """How the program's embedding tables (parameters `tables.<i>`, under `serving.` in a retrieval
    package's query tower) differ from `tables`, in words; None when they do not."""
    found = {int(m.group(1)): tuple(t.shape) for name, t in program.state_dict.items()
             if (m := TABLE_PARAMETER.fullmatch(name))}
    if sorted(found) != list(range(len(tables))):
        return f"it holds {len(found)} embedding tables, not the package's {len(tables)}"
    for i, (what, rows, dim) in enumerate(tables):
        if found[i] != (rows, dim):
            shape = " x ".join(map(str, found[i]))
            return f"its table {i} is {shape}, not {what} ({rows} x {dim})"
    return None


def read_manifest(folder: Path) -> dict[str, Any]:
    """The manifest of a package folder. Raises ValueError (one line) when it is not a package of
    this format version."""
    path = Path(folder) / MANIFEST_FILE
    if Path(folder).is_file() and (Path(folder).parent / MANIFEST_FILE).is_file():
        # PKG/model.pt2 (or another file of a package) given for the package: name its folder
        raise ValueError(f"{folder} is a file of a model package; give the package's folder, {Path(folder).parent}")
    try:
        doc = read_json_document(path)
    except ValueError as exc:
        from flowrec.data.owners import owner_of

        owner = owner_of(Path(folder)) if Path(folder).is_dir() else None
        owner = None if owner == "a model package" else owner  # (its manifest is what failed)
        if owner == "a training run":  # the most common slip: the run for its export
            raise ValueError(f"{folder} is a training run's folder, not a flowrec model package: export it "
                             f"(`flowrec export {folder} OUT/`) and give OUT") from None
        whose = f"{owner}'s folder, not" if owner else "not"  # a dataset's, an encoder's
        raise ValueError(f"{folder} is {whose} a flowrec model package (no "
                         f"readable {MANIFEST_FILE}: {exc}); make one with `flowrec export RUN OUT/`") from None
    if not isinstance(doc, dict) or doc.get("format") != PACKAGE_FORMAT:
        raise ValueError(f"{path} is not a flowrec model package manifest")
    if problem := version_problem(doc.get("version"), READ_VERSIONS):
        raise ValueError(f"{path}: package format {problem}; export the run again with this flowrec")
    from jsonschema import Draft202012Validator

    errors = sorted(Draft202012Validator(load_schema(MODEL_PACKAGE_SCHEMA)).iter_errors(doc),
                    key=lambda e: list(map(str, e.absolute_path)))
    if errors:
        issue = schema_issues(errors[0])[0]
        words = issue.message.split("; ")[0]  # not a spec's hint ("quote it to keep it as text")
        raise ValueError(f"{path}: {f'{issue.path} ' if issue.path else ''}{words} (a damaged or edited manifest; "
                         "export the run again)")
    return doc


def check_manifest_fits(manifest: dict[str, Any], spec: ModelSpec, path: Path) -> None:
    """Raise ValueError (one line) unless the manifest's inputs and heads are those of the package's
    spec.json, in order: a user calling model.pt2 with torch alone reads the order of its dense
    inputs from ``inputs.dense``, and the heads from ``heads``."""
    expected = {"inputs.dense": [f.name for f in spec.dense_features],
                "inputs.sparse": [f.name for f in spec.sparse_features],
                "heads": [{"name": h.name, "task": h.task} for h in spec.heads]}
    found = {"inputs.dense": manifest["inputs"]["dense"], "inputs.sparse": manifest["inputs"]["sparse"],
             "heads": [{"name": h["name"], "task": h["task"]} for h in manifest["heads"]]}
    for key, value in expected.items():
        if found[key] != value:
            raise ValueError(f"{path / MANIFEST_FILE}: {key} is not spec.json's "
                             f"({str(found[key])[:80]} where the spec has {str(value)[:80]}); export the run again")


def check_table_dtype(manifest: dict[str, Any], program: torch.export.ExportedProgram, path: Path) -> None:
    """Raise ValueError (one line) unless the program's embedding tables are of the manifest's
    ``dtype`` and hold its ``table_bytes``."""
    tables = [t for name, t in program.state_dict.items() if TABLE_PARAMETER.fullmatch(name)]
    dtypes = {str(t.dtype).removeprefix("torch.") for t in tables}
    named = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}[manifest["dtype"]]
    size = sum(t.numel() * t.element_size() for t in tables)
    if tables and dtypes != {named}:
        raise ValueError(f"{path / MANIFEST_FILE}: dtype {manifest['dtype']!r} is not that of model.pt2's tables "
                         f"({', '.join(sorted(dtypes))}); export the run again")
    if size != manifest["table_bytes"]:
        raise ValueError(f"{path / MANIFEST_FILE}: table_bytes {manifest['table_bytes']:,} is not what model.pt2's "
                         f"tables hold ({size:,}); export the run again")


def file_digests(folder: Path) -> dict[str, str]:
    """SHA-256 of every file of a package folder but its manifest, by path relative to it."""
    folder = Path(folder)
    return {str(p.relative_to(folder)): _sha256(p) for p in sorted(folder.rglob("*"))
            if p.is_file() and p.name != MANIFEST_FILE}


def verify_files(folder: Path, manifest: dict[str, Any], needed: list[str]) -> None:
    """Raise ValueError (one line) unless every file the manifest lists (and each of `needed`) is a
    plain file inside `folder` whose SHA-256 is the recorded one. Every listed file is read once:
    a file needed later (named by one read since) need only be listed (`require_listed`)."""
    listed = require_listed(folder, manifest, needed)
    for name, digest in listed.items():
        path = inside(Path(folder), name, f"file {name!r} of the manifest")
        if not path.is_file():  # a folder or a pipe under that name was said missing, though listed there
            raise ValueError(f"{path} is missing (the package is incomplete)" if not path.exists() else
                             f"{path} is not a regular file ({'a folder' if path.is_dir() else 'a pipe or a device'}): "
                             "the package is damaged; export the run again")
        if _sha256(path) != digest:
            raise ValueError(f"{path} does not match the digest its manifest records (changed or damaged)")


def require_listed(folder: Path, manifest: dict[str, Any], needed: list[str]) -> dict[str, str]:
    """The manifest's file digests; ValueError (one line) unless it records them and lists each of
    `needed` (whose digests `verify_files` checked with every listed file's)."""
    listed = manifest.get("files")
    if not isinstance(listed, dict) or not all(isinstance(d, str) for d in listed.values()):
        raise ValueError(f"{Path(folder) / MANIFEST_FILE} records no file digests")
    for name in needed:
        if name not in listed:
            raise ValueError(f"{folder}: {name} is not among the files its manifest records")
    return listed


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


