"""`flowrec predict MODEL RAW --out scores.parquet`: score raw rows with a model package.

Raw rows are read chunk by chunk in a training source format, encoded with the package's encoder
and scored by its exported program; scores are appended to the output file (bounded memory) that
appears only when complete: Parquet, or CSV / TSV text when OUT ends in .csv / .tsv (a name that
says another format is refused before anything is scored, never written as Parquet under it). Labels are not needed: Criteo TSV files are read with or without the
label column, as their first row says (40 fields: label first; 39: Criteo's test files).
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, List, Optional

import typer

from flowrec.cli.common import fail, say, skipped_lines
from flowrec.runtime.messages import first_line
from flowrec.spec.schema_errors import did_you_mean
from flowrec.spec.units import counted

EXIT_INTERRUPTED = 130


def predict(
    model_dir: Path = typer.Argument(..., metavar="MODEL", help="Model package folder (from `flowrec export`)."),
    raw: Path = typer.Argument(..., metavar="RAW", help="Raw rows: a file in a training source format (a folder for movielens; a Parquet file or a folder of them for parquet)."),
    out: Path = typer.Option(..., "--out", help="Scores file to write: one column per head, then the --keep columns. Parquet (.parquet, .pq or no suffix), or CSV / TSV text (.csv / .tsv)."),
    fmt: Optional[str] = typer.Option(None, "--format", help="criteo | avazu | libsvm | libfm | csv | movielens | parquet. Default: the spec's data.format."),
    keep: Optional[List[str]] = typer.Option(None, "--keep", help="Raw column to pass through to the scores file (repeatable)."),
    on_error: str = typer.Option("fail", "--on-error", help="Malformed rows: skip (count, report) or fail."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace OUT when it holds scores of this package's heads (or is empty); never another file."),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="No progress bar."),
    top_k: Optional[int] = typer.Option(None, "--top-k", min=1, max=100_000, help="Retrieval packages: write each row's K best items (columns items: raw item ids, best first; scores) instead of head scores, then a column per head beside the retrieval head (its score of the row)."),
) -> None:
    """Score raw rows: one score per head per row.

    \b
    Examples:
      flowrec predict pkg/ml new_ratings.csv --format csv --out scores.parquet --keep user_id
      flowrec predict pkg/dlrm day_24.tsv --format criteo --out day_24_scores.parquet
      flowrec predict pkg/ml new_ratings.csv --format csv --out scores.csv     # CSV text out
      flowrec predict pkg/dlrm test.txt --format criteo --out test_scores.parquet   # Criteo test file: no label
      flowrec predict pkg/tt users.csv --format csv --top-k 10 --out recs.parquet --keep user_id
    """
    from flowrec.data.layout import DataError
    from flowrec.data.output import DISK_FULL
    from flowrec.data.output_guard import atomic_output, check_file_output

    if on_error not in ("skip", "fail"):
        fail(f"--on-error must be skip or fail, not {on_error!r}{did_you_mean(on_error, ('skip', 'fail'))}")
    if str(out) == "-":  # Parquet was written to a file named '-' ('wrote N scored rows to -')
        fail("--out - : predict writes a scores file, not stdout: give a file name (.parquet, .csv or .tsv)")
    if not raw.exists():
        from flowrec.spec.read import broken_link

        link = broken_link(raw)
        fail(f"input not found: {raw}" + ("" if link is None else f" is {link}"))
    from flowrec.cli.streams import refuse_stream_as_package

    refuse_stream_as_package(model_dir, "predict")
    from flowrec.runtime.signals import interrupt_name, terminated_as_interrupted

    try:  # SIGTERM as Ctrl-C: the staged scores file is removed (Python's default left it)
        with terminated_as_interrupted():
            check_file_output(out, [model_dir, raw], overwrite)
            kind = output_kind(out, top_k is not None)
            with atomic_output(out, overwrite, lambda line: say(line, err=True)) as staged:
                rows, errors, zero, first, items, unseen = _score(model_dir, raw, staged, fmt, list(keep or []),
                                                                  on_error, quiet, top_k, kind, out)
    except OSError as exc:
        if exc.errno in DISK_FULL:  # pyarrow's words ('Error writing bytes to file') name no file
            fail(f"cannot write {out}: {os.strerror(exc.errno)}; {out} was not written")
        fail(first_line(exc))
    except (DataError, ValueError, RuntimeError) as exc:
        fail(first_line(exc))
    except KeyboardInterrupt as exc:
        fail(f"interrupted ({interrupt_name(exc)}); {out} was not written", EXIT_INTERRUPTED)
    say(written_line(rows, out, top_k, items))
    if errors:
        for line in skipped_lines(errors, rows, "rows scored", "rerun with --on-error fail to see the first malformed row"):
            typer.echo(line, err=True)
    if zero:
        typer.echo(f"warning: {zero_note(zero, rows, first)}", err=True)
    for line in unseen:
        typer.echo(f"warning: {line}", err=True)
    from flowrec.data.parquet_folder import unread_lines

    for line in unread_lines(raw):  # a folder a job still writes into: the rows it holds were not scored
        typer.echo(f"warning: {line}", err=True)


def written_line(rows: int, out: Path, top_k: Optional[int] = None, items: int = 0) -> str:
    """What predict wrote: scored rows, or each row's top K items (all of them, when the catalogue
    holds fewer than K: it said 'the top 500 items' over rows of 80).

    >>> written_line(3, Path("recs.parquet"), 500, 80)
    'wrote 3 rows of all 80 items, best first, to recs.parquet (the catalogue holds 80, fewer than --top-k 500)'
    >>> written_line(1, Path("recs.parquet"), 10, 80)
    'wrote 1 row of the top 10 items to recs.parquet'
    """
    noun = "row" if rows == 1 else "rows"
    if top_k is None:
        return f"wrote {rows:,} scored {noun} to {out}"
    if items < top_k:
        return (f"wrote {rows:,} {noun} of all {items:,} items, best first, to {out} (the catalogue holds "
                f"{items:,}, fewer than --top-k {top_k})")
    return f"wrote {rows:,} {noun} of the top {top_k} items to {out}"


def zero_note(zero: int, rows: int, first: int) -> str:
    """The warning for rows whose query vector is all zeros (`LoadedModel.recommend`).

    >>> zero_note(2, 10, 3)
    '2 of 10 rows have an all-zero query vector (e.g. an empty history, or ids the model holds no row for; the first is row 3 of the output, from 0): every item scores 0 for them, so their items are arbitrary, not recommendations'
    """
    return (f"{zero:,} of {counted(rows, 'row')} {'has' if zero == 1 else 'have'} an all-zero query vector (e.g. an empty history, or ids the model "
            f"holds no row for; the first is row {first} of the output, from 0): every item scores 0 for them, so "
            "their items are arbitrary, not recommendations")



PARQUET_SUFFIXES = ("", ".parquet", ".pq")
TEXT_DELIMITERS = {".csv": ",", ".tsv": "\t"}


def output_kind(out: Path, lists: bool) -> str:
    """The scores file's format from OUT's suffix: "parquet", ".csv" or ".tsv".

    Args:
        out: the --out path.
        lists: whether the rows hold lists (--top-k's items and scores), which text cannot.

    Returns:
        "parquet" for .parquet, .pq or no suffix; the suffix (".csv" / ".tsv") for text.

    Raises:
        ValueError: another suffix (Parquet under a name like scores.json misleads every reader
            after it), or lists asked into text.

    >>> output_kind(Path("s.CSV"), False), output_kind(Path("s"), True)
    ('.csv', 'parquet')
    """
    suffix = out.suffix.lower()
    if suffix in PARQUET_SUFFIXES:
        return "parquet"
    if suffix not in TEXT_DELIMITERS:
        raise ValueError(f"--out {out}: cannot write {suffix} files; name it .parquet (or .pq), .csv or .tsv")
    if lists:
        raise ValueError(f"--out {out}: --top-k writes lists (items, scores) a row, which {suffix} text cannot "
                         "hold; write Parquet (--out recs.parquet)")
    return suffix


def _open_writer(staged: Path, schema: Any, kind: str) -> Any:
    """A writer of `schema` tables into `staged`: Parquet, or header-first CSV / TSV text.

    Raises:
        ValueError: a nested column (a kept list) asked into text.
    """
    if kind == "parquet":
        import pyarrow.parquet as pq

        return pq.ParquetWriter(staged, schema)
    import pyarrow as pa
    import pyarrow.csv as pacsv

    for field in schema:
        if pa.types.is_nested(field.type):
            raise ValueError(f"--keep {field.name}: its {field.type} values cannot be written as {kind} text; "
                             "write Parquet (--out scores.parquet) or keep another column")
    return pacsv.CSVWriter(staged, schema, write_options=pacsv.WriteOptions(delimiter=TEXT_DELIMITERS[kind]))


def _as_first(table: Any, schema: Any, raw: Path) -> Any:
    """`table` (a chunk's scores and kept columns) in the scores file's `schema` (the first chunk's):
    a kept id column of a Parquet folder may be integers in one file and floats in another
    (`flowrec.data.parquet_folder`), which the writer refused ('Table schema does not match schema
    used to create file', a page of text)."""
    import pyarrow as pa

    if table.schema == schema:
        return table
    for i, field in enumerate(schema):
        if table.schema.field(i).type != field.type:
            try:
                table = table.set_column(i, field, table.column(i).cast(field.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                raise ValueError(f"--keep {field.name}: {raw} holds it as {field.type} in its first rows and as "
                                 f"{table.schema.field(i).type} in later ones, which {field.type} cannot hold: "
                                 "write it as one type, or keep another column") from None
    return table


def _score(model_dir: Path, raw: Path, staged: Path, fmt: Optional[str], keep: list[str], on_error: str,
           quiet: bool, top_k: Optional[int] = None, kind: str = "parquet", out: Optional[Path] = None
           ) -> tuple[int, int, int, int, int, list[str]]:
    """Score `raw` into `staged`: rows written, malformed rows skipped, rows of an all-zero query
    (--top-k) and the first one's row (0-based, over the rows scored), the catalogue's items (0
    without --top-k)."""
    import pyarrow as pa

    from flowrec.data.layout import DataError
    from flowrec.data.close_names import close_name
    from flowrec.data.sources import LINE_COLUMN
    from flowrec.runtime.progress import rows_spinner
    from flowrec.serving.predict import few_lines, load_model

    model = load_model(model_dir)
    model.warn_unseen = model.warn_empty = False  # one line for every chunk, at the end
    if top_k is not None and model.items is None:
        raise ValueError(f"{model_dir} has no retrieval head (its heads {', '.join(model.heads)} score rows): --top-k "
                         "needs a package of a retrieval run; leave --top-k out for the heads' scores")
    beside = [h.name for h in model.other_heads] if top_k is not None else []
    _check_keep(keep, ["items", "scores", *beside] if top_k is not None else model.heads,
                f"each row's top K items and their scores{', then the scores of heads ' + ', '.join(beside) if beside else ''}"
                if top_k is not None else "the head's scores")
    if kind != "parquet" and top_k is None:
        _check_text_heads(model.spec.heads, kind)
    if out is not None:
        refuse_replacing_other_than_scores(out, kind, ["items", "scores"] if top_k is not None else model.heads)
    chunks, log = _raw_chunks(model, raw, fmt, on_error, keep)
    writer, rows, nonfinite, first_bad = None, 0, 0, 0
    with rows_spinner(f"scoring {raw.name}", not quiet) as advance:
        try:
            for chunk in chunks:
                absent = [c for c in keep if c not in chunk.column_names or c == LINE_COLUMN]  # (the reader's own)
                if absent:
                    names = [c for c in chunk.column_names if c != LINE_COLUMN]  # not the reader's own
                    has = names[:12]
                    parts = absent[0].split(",")
                    if len(parts) > 1 and all(part.strip() in chunk.column_names for part in parts):
                        raise ValueError(f"--keep {absent[0]}: no such column in {raw}; --keep takes one column, "
                                         f"give it once per column: {' '.join('--keep ' + p.strip() for p in parts)}")
                    close = close_name(absent[0], names)  # really close (`flowrec.data.close_names`)
                    more = f" and {len(names) - len(has):,} more" if len(names) > len(has) else ""
                    raise ValueError(f"--keep {absent[0]}: no such column in {raw}"
                                     + (f": did you mean --keep {close}?" if close else "")
                                     + f" (has {', '.join(has)}{more})")
                try:
                    scores = model.predict(chunk) if top_k is None else model.recommend(chunk, top_k)
                except DataError as exc:  # about the rows (columns lacking, ...): name the file they came from
                    raise DataError(f"{raw}: {first_line(exc)}") from None
                table = pa.Table.from_pandas(scores, preserve_index=False)
                bad = not_finite_rows(table) if top_k is None else None
                if bad is not None and bad.any():
                    if not nonfinite:
                        first_bad = rows + int(bad.argmax())
                    nonfinite += int(bad.sum())
                for name in keep:
                    table = table.append_column(name, chunk.column(name))
                if writer is None:
                    writer, schema = _open_writer(staged, table.schema, kind), table.schema
                writer.write_table(_as_first(table, schema, raw))
                rows += table.num_rows
                advance(table.num_rows)
        finally:
            if writer is not None:
                writer.close()
    if writer is None:
        raise ValueError(_no_rows(raw, log, fmt or getattr(model.spec.data, "format", None)))
    items = len(model.items.raw_items) if top_k is not None else 0
    customs = [f"{m.name!r} ({m.param('class')})" for m in model.spec.modules if m.kind == "custom"]
    notes = [nonfinite_note(nonfinite, rows, first_bad, customs)] if nonfinite else []
    notes += few_lines(model.empty_columns().lines(str(raw)))  # a column empty in every row of RAW, once a run
    return rows, log.count, model.zero_queries, model.first_zero_query, items, notes + model.unseen_ids().lines()


def not_finite_rows(table: Any) -> Any:
    """Rows of a scores table (before --keep's columns) with a score that is not a finite number:
    NaN (which pandas' frame gives Arrow as null), infinite, or null, in a float column or in a list
    of them (a softmax head's probabilities, --top-k's scores).  # (rows,) bool

    >>> import pyarrow as pa
    >>> not_finite_rows(pa.table({"ctr": [0.5, float("nan"), 1.0], "p": [[0.1, 0.9], [0.5, 0.5], [float("inf"), 0.0]]})).tolist()
    [False, True, True]
    """
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    bad = np.zeros(table.num_rows, dtype=bool)
    for column in table.columns:
        column = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
        if pa.types.is_list(column.type) or pa.types.is_large_list(column.type):
            values = pc.list_flatten(column)
            if not pa.types.is_floating(values.type):
                continue
            parents = pc.list_parent_indices(column).to_numpy(zero_copy_only=False)
            flags = pc.invert(pc.fill_null(pc.is_finite(values), False)).to_numpy(zero_copy_only=False)
            bad[parents[flags]] = True
            bad |= column.is_null().to_numpy(zero_copy_only=False)
        elif pa.types.is_floating(column.type):
            bad |= pc.invert(pc.fill_null(pc.is_finite(column), False)).to_numpy(zero_copy_only=False)
    return bad


def nonfinite_note(count: int, rows: int, first: int, customs: list[str] = ()) -> str:
    """The warning for scores that are not finite numbers; `customs`: the package's custom modules
    (`'NAME' (CLASS)`), named as the likely source (training's non-finite loss names the one at fault).

    >>> nonfinite_note(2, 10, 3)
    '2 of 10 rows have a score that is not a finite number (NaN or infinite; NaN is written as an empty cell); the first is row 3 of the output, from 0: the model computes no score for them (a dense input of NaN or infinity, an overflow in a custom module?)'
    >>> nonfinite_note(1, 10, 0, ["'mine' (x.py:Mine)"]).split(": the model computes no score for it ")[1]
    "(a dense input of NaN or infinity, or custom module 'mine' (x.py:Mine) returning NaN or infinity on such rows?)"
    """
    source = (f"or custom module {', '.join(customs)} returning NaN or infinity on such rows" if customs else
              "an overflow in a custom module")
    return (f"{count:,} of {counted(rows, 'row')} {'has' if count == 1 else 'have'} a score that is not a finite "
            f"number (NaN or infinite; NaN is written as an empty cell); the first is row {first} of the output, from "
            f"0: the model computes no score for {'it' if count == 1 else 'them'} (a dense input of NaN or infinity, "
            f"{source}?)")


SCORES_HEADER_LIMIT = 1 << 20  # bytes of an existing text --out read for its header line (1 MiB)


def refuse_replacing_other_than_scores(out: Path, kind: str, columns: list[str]) -> None:
    """Raise ValueError (one line) when `--out OUT --overwrite` would replace an existing file that
    is not scores this package writes: a table whose columns begin with `columns` (its heads, or
    --top-k's items and scores), or an empty file. The output guard knows only predict's inputs,
    so --overwrite replaced the spec or the raw training CSV the package was trained from with
    scores, as `eval --json` did (`refuse_replacing_other_than_metrics`)."""
    import csv

    from flowrec.data.output_guard import check_replacing_own_output

    def holds_scores(path: Path) -> bool:
        try:
            if kind == "parquet":
                import pyarrow.parquet as pq

                names = pq.read_schema(path).names
            else:
                with open(path, "rb") as f:
                    head = f.read(SCORES_HEADER_LIMIT).split(b"\n", 1)[0].decode("utf-8").rstrip("\r")
                names = next(csv.reader([head], delimiter=TEXT_DELIMITERS[kind]), [])  # its writer quotes names, TSV's too
        except (OSError, ValueError):  # not Parquet (ArrowInvalid), not UTF-8 text: not scores
            return False
        return names[:len(columns)] == columns

    check_replacing_own_output(out, holds_scores, f"scores of {', '.join(columns)} as flowrec predict writes them "
                                                  "with this package")


def _check_keep(keep: list[str], heads: list[str], what: str = "the head's scores") -> None:
    """--keep names: each once, none a column predict writes (a head's scores; --top-k's items and
    scores), `what` those columns hold."""
    for name in keep:
        if name in heads:
            raise ValueError(f"--keep {name}: the scores file already has a column {name} ({what}); keep "
                             "another column")
        if keep.count(name) > 1:
            raise ValueError(f"--keep {name} is given twice")


def _check_text_heads(heads: list[Any], kind: str) -> None:
    """Refuse text output of a multiclass head (a list of class probabilities a row) before any row
    is scored; it was refused at the first chunk as if it were a --keep column the user never gave.

    Raises:
        ValueError: a head is wider than one column (the caller checks only text output).
    """
    wide = next((h for h in heads if h.width > 1), None)
    if wide is not None:
        raise ValueError(f"head {wide.name} scores {wide.width} class probabilities a row, which {kind} text "
                         "cannot hold; write Parquet (--out scores.parquet)")


def _no_rows(raw: Path, log: Any, fmt: Optional[str]) -> str:
    """Why nothing was scored: no data rows, every row was malformed (the first one named), or the
    `_`-named folders of a Parquet folder were not read (`skipped_note`)."""
    from flowrec.data.parquet_folder import skipped_note

    if log.count:
        return f"no rows to score in {raw}: all {log.count:,} data rows are malformed; the first: {log.examples[0]}"
    note = skipped_note(raw) if fmt == "parquet" else ""
    return f"no rows to score in {raw}" + (f": {note}" if note else "")


def default_format_mismatch(raw: Path, fmt: str) -> Optional[str]:
    """Why `raw` cannot be in `fmt`, the package spec's data.format that predict reads when no
    --format is given, where the path says so at once; else None. `flowrec predict pkg/ml
    new_ratings.csv --out s.parquet` (the help's example without its --format csv) said only that the
    CSV file is not a MovieLens folder, and a .parquet file read as CSV that a row "is not valid UTF-8".

    >>> default_format_mismatch(Path("rows.parquet"), "criteo")
    "rows.parquet is named as Parquet, but the package's spec reads criteo (its data.format, the default): give --format parquet"
    >>> default_format_mismatch(Path("rows.csv"), "csv") is None
    True
    """
    from flowrec.data.sources import FORMAT_ALIASES, encoded_dataset_line

    if FORMAT_ALIASES.get(fmt, fmt) == "movielens" and raw.is_file():
        return (f"{raw} is a file, but the package's spec reads a MovieLens folder (its data.format {fmt}, the "
                "default): give --format csv (or parquet) for a file of raw rows")
    if raw.suffix.lower() in (".parquet", ".pq") and FORMAT_ALIASES.get(fmt, fmt) != "parquet":
        if raw.is_file() and (encoded := encoded_dataset_line(raw)) is not None:
            return encoded  # --format parquet would refuse it too
        return (f"{raw} is named as Parquet, but the package's spec reads {fmt} (its data.format, the default): "
                "give --format parquet")
    return None


def _raw_chunks(model, raw: Path, fmt: Optional[str], on_error: str, keep: Optional[List[str]] = None
                ) -> tuple[Any, Any]:
    """Chunks of raw rows in the package spec's source format (labels optional). A kept label column
    of a text format is read as numbers (float64), as training reads it (it was text: `--keep clk` of a
    CSV wrote '1' and '0', and the scores file's clk had no mean); Parquet keeps the file's type."""
    from flowrec.data.error_log import ErrorLog
    from flowrec.data.layout import label_columns, weight_columns
    from flowrec.data.sources import FORMAT_ALIASES, Scoring, criteo_has_label, reader

    spec = model.spec
    if fmt is None:
        fmt = spec.data.format if spec.data is not None else None
        if fmt is None:
            raise ValueError("the package's spec binds no data format (data.format); give --format "
                             "criteo|avazu|libsvm|libfm|csv|movielens|parquet, the format of RAW")
        mismatch = default_format_mismatch(raw, fmt)
        if mismatch is not None:
            raise ValueError(mismatch)
    log = ErrorLog(on_error, str(raw))
    opts = dict(spec.data.options) if spec.data is not None else {}
    if FORMAT_ALIASES.get(fmt, fmt) == "libsvm" and model.record.feature_map:
        opts["feature_map"] = model.record.feature_map  # the package's map, never a file in the working folder
    if FORMAT_ALIASES.get(fmt, fmt) == "criteo_tsv":  # test files lack the label column
        opts["has_label"] = criteo_has_label(raw)
    numeric = {model.encoder.source(f.name) for f in spec.dense_features}
    # scoring ignores the label (a row may leave it empty), and a CSV's other columns are not read (a row
    # of 100,000 columns took 1.5 GB): every feature's (a retrieval package's heads read the row's item
    # where it is given) and --keep's
    scoring = Scoring(frozenset({model.encoder.source(f.name) for f in spec.features} | set(keep or [])))
    labels = set(label_columns(spec)) | set(weight_columns(spec))  # numbers in training: a head's label, its weights
    if FORMAT_ALIASES.get(fmt, fmt) != "parquet":
        numeric |= labels & set(keep or [])
    from flowrec.data.convert import one_index_each
    from flowrec.data.encode import drop_unencodable

    rows = reader(fmt)(raw, opts, log, numeric, scoring)
    if FORMAT_ALIASES.get(fmt, fmt) == "libsvm":  # a one-hot feature given two indices: malformed, as convert says
        columns = {f.name: model.encoder.source(f.name) for f in spec.features}
        rows = (one_index_each(chunk, spec, columns, log) for chunk in rows)
    chunks = (drop_unencodable(model.encoder, chunk, log) for chunk in rows)
    kept = labels & set(keep or [])
    return _kept_labels_said((chunk for chunk in chunks if chunk.num_rows), spec, kept), log  # a value the
    # encoder scales past float32: malformed


def _kept_labels_said(chunks: Any, spec: Any, kept: set[str]) -> Any:
    """The chunks; a kept label column of mostly text (`TextColumn`: '--keep clk' of no/yes, read as
    numbers as training reads it) said as a label, with how to map it, not as a dense column."""
    from flowrec.data.labels import label_tasks, text_label_line
    from flowrec.data.layout import DataError
    from flowrec.data.sources import TextColumn

    try:
        yield from chunks
    except TextColumn as exc:
        if exc.column not in kept:
            raise
        task = label_tasks(spec, {}).get(exc.column, "regression")
        raise DataError(f"--keep {exc.column}: {text_label_line(exc.column, exc.values, task, 'scoring')}, or keep "
                        "another column") from None

