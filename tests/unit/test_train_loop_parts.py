"""Learning-rate schedules, gradient clipping and early stopping, each against a plain reference."""
from __future__ import annotations

import math

import pytest
import torch

from flowrec.runtime.evaluation.early_stop import EarlyStopper
from flowrec.runtime.lr_schedule import LRController, LRSchedule
from flowrec.runtime.step import _dense_update
from flowrec.spec.model import EarlyStoppingSpec, ScheduleSpec
from operators.sparse_optim import make_optimizer


def _reference(spec: ScheduleSpec, horizon: int, k: int) -> float:
    if k < spec.warmup_steps:
        return (k + 1) / spec.warmup_steps
    t = k - spec.warmup_steps
    length = spec.decay_steps or horizon - spec.warmup_steps
    if spec.decay == "step":
        return spec.gamma ** math.floor(t / spec.step_size)
    if spec.decay == "none":
        return 1.0
    frac = min(t / length, 1.0)
    if spec.decay == "linear":
        return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * (1 - frac)
    return spec.min_lr_ratio + (1 - spec.min_lr_ratio) * (1 + math.cos(math.pi * frac)) / 2


@pytest.mark.parametrize("spec", [
    ScheduleSpec(),
    ScheduleSpec(warmup_steps=7),
    ScheduleSpec(warmup_steps=3, decay="linear"),
    ScheduleSpec(decay="cosine", min_lr_ratio=0.2),
    ScheduleSpec(warmup_steps=5, decay="cosine", decay_steps=11),
    ScheduleSpec(warmup_steps=2, decay="step", step_size=4, gamma=0.5),
])
def test_schedule_factor_equals_reference(spec: ScheduleSpec) -> None:
    schedule = LRSchedule(spec, horizon_steps=40)
    got = [schedule.factor(k) for k in range(60)]
    assert got == pytest.approx([_reference(spec, 40, k) for k in range(60)], rel=1e-12)
    if spec.warmup_steps:
        assert got[0] == pytest.approx(1 / spec.warmup_steps) and got[spec.warmup_steps - 1] == 1.0


def test_controller_scales_dense_and_sparse_rates_from_their_bases() -> None:
    w = torch.nn.Parameter(torch.ones(3))
    dense = torch.optim.Adam([w], lr=0.01)
    sparse = make_optimizer(("adagrad", 0.5, ()))
    ctl = LRController(LRSchedule(ScheduleSpec(warmup_steps=4, apply_to="dense"), 10), dense, [sparse], 0.01, 0.5)
    assert ctl.apply(0) == (pytest.approx(0.0025), 0.5)
    dense.param_groups[0]["lr"] = 123.0  # a loaded optimizer state must not become the base
    assert ctl.apply(1) == (pytest.approx(0.005), 0.5) and dense.param_groups[0]["lr"] == pytest.approx(0.005)
    both = LRController(LRSchedule(ScheduleSpec(warmup_steps=4), 10), dense, [sparse], 0.01, 0.5)
    assert both.apply(1)[1] == pytest.approx(0.25) and sparse.lr == pytest.approx(0.25)


def test_clipping_scales_the_dense_gradient_to_the_norm() -> None:
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(4)), torch.nn.Parameter(torch.randn(2, 3))
    a.grad, b.grad = torch.randn(4) * 10, torch.randn(2, 3) * 10
    expected_scale = 0.5 / torch.cat([a.grad.ravel(), b.grad.ravel()]).norm()
    before = (a.detach().clone(), b.detach().clone(), a.grad.clone(), b.grad.clone())
    _dense_update(torch.optim.SGD([a, b], lr=1.0), 0.5)
    assert torch.allclose(a, before[0] - before[2] * expected_scale, atol=1e-6)
    assert torch.allclose(b, before[1] - before[3] * expected_scale, atol=1e-6)
    small = torch.nn.Parameter(torch.zeros(2))
    small.grad = torch.tensor([0.1, 0.0])
    _dense_update(torch.optim.SGD([small], lr=1.0), 0.5)  # under the norm: unchanged gradient
    assert small.detach().tolist() == pytest.approx([-0.1, 0.0])


def _evals(stopper: EarlyStopper, values: list[float]) -> list[tuple[bool, bool]]:
    out = []
    for step, value in enumerate(values, 1):
        v = stopper.observe({"ctr": {"auc": value, "logloss": value}}, step * 10)
        out.append((v.improved, v.stop))
    return out


def test_early_stopping_patience_min_delta_and_mode() -> None:
    stopper = EarlyStopper.of(EarlyStoppingSpec("auc", patience=2, min_delta=0.01), "ctr")
    got = _evals(stopper, [0.70, 0.705, 0.72, 0.72, 0.80])
    assert got == [(True, False), (False, False), (True, False), (False, False), (True, False)]
    stopper = EarlyStopper.of(EarlyStoppingSpec("auc", patience=2), "ctr")
    assert _evals(stopper, [0.7, 0.6, float("nan")])[-1] == (False, True)
    assert stopper.state.best == 0.7 and stopper.state.best_step == 10
    lower = EarlyStopper.of(EarlyStoppingSpec("logloss", patience=1), "ctr")
    assert lower.mode == "min" and _evals(lower, [0.5, 0.4, 0.45]) == [(True, False), (True, False), (False, True)]
    again = EarlyStopper.of(EarlyStoppingSpec("logloss", patience=1), "ctr")
    again.load_state_dict(lower.state_dict())
    assert again.state == lower.state and again.state.stopped


def test_early_stopping_does_not_count_an_undefined_metric_before_a_best() -> None:
    """Early stopping on auc with evaluation labels of one class (AUC undefined, NaN, at every
    evaluation) stopped the run at its second evaluation: 'the best (step None) is in best/', and no
    best/ was written."""
    stopper = EarlyStopper.of(EarlyStoppingSpec("auc", patience=2), "ctr")
    assert _evals(stopper, [float("nan")] * 4) == [(False, False)] * 4
    assert stopper.state.best is None and not stopper.state.stopped
    assert _evals(stopper, [0.7, float("nan"), 0.6]) == [(True, False), (False, False), (False, True)]
    assert stopper.state.best == 0.7 and stopper.state.best_step == 10  # steps count from 10 per call


def test_early_stopping_on_calibration_keeps_the_evaluation_closest_to_one() -> None:
    # calibration is mean prediction over mean label, best at 1.0: watched as the ratio with mode
    # min, an evaluation predicting too little (0.5) was the best, over one calibrated to 1.02
    stopper = EarlyStopper.of(EarlyStoppingSpec("calibration", patience=2), "ctr")
    got = [stopper.observe({"ctr": {"calibration": v}}, step).improved
           for step, v in ((10, 1.3), (20, 1.02), (30, 0.5), (40, 0.97))]
    assert got == [True, True, False, False]
    assert stopper.state.best == 1.02 and stopper.state.best_step == 20 and stopper.state.stopped
    under = EarlyStopper.of(EarlyStoppingSpec("calibration", patience=1, min_delta=0.05), "ctr")
    assert [under.observe({"ctr": {"calibration": v}}, 1).improved for v in (0.8, 1.1, 0.94)] == [True, True, False]


def test_an_evaluations_line_shows_a_small_best_with_its_digits(capsys) -> None:
    """Early stopping on the mse of a regression head of rates: every evaluation's line said
    '(best val/mse 0.0000 at step 10)', as if the model had been exact."""
    import types

    from flowrec.cli.train_cmds import _console_hooks
    from flowrec.runtime.trainer import EvalEvent

    stopper = EarlyStopper.of(EarlyStoppingSpec("mse", patience=3), "val")
    trainer = types.SimpleNamespace(stopper=stopper, model=types.SimpleNamespace(retrieval=None))
    hooks = _console_hooks(trainer, quiet=False)
    for step, mse in ((10, 3.2e-06), (20, 4.1e-06)):
        verdict = stopper.observe({"val": {"mse": mse}}, step)
        hooks.on_eval(EvalEvent(step, {"val": {"mse": mse, "mae": 0.001, "samples": 9}}, False, verdict.improved))
    assert "evaluation at step 20 (best val/mse 3.2000e-06 at step 10)" in capsys.readouterr().err


def test_a_regression_loss_overflowed_by_its_labels_says_so() -> None:
    """A regression label of 1e30 (a price in the wrong unit) stopped training with 'non-finite loss
    (inf) at step 2 in head val' alone, as if the learning rate had diverged: its squared error is
    beyond float32 whatever the model."""
    import types

    from flowrec.runtime.trainer import Trainer
    from flowrec.spec import spec_from_dict

    spec = spec_from_dict({
        "name": "t", "features": [{"name": "d", "type": "dense"}],
        "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "m", "label": "click"},
                  {"name": "val", "input": "m", "task": "regression", "label": "y"}]})
    trainer = types.SimpleNamespace(spec=spec)
    huge = types.SimpleNamespace(labels=torch.tensor([[0.0, 1.5], [1.0, -1e30]]))
    note = Trainer._label_note(trainer, "val", huge)
    assert note.startswith(" (its labels in this batch reach 1e+30, whose squared errors are beyond float32")
    assert Trainer._label_note(trainer, "ctr", huge) == ""  # a binary head's labels are 0 or 1
    assert Trainer._label_note(trainer, "val", types.SimpleNamespace(labels=torch.tensor([[0.0, 1e3]]))) == ""


def test_train_json_writes_an_undefined_metric_as_null(tmp_path, capsys) -> None:
    """flowrec train --json of a run whose evaluation labels were all 0 wrote "auc": NaN, which no
    JSON reader takes (jq, json.loads with parse_constant, JavaScript), where eval --json writes null."""
    import json

    from flowrec.cli.train_cmds import _report
    from flowrec.runtime.trainer import TrainResult

    nan = float("nan")
    result = TrainResult(1, 212, 0.1, 2120.0, nan, eval={"ctr": {"auc": nan, "logloss": 0.75, "samples": 88}})
    _report(result, tmp_path, json_out=True)

    def refuse(constant: str) -> None:
        raise ValueError(f"{constant} is no JSON")

    doc = json.loads(capsys.readouterr().out, parse_constant=refuse)
    assert doc["eval"]["ctr"] == {"auc": None, "logloss": 0.75, "samples": 88} and doc["final_loss"] is None
