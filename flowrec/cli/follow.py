"""`flowrec train SPEC --follow DAYS --out RUN`: continuous training on a stream of day partitions.

Each day is an encoded dataset folder under DAYS (one with ``_flowrec.json``: a conversion
renames it into place only when complete), taken in order of name (day2 before day10), or with `--follow-order
date:COLUMN` by the first date of COLUMN that conversion recorded for it (`flowrec.data.days`).
For each day not trained yet:
the model of the previous day is first scored on it (progressive validation: metrics on data it
has not seen, one ``{"event": "progressive", "step": <day number>, "day", "metrics"}`` line in
RUN/metrics.jsonl, and TensorBoard scalars ``progressive/<head>/<metric>``), then
it trains into RUN/days/<day>/ from the previous day's run (`--init-from`: tables, optimizer
state, managed maps and encoder carry over), which checkpoints as any run. RUN/follow.json lists
the days done and their order, written after each; a day already listed is never trained again, a
day that lands before the last day trained is refused, and so is another order than the stream's, and a day whose
folder holds a checkpoint but is not listed (a crash) is resumed (`--resume`: bitwise equal to an
uninterrupted run). With `--follow-export` each day's model package is written to
RUN/export/<day>/ before the day is recorded. With `--follow-wait S` it waits up to S seconds for
a new day to land before it stops; `--follow-once` trains at most one new day.

Example:
    $ flowrec train spec.yaml --follow days/ --out runs/stream --follow-wait 3600
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

from flowrec.cli.common import fail, say, warn
from flowrec.cli.streams import DAYS_DIR, EXPORT_DIR, FOLLOW_FILE, StreamRecord, done_days, read_record
from flowrec.data.days import DayOrder, day_partitions, landed as named_days, listing, skipped_entries, skipped_line
from flowrec.data.layout import META_FILE, DataError
from flowrec.runs.errors import EXIT_INTERRUPTED
from flowrec.runtime.messages import shell_word
from flowrec.runtime.rundir import RunFolderError, RunLock, folder_state
from flowrec.runtime.signals import interrupt_name

LOCK_FILE = ".follow.lock"  # held by the one --follow process of a stream folder
POLL_S = 1.0  # seconds between looks for a new day


def landed_days(days: Path, order: DayOrder, done: list[str], entries: list[Path] | None = None
                ) -> tuple[list[Path], str | None]:
    """Day partitions under `days` that are complete datasets, in `order`; or ([], why) when they
    cannot be ordered by date while a day not trained yet (not in `done`) has landed: a day copied in
    (cp -r, rsync) whose _flowrec_stats.json or part files have not all arrived has no date yet (the
    loop waits for it within --follow-wait, as for a day whose rows are not all there). `entries`:
    this look's listing of `days` (`_listing`; None: listed here)."""
    try:
        return day_partitions(days, order, entries), None
    except DataError as exc:
        if order.column is not None and _new_days(days, done, entries):
            return [], str(exc)
        fail(f"--follow: {exc}")


def _new_days(days: Path, done: list[str], entries: list[Path] | None = None) -> bool:
    """Whether a day partition not in `done` has landed under `days` (in any order)."""
    try:
        return any(day.name not in done for day in named_days(days, None, entries))
    except DataError:
        return False


def _listing(days: Path) -> list[Path] | None:
    """The entries of `days` for one look (the days that landed and the entries skipped are told from
    this one listing: it was listed two times a look), or None where it cannot be listed (not a folder,
    gone: `landed` names why)."""
    try:
        return listing(days) if days.is_dir() else None
    except OSError:
        return None


def _record(run: Path, days: list[str], order: DayOrder) -> None:
    from flowrec.runtime.rundir import write_text

    names = "text" if order.text else "natural"  # how names compare (a stream started before natural order: text)
    write_text(run / FOLLOW_FILE, json.dumps({"days": days, "order": str(order), "names": names}, indent=2) + "\n")


def follow(request, days: Path, wait_s: float, once: bool, train: Callable, export: bool = False,
           order: DayOrder = DayOrder()) -> None:
    """Train each new day of `days` into `request.out` (see the module docstring).

    Args:
        request: the `RunRequest` of the command (its out folder is the stream's folder).
        days: the folder the day partitions land in.
        wait_s: seconds to wait for a new day before stopping.
        once: train at most one new day.
        train: `run_training`, called with one request per day.
        export: after each day, also write its model package to RUN/export/<day>/.
        order: how the day partitions are ordered (by name or a date column).
    """
    run = request.out
    if run is None:
        fail("--follow needs --out (the stream's folder)")
    _check_stream_folder(run)
    found = folder_state(run, LOCK_FILE)
    try:
        run.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        fail(f"cannot create the stream folder {run}: {exc.strerror or exc}")
    try:  # a second --follow on the same --out is refused, naming the first's pid
        lock = RunLock.acquire(run, LOCK_FILE, "the stream folder", "flowrec train --follow")
    except RunFolderError as exc:
        fail(str(exc))
    command = stream_command(request.spec_path, days, run, export, order)
    try:
        _follow_days(request, run, days, wait_s, once, train, export, order, command)
    except KeyboardInterrupt as exc:  # waiting for a day, scoring, exporting or starting one (a day's training says its own)
        fail(f"interrupted ({interrupt_name(exc)}); the stream in {run} has trained {len(done_days(run))} day(s); "
             f"continue with  {command}", EXIT_INTERRUPTED)
    finally:
        lock.release_as_found(found)  # refused: leave no folder


def stream_command(spec_path: Path, days: Path, run: Path, export: bool, order: DayOrder) -> str:
    """The command that continues the stream: the same --follow command (a day cut short is resumed
    by it, then recorded in follow.json; `--resume RUN/days/<day>` alone would train that day and
    leave the stream's record without it)."""
    return (f"flowrec train {shell_word(str(spec_path))} --follow {shell_word(str(days))} "
            f"--out {shell_word(str(run))}{'' if order.column is None else ' --follow-order ' + shell_word(str(order))}"
            f"{' --follow-export' if export else ''} (the stream's command, with the options it was given)")


def _check_stream_folder(run: Path) -> None:
    """The stream's folder is no folder flowrec owns for something else (a run, a dataset, a
    package, an encoder) and lies in none: its metrics.jsonl and follow.json would land among
    their files."""
    from flowrec.data.output_guard import owning_folder

    if run.exists() and not run.is_dir():
        fail(f"--out {run} is a file; give the stream's folder")
    owned = owning_folder(run)
    if owned is not None:
        fail(f"refusing to use {run} as the stream's folder: "
             f"{'it is' if owned[0] == run.resolve() else 'it lies in ' + str(owned[0]) + ','} "
             f"{owned[1]}'s folder; give a folder of its own")
    foreign = _foreign_entries(run)
    if foreign:  # the stream would cut back a metrics.jsonl of theirs, write among their files
        fail(f"--out {run} is not empty and is not a --follow stream's folder (it holds "
             f"{', '.join(foreign[:3])}{', ...' if len(foreign) > 3 else ''}); give an empty or new folder")


def _foreign_entries(run: Path) -> list[str]:
    """Names in `run` that make it no stream's folder: a folder holding follow.json or days/ is one
    (a stream killed before its first day was recorded holds days/); any other folder may hold
    only the lock and temp files."""
    from flowrec.runtime.atomic import TEMP_PREFIX, TEMP_SUFFIX

    if not run.is_dir() or os.path.lexists(run / FOLLOW_FILE) or (run / DAYS_DIR).is_dir():
        return []
    return sorted(p.name for p in run.iterdir()
                  if p.name != LOCK_FILE and not (p.name.startswith(TEMP_PREFIX) and p.name.endswith(TEMP_SUFFIX)))


def _follow_days(request, run: Path, days: Path, wait_s: float, once: bool, train: Callable, export: bool,
                 order: DayOrder, command: str) -> None:
    """The loop of `follow`, with the stream folder locked."""
    deadline = time.monotonic() + wait_s
    trained = 0
    waiting_on = None  # the day a wait for its files was announced for
    record = read_record(run, order)  # a damaged record, or another order, is refused first
    order = _names_order(run, record, days, order)
    done = record.days  # the lock keeps every other writer out: the record changes only below
    told: set[str] = set()  # entries skipped (no day partition) that a warning named
    while True:
        entries = _listing(days)
        landed, undated = landed_days(days, order, done, entries)
        _tell_skipped(days, told, entries)
        if undated is not None:  # a day still being copied in cannot be dated yet
            if time.monotonic() < deadline:
                if waiting_on != undated:
                    say(f"waiting for the days under {days} to be complete to order them by {order.column} "
                        f"({undated})", err=True)
                    waiting_on = undated
                time.sleep(POLL_S)
                continue
            fail(f"--follow: {undated}")
        todo = [d for d in landed if d.name not in done]
        if not todo:
            if time.monotonic() >= deadline:
                if not trained:  # a mistyped DAYS (raw files, an empty folder) says so
                    say(f"no new day partition under {days} (encoded dataset folders with "
                        f"{META_FILE}); {len(done)} day(s) trained in {run} so far", err=True)
                return
            time.sleep(POLL_S)
            continue
        day = todo[0]
        if done and _before(day, done[-1], landed, order):
            fail(f"day {day.name} landed after day {done[-1]} was trained; days train in order "
                 f"{'of name' if order.column is None else 'of column ' + repr(order.column)}")
        begun = _begun(run, todo)
        if begun is not None and begun != day.name:  # its checkpoint trained from another day than the one before
            fail(f"day {day.name} landed before day {begun}, whose training in {run / DAYS_DIR / begun} is under "
                 f"way; days train in order {'of name' if order.column is None else 'of column ' + repr(order.column)}: "
                 f"move day {day.name} out of {days}, or remove {run / DAYS_DIR / begun} to train it again after it")
        why = _unready(day)
        if why is not None:  # a day copied in (cp -r, rsync) whose _flowrec.json came before its data
            if time.monotonic() < deadline:
                if waiting_on != day.name:
                    say(f"waiting for day {day.name} to be complete ({why})", err=True)
                    waiting_on = day.name
                time.sleep(POLL_S)
                continue
            fail(f"day {day.name} is not complete: {why} (still being copied in? copy a day under another "
                 f"name and rename it into place, or give --follow-wait S to wait for it)")
        waiting_on = None
        previous = run / DAYS_DIR / done[-1] if done else None
        if previous is not None:
            _progressive(run, previous, day, len(done) + 1)
        train(_day_request(request, run / DAYS_DIR / day.name, day, previous, command))
        trained += 1
        if export:
            _export(run / DAYS_DIR / day.name, run / EXPORT_DIR / day.name)
        done = done + [day.name]
        _record(run, done, order)
        deadline = time.monotonic() + wait_s
        if once:
            return


def _tell_skipped(days: Path, told: set[str], entries: list[Path] | None) -> None:
    """One warning line naming the entries under `days` (`entries`: this look's listing) that are no
    day partition (an empty folder, one without _flowrec.json, still being written or never converted,
    a link to nothing or a loop, a file) that no line named yet (`told`, updated): each once per
    stream process, not once per look for a new day."""
    if entries is None:  # the folder went away between looks: the next look names that
        return
    try:
        new = {name: why for name, why in skipped_entries(days, entries).items() if name not in told}
    except OSError:
        return
    if new:
        warn(skipped_line(days, new))
        told.update(new)


def _begun(run: Path, todo: list[Path]) -> str | None:
    """The day not recorded yet whose run folder holds a checkpoint (a crash cut its training short;
    the next day to train), or None."""
    return next((d.name for d in todo if (run / DAYS_DIR / d.name / "checkpoint.pt").is_file()), None)


def _names_order(run: Path, record: StreamRecord, days: Path, order: DayOrder) -> DayOrder:
    """The order of the stream in `run` (`record`: its follow.json): names compared as text for a
    stream that began while they were (its follow.json records no `names`, or it recorded no day
    yet while the day it began is first in text order only), naturally otherwise."""
    text = replace(order, text=True)
    if record.names_as_text:
        return text
    if not record.days:  # killed in its first day: the day begun decides
        try:
            landed = day_partitions(days, order)
        except DataError:
            return order  # the loop names the problem
        begun = _begun(run, landed)
        if begun is not None and landed[0].name != begun and day_partitions(days, text)[0].name == begun:
            return text
    return order


def _unready(day: Path) -> str | None:
    """Why the landed `day` cannot be read yet, or None: its metadata, a part file or a vocabulary
    file (`_vocab/`, which training reads with the parts) is not readable, its part files hold
    another row count than its _flowrec.json records, or a vocabulary file is not the one it records
    (a day whose copy is still under way looks so, as does a damaged one)."""
    from flowrec.data.dataset import dataset_layout, parquet_files
    from flowrec.data.encoder_record import check_vocabularies, record_of_dataset
    from flowrec.data.layout import read_meta

    try:
        meta = read_meta(day)
        dataset_layout(day, meta, parquet_files(day))
        check_vocabularies(record_of_dataset(day, meta))
    except DataError as exc:
        return str(exc)
    return None


def _before(day: Path, last: str, landed: list[Path], order: DayOrder) -> bool:
    """True when `day` comes before the day trained last (by name; by date while that day is still
    among the landed ones, which `day_partitions` sorted by the same key: no day is dated again)."""
    if order.column is None:
        return order.name_key(day.name) < order.name_key(last)
    names = [d.name for d in landed]
    return last in names and names.index(day.name) < names.index(last)


def _day_request(request, folder: Path, day: Path, previous: Path | None, command: str):
    """The run request of one day: resume its folder after a crash, else start it from the previous
    day; an interrupted day names the stream's `command` to continue with."""
    given = {**request.given, "data": str(day)}
    if previous is not None:  # a day from the day before trains its plan: the flags that make one made day 1's
        from flowrec.runs.settings import PLAN_FLAGS

        given.update({key: None for key, _ in PLAN_FLAGS})
    if (folder / "checkpoint.pt").is_file():
        return replace(request, out=None, resume=folder, overwrite=False, given=given, init_from=None,
                       continue_command=command, json_lines=True)
    return replace(request, out=folder, resume=None, overwrite=True, given=given, init_from=previous,
                   continue_command=command, json_lines=True)


def _export(day_run: Path, out: Path) -> None:
    """The day's model package (replacing one a crash left before the day was recorded)."""
    from flowrec.cli.export_cmd import export_package

    out.parent.mkdir(exist_ok=True)
    export_package(day_run, out, dtype="fp32", overwrite=True, quiet=True, index="auto",
                   interrupts_raised=True)  # an interrupt ends in the stream's line, naming its command


def _progressive(run: Path, previous: Path, day: Path, number: int) -> None:
    """Score the previous day's model on `day` (the stream's day `number`, 1-based) before training
    on it: one line in metrics.jsonl (step = `number`, kept once after a crash) and TensorBoard
    scalars `progressive/<head>/<metric>`; a warning line per hashed or managed feature whose ids
    the day writes in another form than the model's training rows (`flowrec.data.id_forms`), once
    per day, also where its training is resumed after a crash (which compares no forms)."""
    from flowrec.data.layout import DataError
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.checkpoint.store import CheckpointError
    from flowrec.runtime.run_log import MetricsError, MetricsLog
    from flowrec.serving.trained import load_trained

    lines: list[str] = []  # the day's ids written in another form than the stream's training rows: scored as unseen
    try:
        metrics = load_trained(previous, "cpu", scoring_plan).evaluate_dataset(day, warn=lines.append)
        log = MetricsLog(run / "metrics.jsonl", keep_through_step=number - 1)
    except (CheckpointError, DataError, MetricsError) as exc:
        fail(str(exc))
    for line in lines:
        warn(line)
    try:
        log.write({"event": "progressive", "step": number, "day": day.name, "model": previous.name,
                   "metrics": metrics})
        log.scalars(number, {f"progressive/{head}/{name}": value for head, values in metrics.items()
                             for name, value in values.items() if name != "samples"})
    finally:
        log.close()
