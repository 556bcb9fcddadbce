"""Hashed vs managed (collisionless) tables on MovieLens-100k user and item ids: collisions, AUC.

Three arms of specs/movielens.yaml, each converted with a time split (the newest 20% of the
ratings are the test set, `split_by: timestamp`) and trained the same way:

- `vocab`: the spec as it is (a row per user and item seen in training: the ceiling);
- `hashed`: user_id and item_id hashed into half as many buckets as there are distinct ids;
- `managed`: user_id and item_id in managed tables with the same rows (half the distinct ids),
  LFU eviction every `--every-steps` steps.

Per arm: AUC and logloss on the test rows; for `hashed`, the share of the training data's
distinct ids that share a bucket with another id, and of training lookups that read a shared
bucket; for `managed`, the rows held by ids at the end (each by exactly one id: collisions
counted, expected 0), ids evicted or waiting, and the share of test lookups that read the
default (unknown or evicted ids). Writes JSON.

Usage:
    python tools/bench_managed_movielens.py --data ../shared/data/movielens-100k --out /tmp/mm \
        --json bench/results/managed_movielens_cpu.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

SPEC = REPO / "specs" / "movielens.yaml"
IDS = ("user_id", "item_id")
TABLES = {"user_id": "users", "item_id": "items"}


def flowrec(*args: str) -> float:
    """Run the CLI; seconds it took."""
    started = time.perf_counter()
    done = run_tree([sys.executable, "-m", "flowrec", *args], capture_output=True, text=True, timeout_s=3600,
                    cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"flowrec {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - started


def arm_spec(arm: str, data: Path, out: Path, rows: dict[str, int], every_steps: int, evict: str = "lfu",
             admit: int = 1) -> Path:
    """specs/movielens.yaml for one arm (time split, absolute data path)."""
    doc = yaml.safe_load(SPEC.read_text())
    doc["name"] = f"movielens_{arm}"
    doc["data"]["path"] = str(data.resolve())
    doc["data"]["options"] = {"test_fraction": 0.2, "split_by": "timestamp"}
    tables = []
    for feature in doc["features"]:
        name = feature["name"]
        if name not in IDS or arm == "vocab":
            continue
        feature.pop("vocab")
        if arm == "hashed":
            feature["hash_buckets"] = rows[name]
            continue
        dim = feature.pop("dim")
        feature["table"] = TABLES[name]
        tables.append({"name": TABLES[name], "dim": dim,
                       "managed": {"rows": rows[name], "evict": evict, "admit_min_count": admit,
                                   "every_steps": every_steps}})
    if tables:
        doc["tables"] = tables
    path = out / f"{arm}.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def distinct_ids(data: Path) -> dict[str, int]:
    ratings = np.loadtxt(data / "u.data", dtype=np.int64)  # user, item, rating, timestamp
    return {"user_id": len(np.unique(ratings[:, 0])), "item_id": len(np.unique(ratings[:, 1]))}


def final_eval(run: Path) -> dict[str, float]:
    lines = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    last = [x for x in lines if x.get("event") == "eval"][-1]
    return next(iter(last["metrics"].values()))


def raw_collisions(data: Path, cutoff_rows: np.ndarray, rows: dict[str, int]) -> dict[str, dict[str, float]]:
    """Collisions of the training ids under flowrec's hashing (1 + SipHash % (rows - 1))."""
    sys.path.insert(0, str(REPO))
    from flowrec.data.encode import hash_rows

    ratings = np.loadtxt(data / "u.data", dtype=np.int64)[cutoff_rows]
    out = {}
    for col, name in enumerate(IDS):
        ids = ratings[:, col]
        values, counts = np.unique(ids, return_counts=True)
        buckets = hash_rows(pa.array(values), rows[name])
        _, inverse, per_bucket = np.unique(buckets, return_inverse=True, return_counts=True)
        shared = per_bucket[inverse] > 1
        out[name] = {"distinct_ids": int(len(values)), "rows": rows[name],
                     "ids_sharing_a_row": round(float(shared.mean()), 4),
                     "lookups_on_shared_rows": round(float(counts[shared].sum() / counts.sum()), 4)}
    return out


def managed_report(run: Path, dataset: Path, rows: dict[str, int]) -> dict[str, dict[str, float]]:
    """Rows held, collisions among them and default lookups on the test rows, from the checkpoint."""
    sys.path.insert(0, str(REPO))
    import torch

    from flowrec.data.managed import NO_ROW, STATE_KEYS, ManagedMap
    from flowrec.spec.model import ManagedSpec

    state = torch.load(run / "checkpoint.pt", weights_only=True)["model"]
    test = pq.read_table(dataset / "test")
    out = {}
    for name in IDS:
        table = TABLES[name]
        arrays = {k: state[f"managed.{table}.{k}"].numpy() for k in STATE_KEYS}
        m = ManagedMap(ManagedSpec(rows=rows[name])).load(arrays)
        held = arrays["row"][arrays["row"] != NO_ROW]
        looked = m.lookup(test.column(name).to_numpy())
        out[name] = {**m.report(), "collisions": int(len(held) - len(np.unique(held))),
                     "test_lookups_default": round(float((looked == NO_ROW).mean()), 4)}
    return out


def train_rows(data: Path) -> np.ndarray:
    """The training rows of the time split (the oldest 80%, ties at the cutoff to test)."""
    ratings = np.loadtxt(data / "u.data", dtype=np.int64)
    ts = ratings[:, 3]
    cutoff = np.sort(ts)[int(len(ts) * 0.8)]
    return np.flatnonzero(ts < cutoff)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="MovieLens-100k folder (u.data, u.user, u.item)")
    parser.add_argument("--out", type=Path, required=True, help="working folder (datasets, runs)")
    parser.add_argument("--json", type=Path, required=True, help="result file")
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--every-steps", type=int, default=10, help="managed eviction interval, steps")
    args = parser.parse_args()
    if not (args.data / "u.data").is_file():
        raise SystemExit(f"error: {args.data} is not the MovieLens-100k folder (no u.data)")
    args.out.mkdir(parents=True, exist_ok=True)
    distinct = distinct_ids(args.data)
    rows = {name: -(-n // 2) for name, n in distinct.items()}
    result: dict = {"distinct_ids": distinct, "rows": rows, "epochs": args.epochs, "arms": {}}
    for arm in ("vocab", "hashed", "managed"):
        spec = arm_spec(arm, args.data, args.out, rows, args.every_steps)
        dataset, run = args.out / f"{arm}_data", args.out / f"{arm}_run"
        flowrec("data", "convert", "movielens", str(args.data), str(dataset), "--spec", str(spec), "--overwrite")
        seconds = flowrec("train", str(spec), "--data", str(dataset), "--out", str(run), "--overwrite",
                          "--epochs", str(args.epochs), "--device", "cpu", "--quiet")
        metrics = final_eval(run)
        entry = {"auc": round(metrics["auc"], 4), "logloss": round(metrics["logloss"], 4),
                 "train_seconds": round(seconds, 1)}
        if arm == "hashed":
            entry["collisions"] = raw_collisions(args.data, train_rows(args.data), rows)
        if arm == "managed":
            entry["map"] = managed_report(run, dataset, rows)
        result["arms"][arm] = entry
        print(arm, json.dumps(entry))
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
