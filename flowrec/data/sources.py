"""Raw sources: streaming readers of each input format, yielding raw pyarrow tables.

Every reader yields chunks (bounded memory whatever the file size) whose columns are the source
columns: labels and dense columns as float64 (null = missing), categorical columns as strings
(null = missing), multi-hot columns as strings (split later by the encoder) or lists. Malformed
rows (wrong field count, non-numeric value, bad encoding, missing label) go to the `ErrorLog`
with their line numbers and are dropped from the chunk (or raise, by policy). Every chunk also
carries `LINE_COLUMN`, the 1-based line of each row in its file, so later checks (labels) can
report rows the same way.

Readers are registered by the `data.format` names of the spec. `flowrec predict` reads the rows it
scores with a `Scoring` (labels may be missing; only the package's columns are read): a reader
argument of its own, never one of the spec's data.options, which a spec fills as it likes.

Example:
    >>> chunks = READERS["criteo_tsv"](Path("day_0.tsv"), {}, ErrorLog("skip"), {"label"})  # doctest: +SKIP
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Collection, Iterator, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from flowrec.data.csv_release import ReaderSlot, open_slot, readers_opened, tracked
from flowrec.data.error_log import ErrorLog
from flowrec.data.layout import META_FILE, DataError
from flowrec.data.libsvm_tokens import TOKEN_FORM, is_number, token_column
from flowrec.data.parquet_folder import file_columns, parquet_files
from flowrec.data.sequences import HISTORY_COLUMN, TEST_COLUMN, next_item_rows, sequence_length
from flowrec.data.stars import off_scale, scale_text
from flowrec.spec.model import FORMAT_ALIASES  # criteo, avazu, libfm: the readers' short names

CHUNK_BYTES = 16 << 20  # bytes of text per streamed chunk
LIBSVM_CHUNK_LINES = 65536  # lines per libsvm chunk
CRITEO_COLUMNS = ["label"] + [f"I{i}" for i in range(1, 14)] + [f"C{i}" for i in range(1, 27)]
ML_GENRES_COUNT = 19  # genre flags at the end of each u.item line
INT64_BOUND = 2.0 ** 63  # MovieLens ids and timestamps are int64: whole numbers of magnitude below it
FLOAT32_MAX = float(np.finfo(np.float32).max)  # larger numbers cannot be encoded
LINE_COLUMN = "__line__"  # int64: 1-based line of the row in its file (u.data for movielens)

@dataclass(frozen=True)
class Scoring:
    """How `flowrec predict` reads the rows a package scores: a row's label may be missing (scoring
    ignores it), and only `columns` are read where the format can leave the others unread (None:
    every column). A reader argument, so no spec's data.options can make `data convert` or `train`
    read so (a spec's `read_columns: [price]` read only that column)."""

    columns: frozenset[str] | None = None


class Reader(Protocol):
    """A format's reader: `path` in chunks of checked rows, by the spec's data `options`, malformed
    rows to `log`, the `numeric` columns as float64; `scoring` for the rows `flowrec predict` scores."""

    def __call__(self, path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
                 scoring: Scoring | None = None) -> Iterator[pa.Table]: ...


def read_criteo(path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
                scoring: Scoring | None = None) -> Iterator[pa.Table]:
    """Criteo TSV: label, I1..I13, C1..C26, tab-separated, no header, empty = missing.

    With ``options["has_label"]`` False, rows are in the layout of Criteo's test files: the same
    columns without the label (39 fields). With `scoring`, a row's label may be missing (an empty
    field), and only its columns and the label (a label that is not a number is still a malformed
    row) are read (`_scored_columns`).
    """
    _refuse_folder(path, "criteo")
    encoding = _fixed_layout_encoding(options, "criteo", "tab-separated, no header")
    if scoring is None and options.get("has_label", True) and _unlabelled_criteo(path):
        # every row would be 'wrong field count (39, expected 40)', whose '--on-error skip' drops them all
        raise DataError(f"{path}: its rows hold 39 fields, the layout of Criteo's test files (no label column); "
                        "training data needs the label first (40 fields). To score this file with a trained "
                        f"model: flowrec predict PKG {path} --format criteo")
    names = CRITEO_COLUMNS if options.get("has_label", True) else CRITEO_COLUMNS[1:]
    numeric = set(numeric) | {"label"} | {c for c in CRITEO_COLUMNS if c.startswith("I")}
    yield from csv_chunks(path, log, numeric, delimiter="\t", names=names,
                          required=set() if scoring else {"label"},
                          chunk_bytes=options.get("chunk_bytes", CHUNK_BYTES), encoding=encoding,
                          scoring=scoring is not None, columns=_scored_columns(scoring, "label", names))


def _unlabelled_criteo(path: Path) -> bool:
    """Whether the first row of a Criteo TSV file has the 39 fields of Criteo's test files (False
    where it cannot tell: the reader then says what is wrong)."""
    try:
        return not criteo_has_label(path)
    except DataError:
        return False


def criteo_has_label(path: Path) -> bool:
    """True if the Criteo TSV file's first row has the label (40 fields), False for the 39 fields of
    Criteo's test files. Blank lines before it are skipped, as the reader skips them.

    Raises:
        DataError: the first row has another number of fields (naming its line), or the file
            holds no row.
    """
    _refuse_folder(path, "criteo")
    try:
        line, first = _first_row(path)  # compressed test files (.gz, ...) too
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"cannot read {path}: {getattr(exc, 'strerror', None) or exc}") from None
    if first is None:
        raise DataError(f"{path} holds no rows (it is empty or blank)")
    fields = first.count(b"\t") + 1
    if fields in (len(CRITEO_COLUMNS), len(CRITEO_COLUMNS) - 1):
        return fields == len(CRITEO_COLUMNS)
    raise DataError(f"{path}: line {line} has {fields} tab-separated fields; Criteo rows have "
                    f"{len(CRITEO_COLUMNS)} (label first) or {len(CRITEO_COLUMNS) - 1} (test files, no label)")


def read_avazu(path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
               scoring: Scoring | None = None) -> Iterator[pa.Table]:
    """Avazu CSV with header (id, click, hour, C1, ...); label column `click` (with `scoring`: it
    may be missing, an empty field or column, as in Avazu's test file, and only the scored columns and
    `click` are read where the header names them all: `_scored_columns`)."""
    _refuse_folder(path, "avazu")
    encoding = _fixed_layout_encoding(options, "avazu", "comma-separated, a header first")
    header = None
    if scoring is not None and scoring.columns is not None:
        try:
            header = _header_names(path, ",", encoding or "utf-8")
        except (OSError, pa.ArrowInvalid, UnicodeError):
            header = None  # the reader names the file
    yield from csv_chunks(path, log, set(numeric) | {"click"}, delimiter=",", names=None,
                          required=set() if scoring else {"click"},
                          chunk_bytes=options.get("chunk_bytes", CHUNK_BYTES), encoding=encoding,
                          scoring=scoring is not None, columns=_scored_columns(scoring, "click", header))


def _scored_columns(scoring: Scoring | None, label: str, names: list[str] | None) -> frozenset[str] | None:
    """The columns a format of fixed label (criteo, avazu) reads for `scoring`: its columns and the
    label where the file has it (`names`: its columns, None: not known), whose text is still checked
    (a header line repeated inside the file is a malformed row, not a row scored); None (every column)
    when not scoring or scoring every column. A file without the label column (Avazu's and Criteo's
    test files) read every column.

    >>> scoring = Scoring(frozenset({"C1"}))
    >>> sorted(_scored_columns(scoring, "click", ["id", "click", "C1"])), sorted(_scored_columns(scoring, "click", ["id", "C1"]))
    (['C1', 'click'], ['C1'])
    >>> _scored_columns(None, "click", None)
    """
    if scoring is None or scoring.columns is None:
        return None
    return scoring.columns | ({label} if names is None or label in names else set())


def _fixed_layout_encoding(options: dict[str, Any], fmt: str, layout: str) -> str | None:
    """The text encoding a format of fixed layout (criteo, avazu) reads with: data.options.encoding,
    else None (UTF-8). Its layout options (sep, header, names) are refused in one line: they were
    taken by validate and then not applied, a `sep: ";"` file read as commas, a latin-1 file
    refused as invalid UTF-8 with `encoding: latin-1` set.

    >>> _fixed_layout_encoding({"encoding": "Latin-1", "test_fraction": 0.1}, "avazu", "comma-separated")
    'iso8859-1'
    >>> _fixed_layout_encoding({"sep": ";"}, "avazu", "comma-separated, a header first")
    Traceback (most recent call last):
    flowrec.data.layout.DataError: data.options.sep does not apply to format avazu (comma-separated, a header first): for another layout, format csv takes sep, header and names
    """
    for key in ("sep", "header", "names"):
        if key in options:
            raise DataError(f"data.options.{key} does not apply to format {fmt} ({layout}): for another "
                            "layout, format csv takes sep, header and names")
    return _encoding(options["encoding"]) if "encoding" in options else None


def arrow_threads_may_hold_python() -> bool:
    """Whether this process opened a streaming CSV reader with a Python invalid-row handler
    (`csv_chunks`). Arrow's IO threads can drop their last reference to such a reader late, and
    releasing the handler then needs the interpreter lock: during interpreter shutdown that
    thread is ended and the C++ runtime aborts the process ("terminate called without an active
    exception", exit 134) after the command's work and its output are done. Measured: 6 in 150
    runs of a read that ended in an error, 4 in 80 of a complete read, and so with the reader
    closed on every way out. A command line that ends then exits without the teardown
    (`flowrec.cli.main`)."""
    return readers_opened()


def read_csv(path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
             scoring: Scoring | None = None) -> Iterator[pa.Table]:
    """Generic delimited text; options: sep (","), header (true), names (when no header),
    encoding (the text's, "utf-8" by default: e.g. latin-1 or cp1252, read into UTF-8 on the way in).
    With `scoring` columns (the package's raw columns and --keep's) only those columns are read
    where the header names them all (`csv_chunks`)."""
    _refuse_folder(path, "csv")
    sep, header, names = _csv_options(options)
    if not header and not names:
        raise DataError("csv without header needs data.options.names")
    yield from csv_chunks(path, log, numeric, delimiter=sep,
                          names=names or None, required=set(),
                          chunk_bytes=options.get("chunk_bytes", CHUNK_BYTES),
                          skip_header=bool(names) and header,
                          encoding=_encoding(options.get("encoding", "utf-8")),
                          scoring=scoring is not None, columns=None if scoring is None else scoring.columns)


def _csv_options(options: dict[str, Any]) -> tuple[str, bool, list[str]]:
    """The csv data options sep, header and names, checked (they reach pyarrow as the spec gives
    them: `sep: "::"` was a message about Py_UCS4, `sep: 5` or `names: [1, 2]` a traceback, and
    `names: label` named the columns l, a, b, e, l).

    >>> _csv_options({"sep": "::"})
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: data.options.sep must be one character (other than a line break), not '::'
    >>> _csv_options({"sep": ";", "header": False, "names": ["a", "b"]})
    (';', False, ['a', 'b'])
    """
    sep, header, names = options.get("sep", ","), options.get("header", True), options.get("names")
    if not isinstance(sep, str) or len(sep) != 1 or sep in "\r\n":
        raise DataError(f"data.options.sep must be one character (other than a line break), not {sep!r}")
    if not isinstance(header, bool):
        raise DataError(f"data.options.header must be true or false, not {header!r}")
    if names is not None and (not isinstance(names, (list, tuple)) or not all(isinstance(n, str) for n in names)):
        raise DataError(f"data.options.names must be a list of column names, not {str(names)[:60]!r}")
    return sep, header, list(names or [])


def _encoding(name: Any) -> str:
    """A text encoding Python knows, by its canonical name (DataError for another value). A codec
    that is no text encoding (rot13, base64, hex, zlib: bytes to bytes or text to text; `undefined`)
    is refused too: it was a LookupError traceback once the file was read.

    >>> _encoding("Latin-1")
    'iso8859-1'
    >>> _encoding("rot13")
    Traceback (most recent call last):
    flowrec.data.layout.DataError: data.options.encoding: 'rot13' is not a text encoding (e.g. utf-8, latin-1, cp1252, utf-16)
    """
    import codecs

    try:
        found = codecs.lookup(str(name)).name
    except LookupError:
        raise DataError(f"data.options.encoding: unknown text encoding {str(name)[:40]!r} "
                        "(e.g. utf-8, latin-1, cp1252, utf-16)") from None
    try:
        "".encode(found)
    except (LookupError, UnicodeError):
        raise DataError(f"data.options.encoding: {str(name)[:40]!r} is not a text encoding "
                        "(e.g. utf-8, latin-1, cp1252, utf-16)") from None
    return found


def csv_chunks(path: Path, log: ErrorLog, numeric: set[str], delimiter: str, names: list[str] | None,
               required: set[str], chunk_bytes: int, skip_header: bool = False,
               encoding: str | None = None, scoring: bool = False,
               columns: Collection[str] | None = None) -> Iterator[pa.Table]:
    """Stream a delimited file; numeric columns parsed to float64, others kept as strings.

    `encoding`: the text's where the format takes one (generic CSV; None: UTF-8, no option to
    name another), transcoded to UTF-8 by the reader; an undecodable value then points at it
    (`encoding_hint`; `scoring`: rows a package scores, read with its spec's options).
    `columns`: the only columns the caller reads (None: all; `_included`): the others are
    neither converted nor checked (one row of 100,000 columns took 1.5 GB, and a value that is
    not UTF-8 in a column nobody reads made its row malformed).
    """
    hint = None if encoding is None else encoding_hint(path, encoding, scoring)
    skipped: list[int] = []  # physical line numbers of rows pyarrow rejected
    failures: list[DataError] = []  # raised after the reader returns (not through pyarrow)

    def on_invalid(row: Any) -> str:
        line = row.number if row.number is not None else -1
        skipped.append(line)
        text = (row.text or "").rstrip("\r\n")
        if "\n" in text:  # a quote not closed took the lines after it into one row: skipping it would drop them
            at = line if log.file_line is None else log.file_line(line)
            failures.append(DataError(
                f"malformed row at {log.path or path}:{at}: a quoted value runs over {text.count(chr(10)) + 1} lines "
                f"to a row of {row.actual_columns} fields, expected {row.expected_columns} (a quote not closed?): "
                f"{text[:80]!r}; fix the quote (--on-error skip would drop those lines as one row)"))
            return "skip"
        reason = f"wrong field count ({row.actual_columns}, expected {row.expected_columns})"
        other = next((sep for sep in (",", ";", "\t", "|") if sep != delimiter and sep in text), None)
        whole = row.actual_columns == 1 and (row.expected_columns or 0) > 1 and other is not None
        if whole:  # a file of another format (a CSV given as criteo): skipping would drop every row
            reason += (f"; the row holds {other!r}, not this format's separator {delimiter!r}: a file of another "
                       "format (csv, avazu) or separator (data.options.sep)?")
        try:
            log.add(line, reason, row.text or "", skippable=not whole)
        except DataError as exc:
            failures.append(exc.with_traceback(None))  # its frames would keep this handler, so the reader, alive
        return "skip"

    lines_of_bytes = "\n".encode(encoding or "utf-8") == b"\n"  # lines of its bytes are the text's (not UTF-16)
    header_lines = 0 if names is None or not skip_header else 1
    if header_lines and lines_of_bytes:  # skip_rows counts blank lines: skip those before the header too
        try:
            header_lines = max(1, _first_row(path)[0])
        except (OSError, pa.ArrowInvalid):
            pass  # the reader names the file
    quote = None if delimiter == "\t" else '"'
    # pyarrow numbers the rows it skips, then the rows (not blank lines, not lines of a quoted value)
    log.file_line = BlankLines(path, header_lines, None if quote is None else quote.encode(),
                               delimiter.encode(encoding or "utf-8") if lines_of_bytes else delimiter.encode(),
                               None if lines_of_bytes else encoding)
    read = pcsv.ReadOptions(block_size=chunk_bytes, use_threads=False, column_names=names,
                            skip_rows=header_lines, encoding=encoding or "utf8")
    header_lines = header_lines if names is not None else 1
    slot = open_slot()  # before it opens (`readers_opened` from here on); the exit hook drops it if left suspended
    try:
        with _undecodable_rows(path, failures):
            # the handler and its ParseOptions are Arrow's only (csv_release): no local keeps them
            slot.reader = pcsv.open_csv(
                _csv_source(path), read_options=read,
                parse_options=pcsv.ParseOptions(delimiter=delimiter, invalid_row_handler=tracked(on_invalid),
                                                quote_char=quote if quote is not None else False,
                                                # a quoted value may span lines: across a block's end too
                                                newlines_in_values=quote is not None),
                convert_options=_binary_columns(path, delimiter, names, encoding or "utf-8", columns))
    except UnicodeError as exc:  # the header's (beyond errors="replace": UTF-16 without its byte-order
        # mark) or the reader's transcoding of the first block
        raise not_in_encoding(path, encoding or "utf-8", exc, hint) from None
    except (OSError, pa.ArrowInvalid) as exc:
        if not failures and _blank(path):  # pyarrow's 'Empty CSV file (or block): cannot infer ...'
            raise DataError(f"{path} holds no rows (it is empty or blank)") from None
        raise (failures[0] if failures else DataError(f"cannot read {path}: {exc}")) from None
    try:
        yield from _read_batches(path, slot, failures, log, numeric, required, header_lines, skipped, hint,
                                 chunk_bytes if quote is not None else 0, chunk_bytes, encoding or "utf-8")
    finally:
        slot.reader = None  # released here; Arrow's IO threads may finish with it a little later


def _read_batches(path: Path, slot: ReaderSlot, failures: list[DataError], log: ErrorLog, numeric: set[str],
                  required: set[str], header_lines: int, skipped: list[int], hint: str | None,
                  quoted_bytes: int = 0, block_bytes: int = 0, encoding: str = "utf-8") -> Iterator[pa.Table]:
    """The checked chunks of the open streaming reader in `slot` (`csv_chunks`). `quoted_bytes`: the
    block size of a reader of quoted values (0: values are not quoted), the most a quoted value may
    hold; `block_bytes`: the reader's block size, the most one line may hold; `encoding`: the text's."""
    try:
        # columns of no name (`a,b,,`) are dropped, unused, one or many (`_named_columns`)
        _unique_columns(path, [name for name in slot.reader.schema.names if name])
    except UnicodeDecodeError:
        raise DataError(f"{path}: the header is not valid UTF-8 (binary data, or another format?"
                        f"{'' if hint is None else ' ' + hint.lstrip('; ')})") from None
    seen = 0
    while True:
        if slot.reader is None:
            raise DataError(f"{path}: the reader was closed at the interpreter's exit")
        try:
            with _undecodable_rows(path, failures):
                batch = slot.reader.read_next_batch()
        except StopIteration:
            if failures:  # the last rows were malformed (a file whose only row is): fail on them
                raise failures[0] from None
            return
        except UnicodeError as exc:  # the reader's transcoding (an encoding other than UTF-8) of a later block
            raise not_in_encoding(path, encoding, exc, hint) from None
        except pa.ArrowInvalid as exc:
            if not failures and quoted_bytes and isinstance(log.file_line, BlankLines):
                at = log.file_line.open_quote(seen + len(skipped) + header_lines + 1, quoted_bytes)
                if at is not None:  # pyarrow's words: a value 'straddles two block boundaries'
                    raise DataError(f"{path}:{at}: a quoted value opened on this line runs on past "
                                    f"{quoted_bytes:,} bytes (a quote not closed?): fix the quote") from None
            at = _long_line(path, block_bytes) if not failures and block_bytes else None
            if at is not None:  # pyarrow's words: 'straddles two block boundaries (try to increase block size?)'
                raise DataError(f"{path}:{at}: the line runs on past {block_bytes:,} bytes, the most one row may "
                                f"hold (binary data, or rows not ended by line breaks?)") from None
            raise (failures[0] if failures else DataError(f"{path}: unreadable input ({exc})")) from None
        if failures:
            raise failures[0]
        table = _named_columns(pa.Table.from_batches([batch]))
        lines = _line_numbers(seen, table.num_rows, header_lines, skipped)
        seen += table.num_rows
        yield _checked(table, lines, log, numeric, required, hint or "")


def _named_columns(table: pa.Table) -> pa.Table:
    """`table` without its columns of no name (a header ending `a,b,,`: trailing separators, as a
    spreadsheet writes them), which no spec can read: unused, as pandas reads them ('Unnamed: 2').

    >>> _named_columns(pa.table([[1], [2], [3]], names=["a", "", ""])).column_names
    ['a']
    """
    unnamed = [i for i, name in enumerate(table.column_names) if name == ""]
    return table.select([i for i in range(table.num_columns) if i not in unnamed]) if unnamed else table


def _why(exc: BaseException) -> str:
    """An exception's first line (its type's name when it has no message), for a one-line error."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _unique_columns(path: Path, names: list[str]) -> None:
    """DataError naming a column the input names twice (which of the two is meant is unknowable), or
    a column named `LINE_COLUMN` (the reader's own: its values would be replaced by line numbers).

    >>> _unique_columns(Path("a.csv"), ["user", "label", "user"])
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: a.csv: the header names column 'user' twice (columns 1 and 3): rename one
    >>> _unique_columns(Path("day.csv"), ["1000009418151094273", "0", "14102100", "1005", "0"])
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: day.csv: the header names column '0' twice (columns 2 and 5): its first line is read as the header, and it holds numbers: a file without its header line? (avazu reads a header first; csv without one: data.options header: false and names)
    """
    first: dict[str, int] = {}
    for i, name in enumerate(names):
        if not name:  # a column of no name is unused, one or many: a CSV header's (`_named_columns`), a Parquet file's
            continue
        if name in first:
            raise DataError(f"{path}: the header names column {name!r} twice (columns {first[name] + 1} and {i + 1}): "
                            + (_header_of_numbers if _is_number(name) else "rename one"))
        first[name] = i
    _refuse_line_column(path, names)


_header_of_numbers = ("its first line is read as the header, and it holds numbers: a file without its header "
                      "line? (avazu reads a header first; csv without one: data.options header: false and names)")


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _refuse_line_column(path: Path, names: list[str]) -> None:
    """DataError when the input has a column named `LINE_COLUMN`, the name the readers give the line
    of each row: the user's values would be silently replaced by line numbers.

    >>> _refuse_line_column(Path("a.csv"), ["user", "__line__"])
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: a.csv: column 2 is named '__line__', the name flowrec gives the line of each row: rename it
    """
    if LINE_COLUMN in names:
        raise DataError(f"{path}: column {list(names).index(LINE_COLUMN) + 1} is named {LINE_COLUMN!r}, the name "
                        "flowrec gives the line of each row: rename it")


@contextmanager
def _undecodable_rows(path: Path, failures: list[DataError]) -> Iterator[None]:
    """While pyarrow parses: a malformed row that is not UTF-8 becomes a DataError in `failures`.

    pyarrow decodes the text of a row with the wrong field count before calling the invalid-row
    handler; when that fails it prints a traceback as an "unraisable" exception and stops parsing.
    The hook is installed only around the (synchronous) parse calls and restored after.
    """
    previous = sys.unraisablehook

    def hook(info: Any) -> None:
        if isinstance(info.exc_value, UnicodeDecodeError):
            failures.append(DataError(f"{path}: a row with the wrong field count is not valid UTF-8 "
                                      "(binary data, or another format?)"))
        else:
            previous(info)

    sys.unraisablehook = hook
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _binary_columns(path: Path, delimiter: str, names: list[str] | None, encoding: str = "utf-8",
                    columns: Collection[str] | None = None) -> pcsv.ConvertOptions:
    """Read every column (those of `_included`) as binary (UTF-8 is checked per row later); empty = null."""
    if names is None:
        names = _header_names(path, delimiter, encoding)
    included = _included(names, columns)
    return pcsv.ConvertOptions(column_types={n: pa.binary() for n in (included or names)}, include_columns=included,
                               strings_can_be_null=True, quoted_strings_can_be_null=True)


def _included(names: list[str], columns: Collection[str] | None) -> list[str]:
    """The columns of the header `names` to read: those in `columns`, in the header's order; [] (every
    column) when `columns` is None, or the header lacks one of them, names a column twice or names
    `LINE_COLUMN`: the lines that say so name the file's columns, read as before.

    >>> _included(["a", "user", "", "b", "item"], {"item", "user"})
    ['user', 'item']
    >>> _included(["a", "user", "b"], {"item", "user"}), _included(["user", "a", "a"], {"user"})
    ([], [])
    """
    if columns is None:
        return []
    named = [name for name in names if name]
    wanted = set(columns)
    if len(set(named)) != len(named) or LINE_COLUMN in named or not wanted <= set(named):
        return []
    return [name for name in names if name in wanted]


def not_in_encoding(path: Path, encoding: str, exc: UnicodeError, hint: str | None) -> DataError:
    """The line for a file whose text does not decode as `encoding` (Python's codec raised `exc`
    in the reader's transcoding: it names neither file nor line, 'charmap' codec can't decode
    byte 0x81 in position 6542952'): the file, its first line that does not decode
    (`_undecodable_line`), the byte, and what to change (`hint`: the package's encoding for rows
    a package scores; else data.options.encoding). No row of it can be skipped: the reader
    decodes the whole stream, so --on-error skip stops too."""
    line = _undecodable_line(path, encoding)
    where = f"{path}:{line}" if line is not None else f"{path}"
    what = (f"byte {exc.object[exc.start:exc.end][:4]!r}: {exc.reason}" if isinstance(exc, UnicodeDecodeError)
            else str(exc))
    if hint is not None and hint.startswith("; the package reads"):
        fix = hint
    else:
        wide = next((w for w in ("utf-16", "utf-32") if encoding.replace("_", "-").startswith(w)), None)
        fix = ("; set data.options.encoding to the one the file is written in"
               + (f" ({wide}-le or {wide}-be: {wide.upper()} without a byte-order mark)" if wide else ""))
    return DataError(f"{where}: the text does not read as {encoding} ({what}){fix}")


def _undecodable_line(path: Path, encoding: str, limit: int = 1 << 30) -> int | None:
    """The 1-based line of `path` (decompressed) on which its text first fails to decode as
    `encoding`, read in pieces ending at a line-break byte through one incremental decoder (a
    sequence of several bytes split between pieces decodes whole); None when it all decodes, or
    past `limit` bytes, or the file cannot be read.

    >>> import tempfile
    >>> f = Path(tempfile.mkdtemp()) / "x.csv"
    >>> _ = f.write_bytes(b"a,b\\n1,2\\n\\x81,3\\n")
    >>> _undecodable_line(f, "cp1252"), _undecodable_line(f, "latin-1")
    (3, None)
    """
    import codecs

    decoder = codecs.getincrementaldecoder(encoding)()
    lines, read = 1, 0
    try:
        with _open_lines(path) as fh:
            for piece in capped_lines(fh, 1 << 20):
                read += len(piece)
                if read > limit:
                    return None
                try:
                    lines += decoder.decode(piece).count("\n")
                except UnicodeError:
                    return lines
            decoder.decode(b"", final=True)
    except UnicodeError:
        return lines
    except (OSError, pa.ArrowInvalid):
        return None
    return None


def _header_names(path: Path, delimiter: str, encoding: str = "utf-8") -> list[str]:
    """The column names of a delimited file's header as pyarrow's reader reads them: blank lines
    before it skipped, a UTF-8 byte order mark dropped, quoted names unquoted (the separator may be inside the quotes; tab-separated
    files are not quoted), the text decoded in `encoding` (UTF-16's two-byte newline included).
    A name read otherwise is not a key of `column_types`, and its column's type was inferred from
    its values: "007", "7" and "7.0" then encoded as one id.
    """
    import codecs
    import csv
    import io

    if codecs.lookup(encoding).name == "utf-8":
        encoding = "utf-8-sig"  # pyarrow skips a UTF-8 byte order mark; other codecs drop theirs
    with io.TextIOWrapper(_open_lines(path), encoding=encoding, errors="replace", newline="") as fh:
        head = ""
        for line in bounded_lines(fh, path):  # the first line that is not blank: pyarrow skips blank lines before the header too
            head = line.rstrip("\r\n")
            if head:
                break
    quoting = {"quoting": csv.QUOTE_NONE} if delimiter == "\t" else {}
    return next(csv.reader([head], delimiter=delimiter, **quoting), [])


def _open_lines(path: Path) -> Any:
    """A buffered binary file of `path`'s lines, decompressed by its extension as pyarrow's CSV
    reader decompresses it (.gz, .bz2, .zst, .lz4, ...): the CSV formats' header and libsvm's lines."""
    import io

    return io.BufferedReader(pa.input_stream(str(path), compression=compression_of(path)))


def _long_line(path: Path, limit: int) -> int | None:
    """The 1-based number of the first line of `path` (decompressed) longer than `limit` bytes, or
    None (none is, or the file cannot be read): no more than `limit` bytes of a line are held."""
    try:
        with _open_lines(path) as fh:
            number = 0
            while True:
                line = fh.readline(limit + 1)
                if not line:
                    return None
                number += 1
                if len(line) > limit:
                    return number
    except (OSError, pa.ArrowInvalid):
        return None


LINE_LIMIT = CHUNK_BYTES  # the longest line read whole: the CSV reader's block (a longer row straddles two)


def bounded_lines(fh: Any, path: Path, before: int = 0, limit: int = LINE_LIMIT) -> Iterator[Any]:
    """The lines of `fh` (bytes or text), each read at most `limit` long: a longer one (a file
    without line breaks, a decompression bomb: 1 GiB of one byte is 1 MiB gzipped) is a DataError
    naming its line (`before` lines were read before), never read whole into memory.

    >>> import io
    >>> list(bounded_lines(io.BytesIO(b"a\\nbb\\n"), Path("f.csv"), limit=3))
    [b'a\\n', b'bb\\n']
    >>> list(bounded_lines(io.BytesIO(b"a\\nbbbbbb"), Path("f.csv"), limit=3))
    Traceback (most recent call last):
    flowrec.data.layout.DataError: f.csv: line 2 is longer than 3 bytes (no line break in it: not a text file of rows?)
    """
    number = before
    while line := fh.readline(limit + 1):
        number += 1
        if len(line) > limit and line[-1:] not in (b"\n", "\n"):
            size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit} bytes"
            ended = b"\r" if isinstance(line, bytes) else "\r"  # lines ended by \r alone (classic Mac OS)
            why = "lines ended by \\r alone? write them with \\n" if ended in line else "not a text file of rows?"
            raise DataError(f"{path}: line {number} is longer than {size} (no line break in it: {why})")
        yield line


def capped_lines(fh: Any, limit: int = LINE_LIMIT) -> Iterator[Any]:
    """The lines of `fh` (bytes or text), each read at most `limit` + 1 long; a longer one (a row the
    CSV reader's block cannot hold, which it refuses) is the last, cut there: a row's line is looked
    up without reading a line of 2 GB whole (5 GB and 50 s before the error of a line too long).

    >>> import io
    >>> [len(line) for line in capped_lines(io.BytesIO(b"a\\n" + b"b" * 10 + b"\\nc\\n"), limit=4)]
    [2, 5]
    """
    while line := fh.readline(limit + 1):
        yield line
        if len(line) > limit and line[-1:] not in (b"\n", "\n"):
            return


COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2", ".zst": "zstd", ".lz4": "lz4", ".br": "brotli"}  # as pyarrow's


def compression_of(path: Path) -> str | None:
    """The codec a text input's extension names, in any case: pyarrow tells it from the lower-case
    extension only, so `DAY_0.TSV.GZ` was read as text (its bytes 'not valid UTF-8').

    >>> compression_of(Path("DAY_0.TSV.GZ")), compression_of(Path("day_0.tsv.zst")), compression_of(Path("a.csv"))
    ('gzip', 'zstd', None)
    """
    return COMPRESSIONS.get(Path(path).suffix.lower())


def encoding_hint(path: Path, encoding: str, scoring: bool = False) -> str:
    """What a value that is not text in `encoding` is told: the option to set (convert, train), or,
    for rows a package scores (`flowrec predict`, which reads with the package's spec and takes no
    option), to write the file in the package's encoding; a file opening with a UTF-16 byte-order
    mark is named as UTF-16 (latin-1, the usual suggestion, reads it as garbage).

    >>> encoding_hint(Path("x.csv"), "utf-8")
    '; another encoding? set data.options.encoding (e.g. latin-1)'
    >>> encoding_hint(Path("x.csv"), "utf-8", scoring=True)
    '; the package reads utf-8 text: write the file in it (e.g. iconv -f latin1 -t utf-8 x.csv)'
    """
    bom = None
    try:  # a regular file only: a named pipe's bytes read here would be lost to the reader
        if not Path(path).is_file():
            raise OSError
        with _open_lines(path) as fh:
            head = fh.read(2)
        bom = "utf-16" if head in (b"\xff\xfe", b"\xfe\xff") and not encoding.startswith("utf-16") else None
    except (OSError, pa.ArrowInvalid, ValueError):
        pass
    if scoring:
        source = bom.replace("-", "") if bom else "latin1"
        return f"; the package reads {encoding} text: write the file in it (e.g. iconv -f {source} -t {encoding} {path.name})"
    if bom:
        return "; the file opens with a UTF-16 byte-order mark: set data.options.encoding: utf-16"
    return "; another encoding? set data.options.encoding (e.g. latin-1)" if encoding == "utf-8" else f" (read as {encoding})"


def _csv_source(path: Path) -> Any:
    """What `pcsv.open_csv` reads: the path (pyarrow decompresses by a lower-case extension), or a
    decompressing stream where the extension is in another case."""
    codec = compression_of(path)
    if codec is None or Path(path).suffix in COMPRESSIONS:
        return path
    return pa.input_stream(str(path), compression=codec)


def _blank(path: Path) -> bool:
    """Whether the text file `path` (decompressed) holds no line that is not blank (False where it
    cannot be read: the reader's own error says why)."""
    try:
        return _first_row(path)[1] is None
    except (OSError, pa.ArrowInvalid, DataError):
        return False


def _first_row(path: Path) -> tuple[int, bytes | None]:
    """The 1-based line and text (line break stripped) of the first line of a text file that is not
    blank, decompressed (`_open_lines`); (lines read, None) when every line is blank. Blank lines
    are skipped as pyarrow's CSV reader skips them (a file may start with one)."""
    with _open_lines(path) as fh:
        line = 0
        for raw in bounded_lines(fh, path):
            line += 1
            text = raw.rstrip(b"\r\n")
            if text:
                return line, text
        return line, None


class BlankLines:
    """The 1-based line of a text file (`_open_lines`: decompressed) on which its k-th row starts:
    pyarrow's CSV reader numbers rows, not lines. It skips blank lines without counting them, and a
    quoted value may span lines (`"a\\nb"`, with `quote` the quote character), so the row number of
    a row (or of one it rejects) names an earlier line after either. Read only for a row that is
    reported, and only as far as the rows asked for (the file is kept open where the last question
    left it).

    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as d:
    ...     p = Path(d) / "f.csv"
    ...     _ = p.write_bytes(b"a\\n\\n\\r\\nb\\nc\\n")
    ...     lines = BlankLines(p)
    ...     _ = (Path(d) / "q.csv").write_bytes(b'x,"1\\n\\n2"\\ny,3\\n')
    ...     [lines(1), lines(3), lines(2), lines(4)], BlankLines(Path(d) / "q.csv", quote=b'"')(2)
    ([1, 5, 4, 6], 4)
    """

    def __init__(self, path: Path, skip: int = 0, quote: bytes | None = None, delimiter: bytes = b",",
                 encoding: str | None = None) -> None:
        self.path = path
        self.encoding = encoding  # the text's, where its lines are not lines of its bytes (UTF-16): read as UTF-8
        self.skip = skip  # lines skipped by their count (`skip_rows`, blank or not): numbered as they are
        self.quote = quote  # the quote character (None: values are not quoted, a row is one line)
        self.delimiter = delimiter
        self.kept: list[int] = []  # the file's line each row starts on, in order, as far as read
        self.read = 0  # lines read so far
        self.in_quote = False  # the line read last ended inside a quoted value (its row goes on)
        self._lines: Iterator[tuple[int, bytes]] | None = None

    def __call__(self, k: int) -> int:
        if k <= self.skip:
            return k
        k -= self.skip
        if k > len(self.kept):
            self._read_to(k)
        if 1 <= k <= len(self.kept):
            return self.kept[k - 1]
        return k + (max(self.read, self.skip) - len(self.kept))  # past the last line: shifted by the blank lines

    def _read_to(self, k: int) -> None:
        if self._lines is None:
            self._lines = self._numbered()
        for number, line in self._lines:
            if self._row_starts(number, line) and len(self.kept) >= k:
                return

    def _row_starts(self, number: int, line: bytes) -> bool:
        """Take in line `number`: whether a row starts on it (then kept), the quote state carried on."""
        self.read = number
        if number <= self.skip:
            return False
        text = line.rstrip(b"\r\n")
        starts = not self.in_quote and bool(text)
        if self.quote is not None and self.quote in text:
            self.in_quote = _ends_quoted(text, self.in_quote, self.quote, self.delimiter)
        if starts:
            self.kept.append(number)
        return starts

    def open_quote(self, k: int, limit: int) -> int | None:
        """The line on which a quoted value opens, at or after the k-th row, that is still open `limit`
        bytes on (or at the end of the file), or None: looked at within a few `limit`s of that row."""
        if k - self.skip > 1:
            self._read_to(k - self.skip - 1)
        if self._lines is None:
            self._lines = self._numbered()
        opened, held, looked = None, 0, 0
        for number, line in self._lines:
            self._row_starts(number, line)
            looked += len(line)
            if self.in_quote:
                opened = number if opened is None else opened
                held += len(line)
                if held > limit:
                    return opened
            else:
                opened, held = None, 0
            if looked > 4 * limit and opened is None:
                return None
        return opened if self.in_quote else None

    def _numbered(self) -> Iterator[tuple[int, bytes]]:
        import io

        try:
            with _open_lines(self.path) as fh:
                if self.encoding is None:
                    yield from enumerate(capped_lines(fh), 1)
                else:  # lines of the decoded text (only "\n" ends one, as in bytes), as UTF-8 bytes
                    text = io.TextIOWrapper(fh, encoding=self.encoding, errors="replace", newline="\n")
                    yield from ((n, line.encode()) for n, line in enumerate(capped_lines(text), 1))
        except (OSError, pa.ArrowInvalid, UnicodeError):
            return


def _ends_quoted(text: bytes, in_quote: bool, quote: bytes, delimiter: bytes) -> bool:
    """Whether a line (`text`, without its line break) of delimited text ends inside a quoted value,
    read as pyarrow's CSV parser reads it: a quote opens a quoted value only at the start of a field
    (elsewhere it is a plain character), two quotes inside one are a quote, and one quote closes it.
    `in_quote`: the line starts inside a quoted value (the previous line ended in one).

    >>> _ends_quoted(b'1,"a', False, b'"', b","), _ends_quoted(b'b"",c', True, b'"', b","), _ends_quoted(b'x"y', False, b'"', b",")
    (True, True, False)
    """
    i, n = 0, len(text)
    field_start = not in_quote
    while i < n:
        if in_quote:
            j = text.find(quote, i)
            if j < 0:
                return True
            if text[j + 1:j + 2] == quote:  # an escaped quote
                i = j + 2
                continue
            in_quote, field_start, i = False, False, j + 1
        elif field_start and text[i:i + 1] == quote:
            in_quote, i = True, i + 1
        else:
            j = text.find(delimiter, i)
            if j < 0:
                return False
            field_start, i = True, j + 1
    return in_quote


def _line_numbers(seen: int, n: int, header: int, skipped: list[int]) -> np.ndarray:
    """Physical 1-based line of each accepted row of a chunk, given rejected lines so far."""
    k = np.arange(seen, seen + n) + header + 1  # line if nothing was skipped
    if not skipped:
        return k
    s = np.sort(np.asarray(skipped))
    shift = s - np.arange(len(s))  # the j-th skipped line pushes rows at or past it down one
    return k + np.searchsorted(shift, k, side="right")


def _checked(table: pa.Table, lines: np.ndarray, log: ErrorLog, numeric: set[str],
             required: set[str], hint: str = "") -> pa.Table:
    """Decode, parse numbers, and drop (or fail on) malformed rows."""
    bad = np.zeros(table.num_rows, bool)
    cols = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        text = _utf8(col, lines, bad, log, name, hint)
        if name in numeric:
            cols[name] = _numbers(text, lines, bad, log, name)
            if name in required:
                for i in np.flatnonzero(cols[name].is_null().to_numpy(zero_copy_only=False) & ~bad):
                    bad[i] = True
                    log.add(int(lines[i]), f"missing value in required column {name}")
        else:
            cols[name] = text
    cols[LINE_COLUMN] = pa.array(lines, pa.int64())
    out = pa.table(cols)
    return out.filter(pa.array(~bad)) if bad.any() else out


def _utf8(col: pa.Array, lines: np.ndarray, bad: np.ndarray, log: ErrorLog, name: str, hint: str = "") -> pa.Array:
    try:
        return col.cast(pa.string())
    except pa.ArrowInvalid:
        values = col.to_pylist()
        out = []
        for i, v in enumerate(values):
            try:
                out.append(None if v is None else v.decode("utf-8"))
            except UnicodeDecodeError:
                out.append(None)
                if not bad[i]:
                    bad[i] = True
                    log.add(int(lines[i]), f"invalid UTF-8 in column {name}{hint}", repr(v[:60]))
        return pa.array(out, pa.string())


def _numbers(text: pa.Array, lines: np.ndarray, bad: np.ndarray, log: ErrorLog, name: str) -> pa.Array:
    """Parse a numeric column; non-numeric, non-finite (inf) and values beyond float32 (which the
    encoded float32 columns cannot hold) make the row malformed."""
    numbers = _parse_numbers(text, lines, bad, log, name)
    _float32_rows(numbers.to_numpy(zero_copy_only=False), numbers.is_valid().to_numpy(zero_copy_only=False),
                  lambda i: text[i].as_py(), lines, bad, log, name)
    return numbers


def _float32_rows(values: np.ndarray, present: np.ndarray, shown: Callable[[int], Any], lines: np.ndarray,
                  bad: np.ndarray, log: ErrorLog, name: str) -> None:
    """Mark malformed the rows whose present value is non-finite or beyond float32 (what the encoded
    float32 columns cannot hold), logged with `shown(i)`, the value as the input wrote it."""
    with np.errstate(invalid="ignore"):
        wrong = present & ~(np.abs(values) <= FLOAT32_MAX)
    for i in np.flatnonzero(wrong & ~bad):
        bad[i] = True
        log.add(int(lines[i]), f"{_number_problem(values[i])} {shown(i)!r} in column {name}")


def _number_problem(value: float) -> str:
    return "value beyond float32" if np.isfinite(value) else "non-finite value"


TEXT_SHOWN = 4  # distinct text values a `TextColumn` error shows


class TextColumn(DataError):
    """A numeric column (a label, a dense feature) whose values are mostly text ('no', 'yes'): not
    malformed rows to skip (skipping them drops most rows), one line saying what the column must
    hold. `flowrec.data.convert` says it of a label column in the label's terms (`label_line`)."""

    def __init__(self, column: str, values: list[str], text: int, present: int) -> None:
        self.column, self.values, self.text, self.present = column, values, text, present
        super().__init__(f"column {column} holds text, not numbers ({', '.join(repr(v) for v in values)}"
                         f"{', ...' if len(values) >= TEXT_SHOWN else ''} in {text:,} of its {present:,} values "
                         "read so far): it is read as numbers (a dense feature or a label); write numbers "
                         "there, or read it as a categorical feature")


BOOL_NUMBERS = {"true": "1", "false": "0"}  # a bool column's text (pandas' True, Spark's true, R's TRUE), any case


def _parse_numbers(text: pa.Array, lines: np.ndarray, bad: np.ndarray, log: ErrorLog, name: str) -> pa.Array:
    """A numeric column's text as float64 (missing: null); True and False (any case: pandas writes a
    bool column's values so) are 1 and 0, as a Parquet file's or a DataFrame's bools are: a label
    column pandas wrote from bools was every row malformed, with a hint to skip them all."""
    try:
        return pc.cast(text, pa.float64())
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
        raw = text.to_pandas()
        words = raw.str.strip().str.lower()
        raw = raw.where(~words.isin(list(BOOL_NUMBERS)), words.map(BOOL_NUMBERS))
        raw = raw.mask(words == "")  # spaces only: missing, as an empty field is (not 'non-numeric value ' '')
        parsed = pd.to_numeric(raw, errors="coerce")
        wrong = (raw.notna() & parsed.isna()).to_numpy()
        headers = (words == name.strip().lower()).to_numpy()  # a header line where the format reads none
        if (wrong & ~headers).sum() * 2 > raw.notna().sum():  # most values text: skipping them would drop most rows
            raise TextColumn(name, sorted(set(raw[wrong & ~headers].str.strip()))[:TEXT_SHOWN],
                             int((wrong & ~headers).sum()), int(raw.notna().sum()))
        for i in np.flatnonzero(wrong & ~bad):
            bad[i] = True
            header = str(raw.iloc[i]).strip() == name  # a header line where the format reads none (or repeated)
            log.add(int(lines[i]), f"non-numeric value {raw.iloc[i]!r} in column {name}"
                    + (": a header line where rows are expected (criteo files have none, or files joined "
                       "with their headers)" if header else ""))
        return pa.array(parsed.to_numpy(dtype=np.float64), pa.float64(), from_pandas=True)


def read_libsvm(path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
                scoring: Scoring | None = None) -> Iterator[pa.Table]:
    """libsvm / libfm text: ``label idx:val ...`` or ``label field:idx:val ...``.

    Options: fields (list of column names, by token position or by libfm field number),
    feature_map (file of ``idx name`` lines: the column of each libsvm index). A categorical
    column receives the index, a numeric one (a dense feature) the value. With `scoring` columns
    that the options all name, only those columns are made, and the other tokens' values are
    neither parsed nor checked (a token's form, its field's position and its index in the map are).
    """
    _refuse_folder(path, "libsvm")
    fields = options.get("fields", ())
    if isinstance(fields, str) or not isinstance(fields, (list, tuple)) or not all(isinstance(f, str) for f in fields):
        raise DataError(f"data.options.fields must be a list of column names, not {str(fields)[:60]!r}")
    fields = list(fields)
    fmap = feature_map_of(options)
    if not fields and fmap is None:
        raise DataError("libsvm needs data.options.fields (columns by position) or feature_map")
    names = list(dict.fromkeys(fields + (sorted(set(fmap.values())) if fmap else [])))
    if LINE_COLUMN in names:  # as `_refuse_line_column` for a header
        raise DataError(f"{path}: data.options names a column {LINE_COLUMN!r}, the name flowrec gives the line "
                        "of each row: rename it")
    read = None
    if scoring is not None and scoring.columns is not None and scoring.columns <= set(names) | {"label"}:
        read = set(scoring.columns)  # else every column, so the line about missing columns names them as before
        names = [n for n in names if n in read]
    try:
        fh = _open_lines(path)
    except (OSError, pa.ArrowInvalid) as exc:
        raise DataError(f"cannot read {path}: {getattr(exc, 'strerror', None) or _why(exc)}") from None
    with fh:
        yield from _libsvm_chunks(fh, path, fields, fmap, names, numeric, log, read)


def _libsvm_chunks(fh: Any, path: Path, fields: list[str], fmap: dict[str, str] | None, names: list[str],
                   numeric: set[str], log: ErrorLog, read: set[str] | None = None) -> Iterator[pa.Table]:
    """`read_libsvm`'s chunks of the open file `fh` (`read`: the only columns whose values are read;
    None: every column). A file that cannot be read on (a truncated .gz: 'Truncated compressed
    stream', which named no file) is one line naming it."""
    lines_read = _ReadsNaming(fh, path)
    known = set(fields) | set(fmap.values() if fmap is not None else ())
    lineno = 0
    while True:
        rows: dict[str, list] = {"label": [], **{n: [] for n in names}}
        lines: list[int] = []
        for raw in bounded_lines(lines_read, path, lineno):
            lineno += 1
            if lineno == 1 and raw.startswith(b"\xef\xbb\xbf"):  # a UTF-8 byte order mark, as the CSV
                raw = raw[3:]  # formats skip it (it was a malformed first row: '\ufeff1')
            parsed = _libsvm_line(raw, lineno, fields, fmap, numeric, log, read, known)
            if parsed is not None:
                for n in rows:
                    rows[n].append(parsed.get(n))
                lines.append(lineno)
            if len(rows["label"]) >= LIBSVM_CHUNK_LINES:
                break
        if not rows["label"]:
            return
        table = {n: pa.array(v, pa.float64() if n in numeric or n == "label" else pa.string())
                 for n, v in rows.items()}
        yield pa.table({**table, LINE_COLUMN: pa.array(lines, pa.int64())})


class _ReadsNaming:
    """A binary file's `readline` whose failure (OSError, ArrowInvalid) is a DataError naming `path`."""

    def __init__(self, fh: Any, path: Path) -> None:
        self.fh, self.path = fh, path

    def readline(self, limit: int = -1) -> bytes:
        try:
            return self.fh.readline(limit)
        except (OSError, pa.ArrowInvalid) as exc:
            raise DataError(f"cannot read {self.path}: {getattr(exc, 'strerror', None) or _why(exc)}") from None


def _libsvm_line(raw: bytes, lineno: int, fields: list[str], fmap: dict[str, str] | None,
                 numeric: set[str], log: ErrorLog, read: set[str] | None = None,
                 known: set[str] = frozenset()) -> dict[str, Any] | None:
    """A line's row, or None (nothing, a comment, or a malformed row `log` took); `known`: every
    column the options name (a libfm field is one of them)."""
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        log.add(lineno, "invalid UTF-8", repr(raw[:60]))
        return None
    text = text.split("#", 1)[0].strip()  # svmlight's comments (a line of its own, or after a row's tokens)
    if not text:
        return None
    if "\r" in text:  # rows split at whitespace read the next rows' labels as tokens ("token '1' is not idx:val")
        log.add(lineno, "lines ended by a carriage return alone (\\r, as classic Mac OS wrote them): write the file "
                        "with \\n line breaks (tr '\\r' '\\n')", text, skippable=False)
        return None
    tokens = text.split()
    try:
        out: dict[str, Any] = {"label": _libsvm_label(tokens[0])}
        indices: set[tuple[str, str]] = set()  # (column, index) of the row's tokens: each once
        dense: dict[str, str] = {}  # dense column -> the index that gave its value
        # svmlight's query id (`1 qid:3 1:0.5`) is no feature: it took the first field's place by position
        for pos, tok in enumerate(t for t in tokens[1:] if not (t.startswith("qid:") and _query_id(t))):
            name, idx, val = token_column(tok, pos, fields, fmap, known)
            if (name, idx) in indices:  # `3:1 3:1` was the id '3^3', `4:0.1 4:0.9` the value 0.9, without a word
                raise ValueError(f"index {idx} of column {name} twice in the row (an index is given once a row)")
            indices.add((name, idx))
            if read is not None and name not in read:
                continue
            if name in numeric:
                if name in dense:  # two indices of one dense column: which value is meant is unknowable
                    raise ValueError(f"indices {dense[name]} and {idx} both give the dense column {name} (one value "
                                     "a row)")
                dense[name] = idx
                out[name] = _dense_value(tok, val, name)
                if abs(out[name]) > FLOAT32_MAX:  # nan is a missing value, as in text formats
                    raise ValueError(f"{_number_problem(out[name])} {val!r} in column {name}")
            else:
                if not is_number(val):  # `5:` or `5:x` gave the id 5, its value unread
                    raise ValueError(f"token {tok!r} has the value {val!r}, not a number ({TOKEN_FORM})")
                out[name] = f"{out[name]}^{idx}" if name in out else idx
        return out
    except ValueError as exc:
        log.add(lineno, str(exc), text)
        return None


def _dense_value(tok: str, val: str, name: str) -> float:
    """The value `val` of the token `tok` for the dense column `name` (nan a missing value, inf its
    own malformed row): ValueError naming it where it is no number (Python's float read `1_000`)."""
    try:
        if "_" in val:
            raise ValueError
        return float(val)
    except ValueError:
        raise ValueError(f"token {tok!r} has the value {val!r}, not a number, for the dense column {name}") from None


def _libsvm_label(text: str) -> float:
    """A row's label, its first token: a number of float32's range (ValueError naming it else)."""
    try:
        label = float(text)
    except ValueError:  # Python's "could not convert string to float" named neither the label nor the form
        raise ValueError(f"label {text!r} is not a number (a libsvm row is: label index:value ...)") from None
    if abs(label) > FLOAT32_MAX:
        raise ValueError(f"{_number_problem(label)} {text!r} in column label")
    return label


def _query_id(token: str) -> bool:
    """True for svmlight's query id, ``qid:`` and a whole number (ValueError for another value)."""
    if not (token[4:].isascii() and token[4:].isdigit()):
        raise ValueError(f"token {token!r} is a query id that is no whole number >= 0 (svmlight's qid:3)")
    return True


FILE_OPTIONS = ("feature_map",)  # data.options naming a file


def spec_file_options(spec: Any, spec_dir: Path) -> dict[str, str]:
    """The spec's data.options that name a file (libsvm's feature_map), a relative one read from the
    spec's folder as data.path is (it was read from the working folder: `flowrec data convert
    libsvm x.libsvm out --spec /x/s.yaml` from elsewhere could not find /x's map); one found only
    in the working folder is left as given.

    >>> from types import SimpleNamespace as S
    >>> spec_file_options(S(data=S(options=(("feature_map", "fmap.txt"), ("sep", " ")))), Path("specs"))
    {}
    """
    options = dict(spec.data.options) if getattr(spec, "data", None) is not None else {}
    out = {}
    for key in FILE_OPTIONS:
        value = options.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute() and (spec_dir / value).is_file():
            out[key] = str(spec_dir / value)
    return out


def feature_map_of(options: dict[str, Any]) -> dict[str, str] | None:
    """libsvm's feature map of data.options: None without one; the map read from its file
    (`feature_map` a path), or as given (a map already read: the one an encoder records, which
    `flowrec predict` scores a package's rows with, wherever it runs).

    >>> feature_map_of({"feature_map": {"1": "user"}})
    {'1': 'user'}
    """
    value = options.get("feature_map")
    if not value:
        return None
    if isinstance(value, dict):
        return {str(k): str(v) for k, v in value.items()}
    return _feature_map(Path(value))


def _feature_map(path: Path) -> dict[str, str]:
    """The libsvm feature map: one ``index name`` line per index (blank lines skipped); a line of one
    token, text that is not UTF-8, or an index given two columns (the last line's was taken, without
    a word) is one line naming the file (it was a dict() or codec message)."""
    try:
        lines = path.read_text(encoding="utf-8").split("\n")
    except OSError as exc:
        raise DataError(f"cannot read feature map {path}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise DataError(f"feature map {path} is not UTF-8 text of 'index name' lines") from None
    out: dict[str, str] = {}
    first: dict[str, int] = {}  # index -> the line that named its column
    for number, line in enumerate(lines, 1):
        tokens = line.split()
        if len(tokens) == 1:
            raise DataError(f"feature map {path}:{number}: {line.strip()[:40]!r} is not an 'index name' line")
        if tokens and out.get(tokens[0], tokens[1]) != tokens[1]:
            raise DataError(f"feature map {path}:{number}: index {tokens[0][:40]!r} is given the column "
                            f"{tokens[1][:40]!r}, and the column {out[tokens[0]][:40]!r} on line {first[tokens[0]]} "
                            "(an index is one column)")
        if tokens:
            out[tokens[0]] = tokens[1]
            first.setdefault(tokens[0], number)
    return out


def read_movielens(path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
                   scoring: Scoring | None = None) -> Iterator[pa.Table]:
    """A MovieLens folder as GroupLens ships it, its release told by its files.

    - 100K: u.data, u.user, u.item (latin-1), u.genre;
    - 1M: ratings.dat, users.dat, movies.dat (``::``-separated, latin-1);
    - 10M: ratings.dat, movies.dat (no users: age, gender, occupation and zip_code missing);
    - 20M, 25M, 32M and ml-latest: ratings.csv, movies.csv (UTF-8, ratings in half stars; no users).

    Columns: user_id, item_id, rating, timestamp, age, gender, occupation, zip_code, genres
    (list of genre names), release_year, label (rating >= 4), rating_5 (rating == 5). Occupation
    is a name in 100K and a code in 1M; a release year comes from the date in 100K and from the
    title's "(1995)" in the others. Rows keep the ratings file's order. With
    ``options["sequence"] = {max_len: L}`` the rows are next-item examples with a ``history`` column
    (`flowrec.data.sequences`).

    Raises:
        DataError: a folder of none of these releases, an unreadable ratings line, or a rating off
            its release's scale (`flowrec.data.stars`: whole stars 1-5 in 100K and 1M, half stars
            0.5-5 after).
    """
    del log, scoring  # read whole: a folder of its own files, scored by no package column list
    max_len = sequence_length(options)
    ratings, users, items = _movielens_tables(path)
    df = ratings.merge(users, on="user_id", how="left").merge(items, on="item_id", how="left")
    df["label"] = (df["rating"] >= 4).astype(np.float64)
    df["rating_5"] = (df["rating"] == 5).astype(np.float64)
    cols = ["user_id", "item_id", "rating", "timestamp", "age", "gender", "occupation", "zip_code",
            "genres", "release_year", "label", "rating_5"]
    df[LINE_COLUMN] = np.arange(1, len(df) + 1)  # ratings line of each rating (left merges keep the order)
    if max_len is not None:
        df = next_item_rows(df, max_len)
        cols += [HISTORY_COLUMN, TEST_COLUMN]
    lines = df[LINE_COLUMN].to_numpy()
    df = df[cols]
    table = pa.Table.from_pandas(df, preserve_index=False)
    numeric = set(numeric) | {"rating", "label", "rating_5"}
    out = {c: (pc.cast(table[c], pa.float64()) if c in numeric else table[c]) for c in cols}
    for c in ("gender", "zip_code"):  # releases without users: all missing, still text columns
        if out[c].type == pa.null():
            out[c] = pc.cast(out[c], pa.large_string())
    yield pa.table({**out, LINE_COLUMN: pa.array(lines, pa.int64())})


ML_USER_COLUMNS = ["user_id", "age", "gender", "occupation", "zip_code"]
ML_RATING_COLUMNS = ["user_id", "item_id", "rating", "timestamp"]
ML_RELEASES = {  # release -> the files that tell it
    "100K": ("u.data", "u.user", "u.item", "u.genre"),
    "1M": ("ratings.dat", "users.dat", "movies.dat"),
    "10M": ("ratings.dat", "movies.dat"),
    "20M+": ("ratings.csv", "movies.csv"),
}


def movielens_release(path: Path) -> str:
    """Which MovieLens release a folder holds ("100K", "1M", "10M" or "20M+"), by its files.

    Raises:
        DataError: none of them is complete there (the files each release needs are named).
    """
    for release, names in ML_RELEASES.items():
        if all((path / n).is_file() for n in names):
            return release
    wanted = "; ".join(f"{r}: {', '.join(n)}" for r, n in ML_RELEASES.items())
    # the release most of whose files are there: a name of it that is no file (a folder, a pipe, a
    # broken link) or missing was 'not a MovieLens folder: it lacks the files of every release'
    release, names = max(ML_RELEASES.items(), key=lambda item: (sum(os.path.lexists(path / n) for n in item[1]),
                                                                 -len(item[1])))
    for name in names:
        if os.path.lexists(path / name) and not (path / name).is_file():
            raise DataError(f"{path / name} is {_not_a_file(path / name)}, not a file: the MovieLens {release} "
                            f"release's {name} is a file of its rows ({release}: {', '.join(names)})")
    missing = [name for name in names if not os.path.lexists(path / name)]
    lacks = (f"{', '.join(missing)} of the {release} release (the files of every release: {wanted})"
             if len(missing) < len(names) else f"the files of every release ({wanted})")
    raise DataError(f"{path} is not a MovieLens folder: it lacks {lacks}")


def _not_a_file(path: Path) -> str:
    """What stands at `path`, which is no regular file (os.lstat's kind, a link followed).

    >>> _not_a_file(Path("/"))
    'a folder'
    """
    import stat

    if path.is_symlink() and not path.exists():
        return "a broken link"
    mode = path.stat().st_mode
    return ("a folder" if stat.S_ISDIR(mode) else "a pipe (FIFO)" if stat.S_ISFIFO(mode)
            else "a socket" if stat.S_ISSOCK(mode) else "a device")


def _movielens_tables(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(ratings, users, items) of a MovieLens folder, in the columns `read_movielens` joins."""
    release = movielens_release(path)
    if release == "100K":
        return _movielens_100k(path)
    no_users = pd.DataFrame({"user_id": pd.Series(dtype=np.int64), "age": pd.Series(dtype="Int64"),
                             "gender": pd.Series(dtype=object), "occupation": pd.Series(dtype="Int64"),
                             "zip_code": pd.Series(dtype=object)})
    if release == "20M+":
        raw = _read_lines(path / "ratings.csv", "userId,movieId,rating,timestamp", dtype=str, keep_default_na=False)
        wanted = ["userId", "movieId", "rating", "timestamp"]
        if not set(wanted) <= set(raw.columns):
            raise DataError(f"{path / 'ratings.csv'}: the header names {list(raw.columns)[:8]}, not {wanted}")
        ratings = _checked_ratings(raw[wanted], path / "ratings.csv", "userId,movieId,rating,timestamp", 2, ",",
                                   release)
        movies = _read_lines(path / "movies.csv", "movieId,title,genres", dtype=str, keep_default_na=False)
        ids = _whole_numbers(movies[["movieId"]], path / "movies.csv", "movieId,title,genres", 2, ",")["movieId"]
        _one_line_each(ids, path / "movies.csv", 2, ",", "movie")
        items = _titled_items(ids.astype(np.int64), movies["title"], movies["genres"])
        return ratings, no_users, items
    ratings = _double_colon_ratings(path / "ratings.dat", release)
    movies = _double_colon_lines(path / "movies.dat", 3)
    _one_line_each(movies[0].astype(np.int64), path / "movies.dat", 1, ":", "movie")
    items = _titled_items(movies[0].astype(np.int64), movies[1], movies[2])
    if release == "10M":
        return ratings, no_users, items
    users = _double_colon_lines(path / "users.dat", 5)
    _one_line_each(users[0].astype(np.int64), path / "users.dat", 1, ":", "user")
    users = pd.DataFrame({"user_id": users[0].astype(np.int64), "age": _codes(users[2]), "gender": users[1],
                          "occupation": _codes(users[3]), "zip_code": users[4]})
    return ratings, users, items


def _movielens_100k(path: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    """(ratings, users, items) of a 100K folder; a line of u.data, u.user or u.item that is not of
    its file's layout is one line naming the file and line (pandas read it as NaN: a rating
    "nan" or a missing field became label 0; a short u.item line was a KeyError traceback)."""
    ratings = _checked_ratings(_read_lines(path / "u.data", "user<TAB>item<TAB>rating<TAB>timestamp", sep="\t",
                                           header=None, names=ML_RATING_COLUMNS, dtype=str, keep_default_na=False),
                               path / "u.data",
                               "user<TAB>item<TAB>rating<TAB>timestamp", 1, "\t", "100K")
    user_layout = "user|age|gender|occupation|zip"
    users = _read_lines(path / "u.user", user_layout, sep="|", header=None, names=ML_USER_COLUMNS,
                        dtype={"age": str, "zip_code": str})
    _one_line_each(_whole_numbers(users[["user_id"]], path / "u.user", user_layout, 1, "|")["user_id"], path / "u.user",
                   1, "|", "user")
    users["age"] = _codes(users["age"])
    genre_names = [line.split("|")[0] for line in (path / "u.genre").read_text("latin-1").splitlines() if line]
    item_layout = f"item|title|date|video date|url|{ML_GENRES_COUNT} genre flags"
    items = _read_lines(path / "u.item", item_layout, sep="|", header=None, encoding="latin-1")
    if items.shape[1] != 5 + ML_GENRES_COUNT:
        raise DataError(f"{path / 'u.item'}: {items.shape[1]} '|'-separated fields, expected {5 + ML_GENRES_COUNT} "
                        f"({item_layout})")
    _one_line_each(_whole_numbers(items[[0]].set_axis(["item"], axis=1), path / "u.item", item_layout, 1, "|")["item"],
                   path / "u.item", 1, "|", "movie")
    flags = items.iloc[:, -ML_GENRES_COUNT:].to_numpy(bool)
    items = pd.DataFrame({
        "item_id": items[0],
        "release_year": pd.to_datetime(items[2], format="%d-%b-%Y", errors="coerce").dt.year.astype("Int64"),
        "genres": [[g for g, on in zip(genre_names, row) if on] for row in flags],
    })
    return ratings, users, items


def _one_line_each(ids: pd.Series, path: Path, first_line: int, sep: str, what: str) -> None:
    """Raise DataError naming the line where an id of `ids` (a users or movies file's, row by row;
    `first_line`, `sep` as `_file_line`'s) is given again: joined to the ratings, each of its lines
    repeated every rating of that user or movie (the rows doubled, their line numbers shifted)."""
    again = np.flatnonzero(ids.duplicated().to_numpy())
    if len(again):
        row = int(again[0])
        first = int(np.flatnonzero((ids == ids.iat[row]).to_numpy())[0])
        raise DataError(f"{path}:{_file_line(path, row, first_line, sep)}: {what} {ids.iat[row]:.0f} again (its line "
                        f"{_file_line(path, first, first_line, sep)} gives it first): a {what} is one line, or its "
                        "ratings would be read once for each")


def _codes(values: pd.Series) -> pd.Series:
    """Integer codes as integers (age, 1M's occupation), anything else (text, a fraction, a number
    beyond 64 bits: casting them was a traceback) kept as text."""
    numbers = pd.to_numeric(values, errors="coerce")
    x = numbers.astype(np.float64)
    whole = bool((numbers.notna() & (x == np.floor(x)) & (x.abs() < INT64_BOUND)).all())
    return numbers.astype("Int64") if whole else values


def _double_colon_ratings(path: Path, release: str) -> pd.DataFrame:
    """ratings.dat (``user::item::rating::timestamp``) by the C parser: ':' splits each ``::`` into
    an empty field between two values."""
    raw = _read_lines(path, "user::item::rating::timestamp", sep=":", header=None, usecols=[0, 2, 4, 6], dtype=str,
                      encoding="latin-1", keep_default_na=False)  # a rating 'nan' is text, named as off the scale
    return _checked_ratings(raw, path, "user::item::rating::timestamp", 1, ":", release)


def _read_lines(path: Path, layout: str, **options: Any) -> pd.DataFrame:
    """`pd.read_csv(path, **options)`; a file pandas cannot split is one line naming it and `layout`."""
    try:
        return pd.read_csv(path, **options)
    except (ValueError, pd.errors.ParserError) as exc:  # UnicodeDecodeError is a ValueError
        raise DataError(f"{path}: not {layout} lines ({_why(exc)})") from None


def _file_line(path: Path, row: int, first_line: int, sep: str) -> int:
    """The 1-based line of `path` that pandas read as data row `row` (0-based), `first_line` the
    line of row 0 when no line is blank (2 under a header). pandas skips blank lines, spaces and
    tabs only (a tab-only line is a row where tab separates), so with one before it the row's
    position alone named an earlier line. Read only to name a bad row."""
    blank = b" \r\n" if sep == "\t" else b" \t\r\n"
    target = row + first_line - 1  # non-blank lines before the row's
    seen = 0
    with open(path, "rb") as fh:
        for number, line in enumerate(fh, 1):
            if line.strip(blank):
                if seen == target:
                    return number
                seen += 1
    return row + first_line  # not found (quoted fields over lines): the position


def _whole_numbers(raw: pd.DataFrame, path: Path, layout: str, first_line: int, sep: str) -> pd.DataFrame:
    """The columns of `raw` as float64: DataError naming the first line (`first_line` is the line of
    row 0 without blank lines; `sep` the file's separator) where one is missing or not a whole number."""
    values = raw.apply(pd.to_numeric, errors="coerce").astype(np.float64)
    bad = (values.isna() | (values != np.floor(values))).any(axis=1).to_numpy().nonzero()[0]
    if len(bad):
        raise DataError(f"{path}:{_file_line(path, int(bad[0]), first_line, sep)}: not {layout}")
    _check_int64(values, raw, path, first_line, [str(c) for c in raw.columns], sep)
    return values


def _check_int64(values: pd.DataFrame, raw: pd.DataFrame, path: Path, first_line: int, names: list[str],
                 sep: str) -> None:
    """Raise DataError naming the first line, column and value where a whole number (`values`, of
    the text `raw`) is beyond 64 bits: cast to int64 it was INT64_MIN without a word (every such
    id one), or an OverflowError traceback."""
    big = (values.abs() >= INT64_BOUND).to_numpy()
    rows = np.flatnonzero(big.any(axis=1))
    if len(rows):
        row = rows[0]
        col = int(np.flatnonzero(big[row])[0])
        raise DataError(f"{path}:{_file_line(path, int(row), first_line, sep)}: {names[col]} {str(raw.iat[row, col]).strip()[:40]!r} is beyond "
                        "64 bits (MovieLens ids and timestamps are 64-bit integers)")


def _checked_ratings(raw: pd.DataFrame, path: Path, layout: str, first_line: int, sep: str,
                     release: str) -> pd.DataFrame:
    """Ratings from the text columns user, item, rating, timestamp (in that order): a line with a
    field missing or not a number (ids and time whole numbers), or a rating off `release`'s scale
    (`flowrec.data.stars`), is DataError naming it (`first_line`: the line of row 0)."""
    if raw.shape[1] != 4:
        raise DataError(f"{path}: {raw.shape[1]} fields a line, expected 4 ({layout})")
    values = raw.set_axis(range(4), axis=1).apply(pd.to_numeric, errors="coerce").astype(np.float64)
    whole = values[[0, 1, 3]]
    rating = raw.iloc[:, 2].str.strip()  # a field missing (a short line) or empty: not the layout
    bad = (~np.isfinite(whole).all(axis=1) | (whole != np.floor(whole)).any(axis=1) | rating.isna() | (rating == "")).to_numpy()
    stars = off_scale(values[2].to_numpy(), release)  # 0, 6, 4.5 in 1M, nan, 'x'
    first = np.flatnonzero(bad | stars)
    if len(first):
        row = int(first[0])
        line = _file_line(path, row, first_line, sep)
        if bad[row]:
            raise DataError(f"{path}:{line}: not {layout}")
        raise DataError(f"{path}:{line}: rating {rating.iat[row][:40]!r} is off the MovieLens {release} "
                        f"release's scale ({scale_text(release)})")
    _check_int64(whole, raw.iloc[:, [0, 1, 3]], path, first_line, ["user", "item", "timestamp"], sep)
    return pd.DataFrame({"user_id": values[0].astype(np.int64), "item_id": values[1].astype(np.int64),
                         "rating": values[2], "timestamp": values[3].astype(np.int64)})


def _double_colon_lines(path: Path, fields: int) -> pd.DataFrame:
    """A small ``::``-separated file (users.dat, movies.dat: titles may hold ':'), field by field."""
    rows = []
    for number, line in enumerate(path.read_text("latin-1").splitlines(), 1):
        if not line.strip():
            continue
        parts = line.split("::")
        if len(parts) != fields or not (parts[0].strip().isascii() and parts[0].strip().isdigit()):
            raise DataError(f"{path}:{number}: {len(parts)} '::'-separated fields, expected {fields}")
        if int(parts[0]) >= INT64_BOUND:
            raise DataError(f"{path}:{number}: id {parts[0].strip()[:40]!r} is beyond 64 bits (MovieLens ids are "
                            "64-bit integers)")
        rows.append(parts)
    return pd.DataFrame(rows)


def _titled_items(ids: pd.Series, titles: pd.Series, genres: pd.Series) -> pd.DataFrame:
    """item_id, release_year (the title's trailing "(1995)") and genres ('|'-separated names; none
    for "(no genres listed)")."""
    year = titles.str.extract(r"\((\d{4})\)\s*$")[0]
    return pd.DataFrame({
        "item_id": ids.reset_index(drop=True),
        "release_year": pd.to_numeric(year, errors="coerce").astype("Int64").reset_index(drop=True),
        "genres": [[g for g in str(text).split("|") if g and g != "(no genres listed)"] for text in genres],
    })


PARQUET_BATCH_ROWS = 65536  # rows per chunk of a raw Parquet input


def read_parquet(path: Path, options: dict[str, Any], log: ErrorLog, numeric: set[str],
                 scoring: Scoring | None = None) -> Iterator[pa.Table]:
    """Raw rows in Parquet: one file, or a folder of them (a Hive-partitioned table: the
    partition columns join the rows), streamed in batches of PARQUET_BATCH_ROWS.

    Numeric columns (labels, dense features) become float64: numbers as they are, NaN as missing
    (as an empty CSV field), text parsed as CSV's is; an infinite value, one beyond float32 or text
    that is not a number makes the row malformed. Other columns keep their type (strings,
    integers, lists for multi-hot features). Every file of a folder holds the same columns, each
    of one type (`flowrec.data.parquet_folder`). `LINE_COLUMN` is the row's 1-based position in
    the input (a folder's files in path order). With `scoring` columns that the first file holds
    all, only those columns are read (pyarrow's `columns=`), and only their types checked.

    Raises:
        DataError: an unreadable file or folder, a file whose columns differ from the folder's
            first file's, or a numeric column of another type (lists, structs, dates).
    """
    del options
    _refuse_owned(path)
    _refuse_encoded(path)
    try:
        for file, names in file_columns(path):  # before the folder's schema is unified, which needs them unique
            _unique_columns(Path(file), names)
        files = parquet_files(path, numeric, None if scoring is None else scoring.columns)
        if files and LINE_COLUMN in files[0].schema.names:  # not its own column: _unique_columns refused that
            key = next(p for p in Path(files[0].path).parents if p.name.startswith(f"{LINE_COLUMN}="))
            raise DataError(f"{key}: a partition folder of key {LINE_COLUMN!r}, the name flowrec gives the line "
                            "of each row: rename the key")
        seen = 0
        for file in files:
            for batch in file.fragment.to_batches(schema=file.schema, columns=file.schema.names,
                                                  batch_size=PARQUET_BATCH_ROWS, use_threads=False):
                table = pa.Table.from_batches([batch], file.schema)
                lines = np.arange(seen + 1, seen + table.num_rows + 1, dtype=np.int64)
                seen += table.num_rows
                if table.num_rows:
                    yield _parquet_checked(table, lines, log, numeric, Path(file.path))
    except (OSError, pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise DataError(f"cannot read {path} as Parquet: {_why(exc)}") from None


def encoded_dataset_line(path: Path) -> str | None:
    """Why `path` cannot be read as raw rows when it is (or lies in, or holds) an encoded flowrec
    dataset, else None: its ids are already table rows and its dense values already transformed, so
    reading it as raw rows would encode them a second time (other hash buckets, log1p twice) and
    score or train on other rows without a word (Parquet readers skip ``_flowrec.json``, so nothing
    else would notice)."""
    path = Path(path)
    inner = [path / META_FILE, *path.glob(f"*/{META_FILE}")] if path.is_dir() else [path.parent / META_FILE]
    found = next((m for m in inner if m.is_file()), None)
    if found is None:
        return None
    if found.parent.parent == path and found.parent.name not in ("train", "test"):  # not a split's part: a folder
        # holding a dataset among other things was called 'an encoded flowrec dataset' itself
        return (f"{path} holds the encoded flowrec dataset {found.parent} ({found} exists), whose rows are no raw "
                f"rows: give a file of raw rows, or a folder of them alone; score {found.parent} with "
                "`flowrec eval RUN --data DIR`")
    return (f"{path} is an encoded flowrec dataset ({found} exists), not raw rows: encoding it again would read "
            "other ids; give the raw rows it was converted from, or score it with `flowrec eval RUN --data DIR`")


def _refuse_owned(path: Path) -> None:
    """Raise DataError when the folder `path`, given as raw Parquet rows, is a training run's, a
    model package's, an encoder's or a --follow stream's: pyarrow read their files as Parquet
    ("cannot read pkg/ml as Parquet: ... 'pkg/ml/encoder.json': Parquet magic bytes not found"), and
    a run on the spec's bound data was called an encoded dataset for its RUN/data."""
    from flowrec.data.owners import is_stream_folder, owner_of

    path = Path(path)
    if not path.is_dir():
        return
    owner = "a --follow stream" if is_stream_folder(path) else owner_of(path)
    if owner is not None and owner != "a dataset":  # a dataset: `_refuse_encoded` names it
        raise DataError(f"{path} is {owner}'s folder, not raw rows: give a Parquet file of raw rows, or a folder "
                        "of them")


def _refuse_encoded(path: Path) -> None:
    """Raise DataError when `path` is (or lies in, or holds) an encoded flowrec dataset
    (`encoded_dataset_line`)."""
    line = encoded_dataset_line(path)
    if line is not None:
        raise DataError(line)


def _refuse_folder(path: Path, fmt: str) -> None:
    """Raise DataError when a text format (one file) is given a folder: an encoded dataset (the
    split that `data convert` wrote, given to `predict` or `convert` again) is named as such, any
    other folder as not a file. Without this, pyarrow's own "Expected file path, but ... is a
    directory" was the message."""
    path = Path(path)
    if not path.is_dir():
        if path.exists() and not path.is_file():  # a pipe (/dev/stdin, <(zcat ...)) was pyarrow's 'lseek failed'
            raise DataError(f"{path} is not a regular file (a pipe or a device): flowrec reads a {fmt} input from "
                            f"its start more than once; write it to a file (.gz, .bz2, .zst are "
                            f"read as they are)")
        _refuse_unread_compression(path)
        _refuse_parquet(path, fmt)
        return
    _refuse_encoded(path)
    raise DataError(f"{path} is a folder, not a file: the {fmt} format reads one file (only parquet and "
                    "movielens read a folder)")


def _refuse_parquet(path: Path, fmt: str) -> None:
    """Raise DataError when a text format is given a Parquet file (it starts with ``PAR1``): its bytes
    were read as rows, 'wrong field count (1, expected 4): '%\\x02\\x18...''."""
    if compression_of(path) is not None or not path.is_file():
        return
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
    except OSError:
        return  # the reader names the file
    if magic == b"PAR1":
        _refuse_encoded(path)  # a part file of a dataset: the parquet format refuses it too
        raise DataError(f"{path} is a Parquet file, not {fmt} text: read it with the parquet format "
                        f"(`flowrec data convert parquet ...`, `flowrec predict ... --format parquet`)")


UNREAD_SUFFIXES = {  # what a text input's name may end with that pyarrow does not decompress
    ".tar.gz": "a tar archive", ".tgz": "a tar archive", ".tar.bz2": "a tar archive", ".tar.zst": "a tar archive",
    ".tar": "a tar archive", ".zip": "a zip archive", ".7z": "a 7z archive", ".rar": "a rar archive",
    ".xz": "xz-compressed", ".lzma": "lzma-compressed", ".z": "compress-compressed (.Z)",
}


def _refuse_unread_compression(path: Path) -> None:
    """DataError for a text input named as an archive or a compression pyarrow does not read: it was
    read as text, so its bytes gave 'not valid UTF-8' or 'line 1 has 9 tab-separated fields'.

    >>> _refuse_unread_compression(Path("day_0.tsv.zip"))
    Traceback (most recent call last):
    ...
    flowrec.data.layout.DataError: day_0.tsv.zip is a zip archive, which is not read: text inputs are read plain or compressed as .gz, .bz2, .zst or .lz4 (extract the file, or recompress it)
    >>> _refuse_unread_compression(Path("day_0.tsv.gz"))
    """
    name = path.name.lower()
    for suffix, kind in UNREAD_SUFFIXES.items():
        if name.endswith(suffix):
            raise DataError(f"{path} is {kind}, which is not read: text inputs are read plain or compressed as "
                            ".gz, .bz2, .zst or .lz4 (extract the file, or recompress it)")


def _parquet_checked(table: pa.Table, lines: np.ndarray, log: ErrorLog, numeric: set[str], path: Path) -> pa.Table:
    """Numeric columns to float64 (NaN missing; inf, beyond float32 or not a number: malformed)."""
    bad = np.zeros(table.num_rows, bool)
    cols = {}
    for name in table.column_names:
        col = table.column(name).combine_chunks()
        if name not in numeric:
            cols[name] = col
            continue
        kind = col.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind):
            cols[name] = _numbers(_utf8(col, lines, bad, log, name), lines, bad, log, name)
            continue
        if not (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)
                or pa.types.is_decimal(kind) or pa.types.is_null(kind)):
            raise DataError(f"{path}: column {name} holds {kind} values; a label or dense feature needs numbers")
        values = pc.cast(col, pa.float64(), safe=False).to_numpy(zero_copy_only=False)  # 2**62 as CSV reads it
        present = ~np.isnan(values)
        _float32_rows(values, present, lambda i: float(values[i]), lines, bad, log, name)
        cols[name] = pa.array(values, pa.float64(), mask=~present)
    cols[LINE_COLUMN] = pa.array(lines, pa.int64())
    out = pa.table(cols)
    return out.filter(pa.array(~bad)) if bad.any() else out


READERS: dict[str, Reader] = {
    "criteo_tsv": read_criteo,
    "avazu_csv": read_avazu,
    "csv": read_csv,
    "libsvm": read_libsvm,
    "movielens": read_movielens,
    "parquet": read_parquet,
}


def reader(fmt: str) -> Reader:
    """The reader of a format (aliases criteo, avazu, libfm accepted); DataError lists the known ones."""
    fmt = FORMAT_ALIASES.get(fmt, fmt)
    if fmt not in READERS:
        from flowrec.spec.schema_errors import did_you_mean

        known = sorted(READERS) + sorted(FORMAT_ALIASES)  # `CSV`: (did you mean 'csv'?), as a spec's data.format says
        raise DataError(f"unknown data format {fmt!r}{did_you_mean(fmt, known)}; known: {', '.join(known)}")
    return READERS[fmt]
