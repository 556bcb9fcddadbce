"""Every child process a test starts, and every wait of a test or tool, has a deadline: a scan of the
source (ast) for the calls that had none. `subprocess.run(..., timeout=T)` kills only its direct child
at T, so a `flowrec train --nproc 2` whose launcher it killed left its ranks running (holding ports
and cores of CI's 2-core machine), and a call without a timeout could hang CI outright; tests call
`flowrec.testing.processes.run_bounded`, which kills the whole tree. A `wait()`, `join()` or
`communicate()` without a timeout blocks for good on a child or thread that never ends."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the test suite and its helpers: no subprocess call that waits on a child without killing its tree
TESTS = (REPO / "tests", REPO / "flowrec" / "testing")
# ... and the tools that tests and CI run: no wait without a deadline
WAITS = (*TESTS, REPO / "tools")
UNBOUNDED = ("run", "call", "check_call", "check_output")  # subprocess's own waits on a child
# how many positional arguments a call takes before its timeout: `communicate(input, timeout)`,
# `wait(timeout)` (Popen, Event, Barrier, Condition), `join(timeout)` (Thread, Process)
TIMEOUT_AT = {"wait": 0, "join": 0, "communicate": 1}


def subprocess_waits(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, what) of each use of subprocess.run / call / check_call / check_output in `tree`."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr in UNBOUNDED and isinstance(node.value, ast.Name)
                and node.value.id == "subprocess"):
            found.append((node.lineno, f"subprocess.{node.attr}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "subprocess":
            found += [(node.lineno, f"from subprocess import {a.name}") for a in node.names if a.name in UNBOUNDED]
    return sorted(found)


def waits_without_deadline(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of each `.wait()`, `.join()` or `.communicate(...)` in `tree` given no timeout
    (`"-".join(words)` has an argument where a timeout would be: not a wait)."""
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TIMEOUT_AT
                and len(node.args) <= TIMEOUT_AT[node.func.attr]
                and not any(k.arg in ("timeout", None) for k in node.keywords)):  # None: **kwargs
            found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _offenders(roots: tuple[Path, ...], scan) -> list[str]:
    out = []
    for root in roots:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            out += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in scan(tree)]
    return out


def test_no_test_waits_on_a_child_without_killing_its_tree():
    offenders = _offenders(TESTS, subprocess_waits)
    assert not offenders, ("use flowrec.testing.processes.run_bounded (a deadline that kills the whole tree):\n"
                           + "\n".join(offenders))


def test_no_test_or_tool_waits_without_a_deadline():
    offenders = _offenders(WAITS, waits_without_deadline)
    assert not offenders, ("give each a timeout (flowrec.testing.processes: communicate_bounded, call_within, "
                           "kill_tree):\n" + "\n".join(offenders))


@pytest.mark.parametrize("source, line", [
    ("import subprocess\n\ndef f():\n    return subprocess.call(['true'])\n", 4),
    ("import subprocess\nrunner = subprocess.run\n", 2),
    ("from subprocess import check_call\n", 1),
])
def test_the_scan_names_the_line_of_each_unbounded_child(source: str, line: int):
    assert [found for found, _ in subprocess_waits(ast.parse(source))] == [line]


@pytest.mark.parametrize("source, line", [
    ("import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n", 4),
    ("import subprocess\nwith subprocess.Popen(['true']) as p:\n    p.communicate()\n", 3),
    ("def f(p):\n    p.kill()\n    return p.wait()\n", 3),
    ("done.wait(**{})\n", None),  # a timeout that may be in **kwargs: not flagged
])
def test_the_scan_names_the_line_of_each_wait_without_a_deadline(source: str, line: int | None):
    assert [found for found, _ in waits_without_deadline(ast.parse(source))] == ([] if line is None else [line])
