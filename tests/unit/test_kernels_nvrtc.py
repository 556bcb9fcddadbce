"""CUDA kernels checked without a GPU: NVRTC compiles every RawKernel source for sm_80 and sm_90,
every launch configuration the code can produce meets the kernel's assumptions, and a NumPy twin
of each kernel's index arithmetic equals the torch reference on skewed inputs."""
from __future__ import annotations

import ast
from pathlib import Path

import numpy as np
import pytest
import torch

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators import cupy_kernels
from operators.casting import casted_row_grads, compute_casting
from operators.cupy_kernels import (CASTED_ROWWISE_ADAGRAD, KERNELS, MAX_DIM, check_launch, rowwise_launch,
                                    rowwise_twin, supports)
from operators.device import KernelSource, LaunchConfig
from operators.embedding import mean_bag_flags
from operators.nvrtc import ARCHS, compile_kernel, nvrtc_module
from operators.sparse_optim import make_optimizer
from operators.random_batches import random_batch

OPERATORS = Path(__file__).resolve().parents[2] / "operators"


def _nvrtc():
    module, note = nvrtc_module()
    if module is None:
        pytest.skip(note)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_every_kernel_compiles_with_nvrtc(kernel, arch):
    _nvrtc()
    result = compile_kernel(kernel, arch)
    assert result.ok, f"{kernel.name} for sm_{arch}:\n{result.log}"
    assert result.ptx_bytes > 100 and result.cubin_bytes > 100
    assert bytes([32]).hex() == "20"  # NVRTC wrote into no interned 1-byte bytes object


def test_compile_errors_name_the_line():
    _nvrtc()
    broken = KernelSource("broken", "f", 'extern "C" __global__ void f(float* x)\n{\n    x[0] = y;\n}\n')
    result = compile_kernel(broken, "80")
    assert not result.ok
    assert "broken.cu(3)" in result.log and "identifier \"y\" is undefined" in result.log


def _kernel_sources_in(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    return [kw.value.value for node in ast.walk(tree) if isinstance(node, ast.Call)
            and getattr(node.func, "id", "") == "KernelSource"
            for kw in node.keywords if kw.arg == "name" and isinstance(kw.value, ast.Constant)]


def test_every_kernel_source_in_operators_is_compiled():
    declared = [name for path in sorted(OPERATORS.glob("*.py")) for name in _kernel_sources_in(path)]
    assert sorted(declared) == sorted(k.name for k in KERNELS)
    for path in OPERATORS.glob("*.py"):
        if path.name != "device.py":
            raw = [node.lineno for node in ast.walk(ast.parse(path.read_text()))
                   if isinstance(node, ast.Attribute) and node.attr in ("RawKernel", "RawModule")]
            assert raw == [], f"{path.name} builds a kernel outside KERNELS at lines {raw}"


@pytest.mark.parametrize("num_unique", [0, 1, 4097, 2**24])
def test_every_launch_meets_the_kernel_assumptions(num_unique):
    for dim in range(1, MAX_DIM + 1):
        config = rowwise_launch(num_unique, dim)
        assert check_launch(CASTED_ROWWISE_ADAGRAD, config, dim) == [], (num_unique, dim, config)
        assert config.block < 2 * max(dim, 32)  # the smallest power of two that covers the row


def test_check_launch_rejects_broken_launches():
    k = CASTED_ROWWISE_ADAGRAD
    assert "not a power of two" in " ".join(check_launch(k, LaunchConfig(3, 96, 384), 90))
    assert "fewer threads" in " ".join(check_launch(k, LaunchConfig(3, 64, 256), 65))
    assert "exceeds" in " ".join(check_launch(k, LaunchConfig(3, 2048, 8192), 2000))
    assert "shared memory 65536 B exceeds" in " ".join(check_launch(k, LaunchConfig(3, 64, 65536), 64))
    assert "fewer than 64 floats" in " ".join(check_launch(k, LaunchConfig(3, 64, 128), 64))


def test_supports_only_dims_the_launch_covers():
    opt = make_optimizer(("rowwise_adagrad", 0.1, ()))
    assert supports(opt, torch.zeros(2, MAX_DIM), torch.zeros(1, MAX_DIM))
    assert not supports(opt, torch.zeros(2, MAX_DIM + 1), torch.zeros(1, MAX_DIM + 1))
    assert not supports(make_optimizer(("adagrad", 0.1, ())), torch.zeros(2, 8), torch.zeros(1, 8))


def _group(dim: int) -> PackedGroup:
    tables = (TableSlot("a", 300, 0), TableSlot("one", 1, 300), TableSlot("b", 40, 301))
    fields = (GroupField("fa", "a", 1, "sum"), GroupField("fone", "one", 2, "mean"),
              GroupField("fb", "b", 6, "mean"), GroupField("fseq", "a", 4, "none"))
    return PackedGroup("g", dim, "fp32", ("rowwise_adagrad", 0.1, ()), tables, fields)


def _case(dim: int, batch_size: int = 24):
    gen = torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))
    group = _group(dim)
    batch = random_batch(group, batch_size, gen, alpha=1.3, empty_prob=0.4)
    casting = compute_casting(batch.ids, batch.offsets, mean_bag_flags(group))
    weight = torch.randn(group.rows, dim, generator=gen)
    state = torch.rand(group.rows, 1, generator=gen)
    grad = torch.randn(casting.num_bags, dim, generator=gen)
    return weight, state, grad, casting


def _reference(weight, state, grad, casting, lr, eps, decay):
    w, s = weight.clone(), state.clone()
    opt = make_optimizer(("rowwise_adagrad", lr, (("eps", eps), ("weight_decay", decay))))
    opt.step(w, s, casting.unique_ids, casted_row_grads(grad, casting))
    return w, s


def _twin(weight, state, grad, casting, lr, eps, decay, config):
    w, s = weight.numpy().copy(), state.numpy().copy()
    rowwise_twin(w, s, lr, eps, decay, grad.numpy(), casting, config)
    return torch.from_numpy(w), torch.from_numpy(s)


@pytest.mark.parametrize("dim", [1, 7, 32, 33, 200, MAX_DIM])
@pytest.mark.parametrize("decay", [0.0, 0.01])
def test_twin_equals_reference_on_skewed_batches(dim, decay):
    weight, state, grad, casting = _case(dim)
    assert int(casting.counts.max()) > 1  # repeated ids
    assert torch.unique(casting.sorted_bags).numel() < casting.num_bags  # some bags are empty
    config = rowwise_launch(casting.unique_ids.numel(), dim)
    got_w, got_s = _twin(weight, state, grad, casting, 0.05, 1e-6, decay, config)
    want_w, want_s = _reference(weight, state, grad, casting, 0.05, 1e-6, decay)
    torch.testing.assert_close(got_s, want_s, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(got_w, want_w, rtol=2e-5, atol=1e-6)
    untouched = torch.ones(weight.shape[0], dtype=torch.bool)
    untouched[casting.unique_ids] = False
    assert torch.equal(got_w[untouched], weight[untouched])


def test_twin_of_an_empty_batch_changes_nothing():
    weight, state, grad, _ = _case(8)
    empty = compute_casting(torch.zeros(0, dtype=torch.int64), torch.zeros(5, dtype=torch.int64))
    w, s = _twin(weight, state, grad[:4], empty, 0.05, 1e-6, 0.0, rowwise_launch(0, 8))
    assert torch.equal(w, weight) and torch.equal(s, state)


def test_twin_shows_what_a_non_power_of_two_block_breaks():
    weight, state, grad, casting = _case(40)
    bad = LaunchConfig(casting.unique_ids.numel(), 48, 48 * 4)
    assert check_launch(CASTED_ROWWISE_ADAGRAD, bad, 40)
    _, got_s = _twin(weight, state, grad, casting, 0.05, 1e-6, 0.0, bad)
    _, want_s = _reference(weight, state, grad, casting, 0.05, 1e-6, 0.0)
    assert not torch.allclose(got_s, want_s, rtol=1e-4)


def test_launch_goes_through_the_device_runtime(monkeypatch):
    weight, state, grad, casting = _case(16)
    seen = []
    monkeypatch.setattr(cupy_kernels, "runtime_for", lambda device: _Recorder(seen))
    opt = make_optimizer(("rowwise_adagrad", 0.1, (("eps", 1e-6),)))
    cupy_kernels.fused_rowwise_update(weight, state, opt, grad, casting)
    (kernel, config, args), = seen
    assert kernel is CASTED_ROWWISE_ADAGRAD and config == rowwise_launch(casting.unique_ids.numel(), 16)
    assert args[5] is weight and args[6] is state and int(args[7]) == 16 and args[7].dtype == np.int32
    assert int(args[8]) == 1  # mean bags give a scale


class _Recorder:
    def __init__(self, seen):
        self.seen = seen

    def launch(self, kernel, config, args):
        self.seen.append((kernel, config, args))
