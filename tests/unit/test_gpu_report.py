"""tools/gpu_report.py: says clearly when there is no GPU; judges every target from results."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_report", REPO / "tools" / "gpu_report.py")
gpu_report = importlib.util.module_from_spec(_spec)
sys.modules["gpu_report"] = gpu_report  # its dataclasses look their module up
_spec.loader.exec_module(gpu_report)


def test_without_a_gpu_it_says_so_and_writes_nothing(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(gpu_report, "device_slug", lambda: None)
    monkeypatch.setattr(gpu_report, "RESULTS", tmp_path)
    assert gpu_report.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("no CUDA device on this machine") and "bench_ops.py" in out.split(" --device cuda.")[0]
    for name in ("bench_costmodel.py", "bench_checkpoint.py", "bench_step_gap.py"):  # they only pass
        assert name not in out.split(" --device cuda.")[0]  # `--device cpu` to flowrec: no option of theirs
    assert out.count("missed (not measured)") == len(gpu_report.TARGETS)
    assert list(tmp_path.iterdir()) == []


def test_targets_are_judged_from_the_results():
    results = {"gpu_tests": {"failed": 0},
               "ops": {"ratios": {"packed_vs_dense_grad_f26": 40.0, "packed_vs_sparse_f1000": 2.0,
                                  "packed_vs_floor_f26": 1.5}}}
    rows = {r["target"]: r for r in gpu_report.evaluate(results)}
    assert rows["gpu tests pass"]["reached"] is True
    assert rows["packed vs per-field dense grads, 26 fields"]["reached"] is True
    assert rows["packed vs per-field sparse grads, 1,000 fields"]["reached"] is False
    assert rows["packed vs gather floor, 26 fields"]["measured"] == 1.5
    assert rows["packed vs gather floor, 1,000 fields"]["reached"] is None
    text = gpu_report.summary("nvidia-h100", list(rows.values()), {"staging": "no --device"})
    assert "| 40 | reached |" in text and "**not reached**" in text and "`staging`: no --device" in text


def test_the_summary_replaces_only_the_marked_section(tmp_path):
    doc = tmp_path / "gpu.md"
    doc.write_text(f"# GPU\nintro\n{gpu_report.START}\nold\n{gpu_report.END}\nafter\n")
    gpu_report.update_docs(doc, "new table")
    assert doc.read_text() == f"# GPU\nintro\n{gpu_report.START}\nnew table\n{gpu_report.END}\nafter\n"
