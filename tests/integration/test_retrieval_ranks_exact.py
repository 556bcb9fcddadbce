"""A two-tower retrieval model (MLP towers, in-batch softmax over the ranks' gathered items, logQ)
trains the same on 2 ranks as in one process, in float64, for a dot product and cosine and for
sparse adagrad and adam (dense adam, and SGD once): 6 steps of an odd global batch through `train_step` with DDP
and the sharded exchange (tests/dist_specs_worker.py on these specs). A gradient applied as two
partial updates (adagrad's accumulator seeing g1^2 + g2^2 for (g1 + g2)^2) or scaled differently
per rank moves parameters by about lr, 10 orders of magnitude past these bounds.
`test_one_step_gradients_tensor_by_tensor` compares a first step's gradients (tools/rank_grads.py).

Under a dot product one tensor gets a wider bound, and `test_dot_gives_the_item_shift_no_gradient`
shows why: an in-batch softmax of dot products is unchanged when every item vector moves by the
same vector c (row i's logits all shift by q_i . c), so the item tower's last bias has a zero
gradient in each unit that is active (ReLU) on every item of the batch. What it gets is rounding
noise whose sign depends on the summation order (ranks add in another order than one process),
and adam divides it by its own size: its steps on that bias are noise, at most
lr x noise / eps, about 1e-11 in float64 but a sizeable fraction of lr in float32 (eps 1e-8 against
float32 noise of 1e-9): see docs/distributed.md.
"""
from __future__ import annotations

import copy
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from flowrec.testing.processes import communicate_bounded, kill_tree, run_bounded, wait_bounded
from operators.retrieval import in_batch_softmax

ROOT = Path(__file__).resolve().parents[2]
TIMEOUT_S = 300
COLLECTIVE_TIMEOUT_S = 60

SPEC = {
    "features": [
        {"name": "user", "type": "categorical", "vocab": 150, "dim": 8},
        {"name": "age", "type": "categorical", "vocab": 6, "dim": 8},
        {"name": "item", "type": "categorical", "vocab": 400, "dim": 8},
    ],
    "modules": [
        {"name": "user_tower", "kind": "mlp", "inputs": ["user", "age"], "layers": [8]},
        {"name": "item_tower", "kind": "mlp", "inputs": ["item"], "layers": [8]},
        {"name": "score", "kind": "similarity", "inputs": ["user_tower", "item_tower"], "metric": "dot"},
    ],
    "heads": [{"name": "retrieve", "input": "score", "task": "retrieval", "logq_correction": True,
               "negatives": {"kind": "in_batch"}, "top_k": [10]}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.1}},
    "training": {"batch_size": 101, "epochs": 1, "seed": 5},
}
# (metric, sparse optimizer, dense optimizer)
CASES = [(metric, sparse, "adam") for metric in ("dot", "cosine") for sparse in ("adagrad", "adam")]
CASES.append(("dot", "adagrad", "sgd"))  # no adam on the dot product's rounding noise: 1e-11 again
DOT_SHIFT_KEY = "ops.item_tower.layers.0.bias"  # the item tower's last bias (see the module docstring)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _name(metric: str, sparse: str, dense: str) -> str:
    return f"towers_{metric}_{sparse}_{dense}"


def _spec(metric: str, sparse: str, dense: str) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["name"] = _name(metric, sparse, dense)
    spec["optimizer"]["sparse"]["name"] = sparse
    spec["optimizer"]["dense"]["name"] = dense
    if metric == "cosine":
        spec["modules"][2].update(metric="cosine", temperature=0.2)
    return spec


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("retrieval_exact")
    specs = out / "specs"
    specs.mkdir()
    for case in CASES:
        (specs / f"{_name(*case)}.yaml").write_text(yaml.safe_dump(_spec(*case)))
    port = _free_port()
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "WORLD_SIZE": "2", "RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": str(port), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([sys.executable, str(ROOT / "tests" / "dist_specs_worker.py"), str(out),
                                       str(COLLECTIVE_TIMEOUT_S), str(specs)], env=env, stderr=subprocess.PIPE,
                                      text=True))
    try:
        errors = [communicate_bounded(p, TIMEOUT_S)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                kill_tree(p.pid)
                wait_bounded(p, 30)
    assert [p.returncode for p in procs] == [0, 0], "\n".join(e[-2000:] for e in errors)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]


@pytest.mark.parametrize(("metric", "sparse", "dense"), CASES)
def test_two_ranks_equal_one_process(reports, metric, sparse, dense):
    """Dense adam under a dot product: its noise steps on the item tower's last bias (about 1e-10
    of it) move every item vector alike, so every later gradient carries 1e-11 of it: 1e-9 for
    every tensor there, 1e-11 elsewhere (cosine; a dot product with dense SGD)."""
    bound = 1e-9 if metric == "dot" and dense == "adam" else 1e-11
    for rank, report in enumerate(reports):
        got = report[_name(metric, sparse, dense)]
        assert got["keys"] and got["steps"] == 6 and got["sharding"] == ["row_wise"], (rank, got)
        assert got["first_embed"] == 0.0 and got["first_logits"] == 0.0, (rank, got)
        assert got["loss_rel"] < 1e-12, (rank, got)
        rels = got["param_rels"]
        assert DOT_SHIFT_KEY in rels and any(k.startswith("embeddings.") for k in rels), sorted(rels)
        for key, rel in rels.items():
            assert rel < bound, (rank, metric, sparse, dense, key, rel)


def _towers(metric: str, seed: int) -> tuple[torch.Tensor, ...]:
    """One in-batch softmax's query vectors, the item tower's pre-activations (every unit of the
    first 5 active on every item, the last 3 on some), its bias, items with repeats and log q."""
    g = torch.Generator().manual_seed(seed)
    b, d = 23, 8
    q = torch.randn(b, d, generator=g, dtype=torch.float64)
    pre = torch.randn(b, d, generator=g, dtype=torch.float64)
    pre[:, :5] = pre[:, :5].abs() + 0.5
    pre[:3, 5:] = -pre[:3, 5:].abs() - 0.5
    bias = (torch.randn(d, generator=g, dtype=torch.float64) * 0.1).requires_grad_(True)
    items = torch.randint(0, 9, (b,), generator=g)
    log_q = torch.rand(9, generator=g, dtype=torch.float64).log()
    return q, pre, bias, items, log_q


@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_dot_gives_the_item_shift_no_gradient(metric):
    """The reason for the dot product's wider bound on the item tower's last bias, against plain
    torch: its gradient is zero (to rounding) in the units active on every item under a dot
    product, and not under cosine (normalising breaks the shift invariance)."""
    q, pre, bias, items, log_q = _towers(metric, seed=3)
    v = torch.relu(pre + bias)
    loss = in_batch_softmax(q, v, items, metric, 0.2 if metric == "cosine" else 1.0, log_q).mean()
    grad, = torch.autograd.grad(loss, bias)
    shifted = in_batch_softmax(q, v + 0.3, items, metric, 0.2 if metric == "cosine" else 1.0, log_q).mean()
    if metric == "dot":
        assert grad[:5].abs().max() < 1e-15, grad
        assert abs(float((shifted - loss).detach())) < 1e-12
    else:
        assert grad[:5].abs().max() > 1e-4, grad
        assert abs(float((shifted - loss).detach())) > 1e-4
    assert grad[5:].abs().max() > 1e-4, grad  # units dead on some items: a real gradient either way


@pytest.mark.parametrize("metric", ["dot", "cosine"])
def test_one_step_gradients_tensor_by_tensor(tmp_path, metric):
    """tools/rank_grads.py: a first step's dense gradients and adagrad table steps on 2 ranks equal
    one process's to float64 rounding, every tensor against the largest gradient (under a dot
    product the item tower's last bias gets rounding noise alone, 1e-17)."""
    spec = tmp_path / "spec.yaml"
    spec.write_text(yaml.safe_dump(_spec(metric, "adagrad", "adam")))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("RANK", None)
    done = run_bounded([sys.executable, str(ROOT / "tools" / "rank_grads.py"), str(spec), "--timeout",
                        str(COLLECTIVE_TIMEOUT_S)], env=env, capture_output=True, text=True, timeout_s=TIMEOUT_S)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout)
    assert abs(got["loss_one"] - got["loss_two"]) < 1e-14 * abs(got["loss_one"])
    largest = max(v["scale"] for v in got["dense"].values())
    assert set(got["dense"]) == {f"ops.{t}_tower.layers.0.{p}" for t in ("user", "item") for p in ("weight", "bias")}
    for name, v in got["dense"].items():
        assert v["diff"] < 1e-13 * largest, (name, v)
    assert got["tables"] and all(0.09 < v["scale"] and v["diff"] < 1e-13 * v["scale"] for v in got["tables"].values())
