"""Custom modules as a demanding user meets them: their parameters counted in the plan's memory,
rows scored independently of their batch in eval mode, a failing state_dict one line, and a class
file known by its content wherever it lies."""
from __future__ import annotations

import random
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.planner.fit import misfit
from flowrec.planner.manager import make_plan
from flowrec.runtime.custom import resolve_custom
from flowrec.runtime.lowering import lower
from flowrec.spec import spec_from_dict
from flowrec.spec.errors import SpecError
from flowrec.testing.processes import run_bounded
from operators.custom_code import import_class

BLOCKS = textwrap.dedent('''
    import torch
    from torch import nn


    class Wide(nn.Module):
        """Two linear layers through a hidden width, a buffer of that width and a frozen projection."""
        def __init__(self, in_features, hidden, frozen):
            super().__init__()
            self.up = nn.Linear(in_features, hidden)
            self.down = nn.Linear(hidden, 3)
            self.register_buffer("scale", torch.ones(hidden))
            self.fixed = nn.Linear(in_features, frozen, bias=False)
            self.fixed.weight.requires_grad_(False)

        def forward(self, x):
            return self.down(torch.relu(self.up(x)) * self.scale) + self.fixed(x).sum(1, keepdim=True)


    class Across(nn.Module):
        """A softmax over the batch: a row's score follows the rows batched with it."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 4)

        def forward(self, x):
            return torch.softmax(self.proj(x), dim=0)


    class Later(nn.Module):
        """Each row minus the next row's value: the first row alone differs, the last does not."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 4)

        def forward(self, x):
            h = self.proj(x)
            return h - torch.cat([h[1:], h[:1] * 0], dim=0)


    class Normed(nn.Module):
        """Batch norm: batch statistics in training, running statistics in eval mode."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 5)
            self.norm = nn.BatchNorm1d(5)
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            return self.norm(self.proj(x))


    class Squeezed(nn.Module):
        """(B, 1) squeezed to (B,): one row alone gives a 0-d tensor."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 1)

        def forward(self, x):
            return self.proj(x).squeeze()


    class CenteredInTraining(nn.Module):
        """Subtracts the batch mean while training only."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            h = self.proj(x)
            return h - h.mean(0, keepdim=True) if self.training else h


    class NoisyInEval(nn.Module):
        """Draws noise in eval mode too: no row has one output to compare, so nothing is said."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            return self.proj(x) + 0.01 * torch.randn(len(x), 3)


    class NoSave(nn.Module):
        """Its state_dict raises."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            return self.proj(x)

        def state_dict(self, *args, **kwargs):
            raise RuntimeError("no saving today")


    class OwnSignature(NoSave):
        """A state_dict of its own signature: the model's state_dict passes it prefix= and keep_vars=."""
        def state_dict(self):
            return {"w": self.proj.weight}


    class NoLoad(NoSave):
        """Loading its state raises."""
        def state_dict(self, *args, **kwargs):
            return nn.Module.state_dict(self, *args, **kwargs)

        def _load_from_state_dict(self, *args, **kwargs):
            raise ValueError("no loading today")


    class Opaque(NoLoad):
        """Extra state that a weights_only load cannot read."""
        def _load_from_state_dict(self, *args, **kwargs):
            return nn.Module._load_from_state_dict(self, *args, **kwargs)

        def get_extra_state(self):
            return {"when": object()}

        def set_extra_state(self, state):
            pass


    class PlainExtra(Opaque):
        """Extra state of plain values: a checkpoint copied the model's state as tensors (a traceback)."""
        def get_extra_state(self):
            return {"vocab": ["a", "b"], "version": 2}


    class TensorExtra(Opaque):
        """Extra state that is a tensor: allowed."""
        def get_extra_state(self):
            return torch.arange(3.0)


    class ParamInForward(nn.Module):
        """Makes its weight at its first forward."""
        def forward(self, x):
            if not hasattr(self, "w"):
                self.w = nn.Parameter(torch.randn(x.shape[1], 4, device=x.device))
            return x @ self.w


    class NoGrad(NoSave):
        """Its forward under torch.no_grad(): its parameters never train."""
        def state_dict(self, *args, **kwargs):
            return nn.Module.state_dict(self, *args, **kwargs)

        def forward(self, x):
            with torch.no_grad():
                return self.proj(x)


    class Detached(NoGrad):
        def forward(self, x):
            return self.proj(x).detach()


    class Rewrapped(NoGrad):
        def forward(self, x):
            return nn.Parameter(self.proj(x))


    class Made(NoGrad):
        def forward(self, x):
            return torch.zeros(len(x), 3)


    class InPlaceNoGrad(NoGrad):
        """Scales its input in place (allowed: it has its own copy), then computes without gradients."""
        def forward(self, x):
            x.mul_(2)
            with torch.no_grad():
                return self.proj(x)


    class InPlace(NoGrad):
        def forward(self, x):
            x.mul_(2)
            return self.proj(x)


    class FrozenStop(nn.Module):
        """A fixed projection behind a stopped gradient: allowed (nothing of its own to train)."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3).requires_grad_(False)

        def forward(self, x):
            with torch.no_grad():
                return self.proj(x)


    class StopsInputOnly(NoGrad):
        """Its input's gradient stopped, its own parameters trained: allowed."""
        def forward(self, x):
            return self.proj(x.detach())


    class Counted(nn.Module):
        """Counts its constructions (a slow constructor: pretrained weights read from disk)."""
        built = 0

        def __init__(self, in_features):
            super().__init__()
            type(self).built += 1
            self.proj = nn.Linear(in_features, 3)
            self.norm = nn.BatchNorm1d(3)

        def forward(self, x):
            return self.norm(self.proj(x))


    class LateNoSave(Counted):
        """Its state_dict raises from its second call on: after the build's check, at the checkpoint."""
        def __init__(self, in_features):
            super().__init__(in_features)
            self.saves = 0

        def state_dict(self, *args, **kwargs):
            self.saves += 1
            if self.saves > 1:
                raise OSError("no room for opinions")
            return super().state_dict(*args, **kwargs)


    class BadTrain(Counted):
        """Overrides nn.Module.train without its mode argument."""
        def train(self):
            return self


    class BadTo(Counted):
        def to(self, *args, **kwargs):
            raise RuntimeError("stays where it is")


    class BadParams(Counted):
        def parameters(self, recurse=True):
            raise RuntimeError("keeps its parameters")
''')
runner = CliRunner()


@pytest.fixture()
def blocks(tmp_path):
    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS)
    return path


def spec_doc(cls: str, params: dict) -> dict:
    return {
        "name": "hostile_custom",
        "features": [
            {"name": "x0", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 200, "dim": 8},
        ],
        "modules": [
            {"name": "mine", "kind": "custom", "class": cls, "inputs": ["@dense", "@sparse"], "params": params},
            {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]},
        ],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.05}},
        "training": {"batch_size": 64, "seed": 1},
    }


def test_a_custom_modules_parameters_and_buffers_count_in_the_plans_memory(blocks):
    """A custom module of 50 M parameters planned the memory of one of 10: its parameters,
    gradients and optimizer state were counted as none, and a device budget never refused it."""
    rng = random.Random()
    hidden, frozen = rng.randrange(1 << 20, 12 << 20), rng.randrange(3, 400)  # up to 50 M parameters, on meta
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Wide", {"in_features": 9, "hidden": hidden,
                                                                     "frozen": frozen})))
    small = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Wide", {"in_features": 9, "hidden": 1, "frozen": 1})))
    trainable, held = 4 * (9 * hidden + hidden + hidden * 3 + 3), 4 * (hidden + 9 * frozen)
    assert (spec.modules[0].param("param_bytes"), spec.modules[0].param("buffer_bytes")) == (trainable, held)
    plan, plan_small = make_plan(spec, target="cpu"), make_plan(small, target="cpu")
    assert plan.graph.nodes["mine"]["op"].param_bytes == trainable
    adam = 2  # adam's two state copies: parameters, gradients, two moments
    grown = dict(plan.cost.memory)["dense"] - dict(plan_small.cost.memory)["dense"]
    assert grown == (2 + adam) * (trainable - 4 * (9 + 1 + 3 + 3)) + held - 4 * (1 + 9)
    line = misfit(plan, trainable, "device memory")  # its parameters alone fit; with Adam's state they do not
    assert line is not None and "module mine:" in line and "of dense parameters, buffers, gradients and optimizer" in line


@pytest.mark.parametrize("cls", ["Across", "Later"])
def test_a_module_whose_rows_depend_on_each_other_in_eval_mode_is_refused(blocks, cls):
    """A softmax over dim 0 planned, trained and exported: predict gave a row another score in every
    batch it was sent in, and micro-batches changed what the model computed."""
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:{cls}", {"in_features": 9})))
    with pytest.raises(ValueError) as err:
        lower(make_plan(spec, target="cpu"), spec, "cpu")
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"module 'mine': {blocks}:{cls}: ")
    assert "depends on the other rows of the batch in eval mode" in line


@pytest.mark.parametrize("cls", ["Normed", "CenteredInTraining", "NoisyInEval"])
def test_batch_statistics_in_training_and_noise_in_eval_are_allowed(blocks, cls):
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:{cls}", {"in_features": 9})))
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    inner = model.ops["mine"].inner
    assert inner.training and getattr(inner, "calls", 0) == 0  # the check ran a copy, and left this one training
    if cls == "Normed":
        assert int(inner.norm.num_batches_tracked) == 0
        x = torch.randn(7, 9) * torch.logspace(-1, 1, 7)[:, None]
        out = model.ops["mine"](x)  # training: the batch's own statistics
        torch.testing.assert_close(out.mean(0), torch.zeros(5), atol=1e-5, rtol=0)


@pytest.mark.parametrize("cls,says", [
    ("NoSave", "state_dict() failed: RuntimeError: no saving today"),
    ("OwnSignature", "state_dict() failed: TypeError: "),
    ("NoLoad", "load_state_dict() of its own state failed: ValueError: no loading today"),
    ("Opaque", "state_dict() failed: TypeError: '_extra_state' is a dict, not a tensor"),
    ("PlainExtra", "state_dict() failed: TypeError: '_extra_state' is a dict, not a tensor"),
])
def test_a_module_whose_state_cannot_be_saved_or_loaded_is_one_line_before_anything_is_written(tmp_path, blocks,
                                                                                                 cls, says):
    """A state_dict that raises trained a whole epoch, then stopped with a traceback at the
    checkpoint, leaving a run folder without one; a load that raises did so at --resume or eval."""
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(spec_doc(f"{blocks}:{cls}", {"in_features": 9})))
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(spec), "--rows", "200", "--out", str(out), "-q", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not out.exists()
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: module 'mine': {blocks}:{cls}: ") and says in line, line


def test_a_module_with_extra_state_of_a_tensor_is_built(tmp_path, blocks):
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:TensorExtra", {"in_features": 9})))
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    assert torch.equal(model.state_dict()["ops.mine.inner._extra_state"], torch.arange(3.0))


def test_a_module_creating_parameters_in_its_forward_is_refused(blocks):
    """A weight made at the first forward trained silently never (the optimizer was made before it)."""
    with pytest.raises(SpecError) as err:
        resolve_custom(spec_from_dict(spec_doc(f"{blocks}:ParamInForward", {})))
    (issue,) = err.value.issues
    assert issue.path == "modules[0].class" and "creates w in its forward" in issue.message


@pytest.mark.parametrize("cls", ["NoGrad", "Detached", "Rewrapped", "Made"])
def test_a_module_whose_output_carries_no_gradient_to_its_parameters_is_refused(blocks, cls):
    """Its trainable parameters trained silently never (nor the modules before it through it)."""
    with pytest.raises(SpecError) as err:
        resolve_custom(spec_from_dict(spec_doc(f"{blocks}:{cls}", {"in_features": 9})))
    (issue,) = err.value.issues
    assert issue.path == "modules[0].class" and "returns a tensor without a gradient in training mode" in issue.message
    assert "(proj.weight, proj.bias)" in issue.message and "\n" not in issue.message


@pytest.mark.parametrize("cls", ["FrozenStop", "StopsInputOnly"])
def test_a_fixed_module_or_one_stopping_its_inputs_gradient_is_allowed(blocks, cls):
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:{cls}", {"in_features": 9})))
    assert spec.modules[0].param("out_width") == 3


def test_building_the_model_constructs_the_class_once_and_still_checks_a_given_out_width(blocks):
    """Building the model constructed the class twice more (a meta dry run for the out_width check,
    then the module): a constructor reading pretrained weights for 30 s cost a minute more."""
    counted = import_class(f"{blocks}:Counted")
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Counted", {"in_features": 9})))
    plan = make_plan(spec, target="cpu")
    before = counted.built
    model = lower(plan, spec, "cpu")
    assert counted.built == before + 1
    norm = model.ops["mine"].inner.norm
    assert int(norm.num_batches_tracked) == 0 and torch.equal(norm.running_mean, torch.zeros(3))  # checks ran a copy
    doc = spec_doc(f"{blocks}:Counted", {"in_features": 9})
    doc["modules"][0]["out_width"] = 4  # it returns 3
    wrong = spec_from_dict(doc)
    with pytest.raises(ValueError, match="returns 3 values per sample, not its out_width 4"):
        lower(make_plan(wrong, target="cpu"), wrong, "cpu")


def test_a_forward_returning_a_tensor_on_another_device_or_no_tensor_is_one_line_naming_it():
    """`return h.cpu()` on a CUDA run failed in the next module, far from the user's code: a traceback
    through flowrec's step (the dry run runs on the meta device and CPU zeros, where it cannot tell)."""
    from torch import nn

    from operators.custom import CustomModule, custom_failure

    class Elsewhere(nn.Module):
        def forward(self, x):
            return torch.zeros(len(x), 3)  # made without device=x.device

    class Sometimes(nn.Module):
        def forward(self, x):
            return (x, x) if len(x) > 2 else x

    rows = random.randrange(3, 50)
    module = CustomModule(Elsewhere(), "blocks.py:Elsewhere")
    module.label = "mine"
    with pytest.raises(RuntimeError) as err:
        module(torch.empty(rows, 4, device="meta"))  # meta stands for cuda here: an input on another device
    assert custom_failure(err.value) == ("custom module 'mine' (blocks.py:Elsewhere) raised RuntimeError: it returned "
                                         "a tensor on cpu for its input on meta: return it on the input's device "
                                         "(make new tensors with device=x.device)")
    module = CustomModule(Sometimes(), "blocks.py:Sometimes")
    module.label = "mine"
    assert module(torch.randn(2, 4)).shape == (2, 4)
    with pytest.raises(TypeError) as err:
        module(torch.randn(rows, 4))
    assert custom_failure(err.value) == ("custom module 'mine' (blocks.py:Sometimes) raised TypeError: it returned a "
                                         "tuple, not one (B, ...) tensor")


def test_a_run_that_recorded_no_measured_memory_resumes_and_starts_others(tmp_path, blocks):
    """A run of a flowrec that measured no param_bytes / buffer_bytes (before 2026-12-06) was
    another model to --resume and --init-from of its own spec ('modules[mine].param_bytes not there
    in the run'): what the dry run measures of the class is no part of the model."""
    import json

    from flowrec.graph.plan_io import model_fingerprint
    from flowrec.runtime.checkpoint.store import load_checkpoint, save_checkpoint
    from flowrec.spec.load import to_dict

    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(spec_doc(f"{blocks}:Normed", {"in_features": 9})))
    run = tmp_path / "run"
    rows = str(random.randrange(200, 400))  # 64k + 1 too: a batch of one row is skipped (test_custom_guards)
    done = runner.invoke(app, ["train", str(spec), "--rows", rows, "--out", str(run), "-q", "--device", "cpu"])
    assert done.exit_code == 0, done.output
    state = load_checkpoint(run / "checkpoint.pt")
    recorded = json.loads(state["spec"])
    assert recorded["modules"][0]["param_bytes"] == 4 * (9 * 5 + 5 + 2 * 5)  # proj, norm's weight and bias
    for key in ("param_bytes", "buffer_bytes"):  # as the older flowrec wrote it
        del recorded["modules"][0][key]
    older = {k: v for k, v in state.items() if k != "digest"}
    save_checkpoint(run / "checkpoint.pt", {**older, "spec": json.dumps(recorded, sort_keys=True)})
    measured = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Normed", {"in_features": 9})))
    assert model_fingerprint(measured) == model_fingerprint(spec_from_dict(recorded))
    assert to_dict(measured) != recorded
    for args in (["--init-from", str(run), "--out", str(tmp_path / "child"), "--rows", rows, "--max-steps", "2"],
                 ["--resume", str(run), "--epochs", "2"]):
        done = runner.invoke(app, ["train", str(spec), *args, "-q", "--device", "cpu"])
        assert done.exit_code == 0, (args, done.output)
    assert load_checkpoint(run / "checkpoint.pt")["position"]["epoch"] == 2


def test_a_plan_saved_without_measured_memory_trains_with_the_measured_spec(tmp_path, blocks):
    """A plan saved by a flowrec that measured no param_bytes (`flowrec plan --json`, then edited)
    was refused by `train --plan` ('node mine: param_bytes differs from what the spec defines')."""
    from dataclasses import replace as replaced

    from flowrec.graph.plan_io import plan_json
    from flowrec.planner.contract import PlanError, load_plan

    measured = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Normed", {"in_features": 9})))
    (mine, *rest) = measured.modules
    unmeasured = replaced(measured, modules=(replaced(mine, params=tuple(
        (k, v) for k, v in mine.params if k not in ("param_bytes", "buffer_bytes"))), *rest))
    older = make_plan(unmeasured, target="cpu")
    assert older.graph.nodes["mine"]["op"].param_bytes == 0
    path = tmp_path / "plan.json"
    path.write_text(plan_json(older))
    plan = load_plan(path, measured)
    assert plan.graph.nodes["mine"]["op"].param_bytes == 4 * (9 * 5 + 5 + 2 * 5)
    assert plan.graph.nodes["mine"]["op"].attr("buffer_bytes") == 4 * (2 * 5) + 8  # running stats, batch count
    other = spec_from_dict(spec_doc(f"{blocks}:Counted", {"in_features": 9}))  # another model is still refused
    with pytest.raises(PlanError):
        load_plan(path, resolve_custom(other))


def test_a_module_dropping_the_batch_dimension_of_one_row_is_refused_saying_so(blocks):
    """`.squeeze()` gave (B,) for a batch but a 0-d tensor for one row: predict of one row failed;
    the refusal said its rows depended on each other."""
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Squeezed", {"in_features": 9})))
    with pytest.raises(ValueError) as err:
        lower(make_plan(spec, target="cpu"), spec, "cpu")
    assert f"{blocks}:Squeezed: its output for one row alone in eval mode is (), not (1, ) as a row" in str(err.value)


@pytest.mark.parametrize("cls,says", [
    ("BadTrain", "TypeError: BadTrain.train() takes 1 positional argument but 2 were given"),
    ("BadTo", "RuntimeError: stays where it is"),
    ("BadParams", "RuntimeError: keeps its parameters"),
])
def test_a_class_overriding_module_methods_so_that_they_raise_is_one_line(blocks, cls, says):
    """`def train(self)` (no mode), a raising `to()` or `parameters()`: the dry run and the model's
    build called them outside the guard of the user's code, a traceback through flowrec."""
    with pytest.raises(SpecError) as err:
        resolve_custom(spec_from_dict(spec_doc(f"{blocks}:{cls}", {"in_features": 9})))
    (issue,) = err.value.issues
    assert issue.message == f"{blocks}:{cls} failed in its dry run: {says}"
    doc = spec_doc(f"{blocks}:{cls}", {"in_features": 9})
    doc["modules"][0]["out_width"] = 3  # given: no dry run, the model's build calls them
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    if cls == "BadTo":  # the model moves its modules by torch's _apply, never by their to(): it builds
        assert lower(plan, spec, "cpu").ops["mine"].inner.proj.out_features == 3
        return
    with pytest.raises(ValueError) as failed:
        lower(plan, spec, "cpu")
    assert str(failed.value) == f"module 'mine': {blocks}:{cls} failed in building the model: {says}"


def test_a_state_dict_or_load_failing_after_the_build_check_is_named_in_one_line():
    """A state_dict raising only after some steps (the build's round trip passed) stopped the
    checkpoint with a traceback through flowrec's trainer; so did a load raising on a checkpoint's values."""
    from torch import nn

    from operators.custom import CustomModule, state_failure

    class Picky(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 2)
            self.saves = 0

        def get_extra_state(self):
            self.saves += 1
            if self.saves > 1:
                raise OSError("no room")
            return torch.zeros(1)

        def set_extra_state(self, state):
            if float(state[0]) != 0:
                raise ValueError(f"cannot take {float(state[0]):g}")

    class Holder(nn.Module):  # the user's state code in a submodule of the custom module
        def __init__(self):
            super().__init__()
            self.inside = Picky()

    model = nn.ModuleDict({"plain": nn.Linear(3, 3), "mine": CustomModule(Holder(), "blocks.py:Holder")})
    model["mine"].label = "mine"
    state = model.state_dict()  # the first save passes
    with pytest.raises(OSError) as err:
        model.state_dict()
    assert state_failure(err.value, model) == ("custom module 'mine' (blocks.py:Holder): its get_extra_state() "
                                               "raised OSError: no room")
    value = random.choice([-1.5, 2.0, 7.25])
    state["mine.inner.inside._extra_state"] = torch.tensor([value])
    with pytest.raises(ValueError) as err:
        model.load_state_dict(state)
    assert state_failure(err.value, model) == ("custom module 'mine' (blocks.py:Holder): its set_extra_state() "
                                               f"raised ValueError: cannot take {value:g}")
    with pytest.raises(RuntimeError) as err:
        model["plain"](torch.randn(2, 5))  # not the state code of a custom module
    assert state_failure(err.value, model) is None


def test_a_checkpoint_whose_custom_state_dict_raises_is_one_line_and_leaves_no_run(tmp_path, blocks):
    spec = tmp_path / "s.yaml"
    spec.write_text(yaml.safe_dump(spec_doc(f"{blocks}:LateNoSave", {"in_features": 9})))
    out = tmp_path / "run"
    rows = str(random.randrange(200, 400))
    result = runner.invoke(app, ["train", str(spec), "--rows", rows, "--out", str(out), "-q", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output and not (out / "checkpoint.pt").exists()
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert (f"custom module 'mine' ({blocks}:LateNoSave): its state_dict() raised OSError: no room for opinions; "
            "no checkpoint was written") in line, line


def test_a_forward_changing_its_input_in_place_is_checked_for_its_gradient_too(blocks):
    """The dry run gave a forward a leaf requiring a gradient, which `x.mul_(2)` may not change: it
    fell back to a run without gradients, and a forward under torch.no_grad() passed unchecked."""
    with pytest.raises(SpecError) as err:
        resolve_custom(spec_from_dict(spec_doc(f"{blocks}:InPlaceNoGrad", {"in_features": 9})))
    assert "returns a tensor without a gradient in training mode" in err.value.issues[0].message
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:InPlace", {"in_features": 9})))
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    x = torch.randn(5, 9) * torch.logspace(-1, 1, 9)
    torch.testing.assert_close(model.ops["mine"](x), model.ops["mine"].inner.proj(2 * x))


MOVER = textwrap.dedent('''
    import os
    from torch import nn

    os.chdir(os.path.join(os.path.dirname(os.path.abspath(__file__)), "elsewhere"))


    class Mover(nn.Module):
        def __init__(self, in_features):
            super().__init__()
            os.chdir("/")
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            return self.proj(x)
''')


def test_a_class_file_changing_the_working_folder_leaves_flowrecs_paths_where_they_were(tmp_path, monkeypatch):
    """A file whose top level (or constructor) called os.chdir made
    `flowrec plan --json p.json` and `train --out runs/x` write into the folder it chose, each
    saying the path as given: the run was not where the line said."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / f"mover_{random.randrange(1 << 30)}.py").write_text(MOVER)
    path = next(tmp_path.glob("mover_*.py"))
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec_doc(f"{path.name}:Mover", {"in_features": 9})))
    done = runner.invoke(app, ["plan", "s.yaml", "--json", "p.json"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "p.json").is_file() and not (tmp_path / "elsewhere" / "p.json").exists()
    done = runner.invoke(app, ["train", "s.yaml", "--rows", "200", "--out", "runs/x", "-q", "--device", "cpu"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "runs" / "x" / "checkpoint.pt").is_file() and not (tmp_path / "elsewhere" / "runs").exists()
    assert Path.cwd() == tmp_path


SILENCER = textwrap.dedent('''
    import io
    import signal
    import sys
    from torch import nn

    sys.stdout = io.StringIO()  # "quiet, please"
    signal.signal(signal.SIGINT, signal.SIG_IGN)


    class Quiet(nn.Module):
        def __init__(self, in_features):
            super().__init__()
            sys.stderr = io.StringIO()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            return self.proj(x)
''')


def test_a_class_file_replacing_the_output_streams_or_the_stop_handler_leaves_flowrecs_in_place(tmp_path):
    """A file that set sys.stdout to a buffer at its top level (or sys.stderr in its constructor)
    swallowed every line flowrec printed after it (the plan, errors), and one that ignored SIGINT
    made Ctrl-C do nothing for the rest of a run."""
    import signal
    import sys

    path = tmp_path / f"quiet_{random.randrange(1 << 30)}.py"
    path.write_text(SILENCER)
    before = sys.stdout, sys.stderr, signal.getsignal(signal.SIGINT)
    try:
        spec = resolve_custom(spec_from_dict(spec_doc(f"{path}:Quiet", {"in_features": 9})))
        lower(make_plan(spec, target="cpu"), spec, "cpu")
        after = sys.stdout, sys.stderr, signal.getsignal(signal.SIGINT)
    finally:  # where flowrec did not put them back, the tests after this one keep their streams and Ctrl-C
        sys.stdout, sys.stderr = before[:2]
        signal.signal(signal.SIGINT, before[2])
    assert after == before
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec_doc(f"{path}:Quiet", {"in_features": 9})))
    done = runner.invoke(app, ["plan", str(tmp_path / "s.yaml")])
    assert done.exit_code == 0 and "stages:" in done.output, done.output


THREADED = textwrap.dedent('''
    import threading
    from torch import nn

    STOP = threading.Event()
    threading.Thread(target=STOP.wait, name="prefetcher").start()  # never set: runs for ever


    class Busy(nn.Module):
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            return self.proj(x)
''')


def test_a_thread_a_class_file_leaves_running_is_named_and_not_waited_for(tmp_path):
    import threading

    from operators.custom_code import lingering_threads, threads_marked

    stop = threading.Event()
    name = f"loader-{random.randrange(1 << 30)}"
    try:
        with threads_marked("importing blocks.py:X"):
            threading.Thread(target=stop.wait, name=name).start()
            threading.Thread(target=stop.wait, name="quiet", daemon=True).start()  # a daemon: never waited for
        mine = [line for line in lingering_threads() if name in line]
        assert mine == [f"'{name}' (started while importing blocks.py:X)"]
        assert not [line for line in lingering_threads() if "quiet" in line]
    finally:  # a failed assert left the thread waiting, and pytest waited for it at exit: a hung run, not a red one
        stop.set()
        for thread in threading.enumerate():
            if thread.name in (name, "quiet"):
                thread.join(60)
    assert not [line for line in lingering_threads() if name in line]


def test_a_command_whose_class_file_left_a_thread_running_ends(tmp_path):
    """`flowrec plan` and `train` of a class file that starts a thread at its top level and never
    ends it did their work, then never exited (the interpreter waited for the thread)."""
    import sys

    (tmp_path / "threaded.py").write_text(THREADED)
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(spec_doc("threaded.py:Busy", {"in_features": 9})))
    done = run_bounded([sys.executable, "-m", "flowrec", "plan", "s.yaml"], cwd=tmp_path, capture_output=True,
                       text=True, timeout_s=300)  # a guard against the hang, not a timing
    assert done.returncode == 0 and "stages:" in done.stdout, done.stderr[-2000:]
    assert ("note: not waiting for the threads a custom module class started and left running: 'prefetcher' "
            f"(started while importing {tmp_path / 'threaded.py'}:Busy)") in done.stderr, done.stderr[-2000:]


def test_a_module_too_large_to_copy_is_checked_without_a_copy(blocks, monkeypatch):
    """The build's checks ran on a copy of the module, doubling the memory of a large pretrained
    one while the model was built; above PROBE_COPY_BYTES they run without one."""
    from operators import custom_checks

    counted = import_class(f"{blocks}:Counted")
    spec = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Counted", {"in_features": 9})))
    across = resolve_custom(spec_from_dict(spec_doc(f"{blocks}:Across", {"in_features": 9})))
    copies = []
    monkeypatch.setattr(custom_checks.copy, "deepcopy", lambda *a: copies.append(a) or pytest.fail("copied"))
    # below its bytes (120: weights and bias), not below its buffers' (32: batch norm's statistics and
    # count), where the one-row probe builds the class once more on the meta device (959b6100)
    monkeypatch.setattr(custom_checks, "PROBE_COPY_BYTES", random.randrange(32, 120))
    before = counted.built
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    assert counted.built == before + 2 and not copies  # the out_width check's meta dry run built it again
    inner = model.ops["mine"].inner
    assert inner.training and int(inner.norm.num_batches_tracked) == 0  # eval-mode checks, then training again
    with pytest.raises(ValueError, match="depends on the other rows of the batch in eval mode"):
        lower(make_plan(across, target="cpu"), across, "cpu")


def test_a_run_whose_class_file_was_edited_in_place_is_refused_naming_it(tmp_path: Path) -> None:
    """A run's class file edited where it lies (a line changed in forward) was used without a word by
    `train --resume` (training the run's weights on other code), eval, export and --init-from, where a
    moved file of other content was refused: the file in place is checked against the sha256 run.json
    records too (`run_class_files`, which every one of them resolves the run's files with)."""
    import hashlib
    import json

    from flowrec.spec.class_paths import DIGESTS_KEY, run_class_files

    blocks = tmp_path / "blocks.py"
    blocks.write_text(BLOCKS)
    run = tmp_path / "run"
    run.mkdir()
    doc = {"name": "edited",
           "features": [{"name": "price", "type": "dense"},
                        {"name": "user", "type": "categorical", "hash_buckets": 50, "dim": 4}],
           "modules": [{"name": "mine", "kind": "custom", "class": f"{blocks}:Wide", "inputs": ["@sparse", "price"],
                        "params": {"in_features": 5, "hidden": 7, "frozen": 2}, "out_width": 3},
                       {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}],
           "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
           "training": {"batch_size": 8}}
    spec = spec_from_dict(doc)
    digest = hashlib.sha256(blocks.read_bytes()).hexdigest()
    (run / "run.json").write_text(json.dumps({DIGESTS_KEY: {str(blocks): digest}}))
    assert run_class_files(spec, run) == (spec, [])  # the file the run trained: nothing to say
    blocks.write_text(BLOCKS.replace("torch.relu", "torch.tanh"))
    with pytest.raises(ValueError) as caught:
        run_class_files(spec, run)
    line = str(caught.value)
    assert "\n" not in line and str(blocks) in line and "changed since the run trained" in line and "sha256" in line
    (run / "run.json").write_text(json.dumps({}))  # a run that recorded no digest: the file as it is
    assert run_class_files(spec, run) == (spec, [])
