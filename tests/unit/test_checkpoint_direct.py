"""A streamed full checkpoint writes the aligned middle of each table around the page cache
(`flowrec.runtime.checkpoint.direct`): the file holds exactly the bytes of a plain write, every
direct write is aligned (offset, length and buffer address), only the partial blocks at a run's
ends go through the page cache, a refused direct write (EINVAL) falls back to the page cache, and a
disk-full error is still one line that keeps the previous checkpoint."""
from __future__ import annotations

import errno
import fcntl
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrec.runtime.checkpoint import direct, stream
from flowrec.runtime.checkpoint.direct import DIRECT_ALIGN, DirectFile, DirectRun
from flowrec.runtime.checkpoint.format import CheckpointError, read_torch_file
from flowrec.runtime.checkpoint.incremental import TableSnapshot
from flowrec.runtime.checkpoint.store import CHECKPOINT_FORMAT, CHECKPOINT_VERSION, load_checkpoint, save_checkpoint
from flowrec.runtime.checkpoint.stream import save_streamed

SMALL_BUFFER = 2 * DIRECT_ALIGN  # bytes: many buffer swaps on small tables


class Recorder:
    """pwrite that records (fd, offset, length, buffer address) and writes."""

    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int, int]] = []
        self.lock = threading.Lock()

    def __call__(self, fd: int, data, offset: int) -> None:
        array = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        with self.lock:
            self.calls.append((fd, offset, array.size, array.ctypes.data if array.size else 0))
        direct.pwrite_all(fd, data, offset)


def _random_run(gen: np.random.Generator, offset: int, nbytes: int) -> list[np.ndarray]:
    """`nbytes` random bytes cut into pieces of random sizes (a single byte to several buffers)."""
    data = gen.integers(0, 256, nbytes, dtype=np.uint8)
    cuts = np.sort(gen.choice(np.arange(1, nbytes), size=min(nbytes - 1, int(gen.integers(1, 12))), replace=False))
    return np.split(data, cuts)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("usable", [True, False])
def test_a_run_writes_the_bytes_of_a_plain_write_and_only_its_partial_end_blocks_through_the_page_cache(
        tmp_path: Path, monkeypatch, seed: int, usable: bool):
    monkeypatch.setattr(direct, "DIRECT_BUFFER_BYTES", SMALL_BUFFER)
    gen = np.random.default_rng(seed)
    offset = int(gen.integers(0, 3 * DIRECT_ALIGN))  # unaligned, or aligned by chance
    nbytes = int(gen.integers(direct.DIRECT_MIN_BYTES, 9 * SMALL_BUFFER))
    pieces = _random_run(gen, offset, nbytes)
    path = tmp_path / "file"
    size = offset + nbytes + int(gen.integers(0, DIRECT_ALIGN))
    prefix = gen.integers(0, 256, size, dtype=np.uint8)  # what the file holds around the run
    path.write_bytes(prefix.tobytes())
    fd = os.open(path, os.O_WRONLY)
    # an ordinary second descriptor stands for the direct one: the recorder checks alignment
    other = DirectFile(os.open(path, os.O_WRONLY) if usable else None)
    record = Recorder()
    run = DirectRun(fd, other, offset, nbytes, record)
    for piece in pieces:
        run.append(piece)
    run.close()
    direct_fd = other.fd
    other.close()
    os.close(fd)
    expected = prefix.copy()
    expected[offset:offset + nbytes] = np.concatenate(pieces)
    assert path.read_bytes() == expected.tobytes()
    through_cache = sum(n for f, _, n, _ in record.calls if f == fd)
    if usable:
        for f, at, n, address in record.calls:
            if f == direct_fd:
                assert at % DIRECT_ALIGN == 0 and n % DIRECT_ALIGN == 0 and address % DIRECT_ALIGN == 0
        assert through_cache < 2 * DIRECT_ALIGN  # the partial blocks at both ends
        assert through_cache == (-offset % DIRECT_ALIGN) + (offset + nbytes) % DIRECT_ALIGN
    else:
        assert through_cache == nbytes


def test_a_short_run_goes_through_the_page_cache_whole(tmp_path: Path):
    path = tmp_path / "file"
    path.write_bytes(bytes(10_000))
    fd = os.open(path, os.O_WRONLY)
    other = DirectFile(os.open(path, os.O_WRONLY))
    record = Recorder()
    run = DirectRun(fd, other, 100, direct.DIRECT_MIN_BYTES - 1, record)
    assert run.staging_bytes == 0
    run.append(np.full(direct.DIRECT_MIN_BYTES - 1, 7, dtype=np.uint8))
    run.close()
    other.close()
    os.close(fd)
    assert {f for f, *_ in record.calls} == {fd}
    assert path.read_bytes()[100:100 + direct.DIRECT_MIN_BYTES - 1] == bytes([7]) * (direct.DIRECT_MIN_BYTES - 1)


def test_a_refused_direct_write_falls_back_to_the_page_cache_for_the_rest(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(direct, "DIRECT_BUFFER_BYTES", SMALL_BUFFER)
    path = tmp_path / "file"
    path.write_bytes(bytes(20 * SMALL_BUFFER))
    fd = os.open(path, os.O_WRONLY)
    other = DirectFile(os.open(path, os.O_WRONLY))
    refused: list[int] = []

    def refusing(f: int, data, offset: int) -> None:
        if f == other.fd and not other.refused:
            refused.append(offset)
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        direct.pwrite_all(f, data, offset)

    data = np.random.default_rng(3).integers(0, 256, 15 * SMALL_BUFFER + 123, dtype=np.uint8)
    run = DirectRun(fd, other, 77, data.size, refusing)
    for piece in np.array_split(data, 9):
        run.append(piece)
    run.close()
    other.close()
    os.close(fd)
    assert len(refused) == 1 and other.refused
    assert path.read_bytes()[77:77 + data.size] == data.tobytes()


@pytest.mark.parametrize("on_io_thread", [True, False])
def test_a_failed_direct_write_is_raised_not_swallowed(tmp_path: Path, monkeypatch, on_io_thread: bool):
    """A disk-full error from a direct write (on the I/O thread, or the last blocks written at
    `close`) reaches the writer as the OSError it is."""
    monkeypatch.setattr(direct, "DIRECT_BUFFER_BYTES", SMALL_BUFFER)
    path = tmp_path / "file"
    path.write_bytes(bytes(20 * SMALL_BUFFER))
    fd = os.open(path, os.O_WRONLY)
    other = DirectFile(os.open(path, os.O_WRONLY))
    nbytes = 3 * SMALL_BUFFER + (DIRECT_ALIGN if not on_io_thread else 0)

    def full(f: int, data, offset: int) -> None:
        at_close = offset + memoryview(data).nbytes == nbytes
        if f == other.fd and (on_io_thread or at_close):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        direct.pwrite_all(f, data, offset)

    run = DirectRun(fd, other, 0, nbytes, full)
    with pytest.raises(OSError) as caught:
        for piece in np.array_split(np.ones(nbytes, dtype=np.uint8), 5):
            run.append(piece)
        run.close()
    other.close()
    os.close(fd)
    assert caught.value.errno == errno.ENOSPC


def _state(gen: torch.Generator, rows: int) -> dict:
    model = {"dense.weight": torch.randn(5, 3, generator=gen),
             "embeddings.a.weight": torch.randn(rows, 16, generator=gen) * torch.rand(rows, 1, generator=gen) ** 4,
             "embeddings.a.state": torch.rand(rows, 1, generator=gen)}
    return {"format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION, "spec": "{}", "plan": "{}", "model": model,
            "dense_optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": []}]},
            "rng": {"torch": torch.get_rng_state()}, "position": {"epoch": 0, "batch": 2, "step": 2, "samples": 8},
            "skipped_batches": 0}


STREAMS = {"embeddings.a.weight": ("a", 0), "embeddings.a.state": ("a", 1)}


def _direct_flags(fds: set[int]) -> dict[int, bool]:
    return {fd: bool(fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_DIRECT", 0)) for fd in fds}


def test_a_streamed_table_goes_around_the_page_cache_while_rows_change_and_equals_the_snapshot(
        tmp_path: Path, monkeypatch):
    """The tables of a streamed checkpoint (2.6 MB; small staging buffers: many swaps on the I/O
    thread) are written almost wholly through a descriptor opened O_DIRECT (where the file system
    takes it), while steps change skewed rows; the file equals `save_checkpoint` of the snapshot."""
    if not DirectFile.open(_probe(tmp_path)).usable:
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(direct, "DIRECT_BUFFER_BYTES", 16 * DIRECT_ALIGN)
    gen = torch.Generator().manual_seed(11)
    state = _state(gen, 40_000)
    expected = {**state, "model": {k: v.clone() for k, v in state["model"].items()}}
    weight, opt = state["model"]["embeddings.a.weight"], state["model"]["embeddings.a.state"]
    snap = TableSnapshot({"a": (weight, opt)}, chunk_rows=997)
    seen: dict[int, list[int]] = {}
    flags: dict[int, bool] = {}
    lock = threading.Lock()

    def recording(fd: int, data, offset: int) -> None:
        with lock:
            if fd not in flags:
                flags.update(_direct_flags({fd}))
            seen.setdefault(fd, []).append(memoryview(data).nbytes)
        direct.pwrite_all(fd, data, offset)

    monkeypatch.setattr(stream, "_pwrite_all", recording)
    done = threading.Event()
    writer = threading.Thread(target=lambda: (save_streamed(tmp_path / "checkpoint.pt", state, STREAMS, snap),
                                              done.set()))
    writer.start()
    steps = 0
    while not done.is_set() and writer.is_alive():
        ids = (torch.rand(300, generator=gen) ** 3 * weight.shape[0]).long()
        snap.before_write("a", ids)
        weight.index_add_(0, ids, torch.randn(ids.numel(), 16, generator=gen))
        opt.index_add_(0, ids, torch.rand(ids.numel(), 1, generator=gen))
        steps += 1
    writer.join(60)
    assert done.is_set() and steps > 0
    table_bytes = weight.numel() * 4 + opt.numel() * 4
    through_direct = sum(sum(sizes) for fd, sizes in seen.items() if flags[fd])
    assert through_direct > table_bytes - 4 * DIRECT_ALIGN
    save_checkpoint(tmp_path / "expected.pt", expected)
    assert (tmp_path / "checkpoint.pt").read_bytes() == (tmp_path / "expected.pt").read_bytes()
    assert snap.peak_extra_bytes >= 2 * 16 * DIRECT_ALIGN  # the staging buffers are counted
    loaded = load_checkpoint(tmp_path / "checkpoint.pt")
    assert torch.equal(loaded["model"]["embeddings.a.weight"], expected["model"]["embeddings.a.weight"])


def _probe(folder: Path) -> Path:
    probe = folder / "probe"
    probe.write_bytes(b"")
    return probe


def test_a_disk_full_in_a_direct_write_is_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path, monkeypatch):
    if not DirectFile.open(_probe(tmp_path)).usable:
        pytest.skip("this file system refuses O_DIRECT")
    monkeypatch.setattr(direct, "DIRECT_BUFFER_BYTES", 4 * DIRECT_ALIGN)
    gen = torch.Generator().manual_seed(4)
    path = tmp_path / "checkpoint.pt"
    _probe(tmp_path).unlink()
    save_checkpoint(path, _state(gen, 100))
    before = path.read_bytes()
    state = _state(gen, 20_000)
    snap = TableSnapshot({"a": (state["model"]["embeddings.a.weight"], state["model"]["embeddings.a.state"])})
    writes = {"direct": 0}

    def full_after_a_while(fd: int, data, offset: int) -> None:
        if _direct_flags({fd})[fd]:
            writes["direct"] += 1
            if writes["direct"] == 3:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        direct.pwrite_all(fd, data, offset)

    monkeypatch.setattr(stream, "_pwrite_all", full_after_a_while)
    with pytest.raises(CheckpointError) as caught:
        save_streamed(path, state, STREAMS, snap)
    message = str(caught.value)
    assert writes["direct"] >= 3 and "\n" not in message
    assert message.startswith(f"could not write checkpoint {path}: No space left on device")
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint.pt"]
    assert read_torch_file(path)["position"]["step"] == 2


def test_a_failed_first_checkpoint_does_not_claim_a_previous_one(tmp_path: Path, monkeypatch):
    """A disk full at a run's first checkpoint said 'the previous checkpoint is intact' where there
    was none (and the refused run's folder was then removed); now the line says none was there,
    and a failed later checkpoint still says the previous one is kept."""
    gen = torch.Generator().manual_seed(5)
    path = tmp_path / "checkpoint.pt"

    def full(fd: int, data, offset: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    real = stream._pwrite_all
    monkeypatch.setattr(stream, "_pwrite_all", full)
    state = _state(gen, 100)
    snap = TableSnapshot({"a": (state["model"]["embeddings.a.weight"], state["model"]["embeddings.a.state"])})
    with pytest.raises(CheckpointError) as caught:
        save_streamed(path, state, STREAMS, snap)
    assert "previous checkpoint" not in str(caught.value) and "no checkpoint was there before it" in str(caught.value)
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setattr(stream, "_pwrite_all", real)
    save_checkpoint(path, _state(gen, 100))
    monkeypatch.setattr(stream, "_pwrite_all", full)
    state = _state(gen, 100)
    snap = TableSnapshot({"a": (state["model"]["embeddings.a.weight"], state["model"]["embeddings.a.state"])})
    with pytest.raises(CheckpointError) as caught:
        save_streamed(path, state, STREAMS, snap)
    assert str(caught.value).endswith("the previous checkpoint is intact")
