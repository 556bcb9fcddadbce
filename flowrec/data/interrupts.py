"""Signal handlers installed for a block of work (main thread only: Python handles signals there
alone). A low module: the data layer holds Ctrl-C and SIGTERM while it swaps an output folder
(`flowrec.data.output_guard`), and the runtime's stops (`flowrec.runtime.signals`) build on it.

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
