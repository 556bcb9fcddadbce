"""`flowrec calibrate` writes a device profile; `--target FILE` on plan and train uses it; bad
profile files are one-line errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from flowrec.cli import app
from flowrec.cli.calibrate_cmd import gemm_shapes
from flowrec.graph.kinds import OP_KINDS
from flowrec.graph.plan_io import NOT_RECORDED, plan_from_document, plan_json
from flowrec.graph.types import ACCESS_NONE
from flowrec.planner.calibration import (COLLECTIVE, MEASURABLE, SPEC_KIND, ProfileError, default_profile_path,
                                         profile_fields)
from flowrec.planner.cost import DEVICES, device_profile, step_collectives
from flowrec.planner.contract import read_plan_document
from flowrec.planner.manager import make_plan
from flowrec.planner.op_work import op_signature
from flowrec.measure import ops as calibrate_ops
from flowrec.measure.concurrent import SHARDED_BLOCKS
from flowrec.measure.spec import TINY_REPEATS
from flowrec.spec import load_spec

REPO = Path(__file__).resolve().parents[2]
SPEC = REPO / "specs" / "dlrm_criteo.yaml"
TINY = """
name: tiny_cal
features:
  - {name: d1, type: dense, transform: log1p}
  - {name: user, type: categorical, hash_buckets: 50, dim: 4}
modules:
  - {name: bottom, kind: mlp, inputs: ["@dense"], layers: [4]}
  - {name: top, kind: mlp, inputs: [bottom, user], layers: [8]}
heads:
  - {name: ctr, input: top, task: binary, loss: bce}
optimizer:
  dense: {name: adam, lr: 0.01}
  sparse: {name: rowwise_adagrad, lr: 0.1}
training: {batch_size: 32, epochs: 1, seed: 5}
"""
runner = CliRunner()


@pytest.fixture(scope="module")
def profile(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("cal") / "cpu.json"
    result = runner.invoke(app, ["calibrate", str(SPEC), "--device", "cpu", "--seconds", "0.01", "--nproc", "2",
                                 "--out", str(path)])
    assert result.exit_code == 0, result.output
    # a calibration of minutes names each stage as it starts (it said nothing until the end)
    stages = [line.split("] ")[0] + "]" for line in result.stderr.splitlines() if line.startswith("[")]
    assert stages == ["[1/4]", "[2/4]", "[3/4]", "[4/4]"], result.stderr
    return path


def test_nproc_measures_collectives_and_sharded_plans_use_them(profile: Path):
    doc = json.loads(profile.read_text())
    measured = doc["measured"]
    assert measured["collective_world_size"]["value"] == 2 and measured["collective_gbps"]["value"] > 0
    assert "2 processes over gloo" in measured["collective_gbps"]["how"]
    assert len(doc["details"]["collective_seconds_by_call"]) >= 10
    for key in ("rank_compute_scale", "rank_staging_values_per_s", "rank_collective_us"):  # a spec on the CPU
        assert measured[key]["value"] > 0 and "2 processes at once" in measured[key]["how"]
    assert len(doc["details"]["shared_cores"]["ranks"]) == 2
    skew = measured["rank_skew_us"]  # the ranks' skew, once per step (0 when the slowest of each step is the typical one)
    assert "2 processes at once" in skew["how"] and skew["value"] == pytest.approx(
        doc["details"]["shared_cores"]["skew_ms"] * 1e3)
    # a call inside the ranks' own steps of the world-size plan, with what it comes from
    call, step = measured["rank_step_call_us"], doc["details"]["shared_cores"]["step_call"]
    sharded, live = (len(doc["details"]["shared_cores"]["ranks"][0][k]) for k in ("sharded_steps_ms", "live_steps_ms"))
    # whole blocks (of the live phase's steps, or half of them each time where two layouts alternate), each
    # layout's blocks going on until they have timed SHARDED_SECONDS, at most SHARDED_BLOCKS blocks a time
    assert "world-size plan's real step" in call["how"] and live <= sharded <= SHARDED_BLOCKS * live
    assert sharded % live == 0 or sharded % -(-live // 2) == 0
    assert step["unsharded_step_ms"] == doc["details"]["shared_cores"]["skew"]["slowest_per_step_ms"]
    assert call["value"] == pytest.approx(max(measured["collective_us"]["value"], (
        step["sharded_step_ms"] - step["unsharded_step_ms"] - step["bytes_ms"]) * 1e3 / step["calls"]))
    spec = load_spec(SPEC)
    assert step["calls"] == step_collectives(make_plan(spec, target=str(profile), world_size=2).graph, spec)[0] >= 4
    assert device_profile(str(profile)).rank_step_call_us == call["value"]
    # every budget shards dlrm_criteo's large tables row-wise (the same calls): no second layout to fit
    assert "rank_step_per_call_us" not in measured and "call_fit" not in doc["details"]["shared_cores"]
    assert "other_sharded_steps_ms" not in doc["details"]["shared_cores"]["ranks"][0]
    text = runner.invoke(app, ["plan", str(SPEC), "--target", str(profile), "--world-size", "2"]).output
    gbps = device_profile(str(profile)).collective_gbps
    assert f"world size 2 over measured collectives (2 processes) ({gbps:g} GB/s per rank" in text


def test_the_profile_records_every_constant_and_how(profile: Path):
    doc = json.loads(profile.read_text())
    assert doc["base"] == "cpu" and set(doc["measured"]) | set(doc["datasheet"]) == set(MEASURABLE)
    assert all(entry["how"] for entry in doc["measured"].values())
    assert doc["measured"]["pcie_gbps"]["value"] is None  # the CPU is its own device
    points = doc["details"]["layer_us_by_shape"]  # the spec's layers and a grid
    assert {"4096x13x512", "4096x367x512"} <= set(points)  # DLRM's first bottom and top layers
    assert set(doc["details"]["gather_rows_per_s_by_dim"]) == {"16", "32", "64", "128"}
    graph = make_plan(load_spec(SPEC), target=str(profile)).graph
    dense = {op_signature(graph.nodes[n]["op"], graph.in_degree(n), "fp32") for n in graph
             if OP_KINDS[graph.nodes[n]["op"].kind].role in ("dense", "loss")}  # the loss is measured as an op
    ops = doc["measured"]["dense_ops"]["value"]
    assert set(ops) == dense and all(p[0::3] == [16.0, 1024.0, 4096.0] for p in ops.values())
    framework = doc["details"]["framework_us_by_batch"]  # the fixed cost's robust fit and its points
    assert sorted({p["batch"] for p in framework["points"]}) == [16, 32, 64, 128]
    assert framework["fit"]["points"] == len(framework["points"]) == 4 * TINY_REPEATS == 4 * framework["rounds"]
    assert framework["fit"]["low_us"] <= framework["fit"]["step_us"] <= framework["fit"]["high_us"]
    assert doc["measured"]["step_us"]["value"] == max(0.0, framework["fit"]["step_us"])
    timing = doc["details"]["timing"]  # the load-robust rule's account (`flowrec.measure.robust`)
    assert timing["rounds"] >= 5 * timing["measurements"] > 0 and 0 <= timing["rejected_rounds"] <= timing["rounds"]
    assert 0 <= timing["extrapolated_measurements"] <= timing["measurements"] and len(timing["loadavg_1min"]) == 2
    assert all(d["method"] in ("clean", "extrapolated") for d in framework["points"])
    assert doc["measured"]["step_us"]["value"] >= 0 and doc["measured"]["staging_values_per_s"]["value"] > 0
    starts = doc["details"]["epoch_start"]  # an epoch's start on the trainer's own epoch path, or why not
    for key in ("epoch_start_us", "epoch_single_us"):
        assert "the trainer runs it" in doc["measured"][key]["how"]
        assert doc["measured"][key]["value"] >= 0 if "batches_8" in starts else doc["measured"][key]["value"] == 0
    assert ("not_measured" in starts) != (len(starts.get("batches_8", {}).get("step_ms_by_position", [])) == 8)
    lean = doc["measured"]["epoch_lean_us"]  # what the start moves the typical step of epochs of 1 .. 8 batches by
    assert "the trainer runs it" in lean["how"] and len(lean["value"]) == 8 and min(lean["value"]) >= 0
    assert lean["value"] == (starts["lean_us"] if "batches_8" in starts else [0.0] * 8)
    fields = profile_fields(doc, str(profile))
    calibrated = device_profile(str(profile))
    assert calibrated.dense_ops and calibrated.source.startswith(f"calibrated {profile}")
    _fallbacks_are_named(doc, calibrated.constants)
    # on a loaded machine a rate may not show in the timings: the datasheet's then, and said so
    assert calibrated.fp32_tflops == fields.get("fp32_tflops", DEVICES["cpu"].fp32_tflops)
    assert DEVICES["cpu"].source == "datasheet"


def _fallbacks_are_named(doc: dict, constants: str) -> None:
    """Every constant the profile kept from the datasheet is named in the plan's constants line
    (collectives, measured with --nproc only, are named by the shard pass; a constant only a spec
    of its kind measures, such as managed tables' work, is not a fallback), and a rate the timings
    did not show is among them with its reason."""
    kept = sorted(set(doc["datasheet"]) - COLLECTIVE - SPEC_KIND)
    unfitted = [line.split(":")[0] for line in doc["details"].get("unfitted", [])]
    assert set(unfitted) <= set(kept) and not set(unfitted) & set(doc["measured"])
    if kept:
        assert constants.endswith(f"; datasheet or derived: {', '.join(kept)})"), constants
    else:
        assert "datasheet or derived" not in constants, constants


def test_a_rate_the_timings_do_not_show_falls_back_to_the_datasheet_and_is_named(tmp_path, monkeypatch):
    """Forced: the layer fit cannot separate a bandwidth (as on a loaded machine); the profile
    keeps the datasheet's, lists it as unfitted, and the plan's constants line names it."""
    real_fit = calibrate_ops.layer_fit

    def no_bandwidth(*args, **kwargs):
        (fixed, tflops, _), backward, points = real_fit(*args, **kwargs)
        return (fixed, tflops, 0.0), backward, points

    monkeypatch.setattr(calibrate_ops, "layer_fit", no_bandwidth)
    path = tmp_path / "loaded.json"
    result = runner.invoke(app, ["calibrate", "--device", "cpu", "--seconds", "0.01", "--out", str(path)])
    assert result.exit_code == 0, result.output
    doc = json.loads(path.read_text())
    assert "gemm_gbps" in doc["datasheet"] and "gemm_gbps" not in doc["measured"]
    assert "gemm_gbps: not shown by the timings (datasheet kept)" in doc["details"]["unfitted"]
    calibrated = device_profile(str(path))
    assert calibrated.gemm_gbps == DEVICES["cpu"].gemm_gbps
    _fallbacks_are_named(doc, calibrated.constants)
    assert "gemm_gbps" in calibrated.constants.split("datasheet or derived: ")[1]
    text = runner.invoke(app, ["plan", str(SPEC), "--target", str(path)]).output
    assert "datasheet or derived: " in text and "gemm_gbps" in text


def test_plan_with_a_calibrated_target_names_it(profile: Path):
    result = runner.invoke(app, ["plan", str(SPEC), "--target", str(profile), "--json", "-"])
    assert result.exit_code == 0, result.output
    plan = json.loads(result.stdout)
    assert plan["target"] == str(profile) and plan["cost"]["target"] == "cpu calibrated"
    datasheet = json.loads(runner.invoke(app, ["plan", str(SPEC), "--json", "-"]).stdout)
    assert datasheet["target"] == "cpu" and datasheet["cost"]["target"] == "cpu"
    assert plan["cost"]["step_ms_overlap"] != datasheet["cost"]["step_ms_overlap"]
    assert plan["cost"]["constants"].startswith(f"calibrated {profile} (")
    assert datasheet["cost"]["constants"] == "datasheet cpu"
    assert plan["cost"]["access_profile"] == datasheet["cost"]["access_profile"] == ACCESS_NONE
    text = runner.invoke(app, ["plan", str(SPEC), "--target", str(profile)]).output
    assert f"cost constants: calibrated {profile} (" in text and "not calibrated" not in text
    assert f"access profile: {ACCESS_NONE}" in text
    uncalibrated = runner.invoke(app, ["plan", str(SPEC)]).output
    assert "cost constants: datasheet cpu (not calibrated: `flowrec calibrate`, then --target FILE)" in uncalibrated


def test_an_old_plan_without_provenance_reads_back_as_not_recorded(tmp_path: Path):
    doc = json.loads(plan_json(make_plan(load_spec(SPEC))))
    del doc["cost"]["constants"], doc["cost"]["access_profile"]
    old = tmp_path / "old.json"
    old.write_text(json.dumps(doc))
    cost = plan_from_document(read_plan_document(old)).cost
    assert cost.constants == cost.access_profile == NOT_RECORDED


def test_train_with_a_calibrated_target_runs_its_plan(profile: Path, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    result = runner.invoke(app, ["train", str(spec), "--rows", "100", "--out", "run", "--quiet",
                                 "--target", str(profile)])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "run" / "plan.json").read_text())["target"] == str(profile)
    assert json.loads((tmp_path / "run" / "run.json").read_text())["target"] == str(profile)


@pytest.mark.parametrize("content, words", [
    ("not json", "is not a device profile (not JSON)"),
    ('{"format": "other"}', "is not a flowrec device profile"),
    ('{"format": "flowrec-device-profile", "version": 1, "base": "cpu", "measured": {"hbm_gbps": {"value": -1}}}',
     "measured hbm_gbps must be a positive number"),
    ('{"format": "flowrec-device-profile", "version": 1, "base": "tpu", "measured": {}}', "base 'tpu' is not a known"),
])
def test_a_bad_profile_file_is_one_line(tmp_path: Path, content: str, words: str):
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    result = runner.invoke(app, ["plan", str(SPEC), "--target", str(bad)])
    assert result.exit_code == 2 and words in result.output and str(bad) in result.output
    assert "Traceback" not in result.output
    with pytest.raises(ProfileError):
        device_profile(str(bad))


def test_gemm_shapes_follow_the_spec_and_the_default_path_is_per_kind(monkeypatch, tmp_path: Path):
    shapes = gemm_shapes(load_spec(SPEC))
    assert shapes[:4] == [(4096, 13, 512), (4096, 512, 256), (4096, 256, 64), (4096, 64, 16)]
    assert len(shapes) == len(set(shapes))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert default_profile_path("cuda") == tmp_path / "flowrec" / "device-cuda.json"


def test_train_samples_its_data_to_predict_cache_traffic(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "500", "--out", "data"])
    assert made.exit_code == 0, made.output
    sampled = runner.invoke(app, ["train", str(spec), "--data", "data", "--out", "a", "--max-steps", "2"])
    assert sampled.exit_code == 0, sampled.output
    assert "access profile: sampled 500 of 500 rows of data (seed 5)" in sampled.output
    cost = json.loads((tmp_path / "a" / "plan.json").read_text())["cost"]
    assert cost["access_profile"] == "sampled: 500 rows of the training data (sample rate 1)"
    assert cost["constants"] == "datasheet cpu"
    prof = tmp_path / "prof.json"
    made = runner.invoke(app, ["data", "profile", str(spec), "data", "--sample-rate", "0.5", "--json", str(prof), "-q"])
    assert made.exit_code == 0, made.output
    given = runner.invoke(app, ["train", str(spec), "--data", "data", "--profile", str(prof), "--out", "c",
                                "--max-steps", "2", "--report"])
    assert given.exit_code == 0, given.output
    samples = json.loads(prof.read_text())["samples"]
    assert f"access profile given {prof} ({samples:,} sampled rows)" in given.output
    assert "predicted from constants datasheet cpu" in given.output
    synthetic = runner.invoke(app, ["train", str(spec), "--rows", "100", "--out", "b", "--max-steps", "2"])
    assert synthetic.exit_code == 0 and "access profile" not in synthetic.output


def test_a_default_data_profile_is_the_sample_a_run_plans_from(tmp_path: Path, monkeypatch):
    """`flowrec data profile` samples by default what `flowrec train --data` samples before planning:
    FAE's rate (here 20,000 of 25,000 rows) with the spec's seed, so `--profile FILE` plans as the
    run would; another seed draws other rows."""
    from flowrec.runs.plan import sampled_access_profile

    monkeypatch.chdir(tmp_path)
    spec = tmp_path / "tiny.yaml"
    spec.write_text(TINY)
    made = runner.invoke(app, ["data", "synth", str(spec), "--rows", "25000", "--out", "data", "-q"])
    assert made.exit_code == 0, made.output
    run = json.loads(json.dumps(sampled_access_profile(load_spec(spec), "data", lambda _: None)))
    assert run["sample_rate"] == pytest.approx(0.8) and run["dataset_rows"] == 25_000
    for name, extra in (("default.json", []), ("seed0.json", ["--seed", "0"])):
        made = runner.invoke(app, ["data", "profile", str(spec), "data", "--json", name, "-q", *extra])
        assert made.exit_code == 0, made.output
    default, seed0 = (json.loads((tmp_path / n).read_text()) for n in ("default.json", "seed0.json"))
    assert (default["sample_rate"], default["samples"], default["tables"]) == \
        (run["sample_rate"], run["samples"], run["tables"])
    assert seed0["sample_rate"] == run["sample_rate"] and seed0["tables"] != run["tables"]


def test_a_device_budget_that_is_not_a_size_is_one_line_before_any_measurement(tmp_path: Path):
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["calibrate", str(SPEC), "--nproc", "2", "--device-budget", "12XB", "--out", str(out)])
    assert result.exit_code == 2 and "--device-budget: not a byte size: '12XB'" in result.output
    assert "Traceback" not in result.output and not out.exists()


@pytest.mark.parametrize("args", [["--device-budget", "1GiB"], [str(SPEC), "--device-budget", "1GiB"],
                                  ["--nproc", "2", "--device-budget", "1GiB"]])
def test_a_device_budget_without_a_spec_and_processes_to_step_is_refused_not_ignored(tmp_path: Path, args):
    """calibrate --device-budget 1GiB without a spec or --nproc measured for a minute and wrote a
    profile the budget had no part in, without a word: it shapes only the sharded plan that the
    --nproc N processes step for a spec on the CPU."""
    out = tmp_path / "p.json"
    result = runner.invoke(app, ["calibrate", *args, "--device", "cpu", "--seconds", "0.01", "--out", str(out)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1 and "leave --device-budget out" in lines[0], result.output
    assert not out.exists()
