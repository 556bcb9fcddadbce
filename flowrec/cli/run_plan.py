"""The plan a `flowrec train` run executes: a saved plan file (checked against the spec) or the
planner's plan for the run's device. The runtime then runs it unchanged.

Example:
    >>> plan, device = plan_for_run(spec, "auto", None, None)  # doctest: +SKIP
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

import torch

from flowrec.cli.common import fail, launch_world_size
from flowrec.graph.types import Plan
from flowrec.planner.contract import PlanError, load_plan
from flowrec.planner.manager import PassFailure, make_plan
from flowrec.runtime.session import cost_target, resolve_device
from flowrec.spec.model import ModelSpec


def plan_for_run(spec: ModelSpec, device_name: str, device_budget: str | None, plan_file: Path | None,
                 status: Callable[[str], None] = lambda _: None,
                 profile: Path | None = None) -> tuple[Plan, torch.device]:
    """(plan, device) of a run; every problem is one line and exit 2 (`fail`). `profile` is an
    access profile (`flowrec data profile --json`) for the planner's cache pass."""
    if launch_world_size() > 1:
        fail("this process was launched as one of several ranks (WORLD_SIZE > 1), but multi-process "
             "training is not in this release yet; plan for many ranks with `flowrec plan --world-size`")
    try:
        device = resolve_device(device_name if device_name != "auto" else spec.plan.device)
    except RuntimeError as exc:
        fail(str(exc))
    if plan_file is not None:
        if profile is not None:
            fail("--profile and --plan both decide placements: plan again with "
                 "`flowrec plan SPEC --profile ... --json FILE`, or give only one")
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
        plan = make_plan(spec, target=cost_target(device), device_budget=device_budget, profile=profile)
    except (ValueError, OSError, PassFailure) as exc:
        fail(str(exc))
    return plan, device
