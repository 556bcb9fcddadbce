"""Allocator tuning applies on glibc Linux and honours the opt-out."""
from __future__ import annotations

import sys

import pytest

from flowrec.runtime.hostmem import tune_host_allocator


def test_opt_out(monkeypatch):
    monkeypatch.setenv("FLOWREC_MALLOC_TUNING", "0")
    assert tune_host_allocator() is False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_applies_on_glibc(monkeypatch):
    monkeypatch.delenv("FLOWREC_MALLOC_TUNING", raising=False)
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):
        pytest.skip("not glibc")
    assert tune_host_allocator() is True
