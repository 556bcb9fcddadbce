"""Two-tower retrieval benchmark on MovieLens 100K: full-catalogue HR@100, recall@10, NDCG@10 over
seeds, beside a popularity ranking.

The protocol of the TensorFlow Recommenders basic-retrieval tutorial: every rating is a (user,
movie) positive, a random 80/20 split of the ratings (the spec's binding, split seed 0: the same
split for every run), and each test rating ranks all 1,682 movies. specs/two_tower_movielens.yaml
(user id -> movie id, dim 32, dot product, in-batch softmax with logQ correction), the same
spec without logQ correction, and with sampled negatives (1,024 movies per step drawn by training
frequency in the data stage, logQ-corrected) are trained by `flowrec.api.train` once per seed; only
the training seed changes. The popularity baseline ranks every user's
movies by their number of training ratings (ties: lower movie row first) and is scored by the
same metric code (`flowrec.runtime.evaluation.retrieval.ranking_metrics`) on the same test rows:

- hr@K: share of test ratings whose movie ranks in the top K (TFRS's top-K categorical accuracy;
  the tutorial prints about 0.23 for K = 100);
- recall@K, ndcg@K: per user (their test movies), mean over users;
- mrr over the test ratings.

No item a user rated in training is excluded (as in the tutorial).

Usage:
    flock /tmp/bench.lock python tools/bench_retrieval.py [--seeds 0,1,2] [--epochs N]
                                    [--variants two-tower,no-logQ,sampled]
                                    [--json bench/results/retrieval_movielens_cpu.json]
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from flowrec import api
from flowrec.runtime.evaluation.retrieval import ranking_metrics
from flowrec.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[1]
SPEC = "two_tower_movielens"
TOP_K = (10, 100)
REPORTED = ("hr@100", "recall@10", "ndcg@10", "hr@10", "recall@100", "mrr")
TFRS_HR100 = 0.23  # the TFRS basic-retrieval tutorial's top-100 accuracy on this protocol
SAMPLED = {"kind": "sampled", "num": 1024, "distribution": "unigram"}  # movies drawn per step (one batch's worth)


def spec_doc() -> dict[str, Any]:
    path = REPO / "specs" / f"{SPEC}.yaml"
    doc = yaml.safe_load(path.read_text())
    doc["data"]["path"] = str((path.parent / doc["data"]["path"]).resolve())
    return doc


def train(doc: dict[str, Any], seed: int, epochs: int | None, out: Path, data: Path | None) -> dict[str, Any]:
    started = time.perf_counter()
    run = api.train(spec_from_dict(doc), seed=seed, epochs=epochs, device="cpu", out=out,
                    data=data)
    metrics = run.result.eval["retrieve"]
    return {"seed": seed, "seconds": time.perf_counter() - started,
            "metrics": {k: metrics[k] for k in REPORTED}, "samples": metrics["samples"]}


def popularity(data: Path) -> dict[str, float]:
    """Every user gets the same ranking: movies by training count, most rated first."""
    train = pq.read_table(data / "train", columns=["item_id"]).column("item_id").to_numpy()
    test = pq.read_table(data / "test", columns=["user_id", "item_id"])
    items, users = test.column("item_id").to_numpy(), test.column("user_id").to_numpy()
    vocab = int(spec_doc()["features"][1]["vocab"])
    counts = np.bincount(train, minlength=vocab + 1)[1:vocab + 1]  # items 1 .. vocab
    order = np.lexsort((np.arange(vocab), -counts))  # most rated first, then lower row
    rank_of = np.empty(vocab, np.int64)
    rank_of[order] = np.arange(vocab)
    inside = (items >= 1) & (items <= vocab)
    ranks = np.where(inside, rank_of[np.clip(items, 1, vocab) - 1], vocab)
    out = ranking_metrics(ranks, users, vocab, TOP_K)
    return {k: out[k] for k in REPORTED}


def summary(values: list[float]) -> dict[str, Any]:
    return {"mean": statistics.mean(values), "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            "values": values}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--epochs", type=int, default=None, help="override the spec's epochs")
    parser.add_argument("--variants", default="two-tower,no-logQ,sampled",
                        help="comma-separated: two-tower (the spec), no-logQ, sampled")
    parser.add_argument("--json", default=str(REPO / "bench" / "results" / "retrieval_movielens_cpu.json"))
    args = parser.parse_args()
    doc = spec_doc()
    if not (Path(doc["data"]["path"]) / "u.data").is_file():
        print(f"MovieLens 100K not found at {doc['data']['path']}; nothing to measure")
        return 0
    seeds = [int(s) for s in args.seeds.split(",")]
    plain = copy.deepcopy(doc)
    plain["heads"][0]["logq_correction"] = False
    sampled = copy.deepcopy(doc)
    sampled["heads"][0]["negatives"] = dict(SAMPLED)
    known = {"two-tower": doc, "no-logQ": plain, "sampled": sampled}  # the spec; without logQ; sampled negatives
    names = [v for v in args.variants.split(",") if v]
    if not names or any(v not in known for v in names):
        parser.error(f"--variants: a comma-separated list of {', '.join(known)}")
    variants = {v: known[v] for v in names}
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in variants}
    with tempfile.TemporaryDirectory(prefix="bench_retrieval_") as tmp:
        data = None
        for name, variant in variants.items():
            for seed in seeds:
                folder = Path(tmp) / f"{name}{seed}"
                runs[name].append(train(variant, seed, args.epochs, folder, data))
                data = data or folder / "data"  # the first run's conversion serves the rest
                m = runs[name][-1]["metrics"]
                print(f"{name} seed {seed}: " + ", ".join(f"{k} {m[k]:.4f}" for k in REPORTED)
                      + f" ({runs[name][-1]['seconds']:.1f} s)", flush=True)
        pop = popularity(data)
    summaries = {name: {k: summary([r["metrics"][k] for r in rs]) for k in REPORTED} for name, rs in runs.items()}
    print(f"{'model':<12} " + " ".join(f"{k:>17}" for k in REPORTED))
    for name, s in summaries.items():
        print(f"{name:<12} " + " ".join(f"{s[k]['mean']:.4f} +- {s[k]['std']:.4f}" for k in REPORTED))
    print(f"{'popularity':<12} " + " ".join(f"{pop[k]:>17.4f}" for k in REPORTED))
    for name, s in summaries.items():
        print(f"{name} HR@100 {s['hr@100']['mean']:.4f} vs the TFRS tutorial's {TFRS_HR100} "
              f"({'at least' if s['hr@100']['mean'] >= TFRS_HR100 else 'BELOW'})")
    report = {"spec": f"specs/{SPEC}.yaml", "protocol": "MovieLens 100K, random 80/20 split of ratings (split "
              "seed 0), every test rating ranks all 1,682 movies, no exclusion of training items",
              "machine": platform.machine(), "torch": torch.__version__, "threads": torch.get_num_threads(),
              "load": os.getloadavg(), "seeds": seeds, "sampled_negatives": SAMPLED,
              "models": {name: {"summary": summaries[name], "runs": runs[name]} for name in variants},
              "popularity": pop, "tfrs_tutorial_hr100": TFRS_HR100}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    raise SystemExit(run_stoppable(main))
