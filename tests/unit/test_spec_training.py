"""The spec's training section: schedule, clip_grad_norm, early_stopping and eval_group_by round-trip
and are checked with one line per problem (did-you-mean for near misses)."""
from __future__ import annotations

import copy

import pytest
import yaml

from flowrec.spec.load import load_spec, spec_from_dict, to_dict
from flowrec.spec.validate import validate_document

DOC = yaml.safe_load("""
name: t
features:
  - {name: user, type: categorical, vocab: 10, dim: 4}
  - {name: hist, type: sequence, vocab: 10, dim: 4, max_len: 3}
modules:
  - {name: top, kind: mlp, inputs: ["@sparse"], layers: [4]}
heads:
  - {name: ctr, input: top}
  - {name: dwell, input: top, task: regression, loss: mse, label: dwell}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: adagrad, lr: 0.1}
training:
  eval_every: 10
  eval_group_by: user
  clip_grad_norm: 5
  schedule: {warmup_steps: 10, decay: cosine, min_lr_ratio: 0.1, apply_to: both}
  early_stopping: {metric: gauc, head: ctr, patience: 2, min_delta: 0.001}
""")


def _issues(**training) -> list[str]:
    doc = copy.deepcopy(DOC)
    doc["training"].update(training)
    return [str(i) for i in validate_document(doc)]


def test_training_settings_round_trip(tmp_path) -> None:
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump(DOC))
    spec = load_spec(path)
    assert spec.training.schedule.decay == "cosine" and spec.training.clip_grad_norm == 5.0
    assert spec.training.early_stopping.metric == "gauc" and spec.training.eval_group_by == "user"
    assert spec_from_dict(to_dict(spec)) == spec
    plain = copy.deepcopy(DOC)
    plain["training"] = {"eval_every": 10}
    assert set(to_dict(spec_from_dict(plain))["training"]) == {"batch_size", "epochs", "seed", "precision",
                                                                "eval_every", "deterministic"}


@pytest.mark.parametrize("training, expected", [
    ({"schedule": {"warmup_step": 3}}, "training.schedule: unknown key 'warmup_step' (did you mean 'warmup_steps'?)"),
    ({"schedule": {"decay": "cosin"}}, "(did you mean 'cosine'?)"),
    ({"clip_grad_norm": 0}, "training.clip_grad_norm: must be > 0"),
    ({"early_stopping": {"metric": "auc", "patiense": 2}}, "(did you mean 'patience'?)"),
    ({"early_stopping": {"metric": "auc", "head": "ctx"}}, "training.early_stopping.head: unknown head 'ctx' "
                                                           "(did you mean 'ctr'?)"),
    ({"early_stopping": {"metric": "auc", "head": "dwell"}}, "'dwell' is a regression head; it reports mse, mae"),
    ({"early_stopping": {"metric": "gauc"}, "eval_group_by": None}, "gauc needs training.eval_group_by"),
    ({"eval_group_by": "usr"}, "training.eval_group_by: unknown feature 'usr' (did you mean 'user'?)"),
    ({"eval_group_by": "hist"}, "feature 'hist' is not a one-id categorical feature"),
])
def test_training_problems_are_one_line_each(training: dict, expected: str) -> None:
    if training.get("eval_group_by", "") is None:
        doc_training = {k: v for k, v in training.items() if k != "eval_group_by"}
        doc = copy.deepcopy(DOC)
        del doc["training"]["eval_group_by"]
        doc["training"].update(doc_training)
        issues = [str(i) for i in validate_document(doc)]
    else:
        issues = _issues(**training)
    assert len(issues) == 1 and expected in issues[0], issues
