"""Long runs of checkpoint bytes written around the page cache (O_DIRECT), the ends through it.

A streamed full checkpoint writes each packed table (GiBs) as one run of bytes at a known offset
of the temp file (`flowrec.runtime.checkpoint.stream`). Written through the page cache, every page
of it is a new page-cache page: on the 2-core VM this cost the writer thread 0.4-4.8 s of CPU per
2 GiB (page allocation; the most when the memory was not touched lately), beside training on the
same cores, and the fsync then waited for the cache to reach the disk. `DirectRun` sends the aligned
middle of a run to the disk by O_DIRECT instead, through two aligned staging buffers (a memcpy per
byte; the disk's DMA does the rest: ~0.2 s of CPU per 2 GiB): one is written by the file's I/O
thread while the writer fills the other, so the writer hashes on while the disk works. The partial
blocks at the run's two ends (which share a block with the archive's own records) go through the
page cache, so no block is written both ways. Durability is unchanged: the temp file is still
fsynced (which flushes the device's cache for the direct writes too) before it is renamed.

Where O_DIRECT is not available (another OS, a file system that refuses to open a file with it)
or a direct write is refused for its alignment (EINVAL), the bytes go through the page cache as
before; any other error (disk full, I/O error) is raised as it is.

Example:
    >>> direct = DirectFile.open(tmp)                       # doctest: +SKIP
    >>> run = DirectRun(fd, direct, offset)                 # doctest: +SKIP
    >>> for chunk in chunks: run.append(chunk)              # doctest: +SKIP
    >>> run.close(); direct.close()                         # doctest: +SKIP
"""
from __future__ import annotations

import errno
import os
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

import numpy as np

DIRECT_ALIGN = 4096  # bytes: offsets, lengths and buffer addresses of direct writes (a logical block or a multiple)
DIRECT_BUFFER_BYTES = 1 << 20  # bytes of each of a run's two aligned staging buffers (a multiple of DIRECT_ALIGN)
DIRECT_MIN_BYTES = 4 * DIRECT_ALIGN  # runs shorter than this go through the page cache whole
STAGING_BUFFERS = 2  # one filled while the other is on its way to the disk


class DirectFile:
    """An O_DIRECT descriptor on a file being written, and the one thread that writes through it
    (a direct write waits for the disk; the thread lets the writer hash the next buffer meanwhile).

    Args:
        fd: the descriptor, or None where O_DIRECT is not available.
    """

    def __init__(self, fd: int | None) -> None:
        self.fd = fd
        self.refused = False  # a direct write was refused for its alignment: no more direct writes
        self._io: ThreadPoolExecutor | None = None

    @classmethod
    def open(cls, path: Path) -> "DirectFile":
        """A second, direct descriptor on `path` (already created), or none where refused."""
        flag = getattr(os, "O_DIRECT", None)
        if flag is None:
            return cls(None)
        try:
            return cls(os.open(path, os.O_WRONLY | flag))
        except OSError:
            return cls(None)

    @property
    def usable(self) -> bool:
        """Direct writes can be tried (a descriptor, and no write refused for its alignment)."""
        return self.fd is not None and not self.refused

    def submit(self, write: Callable[[], None]) -> Future:
        """Run `write` on the file's I/O thread (in order)."""
        if self._io is None:
            self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="flowrec-direct-io")
        return self._io.submit(write)

    def close(self) -> None:
        """Wait for the writes in flight (their errors dropped: a run's `close` raised them), then
        close the descriptor."""
        if self._io is not None:
            self._io.shutdown(wait=True)
            self._io = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            os.close(fd)


class DirectRun:
    """Bytes appended in file order from `offset` on: whole aligned blocks by O_DIRECT (through two
    aligned staging buffers, one written on the file's I/O thread while the other fills), the
    partial blocks at both ends through the page cache (`fd`).

    Args:
        fd: the file's ordinary descriptor.
        direct: its direct descriptor (`DirectFile`; unusable: everything through `fd`).
        offset: the file offset of the run's first byte.
        nbytes: the run's length, when known: a short run goes through the page cache whole.
        pwrite: writes all of a buffer at an offset of a descriptor (default `pwrite_all`).

    Raises (`append`, `close`):
        OSError: a write failed (disk full, I/O error); EINVAL from a direct write is not an
            error: that write and every later one go through the page cache.
    """

    def __init__(self, fd: int, direct: DirectFile, offset: int, nbytes: int | None = None,
                 pwrite: Callable[[int, Any, int], None] | None = None) -> None:
        self.fd = fd
        self.direct = direct
        self.pwrite = pwrite or pwrite_all
        self.position = offset  # file offset of the next byte appended
        self._staged_at = -(-offset // DIRECT_ALIGN) * DIRECT_ALIGN  # file offset of the current buffer
        self._staged = 0  # bytes in the current buffer
        self._current = 0
        self._in_flight: list[Future | None] = [None] * STAGING_BUFFERS  # per buffer: its write
        self._size = DIRECT_BUFFER_BYTES  # bytes of each staging buffer
        short = nbytes is not None and nbytes < DIRECT_MIN_BYTES
        if short:
            self._staged_at = offset + nbytes  # nothing staged: the whole run through the page cache
        staged = direct.usable and not short
        self._buffers = [_aligned(self._size) for _ in range(STAGING_BUFFERS)] if staged else []  # (size,) uint8

    @property
    def staging_bytes(self) -> int:
        """Host bytes of the run's staging buffers."""
        return sum(buffer.nbytes for buffer in self._buffers)

    def append(self, data: Any) -> None:
        """Write `data` (a buffer of bytes) next in the run."""
        view = memoryview(data).cast("B")
        if self.position < self._staged_at:  # the head, up to the first aligned block
            head = min(len(view), self._staged_at - self.position)
            self.pwrite(self.fd, view[:head], self.position)
            self.position, view = self.position + head, view[head:]
        while len(view):
            if not self._buffers or (not self.direct.usable and not self._staged):
                self.pwrite(self.fd, view, self.position)
                self.position += len(view)
                self._staged_at = self.position
                return
            buffer = self._buffers[self._current]
            take = min(len(view), self._size - self._staged)
            buffer[self._staged:self._staged + take] = np.frombuffer(view[:take], dtype=np.uint8)
            self._staged, self.position, view = self._staged + take, self.position + take, view[take:]
            if self._staged == self._size:
                self._send()

    def close(self) -> None:
        """Write what is staged (its whole blocks directly, the partial last block through the page
        cache) and wait for every write of the run."""
        try:
            whole = self._staged - self._staged % DIRECT_ALIGN
            if whole:
                self._wait_all()
                self._write_blocks(self._buffers[self._current][:whole], self._staged_at)
            if self._staged > whole:
                self.pwrite(self.fd, self._buffers[self._current][whole:self._staged], self._staged_at + whole)
            self._staged_at, self._staged = self._staged_at + self._staged, 0
            self._wait_all()
        finally:
            self._buffers = []

    def _send(self) -> None:
        """Hand the full current buffer to the I/O thread and go on with the other one (once its
        own write is done)."""
        data, at = self._buffers[self._current], self._staged_at
        self._in_flight[self._current] = self.direct.submit(lambda: self._write_blocks(data, at))
        self._current = (self._current + 1) % STAGING_BUFFERS
        self._staged_at, self._staged = at + self._size, 0
        self._wait(self._current)

    def _wait(self, index: int) -> None:
        """Wait for buffer `index`'s write (raise its error)."""
        future, self._in_flight[index] = self._in_flight[index], None
        if future is not None:
            future.result()

    def _wait_all(self) -> None:
        for index in range(STAGING_BUFFERS):
            self._wait(index)

    def _write_blocks(self, data: np.ndarray, at: int) -> None:
        """Write whole blocks at `at`: directly, or through the page cache where refused."""
        if self.direct.usable:
            try:
                self.pwrite(self.direct.fd, data, at)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self.direct.refused = True  # alignment refused: this and every later write through the page cache
        self.pwrite(self.fd, data, at)


def _aligned(nbytes: int) -> np.ndarray:
    """An uninitialized (nbytes,) uint8 array whose first byte is DIRECT_ALIGN-aligned."""
    raw = np.empty(nbytes + DIRECT_ALIGN, dtype=np.uint8)
    start = -raw.ctypes.data % DIRECT_ALIGN
    return raw[start:start + nbytes]


def pwrite_all(fd: int, data: Any, offset: int) -> None:
    """Write every byte of `data` at `offset` (pwrite may write less than asked)."""
    view = memoryview(data).cast("B")
    while len(view):
        done = os.pwrite(fd, view, offset)
        view, offset = view[done:], offset + done
