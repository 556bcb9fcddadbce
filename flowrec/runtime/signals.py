"""Signals that stop a run: SIGTERM (what `kill`, `timeout`, schedulers and torch's launcher send)
and SIGHUP (a terminal closed, an ssh connection dropped; unless ignored, as under `nohup`) raised
as Ctrl-C is, and the handlers installed for a block of work (main thread only: Python handles
signals there alone).

Example:
    >>> interrupt_name(Terminated()), interrupt_name(Terminated("SIGHUP")), interrupt_name(KeyboardInterrupt())
    ('SIGTERM', 'SIGHUP', 'Ctrl-C')
"""
from __future__ import annotations

import contextlib
import signal
from typing import Any

from flowrec.data.interrupts import handlers_installed, stop_signals


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `kill`, `timeout` and schedulers send) or SIGHUP (a closed terminal) outside the
    training loop, which has its own handler: stopped as Ctrl-C stops it (the start-up's one line,
    the folder left as found), instead of Python's default, which ended the process without a word
    or any cleanup. `name`: the signal's."""

    def __init__(self, name: str = "SIGTERM") -> None:
        super().__init__(name)
        self.name = name


def interrupt_name(exc: BaseException) -> str:
    """How a stop's line names what stopped it: its signal (`Terminated`: SIGTERM, SIGHUP) or Ctrl-C,
    and whose code it stopped where that was a custom module class's (`operators.custom_code.UserCodeInterrupted`:
    'Ctrl-C while importing the custom module class blocks.py:X')."""
    running = getattr(exc, "running", None)
    if isinstance(running, str) and exc.__cause__ is not None:
        return f"{interrupt_name(exc.__cause__)} while {running}"
    return exc.name if isinstance(exc, Terminated) else "Ctrl-C"


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated(signal.Signals(signum).name)


def terminated_as_interrupted() -> contextlib.AbstractContextManager[None]:
    """Within: SIGTERM and SIGHUP (not where ignored: `nohup`) raise `Terminated`, a
    KeyboardInterrupt (main thread only)."""
    return handlers_installed({sig: _raise_terminated for sig in stop_signals()})
