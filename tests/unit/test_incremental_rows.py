"""Dirty-row tracking marks exactly the packed ids of the steps since the last take; the
background writer runs writes in order, drops the ones after a failure and reports it once."""
from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from flowrec.runtime.checkpoint.delta import delta_files, delta_path, is_delta_name
from flowrec.runtime.checkpoint.incremental import BackgroundWriter, DirtyRows
from flowrec.testing.processes import call_within

WAIT_S = 120  # the background writer's queued lambdas: far above a loaded machine's, far below a hang


def _batch(**ids: torch.Tensor) -> SimpleNamespace:
    return SimpleNamespace(groups={name: SimpleNamespace(ids=t) for name, t in ids.items()})


def test_dirty_rows_are_the_unique_ids_since_the_last_take():
    gen = torch.Generator().manual_seed(3)
    dirty, rows = DirtyRows(), {"a": 1000, "b": 50}
    seen = {"a": [], "b": []}
    for _ in range(5):
        a = (torch.rand(300, generator=gen) ** 4 * 1000).long()  # skewed ids with repeats
        b = torch.randint(0, 50, (40,), generator=gen)
        dirty.mark(_batch(a=a, b=b), rows)
        seen["a"].append(a)
        seen["b"].append(b)
    taken = dirty.take()
    for name in rows:
        assert torch.equal(taken[name], torch.unique(torch.cat(seen[name])))
    dirty.mark(_batch(a=torch.tensor([7, 7, 999]), b=torch.tensor([], dtype=torch.int64)), rows)
    again = dirty.take()
    assert again["a"].tolist() == [7, 999] and again["b"].numel() == 0
    dirty.mark(_batch(a=torch.tensor([0, 8, 9, 15, 16]), b=torch.tensor([49, 0, 48])), rows)  # word edges, last row
    edges = dirty.take()
    assert edges["a"].tolist() == [0, 8, 9, 15, 16] and edges["b"].tolist() == [0, 48, 49]
    assert all(t.numel() == 0 for t in dirty.take().values())


def test_the_writer_keeps_order_and_reports_the_first_failure_once():
    writer, done = BackgroundWriter(), []
    gate = threading.Event()
    writer.submit(lambda: (gate.wait(5), done.append(1)))
    writer.submit(lambda: done.append(2))
    assert writer.pending == 2
    gate.set()
    call_within(WAIT_S, writer.wait)
    assert done == [1, 2] and writer.pending == 0

    def failing() -> None:
        raise OSError(28, "No space left on device")

    writer.submit(failing)
    writer.submit(lambda: done.append(3))  # must never run: it would follow a failed write
    with pytest.raises(OSError, match="No space"):
        call_within(WAIT_S, writer.wait)
    call_within(WAIT_S, writer.wait)  # reported once
    assert done == [1, 2]


def test_delta_names(tmp_path):
    base = tmp_path / "checkpoint.pt"
    assert delta_path(base, 12).name == "checkpoint.delta-000012.pt"
    for n in (2, 1, 10):
        delta_path(base, n).write_bytes(b"")
    (tmp_path / "checkpoint.delta-x.pt").write_bytes(b"")
    assert [n for n, _ in delta_files(base)] == [1, 2, 10]
    assert is_delta_name("checkpoint.delta-000003.pt", "checkpoint.pt")
    assert not is_delta_name("checkpoint.delta-3.pt", "checkpoint.pt")
    assert not is_delta_name("model.delta-000003.pt", "checkpoint.pt")
