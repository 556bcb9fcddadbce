"""A `--follow` stream folder on disk: its record of the days it trained (`follow.json`) and their
run folders (`days/<day>`). `flowrec.cli.follow` writes and checks them; a command given a run
folder (`export`) uses this module to point a user who gave it the stream folder at its days.

Example:
    >>> refuse_stream_folder(Path("runs/ml"), "export")  # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path

from flowrec.cli.common import fail

FOLLOW_FILE = "follow.json"
DAYS_DIR = "days"


def refuse_stream_folder(path: Path, command: str) -> None:
    """Fail in one line (exit 2) when `path` is a `--follow` stream folder without a checkpoint of
    its own (each day is a run folder of its own): name the last trained day's run folder to give
    `command` instead; return for any other path."""
    from flowrec.spec.json_doc import read_json_document

    path = Path(path)
    if not path.is_dir() or not os.path.lexists(path / FOLLOW_FILE) or os.path.lexists(path / "checkpoint.pt"):
        return
    try:
        days = read_json_document(path / FOLLOW_FILE)["days"]
        last = str(days[-1]) if days else None
    except (ValueError, KeyError, TypeError, IndexError, AttributeError):
        fail(f"{path} is a --follow stream folder: each day is a run of its own; {command} one of the run "
             f"folders under {path / DAYS_DIR}")
    if last is None:
        fail(f"{path} is a --follow stream folder that has trained no day yet: nothing to {command}")
    fail(f"{path} is a --follow stream folder: each day is a run of its own; {command} one of them, e.g. "
         f"{path / DAYS_DIR / Path(last).name} (the last of its {len(days)} trained days)")
