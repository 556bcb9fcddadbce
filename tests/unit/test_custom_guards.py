"""Custom modules under flowrec's guards while a run trains: a module that cannot train on one row
(batch norm) gets such batches skipped and said, where the run stopped at an epoch's last batch."""
from __future__ import annotations

import json
import random
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.testing.processes import run_bounded
from operators import custom_checks
from operators.custom_checks import one_row_refusal
from operators.custom_code import build_custom

CLASSES = textwrap.dedent('''
    import torch
    from torch import nn


    class Normed(nn.Module):
        """Batch norm: it refuses a batch of one row in training."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 5)
            self.norm = nn.BatchNorm1d(5)

        def forward(self, x):
            return self.norm(self.proj(x))


    class Plain(nn.Module):
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)

        def forward(self, x):
            return self.proj(x)
''')
runner = CliRunner()
BATCH = 64


@pytest.fixture()
def classes(tmp_path: Path) -> Path:
    path = tmp_path / "normed.py"
    path.write_text(CLASSES)
    return path


def spec_file(tmp_path: Path, cls: str) -> Path:
    doc = {
        "name": "guards",
        "features": [{"name": "x0", "type": "dense"}, {"name": "x1", "type": "dense"},
                     {"name": "user", "type": "categorical", "hash_buckets": 300, "dim": 8}],
        "modules": [{"name": "mine", "kind": "custom", "class": cls, "inputs": ["@dense", "@sparse"],
                     "params": {"in_features": 10}},
                    {"name": "top", "kind": "mlp", "inputs": ["mine"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.05}},
        "training": {"batch_size": BATCH, "seed": random.randrange(1 << 20)},
    }
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def train(*args: str):
    return runner.invoke(app, ["train", *args, "-q", "--device", "cpu"])


def end_record(run: Path) -> dict:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return next(r for r in reversed(records) if r["event"] == "end")


def test_a_module_that_cannot_train_on_one_row_gets_such_batches_skipped_and_resumes_bitwise(tmp_path, classes):
    """`--rows 257` at batch 64 stopped at step 5 (`Expected more than 1 value per channel when
    training`) after the whole epoch trained, and no checkpoint was written."""
    spec = spec_file(tmp_path, f"{classes}:Normed")
    rows = BATCH * random.randrange(2, 5) + 1  # every epoch ends in a batch of one row
    whole, split = tmp_path / "whole", tmp_path / "split"
    done = train(str(spec), "--rows", str(rows), "--epochs", "2", "--out", str(whole))
    assert done.exit_code == 0, done.output
    assert "Traceback" not in done.output
    (line,) = [line for line in done.output.splitlines() if "cannot train on one row" in line]
    assert line.startswith("warning:") and f"'mine' ({classes}:Normed)" in line and "Expected more than 1" in line
    assert f"2 of {2 * rows:,} rows were skipped" in line, line
    assert end_record(whole)["skipped_rows"] == 2
    skipped = [json.loads(r) for r in (whole / "metrics.jsonl").read_text().splitlines() if '"skipped_rows"' in r]
    assert [r["step"] for r in skipped if r["event"] == "train"] == [rows // BATCH + 1, 2 * (rows // BATCH + 1)]
    # one epoch, then resumed for the second: the same batches skipped, the same parameters bit for bit
    done = train(str(spec), "--rows", str(rows), "--epochs", "1", "--out", str(split))
    assert done.exit_code == 0, done.output
    done = train(str(spec), "--resume", str(split), "--epochs", "2")
    assert done.exit_code == 0, done.output
    assert end_record(split)["skipped_rows"] == 1  # this session's: the second epoch's last batch
    one, other = load_checkpoint(whole / "checkpoint.pt")["model"], load_checkpoint(split / "checkpoint.pt")["model"]
    assert one.keys() == other.keys()
    for name in one:
        assert torch.equal(one[name], other[name]), name
    assert int(one["ops.mine.inner.norm.num_batches_tracked"]) == 2 * (rows // BATCH)  # trained batches only


def test_micro_batches_never_give_such_a_module_one_row(tmp_path, classes):
    """A plan of 4 micro-batches split an epoch's last batch of 5 rows into slices of one row."""
    spec = spec_file(tmp_path, f"{classes}:Normed")
    plan = tmp_path / "plan.json"
    done = runner.invoke(app, ["plan", str(spec), "--json", str(plan), "--target", "cpu"])
    assert done.exit_code == 0, done.output
    doc = json.loads(plan.read_text())
    doc["micro_batches"] = 4
    plan.write_text(json.dumps(doc))
    rows = BATCH * random.randrange(1, 4) + 5
    run = tmp_path / "run"
    done = train(str(spec), "--plan", str(plan), "--rows", str(rows), "--out", str(run))
    assert done.exit_code == 0, done.output
    assert "cannot train on one row" not in done.output  # nothing skipped: 5 rows train as slices of 2 and 3
    assert end_record(run)["skipped_rows"] == 0
    assert int(load_checkpoint(run / "checkpoint.pt")["model"]["ops.mine.inner.norm.num_batches_tracked"]) > 0


@pytest.mark.parametrize("copied", ["copy", "itself", "meta"])
def test_the_one_row_probe_leaves_the_modules_state_as_it_was(classes, monkeypatch, copied):
    """The probe runs the module in training mode, which moves batch norm's running statistics:
    on a copy, or (a module too large to copy) on the module itself with its buffers put back, or
    (its buffers too large too) on the class built again on the meta device."""
    if copied != "copy":
        monkeypatch.setattr(custom_checks, "probe_copy", lambda module: None)
    if copied == "meta":
        monkeypatch.setattr(custom_checks, "PROBE_COPY_BYTES", 0)
    inner = build_custom(f"{classes}:Normed", {"in_features": 10})
    inner.train(random.choice([True, False]))
    with torch.no_grad():
        inner.norm.running_mean.copy_(torch.randn(5) * torch.logspace(-2, 2, 5))
    before = {k: v.clone() for k, v in inner.state_dict().items()}
    mode = inner.training
    refused = one_row_refusal(inner, f"{classes}:Normed", 10, {"in_features": 10})
    assert refused is not None and "Expected more than 1 value per channel" in refused
    assert inner.training == mode
    after = inner.state_dict()
    for name, value in before.items():
        assert torch.equal(value, after[name]), name
    assert one_row_refusal(build_custom(f"{classes}:Plain", {"in_features": 10}), f"{classes}:Plain", 10) is None


def exiting_class(tmp_path: Path, where: str, how: str) -> Path:
    """A class file that ends the process (`how`: sys.exit, exit, os._exit) at its top level, in
    __init__, in its forward at once or at its 4th training call (`where`)."""
    call = {"sys": "sys.exit(0)", "exit": "exit()", "os": "os._exit(0)"}[how]
    path = tmp_path / f"bye_{where}_{how}.py"
    path.write_text(textwrap.dedent(f'''
        import os
        import sys
        from torch import nn

        if {where!r} == "import":
            {call}


        class Bye(nn.Module):
            def __init__(self, in_features):
                super().__init__()
                self.proj = nn.Linear(in_features, 3)
                self.calls = 0
                if {where!r} == "init":
                    {call}

            def forward(self, x):
                self.calls += 1  # a copy the build's checks run starts from the count it was copied at: 0
                if {where!r} == "forward" or ({where!r} == "step" and self.training and self.calls == 4):
                    {call}
                return self.proj(x)
    '''))
    return path


@pytest.mark.parametrize("where", ["import", "init", "forward", "step"])
def test_an_exit_in_a_class_file_is_one_line_naming_it_and_a_failure(tmp_path, where):
    """`sys.exit(0)` in a forward while training ended flowrec with status 0 and no word (a script
    took the run for trained); at import, in __init__ and in the dry run it said `SystemExit: 0`."""
    how = random.choice(["sys", "exit"])
    path = exiting_class(tmp_path, where, how)
    run = tmp_path / "run"
    done = train(str(spec_file(tmp_path, f"{path}:Bye")), "--rows", str(random.randrange(300, 500)), "--out", str(run))
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output and not run.exists()
    (line,) = [line for line in done.output.splitlines() if "tried to end the process" in line]
    assert f"{path}:Bye" in line and ("sys.exit(0)" if how == "sys" else "sys.exit(None)") in line, line
    assert ("at step 4: custom module 'mine'" in line) == (where == "step"), line


def test_os_exit_is_refused_within_the_guard_and_restored_after(tmp_path):
    import os

    from operators.custom_code import ExitAttempt, exits_refused

    real = os._exit
    status = random.randrange(256)
    with pytest.raises(ExitAttempt, match=rf"os\._exit\({status}\)"), exits_refused():
        os._exit(status)
    assert os._exit is real
    with pytest.raises(ExitAttempt, match=r"sys\.exit\('bye'\)"), exits_refused():
        raise SystemExit("bye")
    assert os._exit is real
    with pytest.raises(KeyboardInterrupt), exits_refused():  # a stop passes as a stop
        raise KeyboardInterrupt


@pytest.mark.parametrize("where", ["import", "step"])
def test_os_exit_in_a_class_file_ends_flowrec_with_a_failure_and_one_line(tmp_path, where):
    """`os._exit(0)` cannot be caught: it ended `flowrec train` with status 0 and no word."""
    import sys

    path = exiting_class(tmp_path, where, "os")
    run = tmp_path / "run"
    done = run_bounded([sys.executable, "-m", "flowrec", "train", str(spec_file(tmp_path, f"{path}:Bye")),
                        "--rows", str(random.randrange(300, 500)), "--out", str(run), "-q", "--device", "cpu"],
                       capture_output=True, text=True, timeout_s=600)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if "tried to end the process: os._exit(0)" in line]
    assert len(lines) == 1 and f"{path}:Bye" in lines[0], done.stderr
    assert "Traceback" not in done.stderr and not (run / "checkpoint.pt").exists()


MOVER = textwrap.dedent('''
    import os
    import torch
    from torch import nn


    class Mover(nn.Module):
        """From its second training call on, its forward moves the working folder and makes torch's
        default dtype float64."""
        def __init__(self, in_features, elsewhere):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)
            self.elsewhere = elsewhere
            self.calls = 0

        def forward(self, x):
            self.calls += 1
            if self.training and self.calls >= 2:
                os.chdir(self.elsewhere)
                torch.set_default_dtype(torch.float64)
            return self.proj(x)
''')


def test_a_forward_changing_the_working_folder_or_the_default_dtype_while_training_changes_neither(tmp_path,
                                                                                                     monkeypatch):
    """`os.chdir` in a forward moved `--out run` (relative) away mid-run: a traceback from the
    metrics writer and a half-written run folder; `torch.set_default_dtype(torch.float64)` made
    every tensor flowrec made after it float64. Both are put back after each call of the forward."""
    here, elsewhere = tmp_path / "here", tmp_path / "elsewhere"
    here.mkdir()
    elsewhere.mkdir()
    (here / "mover.py").write_text(MOVER)
    monkeypatch.chdir(here)
    spec = spec_file(here, "mover.py:Mover")
    doc = yaml.safe_load(spec.read_text())
    doc["modules"][0]["params"]["elsewhere"] = str(elsewhere)
    spec.write_text(yaml.safe_dump(doc))
    try:
        done = train("spec.yaml", "--rows", str(random.randrange(300, 500)), "--out", "run")
        dtype, folder = torch.get_default_dtype(), Path.cwd()
    finally:
        torch.set_default_dtype(torch.float32)
    assert done.exit_code == 0, done.output
    assert dtype == torch.float32 and folder == here
    assert list(elsewhere.iterdir()) == []
    state = load_checkpoint(here / "run" / "checkpoint.pt")
    assert {t.dtype for t in state["model"].values()} == {torch.float32}
    assert end_record(here / "run")["step"] > 1


WIDE = textwrap.dedent('''
    import torch
    from torch import nn


    class Wide(nn.Module):
        """Its forward raises: with out_width given nothing runs it at planning."""
        def __init__(self, in_features, hidden):
            super().__init__()
            self.up = nn.Linear(in_features, hidden)
            self.down = nn.Linear(hidden, 4)
            self.register_buffer("scale", torch.ones(hidden))

        def forward(self, x):
            raise RuntimeError("not at planning")
''')


def test_a_given_out_width_still_counts_the_modules_memory_in_the_plan(tmp_path):
    """A spec that gave `out_width` skipped the dry run, and with it the count of the module's
    parameters: the plan's memory held none of a module of millions of parameters."""
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.custom import resolve_custom
    from flowrec.spec import spec_from_dict

    (tmp_path / "wide.py").write_text(WIDE)
    hidden = random.randrange(1 << 16, 1 << 22)
    doc = yaml.safe_load(spec_file(tmp_path, f"{tmp_path / 'wide.py'}:Wide").read_text())
    doc["modules"][0].update(params={"in_features": 10, "hidden": hidden}, out_width=4)
    spec = resolve_custom(spec_from_dict(doc))
    mine = spec.modules[0]
    assert mine.param("param_bytes") == 4 * (10 * hidden + hidden + hidden * 4 + 4)
    assert mine.param("buffer_bytes") == 4 * hidden
    small = dict(doc, modules=[dict(doc["modules"][0], params={"in_features": 10, "hidden": 1}), doc["modules"][1]])
    planned = make_plan(spec, target="cpu").cost.peak_memory_bytes
    assert planned - make_plan(resolve_custom(spec_from_dict(small)), target="cpu").cost.peak_memory_bytes \
        >= 4 * 2 * 14 * (hidden - 1)  # parameters and their gradients at least
    given = dict(doc, modules=[dict(doc["modules"][0], param_bytes=12, buffer_bytes=8), doc["modules"][1]])
    assert resolve_custom(spec_from_dict(given)).modules[0].param("param_bytes") == 12  # a given count stays


def test_a_given_out_width_of_a_class_that_cannot_be_built_here_plans_with_a_note(tmp_path):
    """`out_width` is what plans a spec without its class (a laptop without the package): it still
    does, and says that the module's memory is not counted."""
    spec = spec_file(tmp_path, "flowrec_no_such_package.blocks:Wide")
    doc = yaml.safe_load(spec.read_text())
    doc["modules"][0]["out_width"] = random.randrange(1, 9)
    spec.write_text(yaml.safe_dump(doc))
    done = runner.invoke(app, ["plan", str(spec), "--json", str(tmp_path / "plan.json")])
    assert done.exit_code == 0, done.output
    (line,) = [line for line in done.output.splitlines() if line.startswith("note:")]
    assert "module 'mine': its parameters are not counted in the plan's memory" in line
    assert "flowrec_no_such_package" in line and "give param_bytes" in line


SHIFTY = textwrap.dedent('''
    import torch
    from torch import nn


    class Shifty(nn.Module):
        """Its width (or its rows) change from its third training call on: the build saw neither."""
        def __init__(self, in_features, change):
            super().__init__()
            self.proj = nn.Linear(in_features, 6)
            self.change = change
            self.calls = 0

        def forward(self, x):
            self.calls += self.training
            h = self.proj(x)
            if self.calls < 3:
                return h
            return h[:, :5] if self.change == "width" else h[:-1]
''')


@pytest.mark.parametrize("change", ["width", "rows"])
def test_a_module_whose_output_changes_shape_after_the_build_is_one_line_naming_it(tmp_path, change):
    """A forward returning 5 values per sample from its third training call on, where the build
    measured 6, failed in the next layer with a traceback (`mat1 and mat2 shapes cannot be
    multiplied`) and left a run folder without a checkpoint."""
    (tmp_path / "shifty.py").write_text(SHIFTY)
    spec = spec_file(tmp_path, f"{tmp_path / 'shifty.py'}:Shifty")
    doc = yaml.safe_load(spec.read_text())
    doc["modules"][0]["params"]["change"] = change
    spec.write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    done = train(str(spec), "--rows", str(random.randrange(300, 500)), "--out", str(run))
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output and not run.exists()
    (line,) = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert f"at step 3: custom module 'mine' ({tmp_path / 'shifty.py'}:Shifty) raised RuntimeError" in line, line
    assert ("5 values per sample where it returned 6" if change == "width" else "for 64 rows") in line, line


@pytest.mark.parametrize("where", ["import", "init", "step"])
def test_a_class_file_registering_a_hook_on_every_module_is_refused_and_the_hook_removed(tmp_path, where):
    """`torch.nn.modules.module.register_module_forward_hook` in a class file ran on flowrec's own
    modules too: a hook doubling every output trained a wrong model (logloss 6.9) with status 0."""
    from torch.nn.modules import module as torch_module

    path = tmp_path / f"hooker_{where}.py"
    path.write_text(textwrap.dedent(f'''
        import torch
        from torch import nn


        def double(module, args, out):
            return out * 2 if isinstance(out, torch.Tensor) else out


        if {where!r} == "import":
            torch.nn.modules.module.register_module_forward_hook(double)


        class Hooker(nn.Module):
            def __init__(self, in_features):
                super().__init__()
                self.proj = nn.Linear(in_features, 3)
                self.calls = 0
                if {where!r} == "init":
                    torch.nn.modules.module.register_module_forward_hook(double)

            def forward(self, x):
                self.calls += self.training
                if {where!r} == "step" and self.calls == 3:
                    torch.nn.modules.module.register_module_forward_hook(double)
                return self.proj(x)
    '''))
    before = dict(torch_module._global_forward_hooks)
    run = tmp_path / "run"
    try:
        done = train(str(spec_file(tmp_path, f"{path}:Hooker")), "--rows", str(random.randrange(300, 500)),
                     "--out", str(run))
        left = dict(torch_module._global_forward_hooks)
    finally:
        torch_module._global_forward_hooks.clear()
        torch_module._global_forward_hooks.update(before)
    assert left == before
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output and not run.exists()
    (line,) = [line for line in done.output.splitlines() if "registered a hook on every module" in line]
    assert f"{path}:Hooker" in line and ("at step 3" in line) == (where == "step"), line


def test_a_batch_size_that_gives_such_a_module_one_row_at_every_step_is_refused_before_anything_is_written(
        tmp_path, classes):
    """training.batch_size 1 with a batch-norm class skipped every batch: the run ended with status 0
    having trained nothing, said only in its closing warning."""
    spec = spec_file(tmp_path, f"{classes}:Normed")
    doc = yaml.safe_load(spec.read_text())
    doc["training"]["batch_size"] = 1
    spec.write_text(yaml.safe_dump(doc))
    run = tmp_path / "run"
    done = train(str(spec), "--rows", str(random.randrange(20, 60)), "--out", str(run))
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output and not run.exists()
    (line,) = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert f"custom module 'mine' ({classes}:Normed) cannot train on one row" in line, line
    assert "every batch gives it one row" in line and "training.batch_size at least 2" in line, line


NAN_ROWS = textwrap.dedent('''
    import torch
    from torch import nn


    class NanRows(nn.Module):
        """NaN on every `every`-th row from its third training call on."""
        def __init__(self, in_features, every):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)
            self.every = every
            self.calls = 0

        def forward(self, x):
            self.calls += self.training
            h = self.proj(x)
            if self.calls < 3:
                return h
            rows = torch.arange(len(x), device=x.device)[:, None] % self.every == 1
            return torch.where(rows, torch.full_like(h, float("nan")), h)
''')


def test_a_non_finite_loss_names_the_custom_module_that_returned_non_finite_rows(tmp_path):
    """A forward returning NaN on some rows stopped the run with `non-finite loss (nan) at step 3 in
    head ctr`: the head, not the module that made the NaN."""
    (tmp_path / "nanrows.py").write_text(NAN_ROWS)
    every = random.randrange(2, 20)
    spec = spec_file(tmp_path, f"{tmp_path / 'nanrows.py'}:NanRows")
    doc = yaml.safe_load(spec.read_text())
    doc["modules"][0]["params"]["every"] = every
    spec.write_text(yaml.safe_dump(doc))
    done = train(str(spec), "--rows", str(random.randrange(300, 500)), "--out", str(tmp_path / "run"))
    assert done.exit_code == 2, done.output
    (line,) = [line for line in done.output.splitlines() if line.startswith("error:")]
    bad = len(range(1, BATCH, every))
    assert "non-finite loss (nan) at step 3 in head ctr" in line, line
    assert f"(custom module 'mine' ({tmp_path / 'nanrows.py'}:NanRows) returned non-finite values for {bad} of " \
           f"{BATCH} rows)" in line, line


HEAVY = textwrap.dedent('''
    import torch
    from torch import nn


    class Heavy(nn.Module):
        """A buffer, and a forward that needs values: the meta dry run fails, the CPU one builds it."""
        def __init__(self, in_features, rows):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)
            self.register_buffer("table", torch.randn(rows, 16))

        def forward(self, x):
            if float(x.abs().sum()) >= 0:  # a tensor's value in Python
                return self.proj(x)
            return self.proj(x) * 2
''')


def test_a_dry_run_that_would_build_a_module_too_large_for_the_cpu_is_refused_in_one_line(tmp_path, monkeypatch):
    """A module whose forward needs values has its dry run on the CPU: a large buffer was allocated
    whatever the machine held, and the kernel killed `flowrec plan` without a word."""
    from operators import custom as custom_op
    from flowrec.runtime.custom import resolve_custom
    from flowrec.spec import spec_from_dict
    from flowrec.spec.errors import SpecError

    (tmp_path / "heavy.py").write_text(HEAVY)
    rows = random.randrange(1000, 5000)
    doc = yaml.safe_load(spec_file(tmp_path, f"{tmp_path / 'heavy.py'}:Heavy").read_text())
    doc["modules"][0]["params"]["rows"] = rows
    assert resolve_custom(spec_from_dict(doc)).modules[0].param("out_width") == 3  # room for it: as before
    monkeypatch.setattr(custom_op, "cpu_dry_run_room", lambda: 64 * rows - 1)  # less than its buffer
    with pytest.raises(SpecError) as err:
        resolve_custom(spec_from_dict(doc))
    (issue,) = err.value.issues
    assert issue.path == "modules[0].class" and "its forward fails on the meta device" in issue.message
    assert "give its out_width" in issue.message
    doc["modules"][0]["out_width"] = 3  # as the line says: it plans, and trains (the module built once)
    monkeypatch.setattr(custom_op, "probe_copy", lambda module: None)  # too large to copy for the width check
    spec = resolve_custom(spec_from_dict(doc))
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.lowering import lower

    model = lower(make_plan(spec, target="cpu"), spec, "cpu")
    assert model.ops["mine"](torch.randn(4, 10)).shape == (4, 3)


def test_a_ranks_share_of_one_row_skips_that_step_on_every_rank(tmp_path, classes):
    """Under --nproc 2 a last global batch of 3 rows gives one rank 1 row: that rank's forward
    raised while the other waited in the step's collectives."""
    import sys

    spec = spec_file(tmp_path, f"{classes}:Normed")
    rows = BATCH * random.randrange(2, 4) + 3
    run = tmp_path / "run"
    done = run_bounded([sys.executable, "-m", "flowrec", "train", str(spec), "--rows", str(rows), "--out", str(run),
                        "-q", "--device", "cpu", "--nproc", "2"], capture_output=True, text=True, timeout_s=600)
    assert done.returncode == 0, (done.stdout, done.stderr)
    lines = [line for line in done.stderr.splitlines() if "cannot train on one row" in line]
    assert len(lines) == 1 and f"3 of {rows:,} rows were skipped" in lines[0], done.stderr
    assert end_record(run)["skipped_rows"] == 3


LATE_EXIT = textwrap.dedent('''
    import sys
    from torch import nn


    class LateExit(nn.Module):
        """Its state_dict ends the process from its second call: the build's round trip passes."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)
            self.saves = 0

        def forward(self, x):
            return self.proj(x)

        def state_dict(self, *args, **kwargs):
            self.saves += 1
            if self.saves > 1:
                sys.exit(0)
            return super().state_dict(*args, **kwargs)
''')


def test_a_state_dict_ending_the_process_at_a_checkpoint_is_one_line_and_a_failure(tmp_path):
    """sys.exit(0) in a class's state_dict at the run's checkpoint ended `flowrec train` with status
    0, no checkpoint and no word."""
    (tmp_path / "late.py").write_text(LATE_EXIT)
    run = tmp_path / "run"
    done = train(str(spec_file(tmp_path, f"{tmp_path / 'late.py'}:LateExit")), "--rows",
                 str(random.randrange(300, 500)), "--out", str(run))
    assert done.exit_code == 2, done.output
    assert "Traceback" not in done.output and not run.exists()
    (line,) = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert f"custom module 'mine' ({tmp_path / 'late.py'}:LateExit): its state_dict() tried to end the process: " \
           "sys.exit(0)" in line and "no checkpoint was written" in line, line


LOAD_EXIT = textwrap.dedent('''
    import os
    import sys
    import torch
    from torch import nn


    class Leaver(nn.Module):
        """Its state counts training calls; loading a trained one (count > 0) ends the process in
        set_extra_state or in _load_from_state_dict (LEAVE_IN names which) when LEAVE_ON_LOAD is set:
        the build's own round trip of an untrained one loads."""
        def __init__(self, in_features):
            super().__init__()
            self.proj = nn.Linear(in_features, 3)
            self.seen = 0

        def forward(self, x):
            if self.training:
                self.seen += 1
            return self.proj(x)

        def get_extra_state(self):
            return torch.tensor([float(self.seen)])

        def set_extra_state(self, state):
            if os.environ.get("LEAVE_IN") == "set_extra_state":
                self._leave(state)
            self.seen = int(state[0])

        def _load_from_state_dict(self, state_dict, prefix, *args):
            if os.environ.get("LEAVE_IN") == "_load_from_state_dict":
                self._leave(state_dict[prefix + "_extra_state"])
            super()._load_from_state_dict(state_dict, prefix, *args)

        def _leave(self, state):
            if os.environ.get("LEAVE_ON_LOAD") and float(state[0]) > 0:
                sys.exit(int(os.environ["LEAVE_ON_LOAD"]))
''')


@pytest.fixture(scope="module")
def leaver_run(tmp_path_factory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("leaver")
    path = root / "leaver.py"
    path.write_text(LOAD_EXIT)
    spec = spec_file(root, f"{path}:Leaver")
    done = train(str(spec), "--rows", str(random.randrange(200, 400)), "--out", str(root / "run"))
    assert done.exit_code == 0, done.output
    return spec, root / "run", path


@pytest.mark.parametrize("command", ["eval", "export", "resume", "init_from"])
def test_a_load_that_ends_the_process_is_one_line_naming_the_class_and_a_failure(leaver_run, tmp_path, monkeypatch,
                                                                                 command):
    """set_extra_state or _load_from_state_dict calling sys.exit(0) on --resume, eval, export or
    --init-from ended flowrec with status 0 and no word (only the save path was guarded)."""
    spec, run, path = leaver_run
    method = random.choice(["set_extra_state", "_load_from_state_dict"])
    status = random.choice([0, 0, 3])
    monkeypatch.setenv("LEAVE_IN", method)
    monkeypatch.setenv("LEAVE_ON_LOAD", str(status))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    args = {"eval": ["eval", str(run), "--device", "cpu"],
            "export": ["export", str(run), str(tmp_path / "pkg")],
            "resume": ["train", str(spec), "--resume", str(run), "--epochs", "3", "-q", "--device", "cpu"],
            "init_from": ["train", str(spec), "--init-from", str(run), "--out", str(tmp_path / "child"),
                          "--rows", "200", "-q", "--device", "cpu"]}[command]
    done = runner.invoke(app, args)
    assert done.exit_code == 2, done.output
    lines = [line for line in done.output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and f"{path}:Leaver" in lines[0] and "tried to end the process" in lines[0], done.output
    assert f"its {method}()" in lines[0] and f"sys.exit({status})" in lines[0], lines[0]
    assert "Traceback" not in done.output
    assert not (tmp_path / "pkg").exists() and not (tmp_path / "child").exists()
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before  # the run as it was
