"""A `self_attention` model trains through the CLI, and its package scores raw rows as the trained
model does in eval mode: the export's padded-sequence lookup and mask (serving) and training's
packed lookup and mask (lowering) are two implementations that must agree, for a batch of skewed
sequence lengths (empty ones included) and for one row."""
from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch

from package_flow import train_and_export
from tests.integration.test_tower_package import eval_scores

SPEC = """
name: seq_pkg
features:
  - {name: price, type: dense, transform: log1p}
  - {name: item, type: categorical, table: items}
  - {name: clicks, type: sequence, table: items, max_len: 6, pooling: none}
tables:
  - {name: items, hash_buckets: 80, dim: 8}
modules:
  - {name: history, kind: self_attention, inputs: INPUTS, num_heads: 2, num_layers: 2, norm: NORM,
     causal: CAUSAL, output: OUTPUT, dropout: 0.2}
  - {name: top, kind: mlp, inputs: [history, item, "@dense"], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adam, lr: 0.05}
training: {batch_size: 128, epochs: 2, seed: 0}
"""
VARIANTS = {"post_last": ("post", "false", "last", "[clicks]"), "pre_causal_mean": ("pre", "true", "mean", "[clicks]"),
            "post_target": ("post", "false", "target", "[clicks, item]")}  # BST: the candidate joins


def raw_rows(rows: int, seed: int) -> pd.DataFrame:
    rng = np.random.default_rng(seed)
    item = rng.zipf(1.3, rows) % 120
    lengths = np.minimum(rng.zipf(1.6, rows) - 1, 9)  # many short, some empty, some longer than max_len
    clicks = ["^".join(str(v) for v in rng.zipf(1.3, n) % 120) for n in lengths]
    price = rng.lognormal(2.0, 1.0, rows)
    logit = np.where(item % 3 == 0, 1.2, -0.8) + 0.3 * np.minimum(lengths, 6) - 0.8
    label = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(int)
    return pd.DataFrame({"price": price, "item": item, "clicks": clicks, "label": label})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def run(request, tmp_path_factory):
    root = tmp_path_factory.mktemp("seqpkg")
    norm, causal, output, inputs = VARIANTS[request.param]
    spec = SPEC.replace("NORM", norm).replace("CAUSAL", causal).replace("OUTPUT", output).replace("INPUTS", inputs)
    return train_and_export(root, spec, raw_rows(1500, 0))


def test_package_scores_as_the_eval_mode_model(run):
    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.package import encoded_inputs
    from flowrec.serving.predict import load_model
    from flowrec.serving.trained import load_trained

    model = load_model(run / "pkg")
    raw = raw_rows(300, 1)
    assert (raw["clicks"] == "").any() and (raw["clicks"].str.count(r"\^") >= 6).any()
    predicted = model.predict(raw)["ctr"].to_numpy()
    trained = load_trained(run / "run", "cpu", scoring_plan)
    assert type(trained.model.ops["history"]).__name__ == "SelfAttention"
    assert int(trained.model.noise_steps) > 0  # dropout was drawn while training
    labelled = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False))
    np.testing.assert_allclose(eval_scores(trained, labelled), predicted, rtol=0, atol=1e-5)
    encoded = model.encoder.encode(pa.Table.from_pandas(raw, preserve_index=False), labels=False)
    dense, sparse = encoded_inputs(model.spec, encoded)
    program = torch.export.load(str(run / "pkg" / "model.pt2")).module()
    with torch.no_grad():
        for row in (0, int(np.argmax(raw["clicks"].str.len().to_numpy()))):
            one = {k: (ids[int(offs[row]):int(offs[row + 1])], offs[:2] * 0 + torch.tensor([0, int(offs[row + 1] - offs[row])]))
                   for k, (ids, offs) in sparse.items()}
            got = program(dense[row:row + 1], one)[:, 0].numpy()
            np.testing.assert_allclose(got, predicted[row:row + 1], rtol=0, atol=1e-6)
    assert np.std(predicted) > 0
