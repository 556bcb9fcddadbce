"""The data threads yield the cores to the training step: idle priority, raised while it waits.

The data stage's threads (the batch iterator's reader, packing workers and lookahead thread, the
Parquet source's readers) run beside the step. On a machine with few cores they take a core from
the step's parallel regions at moments nothing chooses: a region waits for its slowest thread, so
a data thread woken on a core the step was using stalls the whole region. Measured on the 2-core
machine (DLRM, bf16, `flowrec train`'s step over 60 steps, three alternating runs each in one
process): 55.6-60.7 ms at the median with the data threads at normal priority, 47.3-50.8 ms at
idle priority (Linux `SCHED_IDLE`: a thread that runs only on a core nothing else wants); nice
19 was not better than normal (51.0-60.8 ms), since a niced thread still preempts.

Idle threads starve when every core is busy, so whenever a consumer waits for a batch
(`waiting`), every live data thread is raised to normal priority until the batch arrives: the
stage can never be slower than at normal priority because of this, only the step faster. A
process may lower a thread to idle priority but may raise it again only with the right to (root,
CAP_SYS_NICE, or an RLIMIT_NICE that allows nice 0); without it, the data threads stay at normal
priority, as before. `FLOWREC_DATA_PRIORITY=normal` keeps them there anyway; the default is
`idle` (where it can be undone). Linux only; elsewhere nothing changes.

Example:
    >>> enter_data_thread()  # first thing in a data thread  # doctest: +SKIP
    >>> with waiting():  # around a consumer's blocking get  # doctest: +SKIP
    ...     item = q.get()
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from typing import Callable, Iterator, TypeVar

T = TypeVar("T")

ENV = "FLOWREC_DATA_PRIORITY"
MODES = ("idle", "normal")

_lock = threading.Lock()
_threads: dict[threading.Thread, int] = {}  # live data threads -> native thread id
_waiters = 0  # consumers waiting for a batch now (threads raised while > 0)
_usable: bool | None = None  # whether idle priority can be set and undone here (probed once)


def _policy(tid: int, idle: bool) -> None:
    """Set thread `tid`'s scheduling policy (0: the calling thread)."""
    os.sched_setscheduler(tid, os.SCHED_IDLE if idle else os.SCHED_OTHER, os.sched_param(0))


def _probe() -> bool:
    """Whether a thread of this process can go to idle priority and back (a throwaway thread)."""
    if not (hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE")):
        return False
    result: list[bool] = []

    def probe() -> None:
        try:
            _policy(0, True)
            _policy(0, False)
            result.append(True)
        except OSError:
            result.append(False)

    thread = threading.Thread(target=probe, name="flowrec-priority-probe", daemon=True)
    thread.start()
    thread.join()
    return bool(result and result[0])


def mode() -> str:
    """The asked mode: FLOWREC_DATA_PRIORITY, `idle` when unset."""
    value = os.environ.get(ENV, "idle").strip().lower() or "idle"
    if value not in MODES:
        from flowrec.data.layout import DataError

        raise DataError(f"{ENV}={value!r} is not a data-thread priority: use one of {', '.join(MODES)} "
                        f"(or leave it unset: idle)")
    return value


def enabled() -> bool:
    """Whether data threads run at idle priority in this process (asked and possible)."""
    global _usable
    if mode() != "idle":
        return False
    if _usable is None:
        _usable = _probe()
    return _usable


def enter_data_thread() -> None:
    """Called first in a data thread: registers it, and at idle priority unless a consumer waits.
    Never raises (a bad FLOWREC_DATA_PRIORITY is reported by `enabled` where the stage is made)."""
    try:
        if not enabled():
            return
    except Exception:  # noqa: BLE001  (DataError: reported where the stage is made)
        return
    thread = threading.current_thread()
    with _lock:
        _threads[thread] = threading.get_native_id()
        if _waiters == 0:
            _set(_threads[thread], True, thread)


def _set(tid: int, idle: bool, thread: threading.Thread) -> None:
    """One thread's policy; a thread gone meanwhile is forgotten (under `_lock`)."""
    try:
        _policy(tid, idle)
    except (ProcessLookupError, PermissionError):
        _threads.pop(thread, None)


def _all(idle: bool) -> None:
    for thread, tid in list(_threads.items()):
        if thread.is_alive():
            _set(tid, idle, thread)
        else:
            _threads.pop(thread, None)


@contextmanager
def waiting() -> Iterator[None]:
    """Around a consumer's wait for a batch: every data thread at normal priority meanwhile."""
    global _waiters
    with _lock:
        _waiters += 1
        if _waiters == 1:
            _all(False)
    try:
        yield
    finally:
        with _lock:
            _waiters -= 1
            if _waiters == 0:
                _all(True)


def wait_for(fetch: Callable[[], T], ready: bool) -> T:
    """`fetch()`, inside `waiting()` unless `ready` (what it fetches is there: no wait, no raise)."""
    if ready:
        return fetch()
    with waiting():
        return fetch()


def data_threads() -> dict[str, int]:
    """Live registered data threads: name -> native id (for tests and reports)."""
    with _lock:
        return {t.name: tid for t, tid in _threads.items() if t.is_alive()}
