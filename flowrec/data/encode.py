"""Encoding raw columns to the flowrec layout: hashed or vocabulary ids, dense transforms.

Categorical values are encoded by their string form (an int 7 and a string "7" are the same
value). Hashed tables map a value to ``1 + h(value) % (rows - 1)`` with a stable 64-bit hash
(pandas' SipHash with a fixed key: identical on every machine and run); row 0 is missing.
Vocabulary tables map the values seen at least ``min_freq`` times (most frequent first, ties by
value) to rows 1..; unknown, rare and missing values go to row 0.

Example:
    >>> import pyarrow as pa
    >>> hash_rows(pa.array(["a", None, "a"]), rows=100).tolist()[1]
    0
"""
from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Iterable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from flowrec.data.error_log import ErrorLog
from flowrec.data.id_forms import IdForms
from flowrec.data.layout import is_multi, unique_labels
from flowrec.data.raw_ids import as_strings, raw_id_hashes, value_hashes
from flowrec.spec.model import DenseFeature, ModelSpec, SparseFeature


def hash_rows(values: pa.Array, rows: int) -> np.ndarray:
    """Stable hash of each value's string form into rows 1..rows-1; nulls and "" -> 0."""
    hashed, index = value_hashes(values)
    hashed = hashed % np.uint64(max(rows - 1, 1))
    table = (hashed.astype(np.int64) + 1) if rows > 1 else np.zeros(len(hashed), np.int64)
    out = np.zeros(len(index), np.int64)
    valid = index >= 0
    out[valid] = table[index[valid]]
    return out


BATCHED_HASH_ROWS = 4096  # rows of a chunk up to which its one-hot hashed columns of one type hash as one


def hash_rows_together(columns: list[pa.Array], rows: list[int]) -> list[np.ndarray]:
    """`hash_rows(columns[i], rows[i])` for each i, bitwise, with the columns of one Arrow type
    hashed as one array: a call's fixed cost (text cast, dictionary, hashing) once per type, not once
    per column (a one-row `model.predict` of 1,000 hashed fields spent 150 ms in 1,000 such calls).

    >>> a, b = pa.array(["x", None, "7"]), pa.array(["7", "y", ""])
    >>> [r.tolist() for r in hash_rows_together([a, b], [50, 9])] == [hash_rows(a, 50).tolist(), hash_rows(b, 9).tolist()]
    True
    """
    out: list[np.ndarray | None] = [None] * len(columns)
    kinds: dict[pa.DataType, list[int]] = {}
    columns = [c.combine_chunks() if isinstance(c, pa.ChunkedArray) else c for c in columns]  # (the caller's list kept)
    for i, column in enumerate(columns):
        if pa.types.is_dictionary(column.type) or pa.types.is_nested(column.type) or len(column) == 0 \
                or pa.types.is_binary(column.type) or pa.types.is_large_binary(column.type):
            # (dictionaries of other values do not concatenate; bytes that are not UTF-8 are named by row)
            out[i] = hash_rows(column, rows[i])
        else:
            kinds.setdefault(column.type, []).append(i)
    for members in kinds.values():
        if len(members) == 1:
            out[members[0]] = hash_rows(columns[members[0]], rows[members[0]])
            continue
        hashed, index = value_hashes(pa.concat_arrays([columns[i] for i in members]))
        start = 0
        for i in members:
            part = index[start:start + len(columns[i])]
            start += len(columns[i])
            ids = np.zeros(len(part), np.int64)
            valid = part >= 0
            if rows[i] > 1:
                ids[valid] = (hashed[part[valid]] % np.uint64(rows[i] - 1)).astype(np.int64) + 1
            out[i] = ids
    return out  # type: ignore[return-value]


def count_values(values: pa.Array, counter: Counter) -> None:
    """Add the occurrences of each non-null value (string form) to `counter`."""
    vc = pc.value_counts(as_strings(values).drop_null())
    counter.update(dict(zip(vc.field("values").to_pylist(), vc.field("counts").to_pylist())))


def build_vocab(counter: Counter, size: int, min_freq: int) -> pa.Array:
    """Vocabulary (string values of rows 1..) of a table: at most `size` values, frequent first,
    ties by value."""
    kept = sorted(((-c, v) for v, c in counter.items() if c >= min_freq))[:size]
    return pa.array([v for _, v in kept], pa.string())


BOOL_TEXTS = (("true", "false"), ("True", "False"), ("TRUE", "FALSE"))  # Arrow's; pandas' CSV; R's CSV


def vocab_strings(values: pa.Array, vocab: pa.Array) -> pa.Array:
    """The values as the ids of a vocabulary (`as_strings`), a column of booleans written as the
    vocabulary writes them: a bool has no text of its own, and a run trained on a CSV pandas wrote
    (True, False) had every Parquet or DataFrame bool ('true') unknown, without a word.

    >>> vocab_strings(pa.array([True, None, False]), pa.array(["False", "True"])).to_pylist()
    ['True', None, 'False']
    >>> vocab_strings(pa.array([True]), pa.array(["x"])).to_pylist()  # none known: Arrow's text
    ['true']
    """
    kind = values.type.value_type if pa.types.is_dictionary(values.type) else values.type
    strings = as_strings(values)
    if not pa.types.is_boolean(kind) or not len(vocab):
        return strings
    for yes, no in BOOL_TEXTS:
        if pc.any(pc.is_in(pa.array([yes, no]), value_set=vocab)).as_py():
            return pc.replace_substring_regex(pc.replace_substring_regex(strings, "^true$", yes), "^false$", no)
    return strings


def vocab_rows(values: pa.Array, vocab: pa.Array) -> np.ndarray:
    """Rows of the values in a vocabulary (row = index + 1); unknown and missing -> 0."""
    index = pc.index_in(vocab_strings(values, vocab), value_set=vocab)
    return (index.fill_null(-1).to_numpy(zero_copy_only=False).astype(np.int64) + 1)


FLOAT32_MAX = float(np.finfo(np.float32).max)  # an encoded dense value beyond it would be inf


@dataclass(frozen=True)
class DenseStats:
    """Mean and standard deviation of a dense feature after fill and log1p (for standardize)."""

    mean: float
    std: float


@dataclass
class StatsAccumulator:
    """Streaming count / mean / sum of squared deviations per dense feature (float64), chunks
    combined as Chan et al.'s parallel variance does: a sum of squares less the squared mean lost
    the spread of values far from 0 (epoch seconds 1.7e9 + 0..100 had std 1.0, not 29). A feature
    of one value throughout has std 1.0 (its values standardize to 0), not a rounding residue.

    >>> acc = StatsAccumulator()
    >>> acc.add("t", np.array([1.7e9, 1.7e9 + 2.0])); acc.add("t", np.array([1.7e9 + 4.0]))
    >>> acc.stats()["t"].std == float(np.std([0.0, 2.0, 4.0]))
    True
    >>> acc.add("c", np.full(3, 0.1)); acc.add("c", np.full(4, 0.1)); acc.stats()["c"]
    DenseStats(mean=0.1, std=1.0)
    """

    n: dict[str, int] = field(default_factory=dict)
    mean: dict[str, float] = field(default_factory=dict)
    m2: dict[str, float] = field(default_factory=dict)
    lo: dict[str, float] = field(default_factory=dict)
    hi: dict[str, float] = field(default_factory=dict)

    def add(self, name: str, x: np.ndarray) -> None:
        if not len(x):
            return
        nb, mb = len(x), float(x.mean())
        m2b = float(np.square(x - mb).sum())
        na, ma = self.n.get(name, 0), self.mean.get(name, 0.0)
        n = na + nb
        delta = mb - ma
        self.n[name] = n
        self.mean[name] = ma + delta * (nb / n)
        self.m2[name] = self.m2.get(name, 0.0) + m2b + delta * delta * (na * nb / n)
        self.lo[name] = min(self.lo.get(name, np.inf), float(x.min()))
        self.hi[name] = max(self.hi.get(name, -np.inf), float(x.max()))

    def stats(self) -> dict[str, DenseStats]:
        out = {}
        for name, n in self.n.items():
            if self.lo[name] == self.hi[name]:  # one value: no spread to scale by
                out[name] = DenseStats(self.lo[name], 1.0)
                continue
            out[name] = DenseStats(self.mean[name], float(np.sqrt(self.m2[name] / n)) or 1.0)
        return out


def dense_values(feature: DenseFeature, raw: pa.Array) -> np.ndarray:
    """Fill missing values, then log1p (negatives clamped to 0) where asked: float64 (N,). Integers
    beyond 2**53 are rounded, as CSV reads them."""
    x = pc.cast(raw, pa.float64(), safe=False).to_numpy(zero_copy_only=False)
    x = np.where(np.isnan(x), feature.fill, x)
    if feature.transform == "log1p":
        x = np.log1p(np.maximum(x, 0.0))
    return x


@dataclass(frozen=True)
class Encoder:
    """Encodes raw tables (source column names) into the flowrec layout of a spec.

    Args:
        spec: the model spec.
        columns: feature / label name -> source column (default: the same name).
        vocabs: table -> vocabulary (values of rows 1..), for vocabulary tables.
        stats: dense feature -> statistics, for standardized features.
        sequence_sep: separator of multi-hot values held in one string (e.g. "^").
        id_forms: hashed or managed feature -> the form its training rows wrote its ids in
            (`flowrec.data.id_forms`; none for a run recorded before forms were).

    Example:
        >>> enc = Encoder(spec, columns={}, vocabs={}, stats={})  # doctest: +SKIP
        >>> enc.encode(raw_table).column_names  # doctest: +SKIP
    """

    spec: ModelSpec
    columns: dict[str, str]
    vocabs: dict[str, pa.Array]
    stats: dict[str, DenseStats]
    sequence_sep: str = "^"
    id_forms: dict[str, dict[str, str]] = field(default_factory=dict)

    def source(self, name: str) -> str:
        return self.columns.get(name, name)

    def sparse_values(self, feature: SparseFeature, raw: pa.Table) -> pa.Array:
        """Raw values of a sparse feature: flat for one-hot, a list array for multi-hot."""
        col = raw.column(self.source(feature.name)).combine_chunks()
        if not is_multi(feature) or pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
            return col
        strings = as_strings(col)
        return pc.split_pattern(strings.fill_null(""), self.sequence_sep)

    def encode_sparse(self, feature: SparseFeature, raw: pa.Table) -> pa.Array:
        table = self.spec.table(feature.table)
        values = self.sparse_values(feature, raw)
        multi = is_multi(feature)
        flat = pc.list_flatten(values) if multi else values
        if table.managed is not None:
            rows = raw_id_hashes(flat)
        elif table.hashed:
            rows = hash_rows(flat, table.rows)
        else:
            rows = vocab_rows(flat, self.vocabs[table.name])
        if not multi:
            return pa.array(rows, pa.int64())
        keep = as_strings(flat).is_valid().to_numpy(zero_copy_only=False)
        return truncated_lists(values, rows, keep, feature.max_len, feature.truncate)

    def unencodable(self, raw: pa.Table) -> dict[int, str]:
        """Rows (index -> why) whose standardized dense value is beyond float32: a finite raw number
        that the encoder's mean and std scale past 3.4e38 (3e38 in a column of std 0.001), which the
        float32 column held as inf (predict wrote NaN scores, a converted dataset was refused by train).
        Such a row is malformed, as a raw value beyond float32 is."""
        out: dict[int, str] = {}
        present = set(raw.column_names)  # (once: Arrow builds the list anew at each ask)
        for f in self.spec.dense_features:
            if f.transform != "standardize" or self.source(f.name) not in present or f.name not in self.stats:
                continue  # (a column lacking, or no statistics: a synthetic run's, is predict's line)
            st = self.stats[f.name]
            x = dense_values(f, raw.column(self.source(f.name)))
            with np.errstate(over="ignore", invalid="ignore"):
                wrong = ~(np.abs((x - st.mean) / st.std) <= FLOAT32_MAX) & np.isfinite(x)
            for i in np.flatnonzero(wrong):
                out.setdefault(int(i), f"dense value {float(x[i])!r} in column {self.source(f.name)}: standardized "
                                       f"(mean {st.mean:.6g}, std {st.std:.6g}) it is beyond float32")
        return out

    def _hashed_together(self, raw: pa.Table) -> dict[str, pa.Array]:
        """`encode_sparse` of every one-hot feature of a hashed table, by `hash_rows_together`."""
        features = [f for f in self.spec.sparse_features if not is_multi(f)
                    and self.spec.table(f.table).managed is None and self.spec.table(f.table).hashed]
        if len(features) < 2:
            return {}
        ids = hash_rows_together([self.sparse_values(f, raw) for f in features],
                                 [self.spec.table(f.table).rows for f in features])
        return {f.name: pa.array(rows, pa.int64()) for f, rows in zip(features, ids)}

    def encode(self, raw: pa.Table, labels: bool = True) -> pa.Table:
        """Encode one raw chunk; returns a table with the layout's columns in spec order (the
        label columns last, unless `labels` is False: rows to score need none)."""
        cols, names = [], []
        hashed = self._hashed_together(raw) if raw.num_rows <= BATCHED_HASH_ROWS else {}
        for f in self.spec.features:
            if f.name in hashed:
                cols.append(hashed[f.name])
            elif isinstance(f, DenseFeature):
                x = dense_values(f, raw.column(self.source(f.name)))
                if f.transform == "standardize":
                    st = self.stats[f.name]
                    x = (x - st.mean) / st.std
                cols.append(pa.array(x.astype(np.float32)))
            else:
                cols.append(self.encode_sparse(f, raw))
            names.append(f.name)
        for label in unique_labels(self.spec) if labels else ():
            col = pc.cast(raw.column(self.source(label)), pa.float32())
            cols.append(col.combine_chunks() if isinstance(col, pa.ChunkedArray) else col)
            names.append(label)
        return pa.Table.from_arrays(cols, names=names)


OTHER_FORM_SHARE = 0.5  # unseen ids, of a column's, past which their other form is looked for
_BOOL_TEXT = "^(true|false)$"
_TIME_TEXT = r"^([0-9]{4}-[0-9]{2}-[0-9]{2})[ T]([0-9]{2}:[0-9]{2}:[0-9]{2})(\.0+)?Z?$"


def id_key(values: pa.Array) -> pa.Array:
    """Each id text in one form of what other writers of the same column write otherwise: a float
    column's text (pandas' CSV) "12.0" -> "12"; a boolean's "True" (pandas'), "TRUE" (R's) -> "true"
    (Arrow's, Spark's); a time's "2024-01-05 13:45:00.000000" (Arrow's) -> "2024-01-05 13:45:00"
    (pandas'), a midnight's -> "2024-01-05" (pandas' of a column of midnights); " u7" (a CSV written
    with ", " between fields) -> "u7". `UnseenIds` compares ids so; they are encoded as written ("012"
    stays another id than "12").

    >>> id_key(pa.array(["12.0", "12", "012", "1.50", None, "True", "2024-01-05 00:00:00.000000",
    ...                  "2024-01-05T13:45:00", " u7 "])).to_pylist()
    ['12', '12', '012', '1.50', None, 'true', '2024-01-05', '2024-01-05 13:45:00', 'u7']
    >>> id_key(pa.array(["3.0"], pa.large_string())).to_pylist()  # (a Parquet file's large_string)
    ['3']
    """
    keys = pc.replace_substring_regex(pc.utf8_trim_whitespace(values), r"^(-?[0-9]+)\.0+$", r"\1")
    keys = pc.if_else(pc.match_substring_regex(keys, _BOOL_TEXT, ignore_case=True), pc.utf8_lower(keys), keys)
    keys = pc.replace_substring_regex(keys, r"^([0-9]{4}-[0-9]{2}-[0-9]{2})[ T]00:00:00(\.0+)?Z?$", r"\1")
    return pc.replace_substring_regex(keys, _TIME_TEXT, r"\1 \2")


@dataclass
class UnseenIds:
    """Counts, over the chunks an existing encoder encodes (`flowrec predict`, `data convert
    --encoder-from`), the ids of each vocabulary feature that its vocabulary does not hold, and of
    those the ids it holds in another form (`id_key`: "12.0" where training saw "12", or the
    reverse; "True" where it saw "true"; a time with or without its fraction of a second): pandas
    writes an integer id column with a missing value as floats, and CSV keeps their text, so rows
    of such a file mapped almost every id to row 0 without a word. Ids are not merged ("012" and
    "12" may be two ids); `lines` says so where most ids are such. Hashed and managed features have
    no vocabulary: their ids' form (`flowrec.data.id_forms`) is compared with the one the encoder
    records of the training rows (`Encoder.id_forms`), and `lines` says where it differs."""

    encoder: Encoder
    counts: dict[str, list[int]] = field(default_factory=dict)  # feature -> [ids, unseen, in another form]
    examples: dict[str, tuple[str, str]] = field(default_factory=dict)  # feature -> (an id, its form there)
    _keys: dict[str, pa.Array] = field(default_factory=dict)  # table -> `id_key` of its vocabulary (once)
    forms: IdForms = field(default_factory=IdForms)  # the forms of the hashed and managed features' ids

    def observe(self, raw: pa.Table, encoded: pa.Table | None = None) -> None:
        """Count the ids of a raw chunk; `encoded`, its encoding by this encoder or by one grown from
        it (`flowrec.data.vocab_growth`: new values in rows past its vocabulary), tells the unknown
        ids of a one-id feature (row 0, or past the vocabulary) without looking each up again."""
        if self.encoder.id_forms:  # (a run recorded before forms were: nothing to compare with)
            self.forms.observe(self.encoder, raw, self.encoder.id_forms)
        present = set(raw.column_names)  # (once, not per feature: a 1,000-field model spent 130 ms a call here)
        for f in self.encoder.spec.sparse_features:
            table = self.encoder.spec.table(f.table)
            if table.hashed or table.managed is not None or self.encoder.source(f.name) not in present:
                continue
            vocab = self.encoder.vocabs.get(table.name)
            if vocab is None:
                continue
            values = self.encoder.sparse_values(f, raw)
            ids = vocab_strings(pc.list_flatten(values) if is_multi(f) else values, vocab)
            if encoded is not None and not is_multi(f):  # row 0 (unknown, or missing), or a row grown since
                rows = encoded.column(f.name)
                new = pc.or_(pc.equal(rows, 0), pc.greater(rows, len(vocab)))
                unseen = ids.filter(pc.and_(ids.is_valid(), new))
                ids = ids.drop_null()
            else:
                ids = ids.drop_null()
                unseen = ids.filter(pc.invert(pc.is_in(ids, value_set=vocab)))
            count = self.counts.setdefault(f.name, [0, 0, 0])
            count[0], count[1] = count[0] + len(ids), count[1] + len(unseen)
            if len(unseen) <= OTHER_FORM_SHARE * len(ids):  # a chunk of known ids (and a few new ones): no
                continue  # other form looked for (its vocabulary's keys are made where one is)
            if table.name not in self._keys:
                self._keys[table.name] = id_key(vocab)
            where = pc.index_in(id_key(unseen), value_set=self._keys[table.name])
            found = len(where) - where.null_count
            count[2] += found
            if found and f.name not in self.examples:
                i = int(pc.index(where.is_valid(), True).as_py())
                self.examples[f.name] = (unseen[i].as_py(), vocab[where[i].as_py()].as_py())

    def add(self, other: "UnseenIds") -> None:
        """Count `other`'s ids too (a call's, into a model's running count)."""
        for name, counts in other.counts.items():
            mine = self.counts.setdefault(name, [0, 0, 0])
            mine[:] = [a + b for a, b in zip(mine, counts)]
        for name, example in other.examples.items():
            self.examples.setdefault(name, example)
        self.forms.add(other.forms)

    def lines(self) -> list[str]:
        """A line per feature most of whose ids are unseen while most of those are held in
        another form (`id_key`), and per hashed or managed feature whose ids are written in another
        form than the training rows' (`flowrec.data.id_forms`)."""
        out = []
        for name, (ids, unseen, found) in self.counts.items():
            if not (unseen > OTHER_FORM_SHARE * ids and found > OTHER_FORM_SHARE * unseen):
                continue
            mine, theirs = self.examples[name]
            source = self.encoder.source(name)
            if mine.strip() != mine or theirs.strip() != theirs:
                how = (f"write ids with spaces around them ({mine!r}), unlike the training rows ({theirs!r}; a CSV "
                       "written with ', ' between fields keeps the space in its text); write column "
                       f"{source} as the training rows did")
            elif re.match(_BOOL_TEXT, mine, re.IGNORECASE):
                how = (f"write booleans as {mine!r}, unlike the training rows ({theirs!r}: pandas writes True, "
                       f"Arrow, Spark and DuckDB true); write column {source} as the training rows did")
            elif re.match(_TIME_TEXT, mine) or re.match(_TIME_TEXT, theirs):
                how = (f"write times as {mine!r}, unlike the training rows ({theirs!r}: Arrow writes a time with "
                       "its fraction of a second, pandas' CSV without it and a column of midnights as dates); "
                       f"write column {source} as the training rows did (as text, say)")
            else:
                how = (f"write the ids {'as floats' if '.' in mine else 'as whole numbers'}, unlike the training "
                       "rows (pandas writes an integer column with a missing value as floats, 12.0); write column "
                       f"{source} as the training rows did (pandas' nullable dtype \"Int64\" keeps integers beside "
                       "missing values)")
            out.append(f"column {source}: {unseen:,} of {ids:,} ids are not in the vocabulary of feature {name} "
                       f"(unknown ids), but {found:,} of them are there in another form ({mine!r} is {theirs!r} "
                       f"there): these rows {how}")
        return out + self.forms.lines(self.encoder, self.encoder.id_forms)


def drop_unencodable(encoder: Encoder, raw: pa.Table, log: ErrorLog) -> pa.Table:
    """`raw` without the rows `Encoder.unencodable` names, each a malformed row in `log` (under
    --on-error fail: the DataError naming its line)."""
    keep = encodable_rows(encoder, raw, log)
    return raw if keep is None else raw.filter(pa.array(keep))


def encodable_rows(encoder: Encoder, raw: pa.Table, log: ErrorLog) -> np.ndarray | None:
    """The mask of the rows of `raw` that `Encoder.unencodable` does not name (None: all of them),
    each named one a malformed row in `log` (under --on-error fail: the DataError naming its line)."""
    from flowrec.data.sources import LINE_COLUMN

    bad = encoder.unencodable(raw)
    if not bad:
        return None
    lines = raw.column(LINE_COLUMN).to_numpy() if LINE_COLUMN in raw.column_names else np.arange(raw.num_rows) + 1
    for i, why in sorted(bad.items()):
        log.add(int(lines[i]), why)
    keep = np.ones(raw.num_rows, bool)
    keep[list(bad)] = False
    return keep


def truncated_lists(values: pa.Array, rows: np.ndarray, keep: np.ndarray, max_len: int,
                    truncate: str = "first") -> pa.Array:
    """List array of the encoded ids per sample: missing elements dropped, then the first max_len
    kept (`truncate` "first") or the last max_len (`truncate` "last": the most recent items of a
    history), in their order. The one rule of conversion and of scoring raw rows (`Encoder`).

    Args:
        values: the raw list array (N samples), for its offsets.
        rows: encoded row of every flattened element (missing ones included).
        keep: per flattened element, whether it is present (not missing).

    Example:
        >>> lists = pa.array([["a", None, "b", "c"]])
        >>> keep = np.array([True, False, True, True])
        >>> truncated_lists(lists, np.array([1, 0, 2, 3]), keep, 2, "last").to_pylist()
        [[2, 3]]
    """
    offsets = values.offsets.to_numpy() - values.offsets[0].as_py()  # (N + 1,)
    lengths = np.diff(offsets)
    sample = np.repeat(np.arange(len(lengths)), lengths)[keep]
    rows = rows[keep]
    counts = np.bincount(sample, minlength=len(lengths))
    starts = np.cumsum(counts) - counts
    position = np.arange(len(rows)) - np.repeat(starts, counts)  # index within its sample's kept ids
    if truncate == "last":
        position = np.repeat(counts, counts) - 1 - position  # index from the sample's end
    short = position < max_len
    new_counts = np.minimum(counts, max_len)
    new_offsets = np.concatenate([[0], np.cumsum(new_counts)]).astype(np.int32)
    return pa.ListArray.from_arrays(pa.array(new_offsets), pa.array(rows[short], pa.int64()))


def fit_encoder(spec: ModelSpec, chunks: Iterable[pa.Table], columns: dict[str, str],
                sequence_sep: str = "^", overflow: list[str] | None = None) -> Encoder:
    """One pass over raw chunks to build the vocabularies and dense statistics the spec needs.

    Args:
        overflow: where given, gets one line per vocabulary table whose `vocab` size left out values
            seen at least `min_freq` times, in more than OVERFLOW_WARN of the table's occurrences
            (they all share row 0, the unknown row): the values seen, kept and the share lost.
    """
    probe = Encoder(spec, columns, {}, {}, sequence_sep)
    vocab_tables = {t.name: t for t in spec.tables if t.has_vocab}
    counters: dict[str, Counter] = {name: Counter() for name in vocab_tables}
    acc = StatsAccumulator()
    standardized = [f for f in spec.dense_features if f.transform == "standardize"]
    for raw in chunks:
        for f in spec.sparse_features:
            if f.table in counters:
                values = probe.sparse_values(f, raw)
                count_values(pc.list_flatten(values) if is_multi(f) else values, counters[f.table])
        for f in standardized:
            acc.add(f.name, dense_values(f, raw.column(probe.source(f.name))))
    vocabs = {name: build_vocab(counters[name], t.vocab_size, t.min_freq) for name, t in vocab_tables.items()}
    if overflow is not None:
        overflow.extend(line for name, t in vocab_tables.items()
                        for line in vocab_overflow(name, counters[name], len(vocabs[name]), t.min_freq))
    return Encoder(spec, columns, vocabs, acc.stats(), sequence_sep)


OVERFLOW_WARN = 0.01  # share of a table's occurrences sent to row 0 by its vocab size that is worth a warning


def vocab_overflow(table: str, counter: Counter, kept: int, min_freq: int) -> list[str]:
    """A warning when a vocabulary of `kept` values left out frequent-enough values (beyond its size).

    >>> vocab_overflow("user", Counter({"a": 5, "b": 3, "c": 2}), 1, 1)[0][:58]
    "table 'user' (vocab 1) keeps 1 of 3 distinct values; the o"
    >>> vocab_overflow("user", Counter({"a": 5, "b": 1}), 1, 2)
    []
    """
    eligible = sorted((c for c in counter.values() if c >= min_freq), reverse=True)
    total = sum(counter.values())
    lost = sum(eligible[kept:])
    if not total or lost / total <= OVERFLOW_WARN:
        return []
    return [f"table {table!r} (vocab {kept:,}) keeps {kept:,} of {len(eligible):,} distinct values; the other "
            f"{len(eligible) - kept:,}, {lost / total:.1%} of its occurrences, share row 0 (the unknown row): "
            f"raise its vocab to keep them apart"]


def needs_fit(spec: ModelSpec) -> bool:
    """True if encoding needs a first pass (vocabulary tables or standardized features)."""
    return any(t.has_vocab for t in spec.tables) or any(
        f.transform == "standardize" for f in spec.dense_features)
