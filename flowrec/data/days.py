"""Day partitions: the encoded datasets under one folder that `flowrec train --follow` trains in order.

A day partition is a complete encoded dataset folder (one with ``_flowrec.json``; a conversion
renames it into place only when complete) directly under the folder, its name not starting with
``.`` or ``_``. Days are taken in order of name (``name``, the default) or by a date column
(``date:COLUMN``): the smallest value of COLUMN that conversion recorded for the day (data option
``date_column``, or ``split_by``, in ``_flowrec_stats.json``), else the smallest value of a stored
numeric column COLUMN; ties by name. Names compare naturally (`name_key`: runs of digits as
numbers, so day2 comes before day10); a stream started when they compared as text keeps that
order (`DayOrder.text`, told by its follow.json). `day_ids` gives the distinct raw ids of a day's managed
tables (what `flowrec data inspect DAYS` shows per day, new ids included).

Example:
    >>> order = parse_order("date:timestamp")  # doctest: +SKIP
    >>> [d.name for d in day_partitions(Path("days"), order)]  # doctest: +SKIP
    ['2026-11-01', '2026-11-02']
"""
from __future__ import annotations

import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from flowrec.data.dataset import dataset_layout, parquet_files
from flowrec.data.layout import META_FILE, DataError, DatasetMeta, read_meta
from flowrec.data.raw_ids import MISSING_ID
from flowrec.data.rawstats import STATS_FILE, flat_ids, read_stats

ORDERS = ("name", "date:COLUMN")  # the accepted forms of an order


@dataclass(frozen=True)
class DayOrder:
    """How day partitions are ordered.

    Args:
        column: the date column (None: by name).
        text: names compare as text (day10 before day2), as they did before flowrec compared them
            naturally: the order of a stream started then (its follow.json records no `names`).
    """

    column: str | None = None
    text: bool = False

    def name_key(self, name: str) -> Any:
        """The sort key of a day's name in this order."""
        return name if self.text else name_key(name)

    def __str__(self) -> str:
        return "name" if self.column is None else f"date:{self.column}"


_DIGITS = re.compile(r"([0-9]+)")


def name_key(name: str) -> tuple[tuple[Any, ...], str]:
    """The natural sort key of a day's name: runs of ASCII digits compared as numbers, the rest as
    text; names that differ only in leading zeros (day01, day1) by their text.

    >>> sorted(["day10", "day2", "day1", "day01", "2026-11-02", "2026-11-10"], key=name_key)
    ['2026-11-02', '2026-11-10', 'day01', 'day1', 'day2', 'day10']
    """
    parts = _DIGITS.split(name)  # text, digits, text, ...: digits at the odd places
    return tuple(int(p) if i % 2 else p for i, p in enumerate(parts)), name


def parse_order(text: str) -> DayOrder:
    """`name` or `date:COLUMN` (raises ValueError otherwise)."""
    if text == "name":
        return DayOrder()
    kind, _, column = text.partition(":")
    if kind != "date" or not column.strip():
        raise ValueError(f"day order {text!r}: use one of {', '.join(ORDERS)}")
    return DayOrder(column.strip())


def listing(folder: Path) -> list[Path]:
    """The entries of the folder of days `folder`, in order of name: one listing, which `landed` and
    `skipped_entries` share (`--follow` lists its days once a look, not once for each)."""
    return sorted(folder.iterdir())


def landed(folder: Path, key: Callable[[str], Any] | None = None, entries: list[Path] | None = None) -> list[Path]:
    """The complete day partitions under `folder`, in order of `key` of their names (default: natural
    order, `name_key`; raises DataError if it is not a folder). `entries`: the folder's `listing`,
    where the caller made it (default: listed here, once)."""
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder")
    if (folder / META_FILE).is_file():  # one day given as the days: --follow-wait waited for days under it
        raise DataError(f"{folder} is one dataset (it holds {META_FILE}), not a folder of day partitions: "
                        f"give the folder that holds the days (the one {folder.name} lies in?)")
    if _split_of(folder):  # its train and test parts are no days (test would train first)
        raise DataError(f"{folder} is one dataset split into train/ and test/, not a folder of day partitions")
    from flowrec.data.owners import is_stream_folder, owner_of

    owner = "a --follow stream" if is_stream_folder(folder) else owner_of(folder)
    if owner is not None:  # `--follow RUN` trained a run's encoded bound data, RUN/data, as a day 'data'
        raise DataError(f"{folder} is {owner}'s folder, not a folder of day partitions: give the folder that "
                        "holds the days (each an encoded dataset)")
    entries = listing(folder) if entries is None else entries
    days = sorted((p for p in entries if p.is_dir() and (p / META_FILE).is_file()
                   and not p.name.startswith((".", "_"))), key=lambda p: (key or name_key)(p.name))
    for p in entries:
        # a day converted with a test split was skipped without a word, forever
        if p.is_dir() and not (p / META_FILE).is_file() and not p.name.startswith((".", "_")) and _split_of(p):
            raise DataError(f"day {p.name} under {folder} is one dataset split into train/ and test/ (a "
                            "conversion with --test-fraction, or the spec's data.options.test_fraction): a day "
                            "is one dataset; convert it again with --test-fraction 0")
    seen: dict[Path, str] = {}
    for day in days:  # a day linked in under two names would train twice
        target = day.resolve()
        if target in seen:
            raise DataError(f"days {seen[target]} and {day.name} under {folder} are the same folder "
                            f"({target}, through a link): remove one")
        seen[target] = day.name
    return days


SKIPPED_SHOWN = 10  # skipped entries named in the line; the rest are counted


def skipped_entries(folder: Path, entries: list[Path] | None = None) -> dict[str, str]:
    """The entries of the folder of days `folder` that are no day partition and that `landed` skips
    (an empty folder, one without its meta, a link to nothing or a link loop, a file): name -> why,
    in order of name. Names starting with '.' or '_' are skipped by design (a writer's own), and a
    day split into train/ and test/ is refused by `landed`. `entries`: the folder's `listing`, where
    the caller made it."""
    import errno

    skipped = {}
    for p in listing(folder) if entries is None else entries:
        if p.name.startswith((".", "_")) or (p / META_FILE).is_file():
            continue
        try:
            os.stat(p)
        except OSError as exc:
            skipped[p.name] = ("a link loop" if exc.errno == errno.ELOOP else
                               f"a link to {os.readlink(p)}, which is not there" if p.is_symlink() else
                               os.strerror(exc.errno or errno.EIO))
            continue
        if p.is_dir() and not _split_of(p):
            try:
                empty = next(p.iterdir(), None) is None
            except OSError as exc:
                skipped[p.name] = f"a folder that cannot be read: {os.strerror(exc.errno or errno.EIO)}"
                continue
            skipped[p.name] = ("an empty folder" if empty else
                               f"a folder without {META_FILE}: not converted, or still being written")
        elif not p.is_dir():
            skipped[p.name] = "a file, not a dataset folder"
    return skipped


def skipped_line(folder: Path, entries: dict[str, str] | None = None) -> str | None:
    """One line naming each entry of the folder of days `folder` that `landed` skips, with why
    (`entries`: those to name, from `skipped_entries`; default: all of them); None when there is none."""
    skipped = [f"{name} ({why})" for name, why in (skipped_entries(folder) if entries is None else entries).items()]
    if not skipped:
        return None
    more = f", and {len(skipped) - SKIPPED_SHOWN:,} more" if len(skipped) > SKIPPED_SHOWN else ""
    entries_said = "1 entry that is" if len(skipped) == 1 else f"{len(skipped):,} entries that are"
    return f"{folder}: skipped {entries_said} no day partition: {', '.join(skipped[:SKIPPED_SHOWN])}{more}"


def split_parts(folder: Path) -> list[Path]:
    """The train and test parts of the split dataset `folder` (`data convert --test-fraction`), in
    that order; empty when `folder` is not one."""
    return [folder / part for part in ("train", "test") if (folder / part / META_FILE).is_file()] \
        if _split_of(folder) else []


def _split_of(folder: Path) -> bool:
    """True when `folder` holds the train/test parts of one split dataset (`data convert --test-fraction`)."""
    for part in ("train", "test"):
        if (folder / part / META_FILE).is_file():
            try:
                if read_meta(folder / part).split.get("part") == part:
                    return True
            except (DataError, ValueError, AttributeError):
                continue
    return False


def day_partitions(folder: Path, order: DayOrder, entries: list[Path] | None = None) -> list[Path]:
    """The complete day partitions under `folder` in `order` (raises DataError when a day has no date;
    `entries`: the folder's `listing`, where the caller made it)."""
    return [day for day, _ in _ordered(folder, order, read_meta, entries)]


def _ordered(folder: Path, order: DayOrder, meta: Callable[[Path], DatasetMeta],
             entries: list[Path] | None = None) -> list[tuple[Path, Any]]:
    """(day, its first date; None when ordered by name) per complete day under `folder`, in `order`:
    each day dated once. `meta` reads a day's meta (a caller that reads it again passes a cached one)."""
    days = landed(folder, order.name_key, entries)  # in the order of their names: sorted once
    if order.column is None:
        return [(day, None) for day in days]
    dated = {day.name: _dated(day, order.column, meta) for day in days}
    sources = {source: name for name, (_, source) in dated.items()}
    if len(sources) > 1:  # raw dates of some days against stored (possibly transformed) values of others
        raise DataError(f"day {sources['recorded']} has the dates of column {order.column!r} that conversion "
                        f"recorded, day {sources['stored']} only its stored values: convert every day with "
                        f"the data option date_column: {order.column}")
    keys = {name: (value, order.name_key(name)) for name, (value, _) in dated.items()}
    kinds = {type(k[0]) for k in keys.values()}
    if len(kinds) > 1:
        raise DataError(f"date column {order.column!r} holds numbers for some days and text for others: "
                        "days cannot be ordered by it")
    return [(day, keys[day.name][0]) for day in sorted(days, key=lambda d: keys[d.name])]


def day_key(day: Path, order: DayOrder) -> tuple[Any, ...]:
    """The sort key of one day: (its first date, its name's key); (its name's key,) when ordered by name."""
    if order.column is None:
        return (order.name_key(day.name),)
    return _dated(day, order.column, read_meta)[0], order.name_key(day.name)


def _dated(day: Path, column: str, meta: Callable[[Path], DatasetMeta]) -> tuple[Any, str]:
    """(the first date of `column` in the day, where it comes from: "recorded" by conversion or
    "stored" in the day's parts). A stats file that cannot be read is a DataError, never a silent
    fall back to the stored column (its values may be transformed: another scale)."""
    order = DayOrder(column)
    stats = read_stats(day)
    if stats is None and os.path.lexists(day / STATS_FILE):
        raise DataError(f"day {day.name}: {STATS_FILE} is damaged (not a readable JSON object within the "
                        f"limits); convert the day again")
    dates = (stats or {}).get("dates")
    if isinstance(dates, dict) and dates.get("column") == order.column and dates.get("min") is not None:
        return _recorded_date(day, dates["min"], order.column), "recorded"
    try:
        stored = _stored_min(day, order.column, meta)
    except (OSError, pa.ArrowException) as exc:
        raise DataError(f"day {day.name}: cannot read column {order.column!r}: {str(exc).splitlines()[0]:.200}") from None
    if stored is None:
        raise DataError(f"day {day.name}: no dates of column {order.column!r} (convert it with the data option "
                        f"date_column: {order.column}, or store the column)")
    return stored, "stored"


MAX_DATE_CHARS = 200  # a recorded date longer than this is not a date


def _recorded_date(day: Path, value: Any, column: str) -> float | str:
    """The first date conversion recorded for the day: a finite number (as float, so integer and
    float records order together) or text; anything else (a hand-edited or damaged stats file:
    NaN, a list, true) is a DataError rather than a silently wrong order."""
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    if isinstance(value, str) and len(value) <= MAX_DATE_CHARS:
        return value
    raise DataError(f"day {day.name}: {STATS_FILE} is damaged: the first date of column {column!r} is "
                    f"{value!r:.60}, not a finite number or a date text; convert the day again")


def _stored_min(day: Path, column: str, meta: Callable[[Path], DatasetMeta]) -> float | None:
    """The smallest value of a stored numeric column of the day (None: no such column). An
    encoded categorical column (ids, not dates) is refused, and so is one that holds only NaN."""
    files = parquet_files(day)
    if not files or column not in pq.read_schema(files[0]).names:
        return None
    if column in meta(day).encoding:
        raise DataError(f"day {day.name}: column {column!r} is an encoded categorical feature (ids, not "
                        f"dates): days cannot be ordered by it; convert them with the data option "
                        f"date_column: COLUMN")
    lows = []
    for f in files:
        col = pq.read_table(f, columns=[column]).column(column)
        if not (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)):
            return None
        low = pc.min(col).as_py()
        if low is not None and math.isfinite(low):
            lows.append(float(low))
    return min(lows) if lows else None


def day_ids(day: Path, meta: DatasetMeta | None = None) -> dict[str, np.ndarray]:
    """Managed table -> the sorted distinct raw ids of the day (all its features, missing excluded;
    `meta`: the day's meta when the caller has read it)."""
    meta = read_meta(day) if meta is None else meta
    features: dict[str, list[str]] = {}
    for name, enc in meta.encoding.items():
        # converted data says managed; `data synth` writes raw-id hashes too, its rule's rows 0
        # (`layout.encoded_rows`: a managed table's data holds no rows; every other table has rows)
        if enc.get("mode") == "managed" or (enc.get("mode") == "synthetic" and enc.get("rows") == 0):
            features.setdefault(enc["table"], []).append(name)
    if not features:
        return {}
    files = parquet_files(day)
    out = {}
    for table, names in features.items():
        parts = []
        for f in files:
            parts += [flat_ids(col) for col in pq.read_table(f, columns=names).columns]
        ids = np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64)
        out[table] = ids[ids != MISSING_ID]
    return out


def inspect_days(folder: Path, order: DayOrder) -> list[dict[str, Any]]:
    """Per day in `order`: its rows, its first date (when ordered by one) and, per managed table,
    the distinct raw ids it brings and how many of them no earlier day brought (raises DataError
    for a day whose part files are unreadable or hold other rows than its meta records)."""
    meta = functools.cache(read_meta)  # each day's meta read once (dating may need it too)
    seen: dict[str, np.ndarray] = {}
    out = []
    for day, date in _ordered(folder, order, meta):
        # a day whose part files cannot be read, or hold other rows than its meta records (damaged,
        # or still being copied in), was listed with the rows its meta records: `--follow` refuses it
        dataset_layout(day, meta(day), parquet_files(day))
        entry: dict[str, Any] = {"day": day.name, "rows": meta(day).rows, "managed": {}}
        if order.column is not None:
            entry["date"] = date
        for table, ids in day_ids(day, meta(day)).items():
            before = seen.get(table, np.zeros(0, np.int64))
            new = int(len(ids) - np.isin(ids, before, assume_unique=True).sum())
            entry["managed"][table] = {"distinct_ids": int(len(ids)), "new_ids": new}
            seen[table] = np.union1d(before, ids)
        out.append(entry)
    return out
