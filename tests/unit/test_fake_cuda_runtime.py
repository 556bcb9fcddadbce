"""The narrow device runtime (`operators.device`): the CPU implementation runs the same scheduling
code as CUDA, and its events check that schedule."""
from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flowrec.runtime.caches import LookaheadEmbedding
from flowrec.runtime.pipeline import TransferStage
from operators.device import CpuEvent, CpuRuntime, CpuSideStream, runtime_for
from flowrec.testing.caches import cache_spec, groups_of, head_weights, loss_of, staged, window_rows


def test_cpu_events_must_be_recorded_before_they_are_waited_for():
    rt = runtime_for(torch.device("cpu"))
    assert isinstance(rt, CpuRuntime)
    with pytest.raises(RuntimeError, match="never recorded"):
        rt.wait_current(CpuEvent())
    with pytest.raises(RuntimeError, match="never recorded"):
        rt.side_stream().wait(CpuEvent())
    rt.wait_current(rt.side_stream().record())
    t = torch.arange(3)
    assert rt.pin(t) is t


class _LoggedStream(CpuSideStream):
    def __init__(self, log):
        self.log = log

    def wait(self, event):
        super().wait(event)
        self.log.append(("side waits", id(event)))

    def record(self):
        event = super().record()
        self.log.append(("side records", id(event)))
        return event


class _LoggedRuntime(CpuRuntime):
    def __init__(self, log):
        super().__init__(torch.device("cpu"))
        self.log = log

    def record_current(self):
        event = super().record_current()
        self.log.append(("compute records", id(event)))
        return event

    def wait_current(self, event):
        super().wait_current(event)
        self.log.append(("compute waits", id(event)))


def test_lookahead_exchanges_follow_the_stream_protocol():
    spec = cache_spec()
    batches = staged(spec, window=3)
    group = groups_of(spec, "fp32")[0]
    module = LookaheadEmbedding(replace(group, cache_rows=window_rows(batches, group.name)), 3,
                                torch.device("cpu"), interleave=True)
    log: list = []
    module.runtime, module._stream = _LoggedRuntime(log), _LoggedStream(log)
    w = head_weights(group)
    for batch in batches:
        loss_of(module.forward_group(batch.groups[group.name]), w).backward()
    module.close()
    kinds = [k for k, _ in log]
    exchanges = kinds.count("side records")
    assert exchanges >= len(batches) // 2
    assert kinds == ["compute records", "side waits", "side records", "compute waits"] * exchanges
    for i in range(0, len(log), 4):
        assert log[i][1] == log[i + 1][1] and log[i + 2][1] == log[i + 3][1]


def test_transfer_stage_sends_every_staged_tensor_through_the_runtime_unpinned():
    """Every tensor of a staged batch goes through `DeviceRuntime.upload` (on CUDA a copy from
    pageable memory: pinning each one first slowed the step on an H200), and none is pinned."""
    spec = cache_spec()
    batches = staged(spec, rows=64, window=1)
    uploaded = []

    class Uploading(CpuRuntime):
        def pin(self, tensor):
            raise AssertionError("the transfer stage pinned a staged tensor")

        def upload(self, tensor):
            uploaded.append(tensor)
            return tensor.clone()

    stage = TransferStage(iter(batches), torch.device("cpu"))
    stage.runtime = Uploading(torch.device("cpu"))
    batch = batches[0]
    moved = stage._move(batch)
    castings = [g.casting for g in batch.groups.values()]
    assert all(c is not None for c in castings)  # staged with lookahead: castings travel too
    assert len(uploaded) == 2 + sum(2 + 4 + (c.sorted_scale is not None) for c in castings)
    assert torch.equal(moved.dense, batch.dense) and moved.dense is not batch.dense
    assert torch.equal(moved.labels, batch.labels) and moved.labels is not batch.labels
    for name, g in moved.groups.items():
        assert torch.equal(g.ids, batch.groups[name].ids) and g.ids is not batch.groups[name].ids
        assert torch.equal(g.casting.sorted_bags, batch.groups[name].casting.sorted_bags)


def test_cuda_upload_is_a_plain_copy_to_the_device():
    """CUDA's upload does not pin (checked on the CPU with the copy's target redirected)."""
    from operators.device import CudaRuntime

    rt = CudaRuntime(torch.device("cuda"))
    rt.device = torch.device("cpu")  # the same code path, a device this machine has
    t = torch.randn(5, 3)
    out = rt.upload(t)
    assert torch.equal(out, t) and not out.is_pinned()


def test_seeding_through_the_runtime_draws_what_torch_manual_seed_draws():
    """`DeviceRuntime.seed` (what a model with custom modules calls every step) seeds the host's
    generator as `torch.manual_seed` does, so a user's module draws the same numbers; CUDA's seeds
    its generators too (lazily on a build without CUDA)."""
    import random

    from operators.device import CudaRuntime

    seed = random.randrange(1 << 62)
    torch.manual_seed(seed)
    expected = (torch.rand(7), torch.nn.functional.dropout(torch.ones(64), 0.3, training=True),
                torch.randint(0, 1000, (5,)))
    torch.manual_seed(seed + 1)  # moved elsewhere first
    runtime_for(torch.device("cpu")).seed(seed)
    got = (torch.rand(7), torch.nn.functional.dropout(torch.ones(64), 0.3, training=True),
           torch.randint(0, 1000, (5,)))
    for a, b in zip(expected, got, strict=True):
        assert torch.equal(a, b)
    torch.manual_seed(seed + 2)
    CudaRuntime(torch.device("cuda", 0)).seed(seed)
    assert torch.equal(torch.rand(7), expected[0])
