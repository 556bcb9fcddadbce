"""Loading a trained run: the model `flowrec eval` (and `flowrec.api.load`) scores, and the model a
`--resume` or `--init-from` run builds before its checkpoint is loaded, now against before Round 46,
side by side in one process.

  eval    now: `load_trained` on the CPU maps the checkpoint file (`torch.load(mmap=True)`), builds
          the model without drawing its tables (`operators.embedding.restoring_tables`) and takes
          the checkpoint's tensors as the model's (`load_state_dict(assign=True)`).
          before: the checkpoint read into memory, the model's tables drawn, then the checkpoint's
          tensors copied into them.
  resume  now: the model built without drawing its tables, then the checkpoint copied in (training
          writes its rows: they are copied, not mapped).
          before: the tables drawn first.

Trains SPEC for one step on synthetic rows into a temporary run folder, then alternates the
variants `--rounds` times (after a warm-up load that is not counted). For each: the seconds to a
loaded model. (Memory is not compared here: in one process the allocator reuses what the rounds
before freed. `/usr/bin/time -v flowrec eval RUN --data D` shows the peak of each in a process of
its own: Round 46 in docs/benchmarks/training-rounds-40-49.md.) Every variant must give the same
model state (bitwise) and, for eval, the same scores on fresh synthetic rows: the benchmark stops
with an error otherwise. Figures are medians over the rounds; `ratios` are before / now from the same run.

Usage: python tools/bench_restore.py [--quick] [--spec S] [--rounds R] [--json PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.benchargs import bench_spec, in_temp_folder, refuse_below_one  # noqa: E402

QUICK_SPEC = {"name": "restore_quick", "features": [
    {"name": "x", "type": "dense"},
    {"name": "a", "type": "categorical", "hash_buckets": 900_000, "dim": 8},
    {"name": "b", "type": "categorical", "hash_buckets": 300_000, "dim": 8},
    {"name": "c", "type": "categorical", "hash_buckets": 40, "dim": 8}],
    "modules": [{"name": "m", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [8]}],
    "heads": [{"name": "h", "input": "m"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.1}},
    "training": {"batch_size": 256, "seed": 5, "eval_every": 0}}
VARIANTS = ("now", "before")


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="a small built-in spec (1.2 M table rows), 1 round (smoke run)")
    p.add_argument("--spec", default=None, help="spec file (default specs/dlrm_criteo.yaml; quick: a small built-in one)")
    p.add_argument("--rounds", type=int, default=None, help="alternating rounds (default 3; quick 1)")
    p.add_argument("--json", default=None, help="write the figures to this JSON file")
    a = p.parse_args(argv)
    refuse_below_one(p, a, "rounds")
    return a


def _eval_before(run: Path):
    """`load_trained` as before Round 46: read, drawn, copied."""
    from flowrec.planner.contract import scoring_plan
    from flowrec.runtime.checkpoint.store import check_tensors, checkpoint_path, load_checkpoint
    from flowrec.runtime.lowering import lower
    from flowrec.serving.trained import _spec_of, stored_plan

    source = checkpoint_path(run)
    state = load_checkpoint(source)
    spec = _spec_of(state, source)
    model = lower(scoring_plan(stored_plan(state, str(run))), spec, "cpu")
    check_tensors(source, "model", model.state_dict(), state["model"])
    model.load_state_dict(state["model"])
    return model


def _eval_now(run: Path):
    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.trained import load_trained

    return load_trained(run, "cpu", scoring_plan).model


def _resume(run: Path, name: str):
    """The model a resumed run builds, with its checkpoint loaded (`Trainer.load_state`'s copy)."""
    import contextlib

    from flowrec.runtime.checkpoint.store import load_checkpoint
    from flowrec.runtime.lowering import lower
    from flowrec.serving.trained import _spec_of, stored_plan
    from operators.embedding import restoring_tables

    source = run / "checkpoint.pt"
    state = load_checkpoint(source, mmap=True)  # as the resume reads it
    spec = _spec_of(state, source)
    with restoring_tables() if name == "now" else contextlib.nullcontext():
        model = lower(stored_plan(state, str(run)), spec, "cpu")
    model.load_state_dict(state["model"])
    state.clear()
    return model


def _scores(model, spec, rows) -> "object":
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource
    from flowrec.runtime.evaluation.evaluate import predict

    opts = StagingOptions(batch_size=spec.training.batch_size, shuffle=False, lookahead=0)
    with iterate_batches(spec, MemorySource([rows]), opts, 0, 0, model.groups) as batches:
        return predict(model, batches)[0]


def _timed(build, *args) -> tuple[dict, object]:
    gc.collect()
    t = time.perf_counter()
    model = build(*args)
    return {"seconds": time.perf_counter() - t}, model


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); the figures, also written to --json."""
    a = _args(argv)
    return in_temp_folder(lambda tmp: _run(a, tmp), "flowrec-restore-")


def _run(a: argparse.Namespace, tmp: Path) -> dict:
    import numpy as np
    import torch

    import flowrec
    from flowrec.data.synth import SynthConfig, synth_table

    spec = bench_spec(a.spec, QUICK_SPEC if a.quick else None)
    rounds = a.rounds or (1 if a.quick else 3)
    run = tmp / "run"
    t = time.perf_counter()
    flowrec.train(spec, out=run, rows=max(4 * spec.training.batch_size, 2_000), max_steps=1, eval_every=0, device="cpu")
    print(f"trained {spec.name} for one step into {run} in {time.perf_counter() - t:.1f} s", file=sys.stderr)
    rows = synth_table(spec, 2 * spec.training.batch_size, SynthConfig(seed=int(np.random.default_rng().integers(2**31))))
    builds = {("eval", "now"): (_eval_now, run), ("eval", "before"): (_eval_before, run),
              ("resume", "now"): (_resume, run, "now"), ("resume", "before"): (_resume, run, "before")}
    _timed(*builds[("eval", "now")])  # warm-up (imports, first kernels): not counted
    figures: dict[str, dict[str, list[dict]]] = {k: {n: [] for n in VARIANTS} for k in ("eval", "resume")}
    for r in range(rounds):
        for kind in ("eval", "resume"):
            made = {}
            for name in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
                record, model = _timed(*builds[(kind, name)])
                figures[kind][name].append(record)
                state = {k: v.detach().clone() for k, v in model.state_dict().items()}
                made[name] = (state, _scores(model, spec, rows) if kind == "eval" else None)
                print(f"[round {r + 1}/{rounds}] {kind} {name}: {record['seconds']:.2f} s", file=sys.stderr)
                del model, state
                gc.collect()
            (sa, pa), (sb, pb) = made["now"], made["before"]
            if sa.keys() != sb.keys() or not all(torch.equal(sa[k], sb[k]) for k in sa):
                sys.exit(f"error: {kind}: the two variants' model states differ")
            if kind == "eval" and not np.array_equal(pa, pb):
                sys.exit("error: eval: the two variants' scores differ")
            del made, sa, sb
    med = {k: {n: {m: statistics.median(x[m] for x in rs) for m in rs[0]} for n, rs in by.items()}
           for k, by in figures.items()}
    out = {
        "benchmark": "restore", "spec": spec.name, "rounds": rounds,
        "table_bytes": sum(t.rows * t.dim * 4 for t in spec.tables),
        "torch_threads": torch.get_num_threads(), "same_state_and_scores": True,
        "median": med, "runs": figures,
        "ratios": {f"{k}_seconds_now_vs_before": med[k]["before"]["seconds"] / med[k]["now"]["seconds"]
                   for k in med},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version()},
    }
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({k: out[k] for k in ("table_bytes", "median", "ratios")}, indent=2))
    return out


if __name__ == "__main__":
    main()
