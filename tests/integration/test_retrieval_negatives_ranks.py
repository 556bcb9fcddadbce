"""Sampled negatives through `flowrec train` end to end (gloo, subprocesses):

- `--nproc 2` trains what one process trains (the item group row-wise sharded: every rank stages
  the global batch's drawn items into its slice's lookups, the exchange sums their rows'
  gradients over the ranks, DDP the item tower's; parameters allclose, same global losses);
- a run with the item group on the lookahead cache equals the same run on placement device, and
  one cut short and resumed ends bitwise equal to an uninterrupted one (the resumed data stage
  draws the same items); FAE's static_hot trains and resumes bitwise too.

The spec has a user tower and an item tower (MLPs, so DDP has parameters), logQ correction and
unigram sampling, an odd batch size (uneven rank slices, a smaller last batch), sparse adagrad.
The ranks' runs are cosine (dense adam) and a dot product with dense SGD: under a dot product a
softmax over item vectors is unchanged when they all move alike, so the item tower's last bias
has a zero gradient in the units active on every candidate; what it gets is rounding noise whose
sign depends on the summation order, and adam (eps 1e-8 against float32 noise of 1e-9) turns it
into steps of a sizeable fraction of lr, one process and two ranks alike but different ones
(docs/distributed.md; float64 on ranks: tests/integration/test_retrieval_ranks_exact.py). The
cached runs use adagrad (its state travels with its row).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from flowrec.testing.ranks import assert_same_model, run_flowrec

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300  # every subprocess
DIST_TIMEOUT_S = "120"  # the ranks' process group
ROWS = 640  # 7 global batches of 101 (the last one 34), 2 epochs

SPEC = {
    "name": "two_tower_sampled",
    "features": [
        {"name": "user", "type": "categorical", "vocab": 150, "dim": 8},
        {"name": "age", "type": "categorical", "vocab": 6, "dim": 8},
        {"name": "item", "type": "categorical", "vocab": 400, "dim": 8},
    ],
    "modules": [
        {"name": "user_tower", "kind": "mlp", "inputs": ["user", "age"], "layers": [8]},
        {"name": "item_tower", "kind": "mlp", "inputs": ["item"], "layers": [8]},
        {"name": "score", "kind": "similarity", "inputs": ["user_tower", "item_tower"], "metric": "cosine",
         "temperature": 0.2},
    ],
    "heads": [{"name": "retrieve", "input": "score", "task": "retrieval", "logq_correction": True,
               "negatives": {"kind": "sampled", "num": 40, "distribution": "unigram"}, "top_k": [10]}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.1}},
    "training": {"batch_size": 101, "epochs": 2, "seed": 5},
}


def flowrec(*args: str, cwd: Path):
    return run_flowrec(*args, cwd=cwd, root=ROOT, timeout_s=TIMEOUT_S)


def _plan(root: Path, name: str, world: int, spec: str = "spec.yaml", **group: object) -> None:
    made = flowrec("plan", spec, "--world-size", str(world), "--json", name, cwd=root)
    assert made.returncode == 0, made.stderr
    plan = json.loads((root / name).read_text())
    for g in plan["groups"]:
        g.update(group)
    (root / name).write_text(json.dumps(plan))


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("retrieval_ranks")
    (root / "spec.yaml").write_text(yaml.safe_dump(SPEC))
    score = {**SPEC["modules"][2], "metric": "dot"}
    score.pop("temperature")
    (root / "dot.yaml").write_text(yaml.safe_dump({**SPEC, "modules": [*SPEC["modules"][:2], score],
                                                   "optimizer": {**SPEC["optimizer"],
                                                                 "dense": {"name": "sgd", "lr": 0.1}}}))
    _plan(root, "p1.json", 1, placement="device", sharding="row_wise", shards=1)
    _plan(root, "p2.json", 2, placement="device", sharding="row_wise", shards=2)
    _plan(root, "dot1.json", 1, "dot.yaml", placement="device", sharding="row_wise", shards=1)
    _plan(root, "dot2.json", 2, "dot.yaml", placement="device", sharding="row_wise", shards=2)
    made = flowrec("data", "synth", "spec.yaml", "--rows", str(ROWS), "--rows-per-file", "150", "--out", "d",
                   "--seed", "4", "-q", cwd=root)
    assert made.returncode == 0, made.stderr
    return root


def train(work: Path, out: str, *extra: str, spec: str = "spec.yaml"):
    done = flowrec("train", spec, "--data", "d", "--out", out, "-q", "--eval-every", "0",
                   "--dist-timeout", DIST_TIMEOUT_S, *extra, cwd=work)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def losses(run: Path) -> list[float]:
    records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["event"] == "train"]


@pytest.mark.parametrize(("one_run", "name"), [("r1", "p"), ("dot1", "dot")])
def test_two_ranks_train_what_one_process_trains(work, one_run, name):
    spec = "spec.yaml" if name == "p" else f"{name}.yaml"
    if not (work / one_run).is_dir():
        train(work, one_run, "--plan", f"{name}1.json", spec=spec)
    two = train(work, f"{name}_two", "--plan", f"{name}2.json", "--nproc", "2", spec=spec)
    assert "1 group(s) row_wise" in two.stderr
    # cosine + adam (module docstring): adam turns the summation-order noise of near-zero gradients
    # into steps, so one process and two ranks part by ~1e-5 after 14 steps (1.4e-5 where the CPU
    # weight gradients run through torch's mm, below AVX-512); a lost or doubled rank's half moves
    # parameters by ~lr (1e-2). The dot product with SGD stays at 1e-5.
    tol = 1e-4 if name == "p" else 1e-5
    assert_same_model(work / one_run, work / f"{name}_two", tol=tol)
    one, two = losses(work / one_run), losses(work / f"{name}_two")
    assert len(one) == len(two) == 14
    assert one == pytest.approx(two, rel=tol)


@pytest.mark.parametrize("placement", ["lookahead", "static_hot"])
def test_a_cached_item_group_trains_and_resumes_bitwise(work, placement):
    plan = f"p_{placement}.json"
    _plan(work, plan, 1, placement=placement, cache_rows=500)  # of 559 rows
    full = train(work, f"{placement}_full", "--plan", plan)
    train(work, f"{placement}_cut", "--plan", plan, "--max-steps", "5")
    resumed = flowrec("train", "spec.yaml", "--resume", f"{placement}_cut", "--max-steps", "1000", "-q", cwd=work)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert_same_model(work / f"{placement}_full", work / f"{placement}_cut", tol=0.0)  # bitwise
    assert losses(work / f"{placement}_full")[5:] == losses(work / f"{placement}_cut")[5:]
    if placement == "lookahead":  # the same batch order as on the device: the same parameters
        if not (work / "r1").is_dir():
            train(work, "r1", "--plan", "p1.json")
        assert_same_model(work / "r1", work / f"{placement}_full")
    assert full.returncode == 0
