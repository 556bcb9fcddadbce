"""The cache placements on CUDA: scratchpad / hot table on the GPU, master in pinned host memory;
same parameters as a device-resident table (float64 bitwise where the torch backward runs)."""
from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "unit"))
from flowrec.testing.caches import cache_spec, groups_of, head_weights, loss_of, staged, window_rows  # noqa: E402

from flowrec.runtime.caches import HostEmbedding, LookaheadEmbedding, StaticHotEmbedding, hottest_rows  # noqa: E402
from operators.embedding import PackedEmbeddingBag  # noqa: E402

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")


def reference(group, batches):
    ref = PackedEmbeddingBag(group, seed=3, device=CUDA)
    w = head_weights(group).to(CUDA)
    for b in batches:
        g = b.groups[group.name]
        loss_of(ref(g.ids.to(CUDA), g.offsets.to(CUDA), g.casting.to(CUDA)), w).backward()
    return ref.weight.cpu(), ref.state.cpu()


def run(module, group, batches):
    w = head_weights(group).to(CUDA)
    for b in batches:
        loss_of(module.forward_group(b.groups[group.name]), w).backward()
    torch.cuda.synchronize()
    return module.full_tables()


@pytest.mark.parametrize("dtype", ["fp64", "fp32"])
@pytest.mark.parametrize("interleave", [True, False])
def test_lookahead_cuda_equals_device(dtype, interleave):
    spec = cache_spec()
    batches = staged(spec, window=3)
    for group in groups_of(spec, dtype):
        module = LookaheadEmbedding(replace(group, cache_rows=window_rows(batches, group.name)), 3, CUDA,
                                    interleave=interleave)
        got = run(module, group, batches)
        want = reference(group, batches)
        for x, y in zip(got, want):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        assert module.counters.snapshot()["hit_rate"] == 1.0
        module.close()


def test_static_hot_and_host_cuda_equal_device():
    spec = cache_spec("rowwise_adagrad")
    batches = staged(spec, window=1)
    for group in groups_of(spec, "fp32"):
        counts = torch.bincount(torch.cat([b.groups[group.name].ids for b in batches]), minlength=group.rows)
        hot = StaticHotEmbedding(replace(group, cache_rows=group.rows // 4), 3, CUDA)
        hot.set_hot_rows(hottest_rows(counts, group.rows // 4))
        for x, y in zip(run(hot, group, batches), reference(group, batches)):
            torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)
        host = HostEmbedding(group, 3, CUDA)
        assert host.weight.is_pinned()
