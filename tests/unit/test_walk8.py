"""What an eighth walk found, a demanding user's day with the Python API and the model language
(docs/python.md, docs/spec.md): one test per defect (each fails on the code before its fix)."""
from __future__ import annotations

import random

import pytest

from flowrec.spec.validate import validate_document


def _mixture_spec(kind: str, tower_kind: str = "mlp") -> dict:
    """A PLE / MMoE spec of random sizes: a tower reads one named output, a head the other."""
    rng = random.Random()
    dim = rng.choice([4, 8, 16])
    heads = ["like", "love"]
    mixture = {"name": "mix", "inputs": ["@sparse"], "expert_layers": [rng.randint(8, 64), dim], "heads": heads}
    if kind is not None:
        mixture["kind"] = kind
    return {
        "name": "walk8",
        "features": [{"name": n, "type": "categorical", "vocab": rng.randint(5, 5000), "dim": dim}
                     for n in ("user_id", "item_id", "age")],
        "modules": [mixture, {"name": "like_tower", "kind": tower_kind, "inputs": ["mix.like"],
                              "layers": [rng.randint(2, 32)]}],
        "heads": [{"name": "like", "input": "like_tower", "label": "label"},
                  {"name": "love", "input": "mix.love", "label": "rating_5"}],
    }


@pytest.mark.parametrize("kind", ["pel", "moee", None])
def test_a_misspelt_mixture_kind_is_one_line_not_also_its_readers(kind: str | None) -> None:
    """`kind: pel` for ple gave its one line and then three more that were wrong: the towers
    reading `mix.like` read an 'unknown feature or module', the head reading `mix.love` an unknown
    module, and 'mix' (which both read) fed no head; the kind's line alone now, as a misspelt mlp
    kind gives."""
    spec = _mixture_spec(kind)
    issues = validate_document(spec)
    assert [i.path for i in issues] == ["modules[0]" if kind is None else "modules[0].kind"], issues
    spec["modules"][0]["kind"] = "ple" if kind != "moee" else "moe"
    spec["modules"][0].update({"task_experts": 2} if kind != "moee" else {"experts": 3})
    assert validate_document(spec) == []
    spec["modules"][1]["inputs"] = ["mix.lik"]  # a real unknown output of a known kind is still named
    assert [str(i) for i in validate_document(spec)] == [
        "modules[1].inputs[0]: module 'mix' has no output 'lik' (outputs: like, love)"]


def _custom_spec(name: str, module: str, class_ref: str, width: int) -> str:
    """A spec whose head reads custom module `module` (`class_ref`, built with n=`width`) over an MLP."""
    return f"""
name: {name}
features:
  - {{name: user_id, type: categorical, hash_buckets: {random.randint(10, 900)}, dim: 4}}
  - {{name: price, type: dense, transform: log1p}}
modules:
  - {{name: bottom, kind: mlp, inputs: ["@dense", user_id], layers: [{width}]}}
  - {{name: {module}, kind: custom, class: "{class_ref}", inputs: [bottom], params: {{n: {width}}}}}
heads:
  - {{name: click, input: {module}}}
"""


def test_a_custom_class_that_fails_its_dry_run_names_the_spec_in_python(tmp_path, monkeypatch) -> None:
    """`flowrec.train("my.yaml")` of a custom class whose forward raises said ': 1 error(s)' (no
    spec named), where `flowrec train my.yaml` says 'my.yaml: modules[1].class: ...'; the
    SpecError now names the spec file (a ModelSpec by its name), as every other spec problem does."""
    import flowrec
    from flowrec.spec import load_spec
    from flowrec.spec.errors import SpecError

    monkeypatch.chdir(tmp_path)
    width = random.randint(3, 40)
    (tmp_path / "blocks.py").write_text(
        "from torch import nn\n\n\nclass Broken(nn.Module):\n"
        "    def __init__(self, n):\n        super().__init__()\n        self.lin = nn.Linear(n, 2)\n\n"
        "    def forward(self, x):\n        raise KeyError('no such column')\n")
    (tmp_path / "my.yaml").write_text(_custom_spec("walk8_custom", "mine", "blocks.py:Broken", width))
    for spec, source in (("my.yaml", "my.yaml"), (load_spec(tmp_path / "my.yaml"), "ModelSpec 'walk8_custom'")):
        with pytest.raises(SpecError) as err:
            flowrec.train(spec, out=None, rows=500, max_steps=2, progress=False)
        first, line = str(err.value).splitlines()
        assert first == f"{source}: 1 error(s)", str(err.value)
        assert line.startswith("  modules[1].class: ") and "KeyError" in line, line
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "__pycache__") == ["blocks.py", "my.yaml"]


def _swaps(word: str) -> list[str]:
    """The word with two neighbouring letters swapped, each place where that changes it."""
    return [w for i in range(len(word) - 1) if (w := word[:i] + word[i + 1] + word[i] + word[i + 2:]) != word]


def test_two_swapped_letters_of_a_module_kind_suggest_that_kind() -> None:
    """`kind: mpl`, mlp's letters swapped (the commonest slip of the commonest kind), said 'did you
    mean 'ple'?': difflib ties the two and took the later name. Of names as close as each other,
    the one fewest slips away (a swap is one) is named now; every swap of every kind names it."""
    from typing import get_args

    from flowrec.spec.model import ModuleKind

    spec = _mixture_spec("moe")
    spec["modules"][0]["experts"] = random.randint(2, 6)
    for kind in get_args(ModuleKind):
        for typo in _swaps(kind):
            spec["modules"][1]["kind"] = typo
            issues = [i for i in validate_document(spec) if i.path == "modules[1].kind"]
            if len(kind) > 2:  # 'mf' is no closer to 'fm' than difflib's cutoff: no guess
                assert issues and issues[0].message.endswith(f"(did you mean {kind!r}?)"), (typo, issues)


def test_run_evaluate_of_a_misspelt_group_by_names_the_close_feature() -> None:
    """`run.evaluate(group_by="userid")` listed the model's one-id features but named no close one,
    where `flowrec eval RUN --group-by userid` asks 'did you mean 'user_id'?'; it asks too now."""
    from types import SimpleNamespace

    from flowrec.runtime.evaluation.evaluate import GroupByError, group_slot

    names = ["user_id", "item_id", random.choice(["age", "zip_code", "occupation"])]
    fields = [SimpleNamespace(feature=n, max_len=1, table=n) for n in names]
    model = SimpleNamespace(groups=[SimpleNamespace(fields=fields)], managed=None)
    with pytest.raises(GroupByError) as err:
        group_slot(model, "userid")
    assert "(did you mean 'user_id'?)" in str(err.value) and ", ".join(names) in str(err.value), str(err.value)
    with pytest.raises(GroupByError) as err:
        group_slot(model, "price")  # nothing close: no guess
    assert "did you mean" not in str(err.value)


def test_a_misspelt_custom_class_names_the_close_one(tmp_path, monkeypatch) -> None:
    """`class: blocks.py:GatedCros` of a file of many classes listed the first 8 of its names
    (sorted: the meant one may not be among them) and `torch.nn:Linaer` only torch's AttributeError;
    validate, plan and train now ask 'did you mean ...?', as a misspelt feature or kind does."""
    from flowrec.spec.files import validate_file
    from operators.custom_code import CustomModuleError, import_class

    monkeypatch.chdir(tmp_path)
    meant = "Gated" + "".join(random.choices("ABCDEFGHJK", k=3))  # sorted last: not among the 8 names listed
    names = sorted({"Block" + "".join(random.choices("ABCDEFGHJK", k=4)) for _ in range(12)} | {meant})
    (tmp_path / "blocks.py").write_text("from torch import nn\n\n" + "".join(
        f"\nclass {n}(nn.Module):\n    def forward(self, x):\n        return x\n\n" for n in names))
    typo = "Gatde" + meant[5:]  # two letters swapped
    (tmp_path / "my.yaml").write_text(f"""
name: walk8_class
features:
  - {{name: price, type: dense}}
modules:
  - {{name: mine, kind: custom, class: "blocks.py:{typo}", inputs: ["@dense"]}}
heads:
  - {{name: click, input: mine}}
""")
    (issue,) = validate_file(tmp_path / "my.yaml")
    assert issue.path == "modules[0].class" and f"(did you mean {meant!r}?)" in issue.message, issue
    with pytest.raises(CustomModuleError) as err:
        import_class(f"blocks.py:{typo}")
    assert f"(did you mean {meant!r}?)" in str(err.value), str(err.value)
    with pytest.raises(CustomModuleError) as err:
        import_class("torch.nn:Linaer")
    assert str(err.value).endswith("(did you mean 'Linear'?)"), str(err.value)


def test_a_misspelt_run_folder_names_the_run_beside_it(tmp_path) -> None:
    """`flowrec.load("runs/pel")` (`flowrec eval runs/pel`, `export runs/pel PKG`) of the run
    runs/ple said 'no checkpoint at runs/pel', as of a folder without a checkpoint; it says there is
    no such folder and names the run of a close name beside it."""
    from flowrec.runtime.checkpoint.format import CheckpointError
    from flowrec.runtime.checkpoint.store import load_checkpoint

    name = "".join(random.sample("abcdefgh", 6))  # distinct letters: the swap makes another name
    for run in (name, "other_run"):
        (tmp_path / run).mkdir()
        (tmp_path / run / "checkpoint.pt").write_bytes(random.randbytes(64))
    typo = name[1] + name[0] + name[2:]
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path / typo)
    assert str(err.value) == (f"no checkpoint at {tmp_path / typo}: there is no such file or folder "
                              f"(did you mean {str(tmp_path / name)!r}?)"), str(err.value)


@pytest.mark.parametrize("task", ["binary", "multiclass", "regression"])
def test_a_head_weighted_by_its_own_label_is_refused(task: str) -> None:
    """`{name: love, label: rating_5, sample_weight: rating_5}` validated and trained with exit 0:
    every negative weighed 0, so the head learned from positives alone (MovieLens: love AUC 0.50,
    calibration 4.7, logloss 12.7). A binary or multiclass head weighted by its own label is one
    line now; a regression head may weigh rows by its target, and any head by another column."""
    spec = _mixture_spec("moe")
    spec["modules"][0]["experts"] = random.randint(2, 6)
    label = random.choice(["rating_5", "clicked", "stars"])
    spec["heads"][1].update(label=label, sample_weight=label, task=task)
    if task == "multiclass":
        spec["heads"][1]["num_classes"] = random.randint(2, 9)
    issues = validate_document(spec)
    if task == "regression":
        assert issues == []
        return
    zero = "negative (label 0)" if task == "binary" else "row of class 0"
    assert [str(i) for i in issues] == [
        f"heads[1].sample_weight: sample_weight {label!r} is the head's own label: every {zero} would weigh 0 and "
        "train nothing; weigh the rows by another column, or leave it out"]
    spec["heads"][1]["sample_weight"] = "w"
    assert validate_document(spec) == []


def test_a_mixture_output_nobody_reads_is_named() -> None:
    """`heads: [like, love, hate]` on a ple whose 'hate' output no tower or head read validated and
    trained (its gate and its last level's own experts learning nothing), exit 0; that output is one
    line now. A mixture read whole (`inputs: [mix]`) reads every output."""
    spec = _mixture_spec("ple")
    spec["modules"][0].update(task_experts=random.randint(1, 3), levels=random.randint(1, 3))
    assert validate_document(spec) == []
    extra = random.choice(["hate", "skip", "share"])
    spec["modules"][0]["heads"].append(extra)
    assert [str(i) for i in validate_document(spec)] == [
        f"modules[0].heads[2]: output {extra!r} of module 'mix' is read by no module or head (its gate would train "
        f"for nothing): read it as mix.{extra}, or remove it"]
    spec["modules"][1]["inputs"] = ["mix"]  # the tower reads every output
    assert validate_document(spec) == []


@pytest.mark.parametrize("query", ["adgroup_id", "bottom"])
def test_target_attention_inputs_in_self_attentions_order_are_one_line(query: str) -> None:
    """`kind: target_attention, inputs: [click_sequence, adgroup_id]`, the order self_attention's
    `output: target` takes, gave three lines (the sequence has pooling none, the query must be
    pooled, the second input must be a sequence); one line now says which order it reads."""
    dim = random.choice([4, 8, 16])
    spec = {
        "name": "walk8_din",
        "features": [
            {"name": "adgroup_id", "type": "categorical", "table": "items"},
            {"name": "click_sequence", "type": "sequence", "table": "items", "max_len": random.randint(2, 60),
             "pooling": "none"},
            {"name": "price", "type": "dense"},
        ],
        "tables": [{"name": "items", "hash_buckets": random.randint(10, 10**6), "dim": dim}],
        "modules": [
            {"name": "bottom", "kind": "mlp", "inputs": ["@dense", "adgroup_id"], "layers": [dim]},
            {"name": "din", "kind": "target_attention", "inputs": ["click_sequence", query]},
            {"name": "top", "kind": "mlp", "inputs": ["din", "bottom"], "layers": [8]},
        ],
        "heads": [{"name": "ctr", "input": "top"}],
    }
    assert [str(i) for i in validate_document(spec)] == [
        f"modules[1].inputs: target_attention reads [query, sequence], the sequence second: write inputs: "
        f"[{query}, click_sequence]"]
    spec["modules"][1]["inputs"].reverse()
    assert validate_document(spec) == []


def test_a_custom_forward_that_raises_in_training_keeps_its_type_with_flowrec_trains_line(tmp_path,
                                                                                           monkeypatch) -> None:
    """`flowrec.train` of a custom module whose forward raised at its Nth training call gave the
    caller the bare user error, where `flowrec train` says 'at step N: custom module 'late'
    (late.py:Late) raised ...; ...': the error keeps its type (a caller may catch it) and carries
    that line as a note."""
    import sys

    import flowrec

    if sys.version_info < (3, 11):
        pytest.skip("exception notes are Python 3.11's")
    monkeypatch.chdir(tmp_path)
    width, late = random.randint(3, 20), random.randint(3, 6)
    (tmp_path / "late.py").write_text(
        "from torch import nn\n\n\nclass Late(nn.Module):\n"
        "    def __init__(self, n):\n        super().__init__()\n        self.lin = nn.Linear(n, n)\n"
        "        self.calls = 0\n\n"
        "    def forward(self, x):\n        if self.training:\n            self.calls += 1\n"
        f"            if self.calls == {late}:\n                raise ValueError('went bad')\n"
        "        return self.lin(x)\n")
    (tmp_path / "my.yaml").write_text(_custom_spec("walk8_late", "late", "late.py:Late", width)
                                      + "training: {batch_size: 32}\n")
    with pytest.raises(ValueError, match="went bad") as err:
        flowrec.train("my.yaml", out=None, rows=2_000, max_steps=20, progress=False)
    notes = getattr(err.value, "__notes__", [])
    assert len(notes) == 1 and notes[0].startswith("flowrec: at step "), notes
    assert f"custom module 'late' ({tmp_path / 'late.py'}:Late) raised ValueError: went bad; " in notes[0], notes
