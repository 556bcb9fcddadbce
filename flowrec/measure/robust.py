"""Timing on a shared machine: what a piece of work takes when other processes do not take the
cores from it.

Every calibration measurement (`flowrec calibrate`) and the benchmark's measured steps
(`tools/bench_costmodel.py`) are timed in rounds. A round records its wall time and how long the
process's compute threads were runnable but waiting for a core (the kernel's run-queue wait per
thread, `/proc/self/task/*/schedstat`): the longest wait of any one of them, less the CPU time the
process's own other threads (the data threads of a training run, `exclude`) ran meanwhile beyond
what the cores the compute threads leave free could run in the round (`usable_cores` less the
compute threads, times the wall time): that part is the process competing with itself, which a
training step really pays. What is left is the time other processes took from the round. On a
virtual machine the hypervisor also takes the process's vCPUs for other machines (steal time),
which no run queue of the guest shows: the round's wait is at least the largest steal of a vCPU
the process may run on during the round (`/proc/stat`, counted in the kernel's 10 ms ticks: a
tick seen in a round means steal in it), and at least the round's wall time times that vCPU's
steal rate over the last STEAL_WINDOW_S (a round shorter than a tick sees the tick of one round
in several: at 20% steal a 12 ms round is 2-3 ms slower, and only every fourth shows a tick).
Measured on the 2-vCPU Xeon VM of Rounds 34-37: spells of 10-30 s with 10-19% of each vCPU
stolen between minutes of none. (On
this 2-core machine a one-thread step leaves a core to its data threads: their 4 ms of CPU per
5 ms step do not make the step wait, and do not excuse a wait other processes caused.)

The compute threads of a round are the calling thread (it runs the step's Python and its
kernels) and, when the process computes on several threads (torch's or the numba sparse
update's thread count above 1), the threads that ran on a core for at least `PARTNER_SHARE` of
the round (the partners of its parallel regions). Other threads of the process are not on the
step's path: a thread pool that barely ran (Arrow's readers between reads, jemalloc's background
thread) may wait for a core for a whole time slice while the caller computes, and counting that
wait would take from the round time the caller really spent on a core (measured here: a 23.5 ms
round of 12 ms work with 20 ms of such "wait").

The rule (`estimate`):

* a round is *clean* when that wait is at most `CLEAN_SHARE` of its wall time; the estimate is
  the median wall time of the clean rounds when there are at least `MIN_CLEAN` (or every round
  is clean);
* otherwise (a busy machine: most rounds waited) the median over every round of its wall time
  less its wait (what the round took on the cores it got), at least a tenth of the fastest
  round (a sanity bound). The median, not the fastest: one round whose wait was over-counted
  would otherwise set the whole estimate.

Process or thread CPU time is not the measure: a thread of a parallel region spins at its barrier
while its partner waits for a core, so CPU time grows with the load as wall time does (measured
here, at load 4.4 on 2 cores: a 512^3 GEMM took 23.8 ms wall, each of its 2 threads 8 ms on a core
and 16 ms waiting for one, against 2.3 ms on 1 thread), and schedstat's CPU time of a running
thread advances by scheduler ticks (4 ms here). The same spinning is why the extrapolated
estimate of a parallel kernel on a busy machine is still above its time on free cores: the rule
removes the waits, not the spinning they cause; `TimingLog` records how many measurements had no
clean rounds. Without schedstat (not Linux) every round counts as clean: the median round.

Example:
    >>> estimate([Round(1e-3, 0.0), Round(1.2e-3, 0.0), Round(1.1e-3, 0.0), Round(9e-3, 8e-3)]).seconds
    0.0011
"""
from __future__ import annotations

import functools
import os
import statistics
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from flowrec.data.cores import allowed_cpus, usable_cores

CLEAN_SHARE = 0.05  # foreign run-queue wait a clean round may have, share of its wall time
MIN_CLEAN = 3  # clean rounds the median needs; fewer: the median round less its wait
PARTNER_SHARE = 0.1  # a thread besides the caller is a compute partner of a round that it ran this share of
STEAL_WINDOW_S = 0.25  # the hypervisor's steal rate is read over this much of the recent past (one tick: 4%)
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
    method: str  # "clean": median of clean rounds; "extrapolated": the median round less its wait

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


def _steal() -> dict[int, int]:
    """{cpu: steal ticks (USER_HZ) so far} from `/proc/stat` ({} where not readable: not Linux)."""
    out = {}
    try:
        with open("/proc/stat", "rb") as f:
            text = f.read(65536)
    except OSError:
        return out
    for line in text.split(b"\n"):
        if not line.startswith(b"cpu") or line.startswith(b"cpu "):
            continue
        parts = line.split()
        try:
            out[int(parts[0][3:])] = int(parts[8])
        except (IndexError, ValueError):
            continue
    return out


try:
    TICK_SECONDS = 1.0 / os.sysconf("SC_CLK_TCK")  # /proc/stat's unit
except (AttributeError, ValueError, OSError):
    TICK_SECONDS = 0.01


def compute_threads() -> int:
    """Threads the process's kernels may run on: the larger of torch's thread count and the numba
    sparse update's (once its pool runs: asking before would start it, `operators.fused_sparse_cpu`);
    1 where neither is loaded."""
    counts = [1]
    torch = sys.modules.get("torch")
    if torch is not None and hasattr(torch, "get_num_threads"):
        counts.append(int(torch.get_num_threads()))
    kernels = sys.modules.get("operators.fused_sparse_cpu")
    running = kernels.running_threads() if kernels is not None else None
    if running is not None:
        counts.append(int(running))
    return max(counts)


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
        caller: gives the calling thread's id (default: `threading.get_native_id`).
        threads: gives the process's compute thread count (default: `compute_threads`); with 1,
            only the caller's wait counts.
        cores: gives the cores the process may use (default: `flowrec.data.cores.usable_cores`;
            asked once).
        steal: {cpu: steal ticks so far} (default: `/proc/stat`; a test's fake, `dict` for none).
        cpus: gives the CPUs the process may run on, whose steal counts (default:
            `flowrec.data.cores.allowed_cpus`; None: every CPU; asked once).
    """

    def __init__(self, exclude: Callable[[], set[int]] = set, read: Callable[[], dict] = _schedstat,
                 wall: Callable[[], float] = time.perf_counter,
                 caller: Callable[[], int] = threading.get_native_id,
                 threads: Callable[[], int] = compute_threads, cores: Callable[[], int] = usable_cores,
                 steal: Callable[[], dict[int, int]] = _steal,
                 cpus: Callable[[], set[int] | None] = allowed_cpus) -> None:
        self.exclude, self.read, self.wall = exclude, read, wall
        self.caller, self.threads, self.cores = caller, threads, cores
        self.steal, self.cpus = steal, cpus
        self._cores: int | None = None  # `cores()` read once (cgroup files), at the first round that needs it
        self._steal_seen: deque[tuple[float, dict[int, int]]] = deque()  # (wall, steal ticks) at rounds' ends

    def start(self) -> tuple[float, dict[int, tuple[int, int]], dict[int, int]]:
        """(wall time, counters, steal ticks) at the start of a round: the counters read first, so
        that the round's wall time holds none of the clock's own work (reading schedstat costs
        11-19 us per thread here: ~0.1 ms in a training process with its data threads, which the
        benchmark's measured step held, against ~30 us in calibration's steps with fewer threads;
        /proc/stat 11 us)."""
        stolen = self.steal()
        before = self.read()
        return self.wall(), before, stolen

    @functools.cached_property
    def _allowed(self) -> set[int] | None:
        """`cpus()`, asked at the first steal a round compares."""
        return self.cpus()

    def stolen_seconds(self, before: dict[int, int], after: dict[int, int]) -> float:
        """The largest steal of a CPU this process may run on between two `steal()` reads."""
        allowed = self._allowed
        ticks = [after[c] - before[c] for c in after if c in before and (allowed is None or c in allowed)]
        return max(ticks, default=0) * TICK_SECONDS

    def stop(self, started: tuple[float, dict[int, tuple[int, int]], dict[int, int]], calls: int = 1) -> Round:
        """The Round since `started` (`start()`), per call of `calls`: the wall clock is read
        before the counters (the clock's work is outside the round at both ends)."""
        t1, after = self.wall(), self.read()
        stolen = self.steal()
        t0, before, stolen0 = started
        hypervisor = self.stolen_seconds(stolen0, stolen)  # ticks seen in the round
        seen = self._steal_seen
        while len(seen) > 1 and seen[1][0] <= t1 - STEAL_WINDOW_S:
            seen.popleft()
        since, ticks = (seen[0] if seen and seen[0][0] < t0 else (t0, stolen0))
        if t1 > since:  # the steal rate over the window (or the round, if longer) times the round
            hypervisor = max(hypervisor, self.stolen_seconds(ticks, stolen) / (t1 - since) * (t1 - t0))
        seen.append((t1, stolen))
        own, me, threads = self.exclude(), self.caller(), self.threads()
        alone, wall_ns = threads <= 1, (t1 - t0) * 1e9
        partner_ns = PARTNER_SHARE * wall_ns
        waited = own_cpu = 0
        for tid, (cpu, wait) in after.items():
            cpu0, wait0 = before.get(tid, (0, 0))
            if tid in own:
                own_cpu += cpu - cpu0
            elif tid == me or (not alone and cpu - cpu0 >= partner_ns):
                waited = max(waited, wait - wait0)
        if own_cpu:  # the part of the own threads' CPU time the free cores could not hold
            if self._cores is None:
                self._cores = self.cores()
            own_cpu = max(0.0, own_cpu - max(0, self._cores - threads) * wall_ns)
        # the counters span the round and the reads at its ends: a wait during a read is not the round's
        foreign = max(0.0, (waited - own_cpu) * 1e-9)
        foreign = min(max(foreign, hypervisor), t1 - t0)
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


def estimate(rounds: Iterable[Round | float]) -> Estimate:
    """The rule of the module docstring over `rounds` (a bare number: a round with no wait)."""
    rounds = [r if isinstance(r, Round) else Round(float(r)) for r in rounds]
    if not rounds:
        raise ValueError("no rounds to estimate from")
    clean = [r.wall for r in rounds if r.waited <= CLEAN_SHARE * r.wall]
    if len(clean) >= min(MIN_CLEAN, len(rounds)):
        return Estimate(statistics.median(clean), len(rounds), len(clean), "clean")
    fastest = min(r.wall for r in rounds)
    return Estimate(max(statistics.median(r.wall - r.waited for r in rounds), fastest / 10), len(rounds),
                    len(clean), "extrapolated")


@dataclass(frozen=True)
class Fit:
    """A constant fitted over several measurements: its value, the spread of the measurements
    about it and how many of them were outliers."""

    value: float
    spread: float  # 1.4826 x the median absolute deviation of the leftovers (a standard deviation if normal)
    low: float  # the smallest and largest leftover
    high: float
    points: int
    outliers: int  # leftovers further than OUTLIER_SPREADS spreads from the value


OUTLIER_SPREADS = 3.0


def fit_offset(measured: Iterable[float], predicted: Iterable[float]) -> Fit:
    """The constant `c` in `measured = predicted + c` over pairs of measurements and predictions
    (a fixed cost beside priced work): the median of the leftovers `measured - predicted`, a
    robust least-absolute-deviations fit. One measurement slowed by a neighbour's burst moves a
    mean (and a two-point leftover) by its whole excess; it moves the median of five by nothing.

    Example:
        >>> fit_offset([1.5, 2.6, 3.4, 9.0, 5.5], [1.0, 2.0, 3.0, 4.0, 5.0]).value
        0.5
    """
    left = [m - p for m, p in zip(measured, predicted, strict=True)]
    if not left:
        raise ValueError("no measurements to fit")
    value = statistics.median(left)
    spread = 1.4826 * statistics.median(abs(x - value) for x in left)
    outliers = sum(abs(x - value) > OUTLIER_SPREADS * spread for x in left) if spread > 0 else 0
    return Fit(value, spread, min(left), max(left), len(left), outliers)


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
        return {"rule": f"rounds with foreign run-queue wait (or the hypervisor's steal) <= {CLEAN_SHARE:.0%} of wall are clean; the "
                        f"median of clean rounds (>= {MIN_CLEAN}), else the median of the rounds' wall less their "
                        f"wait (the caller's, and its partners' with several compute threads)",
                "measurements": self.measurements, "rounds": self.rounds, "rejected_rounds": self.rejected,
                "extrapolated_measurements": self.extrapolated, "loadavg_1min": list(self.load)}


LOG = TimingLog()  # the running calibration's log (`flowrec calibrate` resets it)


def reset_log() -> TimingLog:
    global LOG
    LOG = TimingLog()
    LOG.note_load()
    return LOG
