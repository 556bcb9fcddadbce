"""Session resolution: device errors and out-of-memory messages that name tables and budget."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from flowrec.planner.manager import make_plan
from flowrec.runtime import lowering as lowering_mod
from flowrec.runtime import session as session_mod
from flowrec.runtime.session import SessionOptions, prepare, resolve_device
from flowrec.spec import load_spec


def test_cuda_without_cuda_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="CUDA is not available"):
        resolve_device("cuda")
    assert resolve_device("auto") == torch.device("cpu")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_out_of_memory_names_the_group_and_the_planned_budget(repo: Path, monkeypatch, device: str):
    spec_path = repo / "specs" / "dlrm_criteo.yaml"
    spec = load_spec(spec_path)
    plan = make_plan(spec, target="cpu", device_budget="3GiB")

    def no_memory(group, seed, dev):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.01 GiB")

    monkeypatch.setattr(lowering_mod, "group_embedding", no_memory)
    monkeypatch.setattr(session_mod, "synthetic_sources", lambda *a: (None, None, "synthetic"))
    with pytest.raises(RuntimeError) as err:
        prepare(spec, spec_path, SessionOptions(), plan, torch.device(device))
    message = str(err.value)
    assert "group g0_d16 (26 tables, 2.1 GiB with optimizer state" in message
    assert "planner assumed a device budget of 3.0 GiB" in message
    assert ("--device cpu" in message) == (device == "cuda")
    assert ("--device-budget" in message) == (device == "cuda")
    assert "Tried to allocate 2.01 GiB" in message
