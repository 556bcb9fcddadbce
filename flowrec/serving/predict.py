"""Scoring raw rows with a model package: `load_model(path).predict(table)`.

A `LoadedModel` holds the package's exported program (`torch.export.load`), its spec and its
encoder. `predict` encodes raw columns exactly as the training data was encoded (the run's
vocabularies, hash rule, fills and statistics; unseen values go to row 0 or their hash bucket)
and returns one score per head per row: probabilities for binary heads, values for regression.

Example:
    >>> model = load_model("pkg/ml")  # doctest: +SKIP
    >>> model.predict(pd.DataFrame({"user_id": [1], "item_id": [50], ...}))  # doctest: +SKIP
"""
from __future__ import annotations

import datetime
import numbers
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import torch

from flowrec.data.close_names import close_name
from flowrec.data.empty_columns import EmptyColumns
from flowrec.data.encode import Encoder, UnseenIds
from flowrec.data.encoder_record import (ENCODER_FILE, EncoderRecord, load_encoder, read_record,
                                         tables_without_vocabulary)
from flowrec.data.layout import DataError, is_multi
from flowrec.data.look_alike import look_alike_note, look_alikes
from flowrec.data.output_guard import identity
from flowrec.data.raw_ids import check_float_ids, check_ids
from flowrec.data.separators import check_sequence_separators, header_separator
from flowrec.data.sources import FLOAT32_MAX, LINE_COLUMN
from flowrec.serving.frames import frame_table
from flowrec.serving.managed import MANAGED_DIR, Maps, read_maps, remap_inputs
from flowrec.serving.package import (MODEL_FILE, PLAN_FILE, SPEC_FILE, check_manifest_fits, check_program,
                                     check_table_dtype, encoded_inputs, planned_tables, read_manifest,
                                     require_listed, verify_files)
from flowrec.serving.pt2_check import check_archive
from flowrec.serving.pt2_load import load_program
from flowrec.serving.pt2_module import program_module
from flowrec.serving.retrieval_index import HEADS_FILE, ITEMS_FILE, ItemIndex, load_items
from flowrec.spec.json_doc import read_json_document
from flowrec.spec.load import spec_from_dict
from flowrec.spec.model import ModelSpec
from flowrec.spec.validate import validate_document

BATCH_ROWS = 65_536  # rows scored per call of the program, at most
CALL_BYTES = 256 << 20  # bytes of looked-up embedding rows per call (fp32), at most one row's more


def call_rows(spec: ModelSpec) -> int:
    """Rows per call of the program: `BATCH_ROWS`, fewer where a row's looked-up embeddings are wide.
    The program holds them about three times over (lookups, a group's stack, the dense input's
    concat): a 1,000-field model (10,743 floats a row) took 2.8 GB each at 65,536 rows, 11.6 GB
    at the peak of predict; 6,246 rows a call hold 256 MB each.

    >>> from flowrec.testing.specs import csv_spec
    >>> call_rows(csv_spec("w"))
    65536
    """
    dims = {t.name: t.dim for t in spec.tables}
    width = sum(dims[f.table] * (f.max_len if f.pooling == "none" else 1) for f in spec.sparse_features)
    return max(1, min(BATCH_ROWS, CALL_BYTES // (4 * max(1, width))))
ROWS = "the rows"  # how the rows given to predict are named in its warnings
EMPTY_HINT = "the scores read nothing from it; a lost or mistyped column?"


@dataclass
class LoadedModel:
    """A model package loaded for scoring.

    Args:
        path: the package folder.
        spec: the model spec.
        record: the encoder record (rules, fingerprint).
        encoder: the encoder applying it to raw tables.
        program: the exported program's module: (dense, sparse) -> (B, n_heads), without torch's
            guards (`program_module`): it refuses float ids, a dense input that is not float32
            (B, n_dense), and (`InputShapes`, before the program runs) inputs of another number of
            dimensions and offsets that are not one more than the dense rows, each in one line.
        manifest: the package manifest.
        maps: the maps of managed tables (`flowrec.serving.managed`).
    """

    path: Path
    spec: ModelSpec
    record: EncoderRecord
    encoder: Encoder
    program: torch.nn.Module
    manifest: dict[str, Any]
    maps: Maps = field(default_factory=dict)
    items: ItemIndex | None = None  # a retrieval package's items: the program is its query tower
    heads_program: torch.nn.Module | None = None  # a retrieval package's heads beside the retrieval head
    zero_queries: int = 0  # rows `recommend` met whose query vector is all zeros (their items tie)
    first_zero_query: int | None = None  # the first such row, counted over every `recommend` call
    _recommended: int = 0  # rows `recommend` has scored (for first_zero_query)
    unseen: UnseenIds | None = None  # the ids of the rows scored that the vocabularies hold in another form
    warn_unseen: bool = True  # a UserWarning per call whose ids are in another form (predict: a line at the end)
    empty: EmptyColumns | None = None  # the feature columns of the rows scored that held no value in any row
    warn_empty: bool = True  # a UserWarning per call with such a column (predict: a line at the end)

    def __repr__(self) -> str:
        """One line a notebook can show: the package, its spec's name, heads and the raw columns
        `predict` reads (the dataclass's repr printed the spec, manifest and program, 6,000+ characters)."""
        return (f"LoadedModel({str(self.path)!r}, spec={self.spec.name!r}, heads={self.heads}, "
                f"raw_columns={self.raw_columns()}{', retrieval' if self.items is not None else ''})")

    @property
    def heads(self) -> list[str]:
        return [h.name for h in self.spec.heads]

    def raw_columns(self) -> list[str]:
        """The raw columns `predict` reads (feature sources; a retrieval package's query features)."""
        item = self.manifest["retrieval"]["item_feature"] if self.items is not None else None
        return [self.encoder.source(f.name) for f in self.spec.features if f.name != item]

    @property
    def other_heads(self) -> list[Any]:
        """The heads a retrieval package scores beside its items (`heads_program`; none without)."""
        return [h for h in self.spec.heads if h.task != "retrieval"] if self.heads_program is not None else []

    def recommend(self, table: pa.Table | pd.DataFrame, k: int) -> pd.DataFrame:
        """A retrieval package's k best items for each raw row: columns ``items`` (raw item ids,
        best first) and ``scores`` (similarity over temperature), lists per row, then one column
        per head beside the retrieval head (`other_heads`: its score of the row, as `predict`
        gives it, the row's own item read when it has the item column, else an unknown item),
        indexed as `predict`'s scores (a DataFrame's own index).

        A row whose query vector is all zeros (an attention encoder over an empty history outputs
        zeros) scores every item 0: its k items are arbitrary, not recommendations. Such rows are
        counted in `zero_queries` (the first one's row, over all calls, in `first_zero_query`);
        `flowrec predict --top-k` reports them.

        Raises:
            ValueError: the package has no retrieval head, `k` is not a whole number of at least 1
                (`flowrec predict --top-k`'s bound), or its program refuses the rows (`_call`).
            DataError: a raw column the query tower needs is missing (as `predict`).
        """
        if self.items is None:
            raise ValueError(f"{self.path} has no retrieval head (its heads {', '.join(self.heads)} score rows: "
                             "model.predict(rows) gives their scores); recommend needs a package of a retrieval run")
        # k=-1, 2.5 or None were torch's errors naming no k, k=0 empty lists of items
        if isinstance(k, bool) or not isinstance(k, numbers.Integral) or k < 1:
            raise ValueError(f"k must be a whole number of items, at least 1, not {k!r:.40}")
        k = int(k)  # (numpy's integers too)
        raw = raw_table(table)
        self._check_raw(raw, isinstance(table, pd.DataFrame))
        item = self.manifest["retrieval"]["item_feature"]
        source = self.encoder.source(item)
        if source in raw.column_names and self.heads_program is None:  # not an input of the query tower
            raw = raw.drop_columns([source])
        if source not in raw.column_names:  # (the heads beside it read the row's item where it is given)
            raw = raw.append_column(source, pa.nulls(raw.num_rows, pa.string()))
        encoded = self.encoder.encode(raw, labels=False)
        self._count_unseen(raw, encoded)
        self._count_empty(raw)
        rows, scores, others = [], [], []
        with torch.no_grad():
            step = call_rows(self.spec)
            for start in range(0, encoded.num_rows, step):
                dense, sparse = encoded_inputs(self.spec, encoded.slice(start, step))
                sparse = remap_inputs(self.spec, sparse, self.maps)
                if self.heads_program is not None:
                    others.append(self._call(dense, sparse, self.heads_program, HEADS_FILE).numpy())
                del sparse[item]
                query = self._call(dense, sparse)
                self._count_zero_queries(query)
                best, values = self.items.top_k(query, k)
                rows.append(best)
                scores.append(values)
        best = np.concatenate(rows) if rows else np.zeros((0, k), np.int64)
        values = np.concatenate(scores) if scores else np.zeros((0, k), np.float32)
        names = self.items.raw_items
        out = {"items": [[names[r] for r in row] for row in best], "scores": list(values)}
        width = sum(h.width for h in self.other_heads)
        out.update(_head_columns(self.other_heads, np.concatenate(others) if others else np.zeros((0, width),
                                                                                               np.float32)))
        return pd.DataFrame(out, index=row_index(table))

    def _count_unseen(self, raw: pa.Table, encoded: pa.Table) -> None:
        """Count the unknown ids of a call's rows (`unseen_ids`); warn where the call's rows write
        most of a feature's ids in another form than the vocabulary (`UnseenIds.lines`)."""
        call = UnseenIds(self.encoder, _keys=self.unseen_ids()._keys)  # each vocabulary's keys made once
        call.observe(raw, encoded)
        self.unseen_ids().add(call)
        if self.warn_unseen:
            _warn(call.lines())

    def _count_empty(self, raw: pa.Table) -> None:
        """Count the feature columns of a call's rows that hold no value (null, blank, NaN) in any row
        (`empty_columns`); warn of each one the call's rows leave empty: every row gets the missing id
        (or the dense fill) there, so the scores read nothing from that column."""
        call = self._empty_counter()
        call.observe(ROWS, raw)
        self.empty_columns().add(call)
        if self.warn_empty:
            _warn(few_lines(call.lines()))

    def empty_columns(self) -> EmptyColumns:
        """The feature columns over every `predict` and `recommend` call's rows: its `lines()` name each
        one that held no value in any row (a column holding one value is no fault: one user's rows)."""
        if self.empty is None:
            self.empty = self._empty_counter()
        return self.empty

    def _empty_counter(self) -> EmptyColumns:
        read = set(self.raw_columns())  # (once: a 1,000-field model asked it per feature)
        features = [f.name for f in self.spec.features if self.encoder.source(f.name) in read]
        return EmptyColumns(self.spec, self.encoder.columns, features, one_value=False, hint=EMPTY_HINT)

    def unseen_ids(self) -> UnseenIds:
        """The count of unknown ids over every `predict` and `recommend` call (`UnseenIds`): its
        `lines()` say where the rows write the ids in another form than training did."""
        if self.unseen is None:
            self.unseen = UnseenIds(self.encoder)
        return self.unseen

    def _count_zero_queries(self, query: torch.Tensor) -> None:
        zero = (query == 0).all(dim=1)
        found = int(zero.sum())
        if found and self.first_zero_query is None:
            self.first_zero_query = self._recommended + int(zero.nonzero()[0, 0])
        self.zero_queries += found
        self._recommended += query.shape[0]

    def _check_raw(self, raw: pa.Table, frame: bool = False) -> None:
        """Raise DataError unless raw rows can be encoded: every column the model reads, finite dense
        values, a vocabulary for every vocabulary table (a run on synthetic data has none); with
        `frame` (the rows came as a pandas DataFrame) no float id that float64 may have rounded, nor a
        fraction; else (Arrow rows, a Parquet file's) no float id that the float may have rounded."""
        present = set(raw.column_names)  # (once: Arrow builds the list anew at each ask, per feature of 1,000)
        read = self.raw_columns()
        missing = [c for c in read if c not in present]
        if missing:
            read = set(read)
            raise DataError(f"the rows lack columns {named_columns(missing)} that model {self.spec.name!r} reads"
                            f"{close_columns(missing, [c for c in raw.column_names if c not in read])}"
                            f"{separator_note(raw.column_names, missing, self.spec)}")
        unfitted = tables_without_vocabulary(self.spec, self.encoder.vocabs)
        if unfitted:
            raise DataError(f"model {self.spec.name!r} has no vocabulary for its tables {unfitted} (a run on "
                            "synthetic data): raw rows cannot be encoded; train on converted data to score them")
        unscaled = [f.name for f in self.spec.dense_features if f.transform == "standardize"
                    and f.name not in self.encoder.stats]  # (a KeyError traceback at encoding)
        if unscaled:
            raise DataError(f"model {self.spec.name!r} has no mean and std for its standardized features {unscaled} "
                            "(a run on synthetic data, drawn standardized): raw rows cannot be encoded; train on "
                            "converted data to score them")
        for f in self.spec.dense_features:
            check_finite(raw.column(self.encoder.source(f.name)), self.encoder.source(f.name))
        unencodable = self.encoder.unencodable(raw)  # standardized past float32: inf, NaN scores
        if unencodable:
            first = min(unencodable)
            raise DataError(f"row {first + 1}: {unencodable[first]}; dense values must encode as finite float32 "
                            f"numbers ({len(unencodable):,} such rows)")
        options = dict(self.spec.data.options) if self.spec.data is not None else {}
        check_sequence_separators(  # lists written with '|' would each be one unknown id, scored without a word
            raw, self.spec, {f.name: self.encoder.source(f.name) for f in self.spec.sparse_features}, options,
            f"write each row's ids separated by {self.encoder.sequence_sep!r}, as the package's encoder splits them")
        lines = raw.column(LINE_COLUMN).to_numpy() if LINE_COLUMN in present else None  # (predict FILE)
        for f in self.spec.sparse_features:  # (a retrieval query's rows lack the item column)
            if self.encoder.source(f.name) in present:
                check_ids(raw.column(self.encoder.source(f.name)), self.encoder.source(f.name), is_multi(f))
                if frame:
                    check_frame_ids(raw.column(self.encoder.source(f.name)), self.encoder.source(f.name))
                else:  # an Arrow table (a Parquet file's rows: pandas wrote integers with a missing value as floats)
                    check_float_ids(raw.column(self.encoder.source(f.name)), self.encoder.source(f.name), lines)

    def _call(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]],
              program: torch.nn.Module | None = None, name: str = MODEL_FILE) -> torch.Tensor:
        """The program (`program`, file `name`; default the package's model.pt2) on one batch. A
        guard of the program that the batch fails (a model.pt2 exported for other shapes than
        `flowrec export` exports, e.g. a fixed number of rows) is a ValueError naming the file, not
        torch's AssertionError."""
        try:
            return (self.program if program is None else program)(dense, sparse)
        except AssertionError as exc:  # torch's guard: its first line (scoring imports no flowrec.runtime)
            guard = (str(exc).strip() or "a guard failed").splitlines()[0]
            raise ValueError(f"{self.path / name} does not fit the package's spec.json: it refuses a batch of "
                             f"{dense.shape[0]} rows ({guard}; a model.pt2 of another export?); "
                             "export the run again") from None

    def score_encoded(self, encoded: pa.Table) -> np.ndarray:
        """Scores of encoded rows (the flowrec layout): one column per head, one per class of a
        multiclass head.  # (N, sum of head widths) float32"""
        out = []
        with torch.no_grad():
            step = call_rows(self.spec)
            for start in range(0, encoded.num_rows, step):
                dense, sparse = encoded_inputs(self.spec, encoded.slice(start, step))
                sparse = remap_inputs(self.spec, sparse, self.maps)
                out.append(self._call(dense, sparse).numpy())
        width = sum(h.width for h in self.spec.heads)
        return np.concatenate(out) if out else np.zeros((0, width), np.float32)

    def predict(self, table: pa.Table | pd.DataFrame) -> pd.DataFrame:
        """One score column per head for each raw row (pandas or Arrow table of raw columns); a
        multiclass head's column holds each row's class probabilities. The scores of a DataFrame
        keep its index (pandas aligns on it); an Arrow table's are indexed 0, 1, ...

        Raises:
            TypeError: `table` is not a pandas DataFrame or a pyarrow Table (a dict, list, array).
            DataError: a raw column the model needs is missing, or a dense value is infinite or
                beyond float32 (null and NaN are missing values, filled as the encoder says), or
                an id column holds no ids (nested lists, structs; a list for a one-id feature).
            ValueError: the package's program refuses the rows (a model.pt2 of another export: `_call`).
        """
        if self.items is not None:
            raise ValueError(f"{self.path} is a retrieval package (its program is the query tower): "
                             "ask for items with recommend / predict --top-k")
        raw = raw_table(table)
        self._check_raw(raw, isinstance(table, pd.DataFrame))
        encoded = self.encoder.encode(raw, labels=False)
        self._count_unseen(raw, encoded)
        self._count_empty(raw)
        scores = self.score_encoded(encoded)
        return pd.DataFrame(_head_columns(self.spec.heads, scores), index=row_index(table))


def _head_columns(heads: list[Any], scores: np.ndarray) -> dict[str, Any]:
    """Head name -> its column of `scores` (the heads' columns side by side): a multiclass head's
    is a list of class probabilities per row."""
    out, start = {}, 0
    for head in heads:
        part = scores[:, start:start + head.width]
        out[head.name] = part[:, 0] if head.width == 1 else list(part)
        start += head.width
    return out


def load_model(path: str | Path) -> LoadedModel:
    """Load a model package written by `flowrec export` (torch.export program + encoder).

    The package is untrusted input: every file is checked against the digest its manifest records,
    and model.pt2 is checked to hold plain tensors and ATen operators only (`check_archive`),
    before torch reads it; nothing in it is unpickled or run. A package renamed over `path` while it
    is read (`flowrec export RUN PKG --overwrite`) is read again, whole: the new one.

    Raises:
        ValueError: `path` is not a package, or a part of it is missing, damaged, changed or refused (one line).
    """
    if isinstance(path, str) and path == "":  # Path reads it as '.', the working folder
        raise ValueError("path is an empty path: give the package's folder ('.' for the working folder)")
    from flowrec.data.paths import unusable_path

    if isinstance(path, (str, os.PathLike)) and (problem := unusable_path(Path(path).expanduser())):
        raise ValueError(f"path: {problem}")  # not UTF-8, or too long: as flowrec predict refuses it
    path = Path(path).expanduser()  # '~/pkg' as pandas reads it (the shell expands it for the CLI)
    for _ in range(LOAD_TRIES - 1):
        before = identity(path)
        try:
            model = _load_model(path)
        except ValueError:
            if identity(path) == before:
                raise
            continue  # replaced while it was read (an export --overwrite): what failed may be a mix
        if identity(path) == before:
            return model
    return _load_model(path)


LOAD_TRIES = 5  # loads of a package that another process keeps replacing, the last one taken as it is


def _load_model(path: Path) -> LoadedModel:
    """`load_model` of the package in `path` once: its files read by name, so a package renamed over
    `path` meanwhile (`export --overwrite`) gives a mix of the two, which the caller reads again."""
    manifest = read_manifest(path)
    try:
        verify_files(path, manifest, [MODEL_FILE, SPEC_FILE, ENCODER_FILE, PLAN_FILE])  # every listed file, once
        record = read_record(path)  # the package's own encoder.json (verified), never a folder below it
        require_listed(path, manifest, [str(Path(p).relative_to(path)) for p in record.vocab_files.values()])
        spec = _spec(path / SPEC_FILE)
        check_manifest_fits(manifest, spec, path)
        tables = planned_tables(path, spec, manifest["version"])
        encoder = load_encoder(record, spec)
    except DataError as exc:
        raise ValueError(str(exc)) from None
    if record.fingerprint != manifest.get("encoder_fingerprint"):
        raise ValueError(f"{path}: encoder.json does not match the manifest's encoder fingerprint")
    checked = check_archive(path / MODEL_FILE)
    try:
        exported = load_program(path / MODEL_FILE, checked)  # (its example inputs unpickled once, by the check)
    except Exception as exc:  # any failure to read the program is a damaged package
        raise ValueError(f"{path / MODEL_FILE} is not a usable exported program ({type(exc).__name__})") from None
    items = None
    if ("retrieval" in manifest) != any(h.task == "retrieval" for h in spec.heads):
        raise ValueError(f"{path}: the manifest {'has' if 'retrieval' in manifest else 'lacks'} a retrieval entry "
                         f"and its spec {'has no' if 'retrieval' in manifest else 'has a'} retrieval head; "
                         "export the run again")
    if "retrieval" in manifest:
        require_listed(path, manifest, [ITEMS_FILE])
        items = load_items(path, manifest, spec, encoder.vocabs, record.id_types)
    require_listed(path, manifest, [f"{MANAGED_DIR}/{t.name}.parquet" for t in spec.tables if t.managed is not None])
    item = manifest["retrieval"]["item_feature"] if items is not None else None  # (checked by load_items)
    check_program(exported, spec, [f.name for f in spec.sparse_features if f.name != item],
                  items.vectors.shape[1] if items is not None else sum(h.width for h in spec.heads), path / MODEL_FILE,
                  tables)
    check_table_dtype(manifest, exported, path)
    program = program_module(exported, path / MODEL_FILE, BATCH_ROWS)  # no guards code where flowrec's check proves them
    heads = _heads_program(path, manifest, spec, tables) if items is not None else None
    return LoadedModel(path, spec, record, encoder, program, manifest, read_maps(path, spec), items, heads)


def _heads_program(path: Path, manifest: dict[str, Any], spec: ModelSpec,
                   tables: list[tuple[str, int, int]]) -> torch.nn.Module | None:
    """A retrieval package's program of the heads beside its retrieval head (heads.pt2), checked
    as model.pt2 is; None for a package without one (no such heads, or exported before it had one).

    Raises:
        ValueError: the manifest's `heads` entry does not name the spec's other heads and heads.pt2,
            or the program is not one of them (one line).
    """
    entry = manifest["retrieval"].get("heads")
    if entry is None:
        return None
    others = [h for h in spec.heads if h.task != "retrieval"]
    if not isinstance(entry, dict) or entry.get("file") != HEADS_FILE or \
            entry.get("names") != [h.name for h in others] or not others:
        raise ValueError(f"{path}: the manifest's retrieval heads entry does not name the heads beside the "
                         f"retrieval head ({[h.name for h in others]}) and {HEADS_FILE}; export the run again")
    require_listed(path, manifest, [HEADS_FILE])
    checked = check_archive(path / HEADS_FILE)
    try:
        exported = load_program(path / HEADS_FILE, checked)
    except Exception as exc:
        raise ValueError(f"{path / HEADS_FILE} is not a usable exported program ({type(exc).__name__})") from None
    check_program(exported, spec, [f.name for f in spec.sparse_features], sum(h.width for h in others),
                  path / HEADS_FILE, tables)
    return program_module(exported, path / HEADS_FILE, BATCH_ROWS)


def _spec(path: Path) -> ModelSpec:
    try:
        doc = read_json_document(path)
    except ValueError as exc:
        raise ValueError(f"{path} is missing or not JSON: {exc}") from None
    issues = validate_document(doc) if isinstance(doc, dict) else ["not a mapping"]
    if issues:
        raise ValueError(f"{path} holds a spec that is not valid: {issues[0]}")
    return spec_from_dict(doc)


def check_frame_ids(column: pa.ChunkedArray | pa.Array, name: str) -> None:
    """Raise DataError when a DataFrame's id column holds floats that are no exact ids: pandas makes
    a column of integers with a missing value float64 (``pd.Series([2**60 + 1, None])``), which
    rounds an id of 2**53 or more to another id before flowrec sees it, and a fraction (2.5) is no
    id either. pandas' nullable ``Int64`` / ``UInt64`` keep every 64-bit id and its missing values.

    >>> check_frame_ids(pa.array([3.0, None, float("nan")]), "user")
    >>> check_frame_ids(pa.array([1.0, 2.0 ** 60]), "user")
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: column user: id 1152921504606846976.0 at row 1 (0-based) is a float of magnitude 2**53 or more, which float64 may have rounded from another id (pandas makes an integer column with a missing value float64): give the column pandas' nullable integer dtype, dtype="Int64" (or "UInt64") where it is made (a read_csv dtype=, a Series), not .astype of the floats
    """
    whole = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values, rows = whole, None
    if pa.types.is_list(whole.type) or pa.types.is_large_list(whole.type):
        values, rows = pc.list_flatten(whole), pc.list_parent_indices(whole).to_numpy()
    if pa.types.is_dictionary(values.type):
        values = values.dictionary_decode()
    if not pa.types.is_floating(values.type):
        return
    raw = values.to_numpy(zero_copy_only=False)
    bits = np.finfo(raw.dtype).nmant + 1  # every whole number below 2**bits is exact (float64 53, float32 24)
    x = raw.astype(np.float64)
    with np.errstate(invalid="ignore"):
        big = np.abs(x) >= 2.0 ** bits  # inf too (NaN: a missing value)
        part = np.isfinite(x) & (x != np.floor(x))
    bad = np.flatnonzero(big | part)
    if not len(bad):
        return
    i = int(bad[0])
    why = ("is not a whole number" if part[i] else
           f"is a float of magnitude 2**{bits} or more, which {raw.dtype} may have rounded from another id (pandas "
           f"makes an integer column with a missing value float64)")
    shown = f"{x[i]:.1f}" if np.isfinite(x[i]) and not part[i] else repr(float(x[i]))
    raise DataError(f"column {name}: id {shown} at row {i if rows is None else int(rows[i])} (0-based) "
                    f"{why}: give the column pandas' nullable integer dtype, dtype=\"Int64\" (or \"UInt64\") "
                    f"where it is made (a read_csv dtype=, a Series), not .astype of the floats")


def _warn(lines: list[str]) -> None:
    """Each line a UserWarning, pointed at the caller of `predict` / `recommend` (through the
    `_count_*` method that calls this)."""
    import warnings

    for line in lines:
        warnings.warn(line, UserWarning, stacklevel=4)


SHOWN_COLUMNS = 12  # names a line shows of a list of columns (a 1,000-field model's rows of 500: 4,551 characters)


def named_columns(names: list[str]) -> str:
    """A list of column names as a line shows it: every name up to `SHOWN_COLUMNS`, else the first
    of them and how many more.

    >>> named_columns(["user", "item"])
    "['user', 'item']"
    >>> named_columns([f"f{i}" for i in range(500)])
    "['f0', 'f1', 'f2', 'f3', 'f4', 'f5', 'f6', 'f7', 'f8', 'f9', 'f10', 'f11'] and 488 more"
    """
    if len(names) <= SHOWN_COLUMNS:
        return str(list(names))
    return f"{list(names[:SHOWN_COLUMNS])} and {len(names) - SHOWN_COLUMNS:,} more"


def few_lines(lines: list[str]) -> list[str]:
    """Lines of empty columns, one a column, as predict says them: the first `SHOWN_COLUMNS`, then
    one line for the others (two blank rows of a 1,000-field model were 1,004 lines).

    >>> few_lines([f"the rows: column 'c{i}' is empty" for i in range(20)])[-1]
    '8 more feature columns are empty in every row as well (20 in all): rows that lack most of their values?'
    """
    if len(lines) <= SHOWN_COLUMNS + 1:
        return lines
    return lines[:SHOWN_COLUMNS] + [f"{len(lines) - SHOWN_COLUMNS:,} more feature columns are empty in every row as "
                                    f"well ({len(lines):,} in all): rows that lack most of their values?"]


def close_columns(missing: list[str], others: list[Any]) -> str:
    """`` (the rows have 'userid': rename it to 'user_id'?)`` for the columns the rows have, read by
    no feature, that are really close to a missing one (`close_name`), else ``""``; a column whose name only
    looks like a missing one's (an accent written apart, a no-break space) is shown with both names'
    code points, as they print alike (`flowrec.data.look_alike`).

    >>> close_columns(["user_id", "price"], ["User_ID", "label", "prices"])
    " (the rows have 'User_ID', 'prices': rename them to 'user_id', 'price'?)"
    >>> close_columns(["user_id"], ["label"]), close_columns(["cate_id", "userid"], ["item_id", "user_id"])
    ('', " (the rows have 'user_id': rename it to 'userid'?)")
    >>> print(close_columns(["us\u00e9r"], ["use\u0301r"]))
     (the rows' 'use\u0301r' looks like 'us\xe9r' but is written with other characters (an accent written apart, a no-break space): write the rows' name with the same characters)
    """
    alike = look_alikes([str(c) for c in others], missing)
    texts = [str(c) for c in others if str(c) not in {n for n, _ in alike}]
    pairs, looked = [], 0
    for name in missing:
        if len(pairs) == SHOWN_COLUMNS:  # (1,000 renamed columns: a hint of 24,000 characters, 2 s to make)
            break
        looked += 1
        close = close_name(name, texts)  # really close: not 'cate_id' for 'item_id' (`flowrec.data.close_names`)
        if close is not None and name not in {w for _, w in alike}:
            texts.remove(close)
            pairs.append((close, name))
    said = "".join(f" (the rows' {look_alike_note(*pair)}: write the rows' name with the same characters)"
                   for pair in alike[:SHOWN_COLUMNS])
    if not pairs:
        return said
    had, wanted = (", ".join(repr(p[i]) for p in pairs) for i in (0, 1))
    more = f"; the first {len(pairs)} such columns" if looked < len(missing) else ""
    return f"{said} (the rows have {had}: rename {'it' if len(pairs) == 1 else 'them'} to {wanted}?{more})"


def row_index(table: pa.Table | pd.DataFrame) -> pd.Index | None:
    """The index the scores of `table`'s rows take: a DataFrame's own (so `df["score"] =
    model.predict(df)["ctr"]` puts each score on its row, as pandas aligns on the index, also
    after a filter or a shuffle), none for an Arrow table (0, 1, ...)."""
    return table.index if isinstance(table, pd.DataFrame) else None


def raw_table(table: pa.Table | pd.DataFrame) -> pa.Table:
    """Raw rows as an Arrow table; a pandas column Arrow cannot read (lists mixed with text, ...) is
    a DataError naming it. Columns of no name ('', one or many) are left out, unused, as a CSV
    header's and a Parquet file's are: two of them were refused as naming column '' twice."""
    if isinstance(table, pa.Table):
        if "" in table.column_names:
            table = table.select([i for i, name in enumerate(table.column_names) if name != ""])
        seen: set[str] = set()  # (a set: a list's `in` of every name before it took 80 s for 100,000 columns)
        twice = next((name for name in table.column_names if name in seen or seen.add(name)), None)
        if twice is not None:  # (Arrow allows it; reading the column was pyarrow's KeyError 'Field ... exists 2 times')
            raise DataError(f"the rows name column {twice!r} twice: drop or rename one")
        return nested_storage(table)
    if not isinstance(table, pd.DataFrame):
        raise TypeError(f"the rows must be a pandas DataFrame or a pyarrow Table of raw columns, not "
                        f"{type(table).__module__}.{type(table).__qualname__}"
                        f"{' (pd.DataFrame(...) makes one of a dict or list of rows)' if isinstance(table, (dict, list, tuple, np.ndarray)) else ''}")
    if any(isinstance(name, str) and name == "" for name in table.columns):
        table = table.iloc[:, [not (isinstance(name, str) and name == "") for name in table.columns]]
    twice = table.columns[table.columns.duplicated()]
    if len(twice):  # which of the two is meant is unknowable (pyarrow's ValueError named no way out)
        raise DataError(f"the rows name column {twice[0]!r} twice: drop or rename one")
    sparse = [i for i, kind in enumerate(table.dtypes) if isinstance(kind, pd.SparseDtype)]
    if sparse:  # pd.get_dummies(sparse=True)'s columns: Arrow refused them ("Sparse pandas data not supported")
        table = table.copy()
        for i in sparse:
            table.isetitem(i, table.iloc[:, i].sparse.to_dense())
    try:
        return nested_storage(frame_table(table))  # (pa.Table.from_pandas's; a wide frame's plain columns faster)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
        raise DataError(f"the rows cannot be read: {'; '.join(map(str, exc.args))}{mixed_hint(table)}") from None
    except OverflowError:  # a Python int beyond int64 in an object column
        raise DataError(f"the rows cannot be read: {huge_integer(table)}") from None


def nested_storage(table: pa.Table) -> pa.Table:
    """`table` with each column of an extension type stored as a nested one (pandas' intervals: a
    struct of left and right) as that storage, which the id and dense checks refuse in one line
    naming the column: such an id column passed them and its cast to text was a traceback. A
    run-end-encoded column (runs of one value, as Arrow compresses a sorted column) is decoded to
    its values: it was refused as 'not one id per row'."""
    for i, kind in enumerate(table.schema.types):
        if pa.types.is_run_end_encoded(kind):
            table = table.set_column(i, table.field(i).name, pc.run_end_decode(table.column(i)))
        elif isinstance(kind, pa.ExtensionType) and pa.types.is_nested(kind.storage_type):
            column = table.column(i)
            table = table.set_column(i, table.field(i).name, pa.chunked_array(
                [chunk.storage for chunk in column.chunks], kind.storage_type))
    return table


def huge_integer(frame: pd.DataFrame) -> str:
    """What is wrong with the first object (or categorical) column holding a Python int that Arrow
    cannot read as int64 (pandas' read_csv of ids beyond 64 bits, or of one of 2**63 or more beside a
    negative one), and how to give it: as text, as a CSV file gives such ids (and training read them).

    >>> print(huge_integer(pd.DataFrame({"a": [1.5, 2.0], "user": [5, 2 ** 70]})))
    column user holds the integer 1180591620717411303424 at row 1 (0-based), beyond 64 bits: ids of any size are their text, as a CSV file gives them: make the column text with .astype("string") (or read it so: pd.read_csv(..., dtype={'user': "string"})); dense values must be finite float32 numbers
    """
    for name in frame.columns:
        column = frame[name]
        if column.dtype != object and not isinstance(column.dtype, pd.CategoricalDtype):  # (categories of ints too)
            continue
        for row, value in enumerate(column):
            if isinstance(value, int) and not isinstance(value, bool) and not -2 ** 63 <= value < 2 ** 63:
                size = ("beyond 64 bits" if not -2 ** 63 <= value < 2 ** 64 else
                        "beyond int64, which Arrow reads a column of Python integers as")
                return (f"column {name} holds the integer {value} at row {row} (0-based), {size}: ids of any size are "
                        f"their text, as a CSV file gives them: make the column text with .astype(\"string\") (or read "
                        f"it so: pd.read_csv(..., dtype={{{name!r}: \"string\"}})); dense values must be finite "
                        "float32 numbers")
    return "a column holds an integer beyond 64 bits; dense values must be finite float32 numbers"


def mixed_hint(frame: pd.DataFrame) -> str:
    """How to mend the first column Arrow cannot read, or "": an object column mixing text with
    numbers (after a `concat`, say), dates or other values: `.astype("string")`, which keeps a
    missing value missing, where `.astype(str)` made NaN the id 'nan'; a column of complex numbers
    (no id, no dense value), named with what it holds, where Arrow said "Unsupported numpy type 15".

    >>> print(mixed_hint(pd.DataFrame({"a": [1.5, 2.0], "user": [1, "u2"]})))
     (column user mixes text and numbers: make it text with .astype("string"), which keeps missing values missing; not .astype(str), which makes them the text 'nan')
    >>> print(mixed_hint(pd.DataFrame({"user": [pd.Timestamp("2020-01-02"), "u2"]})))
     (column user mixes text and dates or times: make it text with .astype("string"), which keeps missing values missing; not .astype(str), which makes them the text 'nan')
    >>> print(mixed_hint(pd.DataFrame({"user": [pd.Timestamp("2020-01-02"), "u2", 3, b"u"]})))
     (column user mixes text and bytes, dates or times and numbers: make it text with .astype("string"), which keeps missing values missing; not .astype(str), which makes them the text 'nan')
    >>> print(mixed_hint(pd.DataFrame({"price": [1 + 2j, 3.0]})))
     (column price holds complex numbers (complex128): an id is an integer or text, a dense value a real number)
    >>> mixed_hint(pd.DataFrame({"user": ["u1", None]}))
    ''
    """
    for name in frame.columns:
        column = frame[name]
        if column.dtype.kind == "c":
            return (f" (column {name} holds complex numbers ({column.dtype}): an id is an integer or text, a dense "
                    "value a real number)")
        if column.dtype == object:
            kinds = {_value_kind(v) for v in column.dropna()}
            if "text" in kinds and len(kinds) > 1:
                others = sorted(kinds - {"text"})
                other = " and ".join([", ".join(others[:-1]), others[-1]] if len(others) > 1 else others)
                return (f" (column {name} mixes text and {other}: make it text with .astype(\"string\"), which keeps "
                        "missing values missing; not .astype(str), which makes them the text 'nan')")
            if "complex numbers" in kinds:
                return f" (column {name} holds complex numbers: an id is an integer or text, a dense value a real number)"
    return ""


def _value_kind(value: object) -> str:
    """What one value of an object column is, in a line's words: text, numbers, complex numbers,
    dates or times, bytes, or its type's name."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, (datetime.date, datetime.time, np.datetime64, pd.Timedelta, datetime.timedelta)):
        return "dates or times"
    if isinstance(value, numbers.Complex) and not isinstance(value, numbers.Real):
        return "complex numbers"
    if isinstance(value, numbers.Number):
        return "numbers"
    if isinstance(value, (bytes, bytearray)):
        return "bytes"
    return f"values of type {type(value).__name__}"


def check_finite(column: pa.ChunkedArray | pa.Array, name: str) -> None:
    """Raise DataError naming the first row whose dense value is infinite or beyond float32, as CSV
    input refuses them (null and NaN are missing values, filled, as CSV's empty and `nan` are). An
    integer beyond 2**53 is a number, rounded to float64 as CSV reads it (a safe cast refused it as
    "not numbers"). pandas' periods are no numbers either, as its datetimes are not (their Arrow
    extension type cast to its storage's day counts, scored without a word)."""
    if isinstance(column.type, pa.ExtensionType):
        raise DataError(f"column {name} holds values that are not numbers (type {column.type})")
    try:
        values = pa.chunked_array([column]) if isinstance(column, pa.Array) else column
        x = pc.cast(values, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
        raise DataError(f"column {name} holds values that are not numbers (type {column.type})") from None
    with np.errstate(invalid="ignore"):
        wrong = np.flatnonzero(np.abs(x) > FLOAT32_MAX)  # NaN (and null, read as NaN) compares False
    if len(wrong):
        raise DataError(f"row {int(wrong[0]) + 1}: dense column {name} holds {float(x[wrong[0]])!r}; dense "
                        f"values must be finite float32 numbers ({len(wrong):,} such rows)")


def separator_note(names: list[str], missing: list[str], spec: Any) -> str:
    """Where the rows' header splits into the missing columns by another separator (a tab-separated
    file read as commas: one column named 'a\\tb\\tc'): which it looks separated by, and what the
    package reads. '' otherwise.

    >>> separator_note(["user\\tprice\\tlabel"], ["user", "price"], None)
    "; the header looks tab-separated, where the package reads ','-separated text: write the rows with ','"
    """
    data = getattr(spec, "data", None)
    reads = str(dict(getattr(data, "options", None) or ()).get("sep") or ",")  # a spec's options: (key, value) pairs
    sep = header_separator([str(name) for name in names], missing, other_than=reads)
    if sep is None:
        return ""
    shown, pkg = ("tab" if s == "\t" else repr(s) for s in (sep, reads))
    return f"; the header looks {shown}-separated, where the package reads {pkg}-separated text: write the rows with {pkg}"

