"""docs/python.md runs as written (its Python blocks in order, in a fresh folder), and the API's
callbacks and errors behave as documented."""
from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import flowrec
from flowrec.runtime.rundir import RunFolderError
from flowrec.testing.processes import run_bounded

DOC = Path(__file__).resolve().parents[2] / "docs" / "python.md"


def test_the_documented_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert len(blocks) == 3
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(DOC.parents[1]), os.environ.get("PYTHONPATH", "")]))
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)  # noqa: S102 - the documentation's own code
    assert "step 10: auc" in capsys.readouterr().out
    assert (tmp_path / "runs" / "tiny" / "checkpoint.pt").is_file()


def test_a_run_folder_with_a_run_needs_overwrite(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    # (no eval_every=0: the spec stops early, which needs evaluations during training, as in `flowrec train`)
    run = flowrec.train(spec, out=tmp_path / "run", rows=1000, max_steps=2)
    assert run.result.steps == 2 and run.metrics["click"]["samples"] == 200
    with pytest.raises(RunFolderError, match="already holds a run"):
        flowrec.train(spec, out=tmp_path / "run", rows=1000, max_steps=2)
    seen = []
    again = flowrec.train(spec, out=tmp_path / "run", overwrite=True, rows=1000, max_steps=3,
                          on_checkpoint=lambda e: seen.append((e.step, e.path.name)))
    assert again.result.steps == 3 and seen[-1] == (3, "checkpoint.pt")


def test_lifecycle_errors_keep_their_documented_types(tmp_path: Path) -> None:
    """`flowrec.train` raises the lower layer's error (DataError) and a RunError (a ValueError) for a
    device or budget it cannot use; nothing is written."""
    from flowrec.data.layout import DataError
    from flowrec.runs.errors import RunError

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    with pytest.raises(DataError, match="not found"):
        flowrec.train(spec, data=tmp_path / "missing", out=tmp_path / "run", max_steps=1)
    with pytest.raises(RunError, match="byte size"):
        flowrec.train(spec, device_budget="lots", out=tmp_path / "run", rows=500, max_steps=1)
    assert not (tmp_path / "run" / "checkpoint.pt").exists() and not (tmp_path / "run" / "run.json").exists()


def test_load_and_evaluate_refuse_an_argument_of_the_wrong_kind(tmp_path: Path) -> None:
    """`flowrec.load(run, device="tpu")` was torch's RuntimeError naming the CLI's --device,
    `run.evaluate(5)` and `flowrec.load(3)` Python's TypeError; now each is a RunError naming it."""
    from flowrec.runs.errors import RunError

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    flowrec.train(spec, out=tmp_path / "run", rows=500, max_steps=2)
    for call, says in ((lambda: flowrec.load(tmp_path / "run", device="tpu"), "device must be auto, cpu or cuda"),
                       (lambda: flowrec.load(3), "run_dir must be a run folder or checkpoint path"),
                       (lambda: flowrec.load(tmp_path / "run").evaluate(5), "data must be a dataset folder path"),
                       (lambda: flowrec.load(tmp_path / "run").evaluate(None, group_by=1), "group_by must be")):
        with pytest.raises(RunError, match=says):
            call()


def test_cache_data_is_a_run_setting_of_the_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`cache_data=` is `flowrec train --cache-data`: checked before anything is written, recorded
    in run.json (so `--resume` keeps it), and on a Parquet dataset a run that keeps its rows trains
    bitwise the steps of one that reads every epoch."""
    import json

    from typer.testing import CliRunner

    from flowrec.cli import app
    from flowrec.data.rowcache import RowCache
    from flowrec.runs.errors import RunError

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    with pytest.raises(RunError, match="cache_data must be auto, on, off or a byte size"):
        flowrec.train(spec, cache_data="sometimes", out=tmp_path / "bad", rows=500, max_steps=1)
    assert not (tmp_path / "bad").exists()
    for name, rows, seed in (("d", "700", "1"), ("e", "300", "2")):
        made = CliRunner().invoke(app, ["data", "synth", str(spec), "--rows", rows, "--seed", seed,
                                        "--out", str(tmp_path / name)])
        assert made.exit_code == 0, made.output
    fills: list[str] = []
    fill = RowCache.fill
    monkeypatch.setattr(RowCache, "fill", lambda self, *a, **k: fills.append(mode) or fill(self, *a, **k))
    runs = {}
    for mode in ("on", "off"):
        runs[mode] = flowrec.train(spec, data=tmp_path / "d", eval_data=tmp_path / "e", cache_data=mode, out=tmp_path / mode, epochs=3, seed=3)
        assert json.loads((tmp_path / mode / "run.json").read_text())["cache_data"] == mode
    assert "on" in fills and "off" not in fills  # the rows were kept only when asked
    losses = {mode: [r["loss"] for r in run.history if r.get("event") == "train"] for mode, run in runs.items()}
    assert len(losses["on"]) > 2 and losses["on"] == losses["off"]


def test_numpy_integers_are_whole_numbers_to_train(tmp_path: Path) -> None:
    """A notebook's counts are numpy integers (`len` of an array's slice, `np.int64(...)`):
    `flowrec.train(max_steps=np.int64(2))` was refused with 'max_steps must be a non-negative
    integer, not np.int64(2)'; now they train as Python ints and run.json records them."""
    import json

    import numpy as np

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    run = flowrec.train(spec, out=tmp_path / "run", rows=np.int64(500), max_steps=np.int64(2), epochs=np.int32(1),
                        seed=np.uint8(3), eval_every=np.int64(1), checkpoint_every=np.int16(0))
    assert run.result.steps == 2
    recorded = json.loads((tmp_path / "run" / "run.json").read_text())
    assert (recorded["rows"], recorded["max_steps"], recorded["epochs"], recorded["seed"]) == (500, 2, 1, 3)


def test_a_callback_returning_numpys_true_stops_the_run(tmp_path: Path) -> None:
    """`return np.mean(losses[-3:]) < 10` gives np.True_, not True: the run trained on to its end as if
    the callback had said nothing; now numpy's True stops it as True does (its False does not)."""
    import numpy as np

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    losses: list[float] = []

    def on_step(event: flowrec.StepEvent):
        losses.append(event.loss)
        return np.mean(losses[-3:]) < 10 if event.step >= 2 else np.False_

    run = flowrec.train(spec, out=None, rows=1000, max_steps=6, on_step=on_step)
    assert run.result.steps == 2 and run.result.stop_requested and len(losses) == 2


def test_a_run_shows_in_one_short_line(tmp_path: Path) -> None:
    """A notebook cell ending in `run` (or `flowrec.load(...)`) printed the dataclass's repr: the whole
    spec and training result, thousands of characters; now one line with the spec's name, folder,
    steps and final metrics."""
    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    run = flowrec.train(spec, out=tmp_path / "run", rows=500, max_steps=2)
    shown = repr(run)
    folder = repr(str(tmp_path / "run"))  # as long as the temporary folder is: not the repr's own length
    assert "\n" not in shown and len(shown) - len(folder) < 240, shown
    assert re.fullmatch(rf"Run\('tiny', run_dir={re.escape(repr(str(tmp_path / 'run')))}, steps=2, "
                        r"metrics=\{'click': \{'auc': 0\.\d{1,4}, .*'samples': 100\}\}\)", shown), shown
    assert repr(flowrec.load(tmp_path / "run")) == f"Run('tiny', run_dir={str(tmp_path / 'run')!r}, step=2)"
    # RUN/best or a checkpoint file showed as run_dir='RUN', as if the run's last checkpoint were loaded
    file = flowrec.load(tmp_path / "run" / "checkpoint.pt")
    assert file.loaded == tmp_path / "run" / "checkpoint.pt" and file.run_dir == tmp_path / "run"
    assert f"loaded={str(tmp_path / 'run' / 'checkpoint.pt')!r}" in repr(file), repr(file)


def test_ctrl_c_saves_a_checkpoint_then_stops_the_caller(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C (a notebook's interrupt) or SIGTERM in `flowrec.train` checkpointed and returned as if
    the run had ended: a loop of runs went on to the next and a cell's next lines ran. Now, once the
    checkpoint is saved, it raises KeyboardInterrupt saying how to load and continue the run."""
    import signal

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    monkeypatch.chdir(tmp_path)

    def on_step(event: flowrec.StepEvent) -> None:
        if event.step == 2:
            os.kill(os.getpid(), signal.SIGINT)

    started = []
    with pytest.raises(KeyboardInterrupt) as caught:
        for seed in (1, 2):  # a sweep: Ctrl-C ends it, not only its first run
            started.append(seed)
            flowrec.train("s.yaml", out=f"run{seed}", rows=1000, max_steps=6, seed=seed, on_step=on_step)
    assert started == [1]
    assert str(caught.value) == ("training interrupted after step 2; its checkpoint is in run1: flowrec.load('run1') "
                                 "scores it, `flowrec.train('s.yaml', resume='run1')` continues it")
    assert repr(flowrec.load("run1")) == "Run('tiny', run_dir='run1', step=2)"


def test_paths_under_the_home_folder_are_expanded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`flowrec.train("~/s.yaml", out="~/runs/a")` read the spec from ./~ and would have made a folder
    named '~' in the working folder (pandas expands '~', the shell does it for the CLI); now the
    API's paths are expanded as pandas' are, and run.json records the data there."""
    import json
    import sys

    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / "s.yaml").write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    run_bounded([sys.executable, "-m", "flowrec", "data", "synth", str(home / "s.yaml"), "--rows", "300", "--out",
                 str(home / "d"), "-q"], check=True, timeout_s=300)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    run = flowrec.train("~/s.yaml", data="~/d", eval_data="~/d", out="~/runs/a", max_steps=1)
    assert (home / "runs" / "a" / "checkpoint.pt").is_file() and not any(work.iterdir())
    assert json.loads((home / "runs" / "a" / "run.json").read_text())["data"] == str(home / "d")
    assert flowrec.load("~/runs/a").evaluate("~/d")["click"]["samples"] == run.metrics["click"]["samples"] == 300


def test_a_trained_run_scores_only_data_of_its_encoder_as_a_loaded_one(tmp_path: Path) -> None:
    """The Run `flowrec.train` returned evaluated data of another encoder without a word (wrong
    metrics: its ids mean other rows), where `flowrec.load(RUN).evaluate` refuses it, and
    `flowrec.train(out=None)` trained with such `eval_data` unchecked; now both are its DataError."""
    import sys

    from flowrec.data.layout import DataError

    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])
    (tmp_path / "raw.csv").write_text("price,user_id,item_id,label\n" + "".join(
        f"{i % 13}.5,u{i % 7},i{i % 11},{i % 2}\n" for i in range(300)))
    for args in (["data", "synth", str(spec), "--rows", "300", "--out", str(tmp_path / "synth")],
                 ["data", "convert", "csv", str(tmp_path / "raw.csv"), str(tmp_path / "raw"), "--spec", str(spec)]):
        run_bounded([sys.executable, "-m", "flowrec", *args, "-q"], check=True, timeout_s=300)
    for out in (tmp_path / "run", None):
        run = flowrec.train(spec, rows=500, max_steps=2, out=out)
        assert run.evaluate(tmp_path / "synth")["click"]["samples"] == 300  # synthetic rows: its own kind
        with pytest.raises(DataError, match="trained on synthetic rows"):
            run.evaluate(tmp_path / "raw")
    with pytest.raises(DataError, match="raw was encoded with another encoder|trained on synthetic rows"):
        flowrec.train(spec, data=tmp_path / "synth", eval_data=tmp_path / "raw", max_steps=2, out=None)


def test_a_callback_changing_its_events_metrics_changes_nothing_of_the_run(tmp_path: Path) -> None:
    """EvalEvent is frozen, but its metrics were the trainer's own dict: an on_eval that rounded or
    popped them changed run.metrics and the final record of metrics.jsonl; now it gets a copy."""
    spec = tmp_path / "s.yaml"
    spec.write_text((DOC.read_text().split('Path("tiny.yaml").write_text("""')[1]).split('""")')[0])

    def on_eval(event) -> None:
        event.metrics["click"].pop("samples")
        event.metrics["click"]["auc"] = -1.0

    run = flowrec.train(spec, out=tmp_path / "run", rows=500, max_steps=2, eval_every=2, on_eval=on_eval)
    evals = [r for r in run.history if r["event"] == "eval"]
    assert [r["final"] for r in evals] == [False, True]
    for metrics in (run.metrics, *(r["metrics"] for r in evals)):
        assert metrics["click"]["samples"] == 100 and 0 <= metrics["click"]["auc"] <= 1, metrics
