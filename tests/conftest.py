"""Shared test fixtures: paths to ../shared/data (skip when absent), GPU skipping, temp dirs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

from tiers import tiers_of

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FLOWREC_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    _mark_tiers(items)
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _mark_tiers(items) -> None:
    """Mark each test with its tier (tests/tiers.py); a file in no tier stops the run, named."""
    missing = set()
    for item in items:
        path = item.path.resolve().relative_to(REPO).as_posix()
        marks = tiers_of(path, getattr(item, "originalname", None) or item.name.split("[")[0])
        if marks is None:
            missing.add(path)
            continue
        for mark in sorted(marks):
            item.add_marker(getattr(pytest.mark, mark))
    if missing:
        raise pytest.UsageError(f"{', '.join(sorted(missing))}: in no test tier; add each file to FILES in "
                                f"tests/tiers.py (fast, processes, e2e or fuzz)")


@pytest.fixture(autouse=True, scope="session")
def _temp_dirs(tmp_path_factory):
    """Keep torch-inductor and dask scratch inside the run's own temp dir."""
    base = tmp_path_factory.mktemp("scratch")
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(base / "inductor"))
    os.environ.setdefault("DASK_TEMPORARY_DIRECTORY", str(base / "dask"))
    yield


@pytest.fixture
def shared_data() -> Path:
    """The folder of real datasets; the test is skipped with a clear message when absent."""
    if not SHARED_DATA.is_dir():
        pytest.skip(f"real datasets not found at {SHARED_DATA} (set FLOWREC_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture
def repo() -> Path:
    return REPO
