"""The cost model's transfer term prices what the transfer stage sends: every staged tensor
(dense features, labels, and per device-side group its ids, offsets and casting index), copied as
`DeviceRuntime.upload` copies them (`upload_gbps`, `upload_us`), and the caches' rows at
`pcie_gbps`."""
from __future__ import annotations

import random
import time
from dataclasses import replace

import pytest
import torch

from flowrec.data.dataset import MemorySource, split_table
from flowrec.data.profile import profile_access
from flowrec.data.synth import SynthConfig, synth_table
from flowrec.measure.calibrate import upload_fit
from flowrec.planner import cost
from flowrec.planner.calibration import profile_document
from flowrec.planner.cost import DEVICES, casting_bytes, device_profile, predict, upload_seconds, upload_tensors
from flowrec.planner.manager import make_plan
from flowrec.runtime.pipeline import TransferStage
from flowrec.testing.caches import cache_spec, staged
from operators.device import CpuRuntime


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class _Recording(CpuRuntime):
    """The CPU runtime, recording every tensor the transfer stage sends."""

    def __init__(self):
        super().__init__(torch.device("cpu"))
        self.sent: list[torch.Tensor] = []

    def upload(self, tensor):
        self.sent.append(tensor)
        return tensor.clone()


def _sent(batch) -> list[torch.Tensor]:
    stage = TransferStage(iter(()), torch.device("cpu"))
    stage.runtime = _Recording()
    stage._move(batch)
    return stage.runtime.sent


def test_each_part_priced_is_the_bytes_the_stage_sends():
    """Per batch, on fresh skewed data: the dense features and labels, the ids and offsets and
    the casting of each group (`casting_bytes` at the batch's own distinct rows) are the bytes the
    stage copies, and `upload_tensors` the copies."""
    spec = cache_spec()
    batches = staged(spec, rows=640, window=1, seed=random.randrange(1 << 30))
    units = cost._units(make_plan(spec, target="h100").graph)
    assert {u.group.name for u in units} == set(batches[0].groups)
    means = {u.group.name: u.mean for u in units}
    assert sorted(means.values()) == [False, True]  # the sequence field pools by mean: one group has a scale
    for batch in batches:
        sent = _sent(batch)
        assert len(sent) == upload_tensors(units)
        expected = batch.size * (len(spec.dense_features) + len(spec.heads)) * 4
        for name, g in batch.groups.items():
            assert g.casting is not None
            ids = g.ids.numel()
            distinct = g.casting.unique_ids.numel()
            assert distinct < ids  # skewed: rows repeat within a batch
            assert g.casting.nbytes == casting_bytes(ids, distinct, means[name])
            assert _nbytes(g.ids) + _nbytes(g.offsets) == (ids + g.offsets.numel()) * cost.INDEX_BYTES
            expected += (ids + g.offsets.numel()) * cost.INDEX_BYTES + casting_bytes(ids, distinct, means[name])
        assert sum(_nbytes(t) for t in sent) == expected


def test_the_predicted_bytes_follow_the_batches_sent():
    """The plan's bytes a step, its distinct rows from the data's access profile (as `flowrec
    train` samples it), against the stage's copies of that data's batches (fresh skewed data);
    without the castings they would be a third short."""
    spec = cache_spec()
    seed = random.randrange(1 << 30)
    table = synth_table(spec, 640, SynthConfig(seed=seed, alpha=1.2))
    access = profile_access(spec, MemorySource(split_table(table, 3)), sample_rate=1.0)
    batches = staged(spec, rows=640, window=1, seed=seed)
    sent = sorted(sum(_nbytes(t) for t in _sent(b)) for b in batches if b.size == spec.training.batch_size)
    median = sent[len(sent) // 2]
    predicted = make_plan(spec, target="h100", profile=access).cost.h2d_bytes_per_step
    assert abs(predicted / median - 1) < 0.10, (predicted, median, seed)
    castings = [sum(casting_bytes(g.ids.numel(), g.casting.unique_ids.numel(), False) for g in b.groups.values())
                for b in batches]
    assert min(c / s for c, s in zip(castings, (sum(_nbytes(t) for t in _sent(b)) for b in batches))) > 0.3


def test_the_batch_is_priced_at_the_upload_rate_and_rows_at_the_link():
    """A profile's upload constants price the staged batch; `pcie_gbps` prices only the rows a
    host-side group moves; the CPU has no transfer."""
    spec = cache_spec()
    plan = make_plan(spec, target="h100")
    h100 = DEVICES["h100"]

    def transfer(device, graph=plan.graph):
        return dict(predict(graph, spec, device).stage_ms)["transfer"]

    slow, fast = replace(h100, upload_gbps=2.0, upload_us=30.0), replace(h100, upload_gbps=20.0, upload_us=30.0)
    nbytes = predict(plan.graph, spec, h100).h2d_bytes_per_step
    tensors = upload_tensors(cost._units(plan.graph))
    assert transfer(slow) - transfer(fast) == pytest.approx(nbytes * (1 / 2e9 - 1 / 20e9) * 1e3, abs=2e-6)
    assert transfer(slow) == pytest.approx((tensors * 30e-6 + nbytes / 2e9) * 1e3, abs=2e-6)
    assert transfer(h100) == pytest.approx(upload_seconds(h100, nbytes, tensors) * 1e3, abs=2e-6)
    assert upload_seconds(h100, nbytes, tensors) == pytest.approx(tensors * h100.launch_us * 1e-6 + nbytes / 50e9)
    assert upload_seconds(DEVICES["cpu"], nbytes, tensors) == 0.0
    assert transfer(DEVICES["cpu"], make_plan(spec, target="cpu").graph) == 0.0
    # tables on the host, no cache: their ids stay there, their rows cross the link, not the upload
    hosted = make_plan(replace(spec, plan=replace(spec.plan, cache="none")), target="h100",
                       device_budget="1KiB").graph
    units = cost._units(hosted)
    assert {u.placement for u in units} == {"host"} and not any(map(cost.sends_ids, units))
    assert upload_tensors(units) == 2
    moved = predict(hosted, spec, h100).h2d_bytes_per_step
    batch_bytes = spec.training.batch_size * (len(spec.dense_features) + len(spec.heads)) * 4
    links = replace(h100, upload_gbps=1.0, upload_us=0.0), replace(h100, upload_gbps=100.0, upload_us=0.0)
    diff = transfer(links[0], hosted) - transfer(links[1], hosted)
    assert diff == pytest.approx(batch_bytes * (1 / 1e9 - 1 / 100e9) * 1e3, abs=2e-6)
    assert moved > batch_bytes


def test_upload_fit_recovers_the_line_and_survives_noise():
    gbps, us = upload_fit((65_536, 16_777_216), (20e-6 + 65_536 / 12e9, 20e-6 + 16_777_216 / 12e9))
    assert gbps == pytest.approx(12.0) and us == pytest.approx(20.0)
    gbps, us = upload_fit((65_536, 16_777_216), (3e-3, 1e-3))  # the small copy delayed: no negative rate
    assert gbps == pytest.approx(16_777_216 / 1e-3 / 1e9) and us == 0.0


def test_a_profile_with_upload_constants_loads_and_a_cpu_profile_does_not_miss_them(tmp_path):
    import json

    gpu = profile_document("h100", {"upload_gbps": (11.5, "x"), "upload_us": (0.0, "x"), "pcie_gbps": (48.0, "x")}, "m", "t")
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps(gpu))
    profile = device_profile(str(path))
    assert (profile.upload_gbps, profile.upload_us, profile.pcie_gbps) == (11.5, 0.0, 48.0)
    assert "upload_gbps" not in profile.source.split("datasheet or derived:")[1]
    old = profile_document("h100", {"pcie_gbps": (48.0, "x")}, "m", "t")  # a profile from before these constants
    path.write_text(json.dumps(old))
    assert "upload_gbps" in device_profile(str(path)).source.split("datasheet or derived:")[1]
    for measured in ({"pcie_gbps": (None, "x")},  # as flowrec calibrate writes on the CPU, and before
                     {"pcie_gbps": (None, "x"), "upload_gbps": (None, "x"), "upload_us": (None, "x")}):
        path.write_text(json.dumps(profile_document("cpu", measured, "m", "t")))
        cpu = device_profile(str(path))
        assert "upload" not in cpu.source.split("datasheet or derived:")[1]
        assert (cpu.pcie_gbps, cpu.upload_gbps, cpu.upload_us) == (None, 0.0, 0.0)


def test_the_stage_counts_the_bytes_of_the_batches_compute_takes(monkeypatch):
    """A transfer stage on a (recorded) GPU copies every batch on its thread, ahead of compute;
    `delivered_bytes` counts the batches compute took, not those still queued, and the run
    report sets them against the plan's bytes where no cache counters exist."""
    import flowrec.runtime.pipeline as pipeline
    from flowrec.runtime.run_report import run_report
    from flowrec.runtime.trainer import TrainResult

    spec = cache_spec()
    batches = staged(spec, rows=640, window=1, seed=random.randrange(1 << 30))
    recording = _Recording()
    monkeypatch.setattr(pipeline, "runtime_for", lambda device: recording)
    taken = 3
    with TransferStage(iter(batches), torch.device("cuda"), depth=2) as stage:
        got = [next(stage) for _ in range(taken)]
        deadline = time.monotonic() + 120  # a loaded machine may not run the thread for seconds
        while not stage._sizes and time.monotonic() < deadline:  # the stage moves the next batch ahead
            time.sleep(0.01)
        assert stage._sizes, "the transfer stage did not move a batch ahead of compute"
        expected = sum(sum(_nbytes(t) for t in _sent(b)) for b in batches[:taken])
        assert stage.delivered_bytes == expected  # the batch moved ahead is not counted yet
    assert all(torch.equal(g.dense, b.dense) for g, b in zip(got, batches))
    plan = make_plan(spec, target="h100")
    result = TrainResult(taken, taken * spec.training.batch_size, 1.0, 1.0, None, transfer_bytes=expected)
    lines = run_report(result, plan, spec.training.batch_size, len(spec.dense_features), len(spec.heads))
    line = next(x for x in lines if "host->device" in x)
    from flowrec.spec.units import format_bytes

    assert f"measured {format_bytes(expected / taken)} per step" in line
    assert f"predicted {format_bytes(plan.cost.h2d_bytes_per_step)}" in line
