"""Allocator tuning applies on glibc Linux and honours the opt-out."""
from __future__ import annotations

import sys

import pytest

from flowrec.runtime.hostmem import tune_host_allocator
from flowrec.testing.processes import run_bounded


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


_FAULTS = """
import resource, sys, torch
from flowrec.runtime.hostmem import tune_host_allocator
print(tune_host_allocator())
faults = []
for _ in range(16):  # a step's 64 MiB temporary, allocated, written and freed again
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    x = torch.empty(16 << 20).fill_(1.5)
    assert float(x[-1]) == 1.5
    del x
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(sum(faults[-4:]), min(faults))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc mallopt is Linux-only")
def test_a_block_above_the_mmap_threshold_is_reused_not_faulted_in_again(tmp_path):
    """A 64 MiB block freed and allocated again in the next step comes back from the heap once the
    heap holds the steps' blocks: its 16,384 pages are not faulted in (and zeroed by the kernel)
    again every step, as they are without tuning."""
    import os

    pages = (64 << 20) // os.sysconf("SC_PAGE_SIZE")
    out = {}
    for tuning in ("1", "0"):
        env = {**os.environ, "FLOWREC_MALLOC_TUNING": tuning, "OMP_NUM_THREADS": "1"}
        done = run_bounded([sys.executable, "-c", _FAULTS], env=env, capture_output=True, text=True, timeout_s=120)
        assert done.returncode == 0, done.stderr[-2000:]
        applied, last, fewest = done.stdout.split()
        out[tuning] = (applied, int(last), int(fewest))
    if out["1"][0] != "True":
        pytest.skip("not glibc")
    assert out["1"][1] < pages  # the steady steps reuse it from the heap (the heap grows to the steps' needs first)
    assert out["0"][2] > pages // 2  # without tuning: a fresh mapping faulted in every time


@pytest.mark.parametrize("value", ["off", "false", "no", "2"])
def test_a_malloc_tuning_value_other_than_0_or_1_is_refused(monkeypatch, value):
    """docs/guide.md's opt-out is FLOWREC_MALLOC_TUNING=0; `=off` or `=false` kept the tuning on
    without a word."""
    from flowrec.runtime import hostmem

    monkeypatch.setenv("FLOWREC_MALLOC_TUNING", value)
    with pytest.raises(ValueError, match=f"FLOWREC_MALLOC_TUNING='{value}': use 0"):
        hostmem.tune_host_allocator()
    for asked, on in (("0", False), ("1", True), ("", True)):
        monkeypatch.setenv("FLOWREC_MALLOC_TUNING", asked)
        assert hostmem.malloc_tuning_asked() is on
