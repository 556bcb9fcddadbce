"""The one rule from a device to the cost model's target (its datasheet profile).

A target is a datasheet name (`cpu`, `a100`, `h100`) or a calibrated profile file from
`flowrec calibrate`. Every caller that knows a device (a run, `flowrec calibrate`) or only the
spec's device hint (`flowrec plan`) asks here, so one device never gets two targets.

Example:
    >>> target_for_device("cuda", "NVIDIA H200")
    'h100'
    >>> target_for_device("cuda", "")  # a CUDA device of unknown name: the A100 datasheet
    'a100'
    >>> target_for_device("cpu")
    'cpu'
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from flowrec.planner.calibration import is_profile_path
from flowrec.planner.cost import DeviceProfile, device_profile

if TYPE_CHECKING:
    from flowrec.spec.model import ModelSpec

HOPPER = ("h100", "h200", "gh200")  # device names priced with the H100 datasheet


def target_for_device(kind: str, name: str = "") -> str:
    """The datasheet target of a device of `kind` (torch's device type) named `name` (the CUDA
    device name; empty when unknown): cpu off CUDA, h100 for Hopper parts, else a100."""
    if kind != "cuda":
        return "cpu"
    lowered = name.lower()
    return "h100" if any(h in lowered for h in HOPPER) else "a100"


def resolve_target(spec: ModelSpec, target: str | None) -> str:
    """The cost-model target of a plan: the argument, else the spec's `plan.target`, else the rule
    above for the spec's device hint. Raises ValueError for an unknown name or a bad profile."""
    if target is None and spec.plan.target is not None:
        spec_target_profile(spec)
        return spec.plan.target
    name = target or target_for_device("cuda" if spec.plan.device == "cuda" else "cpu")
    device_profile(name)
    return name


def spec_target_profile(spec: ModelSpec) -> DeviceProfile:
    """The profile of the spec's `plan.target`. Raises ValueError naming it as the spec's: a
    profile file is read from the working folder, not the spec's folder (unlike `data.path`),
    which the message says when the file is not there."""
    name = spec.plan.target
    assert name is not None
    try:
        return device_profile(name)
    except (ValueError, OSError) as exc:
        where = ""
        if is_profile_path(name) and not Path(name).is_absolute() and not Path(name).exists():
            where = f"; a relative plan.target is read from the working folder ({Path.cwd()}), not the spec's folder"
        raise ValueError(f"the spec's plan.target: {exc}{where}" if name in str(exc)
                         else f"the spec's plan.target {name}: {exc}{where}") from None
