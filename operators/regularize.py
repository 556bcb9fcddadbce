"""Per-layer regularisers of MLPs: seeded dropout, batch norm and layer norm (plain and packed).

Order inside one MLP layer: linear -> norm -> activation -> dropout. Train/eval behaviour follows
`nn.Module.train()`: in eval mode dropout is the identity and batch norm uses its running
statistics, so scoring and export are deterministic.

Dropout masks are a hash of (seed, position) with the seed set by the training step (`reseed`,
from the training seed and the step count, which the model state carries): a resumed run draws the
same masks as an uninterrupted one, and micro-batches draw the full batch's mask.

Batch norm over micro-batches (D-interleaving) normalises each micro-batch by its own statistics
and updates the running statistics once per micro-batch ("ghost" batch norm): the maths of a
full-batch statistic cannot be split. A training micro-batch of one sample has no variance: it is
normalised by the running statistics, which it leaves unchanged.

Example:
    >>> norm = make_norm("layer", 4)
    >>> norm(torch.randn(3, 4)).shape
    torch.Size([3, 4])
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch
from numba import njit
from torch import nn
from torch.nn import functional as F

NORMS = ("none", "batch", "layer")  # the `norm` values of an mlp (schema enum)
BN_MOMENTUM = 0.1  # running-statistics momentum (torch's default)
NORM_EPS = 1e-5  # variance epsilon of batch and layer norm (torch's default)
MASK32 = 0xFFFFFFFF  # dropout hashes work on 32-bit values held in int64
HASH_MUL = 0x45D9F3B  # multiplier of the 32-bit multiply-xorshift hash (fits int64 products)


class SeededDropout(nn.Module):
    """Inverted dropout whose mask is a hash of (seed, position): keeps each value with 1 - p,
    scaled by 1 / (1 - p).

    The value at unit c (of C per row) of the r-th row drawn since the last `reseed` is kept iff
    ``hash32((hash32(r * C + c) + seed) mod 2**32) >= p * 2**32`` (`hash32`: two multiply-xorshift
    rounds). No generator state: the same on every device, and successive calls continue the row
    count, so micro-batches of a step (in order) draw exactly the full batch's mask.

    Args:
        p: drop probability, 0 <= p < 1.
        batch_dim: the batch axis of the inputs (1 for packed (K, B, C) inputs).

    Example:
        >>> d = SeededDropout(0.5); d.reseed(7)
        >>> a = d(torch.ones(2, 3)); d.reseed(7); torch.equal(a, d(torch.ones(2, 3)))
        True
    """

    def __init__(self, p: float, batch_dim: int = 0):
        super().__init__()
        self.p, self.batch_dim = float(p), batch_dim
        self.seed = 0
        self.rows = 0  # rows drawn since the last reseed
        if SeededDropout._keep is SeededDropout._keep_mask:  # the first dropout made: `_keep` outside compiled
            # code from now on; not at import, where `torch.compiler.disable` imported torch._dynamo (3-6 s on
            # the 2-core VM) into every command that loads a model (eval, export, --resume), dropout or none
            SeededDropout._keep = torch.compiler.disable(SeededDropout._keep_mask)

    def reseed(self, seed: int, first_row: int = 0) -> None:
        """Start the mask stream of `seed` at `first_row` (a rank's first row of the global batch)."""
        self.seed, self.rows = int(seed) & MASK32, int(first_row)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        return x * self._keep(x) / (1.0 - self.p)

    def _keep_mask(self, x: torch.Tensor) -> torch.Tensor:
        """The mask of x (1 kept, 0 dropped, in x's dtype, x's shape), drawn outside compiled code
        (`_keep`, wrapped by `torch.compiler.disable` when the first dropout is made): compiled, the
        seed and the row count, which change every step, were constants of the graph
        (`flowrec train --compile` compiled the dense stage again each step until dynamo's limit)."""
        keep = self._keep_cpu(x)
        if keep is None:  # elsewhere (a GPU): the hash as tensor ops
            keep = (hash32((hash32(self._positions(x)) + self.seed) & MASK32) >= self._threshold()).to(x.dtype)
        return keep

    _keep = _keep_mask

    def _threshold(self) -> int:
        """A value is kept where its 32-bit hash is at least this."""
        return int(self.p * (1 << 32))

    def _draw_rows(self, x: torch.Tensor) -> tuple[int, int, int]:
        """(first row, rows, units per row) of `x`, its rows counted as drawn."""
        rows = x.shape[self.batch_dim]
        first, self.rows = self.rows, self.rows + rows
        return first, rows, x.numel() // max(rows, 1)

    def _keep_cpu(self, x: torch.Tensor) -> torch.Tensor | None:
        """The mask (1 kept, 0 dropped, in x's dtype, x's shape) by one compiled pass on the CPU, the
        same bits as the tensor ops of `hash32` (those are 15 full passes of int64 tensors: 3.4 ms of
        a 12.4 ms esmm_multitask step at batch 1,024 on the 2-core VM); None where it does not apply
        (not the CPU, under `torch.compile`, a layout other than a leading batch axis or (K, B, C))."""
        if (x.device.type != "cpu" or torch.compiler.is_compiling() or x.dim() < 1
                or not (self.batch_dim == 0 or (self.batch_dim == 1 and x.dim() == 3))):
            return None
        first, rows, width = self._draw_rows(x)
        mask = torch.from_numpy(_dropout_keep(first, rows, width, self.seed, self._threshold()))
        if self.batch_dim == 0:
            return mask.view(x.shape).to(x.dtype)
        k, _, c = x.shape  # (K, B, C): a row's units are (k, c), k * C + c
        return mask.view(rows, k, c).permute(1, 0, 2).to(x.dtype)

    def _positions(self, x: torch.Tensor) -> torch.Tensor:
        """Position of every value: (row drawn since reseed) * units per row + unit.  # x.shape"""
        first, rows, width = self._draw_rows(x)
        per_row = list(x.shape)
        per_row[self.batch_dim] = 1
        unit = torch.arange(width, device=x.device).view(per_row)
        along = [1] * x.dim()
        along[self.batch_dim] = rows
        row = torch.arange(first, first + rows, device=x.device).view(along)
        return row * width + unit


def hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash of int64 values in [0, 2**32) (multiply-xorshift, two rounds); the
    same code hashes one int64 in `_dropout_keep` (`_hash32_scalar`, compiled from it)."""
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    x = (((x >> 16) ^ x) * HASH_MUL) & MASK32
    return (x >> 16) ^ x


_hash32_scalar = njit(cache=True, nogil=True)(hash32)


@njit(cache=True, nogil=True)
def _dropout_keep(first_row, rows, width, seed, threshold):
    """(rows, width) float32 mask of `SeededDropout`: 1 where hash32((hash32(position) + seed) mod
    2**32) >= threshold, position = (first_row + row) * width + unit, in int64 as `hash32` computes."""
    out = np.empty((rows, width), np.float32)
    for r in range(rows):
        base = (first_row + r) * width
        for u in range(width):
            bits = _hash32_scalar((_hash32_scalar(np.int64(base + u)) + seed) & MASK32)
            out[r, u] = 1.0 if bits >= threshold else 0.0
    return out


class GhostBatchNorm(nn.BatchNorm1d):
    """`nn.BatchNorm1d` over (B, C) with three differences.

    Outside training, and for a one-sample training batch (no variance), it is the affine map of
    the running statistics, written out so that `torch.export` traces it with no guard on the
    batch size. With `reduce` set (a differentiable sum over the ranks of a distributed run), the
    statistics are those of the ranks' slices together, i.e. of the global batch.
    """

    reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training:
            return self._frozen(x)
        if self.reduce is not None:
            return self._synced(x)
        return super().forward(x) if x.shape[0] > 1 else self._frozen(x)

    def _frozen(self, x: torch.Tensor) -> torch.Tensor:
        scale = self.weight * torch.rsqrt(self.running_var + self.eps)  # (C,)
        return x * scale + (self.bias - self.running_mean * scale)

    def _synced(self, x: torch.Tensor) -> torch.Tensor:
        """Batch norm by the statistics of every rank's rows (sums and count all-reduced)."""
        c = x.shape[1]
        count = x.new_full((1,), float(x.shape[0]))
        sums = self.reduce(torch.cat([x.sum(0), (x * x).sum(0), count]))  # (2C + 1,)
        n = float(sums[-1].detach())
        if n < 2:
            return self._frozen(x)
        mean = sums[:c] / n
        var = (sums[c:2 * c] / n - mean * mean).clamp_min(0.0)  # biased, as torch normalises
        with torch.no_grad():
            m = self.momentum
            self.running_mean.mul_(1 - m).add_(mean.detach(), alpha=m)
            self.running_var.mul_(1 - m).add_(var.detach() * (n / (n - 1)), alpha=m)
            self.num_batches_tracked.add_(1)
        return (x - mean) * torch.rsqrt(var + self.eps) * self.weight + self.bias


class PackedLayerNorm(nn.Module):
    """Layer norm of K members at once: x (K, B, C) normalised over C, member-wise affine.

    Example:
        >>> PackedLayerNorm(2, 4)(torch.randn(2, 3, 4)).shape
        torch.Size([2, 3, 4])
    """

    def __init__(self, num: int, width: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num, 1, width))  # (K, 1, C)
        self.bias = nn.Parameter(torch.zeros(num, 1, width))  # (K, 1, C)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, x.shape[-1:], eps=NORM_EPS) * self.weight + self.bias


class PackedBatchNorm(nn.Module):
    """Batch norm of K members at once: x (K, B, C) is a (B, K * C) batch norm, one channel per
    member and unit, so its statistics are exactly each member's own.

    Example:
        >>> PackedBatchNorm(2, 4)(torch.randn(2, 3, 4)).shape
        torch.Size([2, 3, 4])
    """

    def __init__(self, num: int, width: int):
        super().__init__()
        self.num, self.width = num, width
        self.norm = GhostBatchNorm(num * width, eps=NORM_EPS, momentum=BN_MOMENTUM)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k, b, c = x.shape
        if self.norm.training and b > 1:
            flat = x.permute(1, 0, 2).reshape(b, k * c)  # (B, K * C)
            return self.norm(flat).reshape(b, k, c).permute(1, 0, 2)  # (K, B, C)
        return self._frozen(x)

    def _frozen(self, x: torch.Tensor) -> torch.Tensor:
        """The affine map of the running statistics, per member (no reshape of the batch)."""
        norm = self.norm
        scale = norm.weight * torch.rsqrt(norm.running_var + norm.eps)  # (K * C,)
        shift = norm.bias - norm.running_mean * scale
        return x * scale.view(self.num, 1, self.width) + shift.view(self.num, 1, self.width)


def make_norm(norm: str, width: int) -> nn.Module:
    """The norm layer of one MLP layer of `width` units (`norm`: none, batch or layer)."""
    builders = {"none": lambda: nn.Identity(),
                "batch": lambda: GhostBatchNorm(width, eps=NORM_EPS, momentum=BN_MOMENTUM),
                "layer": lambda: nn.LayerNorm(width, eps=NORM_EPS)}
    return _pick(builders, norm)()


def make_packed_norm(norm: str, num: int, width: int) -> nn.Module:
    """The norm layer of one packed MLP layer: K members of `width` units."""
    builders = {"none": lambda: nn.Identity(),
                "batch": lambda: PackedBatchNorm(num, width),
                "layer": lambda: PackedLayerNorm(num, width)}
    return _pick(builders, norm)()


def _pick(builders: dict, norm: str):
    if norm not in builders:
        raise KeyError(f"unknown norm {norm!r}; known: {', '.join(NORMS)}")
    return builders[norm]
