"""Loading a model package: `torch.export.load` against flowrec's `load_program` (with and without
its sympify memo) and `flowrec.load_model` whole, side by side in one process, plus the first
predict of one row.

  torch_export_load   `torch.export.load(PKG/model.pt2)`: torch's own deserialiser
  load_program        `flowrec.serving.pt2_load.load_program`: the same call, each schema class's
                      type hints looked up once and each symbolic size's text parsed once
  load_program_no_memo  the same, each symbolic size's text parsed by sympy's parser every time
                      (the type hints still remembered: `load_program` before commit bd38d61e)
  load_model          `flowrec.load_model(PKG)` whole: digests, archive check, `load_program`,
                      program checks, the program's module, encoder; then its first
                      `predict` of one raw row (`first_predict`)
  load_model_samples_twice  the same, the example inputs the archive's check unpickled not
                      handed to `load_program`: torch unpickles them a second time (as
                      before serve9)
  load_model_before   with `--before PKG`: `flowrec.load_model(PKG)`, a package another flowrec
                      exported (of the same spec, say: a version 2 package, one lookup per field,
                      from a checkout before serve10), alternating with the others

Each package's graph is counted (`graph`: nodes, embedding_bag nodes, placeholders).

Writes skewed synthetic raw rows of SPEC (zipf ids per categorical feature, log-normal dense
values, a 0/1 label) as Parquet, converts them, trains a few steps on the CPU and exports a package
(each through the `flowrec` command in a process of its own: none of it is timed), then loads the
package once per variant, untimed (imports, first kernels), and alternates the variants `--rounds`
times, the order reversed every other round. Each variant's wall-clock seconds and this process's
CPU seconds (`time.process_time`: every thread) are medians over the rounds. The three program
loads must give the same graph and range constraints: the benchmark stops with an error
otherwise. `--table-rows N` caps every table's rows at N (the 1,000-field spec's 3.9 GB of tables
need about that much memory per loaded copy; the program's graph, what the loads parse, is the
same size).

Beside the loads, the export's own steps that flowrec controls, alternating in the same way
(`export` in the JSON):

  serving_copied      `ServingModel` from the run's checkpoint (mapped, as `flowrec export`
                      loads it; not timed) with every table copied (`mapped=False`, as before)
  serving_in_place    the same with `mapped=True`: the mapped tables used in place

The two ServingModels must hold the same tables.

Usage: python tools/bench_package_load.py [--spec S] [--rows N] [--steps K] [--rounds R]
       [--table-rows N] [--before PKG] [--out PATH]
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 600  # each flowrec command (convert, train, export): past it the tool stops with a line
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from flowrec.testing.benchargs import in_temp_folder, refuse_below_one  # noqa: E402
from flowrec.testing.processes import run_tree  # noqa: E402

VARIANTS = ("torch_export_load", "load_program", "load_program_no_memo", "load_model", "load_model_samples_twice")
EXPORT_VARIANTS = ("serving_copied", "serving_in_place")
SMALL_SPEC = {"name": "package_load_small", "features": [
    {"name": "d0", "type": "dense", "transform": "log1p"},
    {"name": "d1", "type": "dense", "transform": "log1p"},
    *({"name": f"c{i}", "type": "categorical", "hash_buckets": 50 + 40 * i, "dim": 4 * (1 + i % 2)}
      for i in range(8))],
    "modules": [{"name": "deep", "kind": "mlp", "inputs": ["@dense", "@sparse"], "layers": [16]}],
    "heads": [{"name": "ctr", "input": "deep"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.01}, "sparse": {"name": "adagrad", "lr": 0.1}},
    "training": {"batch_size": 64, "seed": 5}}  # the default: 8 hashed fields, 2 dense


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default=None,
                   help="spec file (default: a small built-in spec of 8 hashed fields; specs/wide_1000.yaml: the big case)")
    p.add_argument("--rows", type=int, default=400, help="synthetic raw rows trained on (default 400)")
    p.add_argument("--steps", type=int, default=3, help="training steps before the export (default 3)")
    p.add_argument("--rounds", type=int, default=5, help="alternating rounds; the figures are medians (default 5)")
    p.add_argument("--table-rows", type=int, default=None,
                   help="cap every table at this many rows (default: the spec's own sizes)")
    p.add_argument("--before", default=None,
                   help="a package another flowrec exported, loaded alternating with this one's (load_model_before)")
    p.add_argument("--out", default=None, help="write the figures to this JSON file")
    a = p.parse_args(argv)
    refuse_below_one(p, a, "rows", "steps", "rounds", "table_rows")
    return a


def _spec_document(path: str | None, table_rows: int | None, rows: int) -> dict[str, Any]:
    """The spec document to train: SPEC's (or the small one), its batch at most `rows` and its
    tables capped at `table_rows` rows."""
    import copy

    from flowrec.spec.read import read_document

    doc = copy.deepcopy(SMALL_SPEC) if path is None else _read(read_document, path)
    training = doc.setdefault("training", {})
    training["batch_size"] = min(int(training.get("batch_size", 256)), rows)
    training["eval_every"] = 0
    doc.get("plan", {}).pop("device", None)
    if table_rows is not None:
        for item in (*doc.get("features", []), *doc.get("tables", [])):
            for key in ("hash_buckets", "vocab"):
                if isinstance(item.get(key), int):
                    item[key] = min(item[key], table_rows)
    return doc


def _read(read: Callable[[Path], Any], path: str) -> dict[str, Any]:
    try:
        return read(Path(path))
    except Exception as exc:  # the reader's own errors name the file and the problem
        sys.exit(f"error: {exc}")


def raw_rows(spec: Any, rows: int, seed: int) -> Any:
    """`rows` skewed raw rows of `spec`: zipf ids as text per categorical feature (a few ids hold
    most rows), log-normal dense values, a 0/1 label."""
    import numpy as np
    import pyarrow as pa

    rng = np.random.default_rng(seed)
    columns: dict[str, Any] = {}
    for f in spec.dense_features:
        columns[f.name] = pa.array(rng.lognormal(1.0, 1.5, rows))
    for f in spec.sparse_features:
        columns[f.name] = pa.array([f"{v}" for v in rng.zipf(1.3, rows) % 100_003])
    columns["label"] = pa.array(rng.integers(0, 2, rows))
    return pa.table(columns)


def _flowrec(*args: str) -> None:
    try:
        done = run_tree([sys.executable, "-m", "flowrec", *args], capture_output=True, text=True,
                        timeout_s=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        sys.exit(f"error: flowrec {args[0]} still running after {RUN_TIMEOUT_S} s; stopped")
    if done.returncode != 0:
        sys.exit(f"error: flowrec {args[0]} failed (exit {done.returncode}): "
                 f"{(done.stderr or done.stdout).strip().splitlines()[-1:]}")


def make_package(doc: dict[str, Any], rows: int, steps: int, tmp: Path) -> tuple[Path, Any]:
    """Convert `rows` raw rows of spec `doc`, train `steps` steps on the CPU and export: the
    package's folder and the spec."""
    import pyarrow.parquet as pq

    from flowrec.spec import spec_from_dict

    spec = spec_from_dict(doc)
    file, spec_file = tmp / "rows.parquet", tmp / "spec.json"
    spec_file.write_text(json.dumps(doc))
    pq.write_table(raw_rows(spec, rows, seed=11), file)
    _flowrec("data", "convert", "parquet", str(file), str(tmp / "data"), "--spec", str(spec_file), "-q")
    _flowrec("train", str(spec_file), "--data", str(tmp / "data"), "--out", str(tmp / "run"), "--device", "cpu",
             "--max-steps", str(steps), "--quiet")
    _flowrec("export", str(tmp / "run"), str(tmp / "pkg"), "-q")
    return tmp / "pkg", spec


def _loaders(pkg: Path, before: Path | None = None) -> dict[str, Callable[[], Any]]:
    import sympy
    import torch

    import flowrec
    from flowrec.serving import pt2_load

    model = pkg / "model.pt2"

    def no_memo() -> Any:
        remembering = pt2_load._remembering_sympy
        pt2_load._remembering_sympy = lambda: sympy  # the module itself: each text parsed anew
        try:
            return pt2_load.load_program(model)
        finally:
            pt2_load._remembering_sympy = remembering

    def samples_twice() -> Any:
        from flowrec.serving import predict

        plain = predict.load_program
        predict.load_program = lambda path, checked=None: plain(path)  # the check's inputs not handed over
        try:
            return flowrec.load_model(pkg)
        finally:
            predict.load_program = plain

    loaders = {"torch_export_load": lambda: torch.export.load(model),
               "load_program": lambda: pt2_load.load_program(model),
               "load_program_no_memo": no_memo,
               "load_model": lambda: flowrec.load_model(pkg),
               "load_model_samples_twice": samples_twice}
    if before is not None:
        loaders["load_model_before"] = lambda: flowrec.load_model(before)
    return loaders


def graph_counts(path: Path) -> dict[str, int]:
    """The graph of a package's model.pt2: its nodes, embedding_bag nodes and placeholders."""
    from flowrec.serving import pt2_load

    nodes = list(pt2_load.load_program(Path(path) / "model.pt2").graph.nodes)
    return {"nodes": len(nodes), "embedding_bags": sum("embedding_bag" in str(n.target) for n in nodes),
            "placeholders": sum(n.op == "placeholder" for n in nodes)}


def _export_steps(run: Path) -> dict[str, Callable[[], Any]]:
    """The export's steps, each a call returning (the figures of its timed part, what it made)."""
    from flowrec.planner.contract import scoring_plan
    from flowrec.serving.trained import ServingModel, load_trained

    def serving(mapped: bool) -> Callable[[], Any]:
        def build() -> Any:
            trained = load_trained(run, "cpu", scoring_plan, mmap=True)  # (not timed)
            figures, made = _timed(lambda: ServingModel(trained.spec, trained.model, mapped))
            return figures, [t.detach() for t in made.tables]
        return build

    return {"serving_copied": serving(False), "serving_in_place": serving(True)}


def _timed(load: Callable[[], Any]) -> tuple[dict[str, float], Any]:
    gc.collect()
    wall, cpu = time.perf_counter(), time.process_time()
    made = load()
    return {"wall_s": time.perf_counter() - wall, "cpu_s": time.process_time() - cpu}, made


def _first_predict(model: Any, row: Any) -> dict[str, float]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (a column of one row: its warnings are not what is timed)
        figures, scores = _timed(lambda: model.predict(row))
    if len(scores) != 1:
        sys.exit("error: the first predict of one row gave no score")
    return figures


def _shape(program: Any) -> tuple[str, str]:
    """What a program load must agree on: its graph's code and its range constraints."""
    return program.graph_module.code, repr(sorted((str(k), str(v)) for k, v in program.range_constraints.items()))


def main(argv: list[str] | None = None) -> dict:
    """Run the benchmark (see the module docstring); the figures, also written to --out."""
    a = _args(argv)
    return in_temp_folder(lambda tmp: _run(a, tmp), "flowrec-package-load-")


def _run(a: argparse.Namespace, tmp: Path) -> dict:
    import torch

    doc = _spec_document(a.spec, a.table_rows, a.rows)
    t = time.perf_counter()
    pkg, spec = make_package(doc, a.rows, a.steps, tmp)
    print(f"{spec.name}: {a.rows} rows converted, {a.steps} steps trained, exported in "
          f"{time.perf_counter() - t:.1f} s", file=sys.stderr)
    row = raw_rows(spec, 1, seed=int(time.time_ns() % 2**31))
    loaders = _loaders(pkg, Path(a.before) if a.before else None)
    variants = tuple(loaders)
    for name, load in loaders.items():  # warm-up (imports, first kernels): not counted
        load()
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in variants}
    predicts: list[dict[str, float]] = []
    for r in range(a.rounds):
        shapes = {}
        for name in (variants if r % 2 == 0 else variants[::-1]):
            figures, made = _timed(loaders[name])
            runs[name].append(figures)
            if name == "load_model":
                predicts.append(_first_predict(made, row))
            elif name not in ("load_model_samples_twice", "load_model_before"):
                shapes[name] = _shape(made)
            print(f"[round {r + 1}/{a.rounds}] {name}: {figures['wall_s']:.2f} s wall, {figures['cpu_s']:.2f} s CPU",
                  file=sys.stderr)
            del made
        if len(set(shapes.values())) != 1:
            sys.exit("error: the program loads gave different graphs or range constraints")
    export = _alternate_export(tmp / "run", a.rounds)
    median = {n: {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "cpu_s")} for n, rs in runs.items()}
    median["first_predict"] = {k: statistics.median(x[k] for x in predicts) for k in ("wall_s", "cpu_s")}
    out = {
        "benchmark": "package_load", "spec": spec.name, "fields": len(spec.sparse_features),
        "table_rows": sum(t.rows for t in spec.tables), "rows": a.rows, "steps": a.steps, "rounds": a.rounds,
        "model_pt2_bytes": (pkg / "model.pt2").stat().st_size, "torch_threads": torch.get_num_threads(),
        "same_graph": True, "graph": {"package": graph_counts(pkg),
                                      **({"before": graph_counts(Path(a.before))} if a.before else {})},
        "before": a.before, "median": median, "runs": {**runs, "first_predict": predicts}, "export": export,
        "ratios": {f"{n}_wall_vs_load_program": median[n]["wall_s"] / median["load_program"]["wall_s"]
                   for n in ("torch_export_load", "load_program_no_memo")},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "python": platform.python_version(),
                    "torch": torch.__version__, "load_average": list(os.getloadavg())},
    }
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    print(json.dumps({**{k: out[k] for k in ("spec", "fields", "model_pt2_bytes", "graph", "median", "ratios")},
                      "export": export["median"]}, indent=2))
    return out


def _alternate_export(run: Path, rounds: int) -> dict[str, Any]:
    """The export's steps (`EXPORT_VARIANTS`), once untimed, then `rounds` rounds alternating:
    medians and every round's figures; the two ServingModels' tables must agree each round."""
    import torch

    steps = _export_steps(run)
    for name in EXPORT_VARIANTS:  # warm-up: not counted
        steps[name]()
    runs: dict[str, list[dict[str, float]]] = {n: [] for n in EXPORT_VARIANTS}
    for r in range(rounds):
        made = {}
        for name in (EXPORT_VARIANTS if r % 2 == 0 else EXPORT_VARIANTS[::-1]):
            gc.collect()
            figures, made[name] = steps[name]()
            runs[name].append(figures)
            print(f"[export round {r + 1}/{rounds}] {name}: {figures['wall_s']:.2f} s wall, "
                  f"{figures['cpu_s']:.2f} s CPU", file=sys.stderr)
        copied, in_place = made["serving_copied"], made["serving_in_place"]
        if len(copied) != len(in_place) or not all(map(torch.equal, copied, in_place)):
            sys.exit("error: the two ServingModels hold different tables")
        del made
    median = {n: {k: statistics.median(x[k] for x in rs) for k in ("wall_s", "cpu_s")} for n, rs in runs.items()}
    return {"median": median, "runs": runs}


if __name__ == "__main__":
    from flowrec.testing.benchargs import run_stoppable

    run_stoppable(main)
