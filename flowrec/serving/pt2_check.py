"""Untrusted `model.pt2` archives: checked before `torch.export.load` reads any of them.

`torch.export.load` (torch 2.13) runs code from the archive in several places: weights and
constants whose record says ``use_pickle`` are read with ``torch.load(weights_only=False)``,
custom and opaque objects are unpickled, legacy weight files and AOTInductor libraries are
loaded, example inputs that the safe unpickler refuses are unpickled again without it, shape
expressions are parsed by ``sympy.sympify`` (Python ``eval``), the guards of the program are
``exec``-ed, and graph targets may name any callable of ``torch``, ``math`` or ``operator``.
`check_archive` reads the archive as data (zipfile, JSON, Python's ``ast``, the safe unpickler)
and refuses, with one line, every archive that is not shaped like one `flowrec export` writes:
only known entries, plain tensor records, ATen / symbolic-arithmetic targets, shape
expressions and guards of a fixed small grammar, plain dotted parameter names.

Example:
    >>> check_archive(Path("pkg/model.pt2"))  # doctest: +SKIP
"""
from __future__ import annotations

import ast
import io
import re
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch

from flowrec.spec.json_doc import parse_json_text
from flowrec.spec.read import MAX_SPEC_BYTES

MAX_PROGRAM_BYTES = 16 * MAX_SPEC_BYTES  # models/model.json (a 1,000-field model's graph is a few MB)
MAX_CONFIG_BYTES = MAX_SPEC_BYTES  # weights / constants configs
MAX_SAMPLE_BYTES = MAX_SPEC_BYTES  # the example inputs the program was traced with
EXPR_CHARS = 4096  # characters of a shape expression, at most, plus PER_INPUT_CHARS per input of the program
PER_INPUT_CHARS = 64  # (the ids of a packed group's fields side by side: a sum of their counts, ~46 characters each)
WEIGHTS_CONFIG = "data/weights/model_weights_config.json"
CONSTANTS_CONFIG = "data/constants/model_constants_config.json"
PROGRAM = "models/model.json"
SAMPLE_INPUTS = "data/sample_inputs/model.pt"
ENTRIES = re.compile(  # everything torch.export.save writes for one program of plain tensors
    r"(archive_format|archive_version|byteorder|\.data/version|\.data/serialization_id"
    r"|models/model\.json|data/sample_inputs/model\.pt"
    r"|data/weights/model_weights_config\.json|data/weights/weight_\d+"
    r"|data/constants/model_constants_config\.json|data/constants/tensor_(constant)?\d+)")
# a constant's record: tensor_constant<N> (older torch) or tensor_<N> (torch 2.13, e.g. a module's
# cached index tensor the trace keeps); read as raw storage like a weight, never pickled (checked)
RECORDS = {WEIGHTS_CONFIG: re.compile(r"weight_\d+"), CONSTANTS_CONFIG: re.compile(r"tensor_(constant)?\d+")}
# a parameter's dotted name; a part may be a spec's module or head name (letters, digits, _ : -; its . as ~,
# `flowrec.runtime.lowering.OpModules`)
FQN = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_:~-]+)*")
SYM_OPS = {"_operator." + op for op in ("add", "sub", "mul", "floordiv", "truediv", "mod", "pow", "neg",
                                         "eq", "ne", "lt", "le", "gt", "ge", "and_", "or_", "not_")}
SYM_OPS |= {"torch.sym_" + op for op in ("float", "int", "max", "min", "not", "sqrt", "ite", "sum")}
SYM_OPS |= {"math." + op for op in ("ceil", "floor", "trunc")}
TARGET = re.compile(r"torch\.ops\.(aten|prims)\.[A-Za-z0-9_]+\.[A-Za-z0-9_]+")
SYMPY_NAMES = {  # what torch's serializer writes in expr_str (sympy srepr) and the names it resolves
    "Symbol", "Integer", "Float", "Rational", "Add", "Mul", "Pow", "Max", "Min", "Eq", "Ne", "Lt", "Le",
    "Gt", "Ge", "And", "Or", "Not", "Abs", "floor", "ceiling", "true", "false", "True", "False", "oo", "zoo",
    "nan", "positive", "integer", "nonnegative", "real", "finite", "FloorDiv", "ModularIndexing", "Where",
    "PythonMod", "Mod", "CleanDiv", "CeilToInt", "FloorToInt", "CeilDiv", "LShift", "RShift", "PowByNatural",
    "FloatPow", "FloatTrueDiv", "IntTrueDiv", "TruncToFloat", "TruncToInt", "RoundToInt", "RoundDecimal",
    "ToFloat", "OpaqueUnaryFn_sqrt", "Identity", "IsNonOverlappingAndDenseIndicator", "BitwiseFn_bitwise_and",
    "BitwiseFn_bitwise_or"}
_SYMPY_TOKEN = re.compile(r"\s+|'[a-z]+[0-9]*'|\d+(\.\d+)?(e[+-]?\d+)?|[A-Za-z_][A-Za-z0-9_]*|[(),=+\-*/]")
GUARD_NODES = (ast.Expression, ast.Compare, ast.BinOp, ast.UnaryOp, ast.BoolOp, ast.Constant, ast.Subscript,
               ast.Call, ast.Attribute, ast.Name, ast.Load, ast.Eq, ast.NotEq, ast.Lt, ast.LtE, ast.Gt, ast.GtE,
               ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.USub, ast.Not, ast.And, ast.Or)
GUARD_NAMES = {"L", "math"}
GUARD_ATTRIBUTES = {"size", "stride", "storage_offset", "dim", "isnan", "inf"}
_PLAIN_TEXT = re.compile(r"[^'\"\\\n\r]*")  # a string constant of a guard (it is pasted into code)
_LINE_BREAKS = re.compile(r"[\r\x00]")  # Python reads a lone CR as a line break: never in generated comments


class ArchiveError(ValueError):
    """A model.pt2 that flowrec will not hand to torch; the message is one line."""


@dataclass(frozen=True)
class CheckedArchive:
    """What `check_archive` read of an archive that torch reads again: the example inputs' record
    and what the safe unpickler made of it (None when the archive holds none)."""

    sample_record: bytes | None = None
    sample_inputs: Any = None


def check_archive(path: Path) -> CheckedArchive:
    """Raise ArchiveError unless `path` is a readable pt2 archive of plain tensors and ATen ops.

    Nothing in the archive is unpickled (except example inputs, by the safe unpickler) or run.
    Returns the example inputs it unpickled, for `flowrec.serving.pt2_load.load_program`.
    """
    path = Path(path)
    try:
        archive = zipfile.ZipFile(path)
    except FileNotFoundError:
        raise ArchiveError(f"{path} is missing") from None
    except (OSError, zipfile.BadZipFile, ValueError) as exc:
        empty = path.is_file() and path.stat().st_size == 0
        raise ArchiveError(f"{path} is {'empty' if empty else 'not a zip archive (truncated or damaged?)'}"
                           f"{'' if empty else f' ({type(exc).__name__})'}") from None
    with archive:
        names = _entries(archive, path)
        for config in RECORDS:
            _check_records(_json(archive, names, config, MAX_CONFIG_BYTES, path), config, path)
        _check_program(_json(archive, names, PROGRAM, MAX_PROGRAM_BYTES, path), path)
        return _check_sample_inputs(archive, names, path)


def _entries(archive: zipfile.ZipFile, path: Path) -> dict[str, zipfile.ZipInfo]:
    """Entry name (below the archive's one root folder) -> its info; unknown or repeated names refused."""
    infos = archive.infolist()
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1 or not infos:
        raise ArchiveError(f"{path} is not a torch.export archive (entries under {len(roots)} root folders)")
    names: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        name = info.filename.split("/", 1)[1] if "/" in info.filename else ""
        if not ENTRIES.fullmatch(name):
            raise ArchiveError(f"{path} holds {info.filename!r}, which flowrec's exports never hold "
                               "(pickled data, compiled code or another format); refused without loading it")
        if name in names:
            raise ArchiveError(f"{path} holds {info.filename!r} twice")
        names[name] = info
    for needed in (PROGRAM, WEIGHTS_CONFIG, CONSTANTS_CONFIG, "archive_format"):
        if needed not in names:
            raise ArchiveError(f"{path} is not a complete torch.export archive (no {needed})")
    if archive.read(names["archive_format"]).strip() != b"pt2":
        raise ArchiveError(f"{path} is not a pt2 archive (its archive_format is not pt2)")
    return names


def _json(archive: zipfile.ZipFile, names: dict[str, zipfile.ZipInfo], name: str, limit: int, path: Path) -> Any:
    """A JSON entry, size and nesting bounded before it is parsed."""
    info = names[name]
    if info.file_size > limit:
        raise ArchiveError(f"{path}: {name} is larger than {limit >> 20} MiB")
    try:
        text = archive.read(info).decode("utf-8")
    except (OSError, zipfile.BadZipFile, UnicodeDecodeError, ValueError) as exc:
        raise ArchiveError(f"{path}: {name} is unreadable ({type(exc).__name__})") from None
    try:
        doc = parse_json_text(text, f"{path}: {name}")  # the limits of every JSON flowrec reads
    except ValueError as exc:
        raise ArchiveError(str(exc)) from None
    if not isinstance(doc, dict):
        raise ArchiveError(f"{path}: {name} is not a JSON object")
    return doc


def _check_records(doc: dict, config: str, path: Path) -> None:
    """Every weight / constant: a plain tensor record (never pickled), under a plain dotted name."""
    entries = doc.get("config")
    if not isinstance(entries, dict):
        raise ArchiveError(f"{path}: {config} has no config mapping")
    for fqn, meta in entries.items():
        record = meta.get("path_name") if isinstance(meta, dict) else None
        if not isinstance(meta, dict) or meta.get("use_pickle") is not False:
            raise ArchiveError(f"{path}: {fqn!r} in {config} needs pickle to load; refused without loading it")
        if not FQN.fullmatch(fqn) or not isinstance(record, str) or not RECORDS[config].fullmatch(record):
            raise ArchiveError(f"{path}: {config} names {fqn!r} -> {record!r}, not a plain tensor record")


def _check_program(doc: dict, path: Path) -> None:
    """Graph targets, shape expressions, guards and parameter names of models/model.json."""
    graph = doc.get("graph_module")
    if not isinstance(graph, dict):
        raise ArchiveError(f"{path}: {PROGRAM} has no graph_module")
    for guard in doc.get("guards_code") or []:
        _check_guard(guard, path)
    if any(isinstance(v, str) and _LINE_BREAKS.search(v) for _, v in _walk(doc)):
        raise ArchiveError(f"{path}: {PROGRAM} holds text with a carriage return or NUL (which would end a line "
                           "of the code torch generates from it)")
    inputs = graph.get("graph", {}).get("inputs") if isinstance(graph.get("graph"), dict) else None
    longest = EXPR_CHARS + PER_INPUT_CHARS * (len(inputs) if isinstance(inputs, list) else 0)
    for key, value in _walk(doc):
        if key == "target" and isinstance(value, str) and not (TARGET.fullmatch(value) or value in SYM_OPS):
            raise ArchiveError(f"{path}: the program calls {value[:80]!r}, not an ATen operator")
        if key == "expr_str":
            _check_expr(value, path, longest)
        if key in ("parameter_name", "buffer_name", "tensor_constant_name") and not (
                isinstance(value, str) and FQN.fullmatch(value)):
            raise ArchiveError(f"{path}: the program names a parameter {str(value)[:80]!r}")
        if key in ("custom_obj", "as_custom_obj", "custom_obj_name") or (key == "custom_obj_values" and value):
            raise ArchiveError(f"{path}: the program holds a custom object (pickled); refused without loading it")


def _walk(node: Any) -> Iterator[tuple[str, Any]]:
    """(key, value) of every mapping entry, depth first (the nesting is bounded before parsing)."""
    if isinstance(node, dict):
        for key, value in node.items():
            yield key, value
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def _check_expr(text: Any, path: Path, longest: int) -> None:
    """A shape expression as torch writes it (sympy srepr of symbols, integers and sympy functions),
    at most `longest` characters."""
    if not isinstance(text, str) or len(text) > longest:
        raise ArchiveError(f"{path}: the program holds a shape expression that is not text of a few KB "
                           "(a few per input)")
    position = 0
    while position < len(text):
        token = _SYMPY_TOKEN.match(text, position)
        word = token.group(0) if token else text[position]
        if token is None or (word[0].isalpha() and word not in SYMPY_NAMES) or word.startswith("_"):
            raise ArchiveError(f"{path}: the program holds a shape expression with {word[:40]!r}, which "
                               "torch's shape expressions never hold; refused without evaluating it")
        position = token.end()


def _check_guard(text: Any, path: Path) -> None:
    """A guard as torch.export writes it: comparisons of input sizes and numbers, nothing else."""
    try:
        tree = ast.parse(text, mode="eval") if isinstance(text, str) and len(text) <= 4096 else None
    except (SyntaxError, ValueError):
        tree = None
    bad = tree is None or any(not isinstance(n, GUARD_NODES) or _bad_guard_node(n) for n in ast.walk(tree))
    if bad:
        raise ArchiveError(f"{path}: the program holds a guard that is not a comparison of input sizes "
                           f"({str(text)[:60]!r}); refused without running it")


def _bad_guard_node(node: ast.AST) -> bool:
    if isinstance(node, ast.Name):
        return node.id not in GUARD_NAMES
    if isinstance(node, ast.Attribute):
        return node.attr not in GUARD_ATTRIBUTES
    if isinstance(node, ast.Call):
        return node.keywords != [] or not isinstance(node.func, ast.Attribute)
    if isinstance(node, ast.Constant):
        value = node.value
        return not (isinstance(value, (int, float)) or (isinstance(value, str) and _PLAIN_TEXT.fullmatch(value)))
    return False


def _check_sample_inputs(archive: zipfile.ZipFile, names: dict[str, zipfile.ZipInfo], path: Path) -> CheckedArchive:
    """The example inputs must load with the safe unpickler (torch retries without it otherwise)."""
    info = names.get(SAMPLE_INPUTS)
    if info is None or info.file_size == 0:
        return CheckedArchive()
    if info.file_size > MAX_SAMPLE_BYTES:
        raise ArchiveError(f"{path}: {SAMPLE_INPUTS} is larger than {MAX_SAMPLE_BYTES >> 20} MiB")
    record = archive.read(info)
    try:
        inputs = torch.load(io.BytesIO(record), weights_only=True)
    except Exception as exc:  # any refusal of the safe unpickler: torch would unpickle it unsafely
        raise ArchiveError(f"{path}: its example inputs need pickle to load ({type(exc).__name__}); "
                           "refused without loading them") from None
    return CheckedArchive(record, inputs)
