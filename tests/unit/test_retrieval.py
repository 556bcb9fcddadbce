"""Retrieval heads: the softmax losses against hand computations, training against a plain
PyTorch reference, the ranking metrics against brute force, and the spec's one-line errors.

The reference trains flowrec's unpacked reference model (per-table `nn.EmbeddingBag`, autograd,
torch.optim SGD) with the retrieval loss written out row by row here (float64); flowrec trains
with its packed table, fused sparse update and `operators.retrieval`.
"""
from __future__ import annotations

import math
import random
from dataclasses import replace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from torch.nn import functional as F

from flowrec.data.batches import StagingOptions, iterate_batches
from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.planner.manager import make_plan
from flowrec.runtime.evaluation.retrieval import RankingAccumulator, ranking_metrics
from flowrec.runtime.evaluation.evaluate import evaluate
from flowrec.runtime.lowering import lower
from flowrec.measure.reference import ReferenceModel, reference_optimizers
from flowrec.runtime.retrieval import batch_items, catalogue_vectors, draw_negatives, item_counts, sampler
from flowrec.runtime.step import make_dense_optimizer, train_step
from flowrec.spec import spec_from_dict
from flowrec.spec.validate import validate_document
from operators.retrieval import Candidates, in_batch_softmax, sampled_softmax

BATCH = 32
ITEMS = 60


def _logsumexp(values: list[float]) -> float:
    top = max(values)
    return top + math.log(sum(math.exp(v - top) for v in values))


def _score(q: torch.Tensor, v: torch.Tensor, metric: str, temperature: float) -> float:
    if metric == "cosine":
        return float(q @ v) / (float(q.norm()) * float(v.norm())) / temperature
    return float(q @ v) / temperature


def hand_in_batch(q, v, items, metric, temperature, log_q=None) -> list[float]:
    """Row i: -log softmax over the batch's items, duplicates of item i (other rows) left out."""
    out = []
    for i in range(len(items)):
        logits = []
        for j in range(len(items)):
            if j != i and items[j] == items[i]:
                continue
            s = _score(q[i], v[j], metric, temperature) - (float(log_q[items[j]]) if log_q is not None else 0.0)
            logits.append((j == i, s))
        pos = next(s for own, s in logits if own)
        out.append(_logsumexp([s for _, s in logits]) - pos)
    return out


def hand_sampled(q, v, items, neg_v, neg_ids, metric, temperature, log_q=None) -> list[float]:
    """Row i: -log softmax over [its item, the sampled items other than its item], each logit
    lowered by log(N p) with logQ."""
    n = len(neg_ids)
    corr = (lambda item: math.log(n * math.exp(float(log_q[item])))) if log_q is not None else (lambda item: 0.0)
    out = []
    for i in range(len(items)):
        pos = _score(q[i], v[i], metric, temperature) - corr(int(items[i]))
        negs = [_score(q[i], neg_v[k], metric, temperature) - corr(int(neg_ids[k]))
                for k in range(n) if int(neg_ids[k]) != int(items[i])]
        out.append(_logsumexp([pos] + negs) - pos)
    return out


def _random_case(gen, b=12, d=5, n=9, vocab=7):
    q = torch.randn(b, d, generator=gen, dtype=torch.float64) * 2
    v = torch.randn(b, d, generator=gen, dtype=torch.float64)
    items = torch.randint(1, vocab, (b,), generator=gen)  # few items: duplicates for sure
    neg_ids = torch.randint(1, vocab, (n,), generator=gen)
    # an accidental hit for sure: 9 draws of 6 ids missed the 12 rows' items once in 65,000 (seed 19482)
    neg_ids[int(torch.randint(0, n, (), generator=gen))] = items[int(torch.randint(0, b, (), generator=gen))]
    neg_v = torch.randn(n, d, generator=gen, dtype=torch.float64)
    probs = torch.rand(vocab, generator=gen, dtype=torch.float64) ** 3 + 1e-3
    return q, v, items, neg_ids, neg_v, torch.log(probs / probs.sum())


@pytest.mark.parametrize("metric,temperature", [("dot", 1.0), ("cosine", 0.07)])
@pytest.mark.parametrize("logq", [False, True])
def test_in_batch_softmax_equals_the_masked_reference(metric, temperature, logq):
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    q, v, items, _, _, log_q = _random_case(gen)
    assert len(set(items.tolist())) < len(items)  # duplicates present
    lq = log_q if logq else None
    ours = in_batch_softmax(q, v, items, metric, temperature, lq)
    assert ours.dtype == torch.float64
    assert ours.tolist() == pytest.approx(hand_in_batch(q, v, items, metric, temperature, lq), rel=1e-12)


@pytest.mark.parametrize("metric,temperature", [("dot", 0.5), ("cosine", 0.1)])
@pytest.mark.parametrize("logq", [False, True])
def test_sampled_softmax_equals_a_hand_computation(metric, temperature, logq):
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    q, v, items, neg_ids, neg_v, log_q = _random_case(gen)  # accidental hits present
    cand = Candidates(neg_v, neg_ids, log_q if logq else None, len(neg_ids))
    ours = sampled_softmax(q, v, items, cand, metric, temperature)
    expected = hand_sampled(q, v, items, neg_v, neg_ids, metric, temperature, log_q if logq else None)
    assert ours.tolist() == pytest.approx(expected, rel=1e-12)


def test_log_q_changes_the_loss():
    """The correction is applied (skewed frequencies): the two losses differ."""
    gen = torch.Generator().manual_seed(random.randrange(1 << 30))
    q, v, items, neg_ids, neg_v, log_q = _random_case(gen)
    plain = in_batch_softmax(q, v, items, "dot", 1.0)
    assert not torch.allclose(plain, in_batch_softmax(q, v, items, "dot", 1.0, log_q))


def retrieval_doc(seed: int, negatives: dict, logq: bool, tower: bool = True) -> dict:
    modules = [{"name": "user_tower", "kind": "mlp", "inputs": ["user", "age"], "layers": [8]}]
    if tower:
        modules.append({"name": "item_tower", "kind": "mlp", "inputs": ["item"], "layers": [8]})
    modules.append({"name": "score", "kind": "similarity", "inputs": ["user_tower", "item_tower" if tower else "item"],
                    "metric": "cosine", "temperature": 0.2})
    return {
        "name": "two_tower",
        "features": [
            {"name": "user", "type": "categorical", "vocab": 40, "dim": 8},
            {"name": "age", "type": "categorical", "vocab": 5, "dim": 8},
            {"name": "item", "type": "categorical", "vocab": ITEMS, "dim": 8},
        ],
        "modules": modules,
        "heads": [{"name": "retrieve", "input": "score", "task": "retrieval", "negatives": negatives,
                   "logq_correction": logq, "top_k": [5, 20]}],
        "optimizer": {"dense": {"name": "sgd", "lr": 0.3}, "sparse": {"name": "sgd", "lr": 0.3}},
        "training": {"batch_size": BATCH, "seed": seed},
    }


def staged(spec, plan, seed: int, steps: int, negatives=None):
    table = synth_table(spec, BATCH * steps, SynthConfig(seed=seed, alpha=1.2))
    source = MemorySource(split_table(table, 2))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, workers=1)
    with iterate_batches(spec, source, opts, 0, 0, plan.meta.groups, negatives=negatives) as it:
        batches = [replace(b, dense=b.dense.double(), labels=b.labels.double()) for b in it]
    return batches, table, source


def reference_loss(ref: ReferenceModel, batch, items: torch.Tensor, binding, negs, spec) -> torch.Tensor:
    """The retrieval loss of the reference model, row by row (float64)."""
    out = ref(batch)  # (B, 2D): query | item tower
    d = out.shape[1] // 2
    q, v = out[:, :d], out[:, d:]
    log_q = binding.log_q
    temp = 0.2  # the cosine metric of `retrieval_doc`
    if negs is None:
        rows = []
        for i in range(len(items)):
            keep = [j for j in range(len(items)) if j == i or items[j] != items[i]]
            s = torch.stack([F.cosine_similarity(q[i], v[j], dim=0) / temp
                             - (log_q[items[j]] if log_q is not None else 0.0) for j in keep])
            rows.append(torch.logsumexp(s, 0) - s[keep.index(i)])
        return torch.stack(rows).mean()
    rows_emb = ref.table("item").weight[negs]  # the sampled items' rows, through the item tower
    neg_v = ref.dense_model.ops["item_tower"](rows_emb)
    n = len(negs)
    zero = torch.zeros((), dtype=torch.float64)
    corr = (lambda t: log_q[t] + math.log(n)) if log_q is not None else (lambda t: zero)
    rows = []
    for i in range(len(items)):
        keep = [k for k in range(n) if negs[k] != items[i]]
        pos = F.cosine_similarity(q[i], v[i], dim=0) / temp - corr(items[i])
        s = torch.stack([pos] + [F.cosine_similarity(q[i], neg_v[k], dim=0) / temp - corr(negs[k]) for k in keep])
        rows.append(torch.logsumexp(s, 0) - pos)
    return torch.stack(rows).mean()


@pytest.mark.parametrize("negatives,logq", [
    ({"kind": "in_batch"}, True),
    ({"kind": "sampled", "num": 16, "distribution": "unigram"}, True),
    ({"kind": "sampled", "num": 16, "distribution": "uniform"}, False),
])
def test_training_equals_the_reference(negatives, logq):
    """Ten SGD steps of flowrec (packed table, fused update; sampled items in the item group's one
    lookup) equal a plain PyTorch two-tower trained with the hand-written loss."""
    seed = random.randrange(1 << 30)
    spec = spec_from_dict(retrieval_doc(seed % 1000, negatives, logq))
    plan = make_plan(spec, target="cpu")
    batches, table, source = staged(spec, plan, seed, 10)
    model = lower(plan, spec, "cpu").double()
    binding = model.retrieval
    counts = item_counts(source, "item")
    seen = np.unique(table.column("item"))
    assert counts.sum() == BATCH * 10 and np.array_equal(counts[: ITEMS + 1].nonzero()[0], seen)
    binding.set_counts(counts, torch.device("cpu"))
    binding.probs, binding.log_q = (binding.probs.double(),
                                    binding.log_q.double() if binding.log_q is not None else None)
    ours_batches = batches  # sampled: staged again, the data stage drawing the negatives into the item group
    if binding.sampled:
        ours_batches = staged(spec, plan, seed, 10, sampler(binding, model.noise_seed))[0]
    optimizer = make_dense_optimizer(model, "sgd", 0.3, {})
    ref = ReferenceModel(plan, spec).double()
    ref_opts = reference_optimizers(ref, spec)
    for batch, own in zip(batches, ours_batches, strict=True):
        items = batch_items(binding, batch)
        assert items.tolist() == table.column("item").to_pylist()[batch.index * BATCH:(batch.index + 1) * BATCH]
        negs = draw_negatives(binding, model.noise_seed, batch) if binding.sampled else None
        assert negs is None or torch.equal(own.negatives, negs)
        assert torch.equal(batch_items(binding, own), items)
        ours = train_step(model, optimizer, own)
        for opt in ref_opts:
            opt.zero_grad(set_to_none=True)
        theirs = reference_loss(ref, batch, items, binding, negs, spec)
        theirs.backward()
        for opt in ref_opts:
            opt.step()
        assert ours == pytest.approx(float(theirs.detach()), rel=1e-9), f"seed {seed}"
    ref_params = dict(ref.dense_model.ops.named_parameters())
    for name, p in model.ops.named_parameters():
        torch.testing.assert_close(p, ref_params[name].detach(), rtol=1e-7, atol=1e-9,
                                   msg=lambda m: f"seed {seed}: {name}: {m}")
    for group in model.groups:
        for slot in group.tables:
            torch.testing.assert_close(model.embeddings[group.name].table_rows(slot.table),
                                       ref.table(slot.table).weight.detach(), rtol=1e-7, atol=1e-9)


def brute_force(query, catalogue, items, groups, top_k):
    """Full sort of every query's scores; per-user top-K lists; recall and NDCG from the lists."""
    scores = query @ catalogue.T  # (B, V), item r at column r - 1
    out = {}
    users = sorted(set(groups.tolist()))
    for k in top_k:
        hits, recalls, ndcgs = [], [], []
        for u in users:
            rows = np.flatnonzero(groups == u)
            order = sorted(range(len(catalogue)), key=lambda c: (-scores[rows[0], c], c))
            top = [c + 1 for c in order[:k]]
            relevant = set(items[rows].tolist())
            for r in rows:  # a row's own ranking (same query for a user here)
                own = sorted(range(len(catalogue)), key=lambda c: -scores[r, c])
                hits.append(1.0 if own.index(items[r] - 1) < k else 0.0)
            recalls.append(len(relevant & set(top)) / len(relevant))
            dcg = sum(1 / math.log2(i + 2) for i, c in enumerate(top) if c in relevant)
            ideal = sum(1 / math.log2(i + 2) for i in range(min(len(relevant), k)))
            ndcgs.append(dcg / ideal)
        out[f"hr@{k}"], out[f"recall@{k}"], out[f"ndcg@{k}"] = np.mean(hits), np.mean(recalls), np.mean(ndcgs)
    ranks = [sorted(range(len(catalogue)), key=lambda c: -scores[r, c]).index(items[r] - 1) for r in range(len(items))]
    out["mrr"] = float(np.mean([1 / (x + 1) for x in ranks]))
    return out


@pytest.mark.parametrize("duplicates", [False, True])
def test_ranking_metrics_equal_brute_force(duplicates):
    start = random.randrange(1 << 30)
    for seed in range(start, start + 100):  # a case of hits and misses both (a few draws of 100 have none)
        case = _ranking_case(seed, duplicates)
        if 0 < case[-1]["recall@10"] < 1:
            break
    acc, items, query, groups, order, expected = case
    for part in np.array_split(order, 4):
        acc.update(items[part], np.concatenate([query[part], np.zeros_like(query[part])], 1), groups[part])
    ours = acc.result()
    assert set(ours) == set(expected)
    for name, value in expected.items():
        assert ours[name] == pytest.approx(value, abs=1e-12), f"{name}, seed {seed}"
    assert 0 < ours["recall@10"] < 1 and ours["ndcg@10"] > 0  # hits and misses both (a few users of 9 at least)


def _ranking_case(seed, duplicates):
    """A skewed catalogue, users' queries and items of `seed`: (an accumulator over the catalogue,
    items, query rows, group ids, the rows' order over batches, the brute-force metrics)."""
    rng = np.random.default_rng(seed)
    users, per_user, vocab, d = 9, 4, 50, 6
    while True:  # multiples of 1/8: every score is exact, whatever the summation order; no ties
        user_q = rng.integers(-40, 41, size=(users, d)) / 8
        catalogue = (rng.integers(-40, 41, size=(vocab, d)) + 4 * (np.arange(vocab) % 5)[:, None]) / 8  # skewed
        scores = user_q @ catalogue.T
        if all(len(set(row)) == vocab for row in scores.tolist()):
            break
    groups = np.repeat(np.arange(users) * 7 + 3, per_user)
    query = np.repeat(user_q, per_user, axis=0)
    items = np.concatenate([rng.choice(np.arange(1, vocab + 1), per_user, replace=False) for _ in range(users)])
    if duplicates:  # a user's rows repeat some of their items (each user: 2 distinct items in 4 rows)
        items = np.concatenate([np.repeat(items[u * per_user:u * per_user + 2], 2) for u in range(users)])
    acc = RankingAccumulator(torch.from_numpy(catalogue), "dot", 1.0, (3, 10))
    order = rng.permutation(len(items))  # rows of a user spread over batches
    return acc, items, query, groups, order, brute_force(query, catalogue, items, groups, (3, 10))


def test_ranking_metrics_per_row_and_outside_the_catalogue():
    ranks = np.array([0, 4, 50])  # the last: an item outside a catalogue of 50
    out = ranking_metrics(ranks, np.arange(3), 50, (1, 5))
    assert out["hr@1"] == out["recall@1"] == pytest.approx(1 / 3)
    assert out["hr@5"] == pytest.approx(2 / 3)
    assert out["ndcg@5"] == pytest.approx((1 + 1 / math.log2(6)) / 3)
    assert out["mrr"] == pytest.approx((1 + 1 / 5) / 3)


def test_ranking_metrics_count_a_users_items_once_and_one_per_place():
    # user 7: item 5 in two rows (rank 0 both) and item 9 (rank 3); user 8: item 2 (rank 1)
    out = ranking_metrics(np.array([0, 0, 3, 1]), np.array([7, 7, 7, 8]), 50, (1, 5), np.array([5, 5, 9, 2]))
    assert out["hr@1"] == pytest.approx(2 / 4) and out["hr@5"] == 1.0  # rows
    assert out["recall@1"] == pytest.approx((1 / 2 + 0) / 2)
    assert out["ndcg@1"] == pytest.approx((1 + 0) / 2)
    assert out["recall@5"] == 1.0
    u7 = (1 + 1 / math.log2(5)) / (1 + 1 / math.log2(3))
    assert out["ndcg@5"] == pytest.approx((u7 + 1 / math.log2(3)) / 2)
    # per-row queries: two items of one user both rank first in their own rows' rankings
    out = ranking_metrics(np.array([0, 0]), np.array([1, 1]), 50, (1, 2), np.array([3, 4]))
    assert out["recall@1"] == pytest.approx(1 / 2) and out["ndcg@1"] == 1.0
    assert out["recall@2"] == 1.0 and out["ndcg@2"] == pytest.approx(1.0)
    # a catalogue of one item: 40 rows of it for one user, an unknown item (rank 1 = outside) for another
    ranks, groups, items = np.array([0] * 40 + [1]), np.array([0] * 40 + [1]), np.array([1] * 40 + [0])
    out = ranking_metrics(ranks, groups, 1, (1, 100000), items)
    for k in (1, 100000):
        assert out[f"hr@{k}"] == pytest.approx(40 / 41)
        assert out[f"recall@{k}"] == pytest.approx(1 / 2) and out[f"ndcg@{k}"] == pytest.approx(1 / 2)


def test_rows_of_items_outside_the_catalogue_are_distinct_items_of_their_user():
    # user 3: item 5 ranked first and two rows of unknown items (both encoded as row 0, whichever raw
    # ids they held): one of three items found, where counting the unknown rows as one item said 1/2
    ranks, groups, items = np.array([0, 50, 50]), np.array([3, 3, 3]), np.array([5, 0, 0])
    out = ranking_metrics(ranks, groups, 50, (1, 10), items)
    assert out["recall@1"] == out["recall@10"] == pytest.approx(1 / 3)
    assert out["ndcg@10"] == pytest.approx(1 / (1 + 1 / math.log2(3) + 1 / math.log2(4)))
    assert out["hr@10"] == pytest.approx(1 / 3) and out["mrr"] == pytest.approx(1 / 3)
    # the accumulator: unknown items, and a row no raw id was fitted to, are outside alike
    acc = RankingAccumulator(torch.eye(3), "dot", 1.0, (1,), named=np.array([1, 2]))
    acc.update(np.array([1, 0, 3]), np.array([[1.0, 0, 0, 0, 0, 0]] * 3), np.array([9, 9, 9]))
    assert acc.result()["recall@1"] == pytest.approx(1 / 3)


def test_ranking_metrics_stay_in_the_unit_interval():
    seed = random.randrange(1 << 30)
    rng = np.random.default_rng(seed)
    for _ in range(50):
        n, vocab = int(rng.integers(1, 40)), int(rng.integers(1, 8))
        ranks = rng.integers(0, vocab + 1, n)  # incoherent per-row ranks, some outside the catalogue
        out = ranking_metrics(ranks, rng.integers(0, 3, n), vocab, (1, 2, 100), rng.integers(0, vocab + 1, n))
        assert all(0.0 <= v <= 1.0 + 1e-12 for v in out.values()), (seed, out)


def test_evaluation_scores_the_whole_catalogue():
    spec = spec_from_dict(retrieval_doc(1, {"kind": "in_batch"}, False))
    plan = make_plan(spec, target="cpu")
    batches, table, _ = staged(spec, plan, 5, 3)
    model = lower(plan, spec, "cpu")
    cat = catalogue_vectors(model, model.retrieval)
    assert cat.shape == (ITEMS, 8)
    rows = model.embeddings[model.retrieval.group].table_rows("item")[1:ITEMS + 1]
    torch.testing.assert_close(cat, model.ops["item_tower"](rows))  # the item tower on every row
    metrics = evaluate(model, batches)["retrieve"]
    assert set(metrics) == {"hr@5", "recall@5", "ndcg@5", "hr@20", "recall@20", "ndcg@20", "mrr", "samples"}
    assert metrics["samples"] == 3 * BATCH and 0 <= metrics["hr@5"] <= metrics["hr@20"] <= 1


def test_seen_items_are_left_out_for_a_user_table_packed_after_the_items():
    # features listed item first: the user table's rows follow the item table's in the packed group,
    # and evaluation grouped by the batch's packed user rows while the training pairs hold the
    # dataset's own rows, so exclude_seen left out nothing (another user's items where they met)
    from flowrec.runtime.evaluation.evaluate import batch_groups, group_slot
    from flowrec.runtime.evaluation.retrieval import SeenItems

    doc = retrieval_doc(1, {"kind": "in_batch"}, False)
    doc["features"] = doc["features"][::-1]  # item, age, user
    doc["heads"][0]["exclude_seen"] = True
    doc["training"]["eval_group_by"] = "user"
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    batches, table, source = staged(spec, plan, 5, 3)
    model = lower(plan, spec, "cpu")
    slot = group_slot(model, "user")
    assert slot[3] > 0  # the case: the user table does not start the packed group
    users = np.concatenate([batch_groups(b, slot) for b in batches])
    assert users.tolist() == table.column("user").to_numpy().tolist()  # the dataset's rows
    seen = SeenItems.of(source, "user", "item")
    excluding = evaluate(model, batches, group_by="user", seen=seen)["retrieve"]
    nothing = SeenItems(np.zeros(0, np.int64), np.zeros(0, np.int64))
    plain = evaluate(model, batches, group_by="user", seen=nothing)["retrieve"]
    assert excluding["mrr"] > plain["mrr"]  # each user's other items (all seen) left out


def test_rows_of_an_unknown_user_are_each_a_user_of_their_own():
    # every row's user is row 0 (unknown, or below min_freq): ranked as one user of all their
    # items, recall@K and ndcg@K were one list's; now each row is its own user, as without grouping
    import pyarrow as pa

    spec = spec_from_dict(retrieval_doc(1, {"kind": "in_batch"}, False))
    plan = make_plan(spec, target="cpu")
    table = synth_table(spec, BATCH * 3, SynthConfig(seed=5, alpha=1.2))
    table = table.set_column(table.schema.get_field_index("user"), "user", pa.array(np.zeros(len(table), np.int64)))
    opts = StagingOptions(batch_size=BATCH, shuffle=False, workers=1)
    with iterate_batches(spec, MemorySource(split_table(table, 2)), opts, 0, 0, plan.meta.groups) as it:
        batches = list(it)
    model = lower(plan, spec, "cpu")
    grouped = evaluate(model, batches, group_by="user")["retrieve"]
    assert grouped == evaluate(model, batches)["retrieve"]
    assert grouped["recall@5"] == grouped["hr@5"]


def test_seen_items_of_a_managed_user_table_are_keyed_by_the_users_rows():
    # a managed table's dataset column holds raw ids, a batch the rows they map to: exclude_seen
    # looked the batch's rows up among raw ids and left nothing out (MovieLens two tower with a
    # managed users table: hr@10 0.048, as without exclude_seen, where it is 0.150)
    from types import SimpleNamespace

    from flowrec.runtime.evaluation.evaluate import _seen_in_rows
    from flowrec.runtime.evaluation.retrieval import SeenItems

    raw = np.array([-7421493550786470257, 5490914285300799158, 5490914285300799158, 77])
    seen = SeenItems(raw, np.array([3, 1, 2, 5]))
    rows = {5490914285300799158: 0, -7421493550786470257: 4}  # 77: not admitted, no row
    synced = []
    users_map = SimpleNamespace(lookup=lambda ids: np.array([rows.get(int(i), -1) for i in ids]))
    model = SimpleNamespace(
        groups=[SimpleNamespace(fields=[SimpleNamespace(feature="item", table="item"),
                                        SimpleNamespace(feature="user", table="users")])],
        managed=SimpleNamespace(maps={"users": users_map}, owners={}, sync=lambda: synced.append(True)))
    mapped = _seen_in_rows(model, "user", seen)
    assert synced and list(zip(mapped.users.tolist(), mapped.items.tolist())) == [(0, 1), (0, 2), (4, 3)]
    mask = mapped.mask(np.array([0, 4, -1]), 5)
    assert mask.nonzero().tolist() == [[0, 0], [0, 1], [1, 2]]  # a row without a user: nothing


def test_an_evaluation_during_training_ranks_the_catalogue_in_eval_mode():
    # An item tower with dropout and batch norm: training's evaluations and export (the model in
    # train mode) put the catalogue through the tower with dropout on and the batch statistics of
    # the catalogue's items, which also moved the running statistics.
    doc = retrieval_doc(1, {"kind": "in_batch"}, False)
    doc["modules"][1].update(dropout=0.5, norm="batch")
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    batches, _, _ = staged(spec, plan, 5, 3)
    model = lower(plan, spec, "cpu")
    state = {k: v.clone() for k, v in model.state_dict().items()}
    model.train()
    during_training = evaluate(model, batches)["retrieve"]
    assert model.training
    for key, value in model.state_dict().items():
        torch.testing.assert_close(value, state[key], rtol=0, atol=0, msg=key)  # running statistics unchanged
    vectors = catalogue_vectors(model, model.retrieval)
    model.eval()
    assert during_training == evaluate(model, batches)["retrieve"]
    torch.testing.assert_close(vectors, catalogue_vectors(model, model.retrieval), rtol=0, atol=0)


@pytest.mark.parametrize("change,where,says", [
    ({"negatives": {"kind": "sampled"}}, "heads[0].negatives.num", "need num"),
    ({"negatives": {"kind": "in_batch", "num": 5}}, "heads[0].negatives.num", "for sampled"),
    ({"negatives": {"kind": "random"}}, "heads[0].negatives.kind", "must be one of"),
    ({"top_k": [0]}, "heads[0].top_k[0]", ">= 1"),
    ({"input": "user_tower"}, "heads[0].input", "reads a similarity module"),
    ({"task": "binary"}, "heads[0].negatives", "only a retrieval head"),
    # a K past the catalogue validated and reported hr@K = 1.0 for any model
    ({"top_k": [5, ITEMS]}, "heads[0].top_k", f"K {ITEMS} is not below the catalogue's {ITEMS} items"),
    ({"top_k": [ITEMS * 10]}, "heads[0].top_k", f"hr@{ITEMS * 10} and recall@{ITEMS * 10} would be 1.0"),
])
def test_bad_retrieval_fields_are_one_line_errors(change, where, says):
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    doc["heads"][0].update(change)
    issues = validate_document(doc)
    assert any(i.path == where and says in i.message for i in issues), issues
    assert all("\n" not in str(i) for i in issues)


def test_a_catalogue_of_one_item_is_not_told_to_take_ks_below_1():
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    doc["features"][2]["vocab"] = 1
    issues = validate_document(doc)
    assert [i.path for i in issues] == ["heads[0].top_k"] and "one item has nothing to rank" in issues[0].message
    assert "below 1" not in issues[0].message



def test_the_default_top_k_keeps_the_ks_below_the_catalogue():
    # the default [10, 100] over 60 items reported hr@100 = 1.0 for any model: its Ks are those below
    # the catalogue's size ([10] here; [1] up to 10 items), a written K past it is refused
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    del doc["heads"][0]["top_k"]
    for vocab, spare, top_k in ((ITEMS, 0, (10,)), (100, 1, (10, 100)), (100, 0, (10,)), (8, 0, (1,)), (5000, 0, (10, 100))):
        doc["features"][2]["vocab"] = vocab
        doc["features"][2]["vocab_spare"] = spare  # spare rows take new items
        assert validate_document(doc) == []
        assert spec_from_dict(doc).heads[0].retrieval.top_k == top_k
    doc["training"]["early_stopping"] = {"metric": "hr@100"}  # not reported over 100 items
    issues = validate_document(doc | {"features": [*doc["features"][:2], {**doc["features"][2], "vocab": 100}]})
    assert [i.path for i in issues] == ["training.early_stopping.metric"] and "hr@10," in issues[0].message
    assert "hr@100" not in issues[0].message
    doc["features"][2]["vocab"] = 1  # a catalogue of one item: nothing to rank, whatever the default
    assert any(i.path == "heads[0].top_k" and "one item has nothing to rank" in i.message
               for i in validate_document(doc))


def test_item_tower_must_read_one_item_id():
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    doc["modules"][1]["inputs"] = ["item", "age"]
    issues = validate_document(doc)
    assert [(i.path, "exactly one feature" in i.message) for i in issues] == [("heads[0].input", True)]
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    doc["training"]["early_stopping"] = {"metric": "hr@50"}
    issues = validate_document(doc)
    assert [i.path for i in issues] == ["training.early_stopping.metric"] and "hr@5" in issues[0].message


def test_ranking_metrics_are_maximised_by_early_stopping():
    from flowrec.runtime.evaluation.early_stop import EarlyStopper
    from flowrec.spec.model import EarlyStoppingSpec

    for metric in ("hr@100", "recall@10", "ndcg@10", "mrr"):
        assert EarlyStopper.of(EarlyStoppingSpec(metric), "retrieve").mode == "max"
    assert EarlyStopper.of(EarlyStoppingSpec("logloss"), "ctr").mode == "min"


@pytest.mark.parametrize("where", [("heads", 0, "task"), ("heads", 0, "input"), ("heads", 0, "negatives"),
                                   ("heads", 0, "top_k"), ("modules", 1, "inputs"), ("modules", 2, "inputs"),
                                   ("modules", 2, "kind"), ("features", 2, "table"), ("features", 2, "max_len"),
                                   ("training", None, "early_stopping")])
def test_hostile_values_in_a_retrieval_spec_are_one_line_errors(where):
    import copy

    for value in (None, 1.5, [1], {"a": 1}, "x", -3, True, "item", "score"):
        doc = copy.deepcopy(retrieval_doc(0, {"kind": "in_batch"}, False))
        node = doc[where[0]] if where[1] is None else doc[where[0]][where[1]]
        node[where[2]] = value
        issues = validate_document(doc)  # never an exception
        assert all("\n" not in str(i) for i in issues), (where, value)


def test_seen_items_are_left_out_of_each_users_ranking():
    """Brute force: drop the user's training items (not the positive) from the catalogue, rank."""
    from flowrec.runtime.evaluation.retrieval import SeenItems

    rng = np.random.default_rng(random.randrange(1 << 30))
    vocab, d, users = 40, 5, 6
    catalogue = torch.from_numpy(rng.integers(-20, 21, size=(vocab, d)) / 4)
    query = rng.integers(-20, 21, size=(users, d)) / 4
    train_users = rng.integers(0, users, 150)
    train_items = rng.integers(1, vocab + 1, 150)
    seen = SeenItems(train_users, train_items)
    groups = np.arange(users).repeat(3)
    items = rng.integers(1, vocab + 1, len(groups))
    outputs = np.concatenate([query[groups], np.zeros((len(groups), d))], 1)
    plain, excluding = (RankingAccumulator(catalogue, "dot", 1.0, (5,), s) for s in (None, seen))
    for acc in (plain, excluding):
        acc.update(items, outputs, groups)
    scores = query[groups] @ catalogue.numpy().T
    ranks = []
    for r, u in enumerate(groups):
        dropped = set(train_items[train_users == u].tolist()) - {int(items[r])}
        keep = [c for c in range(vocab) if c + 1 not in dropped and c + 1 != items[r]]
        ranks.append(int(sum(scores[r, c] >= scores[r, items[r] - 1] for c in keep)))
    assert np.concatenate(excluding.ranks).tolist() == ranks
    assert sum(ranks) < int(np.concatenate(plain.ranks).sum())  # something was left out
    assert excluding.result()["hr@5"] >= plain.result()["hr@5"]


@pytest.mark.parametrize("exclude", [False, True])
def test_only_the_rows_that_hold_an_item_are_ranked(exclude):
    """Brute force: with `named` (the rows a raw id was fitted to) the other rows are neither
    counted above a positive nor in a top K, as serving never recommends them; a positive on such
    a row ranks last; seen items are left out on the named rows."""
    from flowrec.runtime.evaluation.retrieval import SeenItems

    rng = np.random.default_rng(random.randrange(1 << 30))
    vocab, d, users = 30, 4, 5
    catalogue = torch.from_numpy(rng.integers(-20, 21, size=(vocab, d)) / 4)
    named = np.sort(rng.choice(np.arange(1, vocab + 1), 18, replace=False))
    train_users, train_items = rng.integers(0, users, 60), rng.integers(1, vocab + 1, 60)
    seen = SeenItems(train_users, train_items) if exclude else None
    groups = np.arange(users).repeat(4)
    items = np.where(rng.random(len(groups)) < 0.8, rng.choice(named, len(groups)), rng.integers(0, vocab + 1))
    query = rng.integers(-20, 21, size=(users, d)) / 4
    outputs = np.concatenate([query[groups], np.zeros((len(groups), d))], 1)
    acc = RankingAccumulator(catalogue, "dot", 1.0, (3,), seen, named)
    acc.update(items, outputs, groups)
    scores = query[groups] @ catalogue.numpy().T
    ranks = []
    for r, u in enumerate(groups):
        positive = int(items[r])
        if positive not in named:
            ranks.append(len(named))
            continue
        dropped = set(train_items[train_users == u].tolist()) - {positive} if exclude else set()
        keep = [c for c in named if c not in dropped and c != positive]
        ranks.append(int(sum(scores[r, c - 1] >= scores[r, positive - 1] for c in keep)))
    assert np.concatenate(acc.ranks).tolist() == ranks
    assert acc.result()["mrr"] == pytest.approx(np.mean([1 / (k + 1) if k < len(named) else 0.0 for k in ranks]))


@pytest.mark.parametrize("trial", range(4))
def test_seen_items_mask_equals_the_per_row_mask(trial):
    """The vectorised mask equals one built row by row (plain Python sets) on random ragged pairs:
    skewed users (some with many items, some with none), items outside the catalogue, repeated and
    unknown users among the rows, and no rows at all."""
    from flowrec.runtime.evaluation.retrieval import SeenItems

    rng = np.random.default_rng(random.randrange(1 << 30))
    vocab = int(rng.integers(1, 60))
    pairs = int(rng.integers(0, 400)) if trial else 0
    users = rng.zipf(1.5, pairs) % 30 - 3  # negative and skewed ids
    items = rng.integers(-2, vocab + 5, pairs)  # some outside 1 .. vocab
    seen = SeenItems(users, items)
    for rows in (rng.integers(-5, 35, int(rng.integers(1, 50))), np.zeros(0, np.int64)):
        want = torch.zeros(len(rows), vocab, dtype=torch.bool)
        for r, u in enumerate(rows.tolist()):
            for item in set(items[users == u].tolist()):
                if 1 <= item <= vocab:
                    want[r, item - 1] = True
        got = seen.mask(rows, vocab)
        assert got.shape == want.shape and torch.equal(got, want)


class CountingSource:
    """A source that counts the partitions it is asked for (and which columns)."""

    def __init__(self, source) -> None:
        self.source, self.asked = source, []

    def partition_rows(self):
        return self.source.partition_rows()

    def submit(self, i, columns):
        self.asked.append((i, tuple(columns)))
        return self.source.submit(i, columns)


def test_item_counts_and_seen_pairs_come_from_one_pass_that_equals_plain_counting():
    from flowrec.runtime.evaluation.retrieval import SeenItems
    from flowrec.runtime.retrieval import read_items

    seed = random.randrange(1 << 30)
    spec = spec_from_dict(retrieval_doc(seed % 1000, {"kind": "in_batch"}, False))
    table = synth_table(spec, 300, SynthConfig(seed=seed, alpha=1.2))
    users, items = table.column("user").to_pylist(), table.column("item").to_pylist()
    source = CountingSource(MemorySource(split_table(table, 3)))
    counts, pairs = read_items(source, "item", "user")
    assert sorted(source.asked) == [(i, ("user", "item")) for i in range(3)]  # each partition once
    assert counts.tolist() == [items.count(r) for r in range(max(items) + 1)]
    assert [tuple(p) for p in pairs.tolist()] == sorted(set(zip(users, items)))
    seen = SeenItems.from_pairs(pairs)
    assert (seen.users.tolist(), seen.items.tolist()) == tuple(map(list, zip(*sorted(set(zip(users, items))))))
    again = SeenItems.of(source, "user", "item")
    assert np.array_equal(again.users, seen.users) and np.array_equal(again.items, seen.items)
    assert np.array_equal(item_counts(source, "item"), counts) and source.asked[-1][1] == ("item",)


def test_the_trainer_reads_the_item_column_once_for_counts_and_seen_items(monkeypatch, tmp_path):
    """A unigram sampler (counts) with exclude_seen (pairs): one read_items pass, its results used."""
    import flowrec
    import flowrec.runtime.trainer as trainer_module

    doc = retrieval_doc(3, {"kind": "sampled", "num": 8, "distribution": "unigram"}, True)
    doc["heads"][0]["exclude_seen"] = True
    doc["training"]["eval_group_by"] = "user"
    passes = []
    read_items = trainer_module.read_items

    def counted(source, item, user=None):
        passes.append((item, user))
        out = read_items(source, item, user)
        passes.append(out)
        return out

    monkeypatch.setattr(trainer_module, "read_items", counted)
    run = flowrec.train(spec_from_dict(doc), rows=600, max_steps=2, seed=1, out=tmp_path / "run")
    assert passes[0] == ("item", "user") and len(passes) == 2
    counts, pairs = passes[1]
    assert counts.sum() == 600 and len(pairs) == len({tuple(p) for p in pairs.tolist()})
    assert run is not None


@pytest.mark.parametrize("chunk", [7, 1 << 16])  # several catalogue chunks, and one
def test_a_cosine_catalogue_is_normalised_once_per_version_and_ranks_are_bitwise_unchanged(monkeypatch, chunk):
    """Ranks over several batches equal the per-batch-normalising path exactly; the catalogue's rows
    are normalised once, and again only after the catalogue changes (in place, or replaced)."""
    import operators.retrieval as ops
    import flowrec.runtime.evaluation.retrieval as evaluation

    monkeypatch.setattr(evaluation, "SCORE_CHUNK", chunk)
    rng = np.random.default_rng(random.randrange(1 << 30))
    vocab, d = 40, 6
    catalogue = torch.from_numpy(rng.standard_normal((vocab, d)) * rng.integers(1, 9, (vocab, 1))).float()
    calls = []
    unit_rows = ops.unit_rows
    monkeypatch.setattr(ops, "unit_rows", lambda v: calls.append(len(v)) or unit_rows(v))
    acc = RankingAccumulator(catalogue, "cosine", 0.3, (5,))

    def batch():
        items = rng.integers(1, vocab + 3, 16)  # some outside the catalogue
        return items, np.concatenate([rng.standard_normal((16, d)), np.zeros((16, d))], 1)

    def old_ranks(items, outputs):  # the catalogue normalised per batch (and per chunk), as before
        query = torch.as_tensor(outputs, dtype=torch.float32)[:, :d]
        return evaluation.rank_items(query, torch.as_tensor(items), acc.catalogue, "cosine", 0.3)

    for step in range(6):
        if step == 3:
            catalogue.mul_(torch.from_numpy(rng.uniform(-2, 2, (vocab, 1))).float())  # trained further in place
        if step == 5:
            acc.catalogue = torch.from_numpy(rng.standard_normal((vocab, d))).float()  # a new catalogue
        items, outputs = batch()
        acc.update(items, outputs)
        got = acc.ranks[-1]
        before = len(calls)
        assert np.array_equal(got, old_ranks(items, outputs))
        del calls[before:]  # the reference's own normalisations
    assert calls == [vocab] * 3  # once, after the in-place change, after the replacement


def test_served_cosine_items_are_normalised_once_per_version_and_score_bitwise_as_before(monkeypatch):
    import operators.retrieval as ops
    from flowrec.serving.retrieval_index import ItemIndex
    from operators.retrieval import pair_scores

    rng = np.random.default_rng(random.randrange(1 << 30))
    vectors = torch.from_numpy(rng.standard_normal((30, 5)) * rng.integers(1, 9, (30, 1))).float()
    index = ItemIndex(list(range(30)), vectors, "cosine", 0.5)
    calls = []
    unit_rows = ops.unit_rows
    monkeypatch.setattr(ops, "unit_rows", lambda v: calls.append(len(v)) or unit_rows(v))
    for step in range(4):
        if step == 2:
            vectors.mul_(torch.from_numpy(rng.uniform(-2, 2, (30, 1))).float())
        query = torch.from_numpy(rng.standard_normal((8, 5))).float()
        rows, scores = index.top_k(query, 6)
        before = len(calls)
        want = torch.topk(pair_scores(query, vectors, "cosine", 0.5), 6, dim=1)  # per call, as before
        del calls[before:]
        assert np.array_equal(rows, want.indices.numpy()) and np.array_equal(scores, want.values.numpy())
    assert calls == [30, 30]  # once, and once after the vectors changed
    dot = ItemIndex(list(range(30)), vectors, "dot", 0.5)
    query = torch.from_numpy(rng.standard_normal((8, 5))).float()
    assert np.array_equal(dot.top_k(query, 6)[1], torch.topk(query @ vectors.T / 0.5, 6, dim=1).values.numpy())
    assert calls == [30, 30]


def test_exclude_seen_needs_the_user_feature():
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    doc["heads"][0]["exclude_seen"] = True
    assert [(i.path, "eval_group_by" in i.message) for i in validate_document(doc)] == [
        ("heads[0].exclude_seen", True)]
    doc["training"]["eval_group_by"] = "user"
    assert validate_document(doc) == []
    spec = spec_from_dict(doc)
    assert spec.heads[0].retrieval.exclude_seen
    assert make_plan(spec, target="cpu").graph.nodes["head_retrieve"]["op"].attr("exclude_seen") is True


def test_the_planner_prices_sampled_negatives_as_lookups_of_the_item_group():
    """N drawn items per step are N more one-id samples of the item's group: a forced lookahead
    scratchpad holds their rows too (it would run short otherwise), and the step costs more."""
    import copy

    from flowrec.planner.cost import step_lookups

    base = retrieval_doc(0, {"kind": "in_batch"}, False)
    base["features"][2]["vocab"] = 2_000_000  # a big catalogue: the group does not fit a small budget
    base["plan"] = {"cache": "lookahead", "window": 2}
    sampled = copy.deepcopy(base)
    sampled["heads"][0]["negatives"] = {"kind": "sampled", "num": 4096}
    plans = [make_plan(spec_from_dict(doc), target="h100", device_budget="24MiB") for doc in (base, sampled)]
    (plain,), (drawn,) = ([g for g in p.meta.groups if any(f.feature == "item" for f in g.fields)] for p in plans)
    assert step_lookups(plans[0].graph) == {} and step_lookups(plans[1].graph) == {drawn.name: 4096}
    assert plain.placement == drawn.placement == "lookahead"
    assert drawn.cache_rows > 10 * plain.cache_rows  # the distinct drawn items of W+1 steps (Zipf model)
    assert plans[1].cost.h2d_bytes_per_step > plans[0].cost.h2d_bytes_per_step
    assert plans[1].cost.step_ms_serial > plans[0].cost.step_ms_serial


def test_uniform_sampled_negatives_without_logq_train_from_the_trainer(monkeypatch, tmp_path):
    """The default sampled head (`distribution: uniform`, no logQ) needs no item counts, so the
    trainer read none and its sampler failed at the first batch with a RuntimeError traceback."""
    import flowrec
    import flowrec.runtime.trainer as trainer_module

    doc = retrieval_doc(5, {"kind": "sampled", "num": 8}, False)
    passes = []
    monkeypatch.setattr(trainer_module, "read_items", lambda *args: passes.append(args))
    run = flowrec.train(spec_from_dict(doc), rows=600, max_steps=3, seed=2, out=tmp_path / "run")
    assert passes == []  # no pass over the item column
    losses = [h["loss"] for h in run.history if h.get("event") == "train"]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses)
    probs = run.trained.model.retrieval.probs
    assert probs[0] == 0 and torch.allclose(probs[1:], torch.full_like(probs[1:], 1 / ITEMS))


def test_calibration_times_the_sampled_loss_with_the_gradient_to_the_drawn_items():
    """The calibrated loss of a sampled head ran its backward without the (B x N) GEMM to the drawn
    items' vectors, which a step computes (and sends on through the item tower)."""
    from flowrec.measure import step as measure_step

    spec = spec_from_dict(retrieval_doc(7, {"kind": "sampled", "num": 32}, False))
    plan = make_plan(spec, target="cpu")
    model = lower(plan, spec, "cpu")
    batch = measure_step._staged(spec, plan, 1)[0]
    logits, labels, cands = measure_step._loss_inputs(model, spec, batch)
    assert cands.vectors.shape[0] == 32 and cands.vectors.is_leaf and cands.vectors.requires_grad
    model.loss(logits, labels, cands).backward()
    assert cands.vectors.grad is not None and cands.vectors.grad.abs().sum() > 0


@pytest.mark.parametrize("distribution", ["uniform", "unigram"])
def test_sampled_negatives_are_drawn_only_from_rows_that_hold_an_item(tmp_path, distribution):
    """A vocab of 100 over data holding 80 items left 20 table rows without a raw id; uniform
    sampling drew them as negatives (a fifth of the draws), and unigram sampling drew them at the
    floor count of 0.5, though evaluation and serving never rank them. Now every drawn row holds an
    item of the data's encoder, and each of those can be drawn."""
    import pandas as pd
    import flowrec
    from flowrec.data.convert import convert

    doc = retrieval_doc(5, {"kind": "sampled", "num": 64, "distribution": distribution}, False)
    doc["features"][2]["vocab"] = 100
    rng = np.random.default_rng(random.randrange(1 << 30))
    items = [f"m{i}" for i in range(80)]
    rows = pd.DataFrame({"user": rng.integers(1, 41, 400).astype(str), "age": rng.integers(1, 5, 400).astype(str),
                         "item": np.array(items)[np.r_[np.arange(80), rng.integers(0, 80, 320)]], "label": 1})
    rows.to_csv(tmp_path / "rows.csv", index=False)
    convert(spec_from_dict(doc), "csv", [tmp_path / "rows.csv"], tmp_path / "data", options={"test_fraction": 0.2})
    # the vocabulary is fitted on the train rows: an item only in test rows has no row either
    fitted = len(pq.read_table(tmp_path / "data" / "train" / "_vocab" / "item.parquet"))
    run = flowrec.train(spec_from_dict(doc), data=tmp_path / "data", max_steps=2, seed=1, out=tmp_path / "run")
    binding = run.trained.model.retrieval
    named = set(binding.named.tolist())
    assert len(named) == fitted and fitted <= 80  # the case itself: 20 rows or more hold no item
    draw = sampler(binding, 1)
    seen: set[int] = set()
    for i in range(2000):  # every named item is drawn in time (unigram: a 1-count item's chance is about 0.4 %)
        drawn = set(draw.draw(0, i).tolist())
        assert drawn <= named, sorted(drawn - named)
        if (seen := seen | drawn) == named:
            break
    assert seen == named, sorted(named - seen)
    empty = sorted(set(range(101)) - named)
    assert len(empty) == 101 - fitted and float(binding.probs[empty].sum()) == 0.0  # row 0 and those without an item
    if distribution == "uniform":
        assert torch.allclose(binding.probs[sorted(named)], torch.full((fitted,), 1 / fitted, dtype=torch.float64))


@pytest.mark.parametrize("retrieval_first", [True, False])
def test_a_head_beside_the_retrieval_head_may_read_its_similarity(retrieval_first):
    """A binary head listed after the retrieval head, both reading `score`, stopped the plan with
    "pass 'pack' failed (passes before it: none): KeyError: 'op'": the retrieval head removed the
    similarity node (nothing read it yet), and the next head read the removed node. In either head
    order the model now plans, trains a step and scores both heads."""
    doc = retrieval_doc(0, {"kind": "in_batch"}, False)
    click = {"name": "click", "input": "score", "label": "click"}
    doc["heads"] = [doc["heads"][0], click] if retrieval_first else [click, doc["heads"][0]]
    assert validate_document(doc) == []
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    assert plan.graph.nodes["score"]["op"].kind == "similarity"
    assert list(plan.graph.predecessors("head_click")) == ["score"]
    batches, _, _ = staged(spec, plan, 0, 2)
    model = lower(plan, spec, "cpu").double()
    train_step(model, make_dense_optimizer(model, "sgd", 0.1, {}), batches[0])
    with torch.no_grad():
        scores = model(batches[1])
    assert scores.shape == (BATCH, 1 + 16) and torch.isfinite(scores).all()  # a click logit, [query | item]


@pytest.mark.parametrize("negatives", [{"kind": "sampled", "num": 16, "distribution": "unigram"}, {"kind": "in_batch"}])
def test_a_bf16_step_with_an_item_tower_trains_as_fp32_within_bf16_rounding(negatives):
    """Under `precision: bf16` the item tower runs under autocast, so the sampled items' vectors
    were bf16 while the queries (head outputs) are fp32: every step of a two-tower with sampled
    negatives stopped with "expected m1 and m2 to have the same dtype" (a traceback). The sampled
    items now meet the queries in their dtype, as the in-batch items do."""
    seed = random.randrange(1 << 30)
    doc = retrieval_doc(seed % 1000, negatives, True)
    for module in doc["modules"][:2]:
        # tanh towers: with relu, about 1 seed in 100 starts with every item vector zero or on units
        # where every query is zero, so every gradient is exactly 0 and "it trained" below failed
        module["activation"] = "tanh"
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    _, _, source = staged(spec, plan, seed, 3)
    losses = {}
    for precision in ("fp32", "bf16"):
        model = lower(plan, spec, "cpu")
        model.retrieval.set_counts(item_counts(source, "item"), torch.device("cpu"))
        batches = staged(spec, plan, seed, 3, sampler(model.retrieval, model.noise_seed) if model.retrieval.sampled
                         else None)[0]
        batches = [replace(b, dense=b.dense.float(), labels=b.labels.float()) for b in batches]
        optimizer = make_dense_optimizer(model, "sgd", 0.3, {})
        before = [p.detach().clone() for p in model.ops.parameters()]
        losses[precision] = [train_step(model, optimizer, b, precision=precision) for b in batches]
        assert any(not torch.equal(a, p) for a, p in zip(before, model.ops.parameters()))  # it trained
    assert all(math.isfinite(x) for x in losses["bf16"])
    assert losses["bf16"][0] == pytest.approx(losses["fp32"][0], rel=3e-2), f"seed {seed}"
    assert losses["bf16"][0] != losses["fp32"][0]  # the tower did run in bf16


def test_the_memory_estimate_counts_the_logits_a_bf16_step_makes(monkeypatch):
    """The planner counted a retrieval head's (B, C) logits at 2 bytes under `precision: bf16`,
    but the step computes them in fp32 (the head's outputs are widened, the loss runs outside
    autocast): a plan's activations were estimated at half its logits. The estimate's element
    size is now that of the logits the step makes."""
    import operators.retrieval as retrieval
    from flowrec.graph.build import build_graph
    from flowrec.planner.cost import RETRIEVAL_LOGIT_COPIES, activation_bytes, retrieval_logit_bytes

    seed = random.randrange(1 << 30)
    doc = retrieval_doc(seed % 1000, {"kind": "sampled", "num": 16, "distribution": "uniform"}, False)
    doc["training"]["precision"] = "bf16"
    spec = spec_from_dict(doc)
    plan = make_plan(spec, target="cpu")
    model = lower(plan, spec, "cpu")
    batch = staged(spec, plan, seed, 1, sampler(model.retrieval, model.noise_seed))[0][0]
    batch = replace(batch, dense=batch.dense.float(), labels=batch.labels.float())
    made = []
    plain = retrieval.pair_scores
    monkeypatch.setattr(retrieval, "pair_scores", lambda *a, **k: made.append(plain(*a, **k)) or made[-1])
    train_step(model, make_dense_optimizer(model, "sgd", 0.3, {}), batch, precision="bf16")
    logits = made[-1]  # (B, N): the sampled items' scores
    assert logits.shape == (BATCH, 16)
    graph = build_graph(spec)
    per_value = retrieval_logit_bytes(graph, BATCH) / (RETRIEVAL_LOGIT_COPIES * BATCH * (1 + 16))
    assert per_value == logits.element_size()
    assert activation_bytes(graph, BATCH, "bf16") == activation_bytes(graph, BATCH, "fp32")  # no attention here
