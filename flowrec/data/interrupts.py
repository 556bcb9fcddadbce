"""Signal handlers installed for a block of work (main thread only: Python handles signals there
alone), and the signals that stop a command as Ctrl-C does. A low module: the data layer holds
Ctrl-C and these signals while it swaps an output folder (`flowrec.data.output_guard`), and the
runtime's stops (`flowrec.runtime.signals`, the trainer's) build on it.

Example:
    >>> import signal
    >>> with handlers_installed({signal.SIGTERM: signal.SIG_IGN}):
    ...     signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    True
"""
from __future__ import annotations

import contextlib
import signal
import threading
from typing import Any, Iterator


def stop_signals() -> tuple[int, ...]:
    """The signals that stop a command as Ctrl-C does: SIGTERM (`kill`, `timeout`, schedulers) and
    SIGHUP (a terminal closed, an ssh connection dropped), whose default ended the process without
    a word or any cleanup. SIGHUP is left out while it is ignored (`nohup` starts the command so: it
    keeps ignoring it)."""
    hangup = getattr(signal, "SIGHUP", None)  # not on Windows
    if hangup is None or signal.getsignal(hangup) is signal.SIG_IGN:
        return (signal.SIGTERM,)
    return (signal.SIGTERM, hangup)


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
