"""Where a trainer step's time goes: the step as `bench_costmodel` times it, under three conditions.

Each variant is a `flowrec train SPEC` run (synthetic rows, one epoch covers every step, --device
cpu, the given --device-budget and --threads) in its own process, the trainer's guarded step
(`Trainer._step`, the interval bench_costmodel times) timed as bench_costmodel times it
(`robust.SchedClock`, the data threads excluded), and also:

- `train_step_ms`: the `train_step` call inside it (the rest is the guard, the managed hooks and
  the clock's own schedstat read);
- `cpu_ms`: the compute thread's own CPU time in the step (`time.thread_time`);
- `wall_ms_clean`: the median of the clean steps (foreign wait <= 5% of the wall, robust.py's rule);
- `data_cpu_ms`: the CPU time of the process's other threads (the data stage) during the step.

Variants, run in turn `--repeats` times (so that a change of the machine's load hits all):
    live: as `flowrec train` runs (the data threads stage batches beside the steps);
    prestaged: every batch of the run staged before the first step, the data stage closed (no
        data thread runs during the steps);
    prestaged_foreign_mem: prestaged, with another process copying 128 MiB arrays in a loop (a
        neighbour's memory traffic on the other core: no run-queue wait, so its rounds count
        as clean).

Usage:
    python tools/bench_step_gap.py [--spec specs/esmm_multitask.yaml] [--steps 20] [--repeats 3]
        [--device-budget 64MiB] [--threads 1] [--profile FILE] [--json bench/results/step_gap_cpu.json]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

WARMUP_STEPS = 2  # as bench_costmodel
VARIANTS = ("live", "prestaged", "prestaged_foreign_mem")
HARNESS = r'''
import json, os, sys, threading, time
from flowrec.measure import robust
from flowrec.runtime import trainer
MODE, OUT, STEPS = os.environ["GAP_MODE"], os.environ["GAP_OUT"], int(os.environ["GAP_STEPS"])
rows, inner = [], []
clock = robust.SchedClock(exclude=robust.python_side_threads)
plain_train_step = trainer.train_step
def train_step(*a, **k):
    t = time.perf_counter()
    out = plain_train_step(*a, **k)
    inner.append(time.perf_counter() - t)
    return out
trainer.train_step = train_step
step = trainer.Trainer._step
def timed(self, batch, *args, **kwargs):
    c0 = time.thread_time()
    started = clock.start()
    out = step(self, batch, *args, **kwargs)
    r = clock.stop(started)
    cpu = time.thread_time() - c0
    after, me = robust._schedstat(), threading.get_native_id()
    data = sum(v[0] - started[1].get(t, (0, 0))[0] for t, v in after.items() if t != me and t in started[1])
    rows.append({"wall_ms": r.wall * 1e3, "waited_ms": r.waited * 1e3, "train_step_ms": inner[-1] * 1e3,
                 "cpu_ms": cpu * 1e3, "data_cpu_ms": data * 1e-6})
    return out
trainer.Trainer._step = timed
if MODE.startswith("prestaged"):
    staged = trainer.Trainer._staged
    def prestaged(self, source):
        it, batches = staged(self, source), []
        for b in it:
            batches.append(b)
            if len(batches) >= STEPS:
                break
        it.close()
        return iter(batches)
    trainer.Trainer._staged = prestaged
from flowrec.cli import main
sys.argv = ["flowrec", *sys.argv[1:]]
try:
    main()
finally:
    with open(OUT, "w") as f:
        json.dump(rows, f)
'''
FOREIGN = "import numpy as np\na = np.ones(1 << 24); b = np.empty_like(a)\nwhile True: np.copyto(b, a)\n"


def median(values: list[float]) -> float:
    ordered = sorted(values)
    mid = len(ordered) // 2
    return ordered[mid] if len(ordered) % 2 else (ordered[mid - 1] + ordered[mid]) / 2


def run_variant(mode: str, spec: Path, data: Path, tmp: Path, steps: int, budget: str | None,
                env: dict[str, str], profile: Path | None = None) -> dict[str, float]:
    out = tmp / f"{mode}.json"
    run_dir = tmp / f"run-{mode}"
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each repeat
    env = {**env, "GAP_MODE": mode, "GAP_OUT": str(out), "GAP_STEPS": str(WARMUP_STEPS + steps)}
    foreign = None
    if mode.endswith("foreign_mem"):
        foreign = subprocess.Popen([sys.executable, "-c", FOREIGN], env=env)
        time.sleep(1.0)
    try:
        run_tree([sys.executable, "-m", "_step_gap_harness", "train", str(spec), "--data", str(data),
                  "--max-steps", str(WARMUP_STEPS + steps), "--epochs", "1", "--device", "cpu",
                  "--out", str(run_dir), "--quiet", "--json", "--eval-every", "0",
                  *(["--device-budget", budget] if budget else []),
                  *(["--target", str(profile)] if profile else [])],
                 cwd=tmp, env=env, check=True, capture_output=True, timeout_s=600)
    finally:
        if foreign is not None:
            foreign.kill()
            foreign.wait(timeout=60)  # killed: gone at once, unless the machine is stalled
    rows = json.loads(out.read_text())[WARMUP_STEPS:]
    result = {key: median([r[key] for r in rows]) for key in rows[0]}
    result["data_cpu_ms_mean"] = sum(r["data_cpu_ms"] for r in rows) / len(rows)
    clean = [r["wall_ms"] for r in rows if r["waited_ms"] <= 0.05 * r["wall_ms"]]  # robust.py's clean rounds
    result["clean_steps"] = len(clean)
    result["wall_ms_clean"] = median(clean) if clean else None
    result["steps"] = len(rows)
    return {k: None if v is None else round(v, 4) for k, v in result.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spec", type=Path, default=REPO / "specs/esmm_multitask.yaml")
    parser.add_argument("--steps", type=int, default=20, help=f"timed steps per run (after {WARMUP_STEPS})")
    parser.add_argument("--repeats", type=int, default=3, help="rounds of the three variants")
    parser.add_argument("--device-budget", default="64MiB")
    parser.add_argument("--profile", type=Path, default=None,
                        help="`flowrec train --target` profile (a `flowrec calibrate` output; default: the run's own)")
    parser.add_argument("--threads", type=int, default=1, help="OMP_NUM_THREADS and NUMBA_NUM_THREADS")
    parser.add_argument("--json", type=Path, default=REPO / "bench/results/step_gap_cpu.json")
    args = parser.parse_args()
    from flowrec.spec import load_spec

    batch = load_spec(args.spec).training.batch_size
    threads = str(args.threads)
    with tempfile.TemporaryDirectory(prefix="bench-gap-") as name:
        tmp = Path(name)
        (tmp / "_step_gap_harness.py").write_text(HARNESS)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(tmp)]),
               "OMP_NUM_THREADS": threads, "NUMBA_NUM_THREADS": threads}
        data = tmp / "data"
        run_tree([sys.executable, "-m", "flowrec", "data", "synth", str(args.spec), "--rows",
                  str(batch * (WARMUP_STEPS + args.steps + 1)), "--out", str(data)],
                 cwd=tmp, env=env, check=True, capture_output=True, timeout_s=600)
        runs = []
        for repeat in range(args.repeats):
            for mode in VARIANTS:
                load = os.getloadavg()[0]
                row = {"repeat": repeat, "variant": mode, "loadavg_1min": load,
                       **run_variant(mode, args.spec, data, tmp, args.steps, args.device_budget, env,
                                   args.profile)}
                print(json.dumps(row), flush=True)
                runs.append(row)
    keys = ("wall_ms", "wall_ms_clean", "train_step_ms", "cpu_ms", "waited_ms", "data_cpu_ms_mean")
    summary = {}
    for mode in VARIANTS:
        values = {key: [r[key] for r in runs if r["variant"] == mode and r[key] is not None] for key in keys}
        summary[mode] = {key: median(v) if v else None for key, v in values.items()}
    result = {"benchmark": "step_gap", "spec": args.spec.name, "device_budget": args.device_budget,
              "threads": args.threads, "profile": str(args.profile) if args.profile else None,
              "steps": args.steps, "repeats": args.repeats, "runs": runs,
              "median_over_repeats": summary}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
