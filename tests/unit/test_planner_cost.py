"""Cost model sanity: monotone in batch, budget, device and precision; memory parts add up."""
from __future__ import annotations

from dataclasses import replace

import pytest

from flowrec.planner.cost import DEVICES, default_budget, device_profile, predict
from flowrec.planner.manager import make_plan
from flowrec.spec import load_spec


@pytest.fixture
def dlrm(repo):
    return load_spec(repo / "specs" / "dlrm_criteo.yaml")


def with_batch(spec, batch):
    return replace(spec, training=replace(spec.training, batch_size=batch))


def test_step_time_grows_with_batch(dlrm):
    times = [make_plan(with_batch(dlrm, b), target="a100").cost.step_ms_serial for b in (512, 2048, 8192)]
    assert times == sorted(times) and times[0] < times[-1]


def test_faster_device_is_faster(dlrm):
    plan = make_plan(dlrm, target="a100")
    a100 = predict(plan.graph, dlrm, DEVICES["a100"])
    h100 = predict(plan.graph, dlrm, DEVICES["h100"])
    cpu = predict(plan.graph, dlrm, DEVICES["cpu"])
    assert dict(h100.stage_ms)["dense"] < dict(a100.stage_ms)["dense"] < dict(cpu.stage_ms)["dense"]
    assert cpu.h2d_bytes_per_step == 0 and a100.h2d_bytes_per_step > 0


def test_bf16_dense_is_faster(dlrm):
    bf16 = replace(dlrm, training=replace(dlrm.training, precision="bf16"))
    fp32_plan, bf16_plan = make_plan(dlrm, target="h100"), make_plan(bf16, target="h100")
    assert dict(bf16_plan.cost.stage_ms)["dense"] < dict(fp32_plan.cost.stage_ms)["dense"]


def test_smaller_budget_moves_more_bytes_and_uses_less_memory(dlrm):
    roomy = make_plan(dlrm, target="h100")
    tight = make_plan(dlrm, target="h100", device_budget="1GiB")
    assert tight.cost.h2d_bytes_per_step > roomy.cost.h2d_bytes_per_step
    assert tight.cost.peak_memory_bytes < roomy.cost.peak_memory_bytes
    assert tight.cost.peak_memory_bytes <= 2**30
    host = make_plan(replace(dlrm, plan=replace(dlrm.plan, cache="none")), target="h100", device_budget="1GiB")
    assert host.cost.h2d_bytes_per_step > tight.cost.h2d_bytes_per_step


def test_overlap_never_slower_and_memory_adds_up(dlrm):
    for target in DEVICES:
        c = make_plan(dlrm, target=target).cost
        assert c.step_ms_overlap <= c.step_ms_serial + 1e-9
        assert c.peak_memory_bytes == sum(b for _, b in c.memory)
        assert c.samples_per_s == pytest.approx(c.batch_size / (c.step_ms_overlap / 1e3), rel=1e-3)


def test_profiles():
    assert default_budget(DEVICES["h100"]) < DEVICES["h100"].memory_bytes
    with pytest.raises(ValueError, match="known: cpu, a100, h100"):
        device_profile("tpu")
