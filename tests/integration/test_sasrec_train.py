"""specs/sasrec_movielens.yaml trains end to end on a slice of the real MovieLens data (next-item
rows, leave-last-out) and evaluates one full-catalogue ranking per user."""
from __future__ import annotations

import math
import shutil
from pathlib import Path

import yaml

from flowrec import api
from flowrec.spec import spec_from_dict

REPO = Path(__file__).resolve().parents[2]


def test_sasrec_spec_trains_and_ranks_one_test_row_per_user(shared_data, tmp_path):
    folder = tmp_path / "ml"
    folder.mkdir()
    for name in ("u.user", "u.item", "u.genre"):
        shutil.copy(shared_data / "movielens-100k" / name, folder / name)
    lines = (shared_data / "movielens-100k" / "u.data").read_text().splitlines()[:4000]
    (folder / "u.data").write_text("\n".join(lines) + "\n")
    counts: dict[str, int] = {}
    for line in lines:
        counts[line.split("\t")[0]] = counts.get(line.split("\t")[0], 0) + 1
    users = sum(1 for n in counts.values() if n >= 2)  # a user with one rating has no example
    doc = yaml.safe_load((REPO / "specs" / "sasrec_movielens.yaml").read_text())
    doc["data"]["path"] = str(folder)
    doc["training"].update(epochs=1, batch_size=128)
    run = api.train(spec_from_dict(doc), device="cpu", out=tmp_path / "run", seed=1)
    ev = run.result.eval["next_item"]
    assert ev["samples"] == users
    assert set(ev) >= {"hr@10", "recall@10", "ndcg@10", "mrr"}
    assert ev["hr@10"] == ev["recall@10"]  # one test row per user
    assert all(math.isfinite(ev[k]) and 0.0 <= ev[k] <= 1.0 for k in ("hr@10", "ndcg@10", "mrr"))
    assert ev["ndcg@10"] <= ev["hr@10"]
