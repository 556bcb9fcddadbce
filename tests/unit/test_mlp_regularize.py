"""mlp dropout, batch norm and layer norm against plain PyTorch (train and eval), packed and not.

References are `nn.Sequential` stacks of `nn.Linear`, `nn.BatchNorm1d` / `nn.LayerNorm` and ReLU
carrying the same weights; dropout masks are the documented hash of (seed, position), in numpy.
"""
from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from torch import nn

from operators import registry
from operators.dense import MLP, PackedMLP
from operators.regularize import GhostBatchNorm, SeededDropout

NORM_MODULES = {"batch": lambda w: nn.BatchNorm1d(w, dtype=torch.float64),
                "layer": lambda w: nn.LayerNorm(w, dtype=torch.float64)}


def skewed(*shape: int, seed: int) -> torch.Tensor:
    """Random inputs with a heavy tail (log-normal magnitudes, random signs)."""
    gen = torch.Generator().manual_seed(seed)
    mag = torch.exp(torch.randn(*shape, generator=gen, dtype=torch.float64) * 1.5)
    return mag * torch.sign(torch.randn(*shape, generator=gen, dtype=torch.float64)) + 0.3


def plain_reference(mlp: MLP, norm: str) -> nn.Sequential:
    """Linear -> norm -> ReLU per layer, with `mlp`'s weights and norm parameters."""
    parts: list[nn.Module] = []
    for layer, ours in zip(mlp.layers, mlp.norms):
        linear = nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None,
                           dtype=torch.float64)
        linear.load_state_dict(layer.state_dict())
        theirs = NORM_MODULES[norm](layer.out_features)
        theirs.load_state_dict(ours.state_dict())
        parts += [linear, theirs, nn.ReLU()]
    return nn.Sequential(*parts)


def perturb_norms(module: nn.Module, seed: int) -> None:
    """Non-trivial norm scales and shifts (their init is ones and zeros)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norms" in name:
                p.add_(torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.3)


@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_mlp_norm_equals_plain_pytorch_train_and_eval(norm):
    seed = random.randrange(1 << 30)
    mlp = registry.create("mlp", {"layers": [12, 5], "norm": norm}, [(7,)]).double()
    perturb_norms(mlp, seed)
    ref = plain_reference(mlp, norm)
    for step in range(3):  # running statistics move in training
        x = skewed(16, 7, seed=seed + step).requires_grad_(True)
        x_ref = x.detach().clone().requires_grad_(True)
        out, out_ref = mlp(x), ref(x_ref)
        torch.testing.assert_close(out, out_ref, msg=lambda m: f"seed {seed}: {m}")
        out.square().sum().backward()
        out_ref.square().sum().backward()
        torch.testing.assert_close(x.grad, x_ref.grad, msg=lambda m: f"seed {seed}: {m}")
    grads = [p.grad for layer, n in zip(mlp.layers, mlp.norms) for p in (*layer.parameters(), *n.parameters())]
    torch.testing.assert_close(grads, [p.grad for p in ref.parameters()])
    mlp.eval(), ref.eval()
    x = skewed(4, 7, seed=seed + 99)
    torch.testing.assert_close(mlp(x), ref(x))
    if norm == "batch":  # eval: running statistics, so one sample scores as it does in a batch
        torch.testing.assert_close(mlp(x[:1]), mlp(x)[:1])
        assert not torch.equal(mlp.norms[0].running_mean, torch.zeros(12, dtype=torch.float64))


def hash32(x: np.ndarray) -> np.ndarray:
    """The documented 32-bit multiply-xorshift hash, in numpy uint64."""
    for _ in range(2):
        x = (((x >> np.uint64(16)) ^ x) * np.uint64(0x45D9F3B)) & np.uint64(0xFFFFFFFF)
    return (x >> np.uint64(16)) ^ x


def documented_keep(seed: int, first_row: int, rows: int, width: int, p: float) -> torch.Tensor:
    """Keep mask of rows [first_row, first_row + rows) of `width` units: hash of (seed, position)."""
    pos = np.arange(first_row * width, (first_row + rows) * width, dtype=np.uint64)
    bits = hash32((hash32(pos) + np.uint64(seed)) & np.uint64(0xFFFFFFFF))
    return torch.from_numpy((bits >= np.uint64(int(p * 2 ** 32))).reshape(rows, width))


def test_dropout_mask_is_the_documented_hash_and_eval_is_identity():
    drop = SeededDropout(0.3)
    x = skewed(400, 9, seed=1)
    drop.reseed(11)
    a = drop(x)
    keep = documented_keep(11, 0, 400, 9, 0.3)
    torch.testing.assert_close(a, x * keep / 0.7)
    assert 0.65 < keep.double().mean() < 0.75
    drop.reseed(11)
    assert torch.equal(drop(x), a)
    drop.reseed(12)
    assert not torch.equal(drop(x), a)
    drop.eval()
    assert torch.equal(drop(x), x)


def test_dropout_over_micro_batches_draws_the_full_batch_mask():
    x = skewed(3, 20, 5, seed=2)  # packed layout (K, B, C)
    drop = SeededDropout(0.4, batch_dim=1)
    drop.reseed(5)
    full = drop(x)
    drop.reseed(5)
    parts = torch.cat([drop(x[:, :7]), drop(x[:, 7:8]), drop(x[:, 8:])], dim=1)
    assert torch.equal(parts, full)
    plain = SeededDropout(0.4)
    plain.reseed(5)
    flat = x.permute(1, 0, 2).reshape(20, 15)  # row r holds its K * C units in order
    assert torch.equal(plain(flat).reshape(20, 3, 5).permute(1, 0, 2), full)


def test_mlp_dropout_applies_after_the_activation():
    mlp = registry.create("mlp", {"layers": [6], "dropout": 0.5}, [(4,)]).double()
    x = skewed(30, 4, seed=3)
    mlp.drops[0].reseed(5)
    got = mlp(x)
    keep = documented_keep(5, 0, 30, 6, 0.5)
    torch.testing.assert_close(got, torch.relu(mlp.layers[0](x)) * keep / 0.5)
    mlp.eval()
    torch.testing.assert_close(mlp(x), torch.relu(mlp.layers[0](x)))


def test_no_bias_before_batch_norm():
    batch = registry.create("mlp", {"layers": [5, 3], "norm": "batch"}, [(4,)])
    layer = registry.create("mlp", {"layers": [5, 3], "norm": "layer"}, [(4,)])
    assert all(l.bias is None for l in batch.layers) and all(l.bias is not None for l in layer.layers)
    assert len(PackedMLP(2, 4, [5, 3], norm="batch").biases) == 0


@pytest.mark.parametrize("norm", ["batch", "layer"])
def test_packed_mlp_with_norm_equals_separate_mlps(norm):
    seed = random.randrange(1 << 30)
    torch.manual_seed(seed)
    mlps = [MLP(6, [5, 4], norm=norm).double() for _ in range(3)]
    for i, m in enumerate(mlps):
        perturb_norms(m, seed + i)
    packed = PackedMLP(3, 6, [5, 4], norm=norm).double()
    copy_into_packed(mlps, packed)
    for step in range(2):
        x = skewed(3, 10, 6, seed=seed + step).requires_grad_(True)
        xs = [x[k].detach().clone().requires_grad_(True) for k in range(3)]
        out = packed(x)
        ref = torch.stack([m(xk) for m, xk in zip(mlps, xs)])
        torch.testing.assert_close(out, ref, msg=lambda m: f"seed {seed}: {m}")
        out.square().sum().backward()
        ref.square().sum().backward()
        torch.testing.assert_close(x.grad, torch.stack([xk.grad for xk in xs]))
    packed.eval()
    for m in mlps:
        m.eval()
    x = skewed(3, 4, 6, seed=seed + 7)
    torch.testing.assert_close(packed(x), torch.stack([m(x[k]) for k, m in enumerate(mlps)]))


def copy_into_packed(mlps: list[MLP], packed: PackedMLP) -> None:
    """Stack the members' linear weights and norm parameters / statistics into `packed`."""
    with torch.no_grad():
        for i, w in enumerate(packed.weights):
            w.copy_(torch.stack([m.layers[i].weight.t() for m in mlps]))
            if packed.biases:
                packed.biases[i].copy_(torch.stack([m.layers[i].bias.unsqueeze(0) for m in mlps]))
            norm = packed.norms[i]
            inner = getattr(norm, "norm", None)
            if inner is None:  # layer norm: (K, 1, C) affines
                norm.weight.copy_(torch.stack([m.norms[i].weight.unsqueeze(0) for m in mlps]))
                norm.bias.copy_(torch.stack([m.norms[i].bias.unsqueeze(0) for m in mlps]))
                continue
            for key in ("weight", "bias", "running_mean", "running_var"):
                getattr(inner, key).copy_(torch.cat([getattr(m.norms[i], key) for m in mlps]))


def test_batch_norm_over_micro_batches_is_per_micro_batch():
    """What flowrec does under D-interleaving: each micro-batch by its own statistics, running
    statistics updated once per micro-batch (equal to running the halves through torch's)."""
    ours = GhostBatchNorm(5).double()
    ref = nn.BatchNorm1d(5, dtype=torch.float64)
    x = skewed(12, 5, seed=4)
    halves = [ours(x[:7]), ours(x[7:])]
    expected = [ref(x[:7]), ref(x[7:])]
    torch.testing.assert_close(torch.cat(halves), torch.cat(expected))
    torch.testing.assert_close(ours.running_mean, ref.running_mean)
    assert int(ours.num_batches_tracked) == 2
    full = nn.BatchNorm1d(5, dtype=torch.float64)
    assert not torch.allclose(torch.cat(halves), full(x)), "the full-batch statistic differs"


def test_one_sample_training_batch_uses_running_statistics():
    norm = GhostBatchNorm(3).double()
    norm(skewed(8, 3, seed=2))
    before = norm.running_mean.clone()
    x = skewed(1, 3, seed=5)
    got = norm(x)
    norm.eval()
    torch.testing.assert_close(got, norm(x))
    assert torch.equal(norm.running_mean, before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_dropouts_compiled_cpu_mask_is_bitwise_the_tensor_ops(dtype, monkeypatch):
    """On the CPU the mask comes from one compiled pass (`_dropout_keep`); it must give the very
    values and gradients of the hash as tensor ops, over calls that continue the row count, for
    both layouts, at large row counts too."""
    rng = np.random.default_rng()
    seed, p = int(rng.integers(0, 2 ** 32)), float(rng.uniform(0.05, 0.9))
    first = int(rng.integers(0, 2 ** 27))  # a late row: positions past 2**32
    shapes = [((37, 11), 0), ((5, 9, 4), 0), ((3, 23, 6), 1)]
    for shape, batch_dim in shapes:
        x = (torch.randn(*shape, dtype=torch.float64) * torch.logspace(-2, 2, shape[-1], dtype=torch.float64)).to(dtype)
        outs, grads = [], []
        for compiled in (True, False):
            drop = SeededDropout(p, batch_dim)
            drop.reseed(seed, first)
            if not compiled:
                monkeypatch.setattr(drop, "_keep_cpu", lambda t: None)
            got, got_grads = [], []
            for part in (x, x):  # the second call continues the row count
                leaf = part.detach().clone().requires_grad_(True)
                y = drop(leaf)
                (y.float() * torch.arange(y.numel(), dtype=torch.float32).view(y.shape)).sum().backward()
                got.append(y.detach())
                got_grads.append(leaf.grad)
            assert drop.rows == first + 2 * shape[batch_dim]
            outs.append(got)
            grads.append(got_grads)
        for a, b in zip(outs[0] + grads[0], outs[1] + grads[1]):
            assert torch.equal(a, b), (shape, batch_dim, dtype, seed, p, first)
        kept = (outs[0][0] != 0).double().mean().item()
        assert outs[0][0].shape == x.shape and not torch.equal(outs[0][0], outs[0][1])  # the rows move on
        assert abs(kept - (1 - p)) < 0.25, (kept, p)


def test_compiled_dropout_is_not_recompiled_for_every_steps_seed():
    """`flowrec train --compile` reseeds the dropout masks every step; the seed and the row count
    were constants of the compiled graph, so every step compiled the dense stage again until
    dynamo's recompile limit (8), then ran eager with a warning (esmm_multitask: 10 steps in 60 s).
    The mask is now drawn outside the compiled graph: compiled once, the eager model's values
    (the eager layers on torch's GEMMs, as the traced graph runs them: `onednn.torch_gemms`; on a
    CPU that is not Intel's they otherwise run oneDNN's, which sum in another order)."""
    from torch._dynamo.testing import CompileCounter

    from operators.onednn import torch_gemms

    torch._dynamo.reset()
    seed = random.randrange(1 << 30)
    mlp = MLP(6, [16, 8], dropout=0.3)
    counter = CompileCounter()
    compiled = torch.compile(mlp, backend=counter)
    first = 0
    for step in range(4):
        x = skewed(64, 6, seed=seed + step).float()
        for d in mlp.drops:
            d.reseed(seed + step)
        with torch_gemms():
            want = mlp(x)
        for d in mlp.drops:
            d.reseed(seed + step)
        got = compiled(x)
        assert torch.equal(got, want), f"seed {seed}, step {step}"
        assert float((got == 0).float().mean()) > 0.1  # dropout did drop
        first = counter.frame_count if step == 0 else first
    assert counter.frame_count == first, f"{counter.frame_count - first} more compilations after the first step"
    torch._dynamo.reset()
