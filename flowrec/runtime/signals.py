"""Signals that stop a run: SIGTERM (what `kill`, `timeout`, schedulers and torch's launcher send)
raised as Ctrl-C is, and the handlers installed for a block of work (main thread only: Python
handles signals there alone).

Example:
    >>> interrupt_name(Terminated()), interrupt_name(KeyboardInterrupt())
    ('SIGTERM', 'Ctrl-C')
"""
from __future__ import annotations

import contextlib
import signal
from typing import Any

from flowrec.data.interrupts import handlers_installed


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `kill`, `timeout` and schedulers send) outside the training loop, which has its
    own handler: stopped as Ctrl-C stops it (the start-up's one line, the folder left as found),
    instead of Python's default, which ended the process without a word or any cleanup."""


def interrupt_name(exc: BaseException) -> str:
    """How a stop's line names what stopped it: SIGTERM (`Terminated`) or Ctrl-C."""
    return "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def terminated_as_interrupted() -> contextlib.AbstractContextManager[None]:
    """Within: SIGTERM raises `Terminated`, a KeyboardInterrupt (main thread only)."""
    return handlers_installed({signal.SIGTERM: _raise_terminated})
