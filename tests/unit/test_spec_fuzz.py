"""Fuzz: seeded random mutations of valid specs give issues (or pass), never an exception."""
from __future__ import annotations

import copy
import random
from pathlib import Path
from typing import Any

import yaml

from flowrec.spec.validate import validate_document

SPECS = Path(__file__).resolve().parents[2] / "specs"
SMALL_SPECS = ("dlrm_criteo.yaml", "din_taobao.yaml", "two_task.yaml", "movielens.yaml")
N_MUTANTS = 300
MUTATIONS_PER_MUTANT = (1, 4)
JUNK: tuple[Any, ...] = (None, -1, 0, 1, 2.5, 1e30, True, "", "x", "@", "@sparse", "none", [], {}, [None], {"a": 1},
                         ["@dense", "@dense"], "4GiB", "bottom")


def _slots(doc: Any, out: list[tuple[Any, Any]]) -> list[tuple[Any, Any]]:
    """Every (container, key) pair in the document."""
    if isinstance(doc, dict):
        for k, v in doc.items():
            out.append((doc, k))
            _slots(v, out)
    elif isinstance(doc, list):
        for i, v in enumerate(doc):
            out.append((doc, i))
            _slots(v, out)
    return out


def _mutate(doc: Any, rng: random.Random) -> None:
    container, key = rng.choice(_slots(doc, []))
    op = rng.randrange(5)
    if op == 0:
        container[key] = copy.deepcopy(rng.choice(JUNK))
    elif op == 1 and isinstance(container, dict):
        del container[key]
    elif op == 2 and isinstance(container, list):
        container.append(copy.deepcopy(container[key]))
    elif op == 3 and isinstance(container[key], str):
        s = container[key]
        container[key] = s[:-1] if s else "?"
    elif isinstance(container, dict):
        container[rng.choice(("dimm", "name", "kind", "extra", "table"))] = copy.deepcopy(rng.choice(JUNK))
    else:
        container[key] = copy.deepcopy(rng.choice(container))


def test_mutated_specs_never_raise():
    rng = random.Random(0)
    sources = [yaml.safe_load((SPECS / name).read_text()) for name in SMALL_SPECS]
    found_issues = 0
    for _ in range(N_MUTANTS):
        doc = copy.deepcopy(rng.choice(sources))
        for _ in range(rng.randint(*MUTATIONS_PER_MUTANT)):
            if _slots(doc, []):
                _mutate(doc, rng)
        issues = validate_document(doc)
        assert all(isinstance(i.path, str) and i.message for i in issues)
        found_issues += bool(issues)
    assert found_issues > N_MUTANTS // 2  # most mutations break a spec, and are reported
