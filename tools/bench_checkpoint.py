"""Checkpoint benchmark: full checkpoints against incremental ones on the default DLRM job.

Runs `flowrec train specs/dlrm_criteo.yaml --checkpoint-every 10` twice on the same synthetic rows:
once with every checkpoint full and written inline (`--checkpoint-full-every 1`, flowrec's
default), once incremental (`--checkpoint-full-every K`: a full checkpoint, then K-1 deltas of the
touched rows, all written in the background). From each run's `metrics.jsonl` end record it takes
the seconds of every full and delta checkpoint (snapshot copy + write) and the seconds training
waited on checkpoints (`stage_seconds.checkpoint`, listed per checkpoint in `checkpoint_stalls`,
the end of the run's wait for the writes in flight included), the most host memory a streamed full
checkpoint's writer held (`checkpoint_extra_bytes`), and from the run folder the file sizes. The
load average before and after goes into the JSON (the machine is shared).

Ratios:
    checkpoint_delta_vs_full: median delta checkpoint seconds / median full checkpoint seconds.
    checkpoint_stall_share: share of the incremental run's training wall time (compute + staging
        wait + eval + checkpoint waits) spent waiting on checkpoints.

Usage:
    python tools/bench_checkpoint.py [--rows 200000] [--full-every 10] [--json bench/results/checkpoint_cpu.json]
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
SPEC = "specs/dlrm_criteo.yaml"
CHECKPOINT_EVERY = 10
RUN_TIMEOUT_S = 3600


def run_job(out: Path, rows: int, full_every: int) -> dict[str, Any]:
    """Train the DLRM job into `out`; the end record, wall seconds and checkpoint file sizes."""
    argv = [sys.executable, "-m", "flowrec", "train", SPEC, "--rows", str(rows), "--out", str(out),
            "--checkpoint-every", str(CHECKPOINT_EVERY), "--checkpoint-full-every", str(full_every),
            "--device", "cpu", "--quiet"]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    t0 = time.perf_counter()
    subprocess.run(argv, cwd=REPO, env=env, check=True, timeout=RUN_TIMEOUT_S, stdout=subprocess.DEVNULL)
    wall = time.perf_counter() - t0
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    end = next(r for r in reversed(records) if r["event"] == "end")
    sizes = {p.name: p.stat().st_size for p in out.glob("checkpoint*.pt")}
    return {"end": end, "process_wall_s": wall, "sizes": sizes}


def summary(job: dict[str, Any]) -> dict[str, Any]:
    end = job["end"]
    stages = end["stage_seconds"]
    writes = end["checkpoint_writes_s"]
    train_wall = stages["compute"] + stages["staging_wait"] + stages["eval"] + stages["checkpoint"]
    delta_sizes = [v for k, v in job["sizes"].items() if ".delta-" in k]
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
        "writer_extra_bytes": end.get("checkpoint_extra_bytes"),
        "compute_s": stages["compute"],
        "train_wall_s": train_wall,
        "stall_share": stages["checkpoint"] / train_wall,
        "process_wall_s": job["process_wall_s"],
        "full_file_bytes": job["sizes"].get("checkpoint.pt"),
        "median_delta_file_bytes": statistics.median(delta_sizes) if delta_sizes else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=200_000, help="synthetic training rows (batch 4096)")
    parser.add_argument("--full-every", type=int, default=10, help="K of the incremental run")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/checkpoint_cpu.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="bench-ckpt-") as tmp:
        full = summary(run_job(Path(tmp) / "full", args.rows, 1))
        incremental = summary(run_job(Path(tmp) / "inc", args.rows, args.full_every))
    load_after = os.getloadavg()
    result = {
        "benchmark": "checkpoint",
        "spec": SPEC,
        "rows": args.rows,
        "checkpoint_every": CHECKPOINT_EVERY,
        "full_every": args.full_every,
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "loadavg_before": load_before, "loadavg_after": load_after},
        "full_only": full,
        "incremental": incremental,
        "ratios": {
            "checkpoint_delta_vs_full": incremental["median_delta_s"] / full["median_full_s"],
            "checkpoint_stall_share": incremental["stall_share"],
            "checkpoint_stall_share_full_only": full["stall_share"],
        },
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result["ratios"], indent=2))


if __name__ == "__main__":
    main()
