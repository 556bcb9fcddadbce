"""The examples in the docstrings of every module of `flowrec` and `operators` run as written, or
are marked as illustrations (`# doctest: +SKIP` on each line that needs a run's objects):
`python -m pytest --doctest-modules flowrec operators` passes. Before, 18 modules failed it: a
comment after the directive (`# doctest: +SKIP  (bitwise)`) is read as a doctest option, which
refused the whole module, the lines after a skipped one ran without the names it made, and
similarity's example printed a rounded 2.0000 for 2. (flowrec.spec, graph and planner: also
test_planner_doctests, in the fast tier.)"""
from __future__ import annotations

from pathlib import Path

import pytest

from flowrec.testing.examples import examples_failures

REPO = Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
    for package in ("flowrec", "operators") for p in (REPO / package).rglob("*.py")
    if "__pycache__" not in p.parts and p.name != "__main__.py")


def test_every_module_is_found():
    assert "flowrec" in MODULES and "operators.similarity" in MODULES and "flowrec.runtime.checkpoint.shards" in MODULES
    assert len(MODULES) > 100


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_module_run(name: str) -> None:
    assert examples_failures(name) == ""
