"""Every argparse help string in tools/ and flowrec/ survives argparse's %-formatting.

argparse expands a help string with `%` formatting (`%(default)s`), so a bare `%` in it, such as
the one `f"{level:.0%}"` writes, makes `--help` raise (`tools/bench_costmodel.py --help` did:
"%i format: a real number is required"). Running every tool's `--help` costs a torch import each;
this reads the source instead: the literal parts of each `help=` string, and the f-string fields
whose format ends in `%`, must leave no `%` that is not `%%` or `%(`.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ESCAPED = re.compile(r"%%|%\([a-z_]+\)[a-z]")  # what argparse expands: %% and %(name)s


def _rendered(node: ast.expr) -> str | None:
    """The help string as argparse will see it, with each f-string field as a placeholder (a field
    formatted with `%` renders as '50%'), or None where it is not a literal."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        parts = []
        for value in node.values:
            if isinstance(value, ast.Constant):
                parts.append(str(value.value))
            elif isinstance(value, ast.FormattedValue):
                spec = value.format_spec
                spec_text = "".join(str(v.value) for v in spec.values if isinstance(v, ast.Constant)) if spec else ""
                parts.append("50%" if spec_text.endswith("%") else "X")
        return "".join(parts)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):  # "a " + "b"
        left, right = _rendered(node.left), _rendered(node.right)
        return None if left is None or right is None else left + right
    return None


def stray_percents(source: str) -> list[tuple[int, str]]:
    """(line, help text) of every `add_argument(..., help=...)` / `ArgumentParser(description=...)`
    whose text has a `%` argparse would choke on."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name not in ("add_argument", "ArgumentParser", "add_parser", "add_argument_group"):
            continue
        for keyword in node.keywords:
            if keyword.arg in ("help", "description", "epilog", "usage"):
                text = _rendered(keyword.value)
                if text is not None and "%" in ESCAPED.sub("", text):
                    found.append((node.lineno, text))
    return found


def test_the_check_finds_a_stray_percent() -> None:
    bad = 'p.add_argument("--x", help=f"while the {LEVEL:.0%} interval")\n'
    good = 'p.add_argument("--x", help=f"while the {LEVEL:.0%}% interval, default %(default)s")\n'
    assert [line for line, _ in stray_percents(bad)] == [1]
    assert stray_percents(good) == []
    assert stray_percents('p.add_argument("--y", help="90% of " + "rows")\n') != []


@pytest.mark.parametrize("root", ["tools", "flowrec"])
def test_help_strings_have_no_stray_percent(root: str) -> None:
    offenders = [f"{path.relative_to(REPO)}:{line}: {text[:80]!r}"
                 for path in sorted((REPO / root).rglob("*.py"))
                 for line, text in stray_percents(path.read_text(encoding="utf-8"))]
    assert offenders == [], "a bare % in an argparse help string breaks --help (write %%):\n" + "\n".join(offenders)
