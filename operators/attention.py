"""The `self_attention` operator: transformer encoder layers over a padded sequence (BST, SASRec).

seq (B, L, D), mask (B, L) bool -> (B, D). Learned positions (one (L, D) table, added to the
sequence) then `num_layers` encoder layers, each multi-head self-attention (torch's
`scaled_dot_product_attention`, so a GPU runs its fused kernels) and a feed-forward block
(Linear -> ReLU -> Linear), each with a residual and a LayerNorm:

- ``norm: post`` (default, as `torch.nn.TransformerEncoderLayer`): x = LN(x + block(x));
- ``norm: pre``: x = x + block(LN(x)).

Keys at padding positions are masked; with ``causal``, position i also sees only positions <= i.
A row with an empty sequence outputs zeros. ``output: last`` is the state at the last valid
position, ``mean`` the mean over the valid positions, ``target`` (BST) the state of a target
vector (the candidate item) that joins the sequence as one more position after its L positions
(position L of the table, never masked), so the sequence is read in the light of the candidate.
Dropout (hash-seeded, like the mlp's: no generator state) is applied where
`torch.nn.TransformerEncoderLayer` applies it to the attention output, after the feed-forward
activation and to the feed-forward output; attention probabilities are not dropped.

Example:
    >>> att = SelfAttention(4, length=3, num_heads=2)
    >>> att(torch.randn(2, 3, 4), torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)).shape
    torch.Size([2, 4])
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from operators.device_free import as_dtype, positions
from operators.regularize import SeededDropout

Shapes = Sequence[tuple[int, ...]]
NORMS = ("post", "pre")
OUTPUTS = ("last", "mean", "target")
LN_EPS = 1e-5  # torch.nn.TransformerEncoderLayer's layer_norm_eps


def _dropout(p: float) -> nn.Module:
    return SeededDropout(p) if p else nn.Identity()


class EncoderLayer(nn.Module):
    """One transformer encoder layer: x (B, L, D), attention mask (B, 1, L, L) -> (B, L, D).

    Args:
        dim: D.
        num_heads: attention heads (D must be a multiple).
        ffn: width of the feed-forward block.
        dropout: drop probability of the three dropout sites.
        pre_norm: LayerNorm before each block (else after each residual).
    """

    def __init__(self, dim: int, num_heads: int, ffn: int, dropout: float, pre_norm: bool):
        super().__init__()
        self.num_heads, self.pre_norm = num_heads, pre_norm
        self.qkv = nn.Linear(dim, 3 * dim)  # rows ordered q, k, v, as nn.MultiheadAttention's in_proj
        self.out = nn.Linear(dim, dim)
        self.ffn_in, self.ffn_out = nn.Linear(dim, ffn), nn.Linear(ffn, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=LN_EPS), nn.LayerNorm(dim, eps=LN_EPS)
        self.drop_attn, self.drop_ffn, self.drop_out = _dropout(dropout), _dropout(dropout), _dropout(dropout)

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        if self.pre_norm:
            x = x + self._attend(self.norm1(x), allowed)
            return x + self._feed_forward(self.norm2(x))
        x = self.norm1(x + self._attend(x, allowed))
        return self.norm2(x + self._feed_forward(x))

    def _attend(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, length, dim = x.shape
        heads = self.qkv(x).view(b, length, 3, self.num_heads, dim // self.num_heads)
        q, k, v = heads.permute(2, 0, 3, 1, 4).unbind(0)  # (B, H, L, D / H) each
        mixed = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)  # (B, H, L, D / H)
        return self.drop_attn(self.out(mixed.transpose(1, 2).reshape(b, length, dim)))

    def _feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop_out(self.ffn_out(self.drop_ffn(torch.relu(self.ffn_in(x)))))


class SelfAttention(nn.Module):
    """Transformer encoder over a padded sequence: seq (B, L, D), mask (B, L) bool [, target (B, D)]
    -> (B, D).

    Args:
        dim: D.
        length: positions of the learned position table (L, or L + 1 with output target).
        num_heads: attention heads.
        num_layers: encoder layers.
        ffn: feed-forward width (default 4 D).
        dropout: drop probability (0: none).
        norm: ``post`` or ``pre`` (LayerNorm placement).
        causal: position i attends only to positions <= i.
        positional: ``learned`` (an (L, D) table added to the sequence) or ``none``.
        output: ``last`` (the last valid position), ``mean`` (over the valid positions) or ``target``
            (the target's position, appended after the sequence).
    """

    def __init__(self, dim: int, length: int, num_heads: int = 1, num_layers: int = 1, ffn: int | None = None,
                 dropout: float = 0.0, norm: str = "post", causal: bool = False, positional: str = "learned",
                 output: str = "last"):
        super().__init__()
        self.causal, self.output = causal, output
        self.positions = nn.Parameter(torch.randn(length, dim) * 0.02) if positional == "learned" else None
        self.layers = nn.ModuleList(EncoderLayer(dim, num_heads, ffn or 4 * dim, dropout, norm == "pre")
                                    for _ in range(num_layers))

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "SelfAttention":
        length, dim = (int(d) for d in input_shapes[0][-2:])
        length += 1 if config.get("output") == "target" else 0  # the target's position
        return cls(dim, length, config.get("num_heads", 1), config.get("num_layers", 1), config.get("ffn"),
                   config.get("dropout", 0.0), config.get("norm", "post"), config.get("causal", False),
                   config.get("positional", "learned"), config.get("output", "last"))

    def forward(self, seq: torch.Tensor, mask: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        if self.output == "target":
            if target is None:
                raise ValueError("self_attention output target: the forward needs the target vector")
            target = as_dtype(target.reshape(seq.shape[0], 1, seq.shape[2]), seq.dtype)  # (B, 1, D)
            seq = torch.cat([seq, target], dim=1)  # (B, L+1, D)
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)  # (B, L+1)
        x = seq if self.positions is None else seq + self.positions
        allowed = self._allowed(mask)
        for layer in self.layers:
            x = layer(x, allowed)
        return x[:, -1] if self.output == "target" else self._pool(x, mask)

    def _allowed(self, mask: torch.Tensor) -> torch.Tensor:
        """Which keys each query may attend to.  # (B, 1, L, L) bool

        A row with no valid position at all may attend to its first position (padding), so no
        softmax row is all masked; its output is zeroed by `_pool`. Any other row attends to its
        valid positions only (with `output: target` the target is one, so an empty history
        leaves the target attending to itself alone).
        """
        length = mask.shape[1]
        position = positions(mask, length)  # (L,)
        keys = mask | ((position == 0) & ~mask.any(dim=1, keepdim=True))  # (B, L)
        allowed = keys[:, None, None, :].expand(-1, 1, length, -1)
        if self.causal:
            allowed = allowed & (position[None, :] <= position[:, None])  # key <= query
        return allowed

    def _pool(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """The last valid position's state, or the mean over valid positions; zeros when empty.  # (B, D)"""
        valid = as_dtype(mask, x.dtype)  # (B, L)
        count = valid.sum(dim=1, keepdim=True)  # (B, 1)
        if self.output == "mean":
            return (x * valid.unsqueeze(2)).sum(dim=1) / count.clamp(min=1.0)
        last = (as_dtype(count, torch.int64) - 1).clamp(min=0)  # (B, 1)
        picked = x.gather(1, last.unsqueeze(2).expand(-1, 1, x.shape[2])).squeeze(1)  # (B, D)
        return picked * as_dtype(count > 0, x.dtype)
