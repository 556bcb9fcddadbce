"""Daily incremental training measured on MovieLens-100k split by time into three slices.

Slice 1 trains a run (its encoder fitted on slice 1); slice 2 continues it with `--init-from`
(encoded with run 1's encoder); slice 3 (the newest) is the test set. The baseline trains from
scratch on slices 1+2 (encoder fitted on 1+2). Writes JSON: AUC of both on slice 3, training
seconds, rows.

Usage:
    python tools/incremental_movielens.py --data ../shared/data/movielens-100k --out /tmp/inc --json inc.json
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.csv as pacsv

REPO = Path(__file__).resolve().parents[1]
SPEC = REPO / "specs" / "movielens.yaml"


def flowrec(*args: str) -> tuple[str, float]:
    """Run the CLI; (stdout, seconds)."""
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "flowrec", *args], capture_output=True, text=True, timeout=1800,
                          cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"flowrec {' '.join(args)} failed:\n{done.stderr[-3000:]}")
    return done.stdout, time.perf_counter() - started


def slices(data: Path, out: Path) -> list[Path]:
    """Three CSV files of the ratings in time order, equal row counts."""
    sys.path.insert(0, str(REPO))
    from flowrec.data.error_log import ErrorLog
    from flowrec.data.sources import read_movielens

    (table,) = list(read_movielens(data, {}, ErrorLog(), set()))
    table = table.take(pc.sort_indices(table, [("timestamp", "ascending")]))
    table = table.append_column("genres_", pc.binary_join(table.column("genres"), "^"))
    keep = [c for c in table.column_names if c not in ("genres",) and not c.startswith("__")]
    table = table.select(keep).rename_columns([c.rstrip("_") for c in keep])
    bounds = np.linspace(0, table.num_rows, 4).astype(int)
    paths = []
    for i in range(3):
        path = out / f"slice{i + 1}.csv"
        pacsv.write_csv(table.slice(bounds[i], bounds[i + 1] - bounds[i]), path)
        paths.append(path)
    both = out / "slice12.csv"
    pacsv.write_csv(table.slice(0, bounds[2]), both)
    return paths + [both]


def convert(raw: Path, out: Path, *extra: str) -> None:
    flowrec("data", "convert", "csv", str(raw), str(out), "--spec", str(SPEC), "--test-fraction", "0", "-q",
            "--overwrite", *extra)


def train(out: Path, data: Path, eval_data: Path, *extra: str) -> tuple[float, float]:
    """(AUC on eval_data, seconds of the whole command)."""
    stdout, seconds = flowrec("train", str(SPEC), "--data", str(data), "--eval-data", str(eval_data), "--out",
                              str(out), "--overwrite", "--quiet", "--json", "--device", "cpu", *extra)
    report = json.loads(stdout[stdout.index("{"):])
    (head,) = report["eval"].values()
    return head["auc"], report["seconds"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "movielens-100k")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    s1, s2, s3, s12 = slices(args.data, args.out)
    convert(s1, args.out / "d1")
    auc1, t1 = train(args.out / "run1", args.out / "d1", args.out / "d1")
    convert(s2, args.out / "d2", "--encoder-from", str(args.out / "run1"))
    convert(s3, args.out / "d3", "--encoder-from", str(args.out / "run1"))
    auc_inc, t_inc = train(args.out / "run2", args.out / "d2", args.out / "d3", "--init-from", str(args.out / "run1"))
    convert(s12, args.out / "d12")
    convert(s3, args.out / "d3_scratch", "--encoder-from", str(args.out / "d12"))
    auc_scratch, t_scratch = train(args.out / "run12", args.out / "d12", args.out / "d3_scratch")
    rows = [sum(1 for _ in open(p)) - 1 for p in (s1, s2, s3)]
    result = {"rows": {"slice1": rows[0], "slice2": rows[1], "slice3": rows[2]},
              "incremental": {"auc_slice3": auc_inc, "train_seconds": t_inc},
              "scratch_1_2": {"auc_slice3": auc_scratch, "train_seconds": t_scratch},
              "slice1_run": {"train_seconds": t1},
              "auc_gap": auc_scratch - auc_inc, "time_ratio": t_inc / t_scratch}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
