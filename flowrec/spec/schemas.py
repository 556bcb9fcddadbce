"""Locate and read the JSON Schemas in the repository's top-level `schemas/` folder.

Example:
    >>> load_schema("model-spec")["title"]
    'flowrec model spec'
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path
from typing import Any

MODEL_SPEC_SCHEMA = "model-spec"
PLAN_SCHEMA = "plan"
ACCESS_PROFILE_SCHEMA = "access-profile"
MODEL_PACKAGE_SCHEMA = "model-package"


def schema_dir() -> Path:
    """The folder holding the JSON Schemas (the repo's `schemas/`, else the installed copy)."""
    repo_dir = Path(__file__).resolve().parents[2] / "schemas"
    if repo_dir.is_dir():
        return repo_dir
    return Path(str(importlib.resources.files("flowrec") / "schemas"))


def schema_path(name: str) -> Path:
    """Path of schema `name` (``"model-spec"`` -> ``schemas/model-spec.schema.json``)."""
    return schema_dir() / f"{name}.schema.json"


@functools.lru_cache(maxsize=None)
def load_schema(name: str) -> dict[str, Any]:
    """Parse schema `name`; cached, so treat the result as read-only.

    Raises:
        FileNotFoundError: if there is no such schema.
    """
    return json.loads(schema_path(name).read_text(encoding="utf-8"))
