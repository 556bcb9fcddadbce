"""Timing on a shared machine: what a piece of work takes when other processes do not take the
cores from it.

Every calibration measurement (`flowrec calibrate`) and the benchmark's measured steps
(`tools/bench_costmodel.py`) are timed in rounds. A round records its wall time and the time the
process's compute threads spent runnable but waiting for a core (the kernel's run-queue wait,
`/proc/self/task/*/schedstat`), less the CPU time the process's own other threads (the data
threads of a training run, `exclude`) ran meanwhile: that part is the process competing with
itself, which a training step really pays. What is left is the time other processes took.

The rule (`estimate`):

* a round is *clean* when that foreign wait is at most `CLEAN_SHARE` of its wall time; the
  estimate is the median wall time of the clean rounds when there are at least `MIN_CLEAN`;
* otherwise (a busy machine: every round waited) the wall time is extrapolated to no wait:
  least squares of wall = a + s x wait over the rounds, s kept within [1 / threads, 1] (a
  parallel region stalls for the whole wait of one descheduled thread; waits of threads
  descheduled together count once each), a bounded by the rounds' fastest wall and by their
  wall less their whole wait.

Process or thread CPU time is not the measure: a thread of a parallel region spins at its barrier
while its partner waits for a core, so CPU time grows with the load as wall time does (measured
here: 20 GEMMs of 512^3 took 70-330 ms of process CPU at load 2.5 for ~56 ms of work).
Without schedstat (not Linux) every round counts as clean: the median round.

Example:
    >>> estimate([Round(1e-3, 0.0), Round(1.2e-3, 0.0), Round(1.1e-3, 0.0), Round(9e-3, 8e-3)]).seconds
    0.0011
"""
from __future__ import annotations

import os
import statistics
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

CLEAN_SHARE = 0.05  # foreign run-queue wait a clean round may have, share of its wall time
MIN_CLEAN = 3  # clean rounds the median needs; fewer: extrapolated to no wait
TASKS = "/proc/self/task"


@dataclass(frozen=True)
class Round:
    """One timed round, per call: wall seconds and the foreign run-queue wait in it (seconds)."""

    wall: float
    waited: float = 0.0


@dataclass(frozen=True)
class Estimate:
    """A measurement's estimate and how it was reached."""

    seconds: float
    rounds: int
    clean: int
    method: str  # "clean": median of clean rounds; "extrapolated": to no wait

    @property
    def rejected(self) -> int:
        return self.rounds - self.clean


def _schedstat() -> dict[int, tuple[int, int]]:
    """{thread id: (ns on a core, ns waiting for one)} of this process's threads ({} without schedstat)."""
    out = {}
    try:
        tids = os.listdir(TASKS)
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"{TASKS}/{tid}/schedstat", "rb") as f:
                on_cpu, waited = f.read().split()[:2]
            out[int(tid)] = (int(on_cpu), int(waited))
        except (OSError, ValueError):
            continue
    return out


def python_side_threads() -> set[int]:
    """Native ids of the process's Python threads other than the calling one (data threads)."""
    me = threading.get_native_id()
    return {t.native_id for t in threading.enumerate() if t.native_id is not None and t.native_id != me}


class SchedClock:
    """Wall time and foreign run-queue wait of this process (see the module docstring).

    Args:
        exclude: gives the ids of the process's own other threads (default: none), whose
            run-queue wait is not counted and whose CPU time is taken from the compute threads' wait.
        read: {thread id: (ns on cpu, ns waiting)} (default: schedstat; a test's fake).
        wall: the wall clock (default: time.perf_counter).
    """

    def __init__(self, exclude: Callable[[], set[int]] = set, read: Callable[[], dict] = _schedstat,
                 wall: Callable[[], float] = time.perf_counter) -> None:
        self.exclude, self.read, self.wall = exclude, read, wall

    def start(self) -> tuple[float, dict[int, tuple[int, int]]]:
        return self.wall(), self.read()

    def stop(self, started: tuple[float, dict[int, tuple[int, int]]], calls: int = 1) -> Round:
        """The Round since `started` (`start()`), per call of `calls`."""
        t1, after = self.wall(), self.read()
        t0, before = started
        own = self.exclude()
        waited = own_cpu = 0
        for tid, (cpu, wait) in after.items():
            cpu0, wait0 = before.get(tid, (0, 0))
            if tid in own:
                own_cpu += cpu - cpu0
            else:
                waited += wait - wait0
        foreign = max(0.0, (waited - own_cpu) * 1e-9)
        return Round((t1 - t0) / calls, foreign / calls)


CLOCK = SchedClock()


def time_rounds(run: Callable[[], Any], rounds: int, calls: int = 1, sync: Callable[[], None] = lambda: None,
                clock: SchedClock = CLOCK) -> list[Round]:
    """`rounds` Rounds of `calls` calls of `run` each (`sync` before the clock stops)."""
    out = []
    for _ in range(rounds):
        started = clock.start()
        for _ in range(calls):
            run()
        sync()
        out.append(clock.stop(started, calls))
    return out


def estimate(rounds: Iterable[Round | float], threads: int | None = None) -> Estimate:
    """The rule of the module docstring over `rounds` (a bare number: a round with no wait);
    `threads`: the compute threads (default: torch's)."""
    rounds = [r if isinstance(r, Round) else Round(float(r)) for r in rounds]
    if not rounds:
        raise ValueError("no rounds to estimate from")
    clean = [r.wall for r in rounds if r.waited <= CLEAN_SHARE * r.wall]
    if len(clean) >= min(MIN_CLEAN, len(rounds)):
        return Estimate(statistics.median(clean), len(rounds), len(clean), "clean")
    return Estimate(_extrapolated(rounds, threads or _threads()), len(rounds), len(clean), "extrapolated")


def _extrapolated(rounds: Sequence[Round], threads: int) -> float:
    fastest = min(r.wall for r in rounds)
    floor = min(max(r.wall - r.waited, 0.0) for r in rounds)
    low, high = 1.0 / max(threads, 1), 1.0
    n = len(rounds)
    mean_q = sum(r.waited for r in rounds) / n
    mean_w = sum(r.wall for r in rounds) / n
    var_q = sum((r.waited - mean_q) ** 2 for r in rounds)
    slope = sum((r.waited - mean_q) * (r.wall - mean_w) for r in rounds) / var_q if var_q > 0 else high
    slope = min(high, max(low, slope))
    intercept = statistics.median(r.wall - slope * r.waited for r in rounds)
    return min(fastest, max(floor, intercept))


def _threads() -> int:
    try:
        import torch

        return max(1, torch.get_num_threads())
    except ImportError:  # pragma: no cover - torch is a dependency
        return 1


@dataclass
class TimingLog:
    """How a calibration's measurements were reached: rounds, rejected rounds, extrapolated
    measurements, and the load average at its start and end (`summary`)."""

    measurements: int = 0
    rounds: int = 0
    rejected: int = 0
    extrapolated: int = 0
    load: list[float] = field(default_factory=list)

    def add(self, est: Estimate) -> Estimate:
        self.measurements += 1
        self.rounds += est.rounds
        self.rejected += est.rejected
        self.extrapolated += est.method == "extrapolated"
        return est

    def note_load(self) -> None:
        try:
            self.load.append(os.getloadavg()[0])
        except OSError:
            pass

    def summary(self) -> dict[str, Any]:
        return {"rule": f"rounds with foreign run-queue wait <= {CLEAN_SHARE:.0%} of wall are clean; the "
                        f"median of clean rounds (>= {MIN_CLEAN}), else wall extrapolated to no wait",
                "measurements": self.measurements, "rounds": self.rounds, "rejected_rounds": self.rejected,
                "extrapolated_measurements": self.extrapolated, "loadavg_1min": list(self.load)}


LOG = TimingLog()  # the running calibration's log (`flowrec calibrate` resets it)


def reset_log() -> TimingLog:
    global LOG
    LOG = TimingLog()
    LOG.note_load()
    return LOG
