"""The transfer stage's thread (runtime/pipeline.py) ends when the trainer stops reading early.

A run that stops mid-epoch (max_steps) leaves the stage's queue full; the thread's put of the end
marker then blocked until `close` gave up after 10 s, and the thread stayed blocked, holding its
batches: every GPU run of custom_module or esmm_multitask for 6 steps took 10 s longer on an H200
(bench/results/h200_round2). The CPU stage runs the same thread with `background=True`."""
from __future__ import annotations

import time

import torch

from flowrec.runtime.pipeline import TransferStage

CPU = torch.device("cpu")


def _items(count: int, fail_at_end: bool = False):
    for i in range(count):
        yield {"index": i}
    if fail_at_end:
        raise RuntimeError("the source failed after its last batch")


def _stop_early(source, depth: int = 2) -> TransferStage:
    stage = TransferStage(source, CPU, depth=depth, background=True)
    first = next(iter(stage))
    assert first == {"index": 0}
    deadline = time.monotonic() + 120  # a loaded machine may not run the thread for seconds
    while not stage._queue.full() and time.monotonic() < deadline:  # the thread fills the queue
        time.sleep(0.01)
    assert stage._queue.full(), "the stage's thread never filled its queue"
    stage.close()
    return stage


def test_stopping_early_with_the_source_exhausted_ends_the_thread():
    stage = _stop_early(_items(3))
    assert not stage._thread.is_alive()
    assert stage._queue.empty()  # no batch is held by the closed stage


def test_stopping_early_with_a_failing_source_ends_the_thread():
    stage = _stop_early(_items(3, fail_at_end=True))
    assert not stage._thread.is_alive()


def test_read_to_the_end_every_item_in_order_then_the_source_error():
    with TransferStage(_items(5), CPU, depth=2, background=True) as stage:
        assert [b["index"] for b in stage] == [0, 1, 2, 3, 4]
    stage = TransferStage(_items(2, fail_at_end=True), CPU, depth=1, background=True)
    got = []
    try:
        for b in stage:
            got.append(b["index"])
        raise AssertionError("the source's error was not raised")
    except RuntimeError as exc:
        assert "failed after its last batch" in str(exc)
    finally:
        stage.close()
    assert got == [0, 1]
    assert not stage._thread.is_alive()
