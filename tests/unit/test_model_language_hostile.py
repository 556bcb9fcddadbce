"""Hostile and careless specs of the newer model-language kinds (custom modules, heads, retrieval,
sequences, managed tables): every bad spec is one line per problem with its path and exit 2 from
the CLI, never a traceback, never a partly written run; a user's module cannot corrupt stdout."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.spec.validate import validate_document

runner = CliRunner()
SPECS = Path(__file__).parents[2] / "specs"

BLOCKS = textwrap.dedent('''
    import sys
    import torch
    from torch import nn


    class Prints(nn.Module):
        def __init__(self, n):
            super().__init__()
            print("HELLO FROM INIT")
            self.lin = nn.Linear(n, 4)

        def forward(self, x):
            print("HELLO FROM FORWARD")
            return self.lin(x)


    class Exits(nn.Module):
        def __init__(self):
            super().__init__()
            sys.exit(3)


    class ExitsInForward(nn.Module):
        def forward(self, x):
            raise SystemExit(4)


    class Empty(nn.Module):
        def forward(self, x):
            return x[:, :0]


    class Huge(nn.Module):
        def forward(self, x):
            return x.unsqueeze(-1).expand(-1, -1, 100000).unsqueeze(-1).expand(-1, -1, -1, 100000)


    class MetaParam(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(8, 4, device="meta"))

        def forward(self, x):
            return x @ self.w


    class PerBatch(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            return self.lin(x).repeat(1, x.shape[0])


    class EvalWide(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def forward(self, x):
            y = self.lin(x)
            return y if self.training else torch.cat([y, y], 1)


    class FirstTwo(nn.Module):
        def forward(self, x):
            return x[:2]


    class Raises(nn.Module):
        def __init__(self):
            super().__init__()
            raise ValueError("first line\\nsecond line")
''')


@pytest.fixture
def blocks(tmp_path: Path) -> Path:
    path = tmp_path / "blocks.py"
    path.write_text(BLOCKS)
    (tmp_path / "boom.py").write_text("raise RuntimeError('module level boom')\n")
    return path


def custom_doc(cls: str, params: dict | None = None, out_width: int | None = None) -> dict[str, Any]:
    mine: dict[str, Any] = {"name": "mine", "kind": "custom", "class": cls, "inputs": ["bottom"]}
    if params is not None:
        mine["params"] = params
    if out_width is not None:
        mine["out_width"] = out_width
    return {
        "name": "hostile_custom",
        "features": [{"name": "x0", "type": "dense"},
                     {"name": "u", "type": "categorical", "hash_buckets": 100, "dim": 4}],
        "modules": [{"name": "bottom", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}, mine,
                    {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.05}, "sparse": {"name": "sgd", "lr": 0.05}},
        "training": {"batch_size": 32},
    }


def _write(tmp_path: Path, doc: dict, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _one_line_error(result, path: str, says: str) -> None:
    assert result.exit_code == 2, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert any(f"{path}: " in line and says in line for line in lines), result.output
    assert "Traceback" not in result.output


# ---- custom modules: the plan-time dry run ---------------------------------------------------


@pytest.mark.parametrize("cls, params, says", [
    ("Exits", None, "failed: tried to end the process: sys.exit(3)"),
    ("ExitsInForward", None, "failed on a (2, 8) input: tried to end the process: sys.exit(4)"),
    ("Empty", None, "returns 0 values per sample"),
    ("Huge", None, "returns 80,000,000,000 values per sample"),
    ("Raises", None, "failed: ValueError: first line"),
    # planned at 2 samples, then a shape traceback in the next layer at the first step
    ("PerBatch", None, "returns 8 values per sample for 2 samples but 12 for 3: its values per sample must not depend "
                       "on the batch size"),
    ("FirstTwo", None, "must return one (B, ...) tensor, got (2, 8) for 3 samples"),
    # trained, then a shape traceback in the next layer at the final evaluation
    ("EvalWide", None, "returns 4 values per sample in training but 8 in eval mode (evaluation, export, predict)"),
])
def test_an_unusable_custom_class_is_one_line_at_plan(tmp_path, blocks, cls, params, says):
    spec = _write(tmp_path, custom_doc(f"{blocks}:{cls}", params))
    result = runner.invoke(app, ["plan", str(spec)])
    _one_line_error(result, "modules[1].class", says)
    assert "second line" not in result.output


@pytest.mark.parametrize("cls, says", [
    ("{tmp}/boom.py:X", "cannot import '{tmp}/boom.py:X': RuntimeError: module level boom"),
    ("..relative:X", "cannot import '..relative:X': TypeError"),
    # a file is imported under flowrec's name for it: 'module 'flowrec_custom_blocks_1f2e..._9a0b...' has no attribute'
    ("{tmp}/blocks.py:Missing", "cannot import '{tmp}/blocks.py:Missing': {tmp}/blocks.py defines no 'Missing' (it "
                                "defines "),
    ("torch.nn:Linear", "returns 100,000,000,000 values per sample"),
])
def test_a_class_path_that_cannot_be_used_is_one_line(tmp_path, blocks, cls, says):
    params = {"in_features": 8, "out_features": 10**11} if cls == "torch.nn:Linear" else None
    spec = _write(tmp_path, custom_doc(cls.format(tmp=tmp_path), params))
    result = runner.invoke(app, ["plan", str(spec)])
    _one_line_error(result, "modules[1].class", says.format(tmp=tmp_path))


def test_a_width_that_follows_the_batch_size_is_refused_before_training(tmp_path, blocks):
    """PerBatch returns (B, 4 * B): the dry run at 2 samples planned it as 8 wide, and the first step
    of 32 samples stopped in the next layer with a traceback (mat1 and mat2 shapes cannot be
    multiplied (32x128 and 8x4)), its run folder left behind."""
    spec = _write(tmp_path, custom_doc(f"{blocks}:PerBatch"))
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(spec), "--rows", "96", "--out", str(out), "-q", "--device", "cpu"])
    _one_line_error(result, "modules[1].class", "must not depend on the batch size")
    assert not out.exists()


def test_a_file_that_failed_to_import_is_imported_again(tmp_path, blocks):
    spec = _write(tmp_path, custom_doc(f"{tmp_path}/boom.py:Fixed"))
    assert runner.invoke(app, ["plan", str(spec)]).exit_code == 2
    (tmp_path / "boom.py").write_text("from torch import nn\n\n\nclass Fixed(nn.Linear):\n"
                                      "    def __init__(self):\n        super().__init__(8, 3)\n")
    result = runner.invoke(app, ["plan", str(spec), "--json", "-"])
    assert result.exit_code == 0, result.output
    mine = next(n for n in json.loads(result.stdout)["nodes"] if n["name"] == "mine")
    assert mine["out_shape"] == ["B", 3]


def test_what_a_custom_module_prints_does_not_corrupt_plan_json(tmp_path, blocks):
    spec = _write(tmp_path, custom_doc(f"{blocks}:Prints", {"n": 8}))
    result = runner.invoke(app, ["plan", str(spec), "--json", "-"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)  # stdout is the plan alone
    assert "HELLO FROM INIT" not in result.stdout and "HELLO FROM INIT" in result.stderr
    assert any(n["name"] == "mine" and n["out_shape"] == ["B", 4] for n in plan["nodes"])


def test_a_wrong_out_width_is_refused_before_training(tmp_path):
    spec = _write(tmp_path, custom_doc("torch.nn:Linear", {"in_features": 8, "out_features": 6}, out_width=5))
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(spec), "--rows", "64", "--out", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert "returns 6 values per sample, not its out_width 5" in result.output
    assert "Traceback" not in result.output
    assert not out.exists()


@pytest.mark.parametrize("cls, params, out_width, path, says", [
    ("{blocks}:Raises", None, None, "modules[1].class", "failed: ValueError: first line"),
    ("torch.nn:Linear", {"in_features": 8, "out_features": 6}, 5, "modules[1].out_width", "returns 6 values per sample, not 5"),
])
def test_calibrate_refuses_an_unusable_custom_module_before_measuring(tmp_path, blocks, cls, params, out_width,
                                                                      path, says):
    """calibrate read the spec without the custom modules' dry run: a module without out_width was a
    ShapeError traceback (a usable one too), a wrong out_width a traceback after a minute of measuring."""
    spec = _write(tmp_path, custom_doc(cls.format(blocks=blocks), params, out_width))
    out = tmp_path / "profile.json"
    result = runner.invoke(app, ["calibrate", str(spec), "--device", "cpu", "--seconds", "0.01", "--out", str(out)])
    _one_line_error(result, path, says)
    assert not out.exists()


# ---- heads: early stopping, task spaces ------------------------------------------------------


def _spec(name: str) -> dict[str, Any]:
    return yaml.safe_load((SPECS / name).read_text())


def _issues(doc: dict) -> list[tuple[str, str]]:
    return [(i.path, i.message) for i in validate_document(doc)]


@pytest.mark.parametrize("metric", ["accuracy", "accuracy_at_k", "logloss", "auc"])
def test_early_stopping_may_watch_every_metric_a_multiclass_head_reports(metric):
    doc = _spec("esmm_multitask.yaml")
    doc["training"].update(eval_every=10, early_stopping={"metric": metric, "head": "category"})
    assert _issues(doc) == []


def test_early_stopping_on_the_auc_of_more_classes_than_it_is_reported_for_is_refused():
    doc = _spec("esmm_multitask.yaml")
    doc["heads"][2]["num_classes"] = 65
    doc["training"].update(eval_every=10, early_stopping={"metric": "auc", "head": "category"})
    assert _issues(doc) == [("training.early_stopping.metric",
                             "head 'category' has 65 classes: its auc is reported up to 64 classes; watch "
                             "accuracy, accuracy_at_k or logloss")]


@pytest.mark.parametrize("label, equals, says", [
    ("click", 0.5, "head 'click' is binary: its label 'click' holds 0 or 1, never 0.5"),
    ("click", 7, "head 'click' is binary: its label 'click' holds 0 or 1, never 7"),
    ("category", 8, "head 'category' has 8 classes: its label 'category' holds a class index 0 .. 7, never 8"),
    ("category", 2.5, "never 2.5"),
    ("category", -1, "never -1"),
])
def test_a_task_space_no_row_can_be_in_is_refused(label, equals, says):
    doc = _spec("esmm_multitask.yaml")
    doc["heads"][1]["trained_where"] = {"label": label, "equals": equals}
    issues = _issues(doc)
    assert len(issues) == 1 and issues[0][0] == "heads[1].trained_where.equals" and says in issues[0][1], issues


@pytest.mark.parametrize("label, equals", [("click", 0), ("click", 1.0), ("category", 7), ("category", 3.0)])
def test_a_task_space_rows_can_be_in_is_accepted(label, equals):
    doc = _spec("esmm_multitask.yaml")
    doc["heads"][1]["trained_where"] = {"label": label, "equals": equals}
    assert _issues(doc) == []


def test_a_problem_in_one_head_is_not_reported_again_at_the_task_space_of_another():
    doc = _spec("esmm_multitask.yaml")
    doc["heads"][0]["weight"] = 0  # head 'click' (whose label the conversion head's space names) is faulty
    assert _issues(doc) == [("heads[0].weight", "must be > 0")]


# ---- retrieval and next-item data ------------------------------------------------------------


def test_exclude_seen_grouped_by_the_item_id_is_refused():
    doc = _spec("two_tower_movielens.yaml")
    doc["heads"][0]["exclude_seen"] = True
    doc["training"]["eval_group_by"] = "item_id"
    assert _issues(doc) == [("heads[0].exclude_seen",
                             "exclude_seen groups by the user: training.eval_group_by 'item_id' is the item id")]
    doc["training"]["eval_group_by"] = "user_id"
    assert _issues(doc) == []


@pytest.mark.parametrize("name", ["items", "scores"])
def test_a_head_beside_a_retrieval_head_named_as_a_top_k_column_is_refused(name):
    """predict --top-k writes items and scores, then a column per head beside the retrieval head:
    a head named items overwrote the recommended items in the file without a word."""
    doc = _spec("two_tower_movielens.yaml")
    doc["modules"].append({"name": "ctr", "kind": "mlp", "inputs": ["user_id", "item_id"], "layers": [4]})
    doc["heads"].append({"name": name, "input": "ctr", "label": "click"})
    issues = _issues(doc)
    assert [path for path, _ in issues] == ["heads[1].name"], issues
    assert f"cannot be named {name!r}" in issues[0][1]
    doc["heads"][1]["name"] = "click"
    doc["heads"][0]["name"] = name  # the retrieval head's own name is no column
    assert _issues(doc) == []


def test_a_history_feature_shorter_than_the_sequence_option_is_refused():
    doc = _spec("sasrec_movielens.yaml")
    del doc["features"][1]["truncate"]  # the rule concerns the default, truncate: first (the example keeps the last)
    doc["data"]["options"]["sequence"]["max_len"] = 50  # the feature keeps 20: the 20 oldest of 50
    issues = _issues(doc)
    assert [path for path, _ in issues] == ["features[1].max_len"], issues
    assert "keeps the first 20 of the up to 50 previous items" in issues[0][1]
    doc["data"]["options"]["sequence"]["max_len"] = 10  # shorter histories are padded: fine
    assert _issues(doc) == []
    doc["data"]["options"]["sequence"]["max_len"] = 50
    doc["data"]["columns"] = {"item_id": "item_id"}
    doc["features"][1]["name"] = "past"  # a feature not reading the history column is not concerned
    doc["modules"][0]["inputs"] = ["past"]
    doc["data"]["options"]["sequence"]["max_len"] = 50
    assert [path for path, _ in _issues(doc)] == []


# ---- heads: sample-weight columns in the data ------------------------------------------------


def _esmm_rows(tmp_path: Path, weight: str) -> tuple[Path, Path]:
    doc = _spec("esmm_multitask.yaml")
    for f in doc["features"]:
        if "hash_buckets" in f:
            f["hash_buckets"] = 100
    spec = _write(tmp_path, doc, "esmm.yaml")
    lines = ["price,user_id,item_id,shop_id,click,conversion,category,w"]
    lines += [f"{i / 7:.3f},{i % 5},{i % 11},{i % 3},{i % 2},{(i // 2) % 2},{i % 8},{0.5 + i % 3}" for i in range(20)]
    lines[4] = lines[4].rsplit(",", 1)[0] + f",{weight}"
    raw = tmp_path / "rows.csv"
    raw.write_text("\n".join(lines) + "\n")
    return spec, raw


@pytest.mark.parametrize("weight, says", [
    ("-1", "sample weight -1.0 in column w: not a finite number >= 0 for a sample weight"),
    ("nan", "missing sample weight in column w"),
    ("", "missing sample weight in column w"),
    ("inf", "non-finite value 'inf' in column w"),
])
def test_a_bad_sample_weight_is_a_malformed_row_at_conversion(tmp_path, weight, says):
    spec, raw = _esmm_rows(tmp_path, weight)
    out = tmp_path / "data"
    result = runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "-q"])
    assert result.exit_code == 2, result.output
    assert "malformed row at" in result.output and says in result.output, result.output
    assert not out.exists()
    skipped = runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "-q",
                                  "--on-error", "skip"])
    assert skipped.exit_code == 0, skipped.output
    assert json.loads((out / "_flowrec.json").read_text())["rows"] == 19


def test_a_good_sample_weight_of_zero_converts(tmp_path):
    spec, raw = _esmm_rows(tmp_path, "0")
    out = tmp_path / "data"
    result = runner.invoke(app, ["data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "-q"])
    assert result.exit_code == 0, result.output


@pytest.mark.parametrize("query_inputs", [["user_id", "item_id"], ["@sparse"]])
def test_a_query_tower_that_reads_the_item_id_is_refused(query_inputs):
    doc = _spec("two_tower_movielens.yaml")
    doc["modules"] = [{"name": "q", "kind": "mlp", "inputs": query_inputs, "layers": [32]},
                      {"name": "score", "kind": "similarity", "inputs": ["q", "item_id"]}]
    issues = _issues(doc)
    assert [path for path, _ in issues] == ["heads[0].input"], issues
    assert "query tower 'q' reads the item id 'item_id'" in issues[0][1]
    doc["modules"][0]["inputs"] = ["user_id"]
    assert _issues(doc) == []


# ---- moe / ple: named outputs ----------------------------------------------------------------


def test_a_name_equal_to_a_named_output_is_refused():
    """A module named 'experts.like' beside moe 'experts' with output 'like': towers reading
    'experts.like' were silently wired to the module, not to the mixture's output."""
    doc = _spec("mmoe_movielens.yaml")
    doc["modules"].insert(1, {"name": "experts.like", "kind": "mlp", "inputs": ["@sparse"], "layers": [3]})
    doc["modules"].append({"name": "x", "kind": "mlp", "inputs": ["experts.like"], "layers": [2]})
    doc["heads"].append({"name": "third", "input": "x", "label": "third"})
    assert _issues(doc) == [("modules[1].name", "module name 'experts.like' is also an output of module 'experts' "
                                                "(modules[0]); inputs naming it would be ambiguous")]
    doc = _spec("mmoe_movielens.yaml")
    doc["features"][0]["name"] = "experts.love"
    assert _issues(doc) == [("features[0].name", "feature name 'experts.love' is also an output of module "
                                                 "'experts' (modules[0]); inputs naming it would be ambiguous")]


def test_a_custom_module_with_meta_parameters_is_refused_before_training(tmp_path, blocks):
    """It plans (the dry run is on the meta device anyway) but has no values to train."""
    spec = _write(tmp_path, custom_doc(f"{blocks}:MetaParam"))
    assert runner.invoke(app, ["plan", str(spec)]).exit_code == 0
    out = tmp_path / "run"
    result = runner.invoke(app, ["train", str(spec), "--rows", "64", "--out", str(out), "-q"])
    assert result.exit_code == 2, result.output
    assert "MetaParam keeps w on the meta device (no values)" in result.output
    assert not out.exists()


def test_a_named_output_of_a_gate_without_its_heads_list_says_so():
    """A moe module whose `heads` list is misspelt: its own error names the key, and the towers
    reading `experts.like` are told the list names no outputs (not an empty '(outputs: )')."""
    doc = _spec("mmoe_movielens.yaml")
    doc["modules"][0]["tasks"] = doc["modules"][0].pop("heads")
    issues = _issues(doc)
    assert ("modules[0]", "missing required key 'heads'") in issues
    assert ("modules[1].inputs[0]", "module 'experts' has no output 'like' (its `heads` list names none)") in issues
    assert not any("(outputs: )" in message for _, message in issues)


@pytest.mark.parametrize("cls", ["{blocks}:GatedCross.inner", "{blocks}:GatedCross ", "{blocks}:9Gate"])
def test_a_class_path_the_schema_refuses_is_one_line_at_validate(tmp_path, blocks, cls):
    """`blocks.py:GatedCross.inner` was two lines at modules[1].class: the schema's, and the file
    check's 'defines no top-level 'GatedCross.inner'' for the same mistake."""
    spec = _write(tmp_path, custom_doc(cls.format(blocks=blocks)))
    result = runner.invoke(app, ["validate", str(spec)])
    assert result.exit_code == 2
    assert result.output.splitlines() == [f"{spec}: modules[1].class: must be 'package.module:Class' or "
                                          "'path/to/file.py:Class'"], result.output


def test_a_run_recording_a_relative_class_file_finds_it_above_its_folder(tmp_path, monkeypatch):
    """A run of before 2026-12-06 recorded `blocks.py:X` relative to the folder it ran in; eval,
    export and --resume from elsewhere said 'no Python file at <cwd>/blocks.py'. The file is looked
    for in the working folder, then above the run folder; a file neither holds stays as written."""
    from flowrec.spec.class_paths import found_class_file, run_class_folders

    (tmp_path / "proj" / "runs" / "a").mkdir(parents=True)
    (tmp_path / "proj" / "blocks.py").write_text("X = 1\n")
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    folders = run_class_folders(tmp_path / "proj" / "runs" / "a")
    assert found_class_file("blocks.py:X", folders) == f"{(tmp_path / 'proj' / 'blocks.py').resolve()}:X"
    assert found_class_file("./blocks.py:X", folders) == f"{(tmp_path / 'proj' / 'blocks.py').resolve()}:X"
    assert found_class_file("other.py:X", folders) == "other.py:X"
    (tmp_path / "elsewhere" / "blocks.py").write_text("X = 2\n")  # the working folder's comes first, as before
    assert found_class_file("blocks.py:X", run_class_folders(tmp_path / "proj" / "runs" / "a")) \
        == f"{(tmp_path / 'elsewhere' / 'blocks.py').resolve()}:X"


@pytest.mark.parametrize("setting", ["torch.set_default_dtype(torch.float64)", "torch.set_grad_enabled(False)"])
def test_a_class_file_that_changes_torchs_settings_does_not_change_flowrecs(tmp_path, setting):
    """A class file whose top level ran `torch.set_default_dtype(torch.float64)` planned, then
    `flowrec train` stopped at its first step with a traceback (mat1 and mat2 must have the same
    dtype: flowrec's own layers, built after the import, were float64); `torch.set_grad_enabled(False)`
    did too (element 0 of tensors does not require grad). Both settings are put back after the
    user's code ran, and the module trains."""
    import torch

    (tmp_path / "settings.py").write_text(f"import torch\nfrom torch import nn\n\n{setting}\n\n\n"
                                          "class Proj(nn.Linear):\n    def __init__(self):\n"
                                          "        super().__init__(8, 5)\n")
    spec = _write(tmp_path, custom_doc(f"{tmp_path}/settings.py:Proj"))
    out = tmp_path / "run"
    try:
        result = runner.invoke(app, ["train", str(spec), "--rows", "96", "--max-steps", "2", "--out", str(out), "-q",
                                     "--device", "cpu"])
        kept = (torch.get_default_dtype(), torch.is_grad_enabled())
    finally:
        torch.set_default_dtype(torch.float32)
        torch.set_grad_enabled(True)
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output
    assert kept == (torch.float32, True)
    assert (out / "checkpoint.pt").exists()


@pytest.mark.parametrize("command", ["plan", "train"])
def test_a_stop_while_a_class_file_runs_names_the_class(tmp_path, command):
    """A class file stuck at its top level (`while True: pass`): Ctrl-C ended `flowrec plan` without
    a word (exit 130) and `flowrec train` with 'interrupted (Ctrl-C) before training started', neither
    saying what was running. The stop (here raised by the file's top level itself, as Ctrl-C raises
    it there) is one line naming the module's path and its class, exit 130, nothing written."""
    (tmp_path / "stuck.py").write_text("raise KeyboardInterrupt\n")
    spec = _write(tmp_path, custom_doc(f"{tmp_path}/stuck.py:Stuck"))
    out = tmp_path / "run"
    args = ["plan", str(spec)] if command == "plan" else ["train", str(spec), "--rows", "96", "--out", str(out), "-q"]
    result = runner.invoke(app, args)
    assert result.exit_code == 130, result.output
    assert "Traceback" not in result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "modules[1].class: interrupted (Ctrl-C) while importing" in lines[0], result.output
    assert f"{tmp_path}/stuck.py:Stuck (custom module 'mine')" in lines[0]
    assert not out.exists()


@pytest.mark.parametrize("inputs, issue", [
    (["@spares"], ("modules[0].inputs[0]", "selector '@spares' matches nothing (no feature has the tag 'spares') "
                                           "(did you mean '@sparse'?)")),
    (["user_id", "item_id", "age", "gender", "occupation", "zip_code", "genres", "releaseyear"],
     ("modules[0].inputs[7]", "unknown feature 'releaseyear' (did you mean 'release_year'?)")),
])
def test_an_input_naming_nothing_is_one_issue_not_one_per_feature(inputs, issue):
    """A typo in the mixture's inputs ('@spares') was its own issue and then one 'feature ... is not
    used by any module' per feature it was meant to read: 9 lines for one mistake."""
    doc = _spec("mmoe_movielens.yaml")
    doc["modules"][0]["inputs"] = inputs
    assert _issues(doc) == [issue]
    doc["modules"][0]["inputs"] = ["user_id", "item_id"]  # features no module names are still reported
    assert [path for path, _ in _issues(doc)] == [f"features[{i}]" for i in range(2, 8)]


def _five_wide(kind: str) -> dict[str, Any]:
    """A custom module returning 5 values read by a `kind` module beside a feature of dim 4."""
    mine = {"name": "mine", "kind": "custom", "class": "torch.nn:Linear", "inputs": ["u"],
            "params": {"in_features": 4, "out_features": 5}}
    reader = {"name": "meet", "kind": kind, "inputs": ["mine", "v"]}
    doc = {"name": "five_wide", "features": [{"name": "x0", "type": "dense"},
                                             {"name": "u", "type": "categorical", "hash_buckets": 100, "dim": 4},
                                             {"name": "v", "type": "categorical", "hash_buckets": 100, "dim": 4}],
           "modules": [mine, reader, {"name": "top", "kind": "mlp", "inputs": ["meet", "@dense"], "layers": [4]}],
           "heads": [{"name": "ctr", "input": "top"}], "training": {"batch_size": 32}}
    if kind == "similarity":  # a two-tower ranker: the similarity is the head's input
        doc["modules"].pop()
        doc["features"].pop(0)
        doc["heads"][0]["input"] = "meet"
    return doc


@pytest.mark.parametrize("kind, says", [
    ("dot", "modules[1].inputs: dot needs fields of equal dim, got dim 5: mine; dim 4: v"),
    ("fm", "modules[1].inputs: fm needs fields of equal dim, got dim 5: mine; dim 4: v"),
    ("similarity", "modules[1].inputs: similarity needs two vectors of one width, got dim 5: mine; dim 4: v"),
])
def test_a_measured_width_that_does_not_fit_its_reader_is_said_at_the_readers_path(tmp_path, kind, says):
    """validate cannot tell a custom module's width; once the dry run measured it, a dot of its 5
    values and a field of dim 4 failed in the graph builder: 'error: interaction inputs need one
    common dim, got shapes [(5,), (4,)]', naming neither the module nor the spec's path."""
    spec = _write(tmp_path, _five_wide(kind))
    assert runner.invoke(app, ["validate", str(spec)]).exit_code == 0
    for args in (["plan", str(spec)], ["train", str(spec), "--rows", "96", "--out", str(tmp_path / "run"), "-q"]):
        result = runner.invoke(app, args)
        assert result.exit_code == 2, result.output
        assert [line for line in result.output.splitlines() if line.strip()] == [f"{spec}: {says}"], result.output
    assert not (tmp_path / "run").exists()


def test_a_module_that_changes_its_input_in_place_trains_and_leaves_the_input_alone(tmp_path):
    """A custom module opening with nn.ReLU(inplace=True) (here torch's ReLU itself) changed the
    bottom MLP's output in place: training stopped at its first backward with autograd's traceback
    ('one of the variables needed for gradient computation has been modified by an inplace
    operation'), and without gradients (evaluation, export, predict) the top MLP, which reads the
    bottom too, saw the changed values. The module now gets its own copy of its input."""
    import torch
    from operators.custom import CustomModule

    x = torch.randn(16, 8) * torch.logspace(-2, 2, 8)  # skewed, half of it negative
    before = x.clone()
    out = CustomModule(torch.nn.ReLU(inplace=True), "torch.nn:ReLU")(x)
    torch.testing.assert_close(x, before, rtol=0, atol=0)
    torch.testing.assert_close(out, before.clamp(min=0), rtol=0, atol=0)
    doc = custom_doc("torch.nn:ReLU", {"inplace": True})
    doc["modules"][2]["inputs"] = ["mine", "bottom"]
    spec = _write(tmp_path, doc)
    result = runner.invoke(app, ["train", str(spec), "--rows", "96", "--max-steps", "2", "--out", str(tmp_path / "run"),
                                 "-q", "--device", "cpu"])
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output


EMA = textwrap.dedent('''
    from torch import nn


    class Ema(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)
            self.running = None

        def forward(self, x):
            y = self.lin(x)
            if self.training:  # (in eval mode too, a row's output would follow its batch: refused at build)
                m = y.mean(0)  # a running mean of the batches, kept without .detach()
                self.running = m if self.running is None else 0.9 * self.running + 0.1 * m
            return y if self.running is None else y - self.running
''')


def test_a_backward_that_fails_in_a_model_with_custom_modules_is_one_line(tmp_path):
    """A custom module keeping a tensor of one step for the next (a running mean not detached)
    trained its first step; the second backward stopped with autograd's traceback through torch's
    engine and flowrec's step ('Trying to backward through the graph a second time'). It is one
    line naming the model's custom modules and what usually causes it, exit 2."""
    import torch
    from operators.custom import CustomModule, backward_failure

    (tmp_path / "ema.py").write_text(EMA)
    spec = _write(tmp_path, custom_doc(f"{tmp_path}/ema.py:Ema"))
    result = runner.invoke(app, ["train", str(spec), "--rows", "96", "--max-steps", "3", "--out", str(tmp_path / "run"),
                                 "-q", "--device", "cpu"])
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    (line,) = [line for line in result.output.splitlines() if line.startswith("error:")]
    assert line.startswith(f"error: at step 2: the backward pass of a model with custom modules ('mine' "
                           f"({tmp_path}/ema.py:Ema)) failed: RuntimeError: Trying to backward through the graph"), line
    # only autograd's backward of a model with custom modules is said so
    plain = torch.nn.Linear(3, 1)
    x = torch.randn(4, 3) * torch.tensor([0.01, 1.0, 100.0])
    loss = plain(x).sum()
    loss.backward()
    with pytest.raises(RuntimeError) as failed:
        loss.backward()
    assert backward_failure(failed.value, plain) is None
    assert backward_failure(failed.value, torch.nn.Sequential(plain, CustomModule(torch.nn.Identity()))) is not None
    assert backward_failure(ValueError("in a forward"), torch.nn.Sequential(CustomModule(torch.nn.Identity()))) is None


@pytest.mark.parametrize("example, output", [("mmoe_movielens.yaml", "experts.like"),
                                             ("ple_movielens.yaml", "experts.love")])
def test_a_mixture_reading_its_own_named_output_is_refused_at_validate(example, output):
    """`inputs: ['@sparse', 'experts.like']` in the mixture 'experts' validated (the self-read check
    compared the whole name only, the cycle check skips a module's edges to itself), then
    `flowrec plan` said 'error: modules form a cycle: experts, like_tower, love_tower', naming two
    towers that are in no cycle and no path."""
    doc = _spec(example)
    doc["modules"][0]["inputs"] = ["@sparse", output]
    assert _issues(doc) == [("modules[0].inputs[1]", f"module 'experts' cannot read its own output {output!r}")]


@pytest.mark.parametrize("where, value, says", [
    ("module", ".like", "modules[1].inputs[0]: must be a feature or module name, or a selector"),
    ("module", "like tower", "modules[1].inputs[0]: must be a feature or module name, or a selector"),
    ("head", "", "heads[1].input: must be a name of ASCII letters"),
    ("head", "love tower", "heads[1].input: must be a name of ASCII letters"),
])
def test_an_input_that_is_no_name_is_one_issue(where, value, says):
    """An input the schema refuses as a name ('.like', '', a space) was its issue and then the
    semantic check's 'unknown feature or module' / 'unknown module' for the same value."""
    doc = _spec("mmoe_movielens.yaml")
    if where == "module":
        doc["modules"][1]["inputs"] = [value]
    else:
        doc["heads"][1]["input"] = value
    issues = [f"{path}: {message}" for path, message in _issues(doc)]
    assert len(issues) == 1 and issues[0].startswith(says), issues


@pytest.mark.parametrize("example, output, bad", [("mmoe_movielens.yaml", "love.v2", "."),
                                                  ("ple_movielens.yaml", "love it", " ")])
def test_a_mixture_output_that_is_no_name_says_what_a_name_is(example, output, bad):
    """An output name with a '.' (or a space) in a moe / ple `heads` list was refused with the raw
    regular expression: "must match the pattern ^[A-Za-z0-9_][A-Za-z0-9_:-]*$ (got 'love.v2')"."""
    doc = _spec(example)
    doc["modules"][0]["heads"] = ["like", output]
    doc["modules"][2]["inputs"] = [f"experts.{output}"]
    issues = _issues(doc)
    assert issues[0] == ("modules[0].heads[1]", "must be an output name of ASCII letters, digits, '_', ':' or '-' (no "
                                                "'.': a reader names it '<module>.<output>') "
                                                f"(got {output!r}: {bad!r} is not allowed)"), issues
    assert not any("^[" in message for _, message in issues)


def test_a_sequence_as_the_target_of_self_attention_says_what_a_target_is():
    """A pooling-none sequence as self_attention's target (`output: target`) was told that 'only a
    target_attention module (as its second input) or a self_attention module can read it', in the
    inputs of a self_attention module."""
    doc = _spec("bst_taobao.yaml")
    doc["features"].append({"name": "seq2", "type": "sequence", "table": "items", "max_len": 5, "pooling": "none"})
    doc["modules"][0]["inputs"] = ["click_sequence", "seq2"]
    assert _issues(doc) == [("modules[0].inputs[1]", "the target of self_attention is one vector (a one-id feature or "
                                                     "a module of the sequence dim), not the pooling-none sequence "
                                                     "'seq2'")]
    doc["modules"][1]["inputs"].append("seq2")  # elsewhere such a sequence is told who may read it
    doc["modules"][0]["inputs"] = ["click_sequence", "adgroup_id"]
    assert [path for path, _ in _issues(doc)] == ["modules[1].inputs[3]"]


def test_a_stop_while_a_class_file_runs_at_export_or_eval_names_the_class(tmp_path):
    """A run's class that came to hang after training (its constructor: the file must stay the one the
    run trained, and an import already made is not made again in one process): Ctrl-C in
    `flowrec export` said 'interrupted (Ctrl-C); PKG was not written' and in `flowrec eval`
    'interrupted (Ctrl-C)', neither saying what was running."""
    stop = tmp_path / "stop"  # the file stays the one the run trained (an edited one is refused): it hangs once this exists
    (tmp_path / "proj.py").write_text(f"import os\nfrom torch import nn\n\n\nclass Proj(nn.Linear):\n"
                                      f"    def __init__(self):\n        if os.path.exists({str(stop)!r}):\n"
                                      "            raise KeyboardInterrupt  # where Ctrl-C stops a loop\n"
                                      "        super().__init__(8, 3)\n")
    spec = _write(tmp_path, custom_doc(f"{tmp_path}/proj.py:Proj"))
    run = tmp_path / "run"
    trained = runner.invoke(app, ["train", str(spec), "--rows", "96", "--max-steps", "2", "--out", str(run), "-q",
                                  "--device", "cpu"])
    assert trained.exit_code == 0, trained.output
    stop.touch()
    running = f"Ctrl-C while constructing the custom module class {tmp_path}/proj.py:Proj"
    for args, line in ((["export", str(run), str(tmp_path / "pkg")], f"error: interrupted ({running}); "),
                       (["eval", str(run)], f"error: interrupted ({running})")):
        result = runner.invoke(app, args)
        assert result.exit_code == 130, result.output
        assert "Traceback" not in result.output
        assert [x for x in result.output.splitlines() if x.startswith("error:")][0].startswith(line), result.output
    assert not (tmp_path / "pkg").exists()


def test_a_class_file_imports_the_files_beside_it(tmp_path):
    """blocks.py with `import sibling_scale` (sibling_scale.py beside it) imported under
    `python -m flowrec` from its folder, but the `flowrec` command put no folder of the user's on the
    import path: 'cannot import ...: ModuleNotFoundError: No module named ...'. While the file runs,
    its folder is first on the import path, as when Python runs the file; afterwards it is not."""
    import sys

    (tmp_path / "sibling_scale_7f3a.py").write_text("SCALE = 2.5\n")
    (tmp_path / "blocks.py").write_text("from torch import nn\n\nimport sibling_scale_7f3a\n\n\n"
                                        "class Scaled(nn.Linear):\n    def __init__(self):\n"
                                        "        super().__init__(8, 3)\n\n    def forward(self, x):\n"
                                        "        return super().forward(x) * sibling_scale_7f3a.SCALE\n")
    spec = _write(tmp_path, custom_doc(f"{tmp_path}/blocks.py:Scaled"))
    try:
        result = runner.invoke(app, ["plan", str(spec), "--json", "-"])
    finally:
        sys.modules.pop("sibling_scale_7f3a", None)
    assert result.exit_code == 0, result.output
    assert any(n["name"] == "mine" and n["out_shape"] == ["B", 3] for n in json.loads(result.stdout)["nodes"])
    assert str(tmp_path) not in sys.path


def test_a_missing_output_of_a_mixture_of_thousands_of_heads_is_a_short_line():
    """A moe module of 5,000 heads read as `experts.nosuch` listed every head in one 30 KB line;
    the line now names the first 20 and the count."""
    import random

    doc = _spec("mmoe_movielens.yaml")
    heads = [f"h{k}" for k in random.Random().sample(range(10 ** 6), 5000)]
    doc["modules"][0]["heads"] = heads
    doc["modules"][1]["inputs"][0] = "experts.nosuch"
    found = [m for _, m in _issues(doc) if "has no output 'nosuch'" in m]
    assert len(found) == 1 and len(found[0]) < 400, found
    assert found[0].endswith(f"(outputs: {', '.join(heads[:20])}, ... (5,000 in all))"), found[0][-200:]
