"""tools/bench_calibration_noise.py: the two settings are measured in turn, in alternating order,
the same number of times; the spread is of the repeats as measured; bad arguments fail with a
message; a real run (one repeat) measures both settings with their own rounds and blocks."""
from __future__ import annotations

import importlib.util
import json
import os
import random
import statistics
import sys
from pathlib import Path

import pytest

from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_calibration_noise", REPO / "tools" / "bench_calibration_noise.py")
noise = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(noise)


def test_the_settings_alternate_in_order_and_each_is_measured_every_repeat():
    rng = random.Random(7)
    repeats = rng.randint(3, 9)
    seen: list[str] = []
    values = {s: [] for s in noise.SETTINGS}

    def measure(setting: str) -> dict[str, float]:
        seen.append(setting)
        v = rng.uniform(1.0, 100.0) * (1.0 if setting == "baseline" else 0.5)
        values[setting].append(v)
        return {"step_us": v, "other": -v}

    progress = []
    out = noise.interleaved(repeats, measure, lambda k, last: progress.append((k, last)))
    a, b = noise.SETTINGS
    assert seen == [x for k in range(repeats) for x in ((a, b) if k % 2 == 0 else (b, a))]
    assert [k for k, _ in progress] == list(range(repeats))
    assert all(last[s]["step_us"] == values[s][k] for k, last in progress for s in noise.SETTINGS)
    summary = noise.summarize(out)
    for setting in noise.SETTINGS:
        got = summary[setting]["step_us"]
        assert got["median"] == pytest.approx(statistics.median(values[setting]))
        assert got["sd"] == pytest.approx(statistics.pstdev(values[setting]))
        assert (got["min"], got["max"]) == (min(values[setting]), max(values[setting]))
        assert summary[setting]["other"]["max"] == -min(values[setting])


def test_spread_of_one_value_has_no_deviation_and_of_none_is_an_error():
    x = random.uniform(-5.0, 5.0)
    assert noise.spread([x]) == {"median": x, "sd": 0.0, "min": x, "max": x}
    with pytest.raises(ValueError):
        noise.spread([])


@pytest.mark.parametrize("args, words", [(["--repeats", "0"], "at least 1"),
                                         (["--baseline-blocks", "0"], "at least 1"),
                                         (["--seconds", "0"], "positive"),
                                         (["--spec", "no/such.yaml"], "no such file"),
                                         (["broken"], "bad.yaml"),
                                         (["--device-budget", "lots"], "--device-budget"),
                                         (["--spec", str(REPO / "specs" / "movielens.yaml"), "--json",
                                           str(REPO / "specs" / "movielens.yaml")], "the spec itself")])
def test_bad_arguments_fail_with_a_message(args, words, capsys, tmp_path: Path):
    out = tmp_path / "r.json"
    if args == ["broken"]:  # a spec that is not one: named before any calibration
        bad = tmp_path / "bad.yaml"
        bad.write_text("name: x\nfeatures: [\n", encoding="utf-8")
        args = ["--spec", str(bad)]
    with pytest.raises(SystemExit) as exc:
        noise.main([*args, *([] if "--json" in args else ["--json", str(out)])])
    assert exc.value.code == 2 and words in capsys.readouterr().err
    assert not out.exists()
    assert (REPO / "specs" / "movielens.yaml").read_text(encoding="utf-8").lstrip().startswith(("#", "name", "{"))


def test_a_real_run_measures_both_settings_with_their_own_rounds_and_blocks(tmp_path: Path):
    """custom_module (a step of a few ms), one repeat of each setting: the baseline's tiny steps
    are exactly its rounds and its staging exactly its blocks (the step is short enough for all of
    them); the calibration's are its own, and every predicted step is a real, positive price."""
    out = tmp_path / "noise.json"
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": str(REPO)}
    proc = run_bounded([sys.executable, str(REPO / "tools" / "bench_calibration_noise.py"),
                        "--spec", str(REPO / "specs" / "custom_module.yaml"), "--repeats", "1",
                        "--baseline-rounds", "1", "--baseline-blocks", "2", "--seconds", "0.05", "--json", str(out)],
                       capture_output=True, text=True, timeout_s=600, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["benchmark"] == "calibration_noise" and doc["spec"] == "custom_module.yaml"
    base, own = doc["repeats_raw"]["baseline"], doc["repeats_raw"]["calibration"]
    assert len(base) == len(own) == 1
    assert base[0]["tiny_rounds"] == 1 and base[0]["staging_blocks"] == 2
    settings = doc["settings"]["calibration"]
    assert own[0]["tiny_rounds"] == settings["tiny_rounds"] > 1
    assert own[0]["staging_blocks"] == settings["staging_blocks"]  # a few ms step: every block fits
    for row in base + own:
        assert row["predicted_step_ms"] > 0.1 and row["predicted_step_ms"] >= row["step_us"] / 1e3  # the fixed cost priced in
        assert row["framework_seconds"] > 0 and row["staging_seconds"] > 0
    assert doc["calibrated"]["predicted_step_ms"] > 0.1
    assert "predicted_step_ms" in proc.stdout and str(out) in proc.stdout
