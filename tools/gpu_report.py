"""One command for whoever has a GPU: the GPU tests, the benchmarks on CUDA, every GPU target.

    python tools/gpu_report.py [--quick] [--no-docs]

Runs `pytest -m gpu` (the CUDA/CuPy tests; the every-spec CPU-against-GPU sweep writes
`bench/results/specs_gpu_<device>.json`), every `tools/bench_*.py` that takes `--device` with
`--device cuda --json bench/results/<name>_<device>.json` (the others are listed as not run), then
checks every GPU target (`TARGETS`: the figures docs/operators.md and docs/benchmarks.md ask for)
against what was measured, writes `bench/results/gpu_report_<device>.json` and the markdown
summary between the markers of docs/gpu.md. `<device>` is the GPU's name as a slug
(`nvidia-h100-80gb-hbm3`). On a machine without CUDA it says so, lists every target as missed and
writes nothing.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from flowrec.testing.processes import run_tree  # noqa: E402

RESULTS = REPO / "bench" / "results"
DOCS = REPO / "docs" / "gpu.md"
START, END = "<!-- gpu-report:start -->", "<!-- gpu-report:end -->"
TEST_TIMEOUT_S = 1800  # pytest -m gpu
BENCH_TIMEOUT_S = 3600  # one benchmark


@dataclass(frozen=True)
class Target:
    """A figure a GPU run must reach.

    Args:
        name: short name.
        source: where the target is stated.
        want: the target, in words.
        read: the measured value from the results by benchmark name (None: not measured).
        reached: whether a measured value meets the target.
    """

    name: str
    source: str
    want: str
    read: Callable[[dict[str, Any]], float | None]
    reached: Callable[[float], bool]


def _get(results: dict[str, Any], bench: str, *keys: str) -> float | None:
    value: Any = results.get(bench)
    for key in keys:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    return float(value) if isinstance(value, (int, float)) else None


TARGETS = (
    Target("gpu tests pass", "tests/gpu", "every `pytest -m gpu` test passes (failures counted)",
           lambda r: _get(r, "gpu_tests", "failed"), lambda v: v == 0),
    Target("packed vs per-field dense grads, 26 fields", "docs/operators.md", ">= 15x",
           lambda r: _get(r, "ops", "ratios", "packed_vs_dense_grad_f26"), lambda v: v >= 15),
    Target("packed vs per-field sparse grads, 1,000 fields", "docs/operators.md", ">= 2.5x",
           lambda r: _get(r, "ops", "ratios", "packed_vs_sparse_f1000"), lambda v: v >= 2.5),
    Target("packed vs gather floor, 26 fields", "docs/operators.md", "<= 2x the gather floor",
           lambda r: _get(r, "ops", "ratios", "packed_vs_floor_f26"), lambda v: v <= 2),
    Target("packed vs gather floor, 1,000 fields", "docs/operators.md", "<= 2.5x the gather floor",
           lambda r: _get(r, "ops", "ratios", "packed_vs_floor_f1000"), lambda v: v <= 2.5),
    Target("DLRM-Criteo step vs plain PyTorch, fp32", "docs/benchmarks.md", ">= 8x",
           lambda r: _get(r, "train", "ratios", "flowrec_vs_plain_dlrm"), lambda v: v >= 8),
    Target("DLRM-Criteo step vs TorchRec, fp32", "docs/benchmarks.md", ">= 1.2x",
           lambda r: _get(r, "train", "ratios", "flowrec_vs_torchrec_dlrm"), lambda v: v >= 1.2),
    Target("DLRM-Criteo step vs TorchRec, bf16", "docs/benchmarks.md", ">= 1.2x",
           lambda r: _get(r, "train", "ratios", "flowrec_vs_torchrec_dlrm_bf16"), lambda v: v >= 1.2),
    Target("wide_1000 step vs plain PyTorch, fp32", "docs/benchmarks.md", ">= 10x",
           lambda r: _get(r, "train", "ratios", "flowrec_vs_plain_wide1000"), lambda v: v >= 10),
    Target("wide_1000 step vs TorchRec, fp32", "docs/benchmarks.md", ">= 1.2x",
           lambda r: _get(r, "train", "ratios", "flowrec_vs_torchrec_wide1000"), lambda v: v >= 1.2),
    Target("wide_1000 step vs TorchRec, bf16", "docs/benchmarks.md", ">= 1.2x",
           lambda r: _get(r, "train", "ratios", "flowrec_vs_torchrec_wide1000_bf16"), lambda v: v >= 1.2),
    Target("lookahead cache traffic vs Belady", "docs/caching.md", "<= 1.2x the Belady bound",
           lambda r: _get(r, "cache", "ratios", "lookahead_vs_belady_bytes"), lambda v: v <= 1.2),
)


def device_slug() -> str | None:
    """The first CUDA device's name as a slug, or None without CUDA."""
    from operators.device import cuda_devices

    found = cuda_devices()
    return re.sub(r"[^a-z0-9]+", "-", found[0].name.lower()).strip("-") if found else None


def takes_device(script: Path) -> bool:
    """Whether a benchmark script has a `--device` option: an `add_argument("--device", ...)` call
    in its source (a script that only passes `--device cpu` to `flowrec` has none, and would fail
    on `--device cuda`)."""
    tree = ast.parse(script.read_text(), filename=str(script))
    return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
               and node.func.attr == "add_argument"
               and any(isinstance(a, ast.Constant) and a.value == "--device" for a in node.args)
               for node in ast.walk(tree))


def run_gpu_tests(slug: str) -> dict[str, Any]:
    """`pytest -m gpu` with a JUnit report; counts of passed, failed, skipped."""
    junit = RESULTS / f"gpu_tests_{slug}.xml"
    # the every-spec sweep (tests/gpu/test_specs_gpu.py) writes what it compared per spec here
    env = {**os.environ, "FLOWREC_SPECS_GPU_JSON": str(RESULTS / f"specs_gpu_{slug}.json")}
    proc = run_tree([sys.executable, "-m", "pytest", "-m", "gpu", "-q", f"--junitxml={junit}"],
                    cwd=REPO, capture_output=True, text=True, timeout_s=TEST_TIMEOUT_S, env=env)
    suite = ET.parse(junit).getroot()
    suite = suite.find("testsuite") if suite.tag == "testsuites" else suite
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    junit.unlink()
    return {"exit_code": proc.returncode, "tests": counts["tests"],
            "failed": counts["failures"] + counts["errors"], "skipped": counts["skipped"],
            "tail": proc.stdout.splitlines()[-20:]}


def benchmarks() -> tuple[list[Path], dict[str, str]]:
    """(the benchmark scripts that take --device, {name: why the others cannot run on cuda})."""
    scripts = sorted((REPO / "tools").glob("bench_*.py"))
    return ([s for s in scripts if takes_device(s)],
            {s.stem.removeprefix("bench_"): f"{s.name} has no --device option" for s in scripts if not takes_device(s)})


def run_benchmarks(slug: str, quick: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Every benchmark that takes --device, on cuda: ({name: its JSON}, {name: why it was not run})."""
    results = {}
    scripts, skipped = benchmarks()
    for script in scripts:
        name = script.stem.removeprefix("bench_")
        out = RESULTS / f"{name}_{slug}.json"
        cmd = [sys.executable, str(script), "--device", "cuda", "--json", str(out)] + (["--quick"] if quick else [])
        proc = run_tree(cmd, cwd=REPO, capture_output=True, text=True, timeout_s=BENCH_TIMEOUT_S)
        if proc.returncode != 0 or not out.is_file():
            skipped[name] = f"{script.name} failed (exit {proc.returncode}): {proc.stderr.strip()[-300:]}"
            continue
        results[name] = json.loads(out.read_text())
    return results, skipped


def evaluate(results: dict[str, Any]) -> list[dict[str, Any]]:
    """Every target with its measured value (None: missed) and whether it was reached."""
    rows = []
    for t in TARGETS:
        value = t.read(results)
        rows.append({"target": t.name, "source": t.source, "want": t.want, "measured": value,
                     "reached": None if value is None else bool(t.reached(value))})
    return rows


def summary(device: str | None, rows: list[dict[str, Any]], not_run: dict[str, str]) -> str:
    """The markdown summary: one row per target, measured or missed, and what did not run."""
    head = f"Measured on `{device}`." if device else "**No CUDA device on this machine: nothing was measured.**"
    lines = [head, "", "| target | source | wants | measured | status |", "|---|---|---|---|---|"]
    for r in rows:
        measured = "—" if r["measured"] is None else f"{r['measured']:.3g}"
        status = "missed (not measured)" if r["reached"] is None else ("reached" if r["reached"] else "**not reached**")
        lines.append(f"| {r['target']} | {r['source']} | {r['want']} | {measured} | {status} |")
    if not_run:
        lines += ["", "Not run: " + "; ".join(f"`{k}`: {v}" for k, v in sorted(not_run.items())) + "."]
    return "\n".join(lines)


def update_docs(path: Path, text: str) -> None:
    """Replace the text between the gpu-report markers of `path`."""
    doc = path.read_text()
    start, end = doc.index(START) + len(START), doc.index(END)
    path.write_text(doc[:start] + "\n" + text + "\n" + doc[end:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the benchmarks' smoke sizes")
    parser.add_argument("--no-docs", action="store_true", help="leave docs/gpu.md as it is")
    args = parser.parse_args(argv)
    slug = device_slug()
    if slug is None:
        scripts, not_run = benchmarks()
        print("no CUDA device on this machine: no GPU test or benchmark was run, nothing was written. "
              f"With a GPU this runs pytest -m gpu and {', '.join(s.name for s in scripts)} --device cuda.")
        print(summary(None, evaluate({}), not_run))
        return 0
    results, not_run = run_benchmarks(slug, args.quick)
    results["gpu_tests"] = run_gpu_tests(slug)
    rows = evaluate(results)
    report = {"device": slug, "quick": args.quick, "targets": rows, "not_run": not_run,
              "gpu_tests": results["gpu_tests"]}
    (RESULTS / f"gpu_report_{slug}.json").write_text(json.dumps(report, indent=2))
    text = summary(slug, rows, not_run)
    if not args.no_docs:
        update_docs(DOCS, text)
    print(text)
    return 0 if results["gpu_tests"]["failed"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
