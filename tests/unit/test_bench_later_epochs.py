"""tools/bench_later_epochs.py: a run's steps split into its first and later epochs; an epoch's
batches sized from the live step within bounds; whether a spec's rows are kept is the library's
own answer on real data (one id per field: kept; a sequence: streamed); bad arguments fail with a
message before any calibration; a real run times every epoch of both runs."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_later_epochs", REPO / "tools" / "bench_later_epochs.py")
later = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(later)


def test_a_runs_steps_split_by_the_epoch_each_logged(tmp_path: Path):
    """Epochs of uneven steps (FAE's hot and cold batches): the split follows the log, not a count."""
    rng = random.Random(3)
    for _ in range(20):
        epochs = [e for e in range(rng.randint(2, 5)) for _ in range(rng.randint(1, 9))]
        rounds = [later.robust.Round(rng.uniform(1.0, 9.0)) for _ in epochs]
        metrics = tmp_path / "metrics.jsonl"
        records = [{"event": "train", "step": k + 1, "epoch": e, "loss": 0.5} for k, e in enumerate(epochs)]
        records.insert(rng.randint(0, len(records)), {"event": "eval", "step": 3, "epoch": 0, "auc": 0.7})
        metrics.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        assert later.step_epochs(metrics) == epochs
        first, rest = later.epoch_rounds(rounds, epochs)
        assert first == rounds[:epochs.count(0)] and rest == rounds[epochs.count(0):]
    with pytest.raises(ValueError):
        later.epoch_rounds([later.robust.Round(1.0)], [0, 1])


def test_an_epoch_holds_about_the_seconds_asked_within_its_bounds():
    rng = random.Random(5)
    for _ in range(50):
        live_ms, seconds = rng.uniform(0.5, 900.0), rng.uniform(0.1, 5.0)
        least = rng.randint(1, 20)
        most = least + rng.randint(0, 400)
        got = later.epoch_batches_for(live_ms, seconds, least, most)
        assert least <= got <= most
        if least < got < most:  # not at a bound: just enough steps for the seconds
            assert (got - 1) * live_ms < seconds * 1e3 <= got * live_ms
    assert later.epoch_batches_for(0.0, 2.0, 7, 50) == 7


def test_the_error_is_the_prediction_over_the_measurement():
    rng = random.Random(11)
    measured = rng.uniform(1.0, 50.0)
    predicted = measured * rng.uniform(0.5, 1.5)
    assert later.error(predicted, measured) == pytest.approx(predicted / measured - 1.0)
    assert later.error(None, measured) is None


@pytest.mark.parametrize("name, kept", [("custom_module.yaml", True), ("movielens.yaml", False)])
def test_whether_rows_are_kept_is_the_pipelines_own_answer(name: str, kept: bool, tmp_path: Path):
    """custom_module's fields are one id each: its rows are kept after an epoch; movielens has a
    genre list: every epoch streams."""
    from flowrec.data.synth import synth_dataset
    from flowrec.spec import load_spec

    model = load_spec(REPO / "specs" / name)
    synth_dataset(model, tmp_path / "data", model.training.batch_size * 3)
    assert later.rows_kept(model, tmp_path / "data") is kept


@pytest.mark.parametrize("args, words", [(["--epochs", "1"], "at least 2"),
                                         (["--specs", "nope.yaml"], "nope.yaml"),
                                         (["--device-budget", "lots"], "--device-budget"),
                                         (["--min-batches", "0"], "at least 1"),
                                         (["--min-batches", "9", "--max-batches", "3"], "--max-batches"),
                                         (["--epoch-seconds", "0"], "positive"),
                                         (["--specs", "movielens.yaml", "--json",
                                           str(REPO / "specs" / "movielens.yaml")], "one of the specs"),
                                         (["--json", str(REPO / "specs")], "is a folder")])
def test_bad_arguments_fail_with_a_message(args, words, capsys, tmp_path: Path):
    out = tmp_path / "r.json"
    spec_text = (REPO / "specs" / "movielens.yaml").read_text(encoding="utf-8")
    with pytest.raises(SystemExit) as exc:
        later.main([*args, *([] if "--json" in args else ["--json", str(out)])])
    assert exc.value.code == 2 and words in capsys.readouterr().err
    assert not out.exists()
    assert (REPO / "specs" / "movielens.yaml").read_text(encoding="utf-8") == spec_text


def test_a_real_run_times_every_epoch_of_both_runs(tmp_path: Path):
    """custom_module (rows kept), two epochs of four batches each: both runs made eight steps, and
    each epoch kind's step and error is a real, positive measurement against the plan's step."""
    out = tmp_path / "epochs.json"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = run_bounded([sys.executable, str(REPO / "tools" / "bench_later_epochs.py"),
                        "--specs", "custom_module.yaml", "--epochs", "2", "--min-batches", "4",
                        "--max-batches", "4", "--json", str(out)],
                       capture_output=True, text=True, timeout_s=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (row,) = doc["rows"]
    assert row["spec"] == "custom_module.yaml" and row["rows_kept"] is True and row["epoch_batches"] == 4
    assert sorted(row["runs"]) == ["off", "on"] and doc["specs_failed"] == []
    for mode, run in row["runs"].items():
        assert run["steps"] == 8 and run["steps_by_epoch"] == [4, 4] and len(run["by_epoch_ms"]) == 2
        assert run["first_epoch_ms"] > 0.1 and run["later_epochs_ms"] > 0.1
        assert row[f"later_epochs_error_{mode}"] == pytest.approx(row["predicted_step_ms"] / run["later_epochs_ms"] - 1)
    assert row["predicted_step_ms"] > 0.1
    assert "worst_later_epochs_error_on" in proc.stdout
