"""The examples in the docstrings of `flowrec.data` run as written (`python -m pytest
--doctest-modules flowrec/data`): managed_stage's example once used a name it never defined."""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

from flowrec.testing.examples import examples_failures

DATA = Path(__file__).resolve().parents[2] / "flowrec" / "data"
MODULES = sorted(f"flowrec.data.{p.stem}" for p in DATA.glob("*.py") if p.stem != "__init__")


@pytest.mark.parametrize("name", MODULES)
def test_the_examples_of_a_data_module_run(name: str) -> None:
    assert examples_failures(name) == ""


def test_the_managed_stage_example_runs() -> None:
    """Not skipped: its example remaps a batch."""
    module = importlib.import_module("flowrec.data.managed_stage")
    (test,) = [t for t in doctest.DocTestFinder().find(module) if t.name == module.__name__]
    runner = doctest.DocTestRunner()
    result = runner.run(test, out=lambda _: None)
    assert result.attempted >= 5 and result.failed == 0
