"""Streaming conversion of raw inputs to an encoded flowrec Parquet dataset.

Reads a source chunk by chunk (bounded memory), encodes it for the spec and appends it to
Parquet part files of at most `rows_per_file` rows. Vocabulary tables and standardized features
need a first pass over the input (as DLRM's Criteo preprocessing does); a split conversion makes it
over the rows it writes to ``train/`` alone, so the test rows are held out of the vocabularies and
statistics too (recorded as ``fit_on: train`` in the split record). With
``data.options.test_fraction`` the rows are split (seeded by ``split_seed``, by a hash of each row's
values: rule 3, so a row's exact copies land on its side, `flowrec.data.duplicates`; by row index
for a run of before it, rule 2; either way not by chunking) into ``train/`` and ``test/`` datasets; with
``split_by: <timestamp column>`` the newest ``test_fraction`` of the rows are the test set (a first
pass reads the column, numbers or text times ordered as text; rows at the cutoff time go to test). The
rows' hashes of a fit pass are kept for the write pass (`flowrec.data.kept_hashes`). Encoding with an existing encoder
whose tables reserve spare rows (``vocab_spare``) first finds the unseen values and gives them
those rows (`flowrec.data.vocab_growth`); the dataset records the extended encoder. Labels are checked
for their heads (`flowrec.data.labels`: binary 0/1, libsvm's -1/+1 mapped and counted). The
output is written into a new folder and swapped in when complete (`flowrec.data.output`); a
conversion that yields no rows is an error and leaves nothing.

Example:
    >>> report = convert(spec, "criteo", [Path("day_0.tsv")], Path("data/criteo"))  # doctest: +SKIP
    >>> report.rows  # doctest: +SKIP
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flowrec.data.duplicates import Duplicates, mix64, row_hashes
from flowrec.data.encode import Encoder, UnseenIds, encodable_rows, fit_encoder, needs_fit
from flowrec.data.empty_columns import EmptyColumns, EmptyLabels
from flowrec.data.look_alike import look_alike_note, look_alikes
from flowrec.data.encoder_record import record_of_encoder
from flowrec.data.close_names import close_name
from flowrec.data.error_log import ErrorLog, ErrorPolicy
from flowrec.data.id_forms import IdForms
from flowrec.data.kept_hashes import KeptHashes
from flowrec.data.labels import (PLUS_MINUS_FORMATS, check_labels, label_features, label_spaces, label_tasks,
                                 text_label_line)
from flowrec.data.layout import (VOCAB_DIR, DataError, DatasetMeta, data_hash, encoded_rows, encoding_mode, is_multi,
                                 unique_labels, write_meta)
from flowrec.data.output import staged_output
from flowrec.data.parquet_folder import listed_files, skipped_note, unread_lines
from flowrec.data.raw_ids import check_float_ids, check_ids
from flowrec.data.rawstats import RawStats
from flowrec.data.sequences import TEST_COLUMN, split_option
from flowrec.data.separators import DEFAULT_SEQUENCE_SEP, check_sequence_separators, header_separator
from flowrec.data.split_share import empty_side_error, far_from, share_line
from flowrec.data.sources import FORMAT_ALIASES, LINE_COLUMN, TextColumn, feature_map_of, reader
from flowrec.data.vocab_growth import TableGrowth, grow_encoder
from flowrec.spec.model import ModelSpec
from flowrec.spec.read import broken_link

ROWS_PER_FILE = 1 << 20  # rows per Parquet part file
ROW_GROUP_ROWS = 1 << 14  # rows per Parquet row group: the unit a rank reads (1/8 of a shuffle chunk)
FORMAT_LABEL = {"avazu_csv": "click"}  # source label column when the spec names none
MAP_COLUMNS = "map them with data.columns"  # the hint for missing columns when nothing more is known
SPLIT_MIX = np.uint64(0x9E3779B97F4A7C15)  # golden-ratio increment of splitmix64
# the seeded split's rule, recorded with it (`split_rule`) since 2026-12-06: 3 is `split_by_hash`'s
# (a row's side drawn from its values: exact copies of a row land on its side); 2 is `split_mask`'s
# (since ffdac45, 2026-12-05: by row index, so a file joined to itself put each copy on a side of
# its own), still made for a run of before rule 3 whose bound data is encoded again; before, the
# rows drew another hash, so a dataset whose record names no rule may hold another split than
# converting its raw rows again makes
SPLIT_RULE = 3
INDEX_SPLIT_RULE = 2
SPLIT_RULES = (INDEX_SPLIT_RULE, SPLIT_RULE)
# the rows a split conversion fits its encoder on, recorded with the split (`fit_on`) since
# 2026-12-06: its train rows alone ("given": it encoded with a given encoder, fitted elsewhere, any
# spare rows grown on the train rows); a record that names none was fitted on every row, test rows included
FIT_ON = "train"
LAST_OUT_NEEDS = ("data option split: leave_last_out needs per-user sequences (format movielens with data option "
                  "sequence: {max_len: L})")


@dataclass(frozen=True)
class ConvertReport:
    """What a conversion wrote and skipped."""

    out: str
    rows: int
    files: int
    errors: int
    error_examples: tuple[str, ...]
    seconds: float
    split: dict[str, int] = field(default_factory=dict)
    labels_mapped: int = 0  # libsvm/libfm labels -1 read as 0 (the -1/+1 convention)
    growth: tuple[TableGrowth, ...] = ()  # spare rows given to new values (with a given encoder)
    warnings: tuple[str, ...] = ()  # what the encoding lost that the spec could keep (vocab sizes); rows not read
    # (a raw Parquet folder's `_temporary/`: `flowrec.data.parquet_folder.unread_lines`)


class PartWriter:
    """Appends encoded chunks to part-NNNNN.parquet files of at most `rows_per_file` rows, in row
    groups of at most ROW_GROUP_ROWS rows (so that a rank of a multi-process run reads about its
    share of each shuffle chunk, `flowrec.data.strata`)."""

    def __init__(self, out: Path, rows_per_file: int):
        check_rows_per_file(rows_per_file)
        self.out, self.rows_per_file = out, rows_per_file
        self.files, self.rows, self._writer, self._in_file = 0, 0, None, 0
        out.mkdir(parents=True, exist_ok=True)

    def write(self, table: pa.Table) -> None:
        while table.num_rows:
            if self._writer is None:
                path = self.out / f"part-{self.files:05d}.parquet"
                self._writer = pq.ParquetWriter(path, table.schema)
                self.files += 1
            take = min(table.num_rows, self.rows_per_file - self._in_file)
            self._writer.write_table(table.slice(0, take), row_group_size=ROW_GROUP_ROWS)
            self._in_file += take
            self.rows += take
            table = table.slice(take)
            if self._in_file >= self.rows_per_file:
                self.close()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
        self._writer, self._in_file = None, 0


def check_rows_per_file(rows_per_file: int) -> None:
    """DataError unless a part file may hold at least one row (0 or fewer wrote nothing, forever).

    >>> check_rows_per_file(0)
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: rows per file must be at least 1, not 0
    """
    if int(rows_per_file) < 1:
        raise DataError(f"rows per file must be at least 1, not {rows_per_file}")


def check_test_fraction(options: dict[str, Any]) -> None:
    """DataError unless the options' test_fraction (when given) is a number in [0, 1): more than 1,
    a negative one or NaN was reported as an empty split, naming no option.

    >>> check_test_fraction({"test_fraction": 1.5})
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: test_fraction must be a number at least 0 and below 1 (the share of rows split off into test/), not 1.5
    """
    value = options.get("test_fraction")
    if value is None:
        return
    try:
        fraction = float(value)
    except (TypeError, ValueError):
        fraction = float("nan")
    if isinstance(value, bool) or not 0.0 <= fraction < 1.0:  # NaN fails both comparisons
        raise DataError(f"test_fraction must be a number at least 0 and below 1 (the share of rows split off into "
                        f"test/), not {value!r}")


def check_split_seed(options: dict[str, Any]) -> None:
    """DataError unless the options' split_seed (when given) is an integer in [0, 2^64): the split
    hashes it as an unsigned 64-bit number, and a negative one was an OverflowError traceback.

    >>> check_split_seed({"split_seed": -5})
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: split_seed must be an integer from 0 to 2^64-1, not -5
    """
    value = options.get("split_seed")
    if value is None:
        return
    seed = -1  # refused unless the value is a whole number (an int, an integral float, or its digits)
    if isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer():
        seed = int(value)
    elif isinstance(value, str) and value.strip().isdigit():
        seed = int(value)
    if not 0 <= seed < 1 << 64:
        raise DataError(f"split_seed must be an integer from 0 to 2^64-1, not {value!r}")


def check_sequence_sep(options: dict[str, Any]) -> None:
    """DataError unless the options' sequence_sep (when given) is a non-empty string: the ids of a
    multi-hot text value are split at it (an empty one was pyarrow's "Empty separator", naming no option).

    >>> check_sequence_sep({"sequence_sep": ""})
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: data.options.sequence_sep must be a non-empty string (the separator of the ids of a multi-hot value), not ''
    """
    value = options.get("sequence_sep")
    if value is not None and (not isinstance(value, str) or not value):
        raise DataError(f"data.options.sequence_sep must be a non-empty string (the separator of the ids of a "
                        f"multi-hot value), not {value!r}")


def seeded_split(options: dict[str, Any]) -> bool:
    """Whether data options split the rows into train and test by a seed: a test_fraction, without
    split_by (a date cutoff) or split (leave_last_out).

    >>> seeded_split({"test_fraction": 0.2}), seeded_split({"test_fraction": 0.2, "split_by": "day"})
    (True, False)
    """
    return bool(float(options.get("test_fraction") or 0)) and not options.get("split_by") and not options.get("split")


def older_seeded_split(split: dict[str, Any]) -> bool:
    """A dataset's split record (`_flowrec.json`'s `split`) of a seeded split that names no split
    rule: converted by a flowrec of before 2026-12-06, perhaps one of before 2026-12-05 whose rule
    put other rows in test, so converting the raw rows again need not give the same split.

    >>> older_seeded_split({"test_fraction": 0.2, "part": "train", "split_seed": 0})
    True
    >>> older_seeded_split({"test_fraction": 0.2, "part": "train", "split_seed": 0, "split_rule": SPLIT_RULE})
    False
    """
    return "split_seed" in split and split.get("split_rule") not in SPLIT_RULES


def split_mask(start: int, n: int, fraction: float, seed: int) -> np.ndarray:
    """True for rows (global indices start..start+n) in the test split: row r draws output r + 1 of
    splitmix64 seeded with splitmix64's first output of `seed`, so every seed (0 included) gives its
    own uniform draw to every row (row 0 included) and the test part is a `fraction` of the rows.

    >>> [int(split_mask(0, 100_000, 0.1, seed).sum()) for seed in (0, 1)]
    [9909, 9894]
    >>> split_mask(0, 4, 1e-9, 0).tolist()  # seed 0 once put row 0 in test at any fraction
    [False, False, False, False]
    """
    with np.errstate(over="ignore"):
        key = mix64(np.array([seed], dtype=np.uint64) + SPLIT_MIX)  # (1,)
        state = key + (np.arange(start, start + n, dtype=np.uint64) + np.uint64(1)) * SPLIT_MIX
    return (mix64(state) >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def split_by_hash(hashes: np.ndarray, fraction: float, seed: int) -> np.ndarray:
    """True for the rows in the test split by rule 3: a row draws its side from its values' hash
    (`flowrec.data.duplicates.row_hashes`) mixed with splitmix64's first output of `seed`, so exact
    copies of a row share its side, and every seed gives its own uniform draw.

    >>> h = np.arange(100_000, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
    >>> [abs(int(split_by_hash(h, 0.1, seed).sum()) - 10_000) < 500 for seed in (0, 1)]
    [True, True]
    >>> split_by_hash(np.array([7, 7], dtype=np.uint64), 0.5, 3).tolist() in ([True, True], [False, False])
    True
    """
    with np.errstate(over="ignore"):
        key = mix64(np.array([seed], dtype=np.uint64) + SPLIT_MIX)  # (1,)
        drawn = mix64(hashes ^ key)
    return (drawn >> np.uint64(11)).astype(np.float64) / float(1 << 53) < fraction


def convert(spec: ModelSpec, fmt: str, inputs: list[Path], out: Path, on_error: ErrorPolicy = "fail",
            options: dict[str, Any] | None = None, rows_per_file: int = ROWS_PER_FILE,
            progress: Callable[[int], None] | None = None, overwrite: bool = False,
            encoder: Encoder | None = None, grow: bool = True,
            status: Callable[[str], None] | None = None, split_rule: int = SPLIT_RULE) -> ConvertReport:
    """Convert raw files of a format to an encoded dataset in `out`.

    The dataset is written into a new sibling folder and renamed to `out` when complete
    (`flowrec.data.output`): a failed or interrupted conversion leaves nothing behind.

    Args:
        spec: the model spec (features, tables; data.columns and data.options are honoured).
        fmt: input format (criteo_tsv|avazu_csv|csv|libsvm|movielens, or criteo|avazu|libfm).
        inputs: input files (a folder for movielens).
        out: output dataset directory (absent or empty, unless `overwrite`).
        on_error: "skip" malformed rows (counted, reported) or "fail" on the first one.
        options: format options overriding data.options (sep, sequence_sep, test_fraction...).
        rows_per_file: rows per Parquet part file.
        progress: called with the number of rows of each written chunk.
        overwrite: replace a non-empty `out`.
        encoder: encode with this existing encoder (a run's, `flowrec.data.encoder_record`)
            instead of fitting one: unseen values go to row 0 or their hash bucket, or, in
            tables with spare rows, to the free rows after the vocabulary.
        grow: with `encoder`, give unseen values spare rows (False: row 0, as `predict` does).
        status: told when replacing `out` waits for flowrec processes reading it (a run training on it).
        split_rule: the seeded split's rule (`SPLIT_RULE`; `INDEX_SPLIT_RULE` for the bound data of a
            run of before rule 3, encoded again: the rows it trained on).

    Raises:
        DataError: missing inputs, unreadable input, a malformed row with on_error="fail", an
            output folder that is not empty (without `overwrite`), no rows converted, fewer than
            one row per file, a test_fraction outside [0, 1) or a split_seed outside [0, 2^64).
    """
    started = time.perf_counter()
    fmt = FORMAT_ALIASES.get(fmt, fmt)
    reader(fmt)  # an unknown format fails before anything is created
    check_rows_per_file(rows_per_file)
    merged = {**(dict(spec.data.options) if spec.data is not None else {}), **(options or {})}
    check_test_fraction(merged)
    check_split_seed(merged)
    check_sequence_sep(merged)
    for path in inputs:
        if not path.exists():
            link = broken_link(path)
            raise DataError(f"input not found: {path}" + ("" if link is None else f" is {link}"))
    if encoder is not None:
        _check_vocabularies(spec, encoder)
    unread = [line for path in inputs if fmt == "parquet" for line in unread_lines(path)]  # a job still writing
    with staged_output(Path(out), overwrite, inputs, status) as tmp, KeptHashes(tmp) as kept:
        report = _convert_into(spec, fmt, inputs, tmp, on_error, options or {}, rows_per_file, progress,
                               encoder, grow, kept, split_rule)
        _check_rows(report, inputs, fmt)
    return replace(report, out=str(out), seconds=time.perf_counter() - started, warnings=(*unread, *report.warnings))


def _convert_into(spec: ModelSpec, fmt: str, inputs: list[Path], out: Path, on_error: ErrorPolicy,
                  options: dict[str, Any], rows_per_file: int,
                  progress: Callable[[int], None] | None, given: Encoder | None, grow: bool,
                  kept: KeptHashes, split_rule: int = SPLIT_RULE) -> ConvertReport:
    read = reader(fmt)
    opts = dict(spec.data.options) if spec.data is not None else {}
    opts.update(options)
    if FORMAT_ALIASES.get(fmt, fmt) == "libsvm" and opts.get("feature_map"):
        opts["feature_map"] = feature_map_of(opts)  # read once; the encoder records it (predict reads it there)
    last_out = split_option(opts) == "leave_last_out"
    if last_out and FORMAT_ALIASES.get(fmt, fmt) != "movielens":  # a column of another input named TEST_COLUMN
        raise DataError(LAST_OUT_NEEDS)  # was taken for the marker: its values' truth split the rows, without a word
    columns = dict(spec.data.columns) if spec.data is not None else {}
    for label in unique_labels(spec):
        if label not in columns and fmt in FORMAT_LABEL and label == "label":
            columns[label] = FORMAT_LABEL[fmt]
    split_by = opts.get("split_by")
    numeric = {columns.get(f.name, f.name) for f in spec.dense_features}
    numeric |= {columns.get(c, c) for c in unique_labels(spec)}
    # MovieLens folders hold numbers (and are read whole before their first chunk: no probe)
    text_times = bool(split_by) and split_by not in numeric and FORMAT_ALIASES.get(fmt, fmt) != "movielens" \
        and _text_times(read, inputs, opts, numeric, split_by)
    if split_by and not text_times:
        numeric.add(split_by)
    if given is not None and given.columns != columns:  # the input's columns are the spec's data.columns (as
        given = replace(given, columns=columns)  # checked), not those of the rows the encoder was made from
    tasks = label_tasks(spec, columns)
    spaces = label_spaces(spec, columns)
    mapped = [0]
    separators_checked = [False]
    # a run's encoder brings its recorded separator: lists written with another are refused all the same
    advice = None if given is None else (f"write each row's ids separated by {given.sequence_sep!r}, as the "
                                         "encoder of --encoder-from splits them")

    def chunks(log_policy: ErrorPolicy) -> Iterator[tuple[ErrorLog, pa.Table]]:
        for path in inputs:
            log = ErrorLog(log_policy, str(path))
            logs.append(log)
            labelled = EmptyLabels(spec, columns, tasks, spaces, str(path))  # a label column empty in every row
            for chunk in _label_text_said(read(path, opts, log, numeric), tasks, path):
                _check_columns(chunk, spec, columns, path)
                _check_id_columns(chunk, spec, columns, path, FORMAT_ALIASES.get(fmt, fmt) != "parquet")
                if FORMAT_ALIASES.get(fmt, fmt) == "libsvm":
                    chunk = one_index_each(chunk, spec, columns, log)
                if not separators_checked[0]:
                    _check_separators(chunk, spec, columns, opts, path, advice)
                    separators_checked[0] = True
                labelled.observe(chunk)
                if log_policy == "fail":  # (its first row would stop it: say why, not to skip such rows)
                    labelled.check(whole=False)
                chunk, n = check_labels(chunk, tasks, log, fmt in PLUS_MINUS_FORMATS, spaces)
                mapped[0] += n
                if split_by and float(opts.get("test_fraction", 0.0)):
                    chunk = _with_times(chunk, split_by, log, text_times)
                if chunk.num_rows:
                    yield log, chunk
            labelled.check(whole=True)

    logs: list[ErrorLog] = []
    sep = opts.get("sequence_sep", DEFAULT_SEQUENCE_SEP)
    growth: tuple[TableGrowth, ...] = ()
    overflow: list[str] = []
    fraction = float(opts.get("test_fraction", 0.0))
    seed = int(opts.get("split_seed", 0))
    # the cutoff first (its pass needs no encoder): the encoder is fitted on the rows before it
    cutoff = _time_cutoff((c for _, c in chunks(on_error)), split_by, fraction, text_times) \
        if split_by and fraction else None

    by_hash = bool(fraction) and cutoff is None and split_rule == SPLIT_RULE  # rule 3

    def test_rows(chunk: pa.Table, index: int, hashes: np.ndarray | None = None) -> np.ndarray | None:
        """The test side of a chunk whose first row is row `index` (None: no split), `hashes` its rows'
        (`row_hashes`, made here where not given). Rows are counted before the rows the encoder
        cannot encode are dropped (`encodable_rows`: that depends on the fitted encoder), so the fit
        pass and the write pass number them alike."""
        if by_hash:
            return split_by_hash(row_hashes(chunk) if hashes is None else hashes, fraction, seed)
        if fraction:
            return (split_mask(index, chunk.num_rows, fraction, seed) if cutoff is None
                    else np.asarray(_times(chunk, split_by, text_times) >= cutoff, bool))
        return _last_rows(chunk) if last_out else None

    counted = {"rows": 0, "train": 0}

    def train_rows() -> Iterator[pa.Table]:
        """The raw rows that the write pass puts in train/ (all of them without a split): the
        encoder is fitted (or grown) on them alone, never on the held-out test rows."""
        for _, chunk in chunks(on_error):
            hashes = None
            if by_hash:  # hashed once: kept for the write pass
                hashes = row_hashes(chunk)
                kept.put(hashes)
            test = test_rows(chunk, counted["rows"], hashes)
            counted["rows"] += chunk.num_rows
            if test is not None:
                chunk = chunk.filter(pa.array(~test))
            counted["train"] += chunk.num_rows
            if chunk.num_rows:
                yield chunk
        kept.done()

    split = bool(fraction or last_out)
    if given is not None and grow:
        encoder, growth = grow_encoder(given, train_rows())
    elif given is not None:
        encoder = given
    elif needs_fit(spec):
        encoder = fit_encoder(spec, train_rows(), columns, sep, overflow)
    else:
        encoder = Encoder(spec, columns, {}, {}, sep)
    logs.clear()  # the write pass counts the malformed rows and mapped labels again
    mapped[0] = 0
    if split and counted["rows"] and not counted["train"]:  # every row held out: nothing to fit on or train on
        if cutoff is not None:
            raise DataError(_after_cutoff(inputs, split_by, cutoff, fraction))
        raise DataError(_empty_side(inputs, "train", fraction, _copies_of(kept) if by_hash else None, counted["rows"]))
    writers = {"": PartWriter(out, rows_per_file)} if not split else {
        "train": PartWriter(out / "train", rows_per_file), "test": PartWriter(out / "test", rows_per_file)}
    seen = index = 0
    stats = {name: RawStats(spec, columns, opts.get("date_column", split_by)) for name in writers}
    unseen = UnseenIds(given) if given is not None else None  # ids the run's vocabulary holds in another form
    forms = IdForms()  # how the rows write the ids of hashed and managed tables, recorded with the encoder
    empty = EmptyColumns(spec, columns)  # feature columns of an input that hold no value in any row written
    copies = Duplicates()  # rows that repeat an earlier row in every column, kept and said in one line
    for log, chunk in chunks(on_error):
        hashes = kept.take(chunk.num_rows) if by_hash else None  # the fit pass's, where it hashed them
        hashes = row_hashes(chunk) if hashes is None else hashes
        copies.observe(log.path or "", hashes, chunk.column(LINE_COLUMN).to_numpy())
        test = test_rows(chunk, index, hashes)
        index += chunk.num_rows
        keep = encodable_rows(encoder, chunk, log)  # a run's std scaling a value past float32
        if keep is not None:
            chunk = chunk.filter(pa.array(keep))
            test = None if test is None else test[keep]
        if not chunk.num_rows:
            continue
        encoded = encoder.encode(chunk)
        forms.observe(encoder, chunk)
        empty.observe(log.path, chunk)
        if unseen is not None:  # ids the given encoder does not know, told by the encoding (grown or not)
            unseen.observe(chunk, encoded)
        if test is not None:
            for side, mask in (("test", pa.array(test)), ("train", pa.array(~test))):
                writers[side].write(encoded.filter(mask))
                stats[side].observe(chunk.filter(mask), encoded.filter(mask))
        else:
            writers[""].write(encoded)
            stats[""].observe(chunk, encoded)
        seen += encoded.num_rows
        if progress is not None:
            progress(encoded.num_rows)
    if cutoff is not None and seen and "train" in writers and not writers["train"].rows:
        # every row at the cutoff time or later: another test_fraction or split_seed would not help
        for w in writers.values():
            w.close()
        raise DataError(_after_cutoff(inputs, split_by, cutoff, fraction))
    if by_hash and seen and not (writers["train"].rows and writers["test"].rows):  # copies may leave a side empty
        for w in writers.values():
            w.close()
        raise DataError(_empty_side(inputs, "test" if writers["train"].rows else "train", fraction, copies, seen))
    for name, w in writers.items():
        w.close()
        record = {"test_fraction": fraction, "part": name}
        record.update({"split_by": split_by, "cutoff": cutoff} if cutoff is not None
                      else {"split_seed": seed, "split_rule": split_rule})
        if last_out:
            record = {"split": "leave_last_out", "part": name}
        # fitted here on the train rows alone, or a given encoder (--encoder-from, a run's), grown on them
        record["fit_on"] = FIT_ON if given is None else "given"
        _finish(spec, encoder, w, fmt, inputs, record if split else {}, opts.get("feature_map"), forms.record(),
                forms.column_types() if fmt == "parquet" else None)  # (text sources' ids have no type)
        stats[name].write(w.out)
    examples = tuple(str(e) for log in logs for e in log.examples)
    copied = copies.line("row" if fmt == "parquet" else "line", split=by_hash)
    uneven = None  # a test share far from test_fraction: few distinct rows, each a unit of the split
    count, estimate = copies.count() if by_hash else (0, False)
    if count and far_from(writers["test"].rows, seen, fraction):
        uneven = share_line(inputs, writers["train"].rows, writers["test"].rows, fraction, copies.rows - count, estimate)
    return ConvertReport(str(out), seen, sum(w.files for w in writers.values()),
                         sum(log.count for log in logs), examples, 0.0,
                         {k: w.rows for k, w in writers.items() if k}, mapped[0], growth,
                         (*label_features(spec, columns), *overflow, *(unseen.lines() if unseen is not None else ()),
                          *empty.lines(), *([copied] if copied else ()), *([uneven] if uneven else ())))


def _after_cutoff(inputs: list[Path], split_by: str, cutoff: float | str, fraction: float) -> str:
    """The error of a time split whose every row is at or after its cutoff (no train rows)."""
    shown = int(cutoff) if isinstance(cutoff, float) and cutoff.is_integer() else cutoff
    return (f"no rows converted from {', '.join(str(p) for p in inputs)} into the train split: every "
            f"row's {split_by} is at or after the cutoff {shown} (the newest {fraction:g} of the "
            f"rows reach back to the oldest time, and rows at the cutoff go to test); leave "
            f"split_by out to split by test_fraction alone, or convert rows of more times")


def _empty_side(inputs: list[Path], side: str, fraction: float = 0.0, copies: Duplicates | None = None,
                rows: int = 0) -> str:
    """The error of a split that put no row in `side` (train or test); `copies`: the rows' copies, for a
    split by row values (rule 3), whose few distinct rows may have left it empty (`flowrec.data.split_share`);
    `rows`: the rows split, of which a `fraction` so small it draws less than one row on average is said so.

    >>> _empty_side([Path("a.csv")], "test", 1e-9, None, 400)
    'no rows converted from a.csv into the test split: test_fraction 1e-09 of its 400 rows is 4e-07 rows on average; give test_fraction at least 0.0025 (one row in 400), or convert more rows'
    """
    names = ", ".join(str(p) for p in inputs)
    if rows and side == "test" and fraction * rows < 1:
        return (f"no rows converted from {names} into the test split: test_fraction {fraction:g} of its {rows:,} rows "
                f"is {fraction * rows:.2g} rows on average; give test_fraction at least {1 / rows:.2g} (one row in "
                f"{rows:,}), or convert more rows")
    if rows and side == "train" and (1 - fraction) * rows < 1:
        return (f"no rows converted from {names} into the train split: test_fraction {fraction:g} leaves "
                f"{(1 - fraction) * rows:.2g} of its {rows:,} rows for train on average; give test_fraction at most "
                f"{1 - 1 / rows:.6g}, or convert more rows")
    count, estimate = copies.count() if copies is not None else (0, False)
    if count:
        return empty_side_error(inputs, side, copies.rows, fraction, copies.rows - count, estimate)
    return (f"no rows converted from {names} into the {side} split: change "
            "test_fraction or split_seed, or convert more rows")


def _copies_of(kept: KeptHashes) -> Duplicates:
    """The copies among a complete fit pass's kept hashes (its rows' places aside)."""
    copies = Duplicates()
    for hashes in kept.replay():
        copies.observe("", hashes, np.zeros(len(hashes), np.int64))
    return copies


def _label_text_said(chunks: Iterator[pa.Table], tasks: dict[str, str], path: Path) -> Iterator[pa.Table]:
    """The chunks of a reader of `path`; a label column of mostly text (`TextColumn`) said in the
    label's terms (`text_label_line`), not as a numeric column's; either line names the file (of
    many inputs, which one held the text)."""
    try:
        yield from chunks
    except TextColumn as exc:
        line = text_label_line(exc.column, exc.values, tasks[exc.column]) if exc.column in tasks else str(exc)
        raise DataError(f"{path}: {line}") from None
    finally:
        close = getattr(chunks, "close", None)
        if close is not None:
            close()


def _last_rows(chunk: pa.Table) -> np.ndarray:
    """Leave-last-out: the reader's marker of each user's last example."""
    if TEST_COLUMN not in chunk.column_names:
        raise DataError(LAST_OUT_NEEDS)
    return chunk.column(TEST_COLUMN).to_numpy(zero_copy_only=False).astype(bool)


def _text_times(read: Callable, inputs: list[Path], opts: dict[str, Any], numeric: set[str], column: str) -> bool:
    """Whether the split_by column holds times as text ('2017-05-06 00:00:00', ISO dates: they
    order as text) rather than numbers, told by its first value: Taobao's time_stamp was read as a
    number, so every row was malformed ('non-numeric value', with a hint to skip them all). A column
    whose first value is a number stays numeric (a later text value is a malformed row, as before)."""
    from contextlib import closing

    for path in inputs:
        with closing(read(path, opts, ErrorLog("skip", str(path)), set(numeric))) as chunks:
            for chunk in chunks:
                if column not in chunk.column_names:
                    return False  # named by _times
                values = chunk.column(column)
                if not (pa.types.is_string(values.type) or pa.types.is_large_string(values.type)):
                    return False
                values = pc.drop_null(values).to_pylist()
                first = next((v for v in values if v.strip()), None)
                if first is not None:
                    try:
                        float(first)
                    except ValueError:
                        return True
                    return False
    return False


def _times(chunk: pa.Table, column: str, text: bool = False) -> np.ndarray:
    """The split column of a chunk as float64, or as str objects for text times (rows without a
    time were taken out as malformed)."""
    if column not in chunk.column_names:
        raise DataError(f"split_by: column {column!r} is not in the input (has "
                        f"{[c for c in chunk.column_names[:12] if c != LINE_COLUMN]})")
    if text:
        return np.asarray(chunk.column(column).to_pylist(), dtype=object)
    return pc.cast(chunk.column(column), pa.float64()).to_numpy(zero_copy_only=False)


def _with_times(chunk: pa.Table, column: str, log: ErrorLog, text: bool = False) -> pa.Table:
    """The chunk without rows that have no time in the split_by column: each is a malformed row
    (named, counted, skipped or fatal by --on-error), never silently a training row."""
    if column not in chunk.column_names:
        missing = np.zeros(0, bool)
    elif text:  # no time: null, or only blanks
        values = chunk.column(column)
        missing = pc.fill_null(pc.equal(pc.utf8_trim_whitespace(values), ""), True).to_numpy(zero_copy_only=False)
    else:
        missing = np.isnan(pc.cast(chunk.column(column), pa.float64()).to_numpy(zero_copy_only=False))
    if not missing.any():
        return chunk
    lines = chunk.column(LINE_COLUMN).to_numpy()
    for i in np.flatnonzero(missing):
        log.add(int(lines[i]), f"no time in column {column} (split_by needs one on every row)")
    return chunk.filter(pa.array(~missing))


def _time_cutoff(chunks: Iterator[pa.Table], column: str, fraction: float, text: bool = False) -> float | str:
    """The time from which rows are test rows: the newest `fraction` of the rows (rows at the
    cutoff time all go to test, so the test share can be a little larger); text times by their
    order as text."""
    times = np.sort(np.concatenate([_times(c, column, text) for c in chunks] or [np.zeros(0)]))
    if not len(times):
        return float("inf")
    index = min(len(times) - max(int(round(len(times) * fraction)), 1), len(times) - 1)
    return str(times[max(index, 0)]) if text else float(times[max(index, 0)])


def _check_vocabularies(spec: ModelSpec, encoder: Encoder) -> None:
    """Raise DataError if a given encoder lacks the vocabulary of a vocabulary table."""
    lacking = [t.name for t in spec.tables if t.has_vocab and t.name not in encoder.vocabs]
    if lacking:
        raise DataError(f"the encoder has no vocabulary for table {lacking[0]!r} (a run trained on "
                        "synthetic data has none): encode raw data with the encoder of a run trained "
                        "on converted data")


def _check_rows(report: ConvertReport, inputs: list[Path], fmt: str) -> None:
    """Raise DataError if the conversion (or one side of its split) holds no rows."""
    names = ", ".join(str(p) for p in inputs)
    if not report.rows and report.errors:
        raise DataError(f"no rows converted from {names}: "
                        + (f"all {report.errors:,} rows were" if report.errors > 1 else "its one row was") + " malformed "
                        f"(first: {report.error_examples[0]})")
    if not report.rows:
        skipped = [note for p in inputs if fmt == "parquet" and (note := skipped_note(p))]
        if skipped:
            raise DataError(f"no rows converted from {names}: {'; '.join(skipped)}")
        bare = [p for p in inputs if fmt == "parquet" and p.is_dir() and not listed_files(p)[0]]
        if bare:  # was "it holds no data rows for format parquet (empty, header only, or another format)"
            raise DataError(f"no rows converted from {names}: {bare[0]} is a folder without files to read (a Parquet "
                            "folder holds part files: give the folder they are in, or a file)")
        raise DataError(f"no rows converted from {names}: it holds no data rows for format {fmt} "
                        "(empty, header only, or another format)")
    for side, rows in report.split.items():
        if not rows:
            raise DataError(_empty_side(inputs, side))


def _check_separators(chunk: pa.Table, spec: ModelSpec, columns: dict[str, str], opts: dict[str, Any],
                      path: Path, advice: str | None = None) -> None:
    """The multi-hot text columns of the first chunk against data option sequence_sep
    (`flowrec.data.separators`); the error names the input file."""
    try:
        check_sequence_separators(chunk, spec, columns, opts, advice)
    except DataError as exc:
        raise DataError(f"{path}: {exc}") from None


def _check_columns(chunk: pa.Table, spec: ModelSpec, columns: dict[str, str], path: Path) -> None:
    names = [f.name for f in spec.features] + list(unique_labels(spec))  # the spec's names of columns
    needed = [columns.get(name, name) for name in names]
    missing = [c for c in needed if c not in chunk.column_names]
    if missing:
        header = [name for name in chunk.column_names if name != LINE_COLUMN]
        has = [name[:40] for name in header[:12]]
        more = "..." if len(header) > 12 else ""
        hint = _separator_hint(chunk.column_names, needed)
        if hint == MAP_COLUMNS:  # nothing wrong with the header itself: a name the spec got wrong?
            named = label_places(spec)
            hint = _close_columns(header, missing, needed, columns, named) or hint
            if hint == MAP_COLUMNS and all(c in named for c in missing):  # data.columns maps features only
                hint = "; ".join(f"set {named[c]} to the input's {'weight' if 'weight' in named[c] else 'label'} "
                                 f"column" for c in missing)
        raise DataError(f"{path}: columns {missing} required by spec {spec.name!r} not in the input "
                        f"(has {has}{more}); {hint}")


def label_places(spec: ModelSpec) -> dict[str, str]:
    """Each label and sample-weight column -> where the spec names it (`heads[1].label`, `data.label`,
    or the default's `data.label (default 'label')`): data.columns maps features only, so a label
    column is renamed there."""
    places: dict[str, str] = {}
    for i, head in enumerate(spec.heads):
        if head.label:
            places.setdefault(head.label, f"heads[{i}].label")
        elif spec.data is not None and spec.data.label != "label":
            places.setdefault(spec.data.label, "data.label")
        else:
            places.setdefault("label", "data.label (default 'label') or the heads' label")
        if head.sample_weight is not None:
            places.setdefault(head.sample_weight, f"heads[{i}].sample_weight")
    return places


def _close_columns(header: list[str], missing: list[str], needed: list[str], columns: dict[str, str],
                   named: dict[str, str] | None = None) -> str:
    """For each missing column, the input's column of a really close name (`close_name`) that the
    spec does not read, as a typo in the spec's name or in its data.columns mapping; "" for none.
    `named`: label and sample-weight columns -> where the spec names them (`label_places`), which
    data.columns cannot map.

    >>> _close_columns(["clk", "userid", "click_sequence"], ["click_sequense"], ["clk", "click_sequense"], {})
    "is 'click_sequense' the input's 'click_sequence' (read by no feature or label)? correct the spec's name, or map it with data.columns: {click_sequense: click_sequence}"
    >>> _close_columns(["clk", "userid"], ["user_id"], ["clk", "user_id"], {"user": "user_id"})
    "data.columns maps 'user' to 'user_id': is it the input's 'userid' (read by no feature or label)?"
    >>> _close_columns(["id", "clk"], ["user"], ["clk", "user"], {}), _close_columns(["item_id"], ["cate_id"], ["cate_id"], {})
    ('', '')
    >>> _close_columns(["user", "rating_5"], ["rating5"], ["user", "rating5"], {}, {"rating5": "heads[1].label"})
    "is 'rating5' the input's 'rating_5' (read by no feature or label)? correct heads[1].label: rating_5"
    """
    unread = [name for name in header if name not in needed]
    notes = []
    for column in missing:
        found = close_name(column, unread)  # really close: not 'cate_id' for 'item_id' (`flowrec.data.close_names`)
        if found is None:
            continue
        unread.remove(found)
        mapped = [name for name, target in columns.items() if target == column and name != column]
        if named and column in named:
            notes.append(f"is {column!r} the input's {found!r} (read by no feature or label)? correct {named[column]}: "
                         f"{found}")
        elif mapped:
            notes.append(f"data.columns maps {mapped[0]!r} to {column!r}: is it the input's {found!r} (read by no "
                         f"feature or label)?")
        else:
            notes.append(f"is {column!r} the input's {found!r} (read by no feature or label)? correct the spec's "
                         f"name, or map it with data.columns: {{{column}: {found}}}")
    return "; ".join(notes)


def _check_id_columns(chunk: pa.Table, spec: ModelSpec, columns: dict[str, str], path: Path, text: bool) -> None:
    """Each sparse feature's column holds ids (`check_ids`: no struct, map or nested list, bytes
    that are UTF-8 text, as predict checks them; of a `text` format, the CSV formats' bytes
    columns are ids by their type, their UTF-8 checked row by row where they are read),
    and an id column of floats (a Parquet file pandas wrote from integers with a missing value) no
    id that the float may have rounded from another (`check_float_ids`); the error names the file."""
    lines = chunk.column(LINE_COLUMN).to_numpy() if LINE_COLUMN in chunk.column_names else None
    for f in spec.sparse_features:
        name = columns.get(f.name, f.name)
        column = chunk.column(name)
        try:
            if not (text and (pa.types.is_binary(column.type) or pa.types.is_string(column.type))):
                check_ids(column, name, is_multi(f))
            check_float_ids(column, name, lines)
        except DataError as exc:
            raise DataError(f"{path}: {exc}") from None


def one_index_each(chunk: pa.Table, spec: ModelSpec, columns: dict[str, str], log: ErrorLog) -> pa.Table:
    """The libsvm rows without those that give a one-hot feature's column two or more indices (a
    feature map naming one column for several indices, or libfm's field given twice): the reader
    joins them with '^' for a multi-hot feature, and a one-hot one encoded the joined text ('0^1') as
    one id without a word. Each such row is malformed (named, counted, skipped or fatal by policy);
    `data convert`, train's staging and `flowrec predict` read libsvm rows so."""
    bad = np.zeros(chunk.num_rows, bool)
    lines = chunk.column(LINE_COLUMN).to_numpy()
    for f in spec.sparse_features:
        name = columns.get(f.name, f.name)
        if is_multi(f) or name not in chunk.column_names:
            continue
        values = chunk.column(name)
        joined = pc.fill_null(pc.match_substring(values, "^"), False).to_numpy(zero_copy_only=False)
        for i in np.flatnonzero(joined & ~bad):
            bad[i] = True
            indices = values[int(i)].as_py().split("^")
            log.add(int(lines[i]), f"{len(indices)} indices ({', '.join(indices[:4])}) give the column {name} of the "
                                   f"one-hot feature {f.name!r}: one index a row, or give the feature max_len "
                                   "(multi-hot)")
    return chunk.filter(pa.array(~bad)) if bad.any() else chunk


def _separator_hint(names: list[str], needed: list[str]) -> str:
    """How to fix missing columns: another separator where the header splits into the needed names
    by one (`;`, tab, `|`, `,`), else mapping them with data.columns.

    >>> _separator_hint(["id;click;hour"], ["click", "hour"])
    "the header looks ';'-separated: set data.options.sep: ';' in the spec"
    >>> print(_separator_hint(["a\\tb"], ["a", "b"]))
    the header looks "\\t"-separated: set data.options.sep: "\\t" in the spec
    >>> _separator_hint(["id", "clk"], ["click"])
    'map them with data.columns'
    >>> _separator_hint(["price", " user"], ["user"])
    "the header's names hold spaces around them (' user'): write the file without the spaces after its separators"
    """
    header = [n for n in names if n != LINE_COLUMN]
    alike = look_alikes(header, needed)
    if alike:  # 'usér' with its accent written apart (NFD, as macOS writes names), a no-break space
        return f"the header's {look_alike_note(*alike[0])}: write the header, or data.columns, with the same characters"
    padded = [n for n in header if n != n.strip() and n.strip() in needed]
    if padded and set(needed) <= {n.strip() for n in header}:  # `price, user, label`: the names read ' user'
        return (f"the header's names hold spaces around them ({', '.join(repr(n) for n in padded[:3])}): write the "
                "file without the spaces after its separators")
    sep = header_separator(header, needed)
    if sep is not None:
        shown = '"\\t"' if sep == "\t" else f"'{sep}'"  # as YAML writes it
        return f"the header looks {shown}-separated: set data.options.sep: {shown} in the spec"
    return MAP_COLUMNS


def _finish(spec: ModelSpec, encoder: Encoder, writer: PartWriter, fmt: str, inputs: list[Path],
            split: dict[str, Any], feature_map: dict[str, str] | None = None,
            id_forms: dict[str, dict[str, str]] | None = None, id_types: dict[str, str] | None = None) -> None:
    """Write the dataset's metadata: its encoder, with the forms its rows wrote the ids of hashed
    and managed tables in (`flowrec.data.id_forms`; none where it has no such tables) and the
    Arrow types a Parquet source held its id columns in (`EncoderRecord.id_types`)."""
    vocab_files = {}
    if encoder.vocabs:
        (writer.out / VOCAB_DIR).mkdir(exist_ok=True)
        for name, values in encoder.vocabs.items():
            pq.write_table(pa.table({"value": values}), writer.out / VOCAB_DIR / f"{name}.parquet")
            vocab_files[name] = f"{VOCAB_DIR}/{name}.parquet"
    record = record_of_encoder(spec, encoder, vocab_files)
    encoding = {}
    for f in spec.sparse_features:
        t = spec.table(f.table)
        encoding[f.name] = {"table": t.name, "rows": encoded_rows(t), "mode": encoding_mode(t),
                            "max_len": f.max_len, "vocab_file": vocab_files.get(t.name),
                            "vocab_digest": record.features[f.name]["vocab"]}
        if t.vocab_spare:
            encoding[f.name]["spare"] = t.vocab_spare
        if f.truncate != "first":
            encoding[f.name]["truncate"] = f.truncate
    dense = {}
    for f in spec.dense_features:
        st = encoder.stats.get(f.name)
        dense[f.name] = {"transform": f.transform, "fill": f.fill,
                         "mean": st.mean if st else None, "std": st.std if st else None}
    meta = DatasetMeta(spec.name, data_hash(spec), writer.rows, unique_labels(spec), encoding, dense,
                       {"format": fmt, "inputs": [str(p) for p in inputs],
                        "encoder": {"fingerprint": record.fingerprint, "columns": record.columns,
                                    "sequence_sep": record.sequence_sep, "order": list(record.features),
                                    **({"feature_map": feature_map} if feature_map else {}),
                                    **({"id_forms": id_forms} if id_forms else {}),
                                    **({"id_types": id_types} if id_types else {})}},
                       split)
    write_meta(writer.out, meta)
