"""The plan a `flowrec train` run executes: a saved plan file (checked against the spec) or the
planner's plan for the run's device. The runtime then runs it unchanged.

Example:
    >>> plan, device = plan_for_run(spec, "auto", None, None)  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from flowrec.cli.common import fail
from flowrec.graph.types import Plan
from flowrec.planner.contract import PlanError, load_plan
from flowrec.planner.manager import PassFailure, make_plan
from flowrec.runtime.session import cost_target, resolve_device
from flowrec.spec.model import ModelSpec


def plan_for_run(spec: ModelSpec, device_name: str, device_budget: str | None, plan_file: Path | None,
                 status: Callable[[str], None] = lambda _: None,
                 target: str | None = None) -> tuple[Plan, torch.device]:
    """(plan, device) of a run; every problem is one line and exit 2 (`fail`).

    `target` is the cost model's device: a datasheet name or a calibrated profile file
    (`flowrec calibrate`); default: the datasheet profile of the run's device.
    """
    try:
        device = resolve_device(device_name if device_name != "auto" else spec.plan.device)
    except RuntimeError as exc:
        fail(str(exc))
    if plan_file is not None:
        if device_budget is not None:
            fail("--device-budget and --plan both decide placements: edit the plan's groups instead, "
                 "or plan again with `flowrec plan SPEC --device-budget ... --json FILE`")
        try:
            plan = load_plan(plan_file, spec)
        except PlanError as exc:
            fail(str(exc))
        status(f"plan: {plan_file} (target {plan.target}, {len(plan.meta.groups)} packed groups)")
        return plan, device
    try:
        plan = make_plan(spec, target=target or cost_target(device), device_budget=device_budget)
    except (ValueError, PassFailure) as exc:
        fail(str(exc))
    return plan, device
