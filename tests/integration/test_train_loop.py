"""The training loop on MovieLens-100k: a run with a learning-rate schedule, gradient clipping and
early stopping stops early, keeps best/, logs the learning rates and the evaluation metrics (also to
TensorBoard), and a run cut short and resumed ends bitwise equal to an uninterrupted one;
`flowrec eval --group-by` gives gAUC equal to pandas + scikit-learn on the same predictions."""
from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.runtime.run_log import read_records

runner = CliRunner()
HEAD = "rating_ge_4"
REPO = Path(__file__).resolve().parents[2]
SHARED_DATA = Path(os.environ.get("FLOWREC_SHARED_DATA", REPO.parent / "shared" / "data"))  # as conftest


def _spec(shared_data: Path, folder: Path) -> Path:
    doc = yaml.safe_load((REPO / "specs" / "movielens.yaml").read_text())
    doc["data"]["path"] = str(shared_data / "movielens-100k")
    doc["optimizer"] = {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adam", "lr": 0.02}}
    doc["training"].update({
        "epochs": 20, "eval_every": 20, "eval_group_by": "user_id", "clip_grad_norm": 1.0,
        "schedule": {"warmup_steps": 10, "decay": "linear", "min_lr_ratio": 0.1},
        "early_stopping": {"metric": "auc", "patience": 1, "min_delta": 0.0005},
    })
    path = folder / "movielens_loop.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def _train(*args: str):
    result = runner.invoke(app, ["train", *args, "--quiet"])
    assert result.exit_code == 0, result.output
    return result


@pytest.fixture(scope="module")
def full_run(tmp_path_factory) -> tuple[Path, Path, str]:
    if not (SHARED_DATA / "movielens-100k").is_dir():
        pytest.skip(f"MovieLens-100k not found in {SHARED_DATA} (set FLOWREC_SHARED_DATA)")
    root = tmp_path_factory.mktemp("loop")
    spec = _spec(SHARED_DATA, root)
    result = _train(str(spec), "--out", str(root / "full"))
    return spec, root / "full", result.output


def test_early_stopping_stops_and_keeps_best(full_run):
    spec, run, output = full_run
    records = read_records(run / "metrics.jsonl")
    evals = [r for r in records if r["event"] == "eval" and not r["final"]]
    end = next(r for r in records if r["event"] == "end")
    steps_per_epoch = math.ceil(80_000 / 1024)  # MovieLens-100k, 80/20 split (19,877 test rows)
    assert end["stopped_early"] and end["step"] < 20 * steps_per_epoch
    assert evals[-1]["stop"] and not evals[-1]["best"] and evals[-1]["step"] == end["step"]
    best = [r for r in evals if r["best"]][-1]  # an evaluation within min_delta of it is no new best
    assert end["best_step"] == best["step"] < end["step"]
    running = None  # the rule replayed: a new best exceeds the last best by more than min_delta (0.0005)
    for r in evals:
        auc = r["metrics"][HEAD]["auc"]
        assert r["best"] == (running is None or auc > running + 0.0005), (r["step"], auc, running)
        running = auc if r["best"] else running
    assert max(r["metrics"][HEAD]["auc"] for r in evals) <= best["metrics"][HEAD]["auc"] + 0.0005
    kept = load_checkpoint(run / "best" / "checkpoint.pt")
    assert kept["position"]["step"] == best["step"]
    assert "stopped early" in output and "new best: saved to best/" not in output  # --quiet: final table only
    rescored = runner.invoke(app, ["eval", str(run / "best"), "--data", str(run / "data" / "test"), "--json", "-"])
    assert rescored.exit_code == 0, rescored.output
    assert json.loads(rescored.stdout)[HEAD]["auc"] == pytest.approx(best["metrics"][HEAD]["auc"], abs=1e-12)


def test_best_is_exported_evaluated_loaded_and_started_from_as_its_runs_model(full_run, tmp_path: Path):
    """RUN/best goes with its run's encoder, data and metrics: `export RUN/best` wrote no package
    (no encoder in best/), `eval RUN/best` scored data of another encoder without a word, and
    `flowrec.load(RUN/best).metrics` was empty; --init-from RUN/best was refused."""
    import flowrec

    spec, run, _ = full_run
    records = read_records(run / "metrics.jsonl")
    best = [r for r in records if r["event"] == "eval" and r.get("best")][-1]
    exported = runner.invoke(app, ["export", str(run / "best"), str(tmp_path / "pkg")])
    assert exported.exit_code == 0, exported.output
    manifest = json.loads((tmp_path / "pkg" / "manifest.json").read_text())
    encoder = json.loads((run / "encoder" / "encoder.json").read_text())
    assert manifest["encoder_fingerprint"] == encoder["fingerprint"]
    assert manifest["metrics_at_export"] == best["metrics"]  # not the last evaluation's
    other = runner.invoke(app, ["data", "synth", str(spec), "--rows", "300", "--out", str(tmp_path / "other"), "-q"])
    assert other.exit_code == 0, other.output
    for scored in (run, run / "best", run / "best" / "checkpoint.pt"):
        refused = runner.invoke(app, ["eval", str(scored), "--data", str(tmp_path / "other"), "--json", "-"])
        assert refused.exit_code == 2 and "another encoder" in refused.output, (scored, refused.output)
    loaded = flowrec.load(run / "best")
    assert loaded.run_dir == run and loaded.metrics == best["metrics"] and len(loaded.history) == len(records)
    started = runner.invoke(app, ["train", str(spec), "--init-from", str(run / "best"), "--data", str(run / "data"),
                                  "--out", str(tmp_path / "next"), "--max-steps", "1", "--quiet"])
    assert started.exit_code == 0, started.output


def test_a_run_folder_named_best_is_its_own_run(full_run, tmp_path: Path):
    """`--out runs/best` is a run folder like any other: `flowrec eval runs/best` scores the data it
    recorded (it was read as the best checkpoint of a run in runs/, which recorded none)."""
    _, run, _ = full_run
    own = tmp_path / "best"
    shutil.copytree(run, own, ignore=shutil.ignore_patterns(".flowrec.lock", "tensorboard"))
    scored = runner.invoke(app, ["eval", str(own), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    final = [r for r in read_records(run / "metrics.jsonl") if r["event"] == "eval"][-1]
    assert json.loads(scored.stdout)[HEAD]["auc"] == pytest.approx(final["metrics"][HEAD]["auc"], abs=1e-12)


def test_schedule_learning_rates_are_logged(full_run):
    _, run, _ = full_run
    steps = {r["step"]: r for r in read_records(run / "metrics.jsonl") if r["event"] == "train"}
    horizon = 20 * math.ceil(80_000 / 1024) - 10  # linear decay over the spec's epochs after warmup
    for step, record in steps.items():
        k = step - 1  # the 0-based step the rate was set for
        factor = (k + 1) / 10 if k < 10 else 0.1 + 0.9 * (1 - (k - 10) / horizon)
        assert record["lr_dense"] == pytest.approx(0.01 * factor, rel=1e-12)
        assert record["lr_sparse"] == pytest.approx(0.02 * factor, rel=1e-12)


def test_cut_and_resumed_run_ends_bitwise_equal(full_run, tmp_path: Path):
    spec, full, _ = full_run
    cut = tmp_path / "cut"
    data = str(full / "data")
    _train(str(spec), "--data", data, "--out", str(cut), "--max-steps", "50")  # between evaluations
    _train(str(spec), "--resume", str(cut), "--max-steps", "100000")
    for name in ("checkpoint.pt", "best/checkpoint.pt"):
        a, b = load_checkpoint(full / name), load_checkpoint(cut / name)
        assert a["position"] == b["position"] and a["early_stopping"] == b["early_stopping"]
        assert all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]), name


def test_eval_group_by_matches_pandas_and_sklearn(full_run, tmp_path: Path):
    pd = pytest.importorskip("pandas")
    sk = pytest.importorskip("sklearn.metrics")
    import pyarrow.parquet as pq

    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.evaluation.evaluate import predict
    from flowrec.serving.trained import load_trained
    from flowrec.runtime.session import open_dataset

    _, run, _ = full_run
    test = run / "data" / "test"
    out = tmp_path / "m.json"
    scored = runner.invoke(app, ["eval", str(run), "--data", str(test), "--group-by", "user_id", "--json", str(out)])
    assert scored.exit_code == 0, scored.output
    assert "gauc" in scored.stdout  # the table
    metrics = json.loads(out.read_text())[HEAD]

    trained = load_trained(run, "cpu", scoring_plan)
    source = open_dataset(test, trained.spec)
    opts = StagingOptions(batch_size=1024, shuffle=False, lookahead=0)
    with iterate_batches(trained.spec, source, opts, 0, 0, trained.model.groups) as batches:
        preds, labels = predict(trained.model, batches)
    users = pq.read_table(test, columns=["user_id"]).column("user_id").to_numpy()
    frame = pd.DataFrame({"y": labels[:, 0].astype(np.float64), "p": preds[:, 0].astype(np.float64), "u": users})
    per_user = [(len(g), sk.roc_auc_score(g["y"], g["p"])) for _, g in frame.groupby("u") if g["y"].nunique() == 2]
    expected = sum(n * a for n, a in per_user) / sum(n for n, _ in per_user)
    assert metrics["gauc"] == pytest.approx(expected, abs=1e-9)
    rate = frame["y"].mean()
    entropy = -(rate * np.log(rate) + (1 - rate) * np.log(1 - rate))
    assert metrics["ne"] == pytest.approx(sk.log_loss(frame["y"], frame["p"]) / entropy, abs=1e-9)
    assert metrics["ne"] == pytest.approx(metrics["logloss"] / entropy, abs=1e-12)
    assert metrics["auc"] == pytest.approx(sk.roc_auc_score(frame["y"], frame["p"]), abs=1e-9)


def test_tensorboard_event_file_holds_the_scalars(full_run):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, run, _ = full_run
    (events,) = (run / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(events))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {f"eval/{HEAD}/auc", f"eval/{HEAD}/gauc", "train/loss", "train/lr_dense", "train/lr_sparse",
            "throughput/samples_per_s"} <= tags
    auc = {e.step: e.value for e in acc.Scalars(f"eval/{HEAD}/auc")}
    logged = {r["step"]: r["metrics"][HEAD]["auc"] for r in read_records(run / "metrics.jsonl") if r["event"] == "eval"}
    assert auc.keys() == logged.keys() and all(auc[s] == pytest.approx(logged[s], rel=1e-6) for s in auc)
