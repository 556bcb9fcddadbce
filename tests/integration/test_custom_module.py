"""A custom module from a file outside the repository trains, resumes, exports, and the package
predicts in a process where that file no longer exists; a bad class path is one line, exit 2."""
from __future__ import annotations

import json
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import torch
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.testing.processes import run_bounded
from operators.custom import DATA_DEPENDENT_FLOW

REPO = Path(__file__).resolve().parents[2]
BLOCKS = textwrap.dedent('''
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


    class Noisy(nn.Module):
        """Draws from torch's process generator: dropout and additive noise while training."""
        def __init__(self, in_features, rank):
            super().__init__()
            self.down = nn.Linear(in_features, rank)
            self.drop = nn.Dropout(0.4)

        def forward(self, x):
            h = self.down(x)
            if self.training:
                h = h + 0.1 * torch.randn_like(h)
            return self.drop(torch.relu(h))


    class Fails(nn.Module):
        """Raises in its third training forward (not in the meta dry run)."""
        def __init__(self, in_features, rank):
            super().__init__()
            self.down = nn.Linear(in_features, rank)
            self.calls = 0

        def forward(self, x):
            self.calls += not x.is_meta
            if self.calls == 3:
                raise KeyError("no row for this user")
            return self.down(x)


    class FailsWhenAsked(nn.Module):
        """Raises while FLOWREC_TEST_FAIL is set (not in the meta dry run)."""
        def __init__(self, in_features, rank):
            super().__init__()
            self.down = nn.Linear(in_features, rank)

        def forward(self, x):
            import os
            if os.environ.get("FLOWREC_TEST_FAIL") and not x.is_meta:
                raise KeyError("asked to fail")
            return self.down(x)


    class Branchy(nn.Module):
        """Branches on its values: trains, but torch.export cannot trace it."""
        def __init__(self, in_features, rank):
            super().__init__()
            self.down = nn.Linear(in_features, rank)

        def forward(self, x):
            h = self.down(x)
            if h.sum() > 0:
                return h
            return -h


    class Chatty(nn.Module):
        """Prints in its constructor and in every forward."""
        def __init__(self, in_features, rank):
            super().__init__()
            print("CHATTY INIT")
            self.down = nn.Linear(in_features, rank)

        def forward(self, x):
            print("CHATTY FORWARD")
            return self.down(x)


    class Hungry(nn.Module):
        """Asks the CPU allocator for 64 TiB in a training step (not in the meta dry run)."""
        def __init__(self, in_features, rank):
            super().__init__()
            self.down = nn.Linear(in_features, rank)

        def forward(self, x):
            if self.training and not x.is_meta:
                x = x + torch.empty(1 << 44, dtype=torch.uint8)[:1].float()
            return self.down(x)
''')
SPEC = """
name: custom_cli
features:
  - {{name: price, type: dense}}
  - {{name: user_id, type: categorical, hash_buckets: 500, dim: 8}}
  - {{name: item_id, type: categorical, hash_buckets: 500, dim: 8}}
modules:
  - {{name: bottom, kind: mlp, inputs: ["@sparse", price], layers: [16]}}
  - {{name: mine, kind: custom, class: "{path}:{cls}", inputs: [bottom], params: {{in_features: 16, rank: 4}}}}
  - {{name: top, kind: mlp, inputs: [mine, bottom], layers: [8]}}
heads:
  - {{name: click, input: top}}
optimizer:
  dense: {{name: adam, lr: 0.01}}
  sparse: {{name: adagrad, lr: 0.05}}
training: {{batch_size: 128, seed: 0}}
"""
PREDICT = """
import sys
import pandas as pd
from flowrec.serving.predict import load_model
scores = load_model(sys.argv[1]).predict(pd.DataFrame({"price": [1.0, 2.5], "user_id": ["a", "b"],
                                                       "item_id": ["c", "d"]}))
assert list(scores.columns) == ["click"] and scores["click"].between(0, 1).all()
assert not any(name.startswith("flowrec_custom_") for name in sys.modules)
print("scored", len(scores))
"""
runner = CliRunner()


def test_custom_module_trains_resumes_exports_and_predicts_without_its_file(tmp_path):
    user = tmp_path / "user"
    user.mkdir()
    (user / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=user / "blocks.py", cls="GatedCross"))
    run = tmp_path / "run"
    first = runner.invoke(app, ["train", str(spec), "--rows", "2000", "--max-steps", "4", "--out", str(run), "-q"])
    assert first.exit_code == 0, first.output
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(run), "--max-steps", "8", "-q"])
    assert resumed.exit_code == 0, resumed.output
    exported = runner.invoke(app, ["export", str(run), str(tmp_path / "pkg")])
    assert exported.exit_code == 0, exported.output
    (user / "blocks.py").unlink()
    (tmp_path / "predict.py").write_text(PREDICT)
    done = run_bounded([sys.executable, str(tmp_path / "predict.py"), str(tmp_path / "pkg")],
                       capture_output=True, text=True, timeout_s=300, cwd=tmp_path,
                       env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    assert done.returncode == 0, done.stderr[-2000:]
    assert "scored 2" in done.stdout


def test_a_bad_class_path_is_one_line_and_exit_2(tmp_path):
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="Nope"))
    result = runner.invoke(app, ["train", str(spec), "--rows", "500", "--max-steps", "1", "--out",
                                 str(tmp_path / "run")])
    assert result.exit_code == 2
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and "modules[1].class" in lines[0] and "cannot import" in lines[0], result.output
    assert "Traceback" not in result.output


def _losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line and json.loads(line).get("event") == "train"]


def test_a_custom_module_drawing_random_numbers_trains_reproducibly_and_resumes_exactly(tmp_path):
    """torch's process generator starts at a random seed in every process: a user's nn.Dropout
    drew other masks in two runs of one seed and after a resume. Training seeds it per step."""
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="Noisy"))
    args = ["train", str(spec), "--rows", "3000", "-q"]
    for name, steps in (("a", "12"), ("b", "6")):
        done = runner.invoke(app, [*args, "--max-steps", steps, "--out", str(tmp_path / name)])
        assert done.exit_code == 0, done.output
    torch.manual_seed(12345)  # the process's generator moves on between the runs
    resumed = runner.invoke(app, ["train", str(spec), "--resume", str(tmp_path / "b"), "--max-steps", "12", "-q"])
    assert resumed.exit_code == 0, resumed.output
    a, b = _losses(tmp_path / "a"), _losses(tmp_path / "b")
    assert len(a) == 12 and a == b
    first = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=True)["model"]
    second = torch.load(tmp_path / "b" / "checkpoint.pt", weights_only=True)["model"]
    assert any("inner.down" in key for key in first)
    for key, value in first.items():
        assert torch.equal(value, second[key]), key

    before = torch.get_rng_state()
    flowrec.train(spec, rows=1000, max_steps=2)
    assert torch.equal(torch.get_rng_state(), before)  # the caller's generator is given back


def test_running_out_of_host_memory_in_a_step_is_one_line_and_exit_3(tmp_path):
    """torch's CPU allocator raises a plain RuntimeError, not OutOfMemoryError: it was a traceback."""
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="Hungry"))
    done = runner.invoke(app, ["train", str(spec), "--rows", "1000", "--out", str(tmp_path / "run"), "-q"])
    assert done.exit_code == 3, done.output
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: out of memory at step 1 on cpu"), done.output
    assert "Traceback" not in done.output and isinstance(done.exception, SystemExit)


def test_a_custom_module_raising_in_training_is_one_line_naming_it(tmp_path):
    """A user's forward that raised in a training step was a traceback through flowrec's trainer."""
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="Fails"))
    done = runner.invoke(app, ["train", str(spec), "--rows", "1000", "--out", str(tmp_path / "run"), "-q"])
    assert done.exit_code == 2, done.output
    errors = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert errors == [f"error: at step 3: custom module 'mine' ({tmp_path / 'blocks.py'}:Fails) raised "
                      "KeyError: 'no row for this user'; no checkpoint was written"], done.output
    assert "Traceback" not in done.output and isinstance(done.exception, SystemExit)


def test_a_custom_module_raising_in_flowrec_eval_or_export_is_one_line_naming_it(tmp_path, monkeypatch):
    """flowrec eval and export showed the user's KeyError as a traceback (a ValueError without the
    module's name), and export left its staging folder .PKG.export-tmp beside PKG."""
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="FailsWhenAsked"))
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", str(spec), "--rows", "500", "--out", str(run), "-q"]).exit_code == 0
    assert runner.invoke(app, ["data", "synth", str(spec), "--rows", "100", "--out", str(tmp_path / "d"),
                               "-q"]).exit_code == 0
    monkeypatch.setenv("FLOWREC_TEST_FAIL", "1")
    done = runner.invoke(app, ["eval", str(run), "--data", str(tmp_path / "d")])
    assert done.exit_code == 2, done.output
    assert done.output.splitlines() == [f"error: custom module 'mine' ({tmp_path / 'blocks.py'}:FailsWhenAsked) "
                                        "raised KeyError: 'asked to fail'"], done.output
    done = runner.invoke(app, ["export", str(run), str(tmp_path / "pkg")])
    assert done.exit_code == 2, done.output
    assert done.output.splitlines() == [f"error: cannot export to {tmp_path / 'pkg'}: custom module 'mine' "
                                        f"({tmp_path / 'blocks.py'}:FailsWhenAsked) raised KeyError: 'asked to fail'"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocks.py", "d", "run", "spec.yaml"]


def test_a_custom_module_branching_on_its_values_is_one_export_line_saying_what_to_write(tmp_path):
    """`if x.sum() > 0:` in a custom forward trained, then export printed torch's partial graph (a
    hundred lines) and its guard error; now one line naming the module and its class, what cannot
    be exported and what to write instead, and nothing left beside the run."""
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="Branchy"))
    run = tmp_path / "run"
    assert runner.invoke(app, ["train", str(spec), "--rows", "500", "--out", str(run), "-q"]).exit_code == 0
    done = runner.invoke(app, ["export", str(run), str(tmp_path / "pkg")])
    assert done.exit_code == 2, done.output
    assert done.output.splitlines() == [f"error: cannot export to {tmp_path / 'pkg'}: custom module 'mine' "
                                        f"({tmp_path / 'blocks.py'}:Branchy) {DATA_DEPENDENT_FLOW}"], done.output
    assert "torch.where" in DATA_DEPENDENT_FLOW and "torch.cond" in DATA_DEPENDENT_FLOW
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocks.py", "run", "spec.yaml"]
    # the folders made for OUT go too (new/sub was left behind)
    done = runner.invoke(app, ["export", str(run), str(tmp_path / "new" / "sub" / "pkg")])
    assert done.exit_code == 2 and DATA_DEPENDENT_FLOW in done.output, done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["blocks.py", "run", "spec.yaml"]


def test_what_a_custom_module_prints_does_not_corrupt_train_or_eval_json(tmp_path):
    """train --json and eval --json - wrote the user's prints (constructor, every forward) on stdout
    before the JSON, which no reader could parse; as plan --json - does, they go to stderr."""
    (tmp_path / "blocks.py").write_text(BLOCKS)
    spec = tmp_path / "spec.yaml"
    spec.write_text(SPEC.format(path=tmp_path / "blocks.py", cls="Chatty"))
    run = tmp_path / "run"
    done = runner.invoke(app, ["train", str(spec), "--rows", "500", "--out", str(run), "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.stdout)["steps"] > 0 and "CHATTY FORWARD" in done.stderr
    done = runner.invoke(app, ["eval", str(run), "--json", "-"])
    assert done.exit_code == 0, done.output
    assert "click" in json.loads(done.stdout) and "CHATTY FORWARD" in done.stderr


def test_a_class_file_relative_to_the_training_folder_is_found_from_any_folder(tmp_path, monkeypatch):
    """`class: "blocks.py:X"` trained in one folder: eval RUN, export RUN PKG and train --resume RUN
    from another said 'no Python file at <cwd>/blocks.py', and --resume with the same file written
    otherwise (./blocks.py:X, its absolute path) was refused as another model; the run now records
    the file absolute and compares class files by the file they name."""
    work, other = tmp_path / "work", tmp_path / "other"
    work.mkdir()
    other.mkdir()
    (work / "blocks.py").write_text(BLOCKS)
    (work / "spec.yaml").write_text(SPEC.format(path="blocks.py", cls="GatedCross"))
    (work / "dot.yaml").write_text(SPEC.format(path="./blocks.py", cls="GatedCross"))
    (work / "abs.yaml").write_text(SPEC.format(path=work / "blocks.py", cls="GatedCross"))
    monkeypatch.chdir(work)
    done = runner.invoke(app, ["train", "spec.yaml", "--rows", "500", "--max-steps", "1", "--out", "run", "-q"])
    assert done.exit_code == 0, done.output
    for steps, spec in (("2", "dot.yaml"), ("3", "abs.yaml")):
        done = runner.invoke(app, ["train", spec, "--resume", "run", "--max-steps", steps, "-q"])
        assert done.exit_code == 0, done.output
    monkeypatch.chdir(other)
    run = work / "run"
    for args in (["eval", str(run)], ["export", str(run), str(other / "pkg")],
                 ["train", str(run / "spec.json"), "--resume", str(run), "--max-steps", "4", "-q"]):
        done = runner.invoke(app, args)
        assert done.exit_code == 0, (args, done.output)
    assert (other / "pkg" / "model.pt2").is_file()
    assert flowrec.load(run, device="cpu").trained.step == 4


def test_a_saved_plan_naming_its_class_file_relative_still_trains(tmp_path, monkeypatch):
    """A plan.json of a flowrec of before 2026-12-06 names `blocks.py:X` as written (and bears the
    fingerprint of that text); the spec's file is now recorded absolute, so `train --plan` of it
    was refused as 'made for ... a different model'. The same file is the same model."""
    from flowrec.graph.plan_io import model_fingerprint
    from flowrec.runtime.custom import resolve_custom
    from flowrec.spec.load import load_spec

    (tmp_path / "blocks.py").write_text(BLOCKS)
    (tmp_path / "spec.yaml").write_text(SPEC.format(path="blocks.py", cls="GatedCross"))
    monkeypatch.chdir(tmp_path)
    done = runner.invoke(app, ["plan", "spec.yaml", "--json", "plan.json"])
    assert done.exit_code == 0, done.output
    absolute = f"{(tmp_path / 'blocks.py').resolve()}:GatedCross"
    text = (tmp_path / "plan.json").read_text()
    assert absolute in text
    planned = resolve_custom(load_spec(tmp_path / "spec.yaml"))
    mine = planned.modules[1]
    mine = replace(mine, params=tuple((k, "blocks.py:GatedCross" if k == "class" else v) for k, v in mine.params))
    old = replace(planned, modules=(planned.modules[0], mine, *planned.modules[2:]))  # the spec as it was planned
    text = text.replace(absolute, "blocks.py:GatedCross").replace(model_fingerprint(planned), model_fingerprint(old))
    (tmp_path / "plan.json").write_text(text)
    done = runner.invoke(app, ["train", "spec.yaml", "--plan", "plan.json", "--rows", "500", "--max-steps", "1",
                               "--out", "run", "-q"])
    assert done.exit_code == 0, done.output
