"""Fuzz (hypothesis): mutated specs are accepted correctly or refused in one line per problem.

Every spec in specs/ is mutated: values replaced by hostile numbers, text, wrong types or deep
nesting; keys deleted, added or duplicated; items repeated; the file's bytes corrupted, truncated
or re-encoded. Properties:

* `validate_document` never raises and names every problem on one line;
* `flowrec validate` and `flowrec plan` exit 0 (and then the spec loads and round-trips through
  YAML and JSON) or exit 2 with one line per problem; never a traceback, a hang (each example runs
  under a time limit) or a change to the input file.

The default run is derandomized and small; `-m slow` runs a much larger one.
"""
from __future__ import annotations

import contextlib
import copy
import json
import math
import signal
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.spec import dump_spec, load_spec
from flowrec.spec.validate import validate_document

SPECS = Path(__file__).resolve().parents[2] / "specs"
SOURCES = {p.name: yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(SPECS.glob("*.yaml"))}
EXAMPLE_LIMIT_S = 30  # wall-clock limit of one example; a hang fails the test
FAST = settings(max_examples=40, derandomize=True, database=None, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
THOROUGH = settings(FAST, max_examples=1500)


def _deep(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


HOSTILE: tuple[Any, ...] = (
    math.nan, math.inf, -math.inf, 1e300, -1e300, 1e-320, 2**63, 2**64, -(2**63) - 1, 2**63 - 1, 0, -1, 1, 16.0,
    0.5, True, False, None, "", "x", "@", "@sparse", "nan", ".inf", "1e3", "4GiB", "9" * 60 + "TiB", "a\u2028b",
    "line\nbreak", "é" * 300, "\ud800", "a\x07b", [], {}, [None], {"a": 1}, {1: "x"}, [["a", 1]], _deep(70), _deep(10),
)
SNIPPETS = (  # text injected into a file
    b"1" * 5000, b"2020-13-45", b" &a ", b" *a ", b" *zz ", b"!!binary ", b"!!set ", b"<<: *a\n", b"\t", b"{", b"}",
    b"- ", b": ", b"\x00", b"\xff", b"\xef\xbb\xbf", b"'", b'"', b"\\u0000", b"NaN", b"-Infinity", b"? [a]\n",
)
NEW_KEYS = ("dimm", "name", "kind", "lr", "eps", "weight", "fill", "seed", "extra", "table", "<<")


def _slots(doc: Any) -> list[tuple[Any, Any]]:
    """Every (container, key) pair in the document, depth first."""
    out: list[tuple[Any, Any]] = []
    todo = [doc]
    while todo:
        node = todo.pop()
        pairs = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
        for k, v in pairs:
            out.append((node, k))
            todo.append(v)
    return out


@st.composite
def mutated_docs(draw: st.DrawFn) -> Any:
    """A spec document from specs/ with 1-4 tree mutations."""
    doc = copy.deepcopy(SOURCES[draw(st.sampled_from(sorted(SOURCES)))])
    for _ in range(draw(st.integers(1, 4))):
        slots = _slots(doc)
        container, key = slots[draw(st.integers(0, len(slots) - 1))]
        op = draw(st.sampled_from(("replace", "replace", "delete", "repeat", "add_key", "nudge")))
        if op == "replace":
            container[key] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
        elif op == "delete":
            del container[key]
        elif op == "repeat" and isinstance(container, list):
            container.append(copy.deepcopy(container[key]))
        elif op == "add_key" and isinstance(container, dict):
            container[draw(st.sampled_from(NEW_KEYS))] = copy.deepcopy(draw(st.sampled_from(HOSTILE)))
        elif op == "nudge" and isinstance(container[key], (int, float)) and not isinstance(container[key], bool):
            container[key] = container[key] * draw(st.sampled_from((-1, 0, 10**6, 1e-9, 1.5)))
    return doc


def _dump(doc: Any, fmt: str) -> bytes:
    if fmt == "json":
        return json.dumps(doc, default=str, allow_nan=True).encode("utf-8")  # NaN / Infinity literals
    return yaml.safe_dump(doc, sort_keys=False, allow_unicode=True).encode("utf-8", errors="surrogatepass")


@st.composite
def spec_files(draw: st.DrawFn) -> tuple[str, bytes]:
    """(suffix, bytes) of a mutated spec file: tree mutations, then line or byte corruption."""
    doc = draw(mutated_docs()) if draw(st.booleans()) else copy.deepcopy(SOURCES[draw(st.sampled_from(sorted(SOURCES)))])
    suffix = draw(st.sampled_from((".yaml", ".json")))
    data = _dump(doc, suffix[1:])
    op = draw(st.sampled_from(("none", "dup_line", "bytes", "inject", "truncate", "nest", "encode")))
    if op == "dup_line":
        lines = data.splitlines(keepends=True)
        i = draw(st.integers(0, len(lines) - 1))
        data = b"".join(lines[: i + 1] + [lines[i]] + lines[i + 1:])
    elif op == "bytes":
        buf = bytearray(data)
        for _ in range(draw(st.integers(1, 8))):
            buf[draw(st.integers(0, len(buf) - 1))] = draw(st.integers(0, 255))
        data = bytes(buf)
    elif op == "inject":
        at = draw(st.integers(0, len(data)))
        data = data[:at] + draw(st.sampled_from(SNIPPETS)) + data[at:]
    elif op == "truncate":
        data = data[: draw(st.integers(0, len(data)))]
    elif op == "nest":
        at, depth = draw(st.integers(0, len(data))), draw(st.sampled_from((10, 65, 30_000)))
        data = data[:at] + b"[" * depth + data[at:]
    elif op == "encode":
        data = data.decode("utf-8", errors="replace").encode(draw(st.sampled_from(("utf-16", "utf-16-le", "utf-32", "latin-1"))),
                                           errors="replace")
    return suffix, data


class Hang(BaseException):
    """An example ran past its time limit (a BaseException, so the CLI runner does not swallow it)."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    def on_alarm(signum: int, frame: Any) -> None:
        raise Hang(f"no answer within {seconds} s")
    previous = signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def _check_document(doc: Any) -> None:
    with time_limit(EXAMPLE_LIMIT_S):
        issues = validate_document(doc)
    for issue in issues:
        assert isinstance(issue.path, str) and issue.message
        assert len(str(issue).splitlines()) == 1


def _check_file(path: Path, runner: CliRunner) -> None:
    before = path.read_bytes()
    outputs = {}
    for command in ("validate", "plan"):
        with time_limit(EXAMPLE_LIMIT_S):
            result = runner.invoke(app, [command, str(path)])
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        assert "Traceback" not in result.output and "internal error" not in result.output
        assert result.exit_code in (0, 2), result.output
        outputs[command] = result
        assert path.read_bytes() == before
    validate, plan = outputs["validate"], outputs["plan"]
    if validate.exit_code == 2:
        lines = validate.output.splitlines()
        assert lines and all(line.startswith(f"{path}: ") and len(line) > len(f"{path}: ") for line in lines)
        assert plan.exit_code == 2 and plan.output.splitlines() == lines  # the same loader, the same lines
        return
    assert validate.output == f"ok  {path}\n"
    assert plan.exit_code == 0 or len(plan.output.splitlines()) == 1 and plan.output.startswith("error: ")
    _check_round_trip(path)


def _check_round_trip(path: Path) -> None:
    spec = load_spec(path)
    for fmt in ("yaml", "json"):
        again = path.with_name(f"again.{fmt}")
        again.write_text(dump_spec(spec, fmt), encoding="utf-8")
        assert load_spec(again) == spec


@FAST
@given(doc=mutated_docs())
def test_mutated_documents_give_issues_never_exceptions(doc):
    _check_document(doc)


@settings(FAST, max_examples=25)
@given(case=spec_files())
def test_mutated_files_through_the_cli(case, tmp_path_factory):
    suffix, data = case
    path = tmp_path_factory.mktemp("fuzz") / f"spec{suffix}"
    path.write_bytes(data)
    _check_file(path, CliRunner())


@pytest.mark.slow
@THOROUGH
@given(doc=mutated_docs())
def test_mutated_documents_thorough(doc):
    _check_document(doc)


@pytest.mark.slow
@THOROUGH
@given(case=spec_files())
def test_mutated_files_thorough(case, tmp_path_factory):
    suffix, data = case
    path = tmp_path_factory.mktemp("fuzz") / f"spec{suffix}"
    path.write_bytes(data)
    _check_file(path, CliRunner())


def test_self_referencing_document():
    doc = copy.deepcopy(SOURCES["dlrm_criteo.yaml"])
    doc["data"] = {"format": "csv", "path": "x", "options": {}}
    doc["data"]["options"]["sequence"] = doc["data"]["options"]  # a known option (plan15)
    issues = validate_document(doc)
    assert [i.message for i in issues] == ["nests deeper than 64 levels"]


def test_most_mutations_are_reported():
    """The mutations bite: a fixed sample of mutated documents is mostly refused."""
    found = []

    @settings(FAST, max_examples=30)
    @given(doc=mutated_docs())
    def probe(doc):
        found.append(bool(validate_document(doc)))

    probe()
    assert sum(found) > len(found) // 2
