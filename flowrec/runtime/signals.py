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
import threading
from typing import Any, Iterator


class Terminated(KeyboardInterrupt):
    """SIGTERM (what `kill`, `timeout` and schedulers send) outside the training loop, which has its
    own handler: stopped as Ctrl-C stops it (the start-up's one line, the folder left as found),
    instead of Python's default, which ended the process without a word or any cleanup."""


def interrupt_name(exc: BaseException) -> str:
    """How a stop's line names what stopped it: SIGTERM (`Terminated`) or Ctrl-C."""
    return "SIGTERM" if isinstance(exc, Terminated) else "Ctrl-C"


@contextlib.contextmanager
def handlers_installed(handlers: dict[int, Any]) -> Iterator[None]:
    """Within: these signal handlers, the previous ones restored after. In a thread other than the
    main one nothing changes (only the main thread may install handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {sig: signal.signal(sig, handler) for sig, handler in handlers.items()}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _raise_terminated(signum: int, frame: Any) -> None:
    raise Terminated


def terminated_as_interrupted() -> contextlib.AbstractContextManager[None]:
    """Within: SIGTERM raises `Terminated`, a KeyboardInterrupt (main thread only)."""
    return handlers_installed({signal.SIGTERM: _raise_terminated})
