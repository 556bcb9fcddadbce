"""The `custom` kind: a user's nn.Module from a file outside the repository, its width learned by a
meta-device dry run, trained as plain PyTorch trains it, and every unusable class one issue."""
from __future__ import annotations

import copy
import random
import textwrap
from dataclasses import replace

import pytest
import torch

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.custom import resolve_custom
from flowrec.runtime.lowering import lower
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict
from flowrec.spec.errors import SpecError
from flowrec.spec.validate import validate_document
from operators.custom_code import import_class

BATCH = 32
BLOCKS = textwrap.dedent('''
    import numpy
    import torch
    from torch import nn


    class GatedCross(nn.Module):
        def __init__(self, in_features, rank):
            super().__init__()
            self.gate = nn.Linear(in_features, in_features)
            self.down = nn.Linear(in_features, rank)
            self.up = nn.Linear(rank, 2 * rank)

        def forward(self, x):
            return torch.relu(self.up(self.down(x * torch.sigmoid(self.gate(x)))))


    class Sparse(nn.Module):
        def __init__(self):
            super().__init__()
            self.table = nn.Embedding(10, 4, sparse=True)

        def forward(self, x):
            return x


    class Broken(nn.Module):
        def forward(self, x):
            raise RuntimeError("not today")


    class Double(nn.Module):
        def forward(self, x):
            return x.double()


    class Flags(nn.Module):
        def forward(self, x):
            return (x > 0).long()


    class Pretrained(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.register_buffer("scale", torch.from_numpy(numpy.linspace(0.5, 1.5, width, dtype="float32")))
            self.proj = nn.Linear(width, 7)

        def forward(self, x):
            return self.proj(x * self.scale)


    class Configured(nn.Module):
        def __init__(self, width, cfg, sizes):
            super().__init__()
            assert isinstance(cfg, dict) and isinstance(sizes, list), (cfg, sizes)
            self.proj = nn.Linear(width, cfg["hidden"] + sum(sizes + [0]))

        def forward(self, x):
            return self.proj(x)


    class DataDependent(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = nn.Linear(width, 3)

        def forward(self, x):
            h = self.proj(x)
            return h / 2 if float(h.abs().max()) > 100 else h


    class Score(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.proj = nn.Linear(width, 1)

        def forward(self, x):
            return self.proj(x).squeeze(1)  # (B,): one value per sample


    class Lazy(nn.Module):
        def __init__(self, out):
            super().__init__()
            self.proj = nn.LazyLinear(out)

        def forward(self, x):
            return self.proj(x)
''')


@pytest.fixture()
def blocks(tmp_path):
    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS)
    return path


def custom_doc(blocks, cls: str = "GatedCross", params: dict | None = None) -> dict:
    return {
        "name": "custom",
        "features": [
            {"name": "x0", "type": "dense"},
            {"name": "user", "type": "categorical", "hash_buckets": 200, "dim": 8},
            {"name": "item", "type": "categorical", "hash_buckets": 300, "dim": 8},
        ],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [12]},
            {"name": "mine", "kind": "custom", "class": f"{blocks}:{cls}", "inputs": ["bottom", "user"],
             "params": {"in_features": 20, "rank": 3} if params is None else params},
            {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]},
        ],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.05}, "sparse": {"name": "sgd", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": 1},
    }


def test_width_is_learned_by_the_dry_run_and_validate_imports_nothing(blocks):
    doc = custom_doc(blocks)
    doc["modules"][1]["class"] = f"{blocks.parent / 'absent.py'}:GatedCross"
    assert validate_document(doc) == []  # validate never imports the class
    spec = resolve_custom(spec_from_dict(custom_doc(blocks)))
    assert spec.modules[1].param("out_width") == 6  # 2 * rank
    plan = make_plan(spec, target="cpu")
    assert plan.graph.nodes["mine"]["op"].out_shape == ("B", 6)
    assert plan.graph.nodes["mine"]["op"].attr("in_features") == 20


def test_training_equals_the_user_module_in_plain_pytorch(blocks):
    seed = random.randrange(1 << 30)
    spec = resolve_custom(spec_from_dict(custom_doc(blocks)))
    plan = make_plan(spec, target="cpu")
    table = synth_table(spec, BATCH * 20, SynthConfig(seed=seed))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, lookahead=1, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        batches = [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]
    model = lower(plan, spec, "cpu").double()
    user = copy.deepcopy(model.ops["mine"].inner)  # the user's module, trained by hand below
    ref = copy.deepcopy(model)
    opt = make_dense_optimizer(model, "sgd", 0.05, {})
    ref_opt = torch.optim.SGD([p for n, p in ref.named_parameters() if not n.startswith("ops.mine")]
                              + list(user.parameters()), lr=0.05)
    group = plan.meta.groups[0]
    for batch in batches:
        train_step(model, opt, batch)
        ref_opt.zero_grad(set_to_none=True)
        emb = ref.embed(batch)[group.name]  # (B, 2, D): user, item
        bottom = ref.ops["bottom"](torch.cat([batch.dense, emb.flatten(1)], dim=1))
        mine = user(torch.cat([bottom, emb[:, 0]], dim=1))
        logits = ref.ops["head_ctr"](ref.ops["top"](mine))
        torch.nn.functional.binary_cross_entropy_with_logits(logits[:, 0], batch.labels[:, 0]).backward()
        ref_opt.step()
    for a, b in zip(model.ops["mine"].inner.parameters(), user.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11, msg=lambda m: f"seed {seed}: {m}")


def test_a_module_holding_cpu_tensors_of_its_own_is_measured_and_keeps_them(blocks):
    """A buffer from torch.from_numpy (pretrained values) is made on the CPU even under the meta
    device: the dry run's forward mixed devices and refused a class that trains."""
    spec = resolve_custom(spec_from_dict(custom_doc(blocks, "Pretrained", {"width": 20})))
    assert spec.modules[1].param("out_width") == 7
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    torch.testing.assert_close(model.ops["mine"].inner.scale, torch.linspace(0.5, 1.5, 20))


def test_a_wrong_out_width_names_its_module_among_modules_of_one_class(blocks):
    """Two modules of one class (torch.nn:Linear, say): the error named only the class."""
    doc = custom_doc(blocks)
    doc["modules"][1]["out_width"] = 6
    twin = dict(doc["modules"][1], name="twin", out_width=7)  # GatedCross returns 2 * rank = 6
    doc["modules"][2:2] = [twin]
    doc["modules"][-1]["inputs"] = ["mine", "twin"]
    spec = resolve_custom(spec_from_dict(doc))  # both give out_width: planning imports nothing
    with pytest.raises(ValueError) as err:
        lower(make_plan(spec, target="cpu"), spec, "cpu")
    assert "module 'twin'" in str(err.value) and "not its out_width 7" in str(err.value)


def test_params_reach_the_class_as_written_also_through_a_saved_plan(blocks):
    """A nested mapping in params reached the constructor as FrozenMapping pairs, a list as a tuple:
    `cfg["hidden"]` was a TypeError, `sizes + [0]` too."""
    from flowrec.graph.plan_io import plan_from_document, plan_json
    import json

    params = {"width": 20, "cfg": {"hidden": 3}, "sizes": [1, 2]}
    spec = resolve_custom(spec_from_dict(custom_doc(blocks, "Configured", params)))
    assert spec.modules[1].param("out_width") == 6
    plan = make_plan(spec, target="cpu")
    for used in (plan, plan_from_document(json.loads(plan_json(plan)))):  # resume, eval and export read the plan
        assert lower(used, spec, "cpu").ops["mine"].inner.proj.out_features == 6


def test_a_forward_that_needs_values_is_measured_on_zeros(blocks):
    """`float(h.max())` has no value on the meta device: a module that trains in PyTorch was refused
    ('Tensor.item() cannot be called on meta tensors'), out_width or not."""
    before = torch.get_rng_state()
    spec = resolve_custom(spec_from_dict(custom_doc(blocks, "DataDependent", {"width": 20})))
    assert spec.modules[1].param("out_width") == 3
    assert torch.equal(torch.get_rng_state(), before)  # the zeros run built the module off the caller's generator
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    assert model.ops["mine"].inner.proj.out_features == 3


def test_a_module_with_lazy_parameters_is_built_with_their_shapes(blocks):
    """nn.LazyLinear learns its input width at its first forward: the optimizer made at the start of
    training read its uninitialised parameters (a traceback) before the model had seen a batch."""
    spec = resolve_custom(spec_from_dict(custom_doc(blocks, "Lazy", {"out": 5})))
    assert spec.modules[1].param("out_width") == 5
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    proj = model.ops["mine"].inner.proj
    assert not torch.nn.parameter.is_lazy(proj.weight) and proj.weight.shape == (5, 20)
    assert model.ops["mine"].inner.training  # the shaping forward ran in eval mode, then training again
    opt = make_dense_optimizer(model, "adam", 0.01, {})
    assert any(p is proj.weight for group in opt.param_groups for p in group["params"])


def test_a_module_returning_a_vector_of_one_value_per_sample_has_width_one(blocks):
    # (B,) is a (B, ...) tensor: the dry run refused it ("must return one (B, ...) tensor, got (2,)")
    spec = resolve_custom(spec_from_dict(custom_doc(blocks, "Score", {"width": 20})))
    assert spec.modules[1].param("out_width") == 1
    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    x = torch.randn(5, 20)
    out = model.ops["mine"](x)
    assert out.shape == (5, 1) and torch.equal(out[:, 0], model.ops["mine"].inner(x))


@pytest.mark.parametrize("cls,params,says", [
    ("Missing", None, "cannot import"),
    ("GatedCross", {"in_features": 20, "rank": 3, "bogus": 1}, "unexpected keyword"),
    ("GatedCross", {"in_features": 19, "rank": 3}, "failed on a (2, 20) input"),
    ("Broken", {}, "not today"),
    ("Double", {}, "returns float64 values for a float32 input"),  # a traceback in the next layer's GEMM
    ("Flags", {}, "returns int64 values for a float32 input"),  # trained its own layers never: no gradient
    ("Sparse", {}, "sparse parameters"),
])
def test_an_unusable_class_is_one_issue_at_its_path(blocks, cls, params, says):
    doc = custom_doc(blocks, cls, params)
    with pytest.raises(SpecError) as err:
        resolve_custom(spec_from_dict(doc))
    (issue,) = err.value.issues
    assert issue.path == "modules[1].class" and says in issue.message and "\n" not in issue.message


def test_an_edited_class_file_is_imported_again(tmp_path):
    """The first import of a file was kept for the process: a class edited between two calls (a
    notebook) planned and trained as it was before the edit, without a word."""
    path = tmp_path / "edited.py"
    path.write_text("from torch import nn\n\n\nclass Proj(nn.Linear):\n    def __init__(self):\n"
                    "        super().__init__(20, 3)\n")
    doc = custom_doc(path.parent / "blocks.py")
    doc["modules"][1].update({"class": f"{path}:Proj", "params": {}})
    assert resolve_custom(spec_from_dict(doc)).modules[1].param("out_width") == 3
    path.write_text(path.read_text().replace("(20, 3)", "(20, 5)"))
    assert resolve_custom(spec_from_dict(doc)).modules[1].param("out_width") == 5


def test_class_paths_import_modules_and_files(blocks):
    assert import_class("torch.nn:Linear") is torch.nn.Linear
    assert import_class(f"{blocks}:GatedCross").__name__ == "GatedCross"
    with pytest.raises(ValueError, match="not a torch.nn.Module"):
        import_class("collections:OrderedDict")
