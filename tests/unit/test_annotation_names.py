"""Names in the annotations of the CLI's module-level functions are bound in their module.

The CLI imports torch and the trainer inside its commands (so `flowrec --help` starts fast): an
annotation naming such a class (`trainer: "Trainer"`) needs an import under `if TYPE_CHECKING:`,
or the name is undefined to pyflakes, to `typing.get_type_hints` and to a reader's tools. Checked
here from the source (pyflakes is not a dependency), and the guard keeps the import off the start.
"""
from __future__ import annotations

import ast
import builtins
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import run_bounded

CLI = Path(__file__).resolve().parents[2] / "flowrec" / "cli"


def _bound(tree: ast.Module) -> set[str]:
    """Names the module binds at its top level, imports under `if TYPE_CHECKING:` included."""
    names: set[str] = set()
    body = list(tree.body)
    while body:
        node = body.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            body.extend(node.body + node.orelse + [s for h in getattr(node, "handlers", []) for s in h.body])
    return names


def _annotation_names(node: ast.AST) -> set[str]:
    """The first name of each name an annotation uses (its text parsed where it is a string)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval")
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Constant) and isinstance(n.value, str):
            out |= _annotation_names(n)
        elif isinstance(n, ast.Name):
            out.add(n.id)
    return out


def _unbound(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    known = _bound(tree) | set(dir(builtins))
    functions = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    functions += [m for c in tree.body if isinstance(c, ast.ClassDef) for m in c.body
                  if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))]
    out = []
    for f in functions:
        a = f.args
        for arg in [*a.posonlyargs, *a.args, *a.kwonlyargs, a.vararg, a.kwarg]:
            if arg is not None and arg.annotation is not None:
                out += [f"{path.name}:{arg.lineno}: {name}" for name in _annotation_names(arg.annotation) - known]
        if f.returns is not None:
            out += [f"{path.name}:{f.lineno}: {name}" for name in _annotation_names(f.returns) - known]
    return out


@pytest.mark.parametrize("path", sorted(CLI.glob("*.py")), ids=lambda p: p.name)
def test_annotations_name_only_names_their_module_binds(path: Path) -> None:
    assert _unbound(path) == []


def test_the_trainer_annotation_imports_nothing_at_start() -> None:
    code = "import sys, flowrec.cli.train_cmds; print('flowrec.runtime.trainer' in sys.modules, 'torch' in sys.modules)"
    shown = run_bounded([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout_s=120)
    assert shown.stdout.split() == ["False", "False"]
