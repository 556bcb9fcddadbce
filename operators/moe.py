"""Multi-gate mixture of experts (MMoE, Ma et al. KDD 2018): E same-shape expert MLPs over one
input, and per head a softmax gate over the experts whose weighted sum is that head's output.

The experts run as one batched kernel (`PackedMLP`: PICASSO's packing of small dense kernels) when
the plan packs them (attr ``packed``), else one MLP each; both compute the same function.

Example:
    >>> moe = MMoE(6, experts=3, expert_layers=[8, 4], gate_layers=[], heads=["a", "b"])
    >>> moe(torch.randn(5, 6)).shape
    torch.Size([5, 2, 4])
"""
from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import nn

from operators.dense import MLP, PackedMLP, Shapes, flat_width


class Gate(nn.Module):
    """A head's gate: hidden layers, then a linear map to E expert weights (softmax).  x (B, In) -> (B, E)"""

    def __init__(self, in_features: int, hidden: Sequence[int], experts: int, activation: str):
        super().__init__()
        self.hidden = MLP(in_features, hidden, activation) if hidden else nn.Identity()
        self.out = nn.Linear(hidden[-1] if hidden else in_features, experts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.out(self.hidden(x)), dim=1)


class MMoE(nn.Module):
    """x (B, In) -> (B, H, D): per head h, sum_e gate_h(x)_e * expert_e(x).

    Args:
        in_features: input width.
        experts: E.
        expert_layers: layer widths of each expert (D = the last).
        gate_layers: hidden widths of each gate (empty: a linear gate).
        heads: output names, one gate each.
        activation: of the expert and gate layers.
        packed: run the experts as one batched kernel.
    """

    def __init__(self, in_features: int, experts: int, expert_layers: Sequence[int], gate_layers: Sequence[int],
                 heads: Sequence[str], activation: str = "relu", packed: bool = True):
        super().__init__()
        self.num_experts = experts
        self.packed = packed
        if packed:
            self.experts = PackedMLP(experts, in_features, expert_layers, activation)
        else:
            self.experts = nn.ModuleList(MLP(in_features, expert_layers, activation) for _ in range(experts))
        self.gates = nn.ModuleList(Gate(in_features, gate_layers, experts, activation) for _ in heads)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "MMoE":
        return cls(config.get("in_features") or flat_width(input_shapes), config["experts"],
                   config["expert_layers"], config.get("gate_layers", ()), config["heads"],
                   config.get("activation", "relu"), config.get("packed", False))

    def expert_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's output.  # (E, B, D)"""
        if self.packed:
            return self.experts(x.unsqueeze(0).expand(self.num_experts, *x.shape))
        return torch.stack([expert(x) for expert in self.experts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.expert_outputs(x)  # (E, B, D)
        mixed = [torch.einsum("be,ebd->bd", gate(x), experts) for gate in self.gates]  # H x (B, D)
        return torch.stack(mixed, dim=1)  # (B, H, D)
