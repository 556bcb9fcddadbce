"""Shared test fixtures: paths to ../shared/data (skip when absent), GPU skipping, temp dirs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SHARED_DATA = Path(os.environ.get("FLOWREC_SHARED_DATA", REPO.parent / "shared" / "data"))


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA (no GPU on this machine)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


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
