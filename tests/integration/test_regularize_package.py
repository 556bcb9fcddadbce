"""Models with mlp batch norm and dropout, and with moe / ple mixtures (packed towers and experts
included), export and predict: the package scores raw rows as the trained model does in eval mode
(running statistics, no dropout), and one row scores as it does within a batch."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from package_flow import train_and_export

SPEC = """
name: reg_pkg
features:
  - {name: price, type: dense, transform: standardize}
  - {name: user, type: categorical, vocab: 60, dim: 8}
  - {name: city, type: categorical, hash_buckets: 50, dim: 8}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense", "@sparse"], layers: [16], norm: batch, dropout: 0.3}
  - {name: t1, kind: mlp, inputs: [bottom], layers: [8], norm: batch, dropout: 0.2}
  - {name: t2, kind: mlp, inputs: [bottom], layers: [8], norm: batch, dropout: 0.2}
  - {name: top, kind: concat, inputs: [t1, t2]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 2, seed: 0}
"""
MIXTURES = """
name: mix_pkg
features:
  - {name: price, type: dense, transform: standardize}
  - {name: user, type: categorical, vocab: 60, dim: 8}
  - {name: city, type: categorical, hash_buckets: 50, dim: 8}
modules:
  - {name: experts, kind: moe, inputs: ["@dense", "@sparse"], experts: 3, expert_layers: [16, 8], heads: [a, b]}
  - {name: levels, kind: ple, inputs: ["@dense", "@sparse"], levels: 2, task_experts: 1, shared_experts: 2,
     expert_layers: [8], gate_layers: [4], heads: [a]}
  - {name: t1, kind: mlp, inputs: [experts.a, levels.a], layers: [8]}
  - {name: t2, kind: mlp, inputs: [experts.b, levels.a], layers: [8]}
  - {name: top, kind: concat, inputs: [t1, t2]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 2, seed: 0}
"""


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    user = rng.zipf(1.3, rows) % 80
    price = rng.lognormal(2.0, 1.0, rows)
    logit = np.where(user % 3 == 0, 1.5, -1.0) - 0.1 * price
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    return pd.DataFrame({"price": price, "user": [f"u{u}" for u in user],
                         "city": rng.integers(0, 500, rows), "label": label})


@pytest.fixture(scope="module", params=["regularised", "mixtures"])
def run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("regpkg")
    return train_and_export(root, SPEC if request.param == "regularised" else MIXTURES, raw_rows(2000, 0))


def test_package_scores_as_the_eval_mode_model(run):
    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.package import encoded_inputs
    from flowrec.serving.predict import load_model
    from flowrec.serving.trained import load_trained

    model = load_model(run / "pkg")
    raw = raw_rows(300, 1)
    predicted = model.predict(raw)["ctr"].to_numpy()
    trained = load_trained(run / "run", "cpu", scoring_plan)
    assert "packed_t1_x2" in trained.model.ops
    if "bottom" in trained.model.ops:
        norm = trained.model.ops["bottom"].norms[0]
        assert int(norm.num_batches_tracked) > 0 and not torch.all(norm.running_mean == 0)
    else:
        assert trained.model.ops["experts"].experts.weights[0].shape[0] == 3  # packed experts
    encoded = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False), labels=False)
    dense, sparse = encoded_inputs(model.spec, encoded)
    program = torch.export.load(str(run / "pkg" / "model.pt2")).module()
    with torch.no_grad():
        scores = program(dense, sparse)[:, 0].numpy()
        one = program(dense[:1], {k: (v[0][:int(v[1][1])], v[1][:2]) for k, v in sparse.items()})
    np.testing.assert_allclose(scores, predicted, rtol=0, atol=1e-6)
    np.testing.assert_allclose(one[:, 0].numpy(), predicted[:1], rtol=0, atol=1e-6)
    assert np.std(predicted) > 0
    labelled = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False))
    np.testing.assert_allclose(eval_scores(trained, labelled), predicted, rtol=0, atol=1e-5)


def eval_scores(trained, encoded) -> np.ndarray:
    """Scores of the trained model in eval mode, batch by batch."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource

    out = []
    opts = StagingOptions(batch_size=64, shuffle=False, lookahead=0)
    with iterate_batches(trained.spec, MemorySource([encoded]), opts, 0, 0, trained.model.groups) as batches, \
            torch.no_grad():
        for batch in batches:
            out.append(torch.sigmoid(trained.model.eval()(batch))[:, 0].numpy())
    return np.concatenate(out)
