"""Learning-rate schedules (`training.schedule`): a factor on the optimizers' learning rates at
each step, applied to the dense torch.optim optimizer and to every group's sparse optimizer.

The factor is a pure function of the step and of the decay length fixed when the run starts (its
`horizon_steps`, kept in the checkpoint), so a resumed run sets the same learning rates at every
step as an uninterrupted one.

Example:
    >>> from flowrec.spec.model import ScheduleSpec
    >>> s = LRSchedule(ScheduleSpec(warmup_steps=2, decay="linear"), horizon_steps=6)
    >>> [round(s.factor(k), 2) for k in range(6)]
    [0.5, 1.0, 1.0, 0.75, 0.5, 0.25]
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from flowrec.spec.model import ScheduleSpec
from operators.sparse_optim import SparseOptimizer


@dataclass(frozen=True)
class LRSchedule:
    """The factor of step k (0-based: the step about to run).

    Args:
        spec: the spec's schedule (None: factor 1 at every step).
        horizon_steps: steps of the whole run, fixed at its start; linear/cosine decay without
            `decay_steps` decays over the steps after warmup.
    """

    spec: ScheduleSpec | None
    horizon_steps: int

    def factor(self, step: int) -> float:
        s = self.spec
        if s is None:
            return 1.0
        if step < s.warmup_steps:
            return (step + 1) / s.warmup_steps
        done = step - s.warmup_steps  # steps since warmup ended
        if s.decay == "step":
            return s.gamma ** (done // s.step_size)
        if s.decay == "none":
            return 1.0
        length = s.decay_steps or max(self.horizon_steps - s.warmup_steps, 1)
        frac = min(done / length, 1.0)
        shape = 1.0 - frac if s.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
        return s.min_lr_ratio + (1.0 - s.min_lr_ratio) * shape

    def applies(self, side: str) -> bool:
        """The schedule sets the `side` ("dense" or "sparse") learning rate."""
        return self.spec is not None and self.spec.apply_to in ("both", side)


class LRController:
    """Sets the learning rates of a step: base rate times the schedule's factor.

    Args:
        schedule: the schedule.
        dense: the dense optimizer (its param groups' current lr are the base rates).
        sparse: the sparse optimizers of the packed groups (their current lr are the base rates).
        dense_lr: the spec's dense learning rate (logged).
        sparse_lr: the spec's sparse learning rate (logged; tables with their own optimizer scale alike).
    """

    def __init__(self, schedule: LRSchedule, dense: torch.optim.Optimizer, sparse: list[SparseOptimizer],
                 dense_lr: float, sparse_lr: float) -> None:
        self.schedule = schedule
        self.dense = dense
        self.dense_base = [float(g["lr"]) for g in dense.param_groups]
        self.sparse = [(opt, float(opt.lr)) for opt in sparse]
        self.dense_lr, self.sparse_lr = dense_lr, sparse_lr

    def apply(self, step: int) -> tuple[float, float]:
        """Set the rates of step `step` (0-based); returns (dense lr, sparse lr) as the spec names them."""
        factor = self.schedule.factor(step)
        dense_f = factor if self.schedule.applies("dense") else 1.0
        sparse_f = factor if self.schedule.applies("sparse") else 1.0
        for group, base in zip(self.dense.param_groups, self.dense_base):
            group["lr"] = base * dense_f
        for opt, base in self.sparse:
            opt.lr = base * sparse_f
        return self.dense_lr * dense_f, self.sparse_lr * sparse_f


def sparse_optimizers(modules: Any) -> list[SparseOptimizer]:
    """Every distinct sparse optimizer among `modules` (an nn.Module tree), in module order."""
    seen: dict[int, SparseOptimizer] = {}
    for module in modules.modules():
        opt = getattr(module, "optimizer", None)
        if isinstance(opt, SparseOptimizer):
            seen.setdefault(id(opt), opt)
    return list(seen.values())
