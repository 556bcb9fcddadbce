"""Saving a `torch.export` program without a transient copy of its weights.

`torch.export.save` (torch 2.13) turns each weight into a Python `bytes` object before it writes
it into the archive: a transient copy of every table (of the largest, at times two), which put
the peak of exporting DLRM-Criteo at 1.8x its tables' bytes. `save_program` writes the same
archive, byte for byte, but hands each weight's storage to the archive writer
(`PyTorchFileWriter.write_record` with a storage, as `torch.save` writes tensors), so nothing is
copied. It does so by running `torch.export.save` with torch's private ``_save_raw_tensors``
replaced, for the duration of the call only (under a lock), by the same function with that one
change. Where this torch lacks the private pieces, `save_program` is plain `torch.export.save`.

Example:
    >>> save_program(torch.export.export(model, example), Path("pkg/model.pt2"))  # doctest: +SKIP
    True
"""
from __future__ import annotations

import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

try:  # private: checked below, with a fallback
    from torch.export.pt2_archive import _package
except ImportError:  # another torch
    _package = None

NEEDED = ("_save_raw_tensors", "Weights", "group_weights", "get_complete_tensor", "schema",
          "serialize_tensor_meta", "_is_fake_tensor")
_PATCH_LOCK = threading.Lock()  # the replacement is module-wide while it lasts


def zero_copy_supported() -> bool:
    """True if this torch has the private pieces `save_program` relies on."""
    return _package is not None and all(hasattr(_package, name) for name in NEEDED)


def save_program(program: torch.export.ExportedProgram, path: Path) -> bool:
    """`torch.export.save(program, path)`, writing each weight from its storage without a copy.

    Returns:
        True if the weights were written without a copy, False if torch.export.save ran as is.
    """
    if not zero_copy_supported():
        with _PATCH_LOCK, _archive_closed_on_failure():
            torch.export.save(program, path)
        return False
    with _PATCH_LOCK, _archive_closed_on_failure(), _storages_written_directly():
        torch.export.save(program, path)
    return True


@contextmanager
def _archive_closed_on_failure() -> Iterator[None]:
    """While it lasts, an archive whose write fails (a full disk, a file size limit) is closed
    once, its own error dropped, and the write's error raised. torch's writer leaves the archive
    open then (its ``__exit__`` writes two more records, which fail too), and the C++ writer's
    destructor closes it later, at garbage collection or the interpreter's teardown: a second
    failure there, inside a destructor, is ``std::terminate``, so the command's one-line error was
    followed by an abort (exit 134) instead of its exit status."""
    writer = getattr(_package, "PT2ArchiveWriter", None)
    if writer is None:
        yield
        return
    original = writer.__exit__

    def __exit__(self, exc_type, exc, tb):  # noqa: N807 (the method it replaces)
        if exc_type is None:
            return original(self, exc_type, exc, tb)
        try:
            self.archive_file.write_end_of_file()  # marks the writer finished, even when it fails
        except Exception:  # noqa: BLE001 (the archive is abandoned; the write's error is the one raised)
            pass
        return False

    writer.__exit__ = __exit__
    try:
        yield
    finally:
        writer.__exit__ = original


@contextmanager
def _storages_written_directly() -> Iterator[None]:
    original = _package._save_raw_tensors
    _package._save_raw_tensors = _save_raw_tensors
    try:
        yield
    finally:
        _package._save_raw_tensors = original


def _save_raw_tensors(raw_items: dict[str, tuple[torch.Tensor, Any]], model_name: str, archive_writer: Any,
                      config: dict[str, Any], directory: str, filename_prefix: str, idx: int) -> int:
    """torch's ``_save_raw_tensors`` (deduplicated raw weights, one record per storage group), the
    record written from the storage instead of from a `bytes` copy of it."""
    if not raw_items:
        return idx
    weights_dict = {model_name: _package.Weights(raw_items)}
    for group in _package.group_weights(weights_dict):
        complete_tensor = _package.get_complete_tensor(group, weights_dict)
        path_name = f"{filename_prefix}{idx}"
        _write_storage(archive_writer, os.path.join(directory, path_name), complete_tensor)
        idx += 1
        for _, item_fqn in group:
            tensor, _ = weights_dict[model_name].get_weight(item_fqn)
            config[item_fqn] = _package.schema.PayloadMeta(
                path_name=path_name, is_param=isinstance(tensor, torch.nn.Parameter), use_pickle=False,
                tensor_meta=_package.serialize_tensor_meta(tensor))
    return idx


def _write_storage(archive_writer: Any, name: str, tensor: torch.Tensor) -> None:
    """The record of a tensor: the bytes of its whole untyped storage (as torch writes them)."""
    if _package._is_fake_tensor(tensor) or not tensor.data_ptr():
        archive_writer.write_bytes(name, b"")
        return
    storage = tensor.cpu().untyped_storage()  # no copy for a CPU tensor
    archive_writer.archive_file.write_record(name, storage, storage.nbytes())


def movable(program: torch.export.ExportedProgram) -> torch.export.ExportedProgram:
    """`program` with its tensor constants as non-persistent buffers (the same tensors, names and
    archive records), in place: the module of a loaded program moves its parameters and buffers
    with `.to(device)` but leaves constants (a dense node's column gather, a custom module's plain
    tensor attribute) on the device they were traced on, so a program moved to a GPU gathered
    with a CPU index, or refused its own constant."""
    from torch.export.graph_signature import InputKind, InputSpec

    specs = program.graph_signature.input_specs
    specs[:] = [InputSpec(InputKind.BUFFER, s.arg, s.target, persistent=False)
                if s.kind == InputKind.CONSTANT_TENSOR else s for s in specs]
    return program
