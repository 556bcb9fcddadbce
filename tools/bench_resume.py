"""A finished run's `flowrec train --resume RUN` told from its checkpoint against the run loaded
whole, and `flowrec eval RUN`, each command in a process of its own.

  resume_checkpoint   `flowrec train SPEC --resume RUN --json`: the checkpoint says the run is
                      finished (`flowrec/runs/finished.py`, af9be63c): mapped and checked, its
                      tensors fitted to the model lowered on the meta device; no data read, no
                      table drawn or copied
  resume_full_load    the same command with `FLOWREC_RESUME_FULL_LOAD=1`: the run's data read,
                      its model built and every table loaded before it is said finished (the
                      path before af9be63c, and the one a checkpoint that does not fit takes)
  eval                `flowrec eval RUN --json -`: the run's model restored and scored on its
                      evaluation rows (a model without dropout never imports torch._dynamo since
                      4f2ab358)

Trains SPEC on the CPU for `--epochs` epochs of `--rows` synthetic rows into a temporary run folder
(a `flowrec` process of its own, not timed), runs each command once untimed (the page cache, the
interpreter's bytecode), then alternates the three `--rounds` times, the order reversed every other
round. Each command's wall-clock seconds, CPU seconds (user + system of the process and anything it
waited for, from `os.wait4`) and peak resident memory (its `ru_maxrss`) are medians over the
rounds. The two resumes must print the same last line and the same --json document, and every
command must succeed: the benchmark stops with an error otherwise. `ratios` are full load over
checkpoint, from the same rounds.

Usage: python tools/bench_resume.py [--spec S] [--rows N] [--epochs E] [--rounds R] [--out PATH]
       python tools/bench_resume.py --spec specs/dlrm_criteo.yaml --out F   # the big case (2.2 GB)
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600  # each measured command: past it it is killed, and its status says so
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.benchargs import in_temp_folder, refuse_below_one  # noqa: E402

VARIANTS = ("resume_checkpoint", "resume_full_load", "eval")
FULL_LOAD_ENV = "FLOWREC_RESUME_FULL_LOAD"  # flowrec.runs.finished.FULL_LOAD_ENV (not imported: no torch here)
SMALL_SPEC = {"name": "resume_small", "features": [
    {"name": "d0", "type": "dense", "transform": "log1p"},
    {"name": "d1", "type": "dense", "transform": "log1p"},
    *({"name": f"c{i}", "type": "categorical", "hash_buckets": 20_000 * (1 + i), "dim": 8 * (1 + i % 2)}
      for i in range(6))],
    "modules": [{"name": "deep", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [32, 16]}],
    "heads": [{"name": "ctr", "input": "deep"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.1}},
    "training": {"batch_size": 256, "epochs": 1, "seed": 5}}  # the default: 6 hashed fields, 420,000 rows


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=None,
                   help="spec file (default: a small built-in spec of 6 hashed fields; specs/dlrm_criteo.yaml: "
                        "the big case, a 2.2 GB checkpoint)")
    p.add_argument("--rows", type=int, default=None,
                   help="synthetic rows trained on (default: 4 batches of the spec, at least 2,000)")
    p.add_argument("--epochs", type=int, default=1, help="epochs trained before the run is finished (default 1)")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds; the figures are medians (default 3)")
    p.add_argument("--out", default=None, help="write the figures to this JSON file")
    a = p.parse_args(argv)
    refuse_below_one(p, a, "rows", "epochs", "rounds")
    return a


def _spec_file(path: str | None, tmp: Path) -> tuple[Path, dict[str, Any]]:
    """The spec file to train and resume (SPEC, or the built-in one written to `tmp`) and its document."""
    from flowrec.spec.read import read_document

    if path is None:
        file = tmp / "spec.json"
        file.write_text(json.dumps(SMALL_SPEC))
        return file, SMALL_SPEC
    try:
        return Path(path), read_document(Path(path))
    except Exception as exc:  # the reader's own errors name the file and the problem
        sys.exit(f"error: {exc}")


def _env(full_load: bool) -> dict[str, str]:
    """The environment of a command: this repository's flowrec first; the full load asked for or not."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop(FULL_LOAD_ENV, None)
    if full_load:
        env[FULL_LOAD_ENV] = "1"
    return env


def measured(args: list[str], env: dict[str, str]) -> dict[str, Any]:
    """Run `python -m flowrec ARGS` in a process of its own: its wall and CPU seconds, its peak
    resident memory (MiB), its exit status, its stdout and its last line on stderr."""
    wall = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "flowrec", *args], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    outs: list[str] = []
    reader = threading.Thread(target=lambda: outs.append(proc.stdout.read()))  # both pipes drained at once
    reader.start()
    stopper = threading.Timer(RUN_TIMEOUT_S, proc.kill)  # a hung command: killed, its status says so
    stopper.start()
    try:
        err = proc.stderr.read()
        reader.join(RUN_TIMEOUT_S)
    finally:
        stopper.cancel()
    _, status, usage = os.wait4(proc.pid, 0)  # the process's own usage (Popen.wait would reap it without)
    proc.returncode = os.waitstatus_to_exitcode(status)
    proc.stdout.close()
    proc.stderr.close()
    out = outs[0]
    lines = err.strip().splitlines()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": usage.ru_utime + usage.ru_stime,
            "peak_rss_mib": usage.ru_maxrss / 1024,  # Linux reports KiB
            "status": proc.returncode, "stdout": out, "line": lines[-1] if lines else ""}


def _commands(spec: Path, run: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    resume = ["train", str(spec), "--resume", str(run), "--json"]
    return {"resume_checkpoint": (resume, _env(False)), "resume_full_load": (resume, _env(True)),
            "eval": (["eval", str(run), "--json", "-"], _env(False))}


def _checked(name: str, done: dict[str, Any]) -> dict[str, Any]:
    if done["status"] != 0:
        sys.exit(f"error: {name} failed (exit {done['status']}): {done['line']}")
    return done


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); the figures, also written to --out."""
    a = _args(argv)
    return in_temp_folder(lambda tmp: _run(a, tmp), "flowrec-resume-")


def _run(a: argparse.Namespace, tmp: Path) -> dict:
    spec, doc = _spec_file(a.spec, tmp)
    batch = int(doc.get("training", {}).get("batch_size", 256))
    rows = a.rows or max(4 * batch, 2_000)
    run = tmp / "run"
    t = time.perf_counter()
    _checked("training", measured(["train", str(spec), "--out", str(run), "--device", "cpu", "--rows", str(rows),
                                   "--epochs", str(a.epochs), "--quiet"], _env(False)))
    print(f"{doc.get('name')}: {rows} rows, {a.epochs} epoch(s) trained in {time.perf_counter() - t:.1f} s",
          file=sys.stderr)
    commands = _commands(spec, run)
    first = {name: _checked(name, measured(*commands[name])) for name in VARIANTS}  # warm-up: not counted
    said = {name: (first[name]["line"], first[name]["stdout"]) for name in VARIANTS}
    if said["resume_checkpoint"] != said["resume_full_load"]:
        sys.exit(f"error: the two resumes said different things: {said['resume_checkpoint'][0]!r} against "
                 f"{said['resume_full_load'][0]!r}")
    if not json.loads(said["resume_checkpoint"][1]).get("finished"):
        sys.exit(f"error: the run was not finished: {said['resume_checkpoint'][0]!r}")
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in VARIANTS}
    for r in range(a.rounds):
        for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            done = _checked(name, measured(*commands[name]))
            if name != "eval" and (done["line"], done["stdout"]) != said[name]:
                sys.exit(f"error: {name} said otherwise in round {r + 1}: {done['line']!r}")
            runs[name].append({k: done[k] for k in ("wall_s", "cpu_s", "peak_rss_mib")})
            print(f"[round {r + 1}/{a.rounds}] {name}: {done['wall_s']:.2f} s wall, {done['cpu_s']:.2f} s CPU, "
                  f"{done['peak_rss_mib']:.0f} MiB", file=sys.stderr)
    median = {n: {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "cpu_s", "peak_rss_mib")}
              for n, rs in runs.items()}
    out = {
        "benchmark": "resume", "spec": doc.get("name"), "rows": rows, "epochs": a.epochs, "rounds": a.rounds,
        "checkpoint_bytes": sum(p.stat().st_size for p in run.glob("checkpoint*.pt")),
        "same_line_and_document": True,
        "lines": {"resume": said["resume_checkpoint"][0], "eval": said["eval"][0]},
        "median": median, "runs": runs,
        "ratios": {f"full_load_vs_checkpoint_{k}": median["resume_full_load"][k] / median["resume_checkpoint"][k]
                   for k in ("wall_s", "cpu_s", "peak_rss_mib")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "load_average": list(os.getloadavg())},
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("spec", "checkpoint_bytes", "median", "ratios")}, indent=2))
    return out


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
