"""Row hashes of a conversion's fit pass, kept on disk for its write pass.

A seeded split (rule 3) draws each row's side from a hash of its values
(`flowrec.data.duplicates.row_hashes`). A conversion that fits its encoder reads the input twice,
and each pass hashed every row: the fit pass to leave the test rows out of the encoder, the write
pass to split the rows and count their copies. The fit pass now writes each chunk's hashes to an
unnamed file in the output's staging folder (8 bytes a row, gone when closed or when the process
ends; a conversion of a billion rows never holds them in memory), and the write pass reads them
back chunk by chunk. Both passes read the same rows in the same chunks; a chunk of another size
than the fit pass's (an input changed under the conversion) is hashed again, and so is every
chunk after it.

Example:
    >>> import tempfile
    >>> with tempfile.TemporaryDirectory() as folder, KeptHashes(Path(folder)) as kept:
    ...     kept.put(np.array([5, 7], np.uint64)); kept.put(np.array([9], np.uint64)); kept.done()
    ...     kept.take(2).tolist(), kept.take(1).tolist(), kept.take(1)
    ([5, 7], [9], None)
"""
from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Iterator

import numpy as np

ROW_BYTES = 8  # one uint64 hash a row


class KeptHashes:
    """Each chunk's row hashes written in order (`put`, then `done` once the pass read every chunk),
    then read back in order (`take`: None where the pass was not complete or the chunks differ)."""

    def __init__(self, folder: Path) -> None:
        self._file = tempfile.TemporaryFile(dir=folder, prefix=".row-hashes-")  # unnamed: nothing left behind
        self._sizes: list[int] = []  # rows of each chunk written, in order
        self._next = 0  # the next chunk to take
        self.complete = False

    def put(self, hashes: np.ndarray) -> None:
        """Keep the hashes of the next chunk."""
        self._file.write(np.ascontiguousarray(hashes, np.uint64).tobytes())
        self._sizes.append(len(hashes))

    def done(self) -> None:
        """The pass read every chunk: its hashes may be taken."""
        self._file.flush()
        self._file.seek(0)
        self.complete = True

    def take(self, rows: int) -> np.ndarray | None:
        """The hashes of the next chunk of `rows` rows, or None (hash them again): the pass was not
        complete, every chunk was taken, or the chunk differs from the fit pass's.  # (rows,) uint64"""
        if not self.complete or self._next >= len(self._sizes) or self._sizes[self._next] != rows:
            self.complete = False  # the chunks no longer line up: none after is taken either
            return None
        self._next += 1
        data = self._file.read(rows * ROW_BYTES)
        if len(data) != rows * ROW_BYTES:
            self.complete = False
            return None
        return np.frombuffer(data, np.uint64)

    def replay(self) -> Iterator[np.ndarray]:
        """Every kept chunk's hashes again, from the first (the pass done; for an error's counts, before
        any `take`).  # (rows,) uint64 each"""
        self._file.seek(0)
        for rows in self._sizes:
            yield np.frombuffer(self._file.read(rows * ROW_BYTES), np.uint64)

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> "KeptHashes":
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
