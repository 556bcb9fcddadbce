"""A `--follow` stream folder on disk: its record of the days it trained (`follow.json`) and their
run folders (`days/<day>`). `flowrec.cli.follow` writes and checks them; a command given a run
folder (`export`) uses this module to point a user who gave it the stream folder at its days.

Example:
    >>> refuse_stream_folder(Path("runs/ml"), "export")  # doctest: +SKIP
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from flowrec.cli.common import fail
from flowrec.data.days import DayOrder, parse_order
from flowrec.data.owners import FOLLOW_FILE, is_stream_folder  # noqa: F401 (this module's names)

DAYS_DIR = "days"
EXPORT_DIR = "export"  # --follow-export: RUN/export/<day>, each day's model package


def _trained_days(path: Path, nothing: str) -> list[str] | None:
    """The trained days of the `--follow` stream folder `path` (None: `path` is none); fails in one
    line (`nothing`: what that leaves the command) when it has trained no day yet."""
    if not is_stream_folder(path):
        return None
    days = done_days(path)
    if not days:
        fail(f"{path} is a --follow stream folder that has trained no day yet: {nothing}")
    return days


def refuse_stream_folder(path: Path, command: str) -> None:
    """Fail in one line (exit 2) when `path` is a `--follow` stream folder without a checkpoint of
    its own (each day is a run folder of its own): name the last trained day's run folder to give
    `command` instead (`done_days`; a damaged record is its one line); return for any other path."""
    path = Path(path)
    days = _trained_days(path, f"nothing to {command}")
    if days is None:
        return
    fail(f"{path} is a --follow stream folder: each day is a run of its own; {command} one of them, e.g. "
         f"{path / DAYS_DIR / days[-1]} (the last of its {len(days)} trained days)")


def refuse_stream_as_package(path: Path, command: str) -> None:
    """Fail in one line (exit 2) when `path`, given where a model package is read, is a `--follow`
    stream folder: name the last trained day's package (`--follow-export` writes RUN/export/<day>),
    else that day's run to export; return for any other path."""
    path = Path(path)
    days = _trained_days(path, f"no model to {command} with")
    if days is None:
        return
    package = path / EXPORT_DIR / days[-1]
    if os.path.lexists(package / "manifest.json"):
        fail(f"{path} is a --follow stream folder: each day's model package is under {path / EXPORT_DIR}; "
             f"{command} with one of them, e.g. {package} (the last of its {len(days)} trained days)")
    fail(f"{path} is a --follow stream folder and holds no model package (--follow-export writes each day's): "
         f"export a day's run first, e.g. flowrec export {path / DAYS_DIR / days[-1]} OUT/ (the last of its "
         f"{len(days)} trained days)")


def done_days(run: Path, order: DayOrder | None = None) -> list[str]:
    """The days the stream in `run` trained, in order (none yet: []); with `order`, fails when the
    stream was ordered otherwise (a stream written before orders were recorded went by name)."""
    return read_record(run, order).days


@dataclass(frozen=True)
class StreamRecord:
    """What a stream's follow.json records (`read_record`): the days it trained, in order, and
    whether it compares day names as text (`names_as_text`)."""

    days: list[str]
    names_as_text: bool
    order: str = "name"  # the order recorded: name or date:COLUMN


def read_record(run: Path, order: DayOrder | None = None) -> StreamRecord:
    """The record of the stream in `run`, read and checked once (none yet: no days); with `order`,
    fails when the stream was ordered otherwise (a stream written before orders were recorded went
    by name). Its names compare as text when it has trained days while day names compared as text
    (day10 before day2): its follow.json records no `names`. Such a stream keeps that order: in
    natural order a day it trained may come after one it has not."""
    from flowrec.spec.json_doc import read_json_document

    path = run / FOLLOW_FILE
    if not os.path.lexists(path):
        return StreamRecord([], False)
    try:  # the limits of every JSON flowrec reads: a regular file, bounded size and nesting
        doc = read_json_document(path)
        days, recorded = doc["days"], doc.get("order", "name")
    except (ValueError, KeyError, TypeError, AttributeError):
        fail(f"{path} is damaged (not a list of days); the day folders under {run / DAYS_DIR} are intact")
    if not isinstance(days, list) or not all(isinstance(d, str) and _plain_name(d) for d in days) \
            or len(set(days)) != len(days):  # a name with a path in it would lead the stream elsewhere
        fail(f"{path} is damaged (not a list of days); the day folders under {run / DAYS_DIR} are intact")
    try:
        valid_order = isinstance(recorded, str) and str(parse_order(recorded)) == recorded
    except ValueError:
        valid_order = False
    if not valid_order:  # the rerun command below must be one that works
        fail(f"{path} is damaged (its order {recorded!r:.60} is neither name nor date:COLUMN); the day "
             f"folders under {run / DAYS_DIR} are intact")
    if order is not None and days and recorded != str(order):
        fail(f"the stream in {run} takes its days in order {recorded!r}, not {str(order)!r}: "
             f"rerun with --follow-order {recorded}")
    return StreamRecord(days, bool(days) and doc.get("names") != "natural", recorded)


def _plain_name(name: str) -> bool:
    """A day's folder name: one path component, neither `.` nor `..`."""
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name
