"""Feature-interaction operators: dot (DLRM), fm (second-order FM), target_attention (DIN).

Example:
    >>> Dot()(torch.randn(2, 4, 8)).shape  # 4 fields -> 6 pairs
    torch.Size([2, 6])
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from operators.dense import MLP, Shapes, flat_rows
from operators.device_free import as_dtype, positions
from operators.lowp import emulating_autocast, matmul


def as_fields(inputs: Sequence[torch.Tensor], flat: Sequence[int] = ()) -> torch.Tensor:
    """Stack inputs (B, D) or (B, F, D) into fields (B, sum F, D); the inputs at the positions in
    `flat` (a module's whole output of named outputs, (B, H, D)) are one field each, flattened."""
    parts = [flat_rows(x).unsqueeze(1) if i in flat or x.dim() == 2 else x for i, x in enumerate(inputs)]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)


class Dot(nn.Module):
    """DLRM pairwise dot products: fields (B, F, D) -> strict upper triangle (B, F (F - 1) / 2).

    Inputs (B, D) count as one field each and are concatenated with (B, F, D) inputs in order.

    Example:
        >>> Dot()(torch.randn(3, 16), torch.randn(3, 26, 16)).shape
        torch.Size([3, 351])
    """

    def __init__(self, flat_ports: Sequence[int] = ()) -> None:
        super().__init__()
        self.flat_ports = tuple(flat_ports)  # inputs that are one field each, flattened (`as_fields`)
        self._pairs: dict[tuple[int, torch.device], torch.Tensor] = {}

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "Dot":
        return cls(config.get("flat_ports", ()))

    def pairs(self, num: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """Flat positions of the strict upper triangle (row * F + col), and for every position
        of the F x F matrix the pair it mirrors (row < col: its own pair, row > col: the pair
        (col, row), the diagonal: P, a zero column).  # (P,), (F * F,) with P = F (F - 1) / 2"""
        key = (num, device)
        if key not in self._pairs:
            rows, cols = torch.triu_indices(num, num, offset=1, device=device)
            upper = rows * num + cols
            mirror = torch.full((num * num,), upper.numel(), dtype=torch.int64, device=device)
            pair = torch.arange(upper.numel(), device=device)
            mirror[upper] = pair
            mirror[cols * num + rows] = pair
            self._pairs[key] = (upper, mirror)
        return self._pairs[key]

    def pairs_of(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`pairs` of the fields of `x` (B, F, D), on its device; while exporting, computed from `x`
        itself (`traced_pairs`), not cached: an exported `triu_indices` holds the traced device."""
        return traced_pairs(x, x.shape[1]) if torch.compiler.is_exporting() else self.pairs(x.shape[1], x.device)

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        if inputs[0].device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            dtype = torch.get_autocast_dtype("cpu")
            x = as_fields([t.to(dtype) for t in inputs], self.flat_ports)  # (B, F, D): cast per input, one cat
            upper, mirror = self.pairs_of(x)
            if emulating_autocast(x.device):  # no bf16 kernels: the fp32 dots of the bf16 values, rounded once
                with torch.autocast("cpu", enabled=False):
                    return _TriuDot.apply(x.float(), upper, mirror).to(torch.bfloat16)
            return _RowsDot.apply(x) if x.shape[1] > 1 else _TriuDot.apply(x, upper, mirror)
        x = as_fields(inputs, self.flat_ports)  # (B, F, D)
        upper, mirror = self.pairs_of(x)
        return _TriuDot.apply(x, upper, mirror)  # (B, F (F - 1) / 2)


def traced_pairs(like: torch.Tensor, num: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`Dot.pairs(num, like.device)`, the same values, made from `like` (no device of its own in
    an exported program): the strict upper triangle's flat positions sorted first, in row-major
    order as `triu_indices` gives them.  # (P,), (F * F,)

    >>> upper, mirror = traced_pairs(torch.zeros(1), 3)
    >>> upper.tolist(), mirror.tolist()
    ([1, 2, 5], [3, 0, 1, 0, 3, 2, 1, 2, 3])
    """
    count = num * (num - 1) // 2  # P
    flat = positions(like, num * num)  # (F * F,) row * F + col
    upper = torch.where(flat // num < flat % num, flat, flat + num * num).sort().values[:count]  # (P,)
    pair = positions(like, count)  # (P,)
    mirror = flat.new_full((num * num,), count).index_put((upper,), pair)
    return upper, mirror.index_put(((upper % num) * num + upper // num,), pair)


class _RowsDot(torch.autograd.Function):
    """The dots under CPU autocast, in autocast's dtype: the values of autocast's own
    `bmm(x, x^T)` then the upper-triangle gather (bitwise), faster.

    On the CPU, torch's column gather (`index_select` along dim 1) has no vectorized bf16 path
    (8.6 ms per DLRM step in bf16), and an fp32 gram goes through MKL's batched sgemm, which takes
    a slow path on AMD CPUs (4096 x 27 x 16: 2.4 ms fp32, 0.7 ms bf16 by oneDNN; one thread). So
    the gram is one bf16 `bmm`, and the strict upper triangle is read as its F - 1 row tails, one
    `cat` of contiguous runs (0.4 ms, against 2.2 ms for the bf16 gather). The backward writes the
    symmetric pair-gradient matrix G + G^T the same way: each row tail of the pair gradients twice
    (row i right of the diagonal, column i below it), zeros on the diagonal, in autocast's dtype
    (the values of the fp32 column gather it replaces, bitwise: copies of the same bf16 values;
    0.7-1.8 ms a bf16 DLRM step less in five A/Bs of 60 steps each, Round 41), then one bf16
    `bmm` (G + G^T) x, rounded once where autograd of the plain ops rounds G x and G^T x, then
    their sum.
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        num = x.shape[1]
        with torch.autocast("cpu", enabled=False):
            gram = matmul(torch.bmm, x, x.transpose(1, 2))  # (B, F, F)
            return torch.cat([gram[:, i, i + 1:] for i in range(num - 1)], dim=1)  # (B, P)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        (x,) = ctx.saved_tensors
        batch, num = x.shape[0], x.shape[1]
        with torch.autocast("cpu", enabled=False):
            pairs = grad.to(x.dtype)  # (B, P): row 0's tail, row 1's, ... (the forward's order)
            sym = x.new_empty(batch, num, num)
            sym.diagonal(dim1=1, dim2=2).zero_()
            start = 0
            for i in range(num - 1):
                tail = pairs[:, start:start + num - 1 - i]  # pairs (i, j) for j > i
                sym[:, i, i + 1:] = tail
                sym[:, i + 1:, i] = tail
                start += num - 1 - i
            return matmul(torch.bmm, sym, x)  # (B, F, D)


class _TriuDot(torch.autograd.Function):
    """Upper-triangle pairwise dots with a direct backward.

    Forward: gram = x x^T, then one column gather of the flattened gram. Backward: since
    gram = x x^T, dx = (G + G^T) x where G holds the pair gradients in the upper triangle; the
    symmetric G + G^T is gathered directly (every position takes its pair's gradient, the
    diagonal a zero: one gather, no zero fill and no scatter), then one bmm, in the input's dtype
    (also under autocast).
    """

    @staticmethod
    def forward(ctx, x: torch.Tensor, upper: torch.Tensor, mirror: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, mirror)
        gram = matmul(torch.bmm, x, x.transpose(1, 2))  # (B, F, F)
        return gram.reshape(x.shape[0], x.shape[1] * x.shape[1]).index_select(1, upper)  # (B, P)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        x, mirror = ctx.saved_tensors
        batch, num = x.shape[0], x.shape[1]
        grad = grad.to(x.dtype)
        padded = torch.cat([grad, grad.new_zeros(batch, 1)], dim=1)  # (B, P + 1): column P is the diagonal's 0
        sym = padded.index_select(1, mirror)  # (B, F * F)
        return matmul(torch.bmm, sym.view(batch, num, num), x), None, None  # (B, F, D)


class FM(nn.Module):
    """Second-order factorization-machine term: fields (B, F, D) -> (B, 1).

    0.5 * sum_d ((sum_f v_fd)^2 - sum_f v_fd^2) = sum over field pairs of <v_i, v_j>.

    Example:
        >>> FM()(torch.randn(2, 5, 4)).shape
        torch.Size([2, 1])
    """

    def __init__(self, flat_ports: Sequence[int] = ()) -> None:
        super().__init__()
        self.flat_ports = tuple(flat_ports)  # inputs that are one field each, flattened (`as_fields`)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "FM":
        return cls(config.get("flat_ports", ()))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        x = as_fields(inputs, self.flat_ports)  # (B, F, D)
        square_of_sum = x.sum(dim=1).square()  # (B, D)
        sum_of_square = x.square().sum(dim=1)  # (B, D)
        return 0.5 * (square_of_sum - sum_of_square).sum(dim=1, keepdim=True)  # (B, 1)


class TargetAttention(nn.Module):
    """DIN target attention: query (B, D), seq (B, L, D), mask (B, L) bool -> (B, D).

    The activation unit scores each position with an MLP over [q, k, q - k, q * k] (hidden
    layers, then one linear output); the result is sum_l mask_l * score_l * k_l (no softmax, as
    in DIN), so masked positions contribute nothing and an all-masked row gives zeros.

    Args:
        dim: D.
        hidden: hidden widths of the activation unit (default [80, 40]).
        activation: activation of the hidden layers (default sigmoid, as in DIN's reference).

    Example:
        >>> att = TargetAttention(4)
        >>> att(torch.randn(2, 4), torch.randn(2, 3, 4), torch.ones(2, 3, dtype=torch.bool)).shape
        torch.Size([2, 4])
    """

    def __init__(self, dim: int, hidden: Sequence[int] = (80, 40), activation: str = "sigmoid"):
        super().__init__()
        self.unit = MLP(4 * dim, list(hidden), activation)
        self.score = nn.Linear(hidden[-1] if hidden else 4 * dim, 1)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "TargetAttention":
        dim = config.get("dim") or int(input_shapes[0][-1])
        return cls(dim, config.get("hidden", (80, 40)), config.get("activation", "sigmoid"))

    def forward(self, query: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        q = query.unsqueeze(1).expand_as(seq)  # (B, L, D)
        feats = torch.cat([q, seq, q - seq, q * seq], dim=-1)  # (B, L, 4D)
        scores = self.score(self.unit(feats)).squeeze(-1)  # (B, L)
        scores = scores.masked_fill(~mask, 0.0)
        return torch.bmm(as_dtype(scores.unsqueeze(1), seq.dtype), seq).squeeze(1)  # (B, D)
