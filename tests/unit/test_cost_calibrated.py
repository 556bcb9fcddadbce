"""The calibrated cost model: fits recover known constants, profiles round-trip, uncalibrated
targets say so, and predictions follow each per-op constant (no timing is asserted)."""
from __future__ import annotations

import json
import random
import statistics
from dataclasses import replace
from pathlib import Path

import pytest

from flowrec.graph.kinds import OP_KINDS, OPTIMIZERS
from flowrec.graph.types import Op
from flowrec.planner.calibration import (MEASURABLE, PROFILE_VERSION, ProfileError, profile_document,
                                         profile_fields, read_profile)
from flowrec.planner.cost import (DEVICES, dense_seconds, dense_update_seconds, device_profile, measured_op_seconds,
                                  predict)
from flowrec.planner.manager import make_plan
from flowrec.planner.op_work import RULES, op_signature, op_work, outside_kernels
from flowrec.measure.ops import fit_linear
from flowrec.measure.robust import Round
from flowrec.spec import load_spec


@pytest.fixture
def dlrm(repo):
    return load_spec(repo / "specs" / "dlrm_criteo.yaml")


@pytest.fixture
def din(repo):
    return load_spec(repo / "specs" / "din_taobao.yaml")


def test_fit_recovers_fixed_and_rate_from_synthetic_timings():
    sizes = [1e3, 1e5, 1e6, 4e6]
    fixed, per_byte = 7e-6, 1 / 12e9  # 7 us + 12 GB/s
    seconds = [fixed + s * per_byte for s in sizes]
    got = fit_linear([[1.0, s] for s in sizes], seconds)
    assert got[0] == pytest.approx(fixed, rel=1e-9) and got[1] == pytest.approx(per_byte, rel=1e-9)


def test_fit_recovers_three_constants_under_noise():
    rng = random.Random(3)
    shapes = [(m, k, n) for m in (512, 4096) for k in (16, 256, 1024) for n in (32, 512)]
    truth = (20e-6, 1 / 0.3e12, 1 / 30e9)  # 20 us, 0.3 TFLOP/s, 30 GB/s
    rows = [[1.0, 2.0 * m * k * n, 4.0 * (m * k + k * n + m * n)] for m, k, n in shapes]
    seconds = [sum(c * x for c, x in zip(truth, r)) * (1 + rng.uniform(-0.02, 0.02)) for r in rows]
    got = fit_linear(rows, seconds)
    assert got[1] == pytest.approx(truth[1], rel=0.05) and got[2] == pytest.approx(truth[2], rel=0.3)


def test_fit_drops_a_coefficient_the_data_would_make_negative():
    sizes = [1e3, 1e5, 1e6]
    seconds = [5e-9 * s for s in sizes]  # pure rate: a free fit would give a slightly negative fixed part
    seconds[0] *= 0.5
    got = fit_linear([[1.0, s] for s in sizes], seconds)
    assert got[0] == 0.0 and got[1] > 0
    with pytest.raises(ValueError):
        fit_linear([[1.0, 2.0]], [0.0])


def _document(**measured):
    return profile_document("cpu", measured, "test machine", "2026-01-01T00:00:00Z")


def test_a_profile_with_per_optimizer_tables_round_trips(tmp_path: Path):
    updates = {name: [1.0 + i, 2.0, 0.5, 0.0, 3.0 + i] for i, name in enumerate(n for n, o in OPTIMIZERS.items() if o.sparse)}
    dense = {name: [10.0, 1.5] for name, o in OPTIMIZERS.items() if o.dense}
    doc = _document(op_us=(4.0, "chain"), gemm_us=(0.0, "fit"), gemm_bwd_tflops=(0.1, "fit"),
                    sparse_update=(updates, "fit"), dense_update=(dense, "fit"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    back = read_profile(path)
    assert back["version"] == PROFILE_VERSION and back["measured"]["sparse_update"]["value"] == updates
    assert "elementwise_gbps" in back["datasheet"] and "op_us" not in back["datasheet"]
    device = device_profile(str(path))
    assert device.op_us == 4.0 and device.gemm_us == 0.0 and device.gemm_bwd_tflops == 0.1
    assert device.sparse_update_cost("adam") == tuple(updates["adam"])
    assert device.dense_update_cost("adam") == (10.0, 1.5)
    assert device.elementwise_gbps == DEVICES["cpu"].elementwise_gbps  # not measured: datasheet kept


def test_an_uncalibrated_target_says_so_and_derives_its_per_op_costs():
    cpu = DEVICES["cpu"]
    assert cpu.constants == "datasheet cpu" and cpu.sparse_update == () and cpu.dense_update == ()
    sgd, adam = cpu.sparse_update_cost("sgd"), cpu.sparse_update_cost("adam")
    assert adam[4] > sgd[4]  # adam's two state elements per row element cost more than sgd's none
    assert cpu.dense_update_cost("adam")[1] > cpu.dense_update_cost("sgd")[1]
    assert cpu.layer_constants(backward=True)[1] < cpu.layer_constants()[1]  # backward: 2x the FLOPs


def test_a_version_1_profile_still_loads(tmp_path: Path):
    old = {"format": "flowrec-device-profile", "version": 1, "base": "cpu",
           "measured": {"fp32_tflops": {"value": 0.3, "how": "x"}}}
    path = tmp_path / "old.json"
    path.write_text(json.dumps(old))
    device = device_profile(str(path))
    assert device.fp32_tflops == 0.3 and device.op_us == DEVICES["cpu"].op_us


@pytest.mark.parametrize("value, words", [
    ({"lion": [1, 2, 3, 4, 5]}, "not an optimizer"),
    ({"adam": [1, 2, 3]}, "must be 5 finite non-negative numbers"),
    ({"adam": [1, 2, 3, 4, -5]}, "must be 5 finite non-negative numbers"),
    ({"adam": [1, 2, 3, 4, float("nan")]}, "must be 5 finite non-negative numbers"),
    ([1, 2, 3, 4, 5], "must map optimizers"),
])
def test_a_bad_per_optimizer_table_is_one_line(value, words):
    doc = {"base": "cpu", "measured": {"sparse_update": {"value": value, "how": "x"}}}
    with pytest.raises(ProfileError, match=words):
        profile_fields(doc, "p.json")


def test_a_zero_rate_is_refused_but_a_zero_fixed_part_is_not():
    with pytest.raises(ProfileError, match="elementwise_gbps must be a positive number"):
        profile_fields({"base": "cpu", "measured": {"elementwise_gbps": {"value": 0.0}}}, "p.json")
    assert profile_fields({"base": "cpu", "measured": {"gemm_us": {"value": 0.0}}}, "p.json") == {"gemm_us": 0.0}


def test_every_dense_kind_has_a_work_rule():
    dense = {k for k, info in OP_KINDS.items() if info.cost == "dense"}
    assert dense == set(RULES)


def test_work_rules_follow_the_op():
    mlp = Op("m", "mlp", ("B", 8), attrs=(("activation", "relu"), ("in_features", 4), ("layers", (16, 8))))
    work = op_work(mlp, 32, 2)
    assert work.forward.gemms == ((32, 4, 16, 1), (32, 16, 8, 1)) == work.backward.gemms
    assert work.param_tensors == 4 and work.forward.elementwise  # two inputs: concatenated first
    assert not op_work(mlp, 32, 1).forward.elementwise
    att = Op("a", "target_attention", ("B", 16), attrs=(("hidden", (80, 40)), ("in_features", 16 * 51)))
    assert op_work(att, 10, 2).forward.gemms[0] == (10 * 50, 64, 80, 1)  # the unit runs on B x L rows


def test_the_work_of_a_mixture_of_many_gates_is_built_in_linear_time(monkeypatch):
    """A moe whose `heads` lists 100,000 names (a gate each) kept `flowrec plan` busy for minutes: the
    work of its gates was added pairwise, copying every kernel tuple again at each gate. Counted in
    kernel entries built (no timing): twice the gates, twice the entries; the work is the same."""
    from flowrec.planner import op_work as work_module

    built = [0]

    class Counted(work_module.Kernels):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            built[0] += len(self.gemms) + len(self.elementwise) + len(self.fresh)

    monkeypatch.setattr(work_module, "Kernels", Counted)

    def moe(heads: int):
        built[0] = 0
        op = Op("x", "moe", ("B", 8), attrs=(("activation", "relu"), ("experts", 3), ("expert_layers", (8,)),
                                              ("gate_layers", (4,)), ("heads", tuple(f"h{i}" for i in range(heads))),
                                              ("in_features", 16), ("packed", True)))
        work = op_work(op, 32, 1)
        return work, built[0]

    small, small_built = moe(1000)
    large, large_built = moe(2000)
    assert len(large.forward.gemms) == 2 * len(small.forward.gemms) - 1  # the experts' GEMM once, 2 per gate
    assert large_built < 2.2 * small_built, (small_built, large_built)


def test_predictions_rise_with_each_per_op_constant(dlrm):
    plan = make_plan(dlrm, target="cpu")
    cpu = DEVICES["cpu"]
    base = predict(plan.graph, dlrm, cpu)
    stages = dict(base.stage_ms)
    slower = {
        "op_us": replace(cpu, op_us=50.0),
        "gemm_bwd_us": replace(cpu, gemm_bwd_us=500.0),
        "elementwise_gbps": replace(cpu, elementwise_gbps=1.0),
        "sparse_update": replace(cpu, sparse_update=(("rowwise_adagrad", (100.0, 50.0, 5.0, 0.0, 50.0)),)),
        "dense_update": replace(cpu, dense_update=(("adam", (500.0, 10.0)),)),
    }
    for name, device in slower.items():
        got = predict(plan.graph, dlrm, device)
        assert got.step_ms_serial > base.step_ms_serial, name
    assert dict(predict(plan.graph, dlrm, slower["gemm_bwd_us"]).stage_ms)["dense"] == stages["dense"]
    assert dict(predict(plan.graph, dlrm, slower["op_us"]).stage_ms)["dense"] > stages["dense"]


def test_micro_batches_pay_the_fixed_costs_again_on_the_cpu(dlrm):
    plan = make_plan(dlrm, target="cpu")
    one = predict(plan.graph, dlrm, DEVICES["cpu"], micro_batches=1)
    four = predict(plan.graph, dlrm, DEVICES["cpu"], micro_batches=4)
    assert dict(four.stage_ms)["dense"] > dict(one.stage_ms)["dense"]


def test_dense_time_follows_the_batch_and_the_update_the_parameters(din):
    plan = make_plan(din, target="cpu")
    cpu = DEVICES["cpu"]
    small, large = dense_seconds(plan.graph, cpu, 256), dense_seconds(plan.graph, cpu, 1024)
    assert small[0] < large[0] and small[1] < large[1] and large[1] > large[0]
    adam = dense_update_seconds(plan.graph, din, cpu)
    sgd = dense_update_seconds(plan.graph, replace(din, dense_optimizer=replace(din.dense_optimizer, name="sgd")), cpu)
    assert 0 < sgd < adam


def test_every_measurable_constant_is_a_profile_field():
    fields = set(DEVICES["cpu"].__dataclass_fields__)
    assert set(MEASURABLE) <= fields


def test_row_map_cost_grows_with_the_map_between_the_timed_sizes():
    from flowrec.planner.cost import MAP_LARGE_ROWS, MAP_SMALL_ROWS

    device = replace(DEVICES["cpu"], map_small_ns_per_id=4.0, map_ns_per_id=60.0)
    assert device.map_ns(1000) == 4.0 and device.map_ns(MAP_SMALL_ROWS) == 4.0
    assert device.map_ns(MAP_LARGE_ROWS * 4) == 60.0
    middle = device.map_ns(int((MAP_SMALL_ROWS * MAP_LARGE_ROWS) ** 0.5))
    assert middle == pytest.approx(32.0)


def test_a_host_table_has_no_row_map_and_on_the_cpu_no_second_gather(repo):
    """`HostEmbedding` looks its ids up in the packed table as a resident table does: a `host`
    group costs on the CPU (the host is the device) what a `device` one costs, whatever the
    row-map constants; cached placements map their ids; a GPU pays the host's gathers."""
    from flowrec.planner.cost import _units, sparse_seconds

    spec = load_spec(repo / "specs" / "dcn_v2.yaml")
    plan = make_plan(spec, target="cpu", device_budget="64MiB")
    units = _units(plan.graph, None)
    assert {u.placement for u in units} == {"host"}
    batch = spec.training.batch_size
    cpu = replace(DEVICES["cpu"], map_small_ns_per_id=19.0, map_ns_per_id=29.0, host_gather_rows_per_s=5e7)
    for u in units:
        host = sparse_seconds(u, cpu, batch, None)
        assert host == sparse_seconds(replace(u, placement="device"), cpu, batch, None)
        cached = sparse_seconds(replace(u, placement="static_hot", hit_rate=0.5), cpu, batch, None)
        assert cached[0] > host[0] + u.lookups(batch) * 19e-9 and cached[1] == host[1]
        gpu = replace(DEVICES["a100"], host_gather_rows_per_s=5e7)
        on_gpu = sparse_seconds(u, gpu, batch, None)
        assert on_gpu[0] > sparse_seconds(replace(u, placement="device"), gpu, batch, None)[0]


def test_large_new_tensors_cost_page_faults_from_the_threshold_on(din):
    cpu = DEVICES["cpu"]
    assert cpu.fresh_seconds(1e9) == 0.0  # uncalibrated: no fresh-memory term
    faulting = replace(cpu, alloc_threshold_bytes=8e6, alloc_ns_per_byte=0.3)
    assert faulting.fresh_seconds(4e6) == 0.0 and faulting.fresh_seconds(1e8) == pytest.approx(0.03)
    plan = make_plan(din, target="cpu")
    base, slower = dense_seconds(plan.graph, cpu, 1024), dense_seconds(plan.graph, faulting, 1024)
    assert slower[0] > base[0] and slower[1] > base[1]  # DIN's attention tensors are 16 MB
    mlp = Op("m", "mlp", ("B", 8), attrs=(("activation", "relu"), ("in_features", 4), ("layers", (8,))))
    work = op_work(mlp, 32, 1)
    assert work.forward.fresh == (32 * 8 * 4, 32 * 8 * 4) and work.backward.fresh == (32 * 8 * 4, 32 * 4 * 4, 4 * 8 * 4)


def _signatures(plan, spec):
    graph = plan.graph
    return {n: op_signature(graph.nodes[n]["op"], graph.in_degree(n), spec.training.precision) for n in graph
            if OP_KINDS[graph.nodes[n]["op"].kind].role == "dense"}


def test_a_measured_op_is_exact_at_its_points_and_linear_between():
    points = (16, 10.0, 30.0, 256, 100.0, 200.0, 1024, 900.0, 1000.0)  # (batch, fwd us, bwd us)
    for batch, fwd, bwd in zip(points[0::3], points[1::3], points[2::3]):
        assert measured_op_seconds(points, batch) == pytest.approx((fwd * 1e-6, bwd * 1e-6))
    assert measured_op_seconds(points, 640) == pytest.approx((500e-6, 600e-6))  # halfway 256 -> 1024
    assert measured_op_seconds(points, 2048) == pytest.approx((1966.6667e-6, 2066.6667e-6))  # the last slope on
    assert measured_op_seconds(points, 1) == pytest.approx((4.375e-6, 19.375e-6))  # below: the first slope
    assert measured_op_seconds((100, 1.0, 1.0, 200, 101.0, 201.0), 10) == (0.0, 0.0)  # never below 0
    assert measured_op_seconds((100, 5.0, 7.0), 300) == pytest.approx((15e-6, 21e-6))  # one point: proportional


def test_a_measured_op_replaces_its_kernels_but_not_its_input_assembly(din):
    plan = make_plan(din, target="cpu")
    cpu = DEVICES["cpu"]
    signatures = _signatures(plan, din)
    attention = signatures["attention"]
    base = dense_seconds(plan.graph, cpu, 1024, precision="fp32")
    slow = replace(cpu, dense_ops=((attention, (1024.0, 50_000.0, 90_000.0)),))
    fast = replace(cpu, dense_ops=((attention, (1024.0, 1.0, 1.0)),))
    got_slow = dense_seconds(plan.graph, slow, 1024, precision="fp32")
    got_fast = dense_seconds(plan.graph, fast, 1024, precision="fp32")
    assert got_slow[0] > base[0] > got_fast[0] and got_slow[1] > base[1] > got_fast[1]
    assert got_slow[0] - got_fast[0] == pytest.approx((50_000.0 - 1.0) * 1e-6)
    assert dense_seconds(plan.graph, slow, 1024, precision="bf16") == dense_seconds(plan.graph, cpu, 1024, precision="bf16")
    att = plan.graph.nodes["attention"]["op"]
    assert outside_kernels(att, 1024, 1) == outside_kernels(att, 1024, 1).__class__()  # nothing outside its module
    mlp = Op("m", "mlp", ("B", 8), attrs=(("activation", "relu"), ("in_features", 4), ("layers", (8,))))
    around = outside_kernels(mlp, 32, 2)
    assert around.forward.elementwise == (2 * 32 * 4 * 4,) and not around.forward.gemms  # the concatenating copy


def test_op_signatures_tell_ops_precisions_and_input_counts_apart(din):
    plan = make_plan(din, target="cpu")
    signatures = _signatures(plan, din)
    assert len(set(signatures.values())) == len(signatures) and signatures == _signatures(plan, din)
    att = plan.graph.nodes["attention"]["op"]
    assert op_signature(att, 2, "fp32") != op_signature(att, 2, "bf16") != op_signature(att, 3, "bf16")
    assert signatures["attention"].startswith("target_attention/")


def test_prediction_rises_with_the_framework_cost_and_falls_with_the_staging_rate(dlrm):
    plan = make_plan(dlrm, target="cpu")
    cpu = DEVICES["cpu"]
    base = predict(plan.graph, dlrm, cpu)
    framework = predict(plan.graph, dlrm, replace(cpu, step_us=700.0))
    assert dict(framework.stage_ms)["dense"] == pytest.approx(dict(base.stage_ms)["dense"] + 0.7)
    assert framework.step_ms_overlap == pytest.approx(base.step_ms_overlap + 0.7)
    faster = predict(plan.graph, dlrm, replace(cpu, staging_values_per_s=cpu.staging_values_per_s * 4))
    assert dict(faster.stage_ms)["staging"] == pytest.approx(dict(base.stage_ms)["staging"] / 4, rel=1e-3)
    assert faster.step_ms_overlap < base.step_ms_overlap  # on the CPU staging takes the trainer's cores


def test_new_profile_fields_round_trip(tmp_path: Path, din):
    plan = make_plan(din, target="cpu")
    attention = _signatures(plan, din)["attention"]
    ops = {attention: [16.0, 200.0, 500.0, 1024.0, 9000.0, 20000.0]}
    doc = _document(step_us=(450.0, "tiny steps"), staging_values_per_s=(3e8, "staged"), dense_ops=(ops, "timed"))
    path = tmp_path / "p.json"
    path.write_text(json.dumps(doc))
    device = device_profile(str(path))
    assert device.step_us == 450.0 and device.staging_values_per_s == 3e8
    assert device.dense_ops == ((attention, tuple(ops[attention])),)
    assert "datasheet or derived" in device.constants and "step_us" not in device.constants.split("derived:")[1]
    assert dense_seconds(plan.graph, device, 1024, precision="fp32")[0] > 9000e-6


@pytest.mark.parametrize("value, words", [
    ({"mlp/abc": [16.0, 1.0]}, "must be a multiple of 3 finite non-negative numbers"),
    ({"mlp/abc": [16.0, 1.0, -2.0]}, "must be a multiple of 3 finite non-negative numbers"),
    ({"mlp/abc": []}, "must be a multiple of 3 finite non-negative numbers"),
    ([16.0, 1.0, 2.0], "must map op signatures"),
])
def test_a_bad_dense_op_table_is_one_line(value, words):
    doc = {"base": "cpu", "measured": {"dense_ops": {"value": value, "how": "x"}}}
    with pytest.raises(ProfileError, match=words):
        profile_fields(doc, "p.json")


def test_a_version_2_profile_loads_and_the_plan_names_what_it_lacks(tmp_path: Path, dlrm):
    old = {"format": "flowrec-device-profile", "version": 2, "base": "cpu", "created": "T",
           "measured": {"fp32_tflops": {"value": 0.3, "how": "x"}, "op_us": {"value": 3.0, "how": "x"}}}
    path = tmp_path / "v2.json"
    path.write_text(json.dumps(old))
    device = device_profile(str(path))
    assert device.step_us == 0.0 and device.dense_ops == () and device.staging_values_per_s == DEVICES["cpu"].staging_values_per_s
    named = device.constants.split("datasheet or derived: ")[1].rstrip(")").split(", ")
    assert {"step_us", "dense_ops", "staging_values_per_s", "elementwise_gbps"} <= set(named)
    assert "op_us" not in named and "fp32_tflops" not in named
    plan = make_plan(dlrm, target=str(path))
    assert "step_us" in plan.cost.constants


def test_measured_op_points_never_fall_as_the_batch_grows():
    from flowrec.measure.spec import monotone

    loaded = [(1024, 9.0, 3.0), (16, 12.0, 0.5), (256, 1.0, 6.0)]  # batch 16's forward and 256's backward slowed
    assert monotone(loaded) == [(16, 1.0, 0.5), (256, 1.0, 3.0), (1024, 9.0, 3.0)]
    calm = [(16, 1.0, 2.0), (256, 3.0, 5.0), (1024, 9.0, 20.0)]
    assert monotone(calm) == calm


def test_compute_scale_prices_the_dense_side_only(dlrm):
    plan = make_plan(dlrm, target="cpu")
    cpu = replace(DEVICES["cpu"], step_us=700.0)
    base, scaled = (dict(predict(plan.graph, dlrm, replace(cpu, compute_scale=s)).stage_ms) for s in (1.0, 1.5))
    forward, backward = dense_seconds(plan.graph, cpu, dlrm.training.batch_size)
    update = dense_update_seconds(plan.graph, dlrm, cpu)
    assert forward > 0 and backward > 0 and update > 0
    assert scaled["dense"] == pytest.approx(base["dense"] + forward * 0.5 * 1e3)  # step_us unscaled
    assert scaled["backward"] == pytest.approx(base["backward"] + (backward + update) * 0.5 * 1e3)
    assert scaled["sparse"] == base["sparse"] > 0 and scaled["staging"] == base["staging"]


def test_compute_scale_is_the_measured_dense_part_over_its_priced_ops(dlrm, monkeypatch, tmp_path: Path):
    """The scale is the dense part of full-batch steps less its fixed cost (its dense part at the
    smallest tiny batch beyond the priced ops there, which step_us holds) over the priced ops, by
    the timing rule over several measurements; a fixed cost of any size leaves it unchanged."""
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.step import with_batch

    plans = {b: make_plan(with_batch(dlrm, b), target="cpu") for b in (calibrate_spec.TINY_BATCHES[0], 4096)}
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "tiny steps")}, "m", "t")))
    priced = device_profile(str(profile))
    work = {b: calibrate_spec._dense_work_ms(plan, with_batch(dlrm, b), priced) for b, plan in plans.items()}
    assert work[4096] > work[16] > 0
    factor = random.uniform(0.6, 2.5)
    for fixed_ms in (0.0, 0.4, 3.0):
        for full_ms, expected in ((factor * work[4096] + fixed_ms, factor), (work[4096] * 5000, 1000.0),
                                  (fixed_ms, 0.1)):
            calls = []

            def fake(plan, spec, device, steps, full_ms=full_ms, fixed_ms=fixed_ms):
                calls.append(spec.training.batch_size)
                ms = full_ms if spec.training.batch_size == 4096 else work[16] + fixed_ms
                slow = 1.5 if calls.count(spec.training.batch_size) == 1 else 1.0  # the first measurement: a burst
                return [Round(ms * slow * 1e-3 * (1 + i % 3 / 2), ms * slow * 1e-3 * (i % 3 / 2)) for i in range(8)]

            monkeypatch.setattr(calibrate_spec, "dense_step_seconds", fake)  # the slower steps waited for a core
            scale, details = calibrate_spec._compute_scale(dlrm, None, lambda batch: plans[batch], profile)
            assert scale == pytest.approx(expected, rel=1e-4)
            assert details["measured_dense_ms"] == pytest.approx(full_ms, rel=1e-5)
            assert details["fixed_ms"] == pytest.approx(fixed_ms, abs=1e-9)
            assert calls.count(4096) >= 2  # several measurements, the burst outvoted
            assert calls[:4] == [4096, 16, 4096, 16]  # in turn: a spell of load falls on both sizes
    profile.write_text(json.dumps(profile_document("cpu", {"compute_scale": (1.7, "steps")}, "m", "t")))
    assert device_profile(str(profile)).compute_scale == 1.7
    assert device_profile("cpu").compute_scale == 1.0  # not measured: the ops' sum


def test_the_framework_cost_is_the_median_leftover_of_rounds_of_tiny_steps(dlrm, monkeypatch):
    """The fixed cost is the median leftover of the tiny steps beyond their priced compute, over
    rounds of every tiny batch in turn (TINY_REPEATS by default): a burst that slows a minority of
    the measurements does not move it."""
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.step import with_batch

    plans = {b: make_plan(with_batch(dlrm, b), target="cpu") for b in calibrate_spec.TINY_BATCHES}
    priced = {b: (p.cost.step_ms_serial - dict(p.cost.stage_ms)["staging"] - dict(p.cost.stage_ms)["transfer"])
              for b, p in plans.items()}
    fixed_us = random.uniform(200.0, 2000.0)
    for rounds in (None, random.randint(3, 6)):
        calls: list[int] = []

        def fake(plan, spec, device, steps, calls=calls):
            calls.append(spec.training.batch_size)
            burst = 5.0 if len(calls) % 7 == 3 else 0.0  # a neighbour's burst: one measurement in seven, +5 ms
            ms = priced[spec.training.batch_size] + fixed_us * 1e-3 + burst
            return [Round(ms * 1e-3) for _ in range(steps)]

        monkeypatch.setattr(calibrate_spec, "step_seconds", fake)
        args = () if rounds is None else (rounds,)
        value, details = calibrate_spec._framework_us(dlrm, None, lambda batch: plans[batch], *args)
        expected = calibrate_spec.TINY_REPEATS if rounds is None else rounds
        batches = list(calibrate_spec.TINY_BATCHES)
        assert calls == batches * expected and details["rounds"] == expected  # every batch size in turn, each round
        assert details["fit"]["points"] == len(details["points"]) == len(batches) * expected
        assert value == pytest.approx(fixed_us, rel=1e-6)  # the bursts outvoted
        assert details["fit"]["high_us"] == pytest.approx(fixed_us + 5000.0, rel=1e-6)


def test_the_compute_scale_is_the_steps_over_the_table_with_no_drift_probe(dlrm, monkeypatch, tmp_path: Path):
    """The scale is the steps' dense part over the table as measured: no probe of the ops around
    the steps divides a drift out (round 19: on this host such probes measured another spell than
    the steps and priced 41 of 60 runs worse). Whatever speed the steps ran at is the scale's: a
    host 30 % slower during the steps gives a dense part 30 % slower and a higher scale. A further
    block is sized to about
    FULL_BLOCK_STEP_SECONDS of the first block's median step."""
    from flowrec.measure import spec as calibrate_spec
    from flowrec.measure.step import with_batch

    batch = dlrm.training.batch_size
    plans = {b: make_plan(with_batch(dlrm, b), target="cpu") for b in (calibrate_spec.TINY_BATCHES[0], batch)}
    graph = plans[batch].graph
    table = {}
    for node in graph:  # a table for every dense op and the loss, skewed per op
        op = graph.nodes[node]["op"]
        if OP_KINDS[op.kind].role in ("dense", "loss"):
            sig = op_signature(op, graph.in_degree(node), dlrm.training.precision)
            f, b = random.uniform(5, 400), random.uniform(5, 900)
            table.setdefault(sig, [16.0, f / 50, b / 50, float(batch), f, b])
    assert len(table) >= 3
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps(profile_document("cpu", {"step_us": (300.0, "tiny"), "dense_ops": (table, "ops")},
                                                   "m", "t")))
    priced = device_profile(str(profile))
    work = {b: calibrate_spec._dense_work_ms(plan, with_batch(dlrm, b), priced) for b, plan in plans.items()}
    factor, fixed_ms = random.uniform(0.7, 1.6), random.uniform(0.2, 0.9)

    def no_probe(*args, **kwargs):
        raise AssertionError("the compute scale timed the ops again")

    monkeypatch.setattr(calibrate_spec, "op_seconds", no_probe)
    scales, dense = {}, {}
    for slow in (1.0, 1.3, 0.8):
        counts = []

        def steps(plan, spec, device, n, slow=slow):
            counts.append((spec.training.batch_size, n))
            ms = (factor * work[batch] + fixed_ms) if spec.training.batch_size == batch else work[16] + fixed_ms
            return [Round(ms * slow * 1e-3 * (1 + i / 200)) for i in range(n)]

        monkeypatch.setattr(calibrate_spec, "dense_step_seconds", steps)
        scale, details = calibrate_spec._compute_scale(dlrm, None, lambda b: plans[b], profile)
        assert "host_drift" not in details
        full = [n for b, n in counts if b == batch]
        assert full[0] == calibrate_spec.FULL_STEPS and len(full) == calibrate_spec.FULL_BLOCKS
        first_ms = (factor * work[batch] + fixed_ms) * slow * (1 + (full[0] - 1) / 400)  # the first block's median
        assert full[1:] == [calibrate_spec.block_steps(first_ms / 1e3)] * (len(full) - 1)
        assert [n for b, n in counts if b != batch] == full  # the tiny batch's blocks alike, in turn
        rounds = [((factor * work[batch] + fixed_ms) * slow * (1 + i / 200)) for n in full for i in range(n)]
        tiny = [((work[16] + fixed_ms) * slow * (1 + i / 200)) for n in full for i in range(n)]
        median = lambda xs: statistics.median(xs)  # noqa: E731
        fixed = max(0.0, median(tiny) - work[16])
        assert details["measured_dense_ms"] == pytest.approx(median(rounds), rel=1e-9)
        assert scale == pytest.approx((median(rounds) - fixed) / work[batch], rel=1e-9)
        scales[slow], dense[slow] = scale, details["measured_dense_ms"]
    # the steps' own speed: their dense part that much slower or faster (blocks sized by the first
    # block's step hold other rounds, hence not exactly), the scale with it, less the fixed part that
    # the tiny batch's steps, just as slow, set
    assert dense[1.3] > dense[1.0] * 1.2 and dense[0.8] < dense[1.0] * 0.9
    assert scales[1.3] > scales[1.0] > scales[0.8]


def test_the_dense_part_is_the_median_of_all_its_rounds_not_the_fastest_block(monkeypatch):
    """Calibration's dense part stands on the benchmark's footing: the timing rule over the rounds
    of every block pooled. One quiet block (every round clean, 20 % faster) must not set it: the
    fastest block would price every step below the median a run is measured at."""
    from flowrec.measure import spec as calibrate_spec

    monkeypatch.setattr(calibrate_spec, "FULL_BLOCKS", 3)  # three blocks of each size below
    fast = [Round(0.8e-3 * (1 + i / 100)) for i in range(8)]
    usual = [Round(1.0e-3 * (1 + i / 100)) for i in range(8)]
    waited = [Round(3.0e-3, 2.0e-3) for _ in range(4)]  # a burst: not clean, not counted
    tiny = [Round(0.5e-3)] * 8
    for order in ([fast, usual, usual + waited], [usual, fast, usual], [usual + waited, usual, fast]):
        blocks = iter(x for block in order for x in (block, tiny))  # the other batch size's in between
        monkeypatch.setattr(calibrate_spec, "dense_step_seconds", lambda *a, **k: next(blocks))
        (est, ms), (_, tiny_ms) = calibrate_spec._dense_ms_pair((None, None), (None, None), None)
        assert tiny_ms == pytest.approx(0.5)
        clean = [r.wall for block in order for r in block if r.waited == 0.0]
        assert est.rounds == sum(len(b) for b in order) and est.clean == len(clean) == 24
        assert ms == pytest.approx(sorted(clean)[11] * 500 + sorted(clean)[12] * 500)  # the median, in ms
        assert ms > 1.0  # not the fast block's 0.8 ms


def test_dense_step_seconds_times_real_dense_steps(repo):
    import torch

    from flowrec.measure.step import dense_step_seconds, with_batch

    spec = with_batch(load_spec(repo / "specs" / "din_taobao.yaml"), 64)  # attention and masks
    plan = make_plan(spec, target="cpu")
    seconds = dense_step_seconds(plan, spec, torch.device("cpu"), 3)
    assert 3 <= len(seconds) <= 12 and all(0 < s.wall < 60 and 0 <= s.waited <= s.wall for s in seconds)


def test_dense_step_seconds_gives_a_retrieval_loss_what_train_step_does(repo, monkeypatch):
    """The calibrated dense step of a retrieval spec runs the trainer's loss: the batch's items as
    the head's labels and the logQ candidates, not the staged labels column alone."""
    import torch

    from flowrec.measure import step as measure_step
    from flowrec.runtime.retrieval import batch_items

    spec = with_batch_spec = measure_step.with_batch(load_spec(repo / "specs" / "two_tower_movielens.yaml"), 64)
    plan = make_plan(with_batch_spec, target="cpu")
    seen, real_lower = [], measure_step.lower

    def lowered(*args, **kwargs):
        model = real_lower(*args, **kwargs)
        loss = model.loss

        class Recording(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.inner = loss

            def forward(self, logits, labels, cands=None):
                seen.append((labels.detach().clone(), cands))
                return self.inner(logits, labels, cands)

            def __getattr__(self, name):
                try:
                    return super().__getattr__(name)
                except AttributeError:
                    return getattr(self.inner, name)

        model.loss = Recording()
        return model

    monkeypatch.setattr(measure_step, "lower", lowered)
    staged = measure_step._staged(spec, plan, 5)
    monkeypatch.setattr(measure_step, "_staged", lambda *a: staged)
    measure_step.dense_step_seconds(plan, spec, torch.device("cpu"), 2)
    binding = real_lower(plan, spec, torch.device("cpu")).retrieval
    assert len(seen) >= 5 and all(cands is not None and cands.log_q is not None for _, cands in seen)
    timed = staged[measure_step.WARMUP_STEPS:]  # replayed in turn on a busy machine (`timed_steps`)
    order = staged[:measure_step.WARMUP_STEPS] + [timed[i % len(timed)] for i in range(len(seen) - len(staged) + len(timed))]
    for (labels, _), batch in zip(seen, order, strict=True):
        assert torch.equal(labels[:, binding.head].long(), batch_items(binding, batch))


def test_staging_rate_is_what_live_steps_add_over_staged_ones(dlrm, monkeypatch):
    from flowrec.measure import spec as calibrate_spec

    values, cpu_s = random.uniform(1e4, 1e5), random.uniform(1e-3, 5e-3)
    monkeypatch.setattr(calibrate_spec, "staging_cpu_seconds", lambda *a, **k: [(cpu_s, values)])
    staged_s = random.uniform(5e-3, 2e-2)
    top = calibrate_spec.STAGING_ADDED_MAX_CPU * cpu_s  # a slowed live block adds no more than this
    for added, expected in ((cpu_s * 1.7, cpu_s * 1.7), (cpu_s / 3, cpu_s / 3), (-cpu_s, cpu_s / 10),
                            (cpu_s * 7, top)):
        live = [Round(staged_s + added + (i % 3) * 0.01, (i % 3) * 0.01) for i in range(9)]  # 3 clean rounds
        monkeypatch.setattr(calibrate_spec, "live_step_seconds",
                            lambda *a, live=live, **k: (live, [Round(staged_s)] * 9))
        rate, details = calibrate_spec._staging_rate(dlrm, None, None)
        assert rate == pytest.approx(values / expected, rel=1e-6)
        assert details["added_ms_per_batch"] == pytest.approx(expected * 1e3, rel=1e-6)


def test_staging_cpu_bound_is_the_least_of_its_runs_and_blocks_are_sized_by_the_step(dlrm, monkeypatch):
    """One slowed run of the pipeline alone must not set the sanity bound (custom_module, round 14:
    22 ms per batch once against about 0.2 ms, its staging priced 10x); the live and staged
    blocks are sized by the step the calibration measured."""
    from flowrec.measure import spec as calibrate_spec

    values = random.uniform(1e4, 1e5)
    runs = iter([(random.uniform(2e-2, 3e-2), values), (1e-3, values), (random.uniform(2e-3, 5e-3), values)])
    monkeypatch.setattr(calibrate_spec, "staging_cpu_seconds", lambda *a, **k: list(runs))
    seen = {}

    def live_steps(plan, spec, device, steps, blocks=1, **k):
        seen.update(steps=steps, blocks=blocks)
        return [Round(5e-3)] * 9, [Round(5e-3)] * 9  # no difference: the bound decides

    monkeypatch.setattr(calibrate_spec, "live_step_seconds", live_steps)
    rate, details = calibrate_spec._staging_rate(dlrm, None, None, 4.0)
    assert details["cpu_ms_per_batch_runs"] and len(details["cpu_ms_per_batch_runs"]) == 3
    assert rate == pytest.approx(values / 1e-4, rel=1e-6)
    assert (seen["blocks"], seen["steps"]) == calibrate_spec.staging_plan(4.0)
    assert seen["blocks"] > 1 and seen["steps"] > calibrate_spec.LIVE_STEPS
    blocks, steps = calibrate_spec.staging_plan(2000.0)
    assert blocks == 1 and steps == calibrate_spec.LIVE_STEPS


def test_live_and_staged_steps_alternate_in_blocks(repo, monkeypatch):
    """staged (warm-up, block), live (warm-up, block), staged (one settling step, block), live:
    the same model steps both kinds, each kind's rounds are its blocks' timed steps."""
    import torch

    from flowrec.measure import step as measure_step

    spec = measure_step.with_batch(load_spec(repo / "specs" / "movielens.yaml"), 32)
    plan = make_plan(spec, target="cpu")
    real_staged, real_step = measure_step._staged, measure_step.train_step
    staged_ids: set[int] = set()
    kinds: list[str] = []

    def staged(*a):
        out = real_staged(*a)
        staged_ids.update(id(b) for b in out)
        return out

    def step(model, optimizer, batch, *a):
        kinds.append("S" if id(batch) in staged_ids else "L")
        return real_step(model, optimizer, batch, *a)

    monkeypatch.setattr(measure_step, "_staged", staged)
    monkeypatch.setattr(measure_step, "train_step", step)
    steps, blocks, warm = 2, 3, measure_step.WARMUP_STEPS
    live, quiet = measure_step.live_step_seconds(plan, spec, torch.device("cpu"), steps, blocks=blocks)
    assert len(live) == len(quiet) == steps * blocks
    expected = "S" * (warm + steps) + "L" * (warm + steps) + ("S" * (1 + steps) + "L" * steps) * (blocks - 1)
    assert "".join(kinds) == expected


def test_live_step_seconds_times_steps_fed_by_the_pipeline(repo):
    import torch

    from flowrec.measure.step import live_step_seconds, with_batch

    spec = with_batch(load_spec(repo / "specs" / "movielens.yaml"), 64)
    plan = make_plan(spec, target="cpu")
    live, staged = live_step_seconds(plan, spec, torch.device("cpu"), 3)
    assert len(live) == len(staged) == 3
    assert all(0 < r.wall < 60 and 0 <= r.waited <= r.wall for r in live + staged)


def test_a_measured_loss_replaces_the_retrieval_softmax_kernels(repo):
    """A retrieval head's in-batch softmax (B x B logits) is priced by its kernel list until the
    profile measures the loss op as a whole; then by the measurement alone, and it grows with the
    batch faster than linearly while unmeasured (B^2 logits)."""
    from flowrec.planner.cost import kernel_seconds, retrieval_work

    spec = load_spec(repo / "specs" / "two_tower_movielens.yaml")
    plan = make_plan(spec, target="cpu")
    graph, cpu = plan.graph, DEVICES["cpu"]
    loss_node = next(n for n in graph if graph.nodes[n]["op"].kind == "loss")
    loss = graph.nodes[loss_node]["op"]
    signature = op_signature(loss, graph.in_degree(loss_node), "fp32")
    base = dense_seconds(graph, cpu, 1024, precision="fp32")
    softmax = retrieval_work(graph, loss, 1024)
    own = op_work(loss, 1024, graph.in_degree(loss_node))
    assert kernel_seconds(softmax.forward, cpu) > 0 and softmax.forward.gemms == ((1024, 32, 1024, 1),)
    fast = replace(cpu, dense_ops=((signature, (1024.0, 1.0, 2.0)),))
    got = dense_seconds(graph, fast, 1024, precision="fp32")
    assert base[0] - got[0] == pytest.approx(kernel_seconds(softmax.forward, cpu) + kernel_seconds(own.forward, cpu)
                                             - 1e-6)
    assert base[1] - got[1] == pytest.approx(kernel_seconds(softmax.backward, cpu, backward=True)
                                             + kernel_seconds(own.backward, cpu, backward=True) - 2e-6)
    slow = replace(cpu, dense_ops=((signature, (256.0, 300.0, 400.0, 1024.0, 3400.0, 3300.0)),))
    assert dense_seconds(graph, slow, 1024, precision="fp32")[0] - got[0] == pytest.approx((3400.0 - 1.0) * 1e-6)
    small = dense_seconds(graph, cpu, 256, precision="fp32")
    assert base[0] > 4 * small[0] or base[1] > 4 * small[1]  # unmeasured: the B x B logits


def test_op_seconds_times_the_loss_on_what_train_step_gives_it(repo, monkeypatch):
    """The loss node is timed like a dense op, at every batch size, on the dense forward's logits,
    the batch's items as the retrieval head's labels and the logQ candidates; `_dense_ops` keys it
    by the loss op's signature."""
    import torch

    from flowrec.measure import spec as measure_spec
    from flowrec.measure import step as measure_step
    from flowrec.runtime.retrieval import batch_items

    spec = measure_step.with_batch(load_spec(repo / "specs" / "two_tower_movielens.yaml"), 64)
    plan = make_plan(spec, target="cpu")
    graph = plan.graph
    loss_node = next(n for n in graph if graph.nodes[n]["op"].kind == "loss")
    calls, real_loss_inputs = [], measure_step._loss_inputs

    def recorded(model, sized, batch):
        args = real_loss_inputs(model, sized, batch)
        calls.append((model, batch, args))
        return args

    monkeypatch.setattr(measure_step, "_loss_inputs", recorded)
    ran = []

    def measure(runs):
        ran.extend(run() for run in runs)
        return [float(i + 1) for i in range(len(runs))]

    timings = measure_step.op_seconds(plan, spec, torch.device("cpu"), ["head_retrieve", loss_node], [16, 64], measure)
    assert [b for b, _, _ in timings[loss_node]] == [16, 64] and len(ran) == 8
    assert len(calls) == 2
    for model, batch, (logits, labels, cands) in calls:
        binding = model.retrieval
        assert logits.requires_grad and logits.shape[0] == batch.size
        assert torch.equal(labels[:, binding.head].long(), batch_items(binding, batch))
        assert cands is not None and cands.log_q is not None
    assert all(isinstance(r, tuple) for r in ran[1::2])  # forward + backward: the gradients
    monkeypatch.setattr(measure_spec, "op_seconds",
                        lambda plan, spec, device, nodes, batches, measure: {n: [(b, 1e-6, 2e-6) for b in batches]
                                                                              for n in nodes})
    ops, details = measure_spec._dense_ops(spec, torch.device("cpu"), plan, 0.01)
    loss_signature = op_signature(graph.nodes[loss_node]["op"], graph.in_degree(loss_node), "fp32")
    assert loss_signature in ops and details[loss_node] == loss_signature
