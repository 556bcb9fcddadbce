"""pyarrow's streaming CSV readers released before the interpreter's teardown, for library users.

pyarrow's streaming CSV reader keeps the Python invalid-row handler it is given
(`flowrec.data.sources.csv_chunks`'s) in its C++ state. Its readahead reads run on Arrow's IO
threads, and the last reference to that state can be a read still in flight when Python drops
the reader: the IO thread then frees the state, and the handler with it, which takes the GIL.
When that happens while the interpreter finalizes (a script or a notebook kernel that read a CSV
through `flowrec.data` and ends), the thread cannot take the GIL; CPython ends it with
`pthread_exit`, whose unwind through Arrow's C++ frames calls `std::terminate`, and the process
aborts (exit 134) after its work is done. Reproduced with torch loaded: 8 in 60 runs of
`open_csv(..., invalid_row_handler=h).read_all()` then exit; gdb shows an IO thread in
`PyGILState_Ensure` from `StreamingReaderImpl`'s disposal while the main thread is in
`Py_FinalizeEx`.

So every reader lives in a `ReaderSlot`, and the handler Arrow holds is a `TrackedHandler` that
nothing in Python references (the caller passes it straight into `ParseOptions` given straight to
`open_csv`): it dies exactly when Arrow has released the reader, which a weak set here sees. An
`atexit` hook, which runs before the finalization while other threads may still take the GIL,
drops the readers still open (a generator left suspended) and waits, sleeping so the IO threads
get the GIL, until every handler is released (at most `EXIT_WAIT_S`; in practice a read of one
block, milliseconds). The command line never waits: it ends without the teardown
(`flowrec.cli.main`, `flowrec.cli.common.exit_without_teardown`), so no atexit hook runs there.

Example:
    >>> slot = open_slot()
    >>> handler = tracked(lambda row: "skip")
    >>> handler(None), release_readers(wait_s=0.01)
    ('skip', False)
    >>> del handler
    >>> release_readers(wait_s=1.0)
    True
"""
from __future__ import annotations

import atexit
import threading
import time
import weakref
from typing import Any, Callable

EXIT_WAIT_S = 10.0  # s: the longest wait at exit for Arrow's IO threads to release the readers
POLL_S = 0.001  # s: sleep between looks (the GIL is free meanwhile)

_HANDLERS: "weakref.WeakSet[TrackedHandler]" = weakref.WeakSet()  # handlers Arrow may still hold
_SLOTS: "weakref.WeakSet[ReaderSlot]" = weakref.WeakSet()  # readers not yet finished
_HOOK = threading.Lock()
_HOOKED: list[bool] = [False]


class TrackedHandler:
    """A row handler for pyarrow's `ParseOptions` whose life this module follows.

    Args:
        handler: the function called with each invalid row (returns "skip" or "error").
    """

    def __init__(self, handler: Callable[[Any], str]) -> None:
        self.handler = handler

    def __call__(self, row: Any) -> str:
        return self.handler(row)


class ReaderSlot:
    """Holds one streaming reader (`reader`, None once finished), so the exit hook can drop it."""

    def __init__(self) -> None:
        self.reader: Any = None


def tracked(handler: Callable[[Any], str]) -> TrackedHandler:
    """`handler` wrapped for Arrow and followed until Arrow releases it; hand it to Arrow only
    (keep no reference, nor to the `ParseOptions` holding it), or the exit hook waits for it."""
    _hook()
    wrapped = TrackedHandler(handler)
    _HANDLERS.add(wrapped)
    return wrapped


def open_slot() -> ReaderSlot:
    """A new, empty reader slot the exit hook will empty if it is still open then."""
    _hook()
    slot = ReaderSlot()
    _SLOTS.add(slot)
    return slot


def release_readers(wait_s: float = EXIT_WAIT_S) -> bool:
    """Drop every reader still in a slot, then wait (GIL released) until Arrow has released every
    tracked handler, for at most `wait_s` seconds.

    Returns:
        True when every handler was released.
    """
    for slot in list(_SLOTS):
        slot.reader = None
    deadline = time.monotonic() + wait_s
    while len(_HANDLERS) and time.monotonic() < deadline:
        time.sleep(POLL_S)
    return not len(_HANDLERS)


def readers_opened() -> bool:
    """Whether this process opened a reader here (a slot or a tracked handler): Arrow's IO threads
    may hold a Python handler of it until the exit hook has run."""
    return _HOOKED[0]


def _hook() -> None:
    """Register the exit hook once, at the first reader."""
    with _HOOK:
        if not _HOOKED[0]:
            atexit.register(release_readers)
            _HOOKED[0] = True
