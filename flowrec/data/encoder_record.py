"""The encoder of a model: the rules that turn raw rows into ids and values, with a fingerprint.

An encoder record lists, per feature in spec order, how its raw column is encoded: sparse features
by their table (rows, hash or vocabulary, the vocabulary's digest, max_len), dense features by
their fill, transform and statistics; labels by their source column. Its fingerprint is a hash of
those rules: two datasets with the same fingerprint hold the same ids for the same raw values.

Every encoded dataset carries its encoder (in ``_flowrec.json`` and ``_vocab/``); a run keeps the
encoder of the data it was trained on in ``RUN/encoder/`` and an export package in ``encoder.json``
+ ``vocab/``. `check_same_encoder` refuses data from a different encoder with one line naming the
first differing feature; `load_encoder` rebuilds the `Encoder` of a run, dataset or package so
that new raw data is encoded exactly as the training data was (``--encoder-from``).

Example:
    >>> rec = record_of_dataset(Path("data/ml/train"))  # doctest: +SKIP
    >>> check_same_encoder(rec, record_of_dataset(Path("data/ml/test")), "data/ml/test")  # doctest: +SKIP
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from flowrec.data.encode import DenseStats, Encoder
from flowrec.data.id_forms import checked_forms, checked_types
from flowrec.data.layout import (META_FILE, DataError, DatasetMeta, data_hash, encoded_rows, encoding_mode,
                                 read_meta, unique_labels)
from flowrec.data.names import inside, plain_name
from flowrec.data.run_paths import CHECKPOINT_NAME, run_folder_of
from flowrec.spec.json_doc import read_json_document, version_problem
from flowrec.spec.model import DenseFeature, ModelSpec

ENCODER_FILE = "encoder.json"
ENCODER_FORMAT = "flowrec-encoder"
ENCODER_VERSION = 1
RUN_ENCODER_DIR = "encoder"  # inside a run folder
VOCAB_SUBDIR = "vocab"  # inside an encoder folder


@dataclass(frozen=True)
class EncoderRecord:
    """What an encoder does, feature by feature, and where its vocabularies are.

    Args:
        spec: name of the spec the encoder was made for.
        data_hash: `data_hash` of that spec (features and tables).
        features: feature name -> rule, in spec order (see the module docstring).
        labels: label name -> {"column": source column}.
        columns: feature / label name -> source column (data.columns), for raw rows.
        sequence_sep: separator of multi-hot values held in one string.
        vocab_files: table -> absolute path of its vocabulary Parquet file.
        feature_map: libsvm's feature map (index -> column) the data was read with, kept so that
            `flowrec predict` reads a package's libsvm rows with it from any folder (None: none).
        id_forms: hashed or managed feature -> the form the training rows wrote its ids in
            (`flowrec.data.id_forms`): how the rows were written, not how ids are encoded, so no
            part of the fingerprint (a record without it, of before forms were recorded, warns of none).
        id_types: sparse feature -> the Arrow type a typed source (Parquet) held its raw column in
            (`IdForms.column_types`): a vocabulary holds every id as text, so a retrieval package
            gives its items back in this type; none for text sources (CSV), whose ids have no
            type but their spelling, nor in the fingerprint (a record without it keeps the guess).
    """

    spec: str
    data_hash: str
    features: dict[str, dict[str, Any]]
    labels: dict[str, dict[str, Any]] = field(default_factory=dict)
    columns: dict[str, str] = field(default_factory=dict)
    sequence_sep: str = "^"
    vocab_files: dict[str, str] = field(default_factory=dict)
    feature_map: dict[str, str] | None = None
    id_forms: dict[str, dict[str, str]] = field(default_factory=dict)
    id_types: dict[str, str] = field(default_factory=dict)

    @property
    def fingerprint(self) -> str:
        doc = [self.data_hash, sorted(self.features.items()), sorted(self.labels.items())]
        return hashlib.sha256(json.dumps(doc, sort_keys=True).encode()).hexdigest()[:16]

    def document(self, vocab_prefix: str = VOCAB_SUBDIR) -> dict[str, Any]:
        """The encoder.json document, vocabularies named relative to its folder."""
        return {"format": ENCODER_FORMAT, "version": ENCODER_VERSION, "spec": self.spec,
                "data_hash": self.data_hash, "fingerprint": self.fingerprint,
                "features": self.features, "labels": self.labels, "columns": self.columns,
                "sequence_sep": self.sequence_sep,
                "vocab_files": {t: f"{vocab_prefix}/{t}.parquet" for t in self.vocab_files},
                **({"feature_map": self.feature_map} if self.feature_map else {}),
                **({"id_forms": self.id_forms} if self.id_forms else {}),
                **({"id_types": self.id_types} if self.id_types else {})}


def vocab_digest(values: pa.Array) -> str:
    """Hash of a vocabulary's values in row order (lengths + bytes of the strings)."""
    values = values.combine_chunks() if isinstance(values, pa.ChunkedArray) else values
    values = pa.array(values, pa.large_string()) if not pa.types.is_large_string(values.type) else values
    offsets = np.frombuffer(values.buffers()[1], np.int64)[values.offset: values.offset + len(values) + 1]
    data = values.buffers()[2]
    h = hashlib.sha256(np.diff(offsets).tobytes())
    if data is not None and len(offsets):
        h.update(memoryview(data)[offsets[0]: offsets[-1]])
    return h.hexdigest()[:16]


def read_vocab(path: Path) -> pa.Array:
    """The values of a vocabulary file (rows 1..)."""
    try:
        return pq.read_table(path, columns=["value"]).column("value").combine_chunks().cast(pa.string())
    except (OSError, KeyError, pa.ArrowException) as exc:
        raise DataError(f"{path}: unreadable vocabulary file ({type(exc).__name__})") from None


def sparse_rule(table: str, rows: int, mode: str, max_len: int, digest: str | None, column: str,
                spare: int = 0, truncate: str = "first") -> dict:
    rule = {"kind": "sparse", "table": table, "rows": rows, "mode": mode, "max_len": max_len,
            "vocab": digest, "column": column}
    if spare:  # only then: encoders without spare rows keep their fingerprints
        rule["spare"] = spare
    if truncate != "first":  # likewise: lists that keep their first ids (the default) hash as before
        rule["truncate"] = truncate
    return rule


def dense_rule(transform: str, fill: float, mean: float | None, std: float | None, column: str) -> dict:
    return {"kind": "dense", "transform": transform, "fill": fill, "mean": mean, "std": std,
            "column": column}


def record_of_encoder(spec: ModelSpec, encoder: Encoder, vocab_files: dict[str, str]) -> EncoderRecord:
    """The record of an encoder that a conversion used (vocabulary files already written)."""
    features = {}
    digests = {t: vocab_digest(v) for t, v in encoder.vocabs.items()}
    for f in spec.features:
        column = encoder.source(f.name)
        if isinstance(f, DenseFeature):
            st = encoder.stats.get(f.name)
            features[f.name] = dense_rule(f.transform, f.fill, st.mean if st else None,
                                          st.std if st else None, column)
        else:
            t = spec.table(f.table)
            features[f.name] = sparse_rule(t.name, encoded_rows(t), encoding_mode(t),
                                           f.max_len, digests.get(t.name), column, t.vocab_spare, f.truncate)
    labels = {name: {"column": encoder.source(name)} for name in unique_labels(spec)}
    return EncoderRecord(spec.name, data_hash(spec), features, labels, dict(encoder.columns),
                         encoder.sequence_sep, vocab_files)


def record_of_dataset(path: Path, meta: DatasetMeta | None = None) -> EncoderRecord:
    """The encoder record of an encoded dataset folder (from its metadata and vocabulary files)."""
    path = Path(path)
    meta = meta or read_meta(path)
    try:
        return _record_of_meta(path, meta)
    except (KeyError, TypeError, AttributeError) as exc:  # a hand-edited or foreign _flowrec.json
        why = f"lacks the key {exc}" if isinstance(exc, KeyError) else f"holds a value of the wrong kind ({exc})"
        raise DataError(f"{path / META_FILE}: its encoder record {why}; convert the data again") from None


def _record_of_meta(path: Path, meta: DatasetMeta) -> EncoderRecord:
    stored = meta.source.get("encoder", {})
    columns = dict(stored.get("columns", {}))
    features, vocab_files = {}, {}
    for name, enc in meta.encoding.items():
        digest = enc.get("vocab_digest")
        plain_name(enc["table"], f"{path / META_FILE}: encoding.{name}.table")
        if enc.get("vocab_file"):
            vocab = inside(path, enc["vocab_file"], f"{path / META_FILE}: encoding.{name}.vocab_file")
            vocab_files[enc["table"]] = str(vocab)
            if digest is None:
                digest = vocab_digest(read_vocab(vocab))
        features[name] = sparse_rule(enc["table"], enc["rows"], enc["mode"], enc["max_len"], digest,
                                     columns.get(name, name), enc.get("spare", 0), enc.get("truncate", "first"))
    for name, d in meta.dense.items():
        features[name] = dense_rule(d["transform"], d["fill"], d.get("mean"), d.get("std"),
                                    columns.get(name, name))
    order = stored.get("order") or list(features)
    ordered = {n: features[n] for n in order if n in features}
    ordered.update({n: r for n, r in features.items() if n not in ordered})
    labels = {name: {"column": columns.get(name, name)} for name in meta.labels}
    return EncoderRecord(meta.spec, meta.data_hash, ordered, labels, columns,
                         stored.get("sequence_sep", "^"), vocab_files,
                         _feature_map(stored.get("feature_map"), path / META_FILE),
                         checked_forms(stored.get("id_forms")), checked_types(stored.get("id_types")))


def synthetic_record(spec: ModelSpec) -> EncoderRecord:
    """The encoder of synthetic data for `spec` (as `flowrec data synth` records it)."""
    features = {}
    for f in spec.features:
        if isinstance(f, DenseFeature):
            features[f.name] = dense_rule(f.transform, f.fill, None, None, f.name)
        else:
            t = spec.table(f.table)
            features[f.name] = sparse_rule(t.name, encoded_rows(t), "synthetic", f.max_len, None, f.name,
                                           t.vocab_spare)
    labels = {name: {"column": name} for name in unique_labels(spec)}
    return EncoderRecord(spec.name, data_hash(spec), features, labels)


def read_record(folder: Path) -> EncoderRecord:
    """The encoder record of an encoder folder (encoder.json + vocab/)."""
    path = Path(folder) / ENCODER_FILE
    try:
        doc = read_json_document(path)
    except ValueError as exc:
        raise DataError(f"unreadable encoder: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != ENCODER_FORMAT:
        raise DataError(f"{path} is not a flowrec encoder file")
    if problem := version_problem(doc.get("version"), ENCODER_VERSION):
        raise DataError(f"{path}: encoder format {problem}")
    try:
        record = EncoderRecord(doc["spec"], doc["data_hash"], doc["features"], doc.get("labels", {}),
                               doc.get("columns", {}), doc.get("sequence_sep", "^"),
                               _vocab_paths(Path(folder), doc.get("vocab_files", {}), path),
                               _feature_map(doc.get("feature_map"), path), checked_forms(doc.get("id_forms")),
                               checked_types(doc.get("id_types")))
    except (KeyError, TypeError, AttributeError) as exc:
        raise DataError(f"{path}: encoder lacks the key {exc} or holds a value of the wrong kind") from None
    if record.fingerprint != doc.get("fingerprint"):
        raise DataError(f"{path} is damaged: its fingerprint does not match its rules")
    return record


def _feature_map(value: Any, where: Path) -> dict[str, str] | None:
    """A recorded libsvm feature map (index -> column); DataError (one line) unless one of text."""
    if value is None:
        return None
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise DataError(f"{where}: feature_map must map each libsvm index to a column name")
    return dict(value)


def _vocab_paths(folder: Path, files: dict[str, Any], where: Path) -> dict[str, str]:
    """table -> path of its vocabulary file; each table a plain name, each file inside `folder`."""
    return {plain_name(t, f"{where}: vocab_files table"): str(inside(folder, p, f"{where}: vocab_files.{t}"))
            for t, p in files.items()}


def write_record(record: EncoderRecord, folder: Path, verified: bool = False) -> None:
    """Write encoder.json and copies of the vocabulary files into `folder` (created). `verified`:
    the record's vocabularies were checked when it was read (`check_vocabularies`: a run's encoder
    as `load_trained` reads it), so they are copied without reading and digesting them again."""
    folder = Path(folder)
    (folder / VOCAB_SUBDIR).mkdir(parents=True, exist_ok=True)
    for table, source in record.vocab_files.items():
        target = folder / VOCAB_SUBDIR / f"{plain_name(table, 'vocabulary table')}.parquet"
        if Path(source).resolve() != target.resolve():
            if not verified:
                checked_vocab(record, table)  # a changed vocabulary is refused, never copied on
            shutil.copyfile(source, target)
    text = json.dumps(record.document(), indent=2) + "\n"
    staged = folder / f".{ENCODER_FILE}.tmp"
    staged.write_text(text)
    staged.replace(folder / ENCODER_FILE)


def find_record(path: Path) -> EncoderRecord:
    """The encoder of a run folder (or its best checkpoint, RUN/best), an export package, an
    encoder folder or an encoded dataset.

    A split dataset (DIR/train, DIR/test) gives the encoder of its train part.

    Raises:
        DataError: `path` holds no encoder.
    """
    path = Path(path)
    if path.is_file() and path.name == CHECKPOINT_NAME:
        path = path.parent
    run = run_folder_of(path) if path.is_dir() else path  # RUN/best (early stopping's best checkpoint)
    for folder in (path / RUN_ENCODER_DIR, path, run / RUN_ENCODER_DIR):
        if (folder / ENCODER_FILE).is_file():
            return read_record(folder)
    if (path / META_FILE).is_file():
        return record_of_dataset(path)
    if (path / "train" / META_FILE).is_file():
        return record_of_dataset(path / "train")
    give = "give a run folder, an export package or an encoded dataset (with _flowrec.json)"
    if not os.path.lexists(path):  # (it was said to 'hold no encoder')
        raise DataError(f"{path} not found: {give}")
    if path.is_file():  # a file of a package (manifest.json), a run (plan.json) or a dataset (a part file)
        try:
            find_record(path.parent)
        except DataError:
            pass
        else:
            raise DataError(f"{path} is a file of {path.parent}, which holds the encoder: give {path.parent}")
    from flowrec.data.owners import owner_of

    if owner_of(run) == "a training run":  # it said to give a run folder, which it is
        raise DataError(f"{run / RUN_ENCODER_DIR} is missing (removed, or a run made before encoders were "
                        f"recorded): `flowrec train SPEC --resume {run}` records the run's encoder again")
    raise DataError(f"{path} holds no encoder: {give}")


def first_difference(expected: EncoderRecord, found: EncoderRecord, extension: bool = False) -> str | None:
    """A few words naming the first feature (or label) whose encoding differs, or None. The raw
    column a value was read from is no part of its encoding (`READING`).

    Args:
        expected: the model's encoder.
        found: the data's encoder.
        extension: accept a `found` whose vocabularies of tables with spare rows start with
            `expected`'s and go on into the spare rows (`flowrec.data.vocab_growth`): every value
            the model knows keeps its row.
    """
    extended: dict[str, bool] = {}
    for name, rule in expected.features.items():
        other = found.features.get(name)
        if other is None:
            return f"feature {name!r} is missing"
        keys = [k for k in rule if k not in READING and rule.get(k) != other.get(k)]
        if keys == ["vocab"] and extension and rule.get("spare"):
            table = rule["table"]
            if table not in extended:
                extended[table] = _extends(expected, found, table)
            if extended[table]:
                continue
            return (f"feature {name!r} differs in its vocabulary (not the model's vocabulary "
                    "extended into its spare rows)")
        if keys:
            return f"feature {name!r} differs in {_describe(keys[0])}"
    extra = [n for n in found.features if n not in expected.features]
    if extra:
        return f"feature {extra[0]!r} is not in the model's encoder"
    for name, rule in expected.labels.items():
        if name not in found.labels or _encoding(found.labels[name]) != _encoding(rule):
            return f"label {name!r} differs"
    if expected.data_hash != found.data_hash:
        return "the spec's tables differ"
    return None


def _extends(expected: EncoderRecord, found: EncoderRecord, table: str) -> bool:
    """True if `found`'s vocabulary of `table` is `expected`'s followed by more values."""
    if table not in expected.vocab_files or table not in found.vocab_files:
        return False
    base, grown = read_vocab(Path(expected.vocab_files[table])), read_vocab(Path(found.vocab_files[table]))
    return len(grown) > len(base) and grown.slice(0, len(base)).equals(base)


READING = ("column",)  # what a rule records of how its raw rows were read, not of how values are encoded


def _encoding(rule: dict) -> dict:
    """A rule without what it records of how its raw rows were read (`READING`): data converted with
    --encoder-from RUN from a file of other column names (the spec's data.columns) is RUN's encoding."""
    return {k: v for k, v in rule.items() if k not in READING}


def _describe(key: str) -> str:
    return {"vocab": "its vocabulary", "mean": "its statistics", "std": "its statistics"}.get(key, key)


def check_same_encoder(expected: EncoderRecord, found: EncoderRecord, where: str,
                       extension: bool = False) -> None:
    """Raise DataError (one line) if `found` (the data at `where`) was encoded differently
    (`extension`: an extension into spare rows is not different, see `first_difference`)."""
    diff = first_difference(expected, found, extension)
    if diff is not None and synthetic(expected) and not synthetic(found):
        raise DataError(f"{where} holds encoded raw data, and the model was trained on synthetic rows (its ids "
                        f"were drawn, no raw value has a row): it scores synthetic data only (`flowrec data synth`); "
                        "to score raw data, train on it (`flowrec data convert`, then `flowrec train --data`)")
    if diff is not None:
        raise DataError(f"{where} was encoded with another encoder (fingerprint {found.fingerprint}, "
                        f"the model's is {expected.fingerprint}): {diff}; convert it with "
                        "`flowrec data convert ... --encoder-from RUN`")


def synthetic(record: EncoderRecord) -> bool:
    """The record is that of synthetic data (`flowrec train --rows`, `flowrec data synth`): its ids
    were drawn, so it maps no raw value to a row."""
    return any(rule.get("mode") == "synthetic" for rule in record.features.values())


def raw_encoder(path: Path) -> EncoderRecord:
    """The encoder at `path` (`find_record`) to encode raw data with (`data convert --encoder-from`).

    Raises:
        DataError: `path` holds none, or that of synthetic data, which maps no raw value (one line).
    """
    record = find_record(path)
    if synthetic(record):
        raise DataError(f"{path} holds the encoder of synthetic data (ids drawn, no raw value has a row): raw "
                        "data cannot be encoded with it; convert without --encoder-from (a new encoder fitted "
                        "to the data) and train on that (`flowrec train --data`)")
    return record


def load_encoder(record: EncoderRecord, spec: ModelSpec) -> Encoder:
    """The Encoder that applies `record` to raw tables for `spec` (same features and tables).

    Raises:
        DataError: the record was made for a spec with other features or tables.
    """
    if record.data_hash != data_hash(spec):
        raise DataError(f"the encoder was made for spec {record.spec!r} whose features or tables "
                        f"differ from spec {spec.name!r}'s")
    vocabs = {t: checked_vocab(record, t) for t in record.vocab_files}
    stats = {name: DenseStats(r["mean"], r["std"]) for name, r in record.features.items()
             if r["kind"] == "dense" and r.get("mean") is not None}
    return Encoder(spec, dict(record.columns), vocabs, stats, record.sequence_sep, dict(record.id_forms))


def check_vocabularies(record: EncoderRecord) -> EncoderRecord:
    """`record`, once each of its vocabulary files is readable and holds the values its digest
    records (`checked_vocab`): a run's encoder read for --resume or `flowrec eval` is refused as
    export and --encoder-from refuse it, not only when the run is exported."""
    for table in record.vocab_files:
        checked_vocab(record, table)
    return record


def checked_vocab(record: EncoderRecord, table: str) -> pa.Array:
    """The vocabulary of `table`, refused (DataError) unless its digest is the one the record's
    rules hold (a reordered or edited vocabulary file would silently change every id)."""
    path = Path(record.vocab_files[table])
    values = read_vocab(path)
    expected = {r.get("vocab") for r in record.features.values() if r.get("table") == table}
    if expected and expected != {vocab_digest(values)}:
        raise DataError(f"{path}: the vocabulary of table {table!r} does not match the digest its encoder "
                        "records (edited, reordered or replaced)")
    return values


def tables_without_vocabulary(spec: ModelSpec, fitted: Iterable[str]) -> list[str]:
    """The vocabulary tables (neither hashed nor managed) of `spec`'s sparse features that are not
    among `fitted`, the tables an encoder has a vocabulary for: raw values of their features cannot
    be encoded (a run on synthetic rows drew its ids and has none), so its package scores encoded
    rows only. `flowrec predict` refuses raw rows for them; `flowrec export` says so on success."""
    fitted = set(fitted)
    tables = [spec.table(f.table) for f in spec.sparse_features]
    return sorted({t.name for t in tables if t.managed is None and not t.hashed and t.name not in fitted})
