"""The planner's static_hot hit rate against the one FAE's hot set gives on the whole data.

At the start of training FAE counts a seeded sample of the data (5 % of the rows, at least 20,000:
`flowrec.graph.kinds.hot_sample_rate`) and puts the most counted rows on the device
(`flowrec.runtime.caches.static_hot`). A run plans its cache placements from an access profile of
the same sample (`flowrec.runs.plan.sampled_access_profile`); a `--profile` file may come from a
smaller one, with the same seed part of FAE's. This compares, per packed group and cache size:

  measured   the share of the whole data's lookups that hit FAE's hot rows (every row counted)
  sampled    the prediction from the sample's own shares (`hot_cdf`, the model before the
             Good-Turing correction): every row the sample saw, and only those, is ever read
  corrected  the planner's prediction (`hit_cdf`, the unseen share, the hot set capped at the rows
             FAE's sample is expected to count: `flowrec.planner.access`)

No timing: the figures are counts, the same on any machine. `--sample-rows` sets the planner's
sample: `run` (the default) is a run's own, FAE's sample; a number of rows, smaller, makes FAE's
relatively larger, more to extrapolate (a `--profile` written at a lower rate; before Round 22 a
run's planner sampled about 20,000 rows whatever the data's size).

Usage:
    python tools/bench_hit_rate.py --spec specs/two_task.yaml --synth 500000 --json out.json
    python tools/bench_hit_rate.py --spec specs/movielens.yaml --data data/ml/train --json out.json
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
SYNTH_TIMEOUT_S = 600  # the synthesized dataset: past it the tool stops (a hung child never ends it)
sys.path.insert(0, str(ROOT))

from flowrec.data.packed_ids import column_arrays, pack_group  # noqa: E402
from flowrec.data.profile import profile_access, sample_rows  # noqa: E402
from flowrec.graph.kinds import hot_sample_rate  # noqa: E402
from flowrec.graph.packing import group_layout  # noqa: E402
from flowrec.planner.access import group_model  # noqa: E402
from flowrec.runtime.caches.static_hot import hottest_rows  # noqa: E402
from flowrec.runtime.session import open_dataset  # noqa: E402
from flowrec.spec.load import load_spec  # noqa: E402
from flowrec.testing.processes import run_tree  # noqa: E402

CACHE_SHARES = (0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0)  # cache sizes as shares of a group's rows


def group_counts(spec: Any, groups: list, table: Any) -> dict[str, np.ndarray]:
    """Lookups per packed row of every group in `table`'s rows."""
    cols = {f.name: column_arrays(table.column(f.name)) for f in spec.sparse_features}
    return {g.name: np.bincount(pack_group(g, cols, table.num_rows)[0], minlength=g.rows) for g in groups}


def sample_only(profile: dict[str, Any]) -> dict[str, Any]:
    """The profile as written before the correction: the sample's own shares, nothing unseen."""
    tables = {name: {k: v for k, v in t.items() if k not in ("hit_cdf", "unseen")}
              for name, t in profile["tables"].items()}
    return {**profile, "tables": tables}


def compare(spec: Any, source: Any, sample_rows_wanted: int | None) -> dict[str, Any]:
    """Measured, sampled and corrected hit rates per group and cache size (see the module docstring).

    `sample_rows_wanted` None: the planner's sample is a run's own (FAE's rate).
    """
    groups = group_layout(spec)
    total = sum(source.partition_rows())
    fae_rate = hot_sample_rate(total)
    rate = fae_rate if sample_rows_wanted is None else min(1.0, sample_rows_wanted / max(total, 1))
    seed = spec.training.seed
    profile = profile_access(spec, source, sample_rate=rate, seed=seed)
    full = group_counts(spec, groups, sample_rows(spec, source, 1.0, seed))
    fae = group_counts(spec, groups, sample_rows(spec, source, fae_rate, seed))
    out = []
    for g in groups:
        members = [(t.table, t.rows, 1.0) for t in g.tables]
        new, _ = group_model(members, profile)
        old, _ = group_model(members, sample_only(profile))
        caps = sorted({max(1, int(round(s * g.rows))) for s in CACHE_SHARES} | {int(new.findable or g.rows)})
        rows = []
        for cap in caps:
            hot = hottest_rows(fae[g.name], cap).numpy()
            measured = float(full[g.name][hot].sum() / max(full[g.name].sum(), 1))
            rows.append({"cache_rows": cap, "measured": round(measured, 4),
                         "sampled": round(old.hit_rate(cap), 4),
                         "corrected": round(new.hot_set_hit_rate(cap), 4)})
        found = int((fae[g.name] > 0).sum())
        out.append({
            "group": g.name, "rows": g.rows, "lookups": int(full[g.name].sum()),
            "distinct_whole_data": int((full[g.name] > 0).sum()),
            "distinct_planner_sample": int(sum(profile["tables"][t.table]["distinct"] for t in g.tables)),
            "distinct_fae_sample": found, "findable_predicted": round(float(new.findable or g.rows), 1),
            "caches": rows,
            "max_error_sampled": round(max(abs(r["sampled"] - r["measured"]) for r in rows), 4),
            "max_error_corrected": round(max(abs(r["corrected"] - r["measured"]) for r in rows), 4),
        })
    return {"rows": total, "planner_sample_rate": rate, "planner_sample_rows": profile["samples"],
            "fae_sample_rate": fae_rate, "groups": out}


@contextmanager
def opened_dataset(spec_path: Path, spec: Any, data: Path | None, synth: int | None) -> Iterator[Any]:
    """The dataset a tool reads: `data` (an encoded folder), or `synth` rows of the spec
    synthesized into a temporary folder (`flowrec data synth`), removed after."""
    with tempfile.TemporaryDirectory() as tmp:
        if synth is not None:
            data = Path(tmp) / "data"
            run_tree([sys.executable, "-m", "flowrec", "data", "synth", str(spec_path), "--rows", str(synth),
                      "--out", str(data)], check=True, cwd=ROOT, stdout=subprocess.DEVNULL,
                     timeout_s=SYNTH_TIMEOUT_S)
        source = open_dataset(data, spec)
        try:
            yield source
        finally:
            source.close()


def sample_sizes(text: str) -> list[int | None]:
    """`--sample-rows`: 'run' (None) or a positive number of rows, comma-separated."""
    out: list[int | None] = []
    for part in text.split(","):
        part = part.strip().replace("_", "")
        if part == "run":
            out.append(None)
        elif part.isdigit() and int(part) > 0:
            out.append(int(part))
        else:
            raise argparse.ArgumentTypeError(f"{part!r} is neither 'run' nor a positive number of rows")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--spec", type=Path, required=True)
    ap.add_argument("--data", type=Path, help="an encoded dataset folder (flowrec data convert / synth)")
    ap.add_argument("--synth", type=int, help="synthesize this many rows for the spec instead of --data")
    ap.add_argument("--sample-rows", type=sample_sizes, default=[None],
                    help="the planner's samples to compare, comma-separated: 'run' (the default, a run's own, "
                         "FAE's sample) or a number of rows")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if (args.data is None) == (args.synth is None):
        ap.error("give --data DIR or --synth ROWS")
    spec = load_spec(args.spec)
    with opened_dataset(args.spec, spec, args.data, args.synth) as source:
        runs = [compare(spec, source, n) for n in args.sample_rows]
    doc = {"benchmark": "hit_rate", "spec": args.spec.name, "data": str(args.data) if args.data else f"synth {args.synth}",
           "host": platform.node(), "runs": runs,
           "max_error_sampled": max(g["max_error_sampled"] for r in runs for g in r["groups"]),
           "max_error_corrected": max(g["max_error_corrected"] for r in runs for g in r["groups"])}
    for r in runs:
        print(f"{doc['spec']}: {r['rows']:,} rows, planner sample {r['planner_sample_rows']:,} rows "
              f"(rate {r['planner_sample_rate']:.3g}), FAE sample rate {r['fae_sample_rate']:.3g}")
        for g in r["groups"]:
            print(f"  {g['group']}: {g['rows']:,} rows, {g['distinct_whole_data']:,} read; FAE's sample counts "
                  f"{g['distinct_fae_sample']:,} (predicted {g['findable_predicted']:,.0f})")
            print(f"    {'cache rows':>12} {'measured':>9} {'sampled':>9} {'corrected':>9}")
            for c in g["caches"]:
                print(f"    {c['cache_rows']:>12,} {c['measured']:>9.4f} {c['sampled']:>9.4f} {c['corrected']:>9.4f}")
            print(f"    max |error|: sampled {g['max_error_sampled']:.4f}, corrected {g['max_error_corrected']:.4f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
