"""One prepared call for a short GPU lease: every GPU check of the project, in priority order, inside a time budget.

    python tools/gpu_lease.py --out DIR [--budget 420] [--shards 6] [--device cuda] [--rows 1228800] [--steps 300]

A lent GPU machine comes for minutes (a developer's session here gets 15 of them, the machine's
start included), so what it runs must be prepared and must end in time. This runs, in this order,
each step in its own process with a limit that never passes the budget's end (a step the budget
cannot hold any more is listed as skipped):

1. `env`: Python, torch and its CUDA, CuPy, the devices, the host's cores, the checkout's commit;
2. `gpu-tests`: `pytest -m gpu tests/gpu`, all but the every-spec sweep;
3. `sweep`: tests/gpu/test_specs_gpu.py (every spec on the device against the CPU, 76 cases) in
   `--shards` pytest processes at once on the one GPU, their JSON merged into `specs_gpu.json`;
4. `calibrate`: `flowrec calibrate specs/dlrm_criteo.yaml --device DEV` into `profile.json`;
5. `transfer`: `tools/bench_transfer.py` with that profile (a batch's send against the profile's
   price, then the transfer variants) into `bench_transfer.json`;
6. `train-fp32`, `train-bf16`: `flowrec train specs/dlrm_criteo.yaml --report` on synthetic rows
   (bf16: the same spec with `training.precision: bf16`), priced with the profile when there is one;
7. `ops`: `tools/bench_ops.py` into `bench_ops.json`.

Everything lands in `--out` as at most 8 files (the device tool brings back 8): `log.txt` (every
step's output), `summary.json` (each step's seconds and outcome, the versions), and the JSON files
above. A table of the steps is printed last. The checkout is run in place (PYTHONPATH is set to it):
on the device machine bring dask and jsonschema as wheels first (../shared/wheels-gpu/README.md).
Without CUDA it stops, unless `--device cpu` asks for a rehearsal of the same steps on the CPU
(the GPU tests then skip).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.runtime.proctree import descendants, kill_tree, running, send  # noqa: E402
from flowrec.testing.processes import run_tree  # noqa: E402

SWEEP = "tests/gpu/test_specs_gpu.py"
SPEC = "specs/dlrm_criteo.yaml"
MIN_STEP_S = 10.0  # a step with less of the budget left is skipped, not started
REAP_S = 30.0  # a step past its limit, killed, is gone within this (a wait past it fails, not hangs)


@dataclass
class Step:
    """One command of the lease.

    Args:
        name: short name, in the summary.
        limit_s: the most seconds it may take (less where the budget ends sooner).
        argv: the command, built from the lease's context when the step starts; None runs `call`.
        call: an in-process step (the sharded sweep) given (context, seconds it may take, log).
    """

    name: str
    limit_s: float
    argv: Callable[["Lease"], list[str]] | None = None
    call: Callable[["Lease", float, "Log"], int] | None = None


@dataclass
class Outcome:
    name: str
    seconds: float
    status: str  # "ok", "failed (exit N)", "timed out after S s", "skipped (budget)"


@dataclass
class Lease:
    out: Path
    device: str
    budget_s: float
    shards: int
    rows: int
    steps: int
    scratch: Path
    started: float = field(default_factory=time.monotonic)

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.started)

    @property
    def profile(self) -> Path:
        return self.out / "profile.json"


class Log:
    """log.txt and the terminal at once."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", encoding="utf-8")

    def write(self, text: str) -> None:
        self.file.write(text)
        self.file.flush()
        sys.stdout.write(text)
        sys.stdout.flush()

    def close(self) -> None:
        self.file.close()


def environment(lease: Lease) -> dict[str, str]:
    """The steps' environment: the checkout first on PYTHONPATH, scratch folders in the lease's own."""
    path = [str(REPO)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path), "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(lease.scratch), "TORCHINDUCTOR_CACHE_DIR": str(lease.scratch / "inductor"),
            "DASK_TEMPORARY_DIRECTORY": str(lease.scratch / "dask")}


def run_command(argv: list[str], limit_s: float, log: Log, env: dict[str, str]) -> int | None:
    """Run `argv` with its output in the log; the exit code, or None when it was stopped at `limit_s`
    (`stop_tree`: its process group and every process below it, those in sessions of their own too)."""
    proc = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace", start_new_session=True)
    deadline = time.monotonic() + limit_s
    timer = _Killer(proc, deadline)
    timer.start()
    assert proc.stdout is not None
    for line in proc.stdout:
        log.write(line)
    proc.wait(timeout=max(0.0, deadline - time.monotonic()) + REAP_S)  # the timer kills it at the deadline
    timer.cancel()
    return None if timer.fired else proc.returncode


class _Killer:
    """Stops a process and all below it at a deadline (a thread, so that reading its output never
    blocks it)."""

    def __init__(self, proc: subprocess.Popen, deadline: float) -> None:
        import threading

        self.proc, self.deadline, self.fired = proc, deadline, False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def cancel(self) -> None:
        self._done.set()
        self._thread.join(timeout=REAP_S)

    def _watch(self) -> None:
        if self._done.wait(max(0.0, self.deadline - time.monotonic())):
            return
        self.fired = True
        stop_tree(self.proc.pid)


def stop_tree(pid: int, grace_s: float = 5.0) -> None:
    """SIGTERM to `pid`'s process group and to every process below it (torch's launcher starts its
    ranks in sessions of their own, out of the group's reach), SIGKILL to whatever is left of them
    after `grace_s`."""
    tree = [pid, *descendants(pid)]
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    for p in tree:
        send(p, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end and any(running(p) for p in tree):
        time.sleep(0.1)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    killed = kill_tree(pid) if running(pid) else []
    for p in tree:
        if p not in killed and running(p):
            send(p, signal.SIGKILL)


def shard(ids: list[str], n: int) -> list[list[str]]:
    """`ids` dealt round-robin into at most `n` non-empty shards (neighbouring cases, often the same
    spec, land in different shards)."""
    return [s for s in (ids[k::max(1, n)] for k in range(max(1, n))) if s]


def merge_shards(paths: list[Path]) -> dict:
    """The sweep's per-shard JSON files as one document (a shard cut short keeps what it wrote)."""
    merged: dict = {"specs": [], "shards": len(paths)}
    for path in paths:
        if path.is_file():
            doc = json.loads(path.read_text())
            merged.update({k: v for k, v in doc.items() if k != "specs"})
            merged["specs"] += doc["specs"]
    return merged


def sweep(lease: Lease, limit_s: float, log: Log) -> int:
    """tests/gpu/test_specs_gpu.py in `lease.shards` pytest processes at once; specs_gpu.json merged."""
    env = environment(lease)
    collected = run_tree([sys.executable, "-m", "pytest", "-m", "gpu", SWEEP, "--collect-only", "-o", "addopts=",
                          "-q", "-p", "no:cacheprovider"], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout_s=min(120.0, limit_s))
    ids = [line for line in collected.stdout.splitlines() if line.startswith(SWEEP + "::")]
    if not ids:
        log.write(f"no sweep cases collected:\n{collected.stdout[-2000:]}{collected.stderr[-2000:]}\n")
        return 1
    shards = shard(ids, lease.shards)
    log.write(f"{len(ids)} cases in {len(shards)} shards\n")
    deadline = time.monotonic() + limit_s
    procs = []
    for k, cases in enumerate(shards):
        shard_env = {**env, "FLOWREC_SPECS_GPU_JSON": str(lease.scratch / f"shard{k}.json"),
                     "OMP_NUM_THREADS": str(max(1, (os.cpu_count() or 2) // len(shards)))}
        text = (lease.scratch / f"shard{k}.txt").open("w")
        procs.append((subprocess.Popen([sys.executable, "-m", "pytest", "-m", "gpu", "-rf", "-p", "no:cacheprovider",
                                        *cases], cwd=REPO, env=shard_env, stdout=text, stderr=subprocess.STDOUT,
                                       start_new_session=True), text))
    codes = []
    for proc, text in procs:
        try:
            codes.append(proc.wait(timeout=max(0.1, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            stop_tree(proc.pid, grace_s=0.0)
            proc.wait(timeout=REAP_S)
            codes.append(None)
        text.close()
    for k, code in enumerate(codes):
        tail = (lease.scratch / f"shard{k}.txt").read_text(errors="replace").splitlines()[-30:]
        log.write(f"--- shard {k}: {'stopped at the limit' if code is None else f'exit {code}'}\n" + "\n".join(tail) + "\n")
    merged = merge_shards([lease.scratch / f"shard{k}.json" for k in range(len(shards))])
    merged["cases"] = len(ids)
    (lease.out / "specs_gpu.json").write_text(json.dumps(merged, indent=1))
    for r in merged["specs"]:
        log.write(f"{r['spec']:28s} {r['budget']:12s} {r['optimizer']:4s} loss {r['max_loss_diff']:.1e} "
                  f"param {r['max_param_diff']:.1e} not-close {len(r['params_not_close'])} "
                  f"cpu {r['seconds_cpu']:.1f}s dev {r['seconds_device']:.1f}s\n")
    log.write(f"{len(merged['specs'])} of {len(ids)} cases compared\n")
    if None in codes:
        return -1
    return max(codes)


def bf16_spec(lease: Lease) -> Path:
    """specs/dlrm_criteo.yaml with `training.precision: bf16`, in the lease's scratch folder."""
    import yaml

    doc = yaml.safe_load((REPO / SPEC).read_text())
    doc.setdefault("training", {})["precision"] = "bf16"
    path = lease.scratch / "dlrm_criteo_bf16.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def _train(lease: Lease, spec: str | Path, name: str) -> list[str]:
    target = ["--target", str(lease.profile)] if lease.profile.is_file() else []
    return [sys.executable, "-m", "flowrec", "train", str(spec), "--device", lease.device, "--rows", str(lease.rows),
            "--max-steps", str(lease.steps), "--report", "--out", str(lease.scratch / name), *target]


def _versions(lease: Lease) -> list[str]:
    code = ("import os, platform, subprocess, torch\n"
            "print('python', platform.python_version(), 'torch', torch.__version__, 'cuda', torch.version.cuda)\n"
            "print('host cores', os.cpu_count())\n"
            "for i in range(torch.cuda.device_count()):\n"
            "    p = torch.cuda.get_device_properties(i); print(f'cuda:{i}', p.name, round(p.total_memory / 2**30, 1), 'GiB')\n"
            "try:\n    import cupy; print('cupy', cupy.__version__)\nexcept ImportError:\n    print('cupy not installed')\n"
            "r = subprocess.run(['git', 'rev-parse', 'HEAD'], capture_output=True, text=True)\n"
            "print('commit', r.stdout.strip() or 'unknown')\n")
    return [sys.executable, "-c", code]


STEPS: list[Step] = [
    Step("env", 60, argv=_versions),
    Step("gpu-tests", 120, argv=lambda lease: [sys.executable, "-m", "pytest", "-m", "gpu", "tests/gpu", "-rf", "-p",
                                                "no:cacheprovider", "--durations=5", f"--ignore={SWEEP}"]),
    Step("sweep", 200, call=sweep),
    Step("calibrate", 150, argv=lambda lease: [sys.executable, "-m", "flowrec", "calibrate", SPEC, "--device",
                                               lease.device, "--out", str(lease.profile)]),
    Step("transfer", 90, argv=lambda lease: [sys.executable, "tools/bench_transfer.py", "--device", lease.device,
                                             "--steps", "150", "--repeats", "2", "--json",
                                             str(lease.out / "bench_transfer.json")]
         + (["--profile", str(lease.profile)] if lease.profile.is_file() else [])),
    Step("train-fp32", 60, argv=lambda lease: _train(lease, SPEC, "run_fp32")),
    Step("train-bf16", 60, argv=lambda lease: _train(lease, bf16_spec(lease), "run_bf16")),
    Step("ops", 60, argv=lambda lease: [sys.executable, "tools/bench_ops.py", "--device", lease.device, "--json",
                                        str(lease.out / "bench_ops.json")]),
]


def run_lease(lease: Lease, steps: list[Step], log: Log) -> list[Outcome]:
    """Each step in order, each limited to the lesser of its own limit and the budget left."""
    outcomes = []
    for step in steps:
        left = lease.left()
        if left < MIN_STEP_S:
            outcomes.append(Outcome(step.name, 0.0, "skipped (budget)"))
            log.write(f"=== {step.name}: skipped, {max(left, 0):.0f} s of the budget left\n")
            continue
        limit = min(step.limit_s, left)
        log.write(f"=== [{time.monotonic() - lease.started:.0f} s] {step.name} (at most {limit:.0f} s)\n")
        began = time.monotonic()
        try:
            code = step.call(lease, limit, log) if step.call else run_command(step.argv(lease), limit, log,
                                                                               environment(lease))
        except Exception as exc:  # a step that cannot start is that step's failure, not the lease's
            log.write(f"{step.name} could not run: {type(exc).__name__}: {exc}\n")
            code = 1
        seconds = time.monotonic() - began
        status = ("ok" if code == 0 else f"timed out after {seconds:.0f} s" if code is None or code == -1
                  else f"failed (exit {code})")
        outcomes.append(Outcome(step.name, round(seconds, 1), status))
        log.write(f"--- {step.name}: {status} in {seconds:.0f} s\n")
    return outcomes


def table(outcomes: list[Outcome]) -> str:
    lines = [f"{'step':12s} {'seconds':>8s}  outcome"]
    lines += [f"{o.name:12s} {o.seconds:8.1f}  {o.status}" for o in outcomes]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[4:]))
    parser.add_argument("--out", type=Path, required=True, help="folder for the (at most 8) result files")
    parser.add_argument("--budget", type=float, default=420.0, help="seconds for all steps (default 420)")
    parser.add_argument("--shards", type=int, default=6, help="pytest processes of the sweep at once (default 6)")
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                        help="cuda (default); cpu rehearses the steps on a machine without a GPU")
    parser.add_argument("--rows", type=int, default=1_228_800, help="synthetic rows of the DLRM runs")
    parser.add_argument("--steps", type=int, default=300, help="steps of the DLRM runs")
    parser.add_argument("--only", default="", help="comma list of step names to run (default: all)")
    args = parser.parse_args(argv)
    names = [s.name for s in STEPS]
    only = [n for n in args.only.split(",") if n]
    unknown = [n for n in only if n not in names]
    if unknown:
        parser.error(f"--only: no step named {', '.join(unknown)} (steps: {', '.join(names)})")
    if args.budget < MIN_STEP_S or args.shards < 1 or args.rows < 1 or args.steps < 1:
        parser.error(f"--budget must be at least {MIN_STEP_S:.0f} s and --shards, --rows, --steps at least 1")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("no CUDA device on this machine: nothing was run. `--device cpu` rehearses the steps here.")
            return 2
    args.out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in args.out.iterdir())
    if stale:
        parser.error(f"--out {args.out} is not empty ({', '.join(stale[:3])}...): give an empty or new folder")
    with tempfile.TemporaryDirectory(prefix="gpu-lease-") as scratch:
        lease = Lease(args.out, args.device, args.budget, args.shards, args.rows, args.steps, Path(scratch))
        log = Log(args.out / "log.txt")
        try:
            outcomes = run_lease(lease, [s for s in STEPS if not only or s.name in only], log)
            (args.out / "summary.json").write_text(json.dumps(
                {"device": args.device, "budget_s": args.budget, "shards": args.shards, "rows": args.rows,
                 "steps": args.steps, "outcomes": [asdict(o) for o in outcomes]}, indent=1))
            log.write(table(outcomes) + "\n")
        finally:
            log.close()
    return 0 if all(o.status == "ok" for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
