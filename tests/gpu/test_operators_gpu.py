"""CUDA and CuPy paths equal the CPU reference (skipped without CUDA)."""
from __future__ import annotations

import pytest
import torch

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators.casting import compute_casting
from operators.embedding import PackedEmbeddingBag, mean_bag_flags
from operators.random_batches import random_batch

pytestmark = pytest.mark.gpu


def _group(optimizer, dim: int = 16) -> PackedGroup:
    tables = (TableSlot("a", 1000, 0), TableSlot("one", 1, 1000), TableSlot("b", 5000, 1001))
    fields = (GroupField("fa", "a", 1, "sum"), GroupField("fone", "one", 2, "mean"),
              GroupField("fb", "b", 8, "mean"), GroupField("fseq", "a", 5, "none"))
    return PackedGroup("g", dim, "fp32", optimizer, tables, fields)


def _run(device: str, group: PackedGroup, batches, grads, use_cupy: bool | None):
    emb = PackedEmbeddingBag(group, seed=7, device=device)
    if use_cupy is not None:
        emb.use_cupy = use_cupy
    outs = []
    for batch, grad in zip(batches, grads):
        casting = compute_casting(batch.ids, batch.offsets, mean_bag_flags(group)).to(device)
        out = emb(batch.ids.to(device), batch.offsets.to(device), casting=casting)
        out.backward(grad.to(device))
        outs.append(out.detach().cpu())
    return emb.weight.cpu(), emb.state.cpu(), outs, emb.last_backend


def _inputs(group, steps=3, batch_size=256):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    batches = [random_batch(group, batch_size, gen, empty_prob=0.2) for _ in range(steps)]
    grads = [torch.randn(batch_size, group.bags_per_sample, group.dim, generator=gen)
             for _ in range(steps)]
    return batches, grads


@pytest.mark.parametrize("optimizer", [("sgd", 0.1, ()), ("adagrad", 0.1, ()),
                                       ("rowwise_adagrad", 0.1, (("weight_decay", 0.01),)),
                                       ("adam", 0.01, ())], ids=lambda o: o[0])
@pytest.mark.parametrize("dim", [1, 16, 200])
def test_cuda_torch_path_equals_cpu(optimizer, dim):
    group = _group(optimizer, dim)
    batches, grads = _inputs(group)
    w_cpu, s_cpu, out_cpu, _ = _run("cpu", group, batches, grads, None)
    w_gpu, s_gpu, out_gpu, backend = _run("cuda", group, batches, grads, False)
    assert backend == "torch"
    for a, b in zip(out_cpu, out_gpu):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w_cpu, w_gpu, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_cpu, s_gpu, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("dim", [1, 16, 200, 256])
def test_cupy_fused_rowwise_equals_torch(dim):
    pytest.importorskip("cupy")
    from operators.backends import cupy_usable

    if not cupy_usable():
        pytest.skip("cupy sees no CUDA device")
    group = _group(("rowwise_adagrad", 0.1, (("eps", 1e-6), ("weight_decay", 0.01))), dim)
    batches, grads = _inputs(group)
    w_ref, s_ref, _, _ = _run("cuda", group, batches, grads, False)
    w_cp, s_cp, _, backend = _run("cuda", group, batches, grads, True)
    assert backend == "cupy"
    w_cpu, _, _, _ = _run("cpu", group, batches, grads, None)
    torch.testing.assert_close(w_cp, w_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(s_cp, s_ref, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(w_cp, w_cpu, rtol=1e-4, atol=1e-5)
