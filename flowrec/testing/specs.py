"""Small specs the tests, tools and benchmarks share (one place, instead of tests importing each
other): `tiny_spec` (a few fields and modules, any plan hints), `wide_spec` (many random fields),
`run_spec` (YAML text of a tiny CTR model whose runs take a second, for the CLI), `mini_spec`
(YAML text of the smallest model a raw-data test binds), `csv_spec` (a model bound to a CSV).

Example:
    >>> tiny_spec(packing=False).plan.packing
    False
"""
from __future__ import annotations

import copy
import random
from typing import Any

from flowrec.spec import spec_from_dict
from flowrec.spec.model import ModelSpec

RUN_SPEC_TEMPLATE = """
name: {name}
features:
  - {{name: d1, type: dense, transform: log1p}}
  - {{name: user, type: categorical, hash_buckets: 50, dim: 4}}
  - {{name: item, type: categorical, hash_buckets: 80, dim: 4}}
modules:
  - {{name: bottom, kind: mlp, inputs: ["@dense"], layers: [4]}}
  - {{name: interact, kind: dot, inputs: [bottom, user, item]}}
  - {{name: top, kind: mlp, inputs: [interact, bottom], layers: [8]}}
heads:
  - {{name: ctr, input: top, task: binary, loss: bce}}
optimizer:
  dense: {{name: adam, lr: 0.01}}
  sparse: {{name: rowwise_adagrad, lr: 0.1}}
training: {{batch_size: {batch_size}, epochs: {epochs}, seed: 5}}
"""


# fp16 table and an lr of 1000: its first update overflows the table (a non-finite parameter)
OVERFLOW_SPEC = """
name: overflow
features:
  - {name: d1, type: dense}
  - {name: c2, type: categorical, hash_buckets: 64, dim: 8, dtype: fp16}
modules:
  - {name: deep, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16]}
heads:
  - {name: ctr, input: deep}
  - {name: val, input: deep, task: regression, label: y}
optimizer: {dense: {name: sgd, lr: 1000}, sparse: {name: sgd, lr: 1000}}
training: {batch_size: 32}
"""


def run_spec(name: str = "tiny_guard", batch_size: int = 32, epochs: int = 2) -> str:
    """YAML text of a tiny CTR model whose runs take about a second (for CLI run tests)."""
    return RUN_SPEC_TEMPLATE.format(name=name, batch_size=batch_size, epochs=epochs)


def mini_spec(name: str) -> str:
    """YAML text of the smallest CTR model a raw-data test binds: one dense column `d1`, one
    hashed id `user`, one MLP, a binary head (batch 128)."""
    return f"""
name: {name}
features:
  - {{name: d1, type: dense}}
  - {{name: user, type: categorical, hash_buckets: 300, dim: 8}}
modules:
  - {{name: top, kind: mlp, inputs: ["@dense", user], layers: [8]}}
heads:
  - {{name: ctr, input: top}}
training: {{batch_size: 128, epochs: 1}}
"""

TINY: dict[str, Any] = {
    "name": "tiny",
    "features": [
        {"name": "d1", "type": "dense"},
        {"name": "d2", "type": "dense", "transform": "log1p"},
        {"name": "a", "type": "categorical", "vocab": 9, "dim": 4, "tags": ["emb"]},
        {"name": "b", "type": "categorical", "hash_buckets": 20, "dim": 4, "tags": ["emb"]},
        {"name": "c", "type": "categorical", "table": "shared", "max_len": 3, "pooling": "mean", "tags": ["emb"]},
        {"name": "w", "type": "categorical", "hash_buckets": 7, "dim": 1, "tags": ["wide"]},
        {"name": "hist", "type": "sequence", "table": "shared", "max_len": 5, "pooling": "none"},
        {"name": "q", "type": "categorical", "table": "shared"},
    ],
    "tables": [{"name": "shared", "vocab": 30, "dim": 4}],
    "modules": [
        {"name": "bot", "kind": "mlp", "inputs": ["@dense"], "layers": [8, 4]},
        {"name": "att", "kind": "target_attention", "inputs": ["q", "hist"], "hidden": [8]},
        {"name": "inter", "kind": "dot", "inputs": ["bot", "@emb", "att"]},
        {"name": "wide", "kind": "linear", "inputs": ["@wide", "d1"], "out": 1},
        {"name": "top", "kind": "mlp", "inputs": ["inter", "bot"], "layers": [8]},
        {"name": "t1", "kind": "mlp", "inputs": ["top"], "layers": [4]},
        {"name": "t2", "kind": "mlp", "inputs": ["top"], "layers": [4]},
        {"name": "final", "kind": "concat", "inputs": ["t1", "wide"]},
    ],
    "heads": [{"name": "h1", "input": "final"}, {"name": "h2", "input": "t2", "task": "regression"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
    "training": {"batch_size": 1024},
}


def csv_spec(name: str, **data: Any) -> ModelSpec:
    """A two-feature model (dense `price`, hashed `user`, label `clicked`) bound to `x.csv` in
    the csv format, with `data` added to its binding (options, sep, ...): readers' tests."""
    return spec_from_dict({
        "name": name,
        "features": [{"name": "price", "type": "dense"},
                     {"name": "user", "type": "categorical", "hash_buckets": 64, "dim": 4}],
        "modules": [{"name": "top", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "top"}],
        "data": {"format": "csv", "path": "x.csv", "label": "clicked", **data},
        "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "sgd", "lr": 0.1}},
        "training": {"batch_size": 8},
    })


def tiny_spec(**plan: Any) -> ModelSpec:
    """The tiny spec with plan hints overridden (e.g. packing=False, cache="none")."""
    doc = copy.deepcopy(TINY)
    doc["plan"] = plan
    return spec_from_dict(doc)


def wide_spec(n_fields: int, seed: int = 0):
    """A random wide spec: n categorical fields of dims 1/4/8/16, two sparse optimizers."""
    rng = random.Random(seed)
    feats = [{"name": "x", "type": "dense"}]
    for i in range(n_fields):
        f = {"name": f"f{i}", "type": "categorical", "hash_buckets": rng.randint(2, 5000),
             "dim": rng.choice([1, 4, 8, 16]), "tags": ["wide"]}
        if i % 7 == 0:
            f["optimizer"] = {"name": "sgd", "lr": 0.1}
        feats.append(f)
    doc = {
        "name": "wide", "features": feats,
        "modules": [{"name": "lin", "kind": "linear", "inputs": ["@wide", "@dense"], "out": 1}],
        "heads": [{"name": "ctr", "input": "lin"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
    }
    return spec_from_dict(doc)
