"""tools/bench_costmodel.py --merge: parts of one run (each under its own short exclusive hold of
a shared machine) make one result: rows by spec, a rerun's row replacing the first, the ratios
recomputed over the merged rows; parts of different runs are refused in one line (exit 2)."""
from __future__ import annotations

import importlib.util
import json
import math
import random
import sys
import time
from pathlib import Path

import pytest

from flowrec.measure.robust import SchedClock as robust_clock
from flowrec.spec import load_spec
from flowrec.testing.processes import run_bounded

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("bench_costmodel", REPO / "tools" / "bench_costmodel.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

OPTIONS = {"device_budget": "64MiB", "threads": 1, "nproc": 1, "cache": None, "one_epoch": False, "interleave": False}


def _row(spec: str, error: float, bytes_error: float | None = None) -> dict:
    row = {"spec": spec, "step_error": error, "step_error_fastest_quartile": error * 1.5,
           "step_error_wall_median": error * 2}
    if bytes_error is not None:
        row["bytes_error"] = bytes_error
    return row


def _part(path: Path, rows: list[dict], **options) -> Path:
    calibration = {r["spec"]: {"step_us": random.uniform(100, 900)} for r in rows if "error" not in r}
    path.write_text(json.dumps(bench.summarize(rows, calibration, {**OPTIONS, **options})))
    return path


def test_parts_merge_into_one_result_with_the_ratios_of_all_rows(tmp_path):
    first = _part(tmp_path / "a.json", [_row("b.yaml", -0.30), _row("a.yaml", 0.04, 0.02)])
    second = _part(tmp_path / "b.json", [_row("c.yaml", 0.07, -0.15), {"spec": "d.yaml", "error": "failed"}])
    rerun = _part(tmp_path / "c.json", [_row("b.yaml", -0.08)])
    out = tmp_path / "all.json"
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--merge", f"{first},{second},{rerun}",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert [r["spec"] for r in doc["specs"]] == ["a.yaml", "b.yaml", "c.yaml", "d.yaml"]
    assert doc["specs"][1]["step_error"] == -0.08  # the rerun's row
    assert sorted(doc["calibration"]) == ["a.yaml", "b.yaml", "c.yaml"]
    assert doc["calibration"]["b.yaml"] == json.loads(rerun.read_text())["calibration"]["b.yaml"]
    ratios = doc["ratios"]
    assert ratios["costmodel_max_step_error"] == pytest.approx(0.08)
    assert ratios["costmodel_median_step_error"] == pytest.approx(0.07)
    assert ratios["costmodel_max_step_error_wall_median"] == pytest.approx(0.16)
    assert ratios["costmodel_max_bytes_error"] == pytest.approx(0.15)
    assert doc["bytes_compared_specs"] == ["a.yaml", "c.yaml"]
    assert {k: doc[k] for k in OPTIONS} == OPTIONS and len(doc["parts"]) == 3


@pytest.mark.parametrize("other", [{"device_budget": None}, {"nproc": 2}, {"threads": 2}, {"interleave": True}])
def test_parts_of_different_runs_are_refused_in_one_line(tmp_path, other):
    first = _part(tmp_path / "a.json", [_row("a.yaml", 0.01)])
    second = _part(tmp_path / "b.json", [_row("b.yaml", 0.02)], **other)
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--merge", f"{first},{second}",
                        "--json", str(tmp_path / "all.json")], cwd=REPO, capture_output=True, text=True,
                       timeout_s=120)
    assert done.returncode == 2 and str(second) in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "all.json").exists()


def test_one_epoch_data_holds_every_step_of_every_run_and_runs_never_wrap():
    specs = sorted((REPO / "specs").glob("*.yaml"))
    for spec in specs:
        batch = load_spec(spec).training.batch_size
        rows = bench.synth_rows(spec, 20, True)
        assert bench.synth_rows(spec, 20, False) == bench.SYNTH_ROWS
        assert rows >= batch * (bench.WARMUP_STEPS + 20 + 1)  # --steps always fits
        model = load_spec(spec)
        cap = min(bench.ONE_EPOCH_ROWS, bench.ONE_EPOCH_VALUES // (len(model.features) + len(model.heads)))
        if batch * (bench.WARMUP_STEPS + bench.MAX_STEPS + 1) <= cap:
            assert rows >= batch * (bench.WARMUP_STEPS + bench.MAX_STEPS + 1)  # a further run's most fits
        else:  # a wide or large-batch spec: its rows stay within the caps unless --steps needs more
            assert rows <= max(cap, bench.SYNTH_ROWS, batch * (bench.WARMUP_STEPS + 20 + 1))
        for step_ms in (0.5, 3.7, 40.0, 900.0):  # whatever a run's steps, one epoch holds them and the warm-up
            count = bench.run_steps(step_ms, 20, batch, rows, epochs=1)
            assert bench.WARMUP_STEPS + count + 1 <= rows // batch
    # cycled data (the default) lets a short step run past its 8,192 rows; one epoch cuts it there
    assert bench.run_steps(1.0, 20, 1024, 8192) == bench.MAX_STEPS
    assert bench.run_steps(1.0, 20, 1024, 50_000, epochs=1) == 50_000 // 1024 - bench.WARMUP_STEPS - 1


def test_a_short_steps_further_runs_take_hundreds_of_steps_within_the_data():
    assert bench.run_steps(1.3, 20, 1024, 8192) == bench.MAX_STEPS  # 1 s of 1.3 ms steps, capped
    assert bench.run_steps(4.0, 20, 1024, 8192) == 250
    assert bench.run_steps(70.0, 20, 4096, 8192) == 20  # never fewer than --steps
    assert bench.run_steps(1.0, 20, 4096, 8192) == 2 * bench.EPOCHS - bench.WARMUP_STEPS - 1  # the data's batches
    rows = [{"spec": "a.yaml", "step_error": 0.05, "step_error_fastest_quartile": 0.0, "step_error_wall_median": 0.0,
             "measured_run_spread": 0.12},
            {"spec": "b.yaml", "step_error": -0.02, "step_error_fastest_quartile": 0.0, "step_error_wall_median": 0.0,
             "measured_run_spread": 0.31}]
    assert bench.summarize(rows, {}, OPTIONS)["ratios"]["costmodel_max_run_spread"] == 0.31


def test_interleaved_pairs_judge_each_run_by_the_calibration_next_to_it():
    """calibrate, run, calibrate, run: a host that slows down between pairs moves the run and its own
    calibration together, so each pair's error is the model's, not the drift's (the pooled
    comparison of one prediction against every run counts the drift)."""
    rng = random.Random()
    speed = [rng.uniform(0.6, 1.6) for _ in range(3)]  # the host's speed in each pair
    model = rng.uniform(-0.08, 0.08)  # the model's own error, the same in every pair
    pairs = [(4.0 * s * (1 + model), [bench.robust.Round(4.0 * s * rng.uniform(0.98, 1.02)) for _ in range(9)]
              + [bench.robust.Round(40.0, 39.0)])  # a round another process delayed: left out
             for s in speed]
    doc = bench.pair_errors(pairs)
    measured = [bench.robust.estimate(r).seconds for _, r in pairs]
    assert doc["pair_measured_step_ms"] == measured
    errors = [p / m - 1 for (p, _), m in zip(pairs, measured)]
    assert doc["pair_step_errors"] == pytest.approx(errors) and doc["step_error"] == pytest.approx(sorted(errors)[1])
    assert doc["pair_error_spread"] == pytest.approx(max(errors) - min(errors))
    assert abs(doc["step_error"] - model) < 0.03  # within the runs' own 2% noise
    with pytest.raises(ValueError, match="no .calibration, run. pairs"):
        bench.pair_errors([])
    rows = [{"spec": "a.yaml", "step_error": 0.05, "step_error_fastest_quartile": 0.0, "step_error_wall_median": 0.0,
             "pair_error_spread": 0.21}, {"spec": "b.yaml", "step_error": 0.01, "step_error_fastest_quartile": 0.0,
                                          "step_error_wall_median": 0.0, "pair_error_spread": 0.04}]
    assert bench.summarize(rows, {}, OPTIONS)["ratios"]["costmodel_max_pair_error_spread"] == 0.21


def test_a_pairs_run_is_sized_by_its_own_calibrations_live_step(tmp_path):
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"details": {"staging": {"live_step_ms": 2.5}}}))
    assert bench.calibrated_live_ms(profile) == 2.5
    assert bench.run_steps(bench.calibrated_live_ms(profile), 20, 1024, 8192) == 400
    profile.write_text(json.dumps({"details": {}}))  # no live step measured: a first run of --steps
    assert bench.run_steps(bench.calibrated_live_ms(profile), 20, 1024, 8192) == 20


def test_a_spec_run_under_another_budget_keeps_a_row_per_budget(tmp_path):
    """`--other-budget`: the same spec's rows at two budgets (one calibration) merge as two rows; a
    rerun of one budget's row replaces that row only; the ratios are over both."""
    def row(budget: str, error: float) -> dict:
        return {**_row("m.yaml", error), "run_device_budget": budget}

    first = _part(tmp_path / "a.json", [row("64MiB", 0.21), row("none", -0.12)], other_budget="none")
    rerun = _part(tmp_path / "b.json", [row("none", -0.04)], other_budget="none")
    out = tmp_path / "all.json"
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--merge", f"{first},{rerun}",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert [(r["run_device_budget"], r["step_error"]) for r in doc["specs"]] == [("64MiB", 0.21), ("none", -0.04)]
    assert doc["ratios"]["costmodel_max_step_error"] == pytest.approx(0.21) and doc["other_budget"] == "none"
    plain = _part(tmp_path / "c.json", [_row("m.yaml", 0.01)])  # a run without --other-budget: another run
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--merge", f"{first},{plain}",
                        "--json", str(tmp_path / "x.json")], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 2 and str(plain) in done.stderr


def test_another_budget_that_is_not_a_size_is_one_line(tmp_path):
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--other-budget", "lots", "--specs", "movielens.yaml",
                        "--json", str(tmp_path / "r.json")], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 2 and "--other-budget: 'lots' is not a size" in done.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "r.json").exists()


def test_a_rows_layout_is_its_plans_calls_and_groups(repo):
    """What a row records of the run's plan (plan.json): the calls the cost model prices and each
    group's sharding and placement."""
    from flowrec.graph.plan_io import plan_document
    from flowrec.planner.manager import make_plan

    spec = load_spec(repo / "specs" / "movielens.yaml")
    for budget, calls, sharding in (("64MiB", 6, "row_wise"), (None, 3, "replicated")):
        doc = json.loads(json.dumps(plan_document(make_plan(spec, target="cpu", world_size=2, device_budget=budget))))
        layout = bench.plan_layout(doc, repo / "specs" / "movielens.yaml")
        assert layout["calls"] == calls and [g[1] for g in layout["groups"]] == [sharding]
    one = json.loads(json.dumps(plan_document(make_plan(spec, target="cpu"))))
    assert bench.plan_layout(one, repo / "specs" / "movielens.yaml")["calls"] == 0


def test_a_fitted_rows_plan_is_also_priced_at_the_lumped_call(tmp_path):
    """Beside the fit's prediction a row keeps the same plan's with every call at the lumped price
    (`rank_step_call_us`) of the same calibration; a profile without the fit has nothing beside."""
    rng = random.Random()
    lumped, fixed, per_call = rng.uniform(800, 2000), rng.uniform(1000, 8000), rng.uniform(200, 700)
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"measured": {"rank_step_call_us": {"value": lumped},
                                                "rank_step_fixed_us": {"value": fixed},
                                                "rank_step_per_call_us": {"value": per_call}}}))
    for calls in (3, 7, 10):
        assert bench.lumped_call_ms(profile, 30.0, calls) == pytest.approx(
            30.0 + (calls * lumped - fixed - calls * per_call) * 1e-3)
    profile.write_text(json.dumps({"measured": {"rank_step_call_us": {"value": lumped}}}))
    assert bench.lumped_call_ms(profile, 30.0, 6) is None


def test_a_rerun_replaces_a_row_from_before_rows_recorded_their_budget(tmp_path):
    """A part from before `run_device_budget` (its rows ran at the file's --device-budget) and a
    rerun of the same spec merged as two rows of one spec, both in the ratios."""
    old = _part(tmp_path / "old.json", [_row("w.yaml", 0.25), _row("v.yaml", 0.02)])
    rerun = _part(tmp_path / "new.json", [{**_row("w.yaml", 0.01), "run_device_budget": "64MiB"}])
    out = tmp_path / "all.json"
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--merge", f"{old},{rerun}",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    assert [(r["spec"], r["step_error"]) for r in doc["specs"]] == [("v.yaml", 0.02), ("w.yaml", 0.01)]
    assert doc["ratios"]["costmodel_max_step_error"] == pytest.approx(0.02)


def test_each_run_keeps_the_hosts_speed_beside_its_calibrations():
    """The host's own drift between a profile and the run judged against it is recorded per run
    (a fixed GEMM and add just around each), pair by pair with --interleave, never in an error."""
    probe = bench.host_probe()
    assert set(probe) == {"gemm_ms", "add_ms"} and 0 < probe["gemm_ms"] < 60e3 and 0 < probe["add_ms"] < 60e3
    slow = random.uniform(1.1, 1.5)
    cal = [{"gemm_ms": 10.0, "add_ms": 4.0}, {"gemm_ms": 20.0, "add_ms": 4.0}, {"gemm_ms": 10.0, "add_ms": 8.0}]
    summary = {"host_probe": cal[0], "pairs": [{"seconds": 1.0, "host_probe": c} for c in cal]}
    row = {"measured_runs": [{"host_probe": {"gemm_ms": 10.0 * slow, "add_ms": 4.0}} for _ in cal]}
    paired = bench.host_drift(row, bench.calibration_probes(summary, True))
    assert paired["gemm"] == pytest.approx([slow, slow / 2, slow]) and paired["add"] == pytest.approx([1.0, 1.0, 0.5])
    one = bench.host_drift(row, bench.calibration_probes(summary, False))  # every run against the one calibration
    assert one["gemm"] == pytest.approx([slow] * 3) and one["add"] == pytest.approx([1.0] * 3)
    assert bench.host_drift(row, bench.calibration_probes({}, True)) == {}  # --profile: nothing probed
    rows = [{**_row("a.yaml", 0.05), "host_drift": paired}, _row("b.yaml", -0.02)]
    ratios = bench.summarize(rows, {}, {})["ratios"]
    assert ratios["host_gemm_drift_range"] == pytest.approx([slow / 2, slow])
    assert ratios["costmodel_max_step_error"] == pytest.approx(0.05)  # the drift is not taken off an error


def _calibrations(tmp_path: Path, live: list[float]):
    """(calibrate(k), the ks asked for): the k-th calibration, a profile whose live step is live[k]."""
    calibrated: list[int] = []

    def calibrate(k):
        calibrated.append(k)
        path = tmp_path / f"cal{k}.json"
        path.write_text(json.dumps({"details": {"staging": {"live_step_ms": live[k]}}}))
        return path

    return calibrate, calibrated


def _long_pairs(spec: Path, tmp_path: Path, monkeypatch, predicted: list[float], measured: list[float],
                host_run: int | None = None):
    """(calibrate, the ks asked for) with `flowrec` stubbed: run k (the run after calibration k) trains
    `spec`'s plan priced predicted[k] ms, its every step measured[k] ms; run `host_run`'s plan places
    its groups on the host (another program)."""
    from flowrec.graph.plan_io import plan_document
    from flowrec.planner.manager import make_plan

    doc = plan_document(make_plan(load_spec(spec), target="cpu"))
    calibrate, calibrated = _calibrations(tmp_path, measured)

    def train(spec_, data, profile, steps, out, tmp, budget, cache, nproc=1):
        k = len(calibrated) - 1
        out.mkdir(parents=True, exist_ok=True)
        groups = [{**g, "placement": "host" if k == host_run else g["placement"]} for g in doc["groups"]]
        (out / "plan.json").write_text(json.dumps({**doc, "groups": groups,
                                                   "cost": {**doc["cost"], "step_ms_overlap": predicted[k]}}))
        rounds = [bench.robust.Round(measured[k] / 1e3) for _ in range(steps)]
        return {"stage_seconds": {}, "steps": steps, "samples": steps * 1024, "seconds": 1.0, "counters": {}}, rounds

    monkeypatch.setattr(bench, "flowrec", lambda *a, **k: "")
    monkeypatch.setattr(bench, "train_json", train)
    monkeypatch.setattr(bench, "host_probe", lambda: {"gemm_ms": 1.0, "add_ms": 1.0})
    return calibrate, calibrated


@pytest.mark.parametrize("runs", [3, 5])
def test_interleaved_runs_give_a_short_step_as_many_pairs_as_asked(repo, tmp_path, monkeypatch, runs):
    """`--runs N --interleave`: a short step gets N (calibration, run) pairs, each run sized by its
    own calibration's live step, and the spec's error is the median of the N pairs' errors (the
    pool of timed seconds grows with N: at the default three runs' 3 s a fourth run never came)."""
    from flowrec.graph.plan_io import plan_document
    from flowrec.planner.manager import make_plan

    spec = repo / "specs" / "movielens.yaml"
    doc = plan_document(make_plan(load_spec(spec), target="cpu"))
    predicted = [random.uniform(2.5, 4.0) for _ in range(runs)]
    measured = [random.uniform(2.5, 4.0) for _ in range(runs)]  # a few ms: a run of RUN_SECONDS is hundreds of steps
    live = [m * random.uniform(0.9, 1.1) for m in measured]  # each calibration's own live step
    asked = []
    # each step a little slower than the last (distinct rounds, a known median); little enough that
    # a run stays about RUN_SECONDS long: at 1e-3 a step, a run of 400 steps took up to 1.3 s, so
    # four runs could fill --runs 5's pool of 5 s and the fifth never came (a flaky failure)
    GROW = 1e-5
    calibrate, calibrated = _calibrations(tmp_path, live)

    def train(spec_, data, profile, steps, out, tmp, budget, cache, nproc=1):
        k = len(asked)
        asked.append(steps)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({**doc, "cost": {**doc["cost"], "step_ms_overlap": predicted[k]}}))
        rounds = [bench.robust.Round(measured[k] * (1 + i * GROW) / 1e3) for i in range(steps)]  # seconds
        return {"stage_seconds": {}, "steps": steps, "samples": steps * 1024, "seconds": 1.0, "counters": {}}, rounds

    monkeypatch.setattr(bench, "flowrec", lambda *a, **k: "")
    monkeypatch.setattr(bench, "train_json", train)
    monkeypatch.setattr(bench, "host_probe", lambda: {"gemm_ms": 1.0, "add_ms": 1.0})
    row = bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", max_runs=runs, recalibrate=calibrate)
    assert calibrated == list(range(runs)) and len(asked) == runs
    size = [bench.run_steps(ms, 20, 1024, row["synth_rows"], epochs=1) + bench.WARMUP_STEPS for ms in live]
    assert asked == size  # each run sized by its own calibration
    steps = [n - bench.WARMUP_STEPS for n in size]
    medians = [m * (1 + (bench.WARMUP_STEPS + (n - 1) / 2) * GROW) for m, n in zip(measured, steps)]  # after warm-up
    errors = [p / m - 1 for p, m in zip(predicted, medians)]
    assert row["pair_step_errors"] == pytest.approx(errors, rel=1e-9)
    assert row["step_error"] == pytest.approx(sorted(errors)[runs // 2], rel=1e-9)  # the median pair
    assert bench.pool_seconds(runs) == pytest.approx(bench.POOL_SECONDS * runs / bench.MAX_RUNS)


@pytest.mark.parametrize("one_epoch", [True, False])
def test_bytes_are_measured_over_a_whole_epoch_of_the_data(repo, tmp_path, monkeypatch, one_epoch):
    """The plan prices an epoch's traffic: with data seen once the bytes come from one more run of
    every batch of it (the first run's kept beside); cycled data keeps the first run's."""
    from flowrec.graph.plan_io import plan_document
    from flowrec.planner.manager import make_plan

    spec = repo / "specs" / "movielens.yaml"
    doc = plan_document(make_plan(load_spec(spec), target="cpu"))
    asked = []
    per_sample = {}  # bytes a sample each run's counters give: the epoch's lower than the start's

    def train(spec_, data, profile, steps, out, tmp, budget, cache, nproc=1):
        asked.append(steps)
        per_sample[steps] = random.uniform(100.0, 200.0)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps({**doc, "cost": {**doc["cost"], "h2d_bytes_per_step": 123456.0}}))
        samples = steps * 1024
        counters = {"g0_d16": {"h2d_bytes": per_sample[steps] * samples * 0.75, "d2h_bytes": per_sample[steps] * samples * 0.25,
                               "samples": samples}}
        rounds = [bench.robust.Round(0.004) for _ in range(steps)]
        return {"stage_seconds": {}, "steps": steps, "samples": samples, "seconds": 1.0, "counters": counters}, rounds

    monkeypatch.setattr(bench, "flowrec", lambda *a, **k: "")
    monkeypatch.setattr(bench, "train_json", train)
    monkeypatch.setattr(bench, "host_probe", lambda: {"gemm_ms": 1.0, "add_ms": 1.0})
    calibration = tmp_path / "cal.json"
    calibration.write_text(json.dumps({"details": {"staging": {"live_step_ms": 4.0}}}))
    row = bench.measure_spec(spec, calibration, 20, tmp_path, "64MiB", max_runs=1, one_epoch=one_epoch)
    batch = row["batch"]
    model = load_spec(spec)
    fixed = batch * (len(model.dense_features) + len(model.heads)) * 4  # dense features and labels, float32
    first = per_sample[asked[0]] * batch + fixed
    if one_epoch:
        epoch = -(-row["synth_rows"] // batch)
        assert asked == [asked[0], epoch] and epoch > asked[0]  # every batch of the data, once
        assert row["bytes_epoch_steps"] == epoch
        assert row["measured_h2d_bytes"] == pytest.approx(per_sample[epoch] * batch + fixed)
        assert row["measured_h2d_bytes_first_run"] == pytest.approx(first)
        assert row["bytes_error_first_run"] == pytest.approx(123456.0 / first - 1)
    else:
        assert len(asked) == 1 and "measured_h2d_bytes_first_run" not in row
        assert row["measured_h2d_bytes"] == pytest.approx(first)
    assert row["bytes_error"] == pytest.approx(123456.0 / row["measured_h2d_bytes"] - 1)


def test_the_epochs_bytes_run_trains_the_plan_its_prediction_came_from(repo, tmp_path, monkeypatch):
    """With --interleave each pair has a calibration of its own, and placements can differ between
    them: the bytes run uses the first pair's, whose plan the predicted bytes are read from."""
    from flowrec.graph.plan_io import plan_document
    from flowrec.planner.manager import make_plan

    spec = repo / "specs" / "movielens.yaml"
    doc = plan_document(make_plan(load_spec(spec), target="cpu"))
    profiles = []

    def calibrate(k):
        path = tmp_path / f"cal{k}.json"
        path.write_text(json.dumps({"details": {"staging": {"live_step_ms": 4.0}}}))
        return path

    def train(spec_, data, profile, steps, out, tmp, budget, cache, nproc=1):
        profiles.append(profile)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(doc))
        counters = {"g0_d16": {"h2d_bytes": 1000 * steps, "d2h_bytes": 0, "samples": steps * 1024}}
        return ({"stage_seconds": {}, "steps": steps, "samples": steps * 1024, "seconds": 1.0, "counters": counters},
                [bench.robust.Round(0.004) for _ in range(steps)])

    monkeypatch.setattr(bench, "flowrec", lambda *a, **k: "")
    monkeypatch.setattr(bench, "train_json", train)
    monkeypatch.setattr(bench, "host_probe", lambda: {"gemm_ms": 1.0, "add_ms": 1.0})
    bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", max_runs=3, recalibrate=calibrate)
    assert profiles[:3] == [tmp_path / f"cal{k}.json" for k in range(3)]  # a pair each
    assert profiles[3:] == [tmp_path / "cal0.json"]  # then the epoch's bytes, on the first pair's plan


@pytest.mark.parametrize("min_runs", [1, 3])
def test_a_long_step_gets_the_pairs_asked_for(repo, tmp_path, monkeypatch, min_runs):
    """`--min-pairs K`: a step whose first run fills the pool of `--runs` still gets K (calibration,
    run) pairs, and the spec's error is their median; without it one pair carries all the host's
    drift between that calibration and that run (round 29: bst_taobao)."""
    spec = repo / "specs" / "movielens.yaml"
    runs = 5
    predicted = [random.uniform(250.0, 350.0) for _ in range(runs)]
    measured = [random.uniform(250.0, 350.0) for _ in range(runs)]  # ms: 20 steps fill --runs 5's pool of 5 s
    calibrate, calibrated = _long_pairs(spec, tmp_path, monkeypatch, predicted, measured)
    row = bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", max_runs=runs, recalibrate=calibrate,
                             min_runs=min_runs)
    assert calibrated == list(range(min_runs))
    errors = [p / m - 1 for p, m in zip(predicted[:min_runs], measured[:min_runs])]
    assert row["pair_step_errors"] == pytest.approx(errors, rel=1e-9)
    assert row["step_error"] == pytest.approx(sorted(errors)[min_runs // 2], rel=1e-9)
    assert row["min_runs"] == min_runs and len(row["measured_runs"]) == min_runs


@pytest.mark.parametrize("argv, message", [
    (["--min-pairs", "3"], "needs --interleave"),
    (["--interleave", "--min-pairs", "0"], "at least 1"),
    (["--specs", "dlrm_criteo.yaml,nope.yaml"], "nope.yaml not in specs/"),
    (["--specs", ","], "none given"),
    (["--bracket", "--min-pairs", "1"], "needs --interleave"),
])
def test_bad_pair_and_spec_arguments_fail_before_any_calibration(tmp_path, argv, message):
    out = tmp_path / "r.json"
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", *argv, "--json", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 2 and message in done.stderr, done.stderr
    assert not out.exists()


def test_bracketed_pairs_cancel_a_drift_the_run_after_alone_takes_in_whole():
    """`--bracket`: run, calibrate, run. The host slows steadily across the pairs; each calibration
    prices the speed at its own moment (plus the model's own error), halfway between the runs on
    either side of it. Judged against the run after it alone, every pair carries the drift; judged
    against the two runs' mean, the model's error is left."""
    rng = random.Random()
    model = rng.uniform(-0.05, 0.05)
    start, slope = rng.uniform(3.0, 6.0), rng.uniform(0.08, 0.2)  # ms, and ms more at each half pair
    pairs = []
    for k in range(rng.randint(4, 8)):
        run_ms = start + slope * (2 * k)  # the run after calibration k, at time 2k
        calibrated_ms = start + slope * (2 * k - 1)  # calibration k, at time 2k - 1
        pairs.append((calibrated_ms * (1 + model), [bench.robust.Round(run_ms * rng.uniform(0.999, 1.001))
                                                    for _ in range(9)]))
    plain = bench.pair_errors(pairs[1:])
    bracketed = bench.pair_errors(pairs, [True] * (len(pairs) - 1))
    assert len(bracketed["pair_step_errors"]) == len(pairs) - 1  # the lead-in measures only
    assert bracketed["lead_predicted_step_ms"] == pairs[0][0]
    assert bracketed["pair_predicted_step_ms"] == [p for p, _ in pairs[1:]]
    assert abs(bracketed["step_error"] - model) < 0.005
    assert all(e < model - 0.01 for e in plain["pair_step_errors"])  # the drift, whole, in every pair
    runs = bracketed["pair_run_step_ms"]
    assert bracketed["pair_measured_step_ms"] == pytest.approx([(a + b) / 2 for a, b in zip(runs, runs[1:])])
    # a pair whose two runs trained different programs is judged by its own run alone
    mixed = bench.pair_errors(pairs, [False] + [True] * (len(pairs) - 2))
    assert mixed["pair_bracketed"][0] is False
    assert mixed["pair_step_errors"][0] == pytest.approx(pairs[1][0] / runs[1] - 1)
    assert mixed["pair_step_errors"][1:] == pytest.approx(bracketed["pair_step_errors"][1:])
    with pytest.raises(ValueError, match="lead-in run and at least one more pair"):
        bench.pair_errors(pairs[:1], [])
    with pytest.raises(ValueError, match="a flag each"):
        bench.pair_errors(pairs, [True] * len(pairs))


def test_two_runs_train_the_same_program_unless_their_layouts_differ(repo):
    from flowrec.graph.plan_io import plan_document
    from flowrec.planner.manager import make_plan

    spec = load_spec(repo / "specs" / "avazu.yaml")
    hot = plan_document(make_plan(spec, device_budget="64MiB", target="cpu"))
    look = plan_document(make_plan(spec, device_budget="1GiB", target="cpu"))
    repriced = {**hot, "cost": {**hot["cost"], "step_ms_overlap": hot["cost"]["step_ms_overlap"] * 1.3},
                "groups": [{**g, "expected_hit_rate": 0.123} for g in hot["groups"]],
                "target": "/tmp/bench-cost-x/avazu-profile3.json"}  # each pair's calibration is a file of its own
    assert bench.same_program(hot, repriced)
    assert not bench.same_program(hot, look)
    fewer = {**hot, "groups": [{**g, "cache_rows": (g["cache_rows"] or 0) + 1} for g in hot["groups"]]}
    assert not bench.same_program(hot, fewer)
    # what differs is named by its path, prices and hit rates never
    assert bench.program_changes(hot, repriced) == []
    assert bench.program_changes(hot, fewer) == [f"groups[{i}].cache_rows" for i in range(len(hot["groups"]))]
    assert "groups[0].placement" in bench.program_changes(hot, look)
    extra = {**hot, "lookahead_window": 4}
    assert bench.program_changes(hot, extra) == ["lookahead_window"]
    assert bench.program_changes(extra, hot) == ["lookahead_window"]


@pytest.mark.parametrize("min_runs", [1, 3])
def test_bracket_adds_a_lead_in_pair_and_judges_by_the_runs_on_both_sides(repo, tmp_path, monkeypatch, min_runs):
    """`--bracket` with `--min-pairs K`: K + 1 calibrations and runs; the first run only measures,
    and calibration k is judged against the mean of runs k - 1 and k, or run k alone where the two
    runs' plans differ (here run 2's placement: pairs 2 and 3)."""
    spec = repo / "specs" / "movielens.yaml"
    n = min_runs + 1
    predicted = [random.uniform(250.0, 350.0) for _ in range(n)]
    measured = [random.uniform(250.0, 350.0) for _ in range(n)]  # ms: one run fills the pool
    calibrate, calibrated = _long_pairs(spec, tmp_path, monkeypatch, predicted, measured, host_run=2)
    row = bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", max_runs=5, recalibrate=calibrate,
                             min_runs=min_runs, bracket=True)
    assert calibrated == list(range(n)) and len(row["measured_runs"]) == n
    judged = [measured[k] if k in (2, 3) else (measured[k - 1] + measured[k]) / 2 for k in range(1, n)]
    errors = [p / m - 1 for p, m in zip(predicted[1:], judged)]
    assert row["pair_step_errors"] == pytest.approx(errors, rel=1e-9)
    assert row["pair_bracketed"] == [k not in (2, 3) for k in range(1, n)]
    # each unbracketed pair names what its runs' plans laid out otherwise: run 2's groups' placement
    changes = row["pair_program_changes"]
    assert [bool(c) for c in changes] == [k in (2, 3) for k in range(1, n)]
    assert all(path.startswith("groups[") and path.endswith("].placement") for c in changes for path in c)
    assert row["step_error"] == pytest.approx(sorted(errors)[len(errors) // 2], rel=1e-9)
    assert row["predicted_step_ms"] == pytest.approx(sorted(predicted[1:])[len(errors) // 2], rel=1e-9)
    assert row["bracket"] is True
    with pytest.raises(ValueError, match="calibration before each run"):
        bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", bracket=True)


def test_a_bracketed_part_does_not_merge_with_an_unbracketed_one(tmp_path, capsys):
    old = _part(tmp_path / "old.json", [_row("a.yaml", 0.04)])  # a result from before --bracket: not bracketed
    plain = _part(tmp_path / "plain.json", [_row("b.yaml", 0.02)], bracket=False)
    assert [r["spec"] for r in bench.merge([old, plain])["specs"]] == ["a.yaml", "b.yaml"]
    bracketed = _part(tmp_path / "br.json", [_row("c.yaml", 0.01)], bracket=True)
    with pytest.raises(SystemExit, match="differ from the first part"):
        bench.merge([old, bracketed])


INTERLEAVED = {"interleave": True, "bracket": True}


def _pairs_row(spec: str, errors: list[float]) -> dict:
    """A bracketed row of `errors` per pair (fresh random runs: no two parts share them)."""
    runs = [random.uniform(5.0, 20.0) for _ in range(len(errors) + 1)]
    judged = [(a + b) / 2 for a, b in zip(runs, runs[1:])]
    row = _row(spec, sorted(errors)[len(errors) // 2])
    row.update(pair_step_errors=list(errors), pair_run_step_ms=runs, pair_measured_step_ms=judged,
               pair_predicted_step_ms=[m * (1 + e) for m, e in zip(judged, errors)], run_device_budget="64MiB",
               **bench.interval_fields(list(errors)))
    return row


def _code(tree: str, dirty: bool = False) -> dict:
    return {name: tree * 40 for name in bench.MODEL_CODE} | {"dirty": dirty}


def _coded(path: Path, code: dict | None) -> Path:
    doc = json.loads(path.read_text())
    doc["model_code"] = code
    path.write_text(json.dumps(doc))
    return path


def test_pool_judges_a_spec_on_the_pairs_of_every_part_that_measured_it(tmp_path):
    first_a = [random.uniform(-0.3, -0.1) for _ in range(7)]
    second_a = [random.uniform(0.0, 0.05) for _ in range(6)]
    b = [random.uniform(0.01, 0.04) for _ in range(7)]
    first = _coded(_part(tmp_path / "r31.json", [_pairs_row("a.yaml", first_a), _pairs_row("b.yaml", b)],
                         **INTERLEAVED), None)  # a part from before results recorded their code
    second = _coded(_part(tmp_path / "r33.json", [_pairs_row("a.yaml", second_a)], **INTERLEAVED), _code("a"))
    out = tmp_path / "all.json"
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--merge", f"{first},{second}", "--pool",
                        "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 0, done.stderr
    doc = json.loads(out.read_text())
    a, row_b = doc["specs"]
    everything = first_a + second_a
    assert a["pooled_pair_step_errors"] == everything
    assert a["step_error"] == pytest.approx(sorted(everything)[6])  # the 7th of 13
    assert a["step_error_part"] == pytest.approx(sorted(second_a)[3])  # the last part's own
    assert [(p["part"], p["pairs"]) for p in a["pooled_from"]] == [(str(first), 7), (str(second), 6)]
    assert a["pooled_pair_error_spread"] == pytest.approx(max(everything) - min(everything))
    assert "pooled_from" not in row_b and row_b["step_error"] == sorted(b)[3]  # one part: as measured
    assert doc["pooled_specs"] == ["a.yaml@64MiB"]
    assert doc["ratios"]["costmodel_max_step_error"] == pytest.approx(max(abs(a["step_error"]), row_b["step_error"]))
    assert doc["parts_model_code"] == [None, _code("a")]
    # without --pool the later part's row replaces the earlier one's, as before
    plain = bench.merge([first, second])
    assert plain["specs"][0]["step_error"] == a["step_error_part"] and "pooled_specs" not in plain


def test_pool_keeps_the_pairs_where_a_later_part_failed_the_spec(tmp_path):
    errors = [random.uniform(-0.2, 0.2) for _ in range(5)]
    good = _part(tmp_path / "good.json", [_pairs_row("a.yaml", errors)], **INTERLEAVED)
    failed = _part(tmp_path / "failed.json", [{"spec": "a.yaml", "run_device_budget": "64MiB", "error": "boom"},
                                              {"spec": "c.yaml", "run_device_budget": "64MiB", "error": "boom"}],
                   **INTERLEAVED)
    doc = bench.merge([good, failed], pool=True)
    rows = {r["spec"]: r for r in doc["specs"]}
    assert rows["a.yaml"]["pair_step_errors"] == errors and "error" not in rows["a.yaml"]
    assert rows["c.yaml"]["error"] == "boom"  # measured nowhere else: the failure stands
    assert bench.merge([failed, good], pool=True)["specs"][0]["pair_step_errors"] == errors
    # a row without pairs (--other-budget's: one calibration, no pairs) is replaced by the later part's
    other = _part(tmp_path / "other1.json", [{**_row("a.yaml", 0.3), "run_device_budget": "none"}], **INTERLEAVED)
    again = _part(tmp_path / "other2.json", [{**_row("a.yaml", -0.02), "run_device_budget": "none"}], **INTERLEAVED)
    assert [r["step_error"] for r in bench.merge([other, again], pool=True)["specs"]] == [-0.02]


def test_pool_refuses_what_would_not_be_one_model_measured_on_fresh_runs(tmp_path):
    one = _part(tmp_path / "one.json", [_pairs_row("a.yaml", [0.1, -0.1, 0.02])], **INTERLEAVED)
    copy = tmp_path / "copy.json"
    copy.write_text(one.read_text())
    with pytest.raises(SystemExit, match="given twice"):
        bench.merge([one, tmp_path / "." / "one.json"], pool=True)
    with pytest.raises(SystemExit, match="runs are those of"):
        bench.merge([one, copy], pool=True)
    old = _coded(_part(tmp_path / "old.json", [_pairs_row("a.yaml", [0.1, 0.2, 0.0])], **INTERLEAVED), _code("b"))
    new = _coded(_part(tmp_path / "new.json", [_pairs_row("a.yaml", [0.0, 0.01, 0.0])], **INTERLEAVED), _code("c"))
    with pytest.raises(SystemExit, match="different model code"):
        bench.merge([old, new], pool=True)
    assert bench.merge([old, new])["specs"][0]["step_error"] == 0.0  # a plain merge: the newer row
    dirty = _coded(_part(tmp_path / "dirty.json", [_pairs_row("a.yaml", [0.3, 0.2, 0.1])], **INTERLEAVED),
                   _code("b", dirty=True))
    with pytest.raises(SystemExit, match="changes its commit does not hold"):
        bench.merge([old, dirty], pool=True)
    for bad in ("9cdca50", {"flowrec": "9cdca50"}, {name: 7 for name in bench.MODEL_CODE}):
        odd = _coded(_part(tmp_path / "odd.json", [_pairs_row("a.yaml", [0.0, 0.1, 0.2])], **INTERLEAVED), bad)
        with pytest.raises(SystemExit, match="model_code is not a git tree"):
            bench.merge([old, odd], pool=True)
    plain = _part(tmp_path / "plain.json", [_row("a.yaml", 0.04)])
    with pytest.raises(SystemExit, match="without --interleave"):
        bench.merge([plain], pool=True)
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--pool", "--json", str(tmp_path / "x.json")],
                       cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 2 and "--pool" in done.stderr and "--merge" in done.stderr


def test_model_code_names_the_trees_of_the_model_folders_and_changes_to_them(tmp_path, monkeypatch):
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))  # no checkout above it is found
    repo = tmp_path / "repo"
    for name in bench.MODEL_CODE:
        (repo / name).mkdir(parents=True)
        (repo / name / "a.py").write_text(f"x = {random.random()}\n")
    (repo / "docs.md").write_text("notes\n")

    def git(*args: str) -> str:
        done = run_bounded(["git", "-C", str(repo), *args], capture_output=True, text=True, timeout_s=60,
                           env={"GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t", "GIT_COMMITTER_NAME": "t",
                                "GIT_COMMITTER_EMAIL": "t@t", "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"})
        assert done.returncode == 0, done.stderr
        return done.stdout.strip()

    assert bench.model_code(repo) is None  # not a git checkout
    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "one")
    code = bench.model_code(repo)
    assert code == {name: git("rev-parse", f"HEAD:{name}") for name in bench.MODEL_CODE} | {"dirty": False}
    (repo / "docs.md").write_text("other notes\n")  # not the model's code
    assert bench.model_code(repo) == code
    (repo / "operators" / "a.py").write_text("x = -1\n")
    assert bench.model_code(repo) == code | {"dirty": True}
    git("commit", "-q", "-am", "two")
    after = bench.model_code(repo)
    assert after["operators"] != code["operators"] and after["flowrec"] == code["flowrec"] and not after["dirty"]


def test_each_probed_run_records_what_the_hypervisor_stole(monkeypatch):
    """A run's probe keeps the largest share of its wall time the hypervisor took from a vCPU the
    process may run on (steal ticks read around the run); steal on other CPUs is not counted, and
    the ratios report the largest share of any run."""
    ticks = {0: 0, 1: 0, 7: 0}
    monkeypatch.setattr(bench, "host_probe", lambda: {"gemm_ms": 1.0, "add_ms": 1.0})
    monkeypatch.setattr(bench.robust, "SchedClock",
                        lambda: robust_clock(steal=lambda: dict(ticks), cpus=lambda: {0, 1}))
    stolen = random.randint(1, 4)

    def work():
        ticks[1] += stolen
        ticks[7] += 50  # not a CPU of this process
        time.sleep(0.1)
        return "done"

    out, probe = bench.probed(work)
    assert out == "done"
    assert 0 < probe["steal_share"] <= stolen * bench.robust.TICK_SECONDS / 0.1
    _, calm = bench.probed(lambda: ticks.__setitem__(7, ticks[7] + 9))
    assert calm["steal_share"] == 0.0
    rows = [{**_row("a.yaml", 0.05), "measured_runs": [{"host_probe": probe}, {"host_probe": calm}]}]
    assert bench.summarize(rows, {}, {})["ratios"]["host_max_steal_share"] == pytest.approx(probe["steal_share"])


def _covers(n: int, k: int) -> float:
    """P(the k-th smallest <= the median <= the k-th largest) of n draws, by simulation's exact twin."""
    return 1.0 - 2.0 * sum(math.comb(n, i) for i in range(k)) / 2 ** n


@pytest.mark.parametrize("n", [3, 4, 6, 8, 13, 25])
def test_a_specs_interval_covers_the_median_as_often_as_it_says(n):
    draws = [random.gauss(0.05, 0.1) for _ in range(n)]
    low, high, cover = bench.median_interval(draws)
    ordered = sorted(draws)
    k = ordered.index(low) + 1
    assert high == ordered[n - k] and cover == pytest.approx(_covers(n, k))
    if _covers(n, 1) >= bench.INTERVAL_LEVEL:  # enough draws: the narrowest interval of at least the level
        assert cover >= bench.INTERVAL_LEVEL and (k + 1 > (n + 1) // 2 or _covers(n, k + 1) < bench.INTERVAL_LEVEL)
    else:  # too few: the range of them all, with its own coverage
        assert (low, high) == (ordered[0], ordered[-1]) and cover < bench.INTERVAL_LEVEL
    # it says how often: over many fresh samples of a skewed distribution with a known median
    rng, hits, trials = random.Random(n), 0, 3000
    for _ in range(trials):
        sample = [rng.expovariate(1.0) for _ in range(n)]  # median ln 2
        lo, hi, _ = bench.median_interval(sample)
        hits += lo <= math.log(2) <= hi
    assert abs(hits / trials - cover) < 0.03


def test_pairs_and_pooled_rows_say_whether_their_misses_are_beyond_the_noise(tmp_path):
    near = [0.01, -0.03, 0.04, 0.02, -0.05, 0.0, 0.03, -0.02]  # interval within 0.10
    far = [-0.2, -0.15, -0.25, -0.18, -0.3, -0.12, -0.22, -0.16]  # wholly below -0.10
    wide = [0.2, -0.2, 0.05, -0.15, 0.1, -0.05, 0.25, -0.1]  # straddles the goal
    pairs = [(1.0 + e, [bench.robust.Round(1.0)] * 3) for e in far]
    row = bench.pair_errors(pairs)
    assert row["step_error_verdict"] == "beyond" and row["step_error_interval"] == pytest.approx([-0.25, -0.15])
    part_a = _part(tmp_path / "a.json", [_pairs_row("a.yaml", near[:4]), _pairs_row("c.yaml", wide[:4])],
                   **INTERLEAVED)
    part_b = _part(tmp_path / "b.json", [_pairs_row("a.yaml", near[4:]), _pairs_row("c.yaml", wide[4:]),
                                         _pairs_row("f.yaml", far)], **INTERLEAVED)
    doc = bench.merge([part_a, part_b], pool=True)
    by = {r["spec"]: r for r in doc["specs"]}
    assert by["a.yaml"]["step_error_interval"] == [-0.03, 0.03]  # over all 8 pooled pairs, not a part's 4
    assert [by[s]["step_error_verdict"] for s in ("a.yaml", "c.yaml", "f.yaml")] == ["within", "undecided", "beyond"]
    assert doc["ratios"]["costmodel_specs_within"] == ["a.yaml"]
    assert doc["ratios"]["costmodel_specs_undecided"] == ["c.yaml"]
    assert doc["ratios"]["costmodel_specs_beyond"] == ["f.yaml"]
    # four pairs cannot bound the median at 90 %: undecided, however close they are
    assert bench.pair_errors(pairs[:4])["step_error_verdict"] == "undecided"


@pytest.mark.parametrize("bracket", [False, True])
@pytest.mark.parametrize("kind", ["steady", "scattered", "biased"])
def test_until_decided_adds_pairs_while_the_interval_straddles_the_goal(repo, tmp_path, monkeypatch, kind, bracket):
    """`--until-decided`: a long step (one run fills the pool) gets pairs past --min-pairs while its
    interval straddles 0.10, up to --runs: five pairs decide a steady spec (within) or a biased one
    (beyond); a scattered one takes every pair --runs allows and stays undecided."""
    spec = repo / "specs" / "movielens.yaml"
    most = 9
    errors = {"steady": [random.uniform(-0.03, 0.03) for _ in range(most + 1)],
              "scattered": [s * random.uniform(0.15, 0.3) for s in [1, -1] * 5],
              "biased": [random.uniform(-0.35, -0.2) for _ in range(most + 1)]}[kind]
    measured = [600.0] * (most + 1)  # every run alike (a bracketed pair's mean is its run's); one fills the pool
    predicted = [m * (1 + e) for m, e in zip(measured, errors)]
    calibrate, calibrated = _long_pairs(spec, tmp_path, monkeypatch, predicted, measured)
    row = bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", max_runs=most, recalibrate=calibrate,
                             min_runs=1, bracket=bracket, until_decided=True)
    pairs = 5 if kind != "scattered" else most
    assert len(row["pair_step_errors"]) == pairs and len(calibrated) == pairs + bracket
    verdict = {"steady": "within", "scattered": "undecided", "biased": "beyond"}[kind]
    assert row["step_error_verdict"] == verdict
    # without it the pool of one long run ends the spec after --min-pairs
    calibrate, calibrated = _long_pairs(spec, tmp_path, monkeypatch, predicted, measured)
    once = bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", max_runs=most, recalibrate=calibrate,
                              min_runs=1, bracket=bracket)
    assert len(once["pair_step_errors"]) == 1 and once["step_error_verdict"] == "undecided"
    with pytest.raises(ValueError, match="calibration before each run"):
        bench.measure_spec(spec, calibrate(0), 20, tmp_path, "64MiB", until_decided=True)


def test_until_decided_needs_interleave(tmp_path):
    done = run_bounded([sys.executable, "tools/bench_costmodel.py", "--until-decided", "--specs", "movielens.yaml",
                        "--json", str(tmp_path / "x.json")], cwd=REPO, capture_output=True, text=True, timeout_s=120)
    assert done.returncode == 2 and "--until-decided" in done.stderr and "--interleave" in done.stderr
    assert not (tmp_path / "x.json").exists()


def test_a_merge_bounds_the_pairs_of_a_result_from_before_the_interval(tmp_path):
    errors = [0.01, -0.02, 0.03, 0.0, -0.01, 0.02]
    old = _pairs_row("a.yaml", errors)
    for key in ("step_error_interval", "step_error_interval_coverage", "step_error_verdict"):
        del old[key]
    doc = bench.merge([_part(tmp_path / "old.json", [old, _row("b.yaml", 0.05)], **INTERLEAVED)])
    a, b = doc["specs"]
    assert a["step_error_interval"] == [-0.02, 0.03] and a["step_error_verdict"] == "within"
    assert "step_error_interval" not in b  # no pairs: nothing to bound
    assert doc["ratios"]["costmodel_specs_within"] == ["a.yaml"]
