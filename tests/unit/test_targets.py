"""One rule from a device to the cost model's target (`flowrec.planner.targets`)."""
from __future__ import annotations

import pytest

from flowrec.planner.targets import resolve_target, target_for_device
from flowrec.testing.specs import tiny_spec


@pytest.mark.parametrize("kind,name,want", [
    ("cpu", "", "cpu"), ("mps", "", "cpu"), ("cuda", "", "a100"), ("cuda", "NVIDIA A100-SXM4-80GB", "a100"),
    ("cuda", "NVIDIA H100 80GB HBM3", "h100"), ("cuda", "NVIDIA H200", "h100"), ("cuda", "NVIDIA GH200 480GB", "h100"),
    ("cuda", "NVIDIA L4", "a100"),
])
def test_a_device_has_one_target(kind: str, name: str, want: str) -> None:
    assert target_for_device(kind, name) == want


def test_the_spec_hint_follows_the_same_rule() -> None:
    assert resolve_target(tiny_spec(device="cuda"), None) == target_for_device("cuda")
    assert resolve_target(tiny_spec(device="cpu"), None) == "cpu"
    assert resolve_target(tiny_spec(device="cuda"), "h100") == "h100"
    with pytest.raises(ValueError):
        resolve_target(tiny_spec(), "no-such-device")
