"""What a rank of a launch that stops with its one line (`flowrec.cli.common.fail`) tells torch's
launcher (its error file) and the other ranks (the rendezvous store), and how the launcher reads it
back (`flowrec.cli.ranks.first_failure`), and what rank 0 leaves for the launcher of `--nproc N` to
say when a signal stops the launch (`note_for_launcher`).

Example:
    >>> report_of(object())
    {}
"""
from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from flowrec.runs.errors import EXIT_INTERRUPTED, EXIT_RANK_FAILED
from flowrec.runs.launch import LAUNCH_NOTE_ENV  # a file of the launch: rank 0's `note_for_launcher`


def report_stop(line: str, status: int, follows: bool) -> None:
    """What a rank that stops with its one line (`fail`) tells the others and torch's launcher.

    The launcher learns of an error of this rank's own from the rank's error file
    (TORCHELASTIC_ERROR_FILE, which torch's launcher sets for each rank and reads when the rank
    fails): its line, status and time, so that `first_failure` names the rank whose own error
    started it, with its line, not a rank that failed a collective a moment later. A rank that
    only follows another's stop (`follows`; a lost rank's status 4 and an interrupt's 130 always
    do: the launcher's SIGTERM to the ranks left after one was killed) writes none: the launcher
    stamps it when it sees it exit, as the rank that was killed beside it (the time it stopped, a
    second before that poll, named it first). The other ranks learn of an error of its own from
    the rendezvous store (`record_stop`): the one that loses this rank then stops as it does.
    Best effort: a file that cannot be written is left out."""
    if follows or status in (0, EXIT_RANK_FAILED, EXIT_INTERRUPTED):
        return
    rank = os.environ.get("RANK", "")
    if "torch.distributed" in sys.modules and rank.isdigit():
        from flowrec.runtime.distributed.world import record_stop

        record_stop(int(rank), status)
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    now = time.time()
    report = {"message": line, "timestamp": int(now), REPORT_KEY: {"line": line, "status": status, "time": now}}
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report))
    except OSError:
        pass


REPORT_KEY = "flowrec"  # a rank's own record in its error file (`report_stop`)


def report_of(failure: Any) -> dict:
    """A failed rank's record of an error of its own (`report_stop`), or {} (it wrote none: it
    followed another rank, or a signal or a traceback ended it)."""
    data = getattr(failure, "error_file_data", None)
    record = data.get(REPORT_KEY) if isinstance(data, dict) else None
    return record if isinstance(record, dict) else {}




def note_for_launcher(line: str | None) -> None:
    """What the launcher of `flowrec train --nproc N` says when a signal stops the launch from now
    on, as rank 0 sets it (other ranks, and processes outside such a launch, write nothing).

    None (no note: the ranks have not started training): the launcher's own line, that nothing was
    trained. "": rank 0 says the line itself (its run folder's resume command is out; its
    interrupt line says where it stopped and what was kept). A line: the run is whole and rank 0's
    closing lines are out; the launcher says this one (`interrupted after the run finished: ...`)
    where a signal came too late for any rank to say it. Best effort, replaced atomically."""
    path = os.environ.get(LAUNCH_NOTE_ENV)
    if not path or os.environ.get("RANK") != "0":
        return
    try:
        if line is None:
            Path(path).unlink(missing_ok=True)
            return
        part = Path(f"{path}.part")
        part.write_text(line)
        os.replace(part, path)
    except OSError:
        pass


def launcher_note(path: Path) -> str | None:
    """The note rank 0 left at `path` (`note_for_launcher`), or None."""
    try:
        return path.read_text()
    except OSError:
        return None
