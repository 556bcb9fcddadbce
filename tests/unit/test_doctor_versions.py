"""`flowrec doctor` names the CuPy that is installed, whichever CUDA major version its wheel is for
(an H200 with CUDA 13's cupy-cuda13x was reported as "cupy not installed")."""
from __future__ import annotations

import importlib.metadata

import pytest

from flowrec.measure import doctor


def _installed(monkeypatch, present: dict[str, str]) -> None:
    def version(name: str) -> str:
        if name in present:
            return present[name]
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(doctor.importlib.metadata, "version", version)


@pytest.mark.parametrize("dist", ["cupy-cuda13x", "cupy-cuda12x", "cupy-cuda11x"])
def test_a_cupy_wheel_for_any_cuda_is_reported_with_its_name(monkeypatch, dist):
    _installed(monkeypatch, {dist: "14.2.0"})
    assert doctor.cupy_version() == f"14.2.0 ({dist})"


def test_cupy_built_from_source_and_no_cupy(monkeypatch):
    _installed(monkeypatch, {"cupy": "13.6.0"})
    assert doctor.cupy_version() == "13.6.0"
    _installed(monkeypatch, {})
    assert doctor.cupy_version() is None
