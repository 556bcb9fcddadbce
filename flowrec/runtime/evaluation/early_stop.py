"""Early stopping (`training.early_stopping`): watch one head's evaluation metric, remember the best
value and stop after `patience` evaluations without an improvement larger than `min_delta`.
`calibration` (mean prediction over mean label) is best at 1.0, so it is watched as its distance
from 1, |calibration - 1| (`mode` applies to that distance; min by default): watched as the ratio
itself, the lowest mean prediction won, a model predicting 0 everywhere the best.

Its state (best value and step, evaluations without improvement, whether it stopped) travels in
the checkpoint, so a resumed run stops where an uninterrupted one does.

Example:
    >>> from flowrec.spec.model import EarlyStoppingSpec
    >>> stopper = EarlyStopper.of(EarlyStoppingSpec("auc", patience=1), "ctr")
    >>> stopper.observe({"ctr": {"auc": 0.7}}, 10).improved
    True
    >>> stopper.observe({"ctr": {"auc": 0.69}}, 20).stop
    True
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from flowrec.runtime.evaluation.metrics import HIGHER_IS_BETTER
from flowrec.spec.tasks import TASKS
from flowrec.spec.model import EarlyStoppingSpec

RANKING_METRICS = frozenset(TASKS["retrieval"].metrics)  # hr@K, recall@K, ndcg@K, mrr: higher is better
CALIBRATION = "calibration"  # best at 1.0: watched as |calibration - 1|


@dataclass(frozen=True)
class Verdict:
    """What one evaluation meant: a new best, and whether to stop now."""

    improved: bool
    stop: bool


@dataclass
class StopperState:
    best: float | None = None
    best_step: int | None = None
    bad_evals: int = 0
    stopped: bool = False


class EarlyStopper:
    """Decides after each evaluation whether it improved on the best one and whether to stop.

    Args:
        head: the head watched.
        metric: its metric.
        mode: "max" or "min".
        patience: evaluations without improvement before stopping.
        min_delta: an improvement must exceed this.
    """

    def __init__(self, head: str, metric: str, mode: str, patience: int, min_delta: float) -> None:
        self.head, self.metric, self.mode = head, metric, mode
        self.patience, self.min_delta = patience, min_delta
        self.state = StopperState()

    @classmethod
    def of(cls, spec: EarlyStoppingSpec, first_head: str) -> "EarlyStopper":
        higher = spec.metric in HIGHER_IS_BETTER or spec.metric.partition("@")[0] in RANKING_METRICS
        mode = spec.mode or ("max" if higher else "min")
        return cls(spec.head or first_head, spec.metric, mode, spec.patience, spec.min_delta)

    @property
    def watched(self) -> str:
        return f"{self.head}/{self.metric}"

    def _watched_value(self, value: float) -> float:
        """What is compared: the metric, or for calibration its distance from 1 (module docstring)."""
        return abs(value - 1.0) if self.metric == CALIBRATION else value

    def observe(self, metrics: dict[str, dict[str, float]], step: int) -> Verdict:
        """Take the evaluation of `step`; a NaN value never improves, and before any best it does not
        count toward `patience` either (an AUC of evaluation labels of one class is undefined at every
        evaluation: counted, the run stopped at its second with no best to keep)."""
        value = metrics.get(self.head, {}).get(self.metric, float("nan"))
        s = self.state
        better = value is not None and not math.isnan(value)
        if not better and s.best is None:
            return Verdict(False, s.stopped)
        if better and s.best is not None:
            now, best = self._watched_value(value), self._watched_value(s.best)
            better = now > best + self.min_delta if self.mode == "max" else now < best - self.min_delta
        if better:
            s.best, s.best_step, s.bad_evals = float(value), step, 0
        else:
            s.bad_evals += 1
        s.stopped = s.bad_evals >= self.patience
        return Verdict(better, s.stopped)

    def state_dict(self) -> dict[str, Any]:
        return asdict(self.state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a checkpoint's state; TypeError where its keys or their types are not a stopper's (a
        text as `best` or `bad_evals` failed at the next evaluation with a traceback, a text as
        `stopped` said the run stopped early)."""
        loaded = StopperState(**state)
        if not (isinstance(loaded.stopped, bool) and _count(loaded.bad_evals)
                and (loaded.best is None or _number(loaded.best))
                and (loaded.best_step is None or _count(loaded.best_step))):
            raise TypeError("not an early stopping state")
        self.state = loaded


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
