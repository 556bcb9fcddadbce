"""`flowrec train` / `eval` / `export` end to end on small specs: learning, determinism, exact
resume (also after Ctrl-C), evaluation of checkpoints, serving export, and clear errors."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.graph.plan_io import plan_json
from flowrec.planner.manager import make_plan
from flowrec.runtime.checkpoint.store import load_checkpoint
from flowrec.runtime.session import SessionOptions, prepare
from flowrec.runtime.trainer import TrainConfig, Trainer
from flowrec.spec import load_spec

SPEC = """
name: tiny_ctr
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: d2, type: dense, transform: none}
  - {name: user, type: categorical, hash_buckets: 500, dim: 8}
  - {name: item, type: categorical, table: items}
  - {name: cat, type: categorical, vocab: 40, dim: 8}
  - {name: hist, type: sequence, table: items, max_len: 5, pooling: mean}
  - {name: wide_user, type: categorical, hash_buckets: 300, dim: 1, tags: [wide]}
tables:
  - {name: items, hash_buckets: 2000, dim: 8}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense"], layers: [16, 8]}
  - {name: interact, kind: dot, inputs: [bottom, user, item, cat, hist]}
  - {name: wide, kind: linear, inputs: ["@wide"]}
  - {name: top, kind: mlp, inputs: [interact, bottom, wide], layers: [16]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 256, epochs: 2, seed: 3}
"""

runner = CliRunner()


@pytest.fixture
def spec_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(SPEC)
    return path


def _train(spec_file: Path, out: Path, *args: str):
    return runner.invoke(app, ["train", str(spec_file), "--rows", "6000", "--out", str(out), "--quiet", *args])


def _params(run: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint(run)["model"]


def test_train_learns_and_writes_a_complete_run(spec_file: Path, tmp_path: Path):
    result = _train(spec_file, tmp_path / "run", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    assert report["steps"] == 2 * 24  # 6000 rows / 256 = 24 batches (last one partial), 2 epochs
    assert report["eval"]["ctr"]["auc"] > 0.6
    run = tmp_path / "run"
    for name in ("checkpoint.pt", "metrics.jsonl", "plan.json", "spec.json", "run.json"):
        assert (run / name).is_file(), name
    events = [json.loads(line)["event"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert events.count("train") == 48 and events[-2:] == ["eval", "end"]
    state = load_checkpoint(run)
    assert state["position"] == {"epoch": 2, "batch": 0, "step": 48, "samples": 12000}
    assert {"embeddings.g0_d1.weight", "embeddings.g1_d8.state"} <= set(state["model"])


def test_same_run_twice_gives_identical_parameters_and_metrics(spec_file: Path, tmp_path: Path):
    outs = []
    for name in ("a", "b"):
        result = _train(spec_file, tmp_path / name, "--json")
        assert result.exit_code == 0, result.output
        outs.append(json.loads(result.stdout[result.stdout.index("{"):])["eval"])
    assert outs[0] == outs[1]
    a, b = _params(tmp_path / "a"), _params(tmp_path / "b")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_resume_after_max_steps_ends_with_the_uninterrupted_parameters(spec_file: Path, tmp_path: Path):
    assert _train(spec_file, tmp_path / "full").exit_code == 0
    first = _train(spec_file, tmp_path / "part", "--max-steps", "29")  # stops mid-epoch 2
    assert first.exit_code == 0, first.output
    assert load_checkpoint(tmp_path / "part")["position"]["step"] == 29
    again = runner.invoke(app, ["train", str(spec_file), "--resume", str(tmp_path / "part"), "--quiet"])
    assert again.exit_code == 0, again.output  # max-steps 29 is restored: the run is finished
    assert "--max-steps 29" in again.stderr and "is finished: step 29" in again.stderr
    more_epochs = runner.invoke(app, ["train", str(spec_file), "--resume", str(tmp_path / "part"), "--quiet",
                                      "--epochs", "3"])  # said 'give a larger --epochs or --max-steps', and
    assert more_epochs.exit_code == 0, more_epochs.output  # a larger --epochs trained nothing past step 29
    assert "give a larger --max-steps to train further" in more_epochs.stderr, more_epochs.stderr
    assert load_checkpoint(tmp_path / "part")["position"]["step"] == 29
    resumed = runner.invoke(app, ["train", str(spec_file), "--resume", str(tmp_path / "part"), "--quiet",
                                  "--max-steps", "48"])
    assert resumed.exit_code == 0, resumed.output
    assert "resuming" in resumed.stderr and "--max-steps 48 overrides the run's --max-steps 29" in resumed.stderr
    full, part = _params(tmp_path / "full"), _params(tmp_path / "part")
    assert all(torch.equal(full[k], part[k]) for k in full)
    steps = [json.loads(line)["step"] for line in (tmp_path / "part" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "train"]
    assert steps == list(range(1, 49))


def test_ctrl_c_leaves_a_resumable_checkpoint(spec_file: Path, tmp_path: Path):
    spec = load_spec(spec_file)

    def run(out: Path, interrupt_at: int | None) -> Trainer:
        plan = make_plan(spec, target="cpu")
        session = prepare(spec, spec_file, SessionOptions(synthetic_rows=6000, workdir=out), plan,
                          torch.device("cpu"))
        trainer = Trainer(session.spec, session.plan, session.model,
                          TrainConfig(out_dir=out, progress=False, tensorboard=False), plan_json(plan))
        if (out / "checkpoint.pt").is_file():
            trainer.load_state(load_checkpoint(out))

        def on_step(pos, loss):
            if pos.step == interrupt_at:
                os.kill(os.getpid(), signal.SIGINT)

        result = trainer.fit(session.train, session.eval, on_step=on_step)
        assert result.interrupted == (interrupt_at is not None)
        return trainer

    run(tmp_path / "full", None)
    stopped = run(tmp_path / "cut", 7)
    assert stopped.position.step == 7
    run(tmp_path / "cut", None)
    full, cut = _params(tmp_path / "full"), _params(tmp_path / "cut")
    assert all(torch.equal(full[k], cut[k]) for k in full)


def test_eval_and_export_score_like_the_trained_model(spec_file: Path, tmp_path: Path):
    data = tmp_path / "data"
    made = runner.invoke(app, ["data", "synth", str(spec_file), "--rows", "3000", "--out", str(data), "--seed", "3"])
    assert made.exit_code == 0, made.output
    assert _train(spec_file, tmp_path / "run", "--data", str(data), "--eval-data", str(data)).exit_code == 0
    scored = runner.invoke(app, ["eval", str(tmp_path / "run"), "--data", str(data), "--json", "-"])
    assert scored.exit_code == 0, scored.output
    metrics = json.loads(scored.stdout)
    assert metrics["ctr"]["samples"] == 3000 and 0.5 < metrics["ctr"]["auc"] <= 1.0
    final = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if json.loads(line)["event"] == "eval"][-1]
    assert metrics["ctr"]["auc"] == pytest.approx(final["metrics"]["ctr"]["auc"], abs=1e-9)

    exported = runner.invoke(app, ["export", str(tmp_path / "run"), str(tmp_path / "pkg")])
    assert exported.exit_code == 0, exported.output
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import ParquetSource
    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.trained import load_trained

    trained = load_trained(tmp_path / "run", "cpu", scoring_plan)
    serving = torch.export.load(tmp_path / "pkg" / "model.pt2").module()
    with iterate_batches(trained.spec, ParquetSource(data), StagingOptions(batch_size=64, shuffle=False)) as it:
        batch = next(it)
    with torch.no_grad():
        expected = torch.sigmoid(trained.model.eval()(batch))
        got = serving(batch.dense, _per_feature(trained.model, batch))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def _per_feature(model, batch) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Unpack a packed batch into per-feature table-local (ids, offsets), one bag per sample."""
    from flowrec.measure.reference import unpack_field

    out = {}
    for group in model.groups:
        packed = batch.groups[group.name]
        bags = group.field_bags()
        for f in group.fields:
            ids, offsets = unpack_field(group, f.feature, packed.ids, packed.offsets)
            width = bags[f.feature].stop - bags[f.feature].start
            out[f.feature] = (ids, offsets[::width])  # a sequence's L single-id bags form one bag
    return out


def test_errors_are_clear_and_exit_2(spec_file: Path, tmp_path: Path):
    other = tmp_path / "other.yaml"
    other.write_text(SPEC.replace("hash_buckets: 500", "hash_buckets: 501"))
    data = tmp_path / "data"
    assert runner.invoke(app, ["data", "synth", str(other), "--rows", "500", "--out", str(data)]).exit_code == 0
    wrong = _train(spec_file, tmp_path / "run", "--data", str(data))
    assert wrong.exit_code == 2 and "re-convert" in wrong.stderr and "Traceback" not in wrong.output
    missing = _train(spec_file, tmp_path / "run2", "--data", str(tmp_path / "nope"))
    assert missing.exit_code == 2 and "not found" in missing.stderr
    policy = _train(spec_file, tmp_path / "run3", "--cache", "lru")
    assert policy.exit_code == 2 and "--cache must be one of" in policy.stderr
    nothing = runner.invoke(app, ["train", str(spec_file), "--resume", str(tmp_path / "empty")])
    assert nothing.exit_code == 2 and "nothing to resume" in nothing.stderr
    bad = tmp_path / "bad.yaml"
    bad.write_text(SPEC.replace("inputs: [interact, bottom, wide]", "inputs: [interactt, bottom, wide]"))
    invalid = runner.invoke(app, ["train", str(bad)])
    assert invalid.exit_code == 2 and "did you mean 'interact'" in invalid.stderr


def test_movielens_deepfm_reaches_the_plain_pytorch_auc(shared_data: Path, repo: Path, tmp_path: Path):
    """MovieLens-100k, rating >= 4, seeded 80/20 split: DeepFM test AUC >= 0.77 (plain PyTorch ~0.776)."""
    result = runner.invoke(app, ["train", str(repo / "specs" / "movielens.yaml"), "--epochs", "5",
                                 "--out", str(tmp_path / "ml"), "--quiet", "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout[result.stdout.index("{"):])
    (head,) = report["eval"].values()
    assert head["samples"] > 15_000 and head["auc"] >= 0.77


def test_dask_cluster_reads_give_the_same_training_as_direct_reads(spec_file: Path, tmp_path: Path):
    data = tmp_path / "data"
    made = runner.invoke(app, ["data", "synth", str(spec_file), "--rows", "2000", "--out", str(data),
                               "--rows-per-file", "500"])
    assert made.exit_code == 0, made.output
    direct = _train(spec_file, tmp_path / "direct", "--data", str(data), "--epochs", "1")
    assert direct.exit_code == 0, direct.output
    dask = _train(spec_file, tmp_path / "dask", "--data", str(data), "--epochs", "1", "--dask", "local")
    assert dask.exit_code == 0, dask.output
    a, b = _params(tmp_path / "direct"), _params(tmp_path / "dask")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("policy", ["none", "lookahead", "static_hot"])
def test_cache_placements_train_end_to_end(spec_file: Path, tmp_path: Path, policy: str):
    """A device budget smaller than the tables: host (policy none), lookahead and static_hot run
    through `flowrec train`; host and lookahead end with the all-resident parameters."""
    cached = tmp_path / "spec.yaml"
    cached.write_text(SPEC.replace("training:", f"plan: {{cache: {policy}, window: 1}}\ntraining:"))
    assert _train(cached, tmp_path / "device", "--epochs", "1").exit_code == 0
    run = _train(cached, tmp_path / "cached", "--epochs", "1", "--device-budget", "224KiB", "--json", "--report")
    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout[run.stdout.index("{"):])
    placements = {c["placement"] for c in report["counters"].values()}
    assert placements == {"host" if policy == "none" else policy}
    assert all(c["h2d_bytes"] > 0 for c in report["counters"].values())
    if policy == "lookahead":
        assert all(c["hit_rate"] == 1.0 for c in report["counters"].values())
    if policy == "static_hot":
        assert report["eval"]["ctr"]["auc"] > 0.6
        return
    a, b = _params(tmp_path / "device"), _params(tmp_path / "cached")
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)


def test_a_lookahead_group_beside_a_static_hot_one_prefetches_its_windows(spec_file: Path, tmp_path: Path):
    """A plan with FAE's hot/cold batches (a static_hot group) and a lookahead group: the
    lookahead group's windows are of the batches as trained, so only the first batch waits for
    its rows and every later row arrives ahead (before, each batch fetched its own rows on
    demand: demand rows equalled rows fetched)."""
    cached = tmp_path / "spec.yaml"
    cached.write_text(SPEC.replace("training:", "plan: {cache: static_hot, window: 2}\ntraining:"))
    planned = runner.invoke(app, ["plan", str(cached), "--device-budget", "224KiB", "--json", str(tmp_path / "p.json")])
    assert planned.exit_code == 0, planned.output
    plan = json.loads((tmp_path / "p.json").read_text())
    wide = next(g for g in plan["groups"] if g["dim"] == 1)
    assert {g["placement"] for g in plan["groups"] if g is not wide} == {"static_hot"}
    wide.update(placement="lookahead", cache_rows=wide["rows"] - 20)
    (tmp_path / "mixed.json").write_text(json.dumps(plan))
    run = _train(cached, tmp_path / "run", "--plan", str(tmp_path / "mixed.json"), "--epochs", "1", "--json")
    assert run.exit_code == 0, run.output
    report = json.loads(run.stdout[run.stdout.index("{"):])
    counters = report["counters"][wide["name"]]
    assert counters["placement"] == "lookahead" and counters["hit_rate"] == 1.0
    assert counters["rows_fetched"] > 2 * counters["demand_rows"] > 0


@pytest.mark.parametrize("policy", ["lookahead", "static_hot"])
def test_cache_placements_resume_exactly(spec_file: Path, tmp_path: Path, policy: str):
    cached = tmp_path / "spec.yaml"
    cached.write_text(SPEC.replace("training:", f"plan: {{cache: {policy}, window: 1}}\ntraining:"))
    budget = ("--device-budget", "224KiB")
    assert _train(cached, tmp_path / "full", *budget).exit_code == 0
    assert _train(cached, tmp_path / "part", *budget, "--max-steps", "30").exit_code == 0
    resumed = runner.invoke(app, ["train", str(cached), "--resume", str(tmp_path / "part"), "--quiet",
                                  "--max-steps", "1000"])
    assert resumed.exit_code == 0, resumed.output
    full, part = _params(tmp_path / "full"), _params(tmp_path / "part")
    assert full.keys() == part.keys()
    for key in full:
        torch.testing.assert_close(full[key], part[key], rtol=0, atol=0)


@pytest.mark.parametrize("policy", ["none", "lookahead"])
def test_interleaved_schedule_equals_the_sequential_one(spec_file: Path, tmp_path: Path, policy: str):
    """K-interleaving (host-side groups looked up on a worker while device groups gather) and the
    threaded cache exchange give bitwise the parameters of `--no-interleave`."""
    cached = tmp_path / "spec.yaml"
    cached.write_text(SPEC.replace("training:", f"plan: {{cache: {policy}, window: 1}}\ntraining:"))
    budget = ("--device-budget", "224KiB", "--epochs", "1")
    assert _train(cached, tmp_path / "overlap", *budget).exit_code == 0
    assert _train(cached, tmp_path / "sequential", *budget, "--no-interleave").exit_code == 0
    a, b = _params(tmp_path / "overlap"), _params(tmp_path / "sequential")
    assert all(torch.equal(a[k], b[k]) for k in a)
    plan = json.loads((tmp_path / "overlap" / "plan.json").read_text())
    assert {g["placement"] for g in plan["groups"]} == {"device", "host" if policy == "none" else policy}


def test_a_checkpoint_at_an_epochs_last_step_records_the_next_epochs_start(spec_file: Path, tmp_path: Path):
    """The state taken inside the epoch loop at an epoch's last step (what `--checkpoint-every`
    writes) records the position the loop leaves once the epoch ends, so a run killed between that
    checkpoint and the final one resumes to the uninterrupted run's position, not (epoch, len)."""
    spec = load_spec(spec_file)
    plan = make_plan(spec, target="cpu")
    session = prepare(spec, spec_file, SessionOptions(synthetic_rows=3000, workdir=tmp_path), plan,
                      torch.device("cpu"))
    trainer = Trainer(session.spec, session.plan, session.model,
                      TrainConfig(out_dir=tmp_path / "run", progress=False, tensorboard=False), plan_json(plan))
    at_epoch_end: list[dict] = []

    def on_step(pos, loss):
        if pos.batch == trainer._per_epoch:  # the epoch's last batch was just trained
            at_epoch_end.append({"in_loop": dict(vars(pos)), "saved": trainer.state()["position"]})

    trainer.fit(session.train, session.eval, on_step=on_step)
    epochs = spec.training.epochs
    assert len(at_epoch_end) == epochs >= 2
    for epoch, seen in enumerate(at_epoch_end):
        assert seen["in_loop"]["epoch"] == epoch and seen["in_loop"]["batch"] == trainer._per_epoch
        assert seen["saved"] == {**seen["in_loop"], "epoch": epoch + 1, "batch": 0}
    assert load_checkpoint(tmp_path / "run")["position"] == at_epoch_end[-1]["saved"]
