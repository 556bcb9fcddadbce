"""The plan a run executes (`flowrec train` and `flowrec.train` alike): a saved plan file (checked
against the spec) or the planner's plan for the run's device, its cache pass fed a sampled access
profile of the run's data. The runtime then runs it unchanged. Every problem is a `RunError`.

Example:
    >>> plan, device = plan_for_run(spec, "auto", None, None)  # doctest: +SKIP
"""
from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import torch

from flowrec.graph.types import ACCESS_SAMPLED, Plan
from flowrec.planner.access import dataset_rows
from flowrec.planner.calibration import is_profile_path
from flowrec.planner.contract import PlanError, load_plan, other_writer, read_plan_document
from flowrec.planner.manager import PassFailure, load_profile, make_plan, profile_digest, recorded_profile
from flowrec.runtime.messages import first_line
from flowrec.planner.targets import spec_target_profile, target_for_device
from flowrec.runs.errors import RunError
from flowrec.runtime.session import resolve_device
from flowrec.spec.model import ModelSpec
from flowrec.spec.units import counted
from operators.device import device_name


# A progress display of reading the data before planning: called with a description and the rows
# to read, it gives a context whose value is called with the rows of each part read (the CLI's bar).
Progress = Callable[[str, int], AbstractContextManager[Callable[[int], None]]]


def no_progress(description: str, total: int) -> AbstractContextManager[Callable[[int], None]]:
    """No display (the API's default)."""
    return nullcontext(lambda rows: None)


def device_for_run(spec: ModelSpec, device_name: str) -> torch.device:
    """The device of a run (auto: the spec's hint, else CUDA when present). A spec's plan.device
    of cuda on a machine without CUDA is named as the spec's, not as a --device never given."""
    try:
        return resolve_device(device_name if device_name != "auto" else spec.plan.device, from_spec=device_name == "auto")
    except RuntimeError as exc:
        raise RunError(str(exc)) from None


def cost_target(device: torch.device) -> str:
    """The cost-model target of a device (`flowrec.planner.targets`: the one rule)."""
    return target_for_device(device.type, device_name(device))


def plan_for_run(spec: ModelSpec, device_name: str, device_budget: str | None, plan_file: Path | None,
                 status: Callable[[str], None] = lambda _: None,
                 profile: Path | None = None, target: str | None = None,
                 data: str | None = None, world_size: int = 1, epochs: int | None = None,
                 max_steps: int | None = None, progress: Progress = no_progress,
                 cache: str | None = None) -> tuple[Plan, torch.device]:
    """(plan, device) of a run; every problem is a `RunError` (one line).

    `profile` is an access profile (`flowrec data profile --json`) for the planner's cache pass;
    without one and with `data`, the run's encoded dataset folder, the planner predicts cache
    traffic from a seeded sample of it (`sampled_access_profile`) instead of its Zipf model.
    `target` is the cost model's device: a datasheet name or a calibrated profile file
    (`flowrec calibrate`); default: the datasheet profile of the run's device. `world_size`: the
    ranks of the run (the plan shards its groups over them). `epochs` and `max_steps` (the run's
    settings; default: the spec's training.epochs, no limit) are the epochs the plan prices a
    lookahead group's traffic over (`run_epochs`). `progress` shows the data's sample being read.
    `cache`: the run's --cache (already the spec's plan.cache); a plan file decides placements itself.
    """
    device = device_for_run(spec, device_name)
    if plan_file is not None:
        recorded = _plan_profile(plan_file)
        if profile is not None and (recorded is None or not _same_profile(profile, recorded[1])):
            raise RunError("--profile and --plan both decide placements: plan again with "
                           "`flowrec plan SPEC --profile ... --json FILE`, or give only one"
                           + (f" (the plan was priced from {recorded[0]}, a file of other bytes)" if recorded else ""))
        if device_budget is not None:
            raise RunError("--device-budget and --plan both decide placements: edit the plan's groups "
                           "instead, or plan again with `flowrec plan SPEC --device-budget ... --json FILE`")
        if cache is not None:  # it was ignored: the plan's groups keep their placements
            raise RunError("--cache and --plan both decide placements: edit the plan's groups instead, or plan "
                           "again with `flowrec plan SPEC --cache ... --json FILE`")
        if target is not None:  # it was ignored: the plan is priced for its own target
            raise RunError("--target and --plan both decide the cost model's device: the plan's is its target "
                           "field; plan again with `flowrec plan SPEC --target ... --json FILE`, or give only one")
        access = None
        if recorded is None and _plan_access(plan_file).startswith(ACCESS_SAMPLED):  # priced from its run's sample of the
            # training data (a run's RUN/plan.json): priced so again, from this run's data, not by the Zipf model
            if data is None:
                status(f"plan: {plan_file} was priced from a sample of its run's training data; this run has no "
                       "--data, so its cache traffic is priced by the Zipf model")
            else:
                access = sampled_access_profile(spec, data, status, progress)  # kept for a static_hot group's FAE
        if recorded is not None:  # priced from an access profile: price it so again (not by the Zipf model)
            given = profile if profile is not None else recorded[0]
            if profile is None and not _same_profile(given, recorded[1]):
                why = "which is gone" if profile_digest(given) is None else "whose bytes changed since"
                raise RunError(f"{plan_file} was priced from the access profile {given}, {why}; give that profile "
                               "with --profile FILE, or plan again (`flowrec plan SPEC --json FILE`)")
            try:
                access = load_profile(given, spec)
            except ValueError as exc:
                raise RunError(str(exc)) from None
        planned = run_epochs(spec, access, epochs, max_steps)  # the epochs a lookahead group's traffic is priced
        if planned != spec.training.epochs:  # over: the run's, as a run without --plan prices them (not the spec's)
            spec = replace(spec, training=replace(spec.training, epochs=planned))
        plan = None
        try:
            plan = load_plan(plan_file, spec, profile=access, world_size=world_size)
        except PlanError as exc:
            raise RunError(str(exc)) from None
        finally:
            if plan is None or not any(g.placement == "static_hot" for g in plan.meta.groups):
                from flowrec.data.profile import forget_kept_sample

                forget_kept_sample()  # no hot set to choose: nothing takes the sample
        status(f"plan: {plan_file} (target {plan.target}, {counted(len(plan.meta.groups), 'packed group')})")
        if (written := other_writer(plan)) is not None:
            status(f"plan: {plan_file} was {written}")
        here = cost_target(device)
        if not is_profile_path(plan.target) and plan.target != here:  # its figures are not this device's
            status(f"plan: {plan_file}'s figures (step time, memory, hit rates) are for target {plan.target}, not "
                   f"this run's {device.type} device (target {here}); its placements are used as they are "
                   f"(`flowrec plan SPEC --target {here} --json FILE` prices them for this device)")
        return plan, device
    from flowrec.data.profile import forget_kept_sample

    plan = None
    try:
        access = load_profile(profile, spec) if profile is not None else sampled_access_profile(spec, data, status, progress)
        planned = run_epochs(spec, access, epochs, max_steps)
        if planned != spec.training.epochs:
            spec = replace(spec, training=replace(spec.training, epochs=planned))
        run_target = target or cost_target(device)
        if target is None and spec.plan.target is not None and spec.plan.target != run_target:
            spec_target_profile(spec)  # a spec's target that `flowrec plan` refuses is refused here too
            status(f"plan: the spec's plan.target {spec.plan.target} is for `flowrec plan`; this run prices "
                   f"its {device.type} device with target {run_target} (--target {spec.plan.target} to use it)")
        plan = make_plan(spec, target=run_target, device_budget=device_budget, profile=access,
                         world_size=world_size)
    except RunError:
        raise
    except (ValueError, OSError, PassFailure) as exc:
        raise RunError(str(exc)) from None
    finally:
        if plan is None or not any(g.placement == "static_hot" for g in plan.meta.groups):
            forget_kept_sample()  # no plan, or no hot set to choose: nothing takes the sample
    return plan, device



def _plan_access(plan_file: Path) -> str:
    """What a plan file says its cache traffic was priced from (`cost.access_profile`), '' when it
    says nothing (or the file is no plan: `load_plan` says so)."""
    try:
        doc = read_plan_document(plan_file)
    except PlanError:
        return ""
    cost = doc.get("cost")
    access = cost.get("access_profile") if isinstance(cost, dict) else None
    return access if isinstance(access, str) else ""


def _plan_profile(plan_file: Path) -> tuple[str, str | None] | None:
    """The access profile a plan file says it was priced from (`recorded_profile`), None when none
    (or the file is no plan: `load_plan` says so)."""
    return recorded_profile(_plan_access(plan_file))


def _same_profile(path: str | Path, digest: str | None) -> bool:
    """Whether the file `path` is the profile of `digest` (a plan of an earlier flowrec recorded
    none: any readable file)."""
    found = profile_digest(path)
    return found is not None and (digest is None or found.startswith(digest))


def run_epochs(spec: ModelSpec, access: dict[str, Any] | None, epochs: int | None, max_steps: int | None) -> int:
    """The whole epochs a run trains: `epochs` (default the spec's), fewer when `max_steps` ends it
    sooner and the access profile knows the data's rows (`dataset_rows`); at least 1.

    Example:
        >>> from flowrec.spec.load import load_spec
        >>> spec = load_spec("specs/movielens.yaml")  # batch 1,024, 5 epochs
        >>> run_epochs(spec, {"dataset_rows": 10_240}, None, 25), run_epochs(spec, None, 3, 25)
        (2, 3)
        >>> run_epochs(spec, {"dataset_rows": 10_240}, None, 4), run_epochs(spec, {"dataset_rows": 10_240}, None, None)
        (1, 5)
    """
    planned = int(epochs if epochs is not None else spec.training.epochs)
    rows = dataset_rows(access)
    if max_steps is not None and rows:
        per_epoch = -(-rows // spec.training.batch_size)
        planned = min(planned, max_steps // per_epoch)
    return max(1, planned)


def sampled_access_profile(spec: ModelSpec, data: str | None, status: Callable[[str], None],
                           progress: Progress = no_progress) -> dict[str, Any] | None:
    """An access profile of a seeded sample of the run's training data: FAE's own sample.

    The sample is the one a static hot set is chosen from at the start of training
    (`flowrec.graph.kinds.hot_sample_rate`: 5 % of the rows, at least 20,000 or all; the same seed),
    so the planner prices the hot set the runtime will hold rather than extrapolating to a larger
    sample. Reading the data, not counting, is most of its cost at any rate; the sampled rows are
    kept for the hot set (`sample_rows`' `keep`), which then reads the data no second time.

    None without a dataset folder (synthetic data follows the planner's Zipf model); a status line
    says when the plan uses a sample. A dataset that cannot be read is a `RunError`.
    """
    if data is None:
        return None
    from flowrec.data.layout import DataError, train_part
    from flowrec.data.profile import profile_access
    from flowrec.runtime.session import open_dataset

    train = train_part(data)
    try:
        source = open_dataset(train, spec)
        try:
            rows = sum(source.partition_rows())
            with progress("sampling the data for the plan", rows) as advance:
                profile = profile_access(spec, source, seed=spec.training.seed, keep_sample=True,  # FAE's sample,
                                         planner_only=True, progress=advance)  # kept for it
        finally:
            source.close()
    except (DataError, OSError, ValueError) as exc:
        raise RunError(first_line(exc), cause=exc) from None
    status(f"access profile: sampled {profile['samples']:,} of {profile['dataset_rows']:,} rows of {train} "
           f"(seed {spec.training.seed}) to predict cache traffic")
    return profile

