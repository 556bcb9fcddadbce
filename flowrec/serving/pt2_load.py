"""Reading a checked `torch.export` archive with each schema class's type hints looked up once,
and each symbolic size's text parsed once.

torch 2.13's deserialiser (`torch._export.serde.serialize._dict_to_dataclass`) turns the
program's JSON into the dataclasses of its schema and asks `typing.get_type_hints` of the class
at every object it makes: 154,010 times for a 1,000-field program, 10.1 s of its load (3.4 s
with each class's hints looked up once). It also parses every symbolic size it meets with
`sympy.sympify` (sympy's parser, about 3.5 ms a call): 5,033 calls for a 1,000-field program, of
1,002 distinct texts (the batch size `Symbol('s37', positive=True, integer=True)` and its
`Add(..., Integer(1))` 4,033 times). `load_program` is `torch.export.load` with the `typing` and
the `sympy` that module sees replaced, for the duration of the call only (under a lock), by copies
whose `get_type_hints` remembers each class's hints (the schema's classes never change) and whose
`sympify` remembers each text's expression for the names it reads (`_remembering_sympy`: the
same text with the same objects behind its names is the same expression; sympy's expressions
never change). Where this torch lacks the private module, `load_program` is plain
`torch.export.load`.

torch also unpickles the archive's example inputs (2,001 tensors for a 1,000-field program), which
`check_archive` has just unpickled the same way (`torch.load(weights_only=True)`, torch's own
first try) to check them: given what the check made of them (`CheckedArchive`), `load_program`
hands torch that object for a record of the same bytes instead of unpickling it a second time.

The archive must have been checked first (`flowrec.serving.pt2_check.check_archive`): this
changes how fast torch reads it, nothing of what torch reads or runs.

Example:
    >>> program = load_program(Path("pkg/model.pt2"))  # doctest: +SKIP
"""
from __future__ import annotations

import re
import threading
import types
import typing
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import sympy
import torch

from flowrec.serving.pt2_check import CheckedArchive

try:  # private: checked below, with a fallback
    from torch._export.serde import serialize as _serialize
except ImportError:  # another torch
    _serialize = None

_PATCH_LOCK = threading.Lock()  # the replacement is module-wide while it lasts


def load_program(path: Path, checked: CheckedArchive | None = None) -> torch.export.ExportedProgram:
    """`torch.export.load(path)`, each schema class's type hints looked up once (`checked`: what
    `check_archive(path)` returned, whose example inputs torch then does not unpickle again)."""
    if getattr(_serialize, "typing", None) is not typing or getattr(_serialize, "sympy", None) is not sympy:
        return torch.export.load(path)  # another torch: as it is
    with _PATCH_LOCK, _remembered(checked or CheckedArchive()):
        return torch.export.load(path)


@contextmanager
def _remembered(checked: CheckedArchive) -> Iterator[None]:
    artifact = getattr(_serialize, "deserialize_torch_artifact", None)  # (another torch: unpickled again)
    _serialize.typing, _serialize.sympy = _remembering_typing(), _remembering_sympy()
    if artifact is not None:
        _serialize.deserialize_torch_artifact = _checked_artifact(artifact, checked)
    try:
        yield
    finally:
        _serialize.typing, _serialize.sympy = typing, sympy
        if artifact is not None:
            _serialize.deserialize_torch_artifact = artifact


def _checked_artifact(artifact: Callable[[Any], Any], checked: CheckedArchive) -> Callable[[Any], Any]:
    """torch's ``deserialize_torch_artifact``, answering the checked example inputs' record (the
    same bytes) with what `check_archive` unpickled of it."""
    def deserialize_torch_artifact(serialized: Any) -> Any:
        if checked.sample_record is not None and isinstance(serialized, bytes) and serialized == checked.sample_record:
            return checked.sample_inputs
        return artifact(serialized)

    return deserialize_torch_artifact


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


NAME = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")  # every word of a text, quoted or not (a superset of its names)


def _remembering_sympy() -> types.SimpleNamespace:
    """The names of `sympy`, its `sympify` remembering the expression of each text parsed with
    `locals`, keyed by the text and the object `locals` gives for each word of it (the objects,
    held by the key: sympy's equal objects are interchangeable): a name `locals` maps to another
    object since (or newly maps) is a new key, so a remembered answer is the one sympy's parser
    would give now. Other calls are sympy's own.

    >>> remembering = _remembering_sympy()
    >>> s = sympy.Symbol("s0", positive=True, integer=True)
    >>> text = "Add(Symbol('s0', positive=True, integer=True), Integer(1))"
    >>> remembering.sympify(text, locals={}) == s + 1, remembering.sympify(text, locals={}) is remembering.sympify(text, locals={})
    (True, True)
    >>> remembering.sympify("s0 + 1", locals={"s0": s}) == s + 1, remembering.sympify("s0 + 1", locals={"s0": s * 2}) == 2 * s + 1
    (True, True)
    """
    seen: dict[tuple, Any] = {}

    def sympify(a: Any, *args: Any, locals: dict | None = None, **kwargs: Any) -> Any:
        if not isinstance(a, str) or args or kwargs or not isinstance(locals, dict):
            return sympy.sympify(a, *args, locals=locals, **kwargs)
        key = (a, *((word, locals[word]) for word in NAME.findall(a) if word in locals))
        try:
            expression = seen.get(key)
        except TypeError:  # (a name's object of no hash: parsed each time)
            return sympy.sympify(a, locals=locals)
        if expression is None:
            expression = seen[key] = sympy.sympify(a, locals=locals)
        return expression

    return types.SimpleNamespace(**{**vars(sympy), "sympify": sympify})
