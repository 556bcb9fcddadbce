"""Reading a checked `torch.export` archive with each schema class's type hints looked up once.

torch 2.13's deserialiser (`torch._export.serde.serialize._dict_to_dataclass`) turns the
program's JSON into the dataclasses of its schema and asks `typing.get_type_hints` of the class
at every object it makes: 154,010 times for a 1,000-field program, 10.1 s of its load (3.4 s
with each class's hints looked up once). `load_program` is `torch.export.load` with the `typing`
that module sees replaced, for the duration of the call only (under a lock), by a copy of it
whose `get_type_hints` remembers each class's hints (the schema's classes never change). Where
this torch lacks the private module, `load_program` is plain `torch.export.load`.

The archive must have been checked first (`flowrec.serving.pt2_check.check_archive`): this
changes how fast torch reads it, nothing of what torch reads or runs.

Example:
    >>> program = load_program(Path("pkg/model.pt2"))  # doctest: +SKIP
"""
from __future__ import annotations

import threading
import types
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

try:  # private: checked below, with a fallback
    from torch._export.serde import serialize as _serialize
except ImportError:  # another torch
    _serialize = None

_PATCH_LOCK = threading.Lock()  # the replacement is module-wide while it lasts


def load_program(path: Path) -> torch.export.ExportedProgram:
    """`torch.export.load(path)`, each schema class's type hints looked up once."""
    if getattr(_serialize, "typing", None) is not typing:  # another torch: as it is
        return torch.export.load(path)
    with _PATCH_LOCK, _hints_remembered():
        return torch.export.load(path)


@contextmanager
def _hints_remembered() -> Iterator[None]:
    _serialize.typing = _remembering_typing()
    try:
        yield
    finally:
        _serialize.typing = typing


def _remembering_typing() -> types.SimpleNamespace:
    """The names of `typing`, its `get_type_hints` remembering each answer (per class and namespaces)."""
    seen: dict[tuple, dict[str, Any]] = {}

    def get_type_hints(obj: Any, globalns: Any = None, localns: Any = None, include_extras: bool = False) -> dict:
        key = (obj, id(globalns), id(localns), include_extras)
        try:
            hints = seen.get(key)
        except TypeError:  # (an object of no hash: asked each time)
            return typing.get_type_hints(obj, globalns, localns, include_extras)
        if hints is None:
            hints = seen[key] = typing.get_type_hints(obj, globalns, localns, include_extras)
        return hints

    return types.SimpleNamespace(**{**vars(typing), "get_type_hints": get_type_hints})
