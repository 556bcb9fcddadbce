"""Read a spec file into a plain document, refusing hostile input before any parser builds it.

The order is what makes it safe: the file must be a regular file of at most `MAX_SPEC_BYTES`;
its bytes must be UTF-8 text (a UTF-16 / UTF-32 file, a binary file or an empty one is named as
such); then flowrec's own scan of the text bounds the nesting depth (`MAX_DEPTH`) before any parser
sees it, so the limit and its message are flowrec's whatever parser version is installed (parsers
bound nesting themselves, each at its own depth and in its own words); then a streaming pass over
the parser's events checks the depth exactly, refuses tags that are not plain YAML values (say
`!!python/object`) and bounds the number of values after alias expansion (`MAX_VALUES`, so
"billion laughs" is refused by arithmetic, without building anything). Only then is the document
built: YAML by the safe loader (libyaml's when built in), `*.json` by the JSON parser; duplicate
keys and JSON's NaN / Infinity literals are refused, each with its line. Every problem is one line.

Example:
    >>> read_document("specs/dlrm_criteo.yaml")["name"]
    'dlrm_criteo'
"""
from __future__ import annotations

import codecs
import json
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml
from yaml.events import AliasEvent, CollectionEndEvent, CollectionStartEvent, ScalarEvent

from flowrec.spec.errors import SpecError, SpecIssue
from flowrec.spec.json_scan import scan_json
from flowrec.spec.schema_errors import show
from flowrec.spec.yaml_scan import yaml_too_deep

MAX_SPEC_BYTES = 16 * 2**20  # a spec is a small text file; wide_1000.yaml (1,000 fields) is 80 KB
MAX_DEPTH = 64  # nested lists / mappings; the example specs use 4
MAX_VALUES = 1_000_000  # values after alias expansion; wide_1000.yaml has 14,000
WIDE_NUL_SHARE = 0.25  # share of NUL bytes in the non-text byte lanes that marks BOM-less UTF-16 / 32
_BOMS = (  # longest first: the UTF-32-LE mark starts with the UTF-16-LE one
    (codecs.BOM_UTF32_LE, "UTF-32"), (codecs.BOM_UTF32_BE, "UTF-32"),
    (codecs.BOM_UTF16_LE, "UTF-16"), (codecs.BOM_UTF16_BE, "UTF-16"),
)
# YAML 1.2 / JSON floats: also read exponents without a dot (1e-3, 1e-08) as numbers, not text.
_EXP_FLOAT = re.compile(r"^[-+]?[0-9][0-9_]*(\.[0-9_]*)?[eE][-+]?[0-9]+$")
_MERGE_TAG = "tag:yaml.org,2002:merge"
_NUMBER_TAGS = frozenset({"tag:yaml.org,2002:int", "tag:yaml.org,2002:float"})
_LEADING_ZERO = re.compile(r"^[-+]?0[0-9_]+$")  # 010: octal in YAML 1.1, ten in YAML 1.2
_STANDARD_TAG = "tag:yaml.org,2002:"


class _SpecLoader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):  # C parser when built with libyaml
    """The safe YAML loader, reading `1e-3` as a float, noting every duplicate mapping key and every
    plain number that YAML 1.1 reads otherwise than YAML 1.2 (`010`, `1:30`)."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.noted: list[SpecIssue] = []  # duplicate keys, numbers YAML versions read apart

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == _MERGE_TAG or not isinstance(key_node, yaml.ScalarNode):
                continue  # merges may override; a non-scalar key is refused by the base loader
            key = self.construct_object(key_node)
            if not isinstance(key, Hashable):
                continue  # e.g. `!!set name: x`: refused by the base loader
            line = key_node.start_mark.line + 1
            if key in seen:
                self.noted.append(SpecIssue("", f"line {line}: duplicate key {show(key)} "
                                                     f"(first at line {seen[key]})"))
            seen.setdefault(key, line)
        return super().construct_mapping(node, deep)

    def construct_object(self, node: yaml.Node, deep: bool = False) -> Any:
        try:
            value = super().construct_object(node, deep)
        except (ValueError, OverflowError) as exc:  # e.g. 2020-13-45 as a date, an int of 5,000 digits
            reason = str(exc).split(";")[0]
            raise yaml.constructor.ConstructorError(None, None, f"cannot read this value: {reason}",
                                                    node.start_mark) from None
        if isinstance(node, yaml.ScalarNode) and node.tag in _NUMBER_TAGS and not node.style:  # plain: None or ''
            self._note_ambiguous(node, value)
        return value

    def _note_ambiguous(self, node: yaml.ScalarNode, value: Any) -> None:
        """YAML 1.1 (what PyYAML reads) takes `010` as octal 8 and `1:30` as 90 (base 60), where
        YAML 1.2, JSON and a reader's eye take 10 and text: such a number is refused, naming both."""
        text = node.value
        line = node.start_mark.line + 1
        if ":" in text:
            self.noted.append(SpecIssue("", f"line {line}: {text} is read by YAML as the base-60 number "
                                                 f"{value}; quote it if it is text, or write the number"))
        elif _LEADING_ZERO.match(text) and value != (decimal := int(text.replace("_", ""))):
            self.noted.append(SpecIssue("", f"line {line}: {text} is read by YAML as the octal number "
                                            f"{value}, not {decimal}; write the number without its leading zeros"))


_SpecLoader.add_implicit_resolver("tag:yaml.org,2002:float", _EXP_FLOAT, list("-+0123456789"))
_PLAIN_TAGS = frozenset(tag for tag in _SpecLoader.yaml_constructors if tag is not None) | {"!"}


PLAN_HINT = "; a plan trains as `flowrec train SPEC --plan FILE`"  # what to do with a plan given as a spec


RUN_SETTINGS_KEYS = ("data", "eval_data", "rows", "seed", "epochs", "max_steps", "eval_every")  # every run.json
# holds them (`flowrec.runs.settings.REQUIRED`): a copy of one outside its run folder is told by them


def flowrec_format(doc: Any) -> str | None:
    """`format 'flowrec-…'` when `doc` is one of the documents flowrec writes for itself (a plan,
    an encoder, a dataset's or a package's record), or what it is for a JSON Schema flowrec
    prints or the metrics `flowrec eval --json` writes, else None.

    Example:
        >>> flowrec_format({"format": "flowrec-plan", "nodes": []}), flowrec_format({"name": "x"})
        ("format 'flowrec-plan'", None)
        >>> flowrec_format(dict.fromkeys(RUN_SETTINGS_KEYS, None))
        "a training run's settings, as its run.json holds them"
    """
    kind = doc.get("format") if isinstance(doc, dict) else None
    if isinstance(kind, str) and kind.startswith("flowrec-"):
        return f"format {kind!r}"
    schema = doc.get("$id") if isinstance(doc, dict) else None
    if isinstance(schema, str) and schema.startswith(SCHEMA_ID_PREFIX):  # `flowrec schema > s.json`
        return f"the JSON Schema {schema.rsplit('/', 1)[-1]!r}, as `flowrec schema` prints it"
    if is_eval_metrics(doc):
        return "metrics of `flowrec eval --json`"
    if isinstance(doc, dict) and all(k in doc for k in RUN_SETTINGS_KEYS) and "features" not in doc:
        return "a training run's settings, as its run.json holds them"  # a stray copy: 25 lines of unknown keys
    return None


SCHEMA_ID_PREFIX = "https://flowrec.dev/schemas/"  # the `$id` of flowrec's JSON Schemas (schemas/)


def is_eval_metrics(doc: Any) -> bool:
    """Whether `doc` is what `flowrec eval --json` writes: head -> {metric: number or null, samples}.

    >>> is_eval_metrics({"ctr": {"auc": 0.7, "logloss": None, "samples": 40}}), is_eval_metrics({"name": "x"})
    (True, False)
    """
    return isinstance(doc, dict) and bool(doc) and all(
        isinstance(m, dict) and isinstance(m.get("samples"), int) and not isinstance(m["samples"], bool)
        and all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in m.values())
        for m in doc.values())


def not_a_spec(own: str) -> SpecIssue:
    """The one issue of a file flowrec wrote for itself (`own` says what it is) given as a spec."""
    hint = PLAN_HINT if "flowrec-plan" in own else ""
    return SpecIssue("", f"not a model spec: flowrec wrote this file for itself ({own}){hint}")


def read_document(path: str | Path) -> Any:
    """Read a YAML or JSON spec file into plain Python values, safely.

    Raises:
        SpecError: one issue for an unreadable, non-UTF-8, empty, too deep, alias-bombed or
            malformed file; one per duplicate key (or NaN / Infinity in JSON).
    """
    path = Path(path)
    try:
        text = decode_spec(_read_bytes(path))
        return parse_json(text) if path.suffix.lower() == ".json" else parse_yaml(text)
    except SpecError as exc:
        raise SpecError(exc.issues, str(path)) from None


def broken_link(path: Path) -> str | None:
    """Where `path` is a link whose target does not exist (a link left behind by a moved or deleted
    file), what it says: "a link to 'T', which does not exist"; None otherwise. Without it a broken
    link was said not to be there ('no such file', 'input not found'), though `ls` lists it.

    >>> import tempfile
    >>> link = Path(tempfile.mkdtemp()) / "latest.csv"
    >>> link.symlink_to("day_9.csv")
    >>> broken_link(link), broken_link(link.parent)
    ("a link to 'day_9.csv', which does not exist", None)
    """
    import os

    try:
        if not os.path.islink(path) or os.path.exists(path):
            return None
        return f"a link to {os.readlink(path)!r}, which does not exist"
    except (OSError, ValueError):
        return None


def _read_bytes(path: Path) -> bytes:
    """The file's bytes; a problem is an issue that does not name the file (every caller shows it
    after the file's path: `FILE: no such file`)."""
    try:
        if path.is_dir():  # a run's or a package's folder holds the spec it was made of
            held = f"; the spec this run or package was made of is {path / 'spec.json'}" \
                if (path / "spec.json").is_file() else ""
            raise _fail(f"a folder, not a spec file (give a .yaml, .yml or .json file{held})")
        if path.exists() and not path.is_file():
            raise _fail("not a regular file")
        with path.open("rb") as f:
            data = f.read(MAX_SPEC_BYTES + 1)
    except FileNotFoundError:
        link = broken_link(path)
        raise _fail("no such file" if link is None else f"{link}: point it at the spec, or give the spec's "
                    "own path") from None
    except OSError as exc:
        raise _fail(f"cannot read the file: {exc.strerror or exc}") from None
    if len(data) > MAX_SPEC_BYTES:
        raise _fail(f"the file is larger than {MAX_SPEC_BYTES // 2**20} MiB; a spec is a small text file")
    return data


def decode_spec(data: bytes) -> str:
    """The text of a spec file: UTF-8 (a UTF-8 byte-order mark is allowed), not empty.

    Raises:
        SpecError: naming the encoding problem (UTF-16 / UTF-32, binary, invalid byte and where).
    """
    for bom, name in _BOMS:
        if data.startswith(bom):
            raise _fail(f"the file is {name} text; save it as UTF-8")
    data = data[len(codecs.BOM_UTF8):] if data.startswith(codecs.BOM_UTF8) else data
    if b"\x00" in data:
        raise _fail(_nul_message(data))
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line, col = _line_col(data, exc.start)
        raise _fail(f"line {line}, column {col}: not UTF-8 text (byte 0x{data[exc.start]:02x}); "
                    "save the file as UTF-8") from None
    if not text.strip():
        raise _fail("the file is empty; a spec is a mapping with name, features, modules, heads and optimizer")
    return text


def _nul_message(data: bytes) -> str:
    """Name BOM-less UTF-16 / UTF-32 (NULs in all byte lanes of a character but the text's), else binary."""
    head = data[:4096]
    for width in (4, 2):
        lanes = [head[i::width] for i in range(width)]
        for text_lane in (0, width - 1):  # little- or big-endian
            others = [lane for i, lane in enumerate(lanes) if i != text_lane]
            if lanes[text_lane] and lanes[text_lane].count(0) == 0 and all(
                    lane.count(0) >= WIDE_NUL_SHARE * len(lane) for lane in others):
                return f"the file looks like UTF-{8 * width} text (without a byte-order mark); save it as UTF-8"
    return f"a binary file (NUL byte at offset {data.index(0)}), not a YAML or JSON spec"


def _line_col(data: bytes | str, offset: int) -> tuple[int, int]:
    newline = b"\n" if isinstance(data, bytes) else "\n"
    line = data.count(newline, 0, offset) + 1
    return line, offset - (data.rfind(newline, 0, offset) + 1) + 1


def parse_yaml(text: str) -> Any:
    """Pre-scan, then build a YAML document; every problem raised as a one-line `SpecError`."""
    deep = yaml_too_deep(text, MAX_DEPTH)
    if deep is not None:
        raise _fail(f"line {deep[0]}, column {deep[1]}: the document nests deeper than {MAX_DEPTH} levels")
    try:
        _prescan(text)
        loader = _SpecLoader(text)
        try:
            doc = loader.get_single_data()
        finally:
            loader.dispose()
    except yaml.YAMLError as exc:
        raise _fail(_yaml_message(exc, text)) from None
    if loader.noted:
        raise SpecError(loader.noted)
    return _not_empty(doc)


def _prescan(text: str) -> None:
    """Walk the YAML events once: bound the depth and the values after alias expansion, refuse tags."""
    open_sizes: list[list[Any]] = []  # per open collection: [anchor, values so far]
    sizes: dict[str, int] = {}  # anchor -> values of its node, expanded
    for event in yaml.parse(text, Loader=_SpecLoader):
        tag = getattr(event, "tag", None)
        if tag is not None and tag not in _PLAIN_TAGS:
            shown = "!!" + tag[len(_STANDARD_TAG):] if tag.startswith(_STANDARD_TAG) else tag
            raise _fail(f"{_at(event)}: the tag {shown} is not allowed in a spec (plain YAML values only)")
        if isinstance(event, CollectionStartEvent):
            open_sizes.append([event.anchor, 1])
            if len(open_sizes) > MAX_DEPTH:
                raise _fail(f"{_at(event)}: the document nests deeper than {MAX_DEPTH} levels")
            continue
        if isinstance(event, CollectionEndEvent):
            anchor, n = open_sizes.pop()
        elif isinstance(event, ScalarEvent):
            anchor, n = event.anchor, 1
        elif isinstance(event, AliasEvent):
            anchor, n = None, sizes.get(event.anchor)
            if n is None:
                raise _fail(f"{_at(event)}: alias *{event.anchor} refers to an anchor that is not "
                            "defined before it or that contains it")
        else:
            continue
        if anchor is not None:
            sizes[anchor] = n
        if open_sizes:
            open_sizes[-1][1] += n
        if (open_sizes[-1][1] if open_sizes else n) > MAX_VALUES:
            raise _fail(f"{_at(event)}: the document expands to more than {MAX_VALUES:,} values "
                        "(aliases of aliases?)")


def _at(event: Any) -> str:
    mark = event.start_mark
    return f"line {mark.line + 1}, column {mark.column + 1}"


def _yaml_message(exc: yaml.YAMLError, text: str) -> str:
    if isinstance(exc, yaml.reader.ReaderError):
        line, col = _line_col(text, min(exc.position, len(text)))
        char = exc.character if isinstance(exc.character, int) else ord(str(exc.character)[:1] or "?")
        return f"line {line}, column {col}: character U+{char:04X} is not allowed in YAML"
    mark = getattr(exc, "problem_mark", None)
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
    if mark is not None and text[mark.index:mark.index + 1] == "\t":  # the parser names no tab
        return f"{where}a tab character: YAML indents with spaces, never tabs"
    problem = getattr(exc, "problem", None) or str(exc)
    return f"{where}not valid YAML/JSON: {problem}"


def parse_json(text: str) -> Any:
    """Pre-scan, then parse a JSON document; every problem raised as a one-line `SpecError`."""
    scan = scan_json(text, MAX_DEPTH)
    if scan.too_deep is not None:
        raise _fail(f"line {scan.too_deep}: the document nests deeper than {MAX_DEPTH} levels")
    try:
        doc = json.loads(text, parse_constant=_refuse_constant)
    except json.JSONDecodeError as exc:
        raise _fail(f"line {exc.lineno}, column {exc.colno}: not valid JSON: {exc.msg}") from None
    except _Constant as exc:
        if not scan.constants:
            scan.problems.append(f"{exc} is not a JSON number (JSON has no NaN or Infinity)")
    except (ValueError, OverflowError) as exc:  # e.g. an integer of 5,000 digits
        raise _fail(f"not valid JSON: {str(exc).split(';')[0]}") from None
    if scan.problems:
        raise SpecError([SpecIssue("", m) for m in dict.fromkeys(scan.problems)])
    return _not_empty(doc)


class _Constant(ValueError):
    """JSON's NaN / Infinity / -Infinity, which Python's parser would otherwise accept."""


def _refuse_constant(name: str) -> Any:
    raise _Constant(name)


def _not_empty(doc: Any) -> Any:
    if doc is None:
        raise _fail("the file is empty; a spec is a mapping with name, features, modules, heads and optimizer")
    return doc


def _fail(message: str) -> SpecError:
    return SpecError([SpecIssue("", message)])
