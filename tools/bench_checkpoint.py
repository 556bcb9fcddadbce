"""Checkpoint benchmark: full checkpoints against incremental ones on the default DLRM job.

Runs `flowrec train specs/dlrm_criteo.yaml --checkpoint-every 10` four times on the same synthetic
rows: with every checkpoint full and written inline on the training thread (`--checkpoint-full-every
1` with `FLOWREC_CHECKPOINT_WRITES=inline`: the behaviour before background writes, the baseline),
with every checkpoint full and written in the background (`--checkpoint-full-every 1`: each full
checkpoint streamed from a copy-on-write snapshot of the tables), flowrec's default
(`--checkpoint-full-every auto`: full, unless the previous full one is still being written, then a
delta) and incremental (`--checkpoint-full-every K`: a full checkpoint, then K-1 deltas of the
touched rows, all written in the background). From each run's `metrics.jsonl` end record it takes
the seconds of every full and delta checkpoint (snapshot copy + write) and the seconds training
waited on checkpoints (`stage_seconds.checkpoint`, listed per checkpoint in `checkpoint_stalls`,
the end of the run's wait for the writes in flight included), the most host memory a streamed full
checkpoint's writer held (`checkpoint_extra_bytes`), and from the run folder the file sizes. The
load average before and after goes into the JSON (the machine is shared).

Ratios:
    checkpoint_delta_vs_full: median delta checkpoint seconds / median full checkpoint seconds
        (the inline baseline's).
    checkpoint_stall_share: share of the incremental run's training wall time (compute + staging
        wait + eval + checkpoint waits) spent waiting on checkpoints.
    checkpoint_stall_share_default: the same for the default run (auto, in the background).
    checkpoint_stall_share_k1: the same for every checkpoint full, in the background (K = 1).
    checkpoint_stall_share_full_only: the same for the inline baseline.

With `--nproc 2` it trains the same job on 2 gloo ranks (`flowrec train --nproc 2`: the packed
group row-wise sharded, each rank writing its shard) twice, both incremental (`--checkpoint-full-every
K`): once with the ranks' checkpoints written inline on the training thread (the behaviour before
background writes, `FLOWREC_CHECKPOINT_WRITES=inline`) and once in the background (the default: each
rank's writer thread streams its shard from a copy-on-write snapshot and the ranks commit on their
checkpoint group). The figures are rank 0's (its end record); every checkpoint's agreement is a
collective, so a rank that waits makes the others wait at their next collective.

Ratios (`--nproc 2`):
    checkpoint_stall_share: the background run's share of training wall time spent waiting on
        checkpoints (the first full write included).
    checkpoint_stall_share_inline: the same for the inline run.
    checkpoint_delta_vs_full: the background run's median delta seconds / median full seconds.

Usage:
    python tools/bench_checkpoint.py [--rows 200000] [--full-every 10] [--json bench/results/checkpoint_cpu.json]
    python tools/bench_checkpoint.py --nproc 2 [--rows 200000] [--json bench/results/checkpoint_nproc2_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

SPEC = "specs/dlrm_criteo.yaml"
CHECKPOINT_EVERY = 10
RUN_TIMEOUT_S = 3600
CHECKPOINT_WRITES_ENV = "FLOWREC_CHECKPOINT_WRITES"  # flowrec.runtime.trainer: "inline" or "background"


def run_job(out: Path, rows: int, full_every: int | str, nproc: int = 1, writes: str = "background") -> dict[str, Any]:
    """Train the DLRM job into `out` (on `nproc` ranks, its checkpoints written `writes`: "inline"
    or "background"); the end record, wall seconds and checkpoint file sizes (shards included)."""
    argv = [sys.executable, "-m", "flowrec", "train", SPEC, "--rows", str(rows), "--out", str(out),
            "--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-full-every", str(full_every),
            "--device", "cpu", "--quiet"]
    if nproc > 1:
        argv += ["--nproc", str(nproc)]
    env = {**os.environ, "PYTHONPATH": str(REPO), CHECKPOINT_WRITES_ENV: writes}
    env.pop("FLOWREC_RANK_CHECKPOINTS", None)  # the older name: only the switch above decides
    t0 = time.perf_counter()
    run_tree(argv, cwd=REPO, env=env, check=True, timeout_s=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in reversed(records) if r["event"] == "end")
    sizes = {p.name: p.stat().st_size for p in out.glob("checkpoint*.pt")}
    sizes.update({f"checkpoint.shards/{p.name}": p.stat().st_size for p in out.glob("checkpoint.shards/*.pt")})
    return {"end": end, "process_wall_s": wall, "sizes": sizes}


def summary(job: dict[str, Any]) -> dict[str, Any]:
    end = job["end"]
    stages = end["stage_seconds"]
    writes = end["checkpoint_writes_s"]
    train_wall = stages["compute"] + stages["staging_wait"] + stages["eval"] + stages["checkpoint"]
    delta_sizes = [v for k, v in job["sizes"].items() if ".delta-" in k]
    shard_sizes = [v for k, v in job["sizes"].items() if k.startswith("checkpoint.shards/") and "-delta" not in k]
    return {
        "steps": end["step"],
        "full_checkpoints": len(writes["full"]),
        "delta_checkpoints": len(writes["delta"]),
        "full_checkpoint_s": writes["full"],
        "delta_checkpoint_s": writes["delta"],
        "median_full_s": statistics.median(writes["full"]) if writes["full"] else None,
        "median_delta_s": statistics.median(writes["delta"]) if writes["delta"] else None,
        "training_waited_on_checkpoints_s": stages["checkpoint"],
        "stall_per_checkpoint_s": end.get("checkpoint_stalls"),
        "end_wait_s": sum(r["stall_s"] for r in end.get("checkpoint_stalls") or [] if r.get("wait")),
        "writer_extra_bytes": end.get("checkpoint_extra_bytes"),
        "compute_s": stages["compute"],
        "train_wall_s": train_wall,
        "stall_share": stages["checkpoint"] / train_wall,
        "process_wall_s": job["process_wall_s"],
        "full_file_bytes": job["sizes"].get("checkpoint.pt"),
        "median_delta_file_bytes": statistics.median(delta_sizes) if delta_sizes else None,
        "full_shard_file_bytes": shard_sizes or None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic training rows (batch 4096)")
    parser.add_argument("--full-every", type=int, default=10, help="K of the incremental run")
    parser.add_argument("--nproc", type=int, default=1, choices=(1, 2),
                        help="2: the distributed job, its checkpoints inline against in the background")
    parser.add_argument("--json", type=Path, default=None,
                        help="default bench/results/checkpoint_cpu.json (--nproc 2: checkpoint_nproc2_cpu.json)")
    args = parser.parse_args()
    name = "checkpoint_cpu.json" if args.nproc == 1 else "checkpoint_nproc2_cpu.json"
    args.json = args.json or REPO / "bench" / "results" / name
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        if args.nproc == 1:
            runs = {"full_only": summary(run_job(Path(tmp) / "full", args.rows, 1, writes="inline")),
                    "full_background": summary(run_job(Path(tmp) / "full_bg", args.rows, 1)),
                    "default_auto": summary(run_job(Path(tmp) / "auto", args.rows, "auto")),
                    "incremental": summary(run_job(Path(tmp) / "inc", args.rows, args.full_every))}
        else:
            runs = {"inline": summary(run_job(Path(tmp) / "inline", args.rows, args.full_every, 2, "inline")),
                    "background": summary(run_job(Path(tmp) / "bg", args.rows, args.full_every, 2, "background"))}
    load_after = os.getloadavg()
    if args.nproc == 1:
        full, incremental = runs["full_only"], runs["incremental"]
        ratios = {"checkpoint_delta_vs_full": incremental["median_delta_s"] / full["median_full_s"],
                  "checkpoint_stall_share": incremental["stall_share"],
                  "checkpoint_stall_share_default": runs["default_auto"]["stall_share"],
                  "checkpoint_stall_share_k1": runs["full_background"]["stall_share"],
                  "checkpoint_stall_share_full_only": full["stall_share"]}
    else:
        background = runs["background"]
        ratios = {"checkpoint_stall_share": background["stall_share"],
                  "checkpoint_stall_share_inline": runs["inline"]["stall_share"],
                  "checkpoint_delta_vs_full": background["median_delta_s"] / background["median_full_s"]}
    result = {
        "benchmark": "checkpoint",
        "spec": SPEC,
        "rows": args.rows,
        "nproc": args.nproc,
        "checkpoint_every": CHECKPOINT_EVERY,
        "full_every": args.full_every,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        **runs,
        "ratios": ratios,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
