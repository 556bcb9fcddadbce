"""What hashing a chunk's rows costs a conversion (copies and the seeded split), side by side.

`flowrec data convert` hashes every row of its input once (`flowrec.data.duplicates.row_hashes`):
for the copies it counts and, with a test split, for each row's side. A column of no plain type
(a Parquet column of lists: multi-hot ids, a behaviour sequence) is hashed by each row's Python
text. This benchmark builds one table of fresh skewed rows (Zipf ids, lognormal prices, lists of
0 to `--max-items` Zipf ids as integers and as text, `--odd-share` of the text items with quotes
or non-ASCII letters that Python writes escaped) and times, alternating in one process, the rows'
hashes with the rows' texts written by Python row by row (the reference: how every list row
was written before) and by `value_texts` (Arrow's kernels for lists of integers and plain
text). Both must give the same hashes (checked every round). Reports the median and the minimum of
the process CPU seconds and the wall seconds per variant, their ratio, and the load average.

Usage:
    python tools/bench_row_hashes.py --json bench/results/row_hashes.json [--rows 200000] [--rounds 7]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

from flowrec.data import duplicates

ODD = ["it's", "caf\u00e9", 'say "hi"', "back\\slash", "\u00fcber"]


def python_texts(values: pa.Array) -> pa.Array:
    """Each value's `repr`, written by Python row by row (the reference)."""
    return pa.array([None if v is None else repr(v) for v in values.to_pylist()], pa.large_string())


def table(rows: int, max_items: int, odd_share: float, seed: int | None) -> pa.Table:
    """Skewed rows: an id, a price, and two list columns (integers, text) of 0 to `max_items` items."""
    rng = np.random.default_rng(seed)

    def lists(text: bool) -> pa.Array:
        lengths = rng.integers(0, max_items + 1, rows)
        items = rng.zipf(1.3, int(lengths.sum())) % 100_000
        offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]), pa.int32())
        if not text:
            return pa.ListArray.from_arrays(offsets, pa.array(items))
        words = [ODD[int(i) % len(ODD)] if r < odd_share else f"i{i}" for i, r in zip(items, rng.random(len(items)))]
        return pa.ListArray.from_arrays(offsets, pa.array(words))

    return pa.table({"user": [f"u{k}" for k in rng.zipf(1.3, rows)], "price": rng.lognormal(0, 2, rows),
                     "history": lists(False), "tags": lists(True)})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, required=True, help="file to write the results to")
    parser.add_argument("--rows", type=int, default=200_000, help="rows of the table (default 200,000)")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds of each variant, alternating (default 7)")
    parser.add_argument("--max-items", type=int, default=20, help="most items of a list row (default 20)")
    parser.add_argument("--odd-share", type=float, default=0.001,
                        help="share of text items Python writes escaped or in double quotes (default 0.001)")
    parser.add_argument("--seed", type=int, default=None, help="seed of the rows (default: fresh)")
    args = parser.parse_args()
    if args.rows < 1 or args.rounds < 1 or args.max_items < 0 or not 0 <= args.odd_share <= 1:
        parser.error("--rows and --rounds must be >= 1, --max-items >= 0, --odd-share from 0 to 1")
    rows = table(args.rows, args.max_items, args.odd_share, args.seed)
    variants = {"python_texts": python_texts, "value_texts": duplicates.value_texts}
    cpu: dict[str, list[float]] = {name: [] for name in variants}
    wall: dict[str, list[float]] = {name: [] for name in variants}
    kept = duplicates.value_texts
    try:
        for _ in range(args.rounds):
            hashes = []
            for name, texts in variants.items():
                duplicates.value_texts = texts
                c0, w0 = time.process_time(), time.perf_counter()
                hashes.append(duplicates.row_hashes(rows))
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
            if not np.array_equal(hashes[0], hashes[1]):
                raise SystemExit("value_texts gave other row hashes than Python's texts: a bug")
    finally:
        duplicates.value_texts = kept
    result = {
        "rows": args.rows, "rounds": args.rounds, "max_items": args.max_items, "odd_share": args.odd_share,
        "list_items": int(sum(len(rows.column(c).combine_chunks().flatten()) for c in ("history", "tags"))),
        "cpu_s": {name: {"median": statistics.median(v), "min": min(v)} for name, v in cpu.items()},
        "wall_s": {name: {"median": statistics.median(v), "min": min(v)} for name, v in wall.items()},
        "cpu_ratio": statistics.median(cpu["python_texts"]) / statistics.median(cpu["value_texts"]),
        "same_hashes": True, "loadavg": list(os.getloadavg()),
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
