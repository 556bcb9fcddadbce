"""What the docstring-example tests share: run one module's examples as `--doctest-modules` does.

Example:
    >>> examples_failures("flowrec.planner.targets")  # every example of the module passes
    ''
"""
from __future__ import annotations

import doctest
import importlib
import io


def examples_failures(name: str) -> str:
    """The report of the failed examples in module `name`'s docstrings ('' when every one passes);
    a malformed directive raises ValueError."""
    module = importlib.import_module(name)
    out = io.StringIO()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    for test in doctest.DocTestFinder().find(module, name):
        runner.run(test, out=out.write)
    return out.getvalue() if runner.failures else ""
