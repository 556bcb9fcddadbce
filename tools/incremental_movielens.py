"""Daily incremental training measured on MovieLens-100k split by time into three slices.

Slice 1 trains a run (its encoder fitted on slice 1); slice 2 continues it with `--init-from`
(encoded with run 1's encoder: with `vocab_spare`, users and items new in slice 2 take spare
rows); slice 3 (the newest) is the test set. The baseline trains from scratch on slices 1+2
(encoder fitted on 1+2). Slice 3 is encoded for each arm with that arm's encoder, `--no-grow`
(values new in slice 3 go to row 0 in both). The spec is specs/movielens.yaml with
`vocab_spare` set on user_id and item_id (default: the number of their values in slices 2 and 3
that slice 1 lacks; `--spare 0` for the spec as it is). Writes JSON: AUC of both on slice 3,
training seconds, rows.

Usage:
    python tools/incremental_movielens.py --data ../shared/data/movielens-100k --out /tmp/inc --json inc.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import yaml

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

SPEC = REPO / "specs" / "movielens.yaml"
SPARE_FEATURES = ("user_id", "item_id")


def flowrec(*args: str) -> tuple[str, float]:
    """Run the CLI; (stdout, seconds)."""
    started = time.perf_counter()
    done = run_tree([sys.executable, "-m", "flowrec", *args], capture_output=True, text=True, timeout_s=1800,
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
    paths: list[Path] = []
    for i in range(3):
        path = out / f"slice{i + 1}.csv"
        pacsv.write_csv(table.slice(bounds[i], bounds[i + 1] - bounds[i]), path)
        paths.append(path)
    both = out / "slice12.csv"
    pacsv.write_csv(table.slice(0, bounds[2]), both)
    return paths + [both]


def new_values(paths: list[Path]) -> dict[str, int]:
    """Per spare feature: distinct values of slices 2 and 3 that slice 1 lacks."""
    first, later = pacsv.read_csv(paths[0]), [pacsv.read_csv(p) for p in paths[1:3]]
    out = {}
    for name in SPARE_FEATURES:
        known = set(first.column(name).to_pylist())
        out[name] = len({v for t in later for v in t.column(name).to_pylist()} - known)
    return out


def spare_spec(out: Path, spare: dict[str, int]) -> Path:
    """specs/movielens.yaml with vocab_spare on the spare features (data.path made absolute)."""
    doc = yaml.safe_load(SPEC.read_text())
    for feature in doc["features"]:
        if spare.get(feature["name"]):
            feature["vocab_spare"] = spare[feature["name"]]
    doc["data"]["path"] = str((SPEC.parent / doc["data"]["path"]).resolve())
    path = out / "movielens_spare.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def convert(spec: Path, raw: Path, out: Path, *extra: str) -> str:
    stdout, _ = flowrec("data", "convert", "csv", str(raw), str(out), "--spec", str(spec), "--test-fraction", "0",
                        "-q", "--overwrite", *extra)
    return stdout


def train(spec: Path, out: Path, data: Path, eval_data: Path, *extra: str) -> tuple[float, float, float]:
    """(AUC on eval_data, training seconds, seconds of the whole command)."""
    stdout, seconds = flowrec("train", str(spec), "--data", str(data), "--eval-data", str(eval_data), "--out",
                              str(out), "--overwrite", "--quiet", "--json", "--device", "cpu", *extra)
    report = json.loads(stdout[stdout.index("{"):])
    (head,) = report["eval"].values()
    return head["auc"], report["seconds"], seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO.parent / "shared" / "data" / "movielens-100k")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--json", type=Path, required=True)
    parser.add_argument("--spare", type=int, default=None,
                        help="vocab_spare of user_id and item_id (default: their new values in slices 2-3)")
    parser.add_argument("--epochs", type=int, default=None, help="epochs of every run (default: the spec's)")
    parser.add_argument("--inc-epochs", type=int, default=None, help="epochs of the incremental step")
    parser.add_argument("--seed", type=int, default=None, help="training seed of every run (default: the spec's)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    s1, s2, s3, s12 = slices(args.data, args.out)
    found = new_values([s1, s2, s3])
    spare = found if args.spare is None else {name: args.spare for name in SPARE_FEATURES}
    spec = spare_spec(args.out, spare)
    seed = ("--seed", str(args.seed)) if args.seed is not None else ()
    epochs = (("--epochs", str(args.epochs)) if args.epochs else ()) + seed
    inc = args.inc_epochs or args.epochs
    inc_epochs = (("--epochs", str(inc)) if inc else ()) + seed
    out = args.out
    convert(spec, s1, out / "d1")
    _, t1, _ = train(spec, out / "run1", out / "d1", out / "d1", *epochs)
    grown = convert(spec, s2, out / "d2", "--encoder-from", str(out / "run1"))
    convert(spec, s3, out / "d3", "--encoder-from", str(out / "d2"), "--no-grow")
    auc_inc, t_inc, wall_inc = train(spec, out / "run2", out / "d2", out / "d3", "--init-from", str(out / "run1"),
                                     *inc_epochs)
    convert(spec, s12, out / "d12")
    convert(spec, s3, out / "d3_scratch", "--encoder-from", str(out / "d12"), "--no-grow")
    auc_scratch, t_scratch, wall_scratch = train(spec, out / "run12", out / "d12", out / "d3_scratch", *epochs)
    rows = [sum(1 for _ in open(p)) - 1 for p in (s1, s2, s3)]
    result = {"rows": {"slice1": rows[0], "slice2": rows[1], "slice3": rows[2]},
              "vocab_spare": spare, "new_values_in_slices_2_3": found,
              "spare_rows_filled_by_slice2": [line for line in grown.splitlines() if line.startswith("table ")],
              "epochs": {"runs": args.epochs, "incremental": args.inc_epochs or args.epochs}, "seed": args.seed,
              "incremental": {"auc_slice3": auc_inc, "train_seconds": t_inc, "command_seconds": wall_inc},
              "scratch_1_2": {"auc_slice3": auc_scratch, "train_seconds": t_scratch, "command_seconds": wall_scratch},
              "slice1_run": {"train_seconds": t1},
              "auc_gap": auc_scratch - auc_inc, "time_ratio": t_inc / t_scratch,
              "seconds_per_1k_rows": {"slice1_run": 1000 * t1 / rows[0], "incremental": 1000 * t_inc / rows[1],
                                      "scratch_1_2": 1000 * t_scratch / (rows[0] + rows[1])}}
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
