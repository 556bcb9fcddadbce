"""The encoded dataset layout shared by converters, synth and the batch iterator.

A flowrec dataset is a directory of Parquet files (any nesting; hive partitions allowed; names
starting with ``_`` or ``.`` are ignored) holding ENCODED values, plus ``_flowrec.json``:

- one ``float32`` column per dense feature (missing filled, transform applied);
- one ``int64`` column per one-hot sparse feature: the row of the feature's table (0 = missing /
  unknown; table-local, NOT packed: packing is applied when batches are built);
- one ``list<int64>`` column per multi-hot / sequence feature (max_len > 1), truncated to max_len;
- one ``float32`` column per label (the label column of every head).

``_flowrec.json`` records the spec name, the data hash of the spec (features and tables only: a
dataset serves every model over the same inputs), the encoding of each sparse feature, the dense
statistics (standardize), the labels, the row count and the vocabulary files.

Example:
    >>> meta = DatasetMeta(spec="m", data_hash="abc", rows=10, labels=("label",))
    >>> DatasetMeta.from_json(meta.to_json()).rows
    10
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from flowrec.data.owners import META_FILE, is_stream_folder, owner_of
from flowrec.spec.json_doc import parse_json_text, version_problem
from flowrec.spec.model import DenseFeature, ModelSpec, SparseFeature, TableSpec
from flowrec.spec.read import MAX_SPEC_BYTES, broken_link

META_FORMAT = "flowrec-dataset"
META_VERSION = 1
VOCAB_DIR = "_vocab"


class DataError(Exception):
    """A user-facing data problem (missing file, wrong format, spec mismatch, malformed rows)."""


@dataclass(frozen=True)
class DatasetMeta:
    """Metadata of an encoded dataset (the ``_flowrec.json`` file).

    Args:
        spec: name of the spec the data was encoded for.
        data_hash: `data_hash(spec)` of that spec.
        rows: number of rows.
        labels: label columns.
        encoding: per sparse feature {"table", "rows", "mode": hash|vocab, "max_len"} (+ "truncate"
            when it is "last").
        dense: per dense feature {"transform", "fill", "mean", "std"}.
        source: where the data came from (format, paths, synth settings).
        split: {"test_fraction", "split_seed"} when the data was split, else {}.
    """

    spec: str
    data_hash: str
    rows: int
    labels: tuple[str, ...]
    encoding: dict[str, dict[str, Any]] = field(default_factory=dict)
    dense: dict[str, dict[str, Any]] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    split: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        doc = {"format": META_FORMAT, "version": META_VERSION, **asdict(self)}
        doc["labels"] = list(self.labels)
        return json.dumps(doc, indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str, where: str = META_FILE) -> "DatasetMeta":
        """Parse `_flowrec.json` text (nesting, size and duplicate keys bounded as for specs).

        Raises:
            DataError: not a flowrec dataset metadata document of this version.
            ValueError, KeyError, TypeError: not JSON, or a key is missing or of the wrong kind.
        """
        doc = parse_json_text(text, where)
        if not isinstance(doc, dict) or doc.get("format") != META_FORMAT:
            raise DataError(f"not a flowrec dataset metadata file (format "
                            f"{doc.get('format') if isinstance(doc, dict) else None!r})")
        if problem := version_problem(doc.get("version"), META_VERSION):
            raise DataError(f"dataset metadata {problem}; convert the data again")
        _check_meta_kinds(doc)
        keys = ("spec", "data_hash", "rows", "encoding", "dense", "source", "split")
        return cls(labels=tuple(doc["labels"]), **{k: doc[k] for k in keys if k in doc})


def _check_meta_kinds(doc: dict[str, Any]) -> None:
    """DataError naming the first key of a metadata document that holds a value of the wrong kind
    (a hand-edited or foreign file: rows "x" was a format traceback in `data inspect`, labels
    "label" the labels l, a, b, e, l, encoding [] or source null an AttributeError in `train`).

    >>> _check_meta_kinds({"spec": "s", "data_hash": "h", "rows": "x", "labels": []})
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: key 'rows' holds 'x', not a row count (an integer at least 0)
    """
    def names(v: Any) -> bool:
        return isinstance(v, list) and all(isinstance(x, str) for x in v)

    def mapping_of_mappings(v: Any) -> bool:
        return isinstance(v, dict) and all(isinstance(x, dict) for x in v.values())

    kinds = {"spec": (lambda v: isinstance(v, str), "a name"), "data_hash": (lambda v: isinstance(v, str), "a hash"),
             "rows": (lambda v: isinstance(v, int) and not isinstance(v, bool) and v >= 0,
                      "a row count (an integer at least 0)"),
             "labels": (names, "a list of column names"),
             "encoding": (mapping_of_mappings, "a mapping of feature -> mapping"),
             "dense": (mapping_of_mappings, "a mapping of feature -> mapping"),
             "source": (lambda v: isinstance(v, dict), "a mapping"), "split": (lambda v: isinstance(v, dict), "a mapping")}
    for key, (ok, wanted) in kinds.items():
        if key in doc and not ok(doc[key]):
            raise DataError(f"key {key!r} holds {str(doc[key])[:40]!r}, not {wanted}")


def data_hash(spec: ModelSpec) -> str:
    """Hash of what determines the encoded columns: features, their tables' rows and encodings."""
    doc = []
    for f in spec.features:
        if isinstance(f, DenseFeature):
            doc.append(["dense", f.name, f.transform, f.fill])
        else:
            t = spec.table(f.table)
            if t.managed is not None:  # raw-id hashes: the data serves any capacity
                doc.append(["sparse", f.name, t.name, "managed", f.max_len] + (["last"] if f.truncate == "last" else []))
                continue
            spare = [t.vocab_spare] if t.vocab_spare else []  # specs without spare rows hash as before
            last = ["last"] if f.truncate == "last" else []  # `first` (the default) hashes as before
            doc.append(["sparse", f.name, t.name, t.rows, t.hashed, t.min_freq, f.max_len, *spare, *last])
    return hashlib.sha256(json.dumps(doc).encode()).hexdigest()[:16]


def encoding_mode(table: TableSpec) -> str:
    """How a table's column is encoded: "managed" (raw-id hashes), "hash" or "vocab" (rows)."""
    if table.managed is not None:
        return "managed"
    return "hash" if table.hashed else "vocab"


def encoded_rows(table: TableSpec) -> int:
    """The rows an encoding rule records: 0 for a managed table (its data holds no rows)."""
    return 0 if table.managed is not None else table.rows


def label_columns(spec: ModelSpec) -> tuple[str, ...]:
    """Label column per head, in head order: head.label, else data.label, else "label"."""
    default = spec.data.label if spec.data is not None else "label"
    return tuple(h.label or default for h in spec.heads)


def weight_columns(spec: ModelSpec) -> tuple[str, ...]:
    """Sample-weight columns of the heads that have one, in head order, each once."""
    return tuple(dict.fromkeys(h.sample_weight for h in spec.heads if h.sample_weight is not None))


def batch_label_columns(spec: ModelSpec) -> tuple[str, ...]:
    """Columns of a batch's label tensor: the label of each head in head order, then the
    sample-weight columns (`weight_columns`)."""
    return label_columns(spec) + weight_columns(spec)


def unique_labels(spec: ModelSpec) -> tuple[str, ...]:
    """Every label and sample-weight column, each once (what datasets carry besides features)."""
    return tuple(dict.fromkeys(batch_label_columns(spec)))


def is_multi(feature: SparseFeature) -> bool:
    """True if the feature is stored as a list column (multi-hot or sequence)."""
    return feature.max_len > 1 or feature.kind == "sequence"


def train_part(path: str | Path) -> Path:
    """A dataset folder's training part: `DIR/train` of a split dataset (`DIR/train`, `DIR/test`),
    else the folder itself."""
    path = Path(path)
    return path / "train" if (path / "train" / META_FILE).is_file() else path


def read_meta(path: str | Path) -> DatasetMeta:
    """Read ``_flowrec.json`` of a dataset directory.

    Raises:
        DataError: if the directory or its metadata is missing or unreadable.
    """
    path = Path(path)
    if path.exists() and not path.is_dir():
        above = path.absolute().parents
        dataset = next((i for i, d in enumerate(above) if (d / META_FILE).is_file()), None)
        if dataset is not None:  # converting it, as the hint below says, is refused: it holds encoded rows
            shown = path.parents[dataset] if dataset < len(path.parents) else above[dataset]  # as the user named it
            shown = above[dataset] if shown == Path(".") else shown
            raise DataError(f"{path} is a file of the dataset {shown}, not a dataset folder: give that folder")
        raw = "parquet" if path.suffix.lower() in (".parquet", ".pq") else "FORMAT"
        raise DataError(f"{path} is a file, not a dataset folder: give the folder holding {META_FILE} "
                        f"(raw files are converted into one by `flowrec data convert {raw} {path} OUT --spec SPEC`)")
    if not path.is_dir():
        link = broken_link(path)
        raise DataError(f"dataset directory not found: {path}" + ("" if link is None else f" is {link}"))
    meta = path / META_FILE
    if not meta.is_file():
        parts = [part for part in ("train", "test") if (path / part / META_FILE).is_file()]
        if parts:  # `data convert --test-fraction`'s OUT: not "convert it first"
            raise DataError(f"{path} is a split dataset: its parts {' and '.join(str(path / p) for p in parts)} "
                            "are the datasets; give one of them")
        owned = _owned_folder(path)
        if owned is not None:  # a run or package given for its data: not "convert it first", nor days
            raise DataError(owned)
        days = sorted(p.name for p in path.iterdir() if p.is_dir() and (p / META_FILE).is_file()
                      and not p.name.startswith((".", "_")))
        if days:  # converted day partitions (`train --follow`), or other datasets: not "convert it first"
            raise DataError(f"{path} holds datasets ({', '.join(days[:3])}{', ...' if len(days) > 3 else ''}) "
                            f"and is not one: give one of them, or, for day partitions, train on each in turn "
                            f"with `flowrec train SPEC --follow {path} --out RUN`")
        raw = " parquet" if any(path.glob("*.parquet")) else ""
        raise DataError(f"{path} is not a flowrec dataset (no {META_FILE}); convert it first "
                        f"with `flowrec data convert{raw}` or `flowrec data synth`")
    try:
        return DatasetMeta.from_json(read_text(meta), str(meta))
    except DataError as exc:
        raise DataError(f"{meta}: {exc}") from None
    except UnicodeDecodeError:  # it was Python's words: "(UnicodeDecodeError: 'utf-8' codec can't decode ...)"
        raise DataError(f"{meta} is not UTF-8 text: unreadable dataset metadata; convert the data again") from None
    except KeyError as exc:
        raise DataError(f"{meta} has no key {exc.args[0]!r}: unreadable dataset metadata; convert the data again") \
            from None
    except (ValueError, TypeError) as exc:  # its own words, naming the file once (not "(NotJsonError: META is ...)")
        text = str(exc) if str(exc).startswith(str(meta)) else f"{meta}: {exc}"
        raise DataError(f"{text}: unreadable dataset metadata; convert the data again") from None


def _owned_folder(path: Path) -> str | None:
    """What to say of a training run's folder or a model package given as a dataset (it was 'not a
    flowrec dataset; convert it first'): a run's encoded bound data is named; None for other folders."""
    owner = owner_of(path)
    if owner == "a training run":
        data = path / "data"
        parts = [str(data / p) for p in ("test", "train") if (data / p / META_FILE).is_file()]
        found = parts or ([str(data)] if (data / META_FILE).is_file() else [])
        return (f"{path} is a training run's folder, not a dataset: " + (
            f"give the data it encoded, {' or '.join(found)}" if found else
            "give the dataset it trained on (its run.json records it; a run on synthetic rows keeps none)"))
    if owner == "a model package":
        return f"{path} is a model package, not a dataset: it holds no rows; give a dataset"
    if is_stream_folder(path):
        return (f"{path} is a --follow stream folder, not a dataset: each of its days is a run; give the data a day "
                f"trained on (`flowrec data inspect DAYS --stream {path}` lists the days it follows)")
    return None


def read_text(path: Path) -> str:
    """The text of a metadata file of at most MAX_SPEC_BYTES (ValueError otherwise)."""
    with open(path, "rb") as f:
        data = f.read(MAX_SPEC_BYTES + 1)
    if len(data) > MAX_SPEC_BYTES:
        raise ValueError(f"larger than {MAX_SPEC_BYTES:,} bytes")
    return data.decode("utf-8")


def write_meta(path: str | Path, meta: DatasetMeta) -> None:
    Path(path, META_FILE).write_text(meta.to_json() + "\n")


def check_spec(meta: DatasetMeta, spec: ModelSpec, path: str | Path | None = None) -> None:
    """Raise DataError if the dataset (in folder `path`, named in the error) was not encoded for a
    spec with the same inputs: a run's --data and --eval-data, or one day of a --follow stream
    among many, would otherwise be refused without saying which folder."""
    name = "dataset" if path is None else f"dataset {path}"
    if meta.data_hash != data_hash(spec):
        raise DataError(
            f"{name} was encoded for spec {meta.spec!r} (data hash {meta.data_hash}); spec "
            f"{spec.name!r} has data hash {data_hash(spec)}: features or tables differ, re-convert")
    missing = [c for c in unique_labels(spec) if c not in meta.labels]
    if missing:
        raise DataError(f"{name} lacks label columns {missing} (has {list(meta.labels)})")
