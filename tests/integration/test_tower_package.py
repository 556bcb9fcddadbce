"""Models whose lookups never meet a dense feature export and predict (issue 26 defect).

A `dot` over two module outputs (a user tower and an item tower) in a spec without dense features
trained, but `flowrec export` failed with a batch constraint violation; so did an mlp over a module
output and an embedding field. The `similarity` kind of two towers is covered the same way. Both read a field slice of a packed lookup, which was flattened by
a `reshape` that asks whether the batch is 1. The package must score raw rows as the trained model
does, for a batch and for one row.
"""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from package_flow import train_and_export

HEAD = """
features:
  - {name: user, type: categorical, vocab: 60, dim: 8}
  - {name: item, type: categorical, hash_buckets: 50, dim: 8}
  - {name: tags, type: categorical, vocab: 12, dim: 8, max_len: 3, pooling: mean}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 2, seed: 0}
heads:
  - {name: ctr, input: score, task: binary, loss: bce}
"""
MODULES = {
    "dot_of_towers": """
modules:
  - {name: user_tower, kind: mlp, inputs: [user], layers: [8]}
  - {name: item_tower, kind: mlp, inputs: [item, tags], layers: [8]}
  - {name: score, kind: dot, inputs: [user_tower, item_tower]}
""",
    "dot_of_packed_towers": """
modules:
  - {name: user_tower, kind: mlp, inputs: [user, tags], layers: [8]}
  - {name: item_tower, kind: mlp, inputs: [item, tags], layers: [8]}
  - {name: score, kind: dot, inputs: [user_tower, item_tower]}
""",
    "cosine_of_towers": """
modules:
  - {name: user_tower, kind: mlp, inputs: [user], layers: [8], norm: layer}
  - {name: item_tower, kind: mlp, inputs: [item, tags], layers: [8]}
  - {name: score, kind: similarity, inputs: [user_tower, item_tower], metric: cosine, temperature: 0.1}
""",
    "mlp_of_module_and_field": """
modules:
  - {name: user_tower, kind: mlp, inputs: [user], layers: [8]}
  - {name: score, kind: mlp, inputs: [user_tower, item, tags], layers: [4]}
""",
}


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    user = rng.zipf(1.3, rows) % 80
    item = rng.zipf(1.2, rows) % 400
    tags = ["^".join(f"t{t}" for t in rng.integers(0, 15, rng.integers(0, 4))) for _ in range(rows)]
    logit = np.where((user + item) % 3 == 0, 1.5, -1.0)
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    return pd.DataFrame({"user": [f"u{u}" for u in user], "item": item, "tags": tags, "label": label})


@pytest.fixture(scope="module", params=sorted(MODULES))
def run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("towers")
    return train_and_export(root, f"name: {request.param}\n" + HEAD + MODULES[request.param], raw_rows(1500, 0))


def test_package_scores_as_the_trained_model(run):
    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.package import encoded_inputs
    from flowrec.serving.predict import load_model
    from flowrec.serving.trained import load_trained

    model = load_model(run / "pkg")
    raw = raw_rows(300, 1)
    predicted = model.predict(raw)["ctr"].to_numpy()
    encoded = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False), labels=False)
    dense, sparse = encoded_inputs(model.spec, encoded)
    assert dense.shape == (300, 0)
    program = torch.export.load(str(run / "pkg" / "model.pt2")).module()
    with torch.no_grad():
        one = program(dense[:1], {k: (v[0][:int(v[1][1])], v[1][:2]) for k, v in sparse.items()})
    np.testing.assert_allclose(one[:, 0].numpy(), predicted[:1], rtol=0, atol=1e-6)
    assert np.std(predicted) > 0
    trained = load_trained(run / "run", "cpu", scoring_plan)
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
