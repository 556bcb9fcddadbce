"""Evaluation metrics against scikit-learn on random inputs with ties, and against hand-computed cases;
streaming accumulators against the whole-array functions."""
from __future__ import annotations

import math

import numpy as np
import pytest

from flowrec.runtime.evaluation import metrics as em

sk = pytest.importorskip("sklearn.metrics")
pd = pytest.importorskip("pandas")


def _tied(rng: np.random.Generator, n: int, levels: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Labels with a skewed base rate, scores on a coarse grid (many ties), Zipf-like groups."""
    labels = (rng.random(n) < rng.uniform(0.05, 0.6)).astype(np.float64)
    scores = np.round(rng.random(n) * levels) / levels * 0.98 + 0.01 + 0.2 * labels * rng.random(n).round(1)
    scores = np.clip(scores, 0.01, 0.99)
    groups = np.minimum(rng.zipf(1.6, n), 40).astype(np.int64)
    return labels, scores, groups


def _sk_gauc(labels, scores, groups) -> float:
    frame = pd.DataFrame({"y": labels, "p": scores, "g": groups})
    total = weight = 0.0
    for _, part in frame.groupby("g"):
        if part["y"].nunique() == 2:
            total += len(part) * sk.roc_auc_score(part["y"], part["p"])
            weight += len(part)
    return total / weight


@pytest.mark.parametrize("seed", range(6))
def test_binary_metrics_equal_sklearn_with_ties(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels, scores, groups = _tied(rng, int(rng.integers(50, 3000)), int(rng.integers(3, 50)))
    assert em.auc(labels, scores) == pytest.approx(sk.roc_auc_score(labels, scores), abs=1e-12)
    assert em.pr_auc(labels, scores) == pytest.approx(sk.average_precision_score(labels, scores), abs=1e-12)
    assert em.logloss(labels, scores) == pytest.approx(sk.log_loss(labels, scores), abs=1e-12)
    assert em.gauc(labels, scores, groups) == pytest.approx(_sk_gauc(labels, scores, groups), abs=1e-12)
    rate = labels.mean()
    base = -(rate * math.log(rate) + (1 - rate) * math.log(1 - rate))
    assert em.normalized_entropy(labels, scores) == pytest.approx(sk.log_loss(labels, scores) / base, abs=1e-12)
    assert em.calibration(labels, scores) == pytest.approx(scores.mean() / rate, abs=1e-12)


@pytest.mark.parametrize("seed", range(4))
def test_regression_metrics_equal_sklearn(seed: int) -> None:
    rng = np.random.default_rng(seed)
    y, p = rng.normal(size=500).round(1), rng.normal(size=500).round(1)
    assert em.mse(y, p) == pytest.approx(sk.mean_squared_error(y, p), abs=1e-12)
    assert em.mae(y, p) == pytest.approx(sk.mean_absolute_error(y, p), abs=1e-12)


def test_hand_computed_cases() -> None:
    # pairs (pos, neg): (0.35 > 0.1), (0.35 < 0.4), (0.8 > both): 3 of 4
    assert em.auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert em.auc([0, 1], [0.5, 0.5]) == 0.5  # a tie counts one half
    assert math.isnan(em.auc([1, 1], [0.2, 0.3]))
    # thresholds 0.8 (P=1, recall +1/2), 0.4 (a negative: recall +0), 0.35 (P=2/3, recall +1/2)
    assert em.pr_auc([0, 0, 1, 1], [0.1, 0.4, 0.35, 0.8]) == pytest.approx(0.5 + 1 / 3)
    # group 1: AUC 1 over 2 samples; group 2: AUC 0 over 2; group 3 (one class) left out
    assert em.gauc([0, 1, 0, 1, 1], [0.1, 0.9, 0.9, 0.1, 0.5], [1, 1, 2, 2, 3]) == 0.5
    assert em.gauc([0, 1, 1, 0, 1], [0.1, 0.9, 0.2, 0.3, 0.4], [1, 1, 2, 2, 2]) == pytest.approx((2 * 1 + 3 * 0.5) / 5)
    # predicting the base rate 0.25 everywhere: NE = 1, calibration = 1
    labels = np.array([1, 0, 0, 0])
    assert em.normalized_entropy(labels, np.full(4, 0.25)) == pytest.approx(1.0)
    assert em.calibration(labels, np.full(4, 0.5)) == pytest.approx(2.0)
    assert em.logloss([1], [0.5]) == pytest.approx(math.log(2))
    assert em.mse([1, 2], [0, 0]) == 2.5 and em.mae([1, -2], [0, 0]) == 1.5


@pytest.mark.parametrize("seed", range(4))
def test_streaming_equals_whole_arrays(seed: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(em, "COMPACT_EVERY", 97)  # compact often: merged keys must not change results
    rng = np.random.default_rng(100 + seed)
    labels, scores, groups = _tied(rng, 2000, 20)
    acc, reg = em.BinaryAccumulator(grouped=True), em.RegressionAccumulator()
    cuts = np.sort(rng.choice(np.arange(1, 2000), size=12, replace=False))
    for lo, hi in zip(np.r_[0, cuts], np.r_[cuts, 2000]):
        acc.update(labels[lo:hi], scores[lo:hi], groups[lo:hi])
        reg.update(labels[lo:hi], scores[lo:hi])
    got = acc.result()
    assert got["auc"] == pytest.approx(em.auc(labels, scores), abs=1e-12)
    assert got["gauc"] == pytest.approx(em.gauc(labels, scores, groups), abs=1e-12)
    assert got["pr_auc"] == pytest.approx(em.pr_auc(labels, scores), abs=1e-12)
    assert got["logloss"] == pytest.approx(em.logloss(labels, scores), abs=1e-12)
    assert got["ne"] == pytest.approx(em.normalized_entropy(labels, scores), abs=1e-12)
    assert got["calibration"] == pytest.approx(em.calibration(labels, scores), abs=1e-12)
    assert reg.result() == pytest.approx({"mse": em.mse(labels, scores), "mae": em.mae(labels, scores)}, abs=1e-12)


def test_grouped_accumulator_needs_groups() -> None:
    with pytest.raises(ValueError, match="group"):
        em.BinaryAccumulator(grouped=True).update(np.array([0, 1]), np.array([0.2, 0.4]))


def test_undefined_metrics_are_nan() -> None:
    acc = em.BinaryAccumulator()
    acc.update(np.zeros(3), np.array([0.1, 0.2, 0.3]))
    got = acc.result()
    assert math.isnan(got["auc"]) and math.isnan(got["ne"]) and math.isnan(got["calibration"])
    assert got["logloss"] == pytest.approx(em.logloss(np.zeros(3), [0.1, 0.2, 0.3]))


def test_a_group_by_feature_that_is_not_in_the_model_names_only_those_it_can_group_by():
    """`flowrec eval RUN --group-by userid` listed a multi-hot feature among the 'categorical
    features' to group by, which --group-by then refused ('holds up to 20 ids per sample')."""
    from types import SimpleNamespace

    from flowrec.runtime.evaluation.evaluate import GroupByError, group_slot

    fields = [SimpleNamespace(feature="user", table="user", max_len=1),
              SimpleNamespace(feature="hist", table="items", max_len=20)]
    model = SimpleNamespace(groups=[SimpleNamespace(name="g0", fields=fields, bags_per_sample=21,
                                                    field_bags=lambda: {"user": range(0, 1)},
                                                    row_offsets={"items": 0, "user": 50})])
    with pytest.raises(GroupByError, match=r"\(one-id categorical features: user\)$"):
        group_slot(model, "userid")
    with pytest.raises(GroupByError, match="holds up to 20 ids"):
        group_slot(model, "hist")
    assert group_slot(model, "user") == ("g0", 0, 21, 50, False)


def _binary_model_and_batches(users: np.ndarray):
    """A tiny binary model and its staged batches of synthetic rows whose user column is `users`."""
    import pyarrow as pa

    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource, split_table
    from flowrec.data.synth import SynthConfig, synth_table
    from flowrec.planner.manager import make_plan
    from flowrec.runtime.lowering import lower
    from flowrec.spec import spec_from_dict

    spec = spec_from_dict({
        "name": "grouped",
        "features": [{"name": "item", "type": "categorical", "vocab": 30, "dim": 4},
                     {"name": "user", "type": "categorical", "vocab": 20, "dim": 4}],
        "modules": [{"name": "deep", "kind": "mlp", "inputs": ["@sparse"], "layers": [4]}],
        "heads": [{"name": "ctr", "input": "deep", "task": "binary"}],
        "training": {"batch_size": 64, "seed": 3},
    })
    plan = make_plan(spec, target="cpu")
    table = synth_table(spec, len(users), SynthConfig(seed=3))
    table = table.set_column(table.schema.get_field_index("user"), "user", pa.array(users, pa.int64()))
    opts = StagingOptions(batch_size=64, shuffle=False, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        batches = list(it)
    return lower(plan, spec, "cpu"), batches


def test_rows_whose_group_by_value_is_missing_or_unknown_are_no_group() -> None:
    # row 0 holds every missing or unknown value (a user below min_freq, one the vocabulary lacks):
    # gAUC took all those rows for one user (MovieLens, user_id min_freq 100: 0.7136, where the
    # known users' gAUC is 0.7182); now each is a group of its own, left out as a one-sample group
    from flowrec.runtime.evaluation.evaluate import evaluate, predict

    rng = np.random.default_rng(5)
    users = np.where(rng.random(640) < 0.4, 0, rng.integers(1, 21, 640))
    model, batches = _binary_model_and_batches(users)
    got = evaluate(model, batches, group_by="user")["ctr"]["gauc"]
    scores, labels = predict(model, batches)
    known = users != 0
    assert got == pytest.approx(_sk_gauc(labels[known, 0], scores[known, 0], users[known]), abs=1e-12)
    assert got != pytest.approx(_sk_gauc(labels[:, 0], scores[:, 0], users), abs=1e-6)  # the case differs


def test_a_managed_users_dropped_bag_is_row_0_not_the_next_features_id() -> None:
    # a managed table's id without a row (unknown, not admitted, evicted) is dropped from its bag:
    # --group-by read the next bag's id in its place (managed_movielens: 3,418 test rows of unknown
    # users grouped by 634 other ids, item rows among them)
    import torch
    from types import SimpleNamespace

    from flowrec.runtime.evaluation.evaluate import batch_groups

    # samples of (user, item) bags in a group where the user table starts at row 10; sample 1's
    # user and the last sample's user have no row
    ids = torch.tensor([13, 40, 41, 12, 42, 43])
    offsets = torch.tensor([0, 1, 2, 2, 3, 4, 5, 5, 6])
    batch = SimpleNamespace(size=4, groups={"g0": SimpleNamespace(ids=ids, offsets=offsets)})
    assert batch_groups(batch, ("g0", 0, 2, 10, True)).tolist() == [3, -1, 2, -1]
    # a managed table's row 0 is a user like any other (an unmanaged table's: missing or unknown)
    assert batch_groups(batch, ("g0", 1, 2, 40, True)).tolist() == [0, 1, 2, 3]
    assert batch_groups(batch, ("g0", 1, 2, 40, False)).tolist() == [-1, 1, 2, 3]
    nobody = SimpleNamespace(size=2, groups={"g0": SimpleNamespace(ids=torch.tensor([], dtype=torch.int64),
                                                                   offsets=torch.tensor([0, 0, 0]))})
    assert batch_groups(nobody, ("g0", 0, 1, 0, True)).tolist() == [-1, -1]


def test_the_metrics_table_shows_small_and_huge_values_with_their_digits() -> None:
    """A regression head of rates (mse 3.2e-06, mae 0.0012) showed mse 0.0000, as if exact, and a
    diverged one (mse 4.4e+48) a 49-digit cell that pushed the table far past the terminal."""
    from flowrec.cli.metrics_table import metrics_table

    head, small, huge = metrics_table({"rate": {"mse": 3.2e-06, "mae": 0.0012, "samples": 5},
                                       "wild": {"mse": 4.3843e48, "mae": 0.0, "samples": 3}})
    assert small.split()[1:] == ["3.2000e-06", "0.0012", "5"]
    assert huge.split()[1:] == ["4.3843e+48", "0.0000", "3"] and len(huge) < 40


def test_metrics_undefined_on_one_class_of_labels_are_said_why(capsys) -> None:
    """Evaluation rows of one class (every label 0) showed '-' for auc, pr_auc, ne and calibration
    (null in --json) with no word of why, in flowrec eval as in train's evaluations."""
    from flowrec.runtime.evaluation.undefined import undefined_notes
    from flowrec.cli.train_cmds import _write_metrics

    nan = float("nan")
    zeros = {"ctr": {"auc": nan, "pr_auc": nan, "logloss": 0.75, "ne": nan, "calibration": nan, "samples": 300},
             "val": {"mse": 1.0, "mae": 0.8, "samples": 300}}
    _write_metrics(zeros, None)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: ctr: every evaluation label is 0 (300 rows): auc, pr_auc, ne and calibration are "
                   "undefined ('-' in the table, null in JSON)"]
    ones = {"ctr": {"auc": nan, "gauc": nan, "pr_auc": 1.0, "ne": nan, "calibration": 0.9, "samples": 5}}
    assert "every evaluation label is 1 (5 rows): auc, gauc and ne are" in undefined_notes(ones)[0]
    groups = {"ctr": {"auc": 0.6, "gauc": nan, "pr_auc": 0.5, "ne": 0.9, "calibration": 1.0, "samples": 5}}
    assert "no group of the evaluation rows holds both classes (5 rows): gauc is" in undefined_notes(groups)[0]
    assert undefined_notes({"ctr": {**groups["ctr"], "gauc": 0.7}}) == []


def test_data_inspect_shows_a_rare_label_mean_with_its_digits() -> None:
    """data inspect showed the label mean of a conversion label of 1 positive in 40,000 rows as 0.0000,
    as if no row were positive, and a regression label's 6.6e+26 as a 33-digit cell."""
    from flowrec.cli.data_cmds import inspect_table

    columns = [{"name": n, "type": "float", "missing": 0, "unique": 2, "raw_missing": None, "label_mean": m,
                "distinct_raw": None, "occupied_rows": None} for n, m in (("cvr", 2.5e-05), ("y", 6.6181e26))]
    cvr, y = (line.split() for line in inspect_table(columns, True)[1:])
    assert cvr[-3] == "2.5000e-05" and y[-3] == "6.6181e+26"


def test_nan_scores_leave_the_ranking_metrics_undefined() -> None:
    """A model of non-finite parameters scores NaN; np.unique sorts NaN above every score, so the
    binary head reported auc 0.5069 and pr_auc 0.5065 of NaN scores, and a multiclass head accuracy
    1.0 (a NaN probability ranks below nothing); now they are NaN, said in one line."""
    from flowrec.runtime.evaluation.undefined import undefined_notes
    from flowrec.runtime.evaluation.classes import MulticlassAccumulator

    labels, groups = np.array([0, 1, 0, 1]), np.array([1, 1, 2, 2])
    acc = em.BinaryAccumulator(grouped=True)
    acc.update(labels, np.array([0.1, np.nan, 0.3, 0.9]), groups)
    out = acc.result()
    assert all(math.isnan(out[m]) for m in ("auc", "pr_auc", "gauc", "logloss"))
    clean = em.BinaryAccumulator(grouped=True)
    clean.update(labels, np.array([0.1, 0.2, 0.3, 0.9]), groups)
    assert clean.result()["auc"] == 0.75 and clean.result()["gauc"] == 1.0
    multi = MulticlassAccumulator()
    multi.update(np.array([0, 1, 2]), np.array([[np.nan] * 3, [0.1, 0.8, 0.1], [0.2, 0.2, 0.6]]))
    assert math.isnan(multi.result()["accuracy"]) and math.isnan(multi.result()["accuracy_at_k"])
    line, = undefined_notes({"ctr": {**out, "ne": math.nan, "calibration": math.nan, "samples": 4}})
    assert line.startswith("ctr: the model scored NaN for some of the 4 evaluation rows")
