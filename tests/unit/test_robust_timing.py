"""The load-robust timing rule (`flowrec.measure.robust`): a fake clock and fake schedstat with
injected descheduling give the un-inflated time; the process's own data threads are not load."""
from __future__ import annotations

import random

import pytest

from flowrec.measure import robust
from flowrec.measure.robust import Round, SchedClock, estimate, time_rounds


class FakeMachine:
    """A wall clock and per-thread (ns on cpu, ns waiting) counters that a fake `run` advances:
    each call does `work` seconds, and with probability `p` is descheduled for `delay` seconds
    (compute thread 1 waits; the wall grows by it). `own_cpu` seconds of a data thread (id 9)
    run per call, and make compute thread 1 wait as long (the process competing with itself)."""

    def __init__(self, work: float, p: float, delay: float, own_cpu: float = 0.0, seed: int = 0) -> None:
        self.t, self.work, self.p, self.delay, self.own_cpu = 100.0, work, p, delay, own_cpu
        self.threads = {1: [0, 0], 2: [0, 0], 9: [0, 0]}
        self.rng = random.Random(seed)

    def wall(self) -> float:
        return self.t

    def read(self) -> dict:
        return {tid: tuple(v) for tid, v in self.threads.items()}

    def run(self) -> None:
        self.t += self.work + self.own_cpu
        self.threads[1][0] += int(self.work * 1e9)
        self.threads[2][0] += int(self.work * 1e9)  # a spinning partner: CPU time is no measure
        self.threads[9][0] += int(self.own_cpu * 1e9)
        self.threads[1][1] += int(self.own_cpu * 1e9)
        if self.rng.random() < self.p:
            delay = self.delay * self.rng.uniform(0.5, 2.0)
            self.t += delay
            self.threads[1][1] += int(delay * 1e9)
            self.threads[2][0] += int(delay * 1e9)  # spins meanwhile


def test_descheduled_rounds_are_rejected_and_the_clean_time_kept():
    machine = FakeMachine(work=2e-3, p=0.6, delay=30e-3)
    clock = SchedClock(steal=dict, read=machine.read, wall=machine.wall, caller=lambda: 1)
    rounds = time_rounds(machine.run, 40, clock=clock)
    walls = sorted(r.wall for r in rounds)
    assert walls[len(walls) // 2] > 5e-3  # the plain median is inflated by the load
    est = estimate(rounds)
    assert est.method == "clean" and 0 < est.clean < 40 and est.rejected == 40 - est.clean
    assert est.seconds == pytest.approx(2e-3, rel=1e-6)


def test_every_round_delayed_extrapolates_to_no_wait():
    machine = FakeMachine(work=3e-3, p=1.0, delay=20e-3, seed=3)
    clock = SchedClock(steal=dict, read=machine.read, wall=machine.wall, caller=lambda: 1)
    rounds = time_rounds(machine.run, 30, calls=2, clock=clock)
    assert all(r.waited > robust.CLEAN_SHARE * r.wall for r in rounds)
    est = estimate(rounds)
    assert est.method == "extrapolated" and est.clean == 0
    assert est.seconds == pytest.approx(3e-3, rel=1e-3)
    assert est.seconds < min(r.wall for r in rounds) / 3


def test_own_data_threads_are_part_of_the_step():
    machine = FakeMachine(work=2e-3, p=0.0, delay=0.0, own_cpu=1e-3)
    full = dict(caller=lambda: 1, threads=lambda: 2, cores=lambda: 2)  # no core left to the data thread
    own = SchedClock(steal=dict, exclude=lambda: {9}, read=machine.read, wall=machine.wall, **full)
    est = estimate(time_rounds(machine.run, 10, clock=own), )
    assert est.method == "clean" and est.seconds == pytest.approx(3e-3, rel=1e-6)  # not 2 ms
    blind = SchedClock(steal=dict, read=machine.read, wall=machine.wall, **full)  # data thread not known as the process's own
    rounds = time_rounds(machine.run, 10, clock=blind)
    assert all(r.waited == pytest.approx(1e-3) for r in rounds)


def test_data_threads_on_a_free_core_do_not_excuse_a_foreign_wait():
    """One compute thread on 2 cores: the data thread's 1 ms per call fits the free core, so the
    caller's 1 ms wait was other processes' (a foreign wait, not the step's own cost); with no
    free core it is the process's own."""
    machine = FakeMachine(work=2e-3, p=0.0, delay=0.0, own_cpu=1e-3)
    spare = SchedClock(steal=dict, exclude=lambda: {9}, read=machine.read, wall=machine.wall, caller=lambda: 1,
                       threads=lambda: 1, cores=lambda: 2)
    rounds = time_rounds(machine.run, 5, clock=spare)
    assert all(r.waited == pytest.approx(1e-3) for r in rounds)
    assert estimate(rounds).seconds == pytest.approx(2e-3, rel=1e-6)
    busy = SchedClock(steal=dict, exclude=lambda: {9}, read=machine.read, wall=machine.wall, caller=lambda: 1,
                      threads=lambda: 1, cores=lambda: 1)
    assert all(r.waited == 0.0 for r in time_rounds(machine.run, 5, clock=busy))


class PoolMachine:
    """The caller (thread 1) computes `work` seconds per call on a core it never waits for; a
    partner (thread 2) of its parallel regions runs as long and waits `partner_wait` seconds, which
    the caller's call waits for too (the wall grows by it); a pool thread (thread 3) runs 10 us and
    waits `pool_wait` seconds for a core meanwhile (not on the call's path)."""

    def __init__(self, work: float, partner_wait: float, pool_wait: float) -> None:
        self.t, self.work, self.partner_wait, self.pool_wait = 10.0, work, partner_wait, pool_wait
        self.threads = {1: [0, 0], 2: [0, 0], 3: [0, 0]}

    def wall(self) -> float:
        return self.t

    def read(self) -> dict:
        return {tid: tuple(v) for tid, v in self.threads.items()}

    def run(self) -> None:
        self.t += self.work + self.partner_wait
        self.threads[1][0] += int((self.work + self.partner_wait) * 1e9)  # spins at the barrier
        self.threads[2][0] += int(self.work * 1e9)
        self.threads[2][1] += int(self.partner_wait * 1e9)
        self.threads[3][0] += 10_000
        self.threads[3][1] += int(self.pool_wait * 1e9)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_pool_thread_waiting_beside_the_caller_is_not_the_rounds_wait(threads):
    machine = PoolMachine(work=4e-3, partner_wait=0.0, pool_wait=3.5e-3)
    clock = SchedClock(steal=dict, read=machine.read, wall=machine.wall, caller=lambda: 1, threads=lambda: threads)
    rounds = time_rounds(machine.run, 5, clock=clock)
    assert all(r.waited == 0.0 for r in rounds)  # the pool thread ran 10 us of a 4 ms round
    est = estimate(rounds)
    assert est.method == "clean" and est.seconds == pytest.approx(4e-3)
    counted = SchedClock(steal=dict, read=machine.read, wall=machine.wall, caller=lambda: 3, threads=lambda: threads)
    assert time_rounds(machine.run, 1, clock=counted)[0].waited == pytest.approx(3.5e-3)  # the caller's own wait counts


def test_a_partner_of_a_parallel_region_is_waited_for_with_several_threads_only():
    machine = PoolMachine(work=4e-3, partner_wait=6e-3, pool_wait=0.0)
    several = SchedClock(steal=dict, read=machine.read, wall=machine.wall, caller=lambda: 1, threads=lambda: 2)
    rounds = time_rounds(machine.run, 5, clock=several)
    assert all(r.waited == pytest.approx(6e-3) for r in rounds)
    assert estimate(rounds).seconds == pytest.approx(4e-3)
    one = SchedClock(steal=dict, read=machine.read, wall=machine.wall, caller=lambda: 1, threads=lambda: 1)
    assert all(r.waited == 0.0 for r in time_rounds(machine.run, 3, clock=one))


def test_one_over_counted_round_does_not_set_the_extrapolated_estimate():
    rounds = [Round(24e-3, 12e-3 + random.Random(i).uniform(-3e-4, 3e-4)) for i in range(19)]
    rounds.append(Round(23.5e-3, 20e-3))  # its wait over-counted: 3.5 ms left of a 12 ms step
    est = estimate(rounds)
    assert est.method == "extrapolated" and est.clean == 0
    assert est.seconds == pytest.approx(12e-3, rel=0.03)


def test_compute_threads_follow_torch_and_the_sparse_update():
    import numba
    import torch

    from operators import fused_sparse_cpu

    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        fused_sparse_cpu.use_threads(1)
        assert robust.compute_threads() == 1
        torch.set_num_threads(2)
        assert robust.compute_threads() == 2
        torch.set_num_threads(1)
        fused_sparse_cpu.use_threads(2)  # at most numba's pool
        assert robust.compute_threads() == min(2, numba.config.NUMBA_NUM_THREADS)
    finally:
        torch.set_num_threads(saved)
        fused_sparse_cpu.use_threads(saved)


def test_bare_numbers_and_the_log():
    values = [random.uniform(1.0, 2.0) for _ in range(7)]
    est = estimate(values)
    assert est.method == "clean" and est.seconds == sorted(values)[3]
    with pytest.raises(ValueError):
        estimate([])
    log = robust.TimingLog()
    log.add(est)
    log.add(estimate([Round(5.0, 4.0), Round(6.0, 5.0), Round(4.0, 3.0)]))
    summary = log.summary()
    assert summary["measurements"] == 2 and summary["rounds"] == 10 and summary["rejected_rounds"] == 3
    assert summary["extrapolated_measurements"] == 1


def test_the_clocks_own_reads_are_outside_the_round():
    """Reading schedstat takes time (per thread of the process): a round holds the work between
    start and stop, not the counters' reads at either end, however many threads there are."""
    for threads in (1, 30):
        machine = FakeMachine(work=2e-3, p=0.0, delay=0.0)
        read_seconds = 20e-6 * threads

        def read(machine=machine, read_seconds=read_seconds):
            machine.t += read_seconds + 5e-3
            machine.threads[1][1] += int(5e-3 * 1e9)  # descheduled 5 ms while reading: outside the round
            return machine.read()

        clock = SchedClock(steal=dict, read=read, wall=machine.wall, caller=lambda: 1, threads=lambda: 1)
        rounds = time_rounds(machine.run, 5, clock=clock)
        assert [r.wall for r in rounds] == pytest.approx([2e-3] * 5, abs=1e-12)
        assert all(0 < r.waited <= r.wall for r in rounds)


def test_real_clock_reads_this_process():
    rounds = time_rounds(lambda: sum(range(20000)), 5)
    assert len(rounds) == 5 and all(r.wall > 0 and r.waited >= 0 for r in rounds)
    import threading

    seen, stop = [], threading.Event()
    worker = threading.Thread(target=lambda: (seen.append(threading.get_native_id()), stop.wait(10)))
    worker.start()
    try:
        while not seen:
            stop.wait(0.001)
        assert seen[0] in robust.python_side_threads()
        assert threading.get_native_id() not in robust.python_side_threads()
    finally:
        stop.set()
        worker.join(60)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_fixed_cost_fit_recovers_a_known_intercept_through_noise_and_outliers(seed):
    """Synthetic steps: a known fixed cost plus priced work at several batch sizes and shapes, each
    with noise, and two of the ten slowed by a neighbour's burst (+3 ms): the fit gives the fixed
    cost within the noise, where a mean (the old two-point leftover's rule) is pulled far off."""
    rng = random.Random(seed)
    intercept, noise = 450.0, 20.0
    predicted = [rng.uniform(100.0, 5000.0) for _ in range(10)]
    measured = [p + intercept + rng.gauss(0.0, noise) for p in predicted]
    slowed = rng.sample(range(10), 2)
    for i in slowed:
        measured[i] += 3000.0
    fit = robust.fit_offset(measured, predicted)
    assert abs(fit.value - intercept) < 3 * noise
    assert fit.outliers >= 2
    assert 0 < fit.spread < 5 * noise
    assert fit.high - intercept > 2000  # the slowed points are reported, not hidden
    mean = sum(m - p for m, p in zip(measured, predicted)) / len(measured)
    assert abs(mean - intercept) > 500  # the fit matters: a mean is off by the outliers' share


def test_fixed_cost_fit_refuses_nothing_and_mismatched_lengths():
    with pytest.raises(ValueError):
        robust.fit_offset([], [])
    with pytest.raises(ValueError):
        robust.fit_offset([1.0, 2.0], [1.0])
    exact = robust.fit_offset([3.0, 4.0, 5.0], [1.0, 2.0, 3.0])
    assert (exact.value, exact.spread, exact.outliers) == (2.0, 0.0, 0)


def test_step_measurements_go_on_while_too_few_rounds_are_clean(monkeypatch):
    """`timed_steps`: warm-up calls untimed, then the asked steps; on a busy machine (no clean
    round) more rounds, batches replayed, up to MORE_ROUNDS x steps; not replayed where a cache's
    plan forbids it; no more once enough rounds are clean."""
    from flowrec.measure import step as measure_step

    def stepper(clean_every: int):
        calls = []

        def step(batch):
            calls.append(batch)
            waited = 0.0 if clean_every and len(calls) % clean_every == 0 else 5e-3
            return Round(10e-3, waited)
        return step, calls

    batches = list(range(measure_step.WARMUP_STEPS + 4))
    step, calls = stepper(0)
    rounds = measure_step.timed_steps(step, batches, 4, replay=True)
    assert len(rounds) == measure_step.MORE_ROUNDS * 4 and len(calls) == len(rounds) + measure_step.WARMUP_STEPS
    assert calls[measure_step.WARMUP_STEPS:] == [batches[measure_step.WARMUP_STEPS + i % 4] for i in range(len(rounds))]
    step, calls = stepper(0)
    assert len(measure_step.timed_steps(step, batches, 4, replay=False)) == 4  # no replay: as far as the batches go
    step, calls = stepper(1)
    assert len(measure_step.timed_steps(step, batches, 4, replay=True)) == 4  # all clean: the asked steps
    step, calls = stepper(3)
    rounds = measure_step.timed_steps(step, batches, 4, replay=True)
    clean = [i for i, r in enumerate(rounds) if r.waited == 0.0]
    assert len(clean) == robust.MIN_CLEAN and clean[-1] == len(rounds) - 1 > 4  # on until the third clean one
    monkeypatch.setattr(measure_step, "MORE_SECONDS", 0.0)
    step, calls = stepper(0)
    assert len(measure_step.timed_steps(step, batches, 4, replay=True)) == 4  # out of time


def test_a_staged_batch_is_replayed_only_without_a_cache(repo):
    from flowrec.measure.step import replayable
    from flowrec.planner.manager import make_plan
    from flowrec.spec import load_spec

    spec = load_spec(repo / "specs" / "dlrm_criteo.yaml")
    assert replayable(make_plan(spec, target="cpu"))
    cached = make_plan(spec, target="cpu", device_budget=64 << 20)
    assert any(g.placement in ("lookahead", "static_hot") for g in cached.meta.groups)
    assert not replayable(cached)


def test_rounds_the_hypervisor_stole_from_are_rejected():
    """On a virtual machine the hypervisor runs other machines on the process's vCPUs (steal time,
    /proc/stat's 10 ms ticks): no run queue of the guest shows it, yet the round's wall holds it.
    A 12 ms round in a spell of 20% steal is 3 ms slower and sees a tick only every few rounds: the
    steal rate over the last STEAL_WINDOW_S marks every round of the spell once the window holds
    two ticks; steal on a CPU the process may not run on never counts."""
    rng = random.Random(random.SystemRandom().randrange(1 << 30))
    work, share = 12e-3, rng.uniform(0.18, 0.25)
    machine = FakeMachine(work=work, p=0.0, delay=0.0)
    stolen_ns = {0: 0, 1: 0, 5: 0}
    spell = range(30, 110)
    k = {"round": 0, "cpu": rng.choice([0, 1])}

    def ticks() -> dict[int, int]:  # the kernel's conversion of its ns counters to ticks
        return {c: int(ns // int(robust.TICK_SECONDS * 1e9)) for c, ns in stolen_ns.items()}

    def run() -> None:
        machine.run()
        stolen_ns[5] += int(work * 1e9)  # a CPU the process may not run on, always stolen: never counts
        if k["round"] in spell:
            taken = work * share / (1 - share)
            machine.t += taken  # the wall holds what was stolen
            stolen_ns[k["cpu"]] += int(taken * 1e9)
        k["round"] += 1

    clock = SchedClock(steal=ticks, cpus=lambda: {0, 1}, read=machine.read, wall=machine.wall,
                       caller=lambda: 1, threads=lambda: 1)
    rounds = time_rounds(run, 140, clock=clock)
    assert all(r.waited == 0 for r in rounds[:30])  # before the spell
    late = rounds[spell.start + 8:spell.stop]
    assert all(r.waited > robust.CLEAN_SHARE * r.wall for r in late)  # every round once the window sees it
    assert all(r.waited <= r.wall for r in rounds)
    assert all(r.waited == 0 for r in rounds[-5:])  # the window has left the spell
    walls = sorted(r.wall for r in rounds)
    assert walls[len(walls) // 2] > work * 1.1  # the plain median holds the steal
    est = estimate(rounds)
    assert est.method == "clean" and est.seconds == pytest.approx(work)

    every = SchedClock(steal=ticks, cpus=lambda: None, read=machine.read, wall=machine.wall,
                       caller=lambda: 1, threads=lambda: 1)  # affinity unknown: every CPU's steal counts
    assert all(r.waited > 0 for r in time_rounds(run, 3, clock=every))


def test_steal_is_read_from_proc_stat():
    got = robust._steal()
    try:
        with open("/proc/stat") as f:
            cpus = [line.split()[0] for line in f if line.startswith("cpu") and not line.startswith("cpu ")]
    except OSError:
        pytest.skip("no /proc/stat here")
    assert sorted(got) == sorted(int(c[3:]) for c in cpus)
    later = robust._steal()
    assert all(later[c] >= got[c] for c in got)
