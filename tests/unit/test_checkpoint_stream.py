"""A full checkpoint streamed from the live tables while training changes them (`save_streamed`)
is the checkpoint of the state when its snapshot was taken: the same tensors and the same digest
as `save_checkpoint` of a copy made then, it loads through `load_checkpoint`, a stopped write
leaves the previous checkpoint intact (also when a table value is not finite), and the writer
holds a bounded number of rows."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from flowrec.runtime.checkpoint.store import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, load_checkpoint, save_checkpoint
from flowrec.runtime.checkpoint.format import content_digest, read_torch_file
from flowrec.runtime.checkpoint.stream import save_streamed
from flowrec.runtime.checkpoint.checkpointer import Checkpointer
from flowrec.runtime.checkpoint.incremental import TableSnapshot, copy_rows
from flowrec.runtime.nonfinite import TrainingStopped
from flowrec.testing.processes import call_within

WAIT_S = 120  # a background write of these small states: far above a loaded machine's, far below a hang
STREAMS = {"embeddings.a.weight": ("a", 0), "embeddings.a.state": ("a", 1),
           "embeddings.b.weight": ("b", 0), "embeddings.b.state": ("b", 1)}


def _state(gen: torch.Generator, dtype: torch.dtype) -> dict:
    """A checkpoint-shaped state: two packed groups (one with an empty optimizer state), dense
    parameters (one a view into a larger storage), a dense optimizer state, RNG and position."""
    backing = torch.randn(40, 3, generator=gen, dtype=dtype)
    model = {"bottom.weight": torch.randn(6, 5, generator=gen, dtype=dtype),
             "embeddings.a.weight": torch.randn(3000, 8, generator=gen, dtype=dtype),
             "embeddings.a.state": torch.rand(3000, 1, generator=gen, dtype=dtype),
             "embeddings.b.weight": torch.randn(500, 4, generator=gen, dtype=dtype),
             "embeddings.b.state": torch.zeros(500, 0, dtype=dtype),
             "top.bias": backing[7:9]}
    optimizer = {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(6, 5, generator=gen, dtype=dtype)}},
                 "param_groups": [{"lr": 0.01, "params": [0]}]}
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "spec": "{}", "plan": "{}",
            "model": model, "dense_optimizer": optimizer, "rng": {"torch": torch.get_rng_state()},
            "position": {"epoch": 0, "batch": 4, "step": 4, "samples": 64}, "skipped_batches": 0}


def _tables(state: dict) -> dict[str, tuple[torch.Tensor, ...]]:
    model = state["model"]
    return {g: (model[f"embeddings.{g}.weight"], model[f"embeddings.{g}.state"]) for g in ("a", "b")}


def _step(tables: dict, snap: TableSnapshot, gen: torch.Generator) -> None:
    """One 'training step': skewed ids with repeats, saved first, then changed in place."""
    for name, (weight, state) in tables.items():
        ids = (torch.rand(200, generator=gen) ** 3 * weight.shape[0]).long()
        snap.before_write(name, ids)
        weight.index_add_(0, ids, torch.randn(ids.numel(), weight.shape[1], generator=gen, dtype=weight.dtype))
        if state.shape[1]:
            state.index_add_(0, ids, torch.rand(ids.numel(), state.shape[1], generator=gen, dtype=state.dtype))


def _frozen(state: dict) -> dict:
    return {**state, "model": {k: v.clone() for k, v in state["model"].items()}}


@pytest.mark.parametrize("seed, dtype, chunk_rows", [(0, torch.float64, 7), (1, torch.float32, 64),
                                                     (2, torch.float32, None), (3, torch.bfloat16, 33)])
def test_a_write_while_rows_change_equals_the_checkpoint_of_the_snapshot(tmp_path: Path, seed: int,
                                                                        dtype: torch.dtype, chunk_rows):
    gen = torch.Generator().manual_seed(seed)
    state = _state(gen, dtype)
    expected = _frozen(state)
    tables = _tables(state)
    snap = TableSnapshot(tables, chunk_rows=chunk_rows)
    _step(tables, snap, gen)  # after the snapshot was taken, before the write started
    out: dict = {}
    writer = threading.Thread(target=lambda: out.update(
        digest=save_streamed(tmp_path / "checkpoint.pt", state, STREAMS, snap)))
    writer.start()
    during, deadline = 0, time.monotonic() + 120
    while (writer.is_alive() or during == 0) and time.monotonic() < deadline:  # steps back to back
        _step(tables, snap, gen)
        during += writer.is_alive()
    writer.join(60)
    assert not writer.is_alive(), "the writer never finished while steps ran back to back (starved of the lock)"
    save_checkpoint(tmp_path / "reference.pt", expected)
    got = read_torch_file(tmp_path / "checkpoint.pt")
    reference = read_torch_file(tmp_path / "reference.pt")
    assert out["digest"] == got["digest"] == reference["digest"] == content_digest(expected)
    assert got["model"].keys() == expected["model"].keys()
    assert all(torch.equal(got["model"][k], expected["model"][k]) for k in expected["model"])
    assert torch.equal(got["dense_optimizer"]["state"][0]["exp_avg"], expected["dense_optimizer"]["state"][0]["exp_avg"])
    assert not torch.equal(state["model"]["embeddings.a.weight"], expected["model"]["embeddings.a.weight"])
    loaded = load_checkpoint(tmp_path / "checkpoint.pt")  # format, keys and digest checked
    assert loaded["position"] == expected["position"]


def test_a_stopped_write_leaves_the_previous_checkpoint_and_no_temp_file(tmp_path: Path):
    gen = torch.Generator().manual_seed(3)
    path = tmp_path / "checkpoint.pt"
    save_checkpoint(path, _state(gen, torch.float32))
    before = path.read_bytes()
    state = _state(gen, torch.float32)
    snap = TableSnapshot(_tables(state), chunk_rows=100)
    seen = []

    def stop_at_third_chunk(key: str, rows: torch.Tensor) -> None:
        seen.append(key)
        if len(seen) == 3:
            raise ValueError("not finite")

    with pytest.raises(ValueError, match="not finite"):
        save_streamed(path, state, STREAMS, snap, stop_at_third_chunk)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    snap.close()
    snap.before_write("a", torch.arange(3000))  # closed: nothing is saved any more
    assert not any(stream.held().numel() for stream in snap._parts["a"])


def test_the_writer_holds_one_chunk_and_the_saved_rows_not_written_yet():
    gen = torch.Generator().manual_seed(5)
    weight = torch.randn(3000, 8, generator=gen, dtype=torch.float64)
    snap = TableSnapshot({"a": (weight,)}, chunk_rows=50)
    stream = snap._parts["a"][0]
    saved_total = held_most = 0
    for start, rows in snap.chunks("a", 0):
        end = start + rows.shape[0]
        assert rows.shape == (min(50, 3000 - start), 8)
        assert bool((stream.held() >= end).all())  # rows written are dropped
        ids = (torch.rand(40, generator=gen) ** 2 * 3000).long()
        held = stream.held().numel()
        snap.before_write("a", ids)
        saved_total += stream.held().numel() - held
        held_most = max(held_most, stream.held().numel())
        weight.index_add_(0, ids, torch.ones(40, 8, dtype=torch.float64))
    assert not stream.held().numel() and saved_total > held_most > 0
    row_bytes = 8 * 8
    # the buffer, plus the saved rows (written ones stay in the merged arrays until the next merge)
    assert 50 * row_bytes <= snap.peak_extra_bytes <= 50 * row_bytes + 2 * held_most * (row_bytes + 8)
    assert snap.peak_extra_bytes < weight.numel() * weight.element_size() / 2


def _recounted(snap: TableSnapshot) -> int:
    """The host bytes every stream holds, counted from scratch (what the running total must equal)."""
    total = 0
    for streams in snap._parts.values():
        for s in streams:
            total += s.held_rows.untyped_storage().nbytes() + s.held_values.untyped_storage().nbytes()
            total += sum(v.numel() * v.element_size() + r.numel() * 8 for r, v in s.pending)
    return total


def test_the_running_total_of_held_bytes_equals_a_recount_after_every_step_and_chunk():
    """Two groups (one state empty), skewed ids, steps between chunks of both tensors of a group
    and before any chunk: the total kept per change equals a recount at every point, and the peak
    is the most of (recount, recount + the chunk buffer at a chunk)."""
    gen = torch.Generator().manual_seed(int(torch.randint(0, 1 << 30, (1,))))
    tables = {"a": (torch.randn(900, 6, generator=gen), torch.rand(900, 1, generator=gen)),
              "b": (torch.randn(300, 4, generator=gen), torch.zeros(300, 0))}
    snap = TableSnapshot(tables, chunk_rows=37)
    peak = 0

    def step(group: str) -> None:
        nonlocal peak
        rows = len(tables[group][0])
        ids = (torch.rand(int(torch.randint(1, 60, (1,), generator=gen)), generator=gen) ** 3 * rows).long()
        snap.before_write(group, ids)
        assert snap._held[0] == _recounted(snap)
        peak = max(peak, snap._held[0])
        for t in tables[group]:
            t.index_add_(0, ids, torch.ones(len(ids), *t.shape[1:]))

    step("a"), step("b")
    for group in ("a", "b"):
        for index in range(2):
            chunks = snap.chunks(group, index)
            t = tables[group][index]
            buffer = min(37, len(t)) * t[:1].numel() * t.element_size()
            while True:
                before = _recounted(snap)  # what a chunk notes with its buffer, before it takes its rows
                if next(chunks, None) is None:
                    break
                peak = max(peak, before + buffer)
                assert snap._held[0] == _recounted(snap)
                step("a"), step("b")
            assert snap._held[0] == _recounted(snap)
    snap.close()
    assert snap._held[0] == _recounted(snap)
    assert snap.peak_extra_bytes == peak > 0


@pytest.mark.parametrize("full_every", [1, 3])  # 1: the default, every checkpoint full, streamed too
def test_a_non_finite_table_value_stops_the_streamed_write_and_keeps_the_last_checkpoint(tmp_path: Path,
                                                                                        full_every: int):
    gen = torch.Generator().manual_seed(6)
    path = tmp_path / "checkpoint.pt"
    ckpt = Checkpointer(path, full_every=full_every, rows_of_group={"a": 3000, "b": 500})
    groups = {"a": None, "b": None}  # a full checkpoint reads only the group names
    ckpt.save(_state(gen, torch.float32), groups)
    call_within(WAIT_S, ckpt.wait)
    assert load_checkpoint(path)["position"]["step"] == 4 and ckpt.step == 4
    bad = _state(gen, torch.float32)
    bad["position"] = {**bad["position"], "step": 8}
    bad["model"]["embeddings.a.weight"][2345, 3] = float("nan")  # finite sum elsewhere: found chunk by chunk
    ckpt.restart_chain(4)  # the next checkpoint is a full one
    ckpt.save(bad, groups)  # queued: the training thread checked only the dense part
    with pytest.raises(TrainingStopped, match="embeddings.a.weight is not finite at step 8; not checkpointed, "
                                              "the checkpoint of step 4 is kept"):
        call_within(WAIT_S, ckpt.wait)
    assert load_checkpoint(path)["position"]["step"] == 4
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert ckpt.extra_bytes and min(ckpt.extra_bytes) > 0  # both were streamed from a snapshot


def test_the_inline_switch_checks_and_writes_on_the_training_thread(tmp_path: Path):
    """`background=False` (FLOWREC_CHECKPOINT_WRITES=inline): the whole state is checked and
    written inside `save`, so a non-finite table stops there, nothing queued."""
    gen = torch.Generator().manual_seed(8)
    path = tmp_path / "checkpoint.pt"
    ckpt = Checkpointer(path, full_every=1, rows_of_group={"a": 3000, "b": 500}, background=False)
    groups = {"a": None, "b": None}
    state = _state(gen, torch.float32)
    ckpt.save(state, groups)  # on disk when save returns, no wait
    assert load_checkpoint(path)["position"]["step"] == 4 and ckpt.step == 4 and ckpt.extra_bytes == []
    loaded = load_checkpoint(path)["model"]
    assert loaded.keys() == state["model"].keys()
    assert all(torch.equal(loaded[k], state["model"][k]) for k in loaded)
    bad = _state(gen, torch.float32)
    bad["position"] = {**bad["position"], "step": 8}
    bad["model"]["embeddings.b.weight"][123, 1] = float("inf")
    with pytest.raises(TrainingStopped, match="embeddings.b.weight is not finite at step 8; not checkpointed, "
                                              "the checkpoint of step 4 is kept"):
        ckpt.save(bad, groups)
    call_within(WAIT_S, ckpt.wait)
    assert load_checkpoint(path)["position"]["step"] == 4


def test_inline_deltas_are_on_disk_when_save_returns_and_load_on_their_base(tmp_path: Path):
    """The inline switch with K = 3: a full checkpoint, then a delta of the rows a step touched,
    each written inside `save`; the chain loads as the state of the delta's step, bitwise."""
    from types import SimpleNamespace

    from flowrec.runtime.checkpoint.delta import delta_files

    gen = torch.Generator().manual_seed(9)
    path = tmp_path / "checkpoint.pt"
    ckpt = Checkpointer(path, full_every=3, rows_of_group={"a": 3000, "b": 500}, background=False)
    state = _state(gen, torch.float32)
    tables = _tables(state)
    groups = {g: SimpleNamespace(weight=w, state=st) for g, (w, st) in tables.items()}
    ckpt.save(state, groups)
    assert load_checkpoint(path)["position"]["step"] == 4 and not delta_files(path)
    ids = {g: (torch.rand(200, generator=gen) ** 3 * w.shape[0]).long() for g, (w, _) in tables.items()}
    ckpt.mark(SimpleNamespace(groups={g: SimpleNamespace(ids=i) for g, i in ids.items()}))
    for g, (w, st) in tables.items():
        w.index_add_(0, ids[g], torch.randn(ids[g].numel(), w.shape[1], generator=gen))
    state["position"] = {**state["position"], "step": 5}
    ckpt.save(state, groups)
    assert [n for n, _ in delta_files(path)] == [1] and ckpt.step == 5
    loaded = load_checkpoint(path)
    assert loaded["position"]["step"] == 5
    assert all(torch.equal(loaded["model"][k], state["model"][k]) for k in state["model"])


@pytest.mark.parametrize("new, old, background", [
    (None, None, True), ("background", None, True), ("inline", None, False), (None, "inline", False),
    ("background", "inline", True), ("inline", "background", False)])
def test_one_switch_for_inline_writes_and_the_older_name_is_still_read(monkeypatch, new, old, background):
    from flowrec.runtime import trainer

    for name, value in ((trainer.CHECKPOINT_WRITES_ENV, new), (trainer.RANK_CHECKPOINTS_ENV, old)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    assert trainer.background_checkpoints() is background


@pytest.mark.parametrize("name", ["FLOWREC_CHECKPOINT_WRITES", "FLOWREC_RANK_CHECKPOINTS"])
def test_a_misspelt_checkpoint_writes_switch_is_refused_naming_it(monkeypatch, name):
    """FLOWREC_CHECKPOINT_WRITES=inlne (docs/runs.md's comparison switch, misspelt) wrote in the
    background without a word, so a comparison of the two modes timed one of them twice."""
    from flowrec.runtime import trainer

    monkeypatch.delenv(trainer.CHECKPOINT_WRITES_ENV, raising=False)
    monkeypatch.delenv(trainer.RANK_CHECKPOINTS_ENV, raising=False)
    monkeypatch.setenv(name, "inlne")
    with pytest.raises(ValueError, match=f"{name}='inlne': use background or inline"):
        trainer.background_checkpoints()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64, torch.int64])
def test_copy_rows_equals_torch_copy_contiguous_or_not(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(7)
    source = (torch.randn(300, 6, generator=gen) * 1000).to(dtype)
    for src in (source[17:211], source.t().contiguous().t()[5:90], source[:, 1:4]):  # plain, strided, a column slice
        dst = torch.full(src.shape, -1, dtype=dtype)
        copy_rows(dst, src)
        assert torch.equal(dst, src)
    empty = torch.zeros(5, 0, dtype=dtype)
    copy_rows(torch.empty(5, 0, dtype=dtype), empty)


def test_auto_takes_a_delta_only_while_a_full_write_is_in_flight_and_at_most_a_bounded_run():
    from flowrec.runtime.checkpoint.checkpointer import AUTO, AUTO_MAX_DELTAS, Checkpointer, next_is_delta

    assert not next_is_delta(AUTO, chained=False, deltas=0, full_in_flight=True)  # no base yet: full
    assert next_is_delta(AUTO, chained=True, deltas=0, full_in_flight=True)
    assert not next_is_delta(AUTO, chained=True, deltas=0, full_in_flight=False)  # written: full again
    assert next_is_delta(AUTO, chained=True, deltas=AUTO_MAX_DELTAS - 1, full_in_flight=True)
    assert not next_is_delta(AUTO, chained=True, deltas=AUTO_MAX_DELTAS, full_in_flight=True)  # then it waits
    assert [next_is_delta(3, True, d, False) for d in range(3)] == [True, True, False]  # K = 3 ignores writes
    assert not next_is_delta(1, True, 0, True)  # K = 1: always full
    assert Checkpointer(Path("c.pt"), AUTO, {"g": 4}).incremental  # marks rows for deltas
    assert not Checkpointer(Path("c.pt"), AUTO, {"g": 4}, background=False).incremental  # inline: all full
    assert not Checkpointer(Path("c.pt"), 1, {"g": 4}).incremental


def test_auto_rests_after_a_full_write_for_a_multiple_of_its_time_then_takes_a_full_one(tmp_path, monkeypatch):
    """While the rest after a full write lasts, checkpoints are deltas; the first one after it is
    full again; the rest is AUTO_REST times the write's time; inline writes are always full."""
    import time

    from flowrec.runtime.checkpoint import checkpointer as module

    def recorded(ckpt):
        kinds = []
        monkeypatch.setattr(ckpt, "_save_full", lambda *a: (kinds.append("full"), setattr(ckpt, "_chained", True)))
        monkeypatch.setattr(ckpt, "_save_delta", lambda *a: kinds.append("delta"))
        return kinds

    state = {"position": {"step": 1}}
    ckpt = module.Checkpointer(tmp_path / "c.pt", module.AUTO, {"g": 4})
    kinds = recorded(ckpt)
    ckpt.save(state, None)
    ckpt.pace.rest_until = time.monotonic() + 3600.0  # resting
    ckpt.save(state, None)
    ckpt.save(state, None)
    ckpt.pace.rest_until = time.monotonic() - 1.0  # rested
    ckpt.save(state, None)
    assert kinds == ["full", "delta", "delta", "full"]
    inline = module.Checkpointer(tmp_path / "d.pt", module.AUTO, {"g": 4}, background=False)
    inline_kinds = recorded(inline)
    inline.save(state, None)
    inline.pace.rest_until = time.monotonic() + 3600.0
    inline.save(state, None)
    assert inline_kinds == ["full", "full"]
    # a real full write sets the rest from its own time
    writer = module.Checkpointer(tmp_path / "e.pt", module.AUTO, {"g": 4}, background=False)
    before = time.monotonic()
    writer._write_full({"x": torch.ones(3)}, 1, 0.0, save=lambda path, st: (time.sleep(0.05), "digest")[1])
    took = writer.seconds["full"][0]
    assert took >= 0.05 and before + module.AUTO_REST * took <= writer.pace.rest_until <= time.monotonic() + module.AUTO_REST * took


def test_a_tensor_hashed_in_chunks_has_the_digest_of_one_call(monkeypatch):
    """A checkpoint's digest hashed each tensor's bytes in one call (over a 2 GB table a SIGTERM's
    handler waited seconds for it); its bytes are hashed in chunks now, and the digest, which every
    checkpoint written before records, is the same."""
    import hashlib
    import random

    from flowrec.runtime.checkpoint import format as fmt

    rows, dim = random.randrange(300, 3000), random.choice([1, 3, 16])  # every tensor past 1,000 bytes
    state = {"model": {"t": torch.randn(rows, dim).exp(), "i": torch.randint(0, 1 << 40, (rows,))},
             "position": {"step": random.randrange(1, 99)}, "tag": "x"}
    whole = content_digest(state)
    for chunk in (1, random.randrange(2, 97), rows * dim * 4 - 1, 1 << 30):
        monkeypatch.setattr(fmt, "DIGEST_CHUNK_BYTES", chunk)
        assert content_digest(state) == whole, chunk
    calls = []
    monkeypatch.setattr(fmt, "DIGEST_CHUNK_BYTES", 1000)
    real = hashlib.sha256

    class Counted:
        def __init__(self):
            self.h = real()

        def update(self, data):
            calls.append(len(data))
            self.h.update(data)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(fmt.hashlib, "sha256", Counted)
    assert content_digest(state) == whole and max(calls) <= 1000
