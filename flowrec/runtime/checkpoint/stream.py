"""Full checkpoints streamed from the live tables: copy-on-write by chunks, bounded memory.

`save_streamed(path, state, streams, snapshot)` writes the checkpoint `save_checkpoint` would write
for `state` with each packed table as it was when `snapshot` (a `TableSnapshot`) was taken, without
copying the tables: only one chunk of rows, the rows training saved for the snapshot and two
staging buffers of the direct writes (`flowrec.runtime.checkpoint.direct`, 1 MiB each) are ever
held besides them.

1. layout: `torch.save` under `torch.serialization.skip_data` writes the archive with holes where
   the storage bytes go; each table stands in as an untouched host tensor (virtual memory only),
   the digest as a random placeholder of the same length;
2. offsets: the archive loaded on the meta device gives each storage's offset in the file;
3. content: the state is walked in the digest's order (`content_digest`); each tensor's bytes are
   hashed and written at their offset, a table's chunk by chunk from the snapshot, as one
   `DirectRun`: its aligned middle by O_DIRECT from the file's I/O thread (no page cache: on the
   2-core VM the page cache cost the writer 0.4-4.8 s of CPU per 2 GiB), the partial blocks at its
   ends through the page cache; where O_DIRECT is refused, all of it through the page cache;
4. the digest is written over its placeholder in `data.pkl`; the temp file is fsynced and renamed
   over `path` (`write_atomically_at`), so a kill at any moment leaves the previous checkpoint.

Example:
    >>> snap = TableSnapshot({"g0": (weight, state)})  # doctest: +SKIP
    >>> digest = save_streamed(path, state, {"embeddings.g0.weight": ("g0", 0), "embeddings.g0.state": ("g0", 1)}, snap)  # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterable, Iterator, Mapping

import torch
from torch.utils.serialization import config as serialization_config

from flowrec.runtime.atomic import write_atomically_at
from flowrec.runtime.checkpoint.direct import DirectFile, DirectRun
from flowrec.runtime.checkpoint.direct import pwrite_all as _pwrite_all
from flowrec.runtime.checkpoint.store import write_errors
from flowrec.runtime.checkpoint.format import CheckpointError, content_digest
from flowrec.runtime.checkpoint.incremental import TableSnapshot

DIGEST_BYTES = 32  # SHA-256; the placeholder is as many random bytes, in hex like the digest
PICKLE_RECORD = "data.pkl"


def save_streamed(path: Path, state: dict[str, Any], streams: Mapping[str | tuple[str, ...], tuple[str, int]],
                  snapshot: TableSnapshot,
                  check: Callable[[str, torch.Tensor], None] | None = None) -> str:
    """Write `state` to `path` atomically, its tables streamed from `snapshot` (module docstring).

    Args:
        path: the checkpoint file; its folder must exist.
        state: the checkpoint content (without `digest`); `state["model"][key]` for each key of
            `streams` is the live table (only its shape and dtype are read).
        streams: model key -> (group, tensor index) of the snapshot that holds its rows; a key
            may also be a tuple of nested keys from the top of `state` (a rank's shard:
            ("groups", group, "weight")).
        snapshot: the tables as taken.
        check: called with (key, rows) on each chunk before it is written (raise to stop the write).

    Returns:
        The content digest written into the file.

    Raises:
        CheckpointError: the write failed; the previous checkpoint at `path` is untouched.
        Exception: whatever `check` raised, as raised (the previous checkpoint is untouched too).
    """
    path = Path(path)
    content: dict[str, Any] = dict(state)
    stand_ins: dict[int, tuple[str, str, int]] = {}
    for key, (group, index) in streams.items():
        where = ("model", key) if isinstance(key, str) else tuple(key)
        live = _at(state, where)
        stand_in = torch.empty(live.shape, dtype=live.dtype)  # never touched: no memory
        content = _put(content, where, stand_in)
        stand_ins[id(stand_in)] = (key if isinstance(key, str) else ".".join(where), group, index)
    digests: list[str] = []

    def write(f: BinaryIO, tmp: Path) -> None:
        placeholder = os.urandom(DIGEST_BYTES).hex()
        with serialization_config.patch({"save.compute_crc32": False}), torch.serialization.skip_data():
            torch.save({**content, "digest": placeholder}, f)
        f.flush()
        direct = DirectFile.open(tmp)
        try:
            writer = _ContentWriter(f.fileno(), direct, _storage_offsets(tmp, content), stand_ins, snapshot, check)
            digest = content_digest(content, writer.tensor_bytes)
        finally:
            direct.close()
        writer.check_complete(tmp)
        _write_digest(f.fileno(), tmp, placeholder, digest)
        digests.append(digest)

    try:
        with write_errors(path, content):
            write_atomically_at(path, write)
    except _Stopped as stop:  # `check` refused a chunk: its own error, not a write failure
        raise stop.error from None
    return digests[0]


def _at(state: Mapping[str, Any], where: tuple[str, ...]) -> Any:
    """The value at nested keys `where` of `state`."""
    value: Any = state
    for key in where:
        value = value[key]
    return value


def _put(state: dict[str, Any], where: tuple[str, ...], value: Any) -> dict[str, Any]:
    """A copy of `state` with `value` at nested keys `where` (the dicts on the way copied, the
    caller's left as they are)."""
    out = dict(state)
    out[where[0]] = value if len(where) == 1 else _put(state[where[0]], where[1:], value)
    return out


class _Stopped(Exception):
    """`check` refused a chunk with `error`."""

    def __init__(self, error: Exception) -> None:
        super().__init__(str(error))
        self.error = error


class _ContentWriter:
    """Writes each tensor's storage bytes at its offset while the digest walk reads them; a
    table's bytes as one `DirectRun` (its aligned middle around the page cache, on `direct`)."""

    def __init__(self, fd: int, direct: DirectFile, offsets: dict[int, tuple[int, int]],
                 stand_ins: dict[int, tuple[str, str, int]], snapshot: TableSnapshot,
                 check: Callable[[str, torch.Tensor], None] | None) -> None:
        self.fd = fd
        self.direct = direct
        self.offsets = offsets  # id(tensor) -> (file offset of its storage, storage bytes)
        self.stand_ins = stand_ins
        self.snapshot = snapshot
        self.check = check
        self.written: set[int] = set()  # file offsets of the storages written

    def tensor_bytes(self, t: torch.Tensor) -> Iterable[Any]:
        offset, nbytes = self.offsets[id(t)]
        if id(t) in self.stand_ins:
            return self._table(t, offset)
        if offset not in self.written and nbytes:
            storage = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage(), 0, (nbytes,))
            _pwrite_all(self.fd, storage.cpu().numpy(), offset)
        self.written.add(offset)
        flat = t.detach().cpu().contiguous()
        return (flat.reshape(-1).view(torch.uint8).numpy(),) if flat.numel() else ()

    def _table(self, t: torch.Tensor, offset: int) -> Iterator[Any]:
        key, group, index = self.stand_ins[id(t)]
        self.written.add(offset)
        run = DirectRun(self.fd, self.direct, offset, t.numel() * t.element_size(), _pwrite)
        self.snapshot.writer_bytes = run.staging_bytes  # counted in the snapshot's peak extra bytes
        for _, rows in self.snapshot.chunks(group, index):
            if self.check is not None:
                try:
                    self.check(key, rows)
                except Exception as exc:
                    raise _Stopped(exc) from None
            data = rows.reshape(-1).view(torch.uint8).numpy()
            if data.size:
                run.append(data)  # the chunks come in row order: the run's bytes in file order
                yield data
        run.close()
        self.snapshot.writer_bytes = 0

    def check_complete(self, tmp: Path) -> None:
        """Every storage of the archive was written (a guard on the walk covering the state)."""
        missing = {offset for offset, nbytes in self.offsets.values() if nbytes} - self.written
        if missing:
            raise CheckpointError(f"streamed checkpoint {tmp.name}: {len(missing)} storages were not written")


def _storage_offsets(tmp: Path, content: dict[str, Any]) -> dict[int, tuple[int, int]]:
    """id(tensor of `content`) -> (file offset of its storage, storage bytes), from the layout."""
    laid_out = torch.load(tmp, map_location="meta", weights_only=True)
    offsets = {}
    for mine, meta in zip(_tensors(content), _tensors(laid_out), strict=True):
        storage = meta.untyped_storage()
        offsets[id(mine)] = (int(storage._checkpoint_offset), storage.nbytes())
    return offsets


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    """The tensors of a nested dict / list / tuple, in the order a pickle of it stores them."""
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _tensors(item)


def _write_digest(fd: int, tmp: Path, placeholder: str, digest: str) -> None:
    """Put `digest` over its placeholder in the archive's pickle record."""
    with open(tmp, "rb") as f:
        reader = torch._C.PyTorchFileReader(f)
        offset = reader.get_record_offset(PICKLE_RECORD)
        data = bytes(reader.get_record(PICKLE_RECORD))
    mark = placeholder.encode()
    if data.count(mark) != 1 or len(digest) != len(placeholder):
        raise CheckpointError(f"streamed checkpoint {tmp.name}: the digest's place was not found")
    _pwrite_all(fd, digest.encode(), offset + data.index(mark))


def _pwrite(fd: int, data: Any, offset: int) -> None:
    """Every write of a streamed checkpoint's bytes, direct or not, goes through `_pwrite_all`
    (looked up at the call: one place where tests count or fail writes)."""
    _pwrite_all(fd, data, offset)

