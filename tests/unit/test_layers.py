"""Dependencies run one way, with no cycles (docs/architecture.md):

    cli, api -> runs -> {serving, measure} -> runtime -> {data -> operators} -> graph -> spec
    cli, api -> runs -> planner -> graph -> spec;   measure -> planner

`runs` is the one run lifecycle of the CLI and the API: it raises typed errors and never prints
(no typer, no rich).

Inside: distributed code never imports checkpoints, checkpoints never import the trainer, and
scoring a package (`flowrec.serving.predict`) never reaches the training runtime.

`operators/` imports nothing from flowrec; `flowrec.data` does not import the planner; planning
(spec, graph, planner) imports neither torch nor dask. Imports inside functions count too.
"""
from __future__ import annotations

import ast
from pathlib import Path

import networkx as nx
import pytest

REPO = Path(__file__).resolve().parents[2]

# layer -> the layers it may import (itself included)
ALLOWED: dict[str, set[str]] = {
    "flowrec.spec": {"flowrec.spec"},
    "flowrec.graph": {"flowrec.graph", "flowrec.spec", "flowrec.version"},  # a plan records the version that wrote it
    "flowrec.planner": {"flowrec.planner", "flowrec.graph", "flowrec.spec", "flowrec.version"},
    "flowrec.render": {"flowrec.render", "flowrec.graph", "flowrec.spec"},
    "flowrec.data": {"flowrec.data", "flowrec.graph", "flowrec.spec", "operators"},  # casting in staging
    "operators": {"operators"},
    "flowrec.runtime": {"flowrec.runtime", "flowrec.data", "flowrec.graph", "flowrec.spec", "operators",
                        "flowrec.version"},  # a package records the version that wrote it
    "flowrec.serving": {"flowrec.serving", "flowrec.runtime", "flowrec.data", "flowrec.graph", "flowrec.spec",
                        "operators", "flowrec.version"},
    "flowrec.measure": {"flowrec.measure", "flowrec.runtime", "flowrec.planner", "flowrec.data", "flowrec.graph",
                        "flowrec.spec", "operators", "flowrec.version"},
    "flowrec.runs": {"flowrec.runs", "flowrec.serving", "flowrec.measure", "flowrec.runtime", "flowrec.planner",
                     "flowrec.data", "flowrec.graph", "flowrec.spec", "operators"},
    "flowrec.testing": {"flowrec.testing", "flowrec.measure", "flowrec.runtime", "flowrec.planner", "flowrec.data",
                        "flowrec.graph", "flowrec.spec", "operators"},
    "flowrec.cli": {"flowrec.cli", "flowrec.runs", "flowrec.serving", "flowrec.measure", "flowrec.runtime", "flowrec.planner",
                    "flowrec.render", "flowrec.data", "flowrec.graph", "flowrec.spec", "operators", "flowrec.version"},
    "flowrec.api": {"flowrec.api", "flowrec.runs", "flowrec.serving", "flowrec.runtime", "flowrec.planner", "flowrec.data",
                    "flowrec.graph", "flowrec.spec", "operators"},
    "flowrec.version": {"flowrec.version"},
    "flowrec.__main__": {"flowrec.__main__", "flowrec.cli"},
    # the face (flowrec/__init__.py): reaches the API, the version and the model loader on first use
    "flowrec": {"flowrec.api", "flowrec.version", "flowrec.serving"},
}
ROOT = "flowrec"  # the face: no module imports it (`flowrec.version` holds the version)
PLANNING = ("flowrec.spec", "flowrec.graph", "flowrec.planner", "flowrec.render")
HEAVY = ("torch", "dask", "distributed", "cupy", "pyarrow")


def module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, name: str | None = None) -> set[str]:
    """Every module `path` (module `name`) imports, at any depth of its code (absolute names)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    out = set()
    name = name or module_name(path)
    package = name.rsplit(".", 1)[0] if path.name != "__init__.py" else name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            out.add(base)
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def layer(module: str) -> str | None:
    """The layer of a project module (None for a module outside flowrec and operators)."""
    if module == ROOT:
        return ROOT
    return next((name for name in sorted(ALLOWED, key=len, reverse=True)
                 if name != ROOT and (module == name or module.startswith(name + "."))), None)


def sources() -> list[Path]:
    return sorted(p for root in ("flowrec", "operators") for p in (REPO / root).rglob("*.py"))


def project_modules() -> set[str]:
    return {module_name(p) for p in sources()}


def violations(files: list[tuple[str, Path]]) -> list[str]:
    """`module imports target` lines for every import that crosses the layers the wrong way."""
    problems = []
    for name, path in files:
        mine = layer(name)
        if mine is None:
            continue
        for target in imports(path, name):
            theirs = layer(target)
            if theirs is not None and theirs not in ALLOWED[mine]:
                problems.append(f"{name} ({mine}) imports {target} ({theirs})")
    return problems


def test_every_import_follows_the_layers():
    problems = violations([(module_name(p), p) for p in sources()])
    assert not problems, "\n".join(problems)


def test_planning_imports_no_device_stack():
    problems = [f"{path.relative_to(REPO)} imports {t}" for path in sources()
                if module_name(path).startswith(PLANNING)
                for t in imports(path) if t.split(".")[0] in HEAVY]
    assert not problems, "\n".join(problems)


QUIET = ("flowrec.runs",)  # never print: no console libraries
CONSOLE = ("typer", "rich", "click")


def test_the_lifecycle_never_prints():
    problems = [f"{module_name(p)} imports {t}" for p in sources() if module_name(p).startswith(QUIET)
                for t in imports(p) if t.split(".")[0] in CONSOLE]
    problems += [f"{module_name(p)} calls print" for p in sources() if module_name(p).startswith(QUIET)
                 and "print(" in p.read_text(encoding="utf-8")]
    assert not problems, "\n".join(problems)


def test_every_module_is_in_a_layer():
    assert sorted(m for m in project_modules() if layer(m) is None) == []


def test_nobody_imports_the_face():
    """`import flowrec` or `from flowrec import x` inside the package would run the face (and,
    through it, the API) from any module: the circle the face once closed through the exporter."""
    problems = [f"{module_name(p)} imports {ROOT}" for p in sources()
                if module_name(p) != ROOT and ROOT in imports(p)]
    assert not problems, "\n".join(problems)


def test_no_import_cycles_between_modules():
    """Edges into a module's own packages count too (`flowrec.x` importing `flowrec` is one)."""
    known = project_modules()
    graph = nx.DiGraph()
    for path in sources():
        me = module_name(path)
        for target in imports(path):
            if target in known and target != me:
                graph.add_edge(me, target)
    cycles = list(nx.simple_cycles(graph))
    assert not cycles, "import cycles: " + "; ".join(" -> ".join(c + [c[0]]) for c in cycles[:5])


# inner rules: (modules under this prefix, may not import modules under this one)
INNER_FORBIDDEN = [
    ("flowrec.runtime.distributed", "flowrec.runtime.checkpoint.store"),
    ("flowrec.runtime.checkpoint.store", "flowrec.runtime.trainer"),
    ("flowrec.runtime.checkpoint.store", "flowrec.runtime.session"),
]
# modules that may not reach (import, at any depth of the import graph) these modules
NEVER_REACHES = [
    ("flowrec.serving.predict", "flowrec.runtime"),
    ("flowrec.serving.package", "flowrec.runtime"),
]


def _under(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def inner_violations(files: list[tuple[str, Path]]) -> list[str]:
    return [f"{name} imports {target}" for name, path in files for target in imports(path, name)
            for src, dst in INNER_FORBIDDEN if _under(name, src) and _under(target, dst)]


def import_graph() -> nx.DiGraph:
    known = project_modules()
    graph = nx.DiGraph()
    for path in sources():
        me = module_name(path)
        graph.add_node(me)
        for target in imports(path):
            # `from a.b import c` names module a.b.c when it is one, else a.b
            if target in known and target != me:
                graph.add_edge(me, target)
    return graph


def test_the_inner_rules_hold():
    problems = inner_violations([(module_name(p), p) for p in sources()])
    assert not problems, "\n".join(problems)


def reach_violations(graph: nx.DiGraph) -> list[str]:
    problems = []
    for start, banned in NEVER_REACHES:
        reached = nx.descendants(graph, start)
        bad = sorted(m for m in reached if _under(m, banned))
        if bad:
            path = nx.shortest_path(graph, start, bad[0])
            problems.append(f"{start} reaches {bad[0]}: " + " -> ".join(path))
    return problems


def test_scoring_a_package_never_reaches_the_training_runtime():
    problems = reach_violations(import_graph())
    assert not problems, "\n".join(problems)


def test_the_reach_checker_sees_a_planted_path():
    graph = import_graph()
    graph.add_edge("flowrec.serving.managed", "flowrec.serving.trained")  # trained imports the runtime
    problems = reach_violations(graph)
    assert problems and problems[0].startswith("flowrec.serving.predict reaches flowrec.runtime")


def test_the_inner_checker_sees_a_planted_violation(tmp_path: Path):
    planted = tmp_path / "planted.py"
    planted.write_text("def f():\n    from flowrec.runtime.checkpoint.store import save_checkpoint\n")
    assert sorted(inner_violations([("flowrec.runtime.distributed.planted", planted)])) == [
        "flowrec.runtime.distributed.planted imports flowrec.runtime.checkpoint.store",
        "flowrec.runtime.distributed.planted imports flowrec.runtime.checkpoint.store.save_checkpoint"]


@pytest.mark.parametrize("name,bad", [
    ("operators.planted", "from flowrec.graph.types import PackedGroup\n"),
    ("flowrec.data.planted", "def f():\n    from flowrec.planner.manager import make_plan\n"),
    ("flowrec.runtime.planted", "from ..planner import contract\n"),
    ("flowrec.runtime.planted", "import flowrec\n"),
    ("flowrec.version", "from flowrec.spec import load_spec\n"),
    ("flowrec.runtime.planted", "from flowrec.serving.predict import load_model\n"),
    ("flowrec.runtime.planted", "from flowrec.measure import calibrate\n"),
])
def test_the_checker_sees_a_planted_violation(tmp_path: Path, name: str, bad: str):
    planted = tmp_path / "planted.py"
    planted.write_text(bad)
    assert {p.split(" ")[0] for p in violations([(name, planted)])} == {name}
