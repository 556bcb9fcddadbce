"""MovieLens-100k replayed in time order as daily slices through `flowrec train --follow`.

The ratings, sorted by time, are cut into `--slices` equal slices ("days"); slice 1 fits the
encoder, every later slice is converted with the encoder of the slice before it (so vocabulary
tables with spare rows grow day by day). Three arms of specs/movielens.yaml train on the stream
with `--follow`, each day from the day before, and are scored on each day before training on it
(progressive validation):

- `hashed`: user_id and item_id hashed into half as many rows as there are distinct ids;
- `managed`: user_id and item_id in managed tables with the same rows (LFU, admission at first
  sight, eviction every `--every-steps` steps);
- `vocab_spare`: vocabulary tables with the same rows: day 1's most frequent ids (at most rows - 1)
  and the rest spare rows, taken first come, first served by the ids the later slices bring
  (then unknown ids share row 0);
- `vocab_full` (only with `--arms ...,vocab_full`): vocabulary tables with a spare row for every
  id the later slices bring (no collisions, twice the rows: the ceiling of a fixed table).

Writes JSON: per day the progressive AUC of each arm; the managed maps at the end (rows held,
collisions among them, admitted, evicted); the share of hashed ids that share a row.

Usage:
    python tools/follow_movielens.py --data ../shared/data/movielens-100k --out /tmp/fm \
        --json bench/results/follow_movielens_cpu.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import yaml

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_managed_movielens", REPO / "tools" / "bench_managed_movielens.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def day_slices(data: Path, out: Path, n: int) -> list[Path]:
    """`n` CSV files of the ratings in time order, equal row counts."""
    sys.path.insert(0, str(REPO))
    from flowrec.data.error_log import ErrorLog
    from flowrec.data.sources import read_movielens

    (table,) = list(read_movielens(data, {}, ErrorLog(), set()))
    table = table.take(pc.sort_indices(table, [("timestamp", "ascending")]))
    table = table.append_column("genres_", pc.binary_join(table.column("genres"), "^"))
    keep = [c for c in table.column_names if c not in ("genres",) and not c.startswith("__")]
    table = table.select(keep).rename_columns([c.rstrip("_") for c in keep])
    bounds = np.linspace(0, table.num_rows, n + 1).astype(int)
    paths = []
    for i in range(n):
        path = out / "raw" / f"day{i + 1:02d}.csv"
        path.parent.mkdir(parents=True, exist_ok=True)
        pacsv.write_csv(table.slice(bounds[i], bounds[i + 1] - bounds[i]), path)
        paths.append(path)
    return paths


def spare_ids(paths: list[Path]) -> dict[str, int]:
    """Per id feature: distinct values of the later days that day 1 lacks."""
    first = pacsv.read_csv(paths[0])
    later = [pacsv.read_csv(p) for p in paths[1:]]
    return {name: len({v for t in later for v in t.column(name).to_pylist()} - set(first.column(name).to_pylist()))
            for name in bench.IDS}


def first_day_ids(paths: list[Path]) -> dict[str, int]:
    """Per id feature: distinct values of day 1."""
    first = pacsv.read_csv(paths[0])
    return {name: len(set(first.column(name).to_pylist())) for name in bench.IDS}


def equal_rows_vocab(first: dict[str, int], rows: dict[str, int]) -> dict[str, dict[str, int]]:
    """Vocabulary and spare rows per id feature so that vocab + 1 + spare == rows (day 1's most
    frequent ids first; the rows left are spare)."""
    out = {}
    for name, n in rows.items():
        vocab = min(first[name], n - 1)
        out[name] = {"vocab": vocab, "spare": n - 1 - vocab}
    return out


def spare_spec(out: Path, data: Path, sizes: dict[str, dict[str, int]], arm: str) -> Path:
    """specs/movielens.yaml with vocabulary tables of the given vocabulary and spare rows."""
    path = bench.arm_spec("vocab", data, out, {}, 0)
    doc = yaml.safe_load(path.read_text())
    doc["name"] = f"movielens_{arm}"
    for feature in doc["features"]:
        if feature["name"] in sizes:
            feature["vocab"] = sizes[feature["name"]]["vocab"]
            feature["vocab_spare"] = sizes[feature["name"]]["spare"]
    target = out / f"{arm}.yaml"
    target.write_text(yaml.safe_dump(doc, sort_keys=False))
    return target


def convert_days(spec: Path, raws: list[Path], days: Path) -> None:
    previous = None
    for raw in raws:
        out = days / raw.stem
        extra = ("--encoder-from", str(previous)) if previous else ()
        bench.flowrec("data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "--test-fraction", "0",
                      "-q", "--overwrite", *extra)
        previous = out


def progressive(stream: Path) -> dict[str, float]:
    lines = [json.loads(x) for x in (stream / "metrics.jsonl").read_text().splitlines()]
    return {x["day"]: round(next(iter(x["metrics"].values()))["auc"], 4) for x in lines if x["event"] == "progressive"}


def managed_end(stream: Path, last_day: str) -> dict:
    import torch

    model = torch.load(stream / "days" / last_day / "checkpoint.pt", weights_only=True)["model"]
    out = {}
    for name, table in bench.TABLES.items():
        row = model[f"managed.{table}.row"]
        held = row[row >= 0]
        stats = model[f"managed.{table}.stats"].tolist()
        out[name] = {"rows_held": int(held.numel()), "collisions": int(held.numel() - held.unique().numel()),
                     "admitted": stats[0], "evicted": stats[1]}
    return out


def hashed_sharing(paths: list[Path], rows: dict[str, int]) -> dict[str, float]:
    """Share of all distinct ids of the stream that share a hashed row with another id."""
    sys.path.insert(0, str(REPO))
    import pyarrow as pa

    from flowrec.data.encode import hash_rows

    out = {}
    for name in bench.IDS:
        values = np.unique(np.concatenate([pacsv.read_csv(p).column(name).to_numpy() for p in paths]))
        buckets = hash_rows(pa.array(values), rows[name])
        _, inverse, per = np.unique(buckets, return_inverse=True, return_counts=True)
        out[name] = round(float((per[inverse] > 1).mean()), 4)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, required=True, help="MovieLens-100k folder")
    parser.add_argument("--out", type=Path, required=True, help="working folder")
    parser.add_argument("--json", type=Path, required=True, help="result file")
    parser.add_argument("--slices", type=int, default=6)
    parser.add_argument("--epochs", type=int, default=3, help="epochs per day")
    parser.add_argument("--every-steps", type=int, default=10, help="managed eviction interval, steps")
    parser.add_argument("--evict", default="lfu", choices=("lfu", "lru", "decayed_lfu"), help="managed eviction score")
    parser.add_argument("--admit", type=int, default=1, help="managed admit_min_count")
    parser.add_argument("--arms", default="hashed,managed,vocab_spare", help="arms to run, comma-separated")
    args = parser.parse_args()
    if not (args.data / "u.data").is_file():
        raise SystemExit(f"error: {args.data} is not the MovieLens-100k folder (no u.data)")
    args.out.mkdir(parents=True, exist_ok=True)
    raws = day_slices(args.data, args.out, args.slices)
    rows = {name: -(-n // 2) for name, n in bench.distinct_ids(args.data).items()}
    distinct = bench.distinct_ids(args.data)
    equal = equal_rows_vocab(first_day_ids(raws), rows)
    full = {name: {"vocab": distinct[name], "spare": n} for name, n in spare_ids(raws).items()}
    specs = {"hashed": bench.arm_spec("hashed", args.data, args.out, rows, args.every_steps),
             "managed": bench.arm_spec("managed", args.data, args.out, rows, args.every_steps, args.evict, args.admit),
             "vocab_spare": spare_spec(args.out, args.data, equal, "vocab_spare"),
             "vocab_full": spare_spec(args.out, args.data, full, "vocab_full")}
    specs = {arm: spec for arm, spec in specs.items() if arm in args.arms.split(",")}
    result: dict = {"slices": args.slices, "epochs_per_day": args.epochs, "rows": rows,
                    "vocab_spare": equal, "vocab_full": full,
                    "managed": {"evict": args.evict, "admit_min_count": args.admit, "every_steps": args.every_steps},
                    "progressive_auc": {}, "hashed_ids_sharing_a_row": hashed_sharing(raws, rows)}
    for arm, spec in specs.items():
        days, stream = args.out / f"{arm}_days", args.out / f"{arm}_stream"
        convert_days(spec, raws, days)
        bench.flowrec("train", str(spec), "--follow", str(days), "--out", str(stream), "--epochs", str(args.epochs),
                      "--device", "cpu", "--quiet")
        result["progressive_auc"][arm] = progressive(stream)
        if arm == "managed":
            result["managed_at_end"] = managed_end(stream, raws[-1].stem)
        print(arm, json.dumps(result["progressive_auc"][arm]))
    result["load_average"] = [round(x, 2) for x in os.getloadavg()]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(slice_table(result["progressive_auc"]))


def slice_table(auc: dict[str, dict[str, float]]) -> str:
    """Progressive AUC per day (rows) and arm (columns)."""
    arms = list(auc)
    days = sorted({d for per in auc.values() for d in per})
    lines = ["day    " + " ".join(f"{a:>11}" for a in arms)]
    lines += [f"{d:<6} " + " ".join(f"{auc[a].get(d, float('nan')):>11.4f}" for a in arms) for d in days]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
