"""Every child process a test starts, and every wait of a test or tool, has a deadline: a scan of the
source (ast) for the calls that had none. `subprocess.run(..., timeout=T)` kills only its direct child
at T, so a `flowrec train --nproc 2` whose launcher it killed left its ranks running (holding ports
and cores of CI's 2-core machine), and a call without a timeout could hang CI outright; tests call
`flowrec.testing.processes.run_bounded`, which kills the whole tree, and tools, where a call has a
timeout, `run_tree` (a TimeoutExpired, once the tree is killed). A `wait()`, `join()` or
`communicate()` without a timeout blocks for good on a child or thread that never ends, and a test's
Popen waited with one (`proc.wait(timeout=T)`) raises at T and kills nothing: tests wait on their
Popen through `wait_bounded` / `communicate_bounded`, which kill the tree."""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# the test suite and its helpers: no subprocess call that waits on a child without killing its tree
TESTS = (REPO / "tests", REPO / "flowrec" / "testing")
# where a Popen's own wait() / communicate() is called: the helpers that bound them, and nowhere else
BOUNDED_WAITS = REPO / "flowrec" / "testing" / "processes.py"
# the tools that tests and CI run: no deadline that kills only the direct child
TOOLS = (REPO / "tools",)
# ... and everywhere: no wait without a deadline
WAITS = (*TESTS, *TOOLS)
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


def deadlines_that_kill_one(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of each subprocess.run / call / check_call / check_output in `tree` given a
    `timeout=` (at which subprocess kills its direct child only), under its own name or imported."""
    names = {alias.asname or alias.name: alias.name for node in ast.walk(tree)
             if isinstance(node, ast.ImportFrom) and node.module == "subprocess"
             for alias in node.names if alias.name in UNBOUNDED}
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and any(k.arg == "timeout" for k in node.keywords)):
            continue
        func = node.func
        if (isinstance(func, ast.Attribute) and func.attr in UNBOUNDED and isinstance(func.value, ast.Name)
                and func.value.id == "subprocess") or (isinstance(func, ast.Name) and func.id in names):
            found.append((node.lineno, ast.unparse(func)))
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


def _is_popen(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and (isinstance(node.func, ast.Name) and node.func.id == "Popen"
                                            or isinstance(node.func, ast.Attribute) and node.func.attr == "Popen"))


def _annotation_popens(annotation: ast.AST | None) -> list[bool]:
    """Which parts of a value so annotated hold a Popen: one (`Popen`, `list[Popen]`) or, for a
    `tuple[...]`, one per element."""
    if annotation is None:
        return [False]
    if (isinstance(annotation, ast.Subscript) and ast.unparse(annotation.value).split(".")[-1] == "tuple"
            and isinstance(annotation.slice, ast.Tuple)):
        return ["Popen" in ast.unparse(e) for e in annotation.slice.elts]
    return ["Popen" in ast.unparse(annotation)]


def popen_names(tree: ast.AST) -> set[str]:
    """The names in `tree` that hold a Popen or a collection of them: assigned, appended or bound
    by `with` a `Popen(...)` (or a list, tuple or comprehension of them), a parameter annotated with
    Popen, a loop over such a collection, a module function's result annotated with Popen (a
    tuple's elements one by one). Names, not scopes: a name that holds a Popen anywhere counts."""
    returns = {f.name: _annotation_popens(f.returns) for f in ast.walk(tree)
               if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))}
    names = {a.arg for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef))
             for a in (*f.args.posonlyargs, *f.args.args, *f.args.kwonlyargs) if any(_annotation_popens(a.annotation))}

    def holds(node: ast.AST | None) -> bool:
        if isinstance(node, ast.Name):
            return node.id in names
        if isinstance(node, ast.Subscript):
            return holds(node.value)
        if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
            return any(holds(e) for e in node.elts)
        if isinstance(node, (ast.ListComp, ast.GeneratorExp, ast.SetComp)):
            return holds(node.elt)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in returns:
            return any(returns[node.func.id])
        return _is_popen(node)

    def bind(target: ast.AST, value: ast.AST | None) -> None:
        if isinstance(target, ast.Name) and holds(value):
            names.add(target.id)
        elif isinstance(target, ast.Tuple) and isinstance(value, ast.Tuple):
            for t, v in zip(target.elts, value.elts):
                bind(t, v)
        elif (isinstance(target, ast.Tuple) and isinstance(value, ast.Call) and isinstance(value.func, ast.Name)
              and value.func.id in returns and len(returns[value.func.id]) == len(target.elts)):
            names.update(t.id for t, popen in zip(target.elts, returns[value.func.id])
                         if popen and isinstance(t, ast.Name))

    while True:  # until no new name: a loop over a list found later, found next time
        before = set(names)
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign):
                for target in node.targets:
                    bind(target, node.value)
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                bind(node.target, node.value)
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                bind(node.optional_vars, node.context_expr)
            elif isinstance(node, (ast.For, ast.comprehension)):
                bind(node.target, node.iter)
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr in ("append", "extend") and isinstance(node.func.value, ast.Name)
                  and any(holds(a) for a in node.args)):
                names.add(node.func.value.id)
        if names == before:
            return names


def popen_waits(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, call) of each `.wait(...)` / `.communicate(...)` in `tree` on a Popen (`popen_names`):
    past its timeout it raises and kills nothing, leaving the child and what it started running."""
    names = popen_names(tree)
    found = []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr in ("wait", "communicate")):
            receiver = node.func.value
            while isinstance(receiver, ast.Subscript):
                receiver = receiver.value
            if (isinstance(receiver, ast.Name) and receiver.id in names) or _is_popen(receiver):
                found.append((node.lineno, ast.unparse(node)))
    return sorted(found)


def _offenders(roots: tuple[Path, ...], scan, skip: tuple[Path, ...] = ()) -> list[str]:
    out = []
    for root in roots:
        for path in sorted(p for p in root.rglob("*.py") if p not in skip):
            tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
            out += [f"{path.relative_to(REPO)}:{line}: {what}" for line, what in scan(tree)]
    return out


def test_no_test_waits_on_a_child_without_killing_its_tree():
    offenders = _offenders(TESTS, subprocess_waits)
    assert not offenders, ("use flowrec.testing.processes.run_bounded (a deadline that kills the whole tree):\n"
                           + "\n".join(offenders))


def test_no_test_waits_on_its_popen_without_killing_its_tree():
    offenders = _offenders(TESTS, popen_waits, skip=(BOUNDED_WAITS,))
    assert not offenders, ("use flowrec.testing.processes.wait_bounded or communicate_bounded (past the deadline "
                           "they kill the whole tree and fail; a Popen's own wait kills nothing):\n"
                           + "\n".join(offenders))


def test_no_tool_gives_a_child_a_deadline_that_kills_only_it():
    offenders = _offenders(TOOLS, deadlines_that_kill_one)
    assert not offenders, ("use flowrec.testing.processes.run_tree (its deadline kills the whole tree, then raises "
                           "subprocess.TimeoutExpired):\n" + "\n".join(offenders))


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
    ("import subprocess\n\ndef f():\n    return subprocess.run(['true'], timeout=5)\n", 4),
    ("from subprocess import check_output as out\nout(['true'],\n    timeout=5)\n", 2),
    ("import subprocess\nsubprocess.call(['true'])\n", None),  # no deadline: the tool waits for its end
    ("from flowrec.testing.processes import run_tree\nrun_tree(['true'], timeout_s=5)\n", None),
    ("import subprocess\nsubprocess.Popen(['true']).communicate(timeout=5)\n", None),  # a wait: the other scans'
])
def test_the_scan_names_the_line_of_each_deadline_that_kills_one_child(source: str, line: int | None):
    assert [found for found, _ in deadlines_that_kill_one(ast.parse(source))] == ([] if line is None else [line])


@pytest.mark.parametrize("source, line", [
    ("import subprocess\np = subprocess.Popen(['true'])\np.wait(timeout=5)\n", 3),
    ("from subprocess import Popen\nwith Popen(['true']) as job:\n    job.communicate('x', 5)\n", 3),
    ("import subprocess\nps = [subprocess.Popen(['true']) for _ in range(2)]\ncodes = [p.wait(5) for p in ps]\n", 3),
    ("import subprocess\nps = []\nps.append(subprocess.Popen(['true']))\nps[0].wait(timeout=5)\n", 4),
    ("import subprocess\n\ndef f(proc: subprocess.Popen):\n    proc.wait(timeout=5)\n", 4),
    ("import subprocess\n\ndef start() -> tuple[subprocess.Popen, int]:\n    ...\n\n"
     "def f():\n    job, n = start()\n    for j in (job,):\n        j.wait(timeout=5)\n", 9),
    ("import threading\nstop = threading.Event()\nstop.wait(5)\nb = threading.Barrier(2)\nb.wait(timeout=5)\n",
     None),  # a thread's event or barrier: no process to kill
    ("import subprocess\n\ndef start() -> tuple[subprocess.Popen, int]:\n    ...\n\n"
     "def f(done):\n    job, n = start()\n    n.wait(5)\n    done.wait(5)\n", None),
])
def test_the_scan_names_the_line_of_each_wait_on_a_popen(source: str, line: int | None):
    assert [found for found, _ in popen_waits(ast.parse(source))] == ([] if line is None else [line])


@pytest.mark.parametrize("source, line", [
    ("import threading\nt = threading.Thread(target=print)\nt.start()\nt.join()\n", 4),
    ("import subprocess\nwith subprocess.Popen(['true']) as p:\n    p.communicate()\n", 3),
    ("def f(p):\n    p.kill()\n    return p.wait()\n", 3),
    ("done.wait(**{})\n", None),  # a timeout that may be in **kwargs: not flagged
])
def test_the_scan_names_the_line_of_each_wait_without_a_deadline(source: str, line: int | None):
    assert [found for found, _ in waits_without_deadline(ast.parse(source))] == ([] if line is None else [line])
