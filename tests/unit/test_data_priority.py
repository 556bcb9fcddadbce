"""The data threads at idle priority, raised while a consumer waits (`flowrec.data.priority`): the
bookkeeping with a recording scheduler, the refusal where the priority cannot be undone, the real
Linux policy where this process may set it, and the same batches either way."""
from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from flowrec.data import priority
from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.layout import DataError
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.testing.caches import cache_spec


@pytest.fixture
def fresh(monkeypatch):
    """A clean registry and probe for each test (the module keeps them per process)."""
    monkeypatch.setattr(priority, "_threads", {})
    monkeypatch.setattr(priority, "_waiters", 0)
    monkeypatch.setattr(priority, "_usable", None)
    monkeypatch.delenv(priority.ENV, raising=False)
    return monkeypatch


def _batches(spec, rows: int = 960, seed: int = 4):
    table = synth_table(spec, rows, SynthConfig(seed=seed, alpha=1.3))
    opts = StagingOptions(batch_size=spec.training.batch_size, shuffle_buffer=128, workers=2, lookahead=2)
    return iterate_batches(spec, MemorySource(split_table(table, 3)), opts)


def _recording(fresh):
    calls: list[tuple[int, bool]] = []
    lock = threading.Lock()

    def policy(tid: int, idle: bool) -> None:
        with lock:
            calls.append((threading.get_native_id() if tid == 0 else tid, idle))

    fresh.setattr(priority, "_policy", policy)
    fresh.setattr(priority, "_usable", True)
    return calls


def test_data_threads_go_idle_and_are_raised_exactly_while_a_consumer_waits(fresh):
    calls = _recording(fresh)
    spec = cache_spec()
    with _batches(spec) as it:
        first = next(it)
        threads = priority.data_threads()
        assert {"flowrec-reader", "flowrec-lookahead"} <= set(threads)
        assert any(name.startswith("flowrec-pack") for name in threads)
        entered = {tid for tid, idle in calls if idle}
        assert set(threads.values()) <= entered  # every data thread lowered itself on entry
        calls.clear()
        with priority.waiting():  # two consumers at once: raised once, lowered once
            with priority.waiting():
                assert calls and all(not idle for _, idle in calls)
                raised = {tid for tid, _ in calls}
            assert all(not idle for _, idle in calls)
        lowered = {tid for tid, idle in calls if idle}
        live = set(priority.data_threads().values())
        assert live <= raised and live <= lowered
        assert priority._waiters == 0
        rest = list(it)
    assert first.index == 0 and len(rest) >= 2


def test_no_thread_is_lowered_where_the_priority_cannot_be_raised_again(fresh):
    calls: list[tuple[int, bool]] = []

    def policy(tid: int, idle: bool) -> None:
        calls.append((tid, idle))
        if not idle:  # an unprivileged process: SCHED_IDLE -> SCHED_OTHER is refused
            raise PermissionError(1, "Operation not permitted")

    fresh.setattr(priority, "_policy", policy)
    assert priority.enabled() is False
    assert calls == [(0, True), (0, False)]  # only the probe's own throwaway thread tried
    with _batches(cache_spec()) as it:
        next(it)
        assert priority.data_threads() == {}
    assert calls == [(0, True), (0, False)]


def test_normal_mode_leaves_the_threads_alone_and_a_bad_mode_is_named(fresh):
    calls = _recording(fresh)
    fresh.setenv(priority.ENV, "normal")
    with _batches(cache_spec()) as it:
        list(it)
    assert calls == [] and priority.data_threads() == {}
    fresh.setenv(priority.ENV, "lowest")
    with pytest.raises(DataError, match="FLOWREC_DATA_PRIORITY='lowest'.*idle, normal"):
        priority.enabled()
    with pytest.raises(DataError, match="FLOWREC_DATA_PRIORITY='lowest'"):  # before any data thread starts
        _batches(cache_spec())
    priority.enter_data_thread()  # in a data thread it never raises: the stage reported it
    assert calls == [] and priority.data_threads() == {}


def test_a_thread_gone_is_forgotten_not_an_error(fresh):
    calls = _recording(fresh)
    done = threading.Event()

    def short() -> None:
        priority.enter_data_thread()
        done.set()

    t = threading.Thread(target=short, name="flowrec-short")
    t.start()
    t.join(60)
    assert done.is_set() and calls
    with priority.waiting():
        pass
    assert priority._threads == {}  # the dead thread was dropped, its id never touched again
    assert len(calls) == 1


def test_the_batches_are_the_same_at_either_priority(fresh):
    spec = cache_spec()
    fresh.setenv(priority.ENV, "normal")
    with _batches(spec, seed=9) as it:
        normal = list(it)
    fresh.setenv(priority.ENV, "idle")
    fresh.setattr(priority, "_usable", None)
    with _batches(spec, seed=9) as it:
        idle = list(it)
    assert len(normal) == len(idle) >= 5
    for a, b in zip(normal, idle):
        assert a.index == b.index and torch.equal(a.dense, b.dense) and torch.equal(a.labels, b.labels)
        for name in a.groups:
            assert torch.equal(a.groups[name].ids, b.groups[name].ids)
            assert torch.equal(a.groups[name].casting.sorted_bags, b.groups[name].casting.sorted_bags)


@pytest.mark.skipif(not priority._probe(), reason="this process may not undo SCHED_IDLE (no CAP_SYS_NICE)")
def test_real_policy_idle_while_the_consumer_computes_normal_while_it_waits(fresh):
    with _batches(cache_spec(), rows=1920) as it:
        next(it)
        time.sleep(0.05)
        threads = priority.data_threads()
        assert threads
        assert {os.sched_getscheduler(tid) for tid in threads.values()} == {os.SCHED_IDLE}
        with priority.waiting():
            assert {os.sched_getscheduler(tid) for tid in threads.values()} == {os.SCHED_OTHER}
        live = priority.data_threads()
        assert {os.sched_getscheduler(tid) for tid in live.values()} == {os.SCHED_IDLE}
        list(it)


def test_train_refuses_an_unknown_priority_in_one_line_before_writing(fresh, tmp_path):
    from pathlib import Path

    from typer.testing import CliRunner

    from flowrec.cli import app

    fresh.setenv(priority.ENV, "realtime")
    out = tmp_path / "run"
    spec = Path(__file__).resolve().parents[2] / "specs" / "wide_deep.yaml"
    result = CliRunner().invoke(app, ["train", str(spec), "--rows", "2000", "--max-steps", "1", "--out", str(out)])
    assert result.exit_code == 2, result.output
    assert "FLOWREC_DATA_PRIORITY='realtime'" in result.output and "Traceback" not in result.output
    assert not out.exists()  # nothing written
