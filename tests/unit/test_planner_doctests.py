"""The examples in the docstrings of `flowrec.spec`, `flowrec.graph` and `flowrec.planner` run as
written (`python -m pytest --doctest-modules flowrec/planner`): contract's and op_work's examples
had an import line without its prompt (doctest refused the whole module), and edges' example set
the inputs of a node its graph did not hold (networkx's KeyError)."""
from __future__ import annotations

from pathlib import Path

import pytest

from flowrec.testing.examples import examples_failures

ROOT = Path(__file__).resolve().parents[2] / "flowrec"
MODULES = sorted(f"flowrec.{package}.{p.stem}" for package in ("spec", "graph", "planner")
                 for p in (ROOT / package).glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_planning_module_run(name: str) -> None:
    assert examples_failures(name) == ""
