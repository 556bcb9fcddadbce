"""The files of a raw Parquet input, checked against each other before a row is read.

pyarrow's dataset takes a folder's schema from its first file, then fills a column that another
file lacks with nulls and casts a column that another file holds with another type: a column the
spec binds read as missing on every row of a file without a word, a file outside the Hive
partition folders read with no partition value, a list column a traceback, text in a column of
integers a message that names no file. So every file with rows must hold the columns of the
folder's first such file (its own columns and the Hive partition keys of its folders), no other,
each with the first file's type; an error is one line naming the file and the column. Where the
values keep their meaning whatever the type, types may differ: a label or dense column (`numeric`)
is read as numbers file by file (int64 in one day's file and double in the next, as pandas writes a
day with a missing value), so is any column of integers in one file and floats in another (an id
column of such a day: 3 and 3.0 are the id "3"), so is a column of text in one Arrow type in one
file and another in the next (string, large_string as polars writes it, pandas' categories of text),
and a column holding only nulls (Arrow's null type) fits any type. Each
file is then read with its own types for those columns (a dataset-wide cast of int64 to double
refuses integers beyond 2^53). A file without rows adds none and is left out.

Example:
    >>> files = parquet_files(Path("clicks/"), {"label"})  # doctest: +SKIP
    >>> [f.path for f in files]  # doctest: +SKIP
    ['clicks/day=1/part-0.parquet', 'clicks/day=2/part-0.parquet']
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Collection

import pyarrow as pa

from flowrec.data.layout import DataError
from flowrec.data.names import check_folder_links

MARKERS = ("_", ".")  # a file or (non-partition) folder so named is not data: Spark's _SUCCESS, _temporary/
SAME_COLUMNS = "every file of a Parquet folder must hold the same columns"


@dataclass(frozen=True)
class ParquetFile:
    """One file of a raw Parquet input and the schema it is read with.

    Args:
        path: the file.
        fragment: pyarrow's fragment of it (its Hive partition keys included).
        schema: the columns in the folder's order: its own type for numeric ones, the folder's
            type for the others (a null column cast to it), partition keys as the folder types them.
    """

    path: str
    fragment: Any
    schema: pa.Schema


def parquet_files(path: Path, numeric: set[str], columns: Collection[str] | None = None) -> list[ParquetFile]:
    """The files of a raw Parquet file or folder (path order) that hold rows, checked alike.
    `columns`: the only columns read (`flowrec predict`'s), where the first file holds them all: each
    file's schema holds only those, and only they must be in every file, of one type (else every
    column, as None).

    Raises:
        DataError: a file that lacks a column of the folder's first file, has one it lacks, or
            holds a non-numeric column with another type (one line naming the file and the
            column); pyarrow's errors (an unreadable file) pass through for the caller to name.
    """
    import pyarrow.dataset as ds

    check_folder_links(Path(path))  # pyarrow follows a link loop without end
    data = ds.dataset(**_source(path), format="parquet", partitioning="hive", exclude_invalid_files=False,
                      schema=_discovered_schema(path))
    files = [(f, _columns(f, data.schema)) for f in data.get_fragments() if f.metadata.num_rows]
    if not files:
        return []
    first, reference = files[0][0].path, files[0][1]
    read = list(reference) if columns is None or not set(columns) <= set(reference) else \
        [name for name in reference if name in set(columns)]
    restricted = len(read) < len(reference)
    for fragment, held in files[1:]:  # the columns read (every one, or `columns`), in every file
        _check_names(fragment.path, {n: f for n, f in held.items() if n in read} if restricted else held, first,
                     {n: reference[n] for n in read})
    typed = _folder_types([(f, {n: c[n] for n in read}) for f, c in files], numeric)
    return [ParquetFile(f.path, f, pa.schema([pa.field(n, typed.get(n, c[n].type)) for n in read]))
            for f, c in files]


def _discovered_schema(path: Path) -> pa.Schema:
    """The schema pyarrow's discovery gives a raw Parquet file or folder (its first file's columns,
    then the Hive partition keys of its folders), without pyarrow's merge of the two, which refused
    the ordinary folder whose files hold their partition column (day=1/ of files with a column
    `day`: "Unable to merge: Field day has incompatible types: int64 vs int32", a traceback): such
    a key takes the files' type, and its rows the value their folder names, as pyarrow (and Spark)
    read it. Columns of no name ('', which pandas writes for a frame's column '') are left out:
    unused, as a CSV header's (`flowrec.data.sources._named_columns`)."""
    import pyarrow.dataset as ds
    import pyarrow.fs as pfs

    options = ds.FileSystemFactoryOptions(exclude_invalid_files=False)
    source: Any = [str(path)]
    if Path(path).is_dir():
        options.partition_base_dir = str(path)
        options.partitioning_factory = ds.HivePartitioning.discover()
        source = listed_files(Path(path))[0]
    *physical, partition = ds.FileSystemDatasetFactory(pfs.LocalFileSystem(), source, ds.ParquetFileFormat(),
                                                       options).inspect_schemas()
    own = [field for field in (physical[0] if physical else []) if field.name]
    names = {field.name for field in own}
    return pa.schema([*own, *(key for key in partition if key.name not in names)])


def file_columns(path: Path) -> list[tuple[str, list[str]]]:
    """(file, its own column names) of each file of a raw Parquet file or folder, read before
    pyarrow's discovery unifies them: a file naming a column twice (two columns of no name, as
    pandas writes a frame whose columns are '') made that a "Can't unify schema" naming no column."""
    import pyarrow.dataset as ds

    check_folder_links(Path(path))
    listed = ds.dataset(**_source(path), format="parquet", partitioning="hive", exclude_invalid_files=False,
                        schema=pa.schema([]))  # lists the files; reads no schema of theirs
    return [(f.path, f.physical_schema.names) for f in listed.get_fragments()]


def listed_files(path: Path) -> tuple[list[str], list[str]]:
    """(the files of the folder `path` to read, in path order; its folders skipped, each holding files).

    As Spark and pyarrow, a file whose name starts with `_` or `.` is not read (Spark's `_SUCCESS`,
    `.part-0.crc`), nor a folder so named (`_temporary/` of a job still writing, `.cache/`), but a
    Hive partition folder is read whatever its key (`_day=1/`, `__line__=7/`): pyarrow's discovery
    skipped those, so a table partitioned by `_day` was "no rows converted ...: it holds no data rows"
    (`skipped` lets that message name the folders left out)."""
    import os

    files: list[str] = []
    skipped: list[str] = []
    for root, folders, names in os.walk(path, followlinks=True):  # check_folder_links: no loop
        kept = [f for f in folders if not f.startswith(MARKERS) or _hive_folder(f)]
        skipped += [os.path.join(root, f) for f in folders if f not in kept and _holds_files(Path(root, f))]
        folders[:] = sorted(kept)
        files += [os.path.join(root, n) for n in names if not n.startswith(MARKERS)]
    return sorted(files), sorted(skipped)


def skipped_note(path: Path) -> str:
    """What a raw Parquet folder that gave no rows left out, for the line saying it gave none: its
    `_`- or `.`-named folders holding files ('' when none, or `path` is a file)."""
    skipped = listed_files(Path(path))[1] if Path(path).is_dir() else []
    if not skipped:
        return ""
    return (f"its folders {', '.join(skipped[:3])}{' ...' if len(skipped) > 3 else ''} were not read (a folder "
            "whose name starts with _ or . is not data, as Spark's _temporary/; a partition folder key=value is "
            "read): rename them")


WRITING = "_temporary"  # the folder a Spark (Hadoop) job writes its part files into until it commits them
DATA_SUFFIXES = (".parquet", ".pq")


def unread_lines(path: Path, raw: bool = True) -> list[str]:
    """Warnings (one line each, none where all is well) for what a read of the Parquet folder `path`
    leaves out without a word: a `_temporary/` folder at any depth, where a job (Spark's) still
    writes part files it has not committed, their rows not read; and, for a raw folder (`raw`),
    the other `_`- or `.`-named folders holding Parquet files (`.hidden/`, `_old/`; an encoded
    dataset's own `_vocab/` holds its vocabularies). Files so named (`_SUCCESS`, `.part-0.crc`,
    `.DS_Store`) are never data and stay silent; a partition folder key=value is read.

    >>> unread_lines(Path("no-such-folder"))
    []
    """
    import os

    if not Path(path).is_dir():
        return []
    writing: list[str] = []
    unread: list[tuple[str, int]] = []
    for root, folders, _ in os.walk(path, followlinks=True):  # check_folder_links: no loop
        for name in [f for f in folders if f.startswith(MARKERS) and not _hive_folder(f)]:
            folder = os.path.join(root, name)
            if name == WRITING:
                writing.append(folder)
            elif raw and (files := _data_files(Path(folder))):
                unread.append((folder, files))
        folders[:] = [f for f in folders if not f.startswith(MARKERS) or _hive_folder(f)]
    lines = []
    if writing:
        lines.append(f"{', '.join(sorted(writing)[:3])}{' ...' if len(writing) > 3 else ''}: a job is still writing "
                     f"into {path} (Spark's {WRITING}/ until it commits); the rows it holds are not read: read "
                     f"{path} again once the job has finished")
    if unread:
        shown = [f"{folder} ({n} Parquet file{'s' if n > 1 else ''})" for folder, n in sorted(unread)[:3]]
        lines.append(f"{', '.join(shown)}{' ...' if len(unread) > 3 else ''}: not read (a folder whose name starts "
                     "with _ or . is not data; a partition folder key=value is read): rename it to read its rows")
    return lines


def _data_files(folder: Path) -> int:
    """How many Parquet files (by name; not `_`- or `.`-named) lie at any depth below `folder`."""
    return sum(1 for p in folder.rglob("*") if p.name.lower().endswith(DATA_SUFFIXES)
               and not p.name.startswith(MARKERS) and p.is_file())


def _source(path: Path) -> dict[str, Any]:
    """pyarrow's dataset source for `path`: a file as it is, a folder's `listed_files`, whose
    partition keys are those of the folders below `path`."""
    if not Path(path).is_dir():
        return {"source": str(path)}
    return {"source": listed_files(Path(path))[0], "partition_base_dir": str(path)}


def _hive_folder(name: str) -> bool:
    key, equals, _ = name.partition("=")
    return bool(equals and key.strip("_."))


def _holds_files(folder: Path) -> bool:
    return any(p.is_file() for p in folder.rglob("*"))


def _columns(fragment: Any, schema: pa.Schema) -> dict[str, pa.Field]:
    """A file's columns: its own, then the partition keys its folders give (typed as the folder's)."""
    import pyarrow.dataset as ds

    own = {field.name: field for field in fragment.physical_schema if field.name}  # '': unused
    keys = ds.get_partition_keys(fragment.partition_expression)
    return {**own, **{name: schema.field(name) for name in keys if name not in own}}


def _check_names(path: str, columns: dict[str, pa.Field], first: str, reference: dict[str, pa.Field]) -> None:
    missing = [name for name in reference if name not in columns]
    if missing:
        raise DataError(f"{path}: no column {missing[0]!r}, which {first} has: {SAME_COLUMNS}")
    extra = [name for name in columns if name not in reference]
    if extra:
        raise DataError(f"{first}: no column {extra[0]!r}, which {path} has: {SAME_COLUMNS}")


def _folder_types(files: list[tuple[Any, dict[str, pa.Field]]], numeric: set[str]) -> dict[str, pa.DataType]:
    """The type of each non-numeric column, from the first file where it is not all nulls; DataError
    naming a file that holds it with another type."""
    typed: dict[str, tuple[str, pa.Field]] = {}
    numbers: set[str] = set()  # columns of integers in one file and floats in another (or text in two
    # Arrow types): each file's own type
    for fragment, columns in files:
        for name, field in columns.items():
            if name in numeric or pa.types.is_null(field.type):
                continue
            where, held = typed.setdefault(name, (fragment.path, field))
            if field.type != held.type and _number(field.type) and _number(held.type):
                numbers.add(name)  # ids as numbers: 3 and 3.0 are the id "3" (`flowrec.data.raw_ids.as_strings`)
            elif field.type != held.type and _text(field.type) and _text(held.type):
                numbers.add(name)  # one text: string, large_string (polars' and pandas' Arrow strings), categories,
                # bytes (a writer without the UTF-8 mark, as Hive's or old Spark's: the same ids, `_text`)
            elif field.type != held.type:
                raise DataError(f"{fragment.path}: column {name!r} holds {field.type} values, {where} "
                                f"{held.type}: a column holds one type in every file of a Parquet folder "
                                "(labels and dense features any numbers, other columns integers or floats, or "
                                "text or bytes)")
    return {name: field.type for name, (_, field) in typed.items() if name not in numbers}


def _number(kind: pa.DataType) -> bool:
    return pa.types.is_integer(kind) or pa.types.is_floating(kind)


def _text(kind: pa.DataType) -> bool:
    """Text of any Arrow string type, or categories of text (pandas' category dtype: a dictionary), or
    bytes: an id column one writer marks as UTF-8 text and another (Hive, old Spark) leaves as bytes
    encodes to the same ids (`flowrec.data.raw_ids`)."""
    kind = kind.value_type if pa.types.is_dictionary(kind) else kind
    return (pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_string_view(kind)
            or pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or pa.types.is_binary_view(kind))
