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
        self.experts = _experts(experts, in_features, expert_layers, activation, packed)
        self.gates = nn.ModuleList(Gate(in_features, gate_layers, experts, activation) for _ in heads)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "MMoE":
        return cls(config.get("in_features") or flat_width(input_shapes), config["experts"],
                   config["expert_layers"], config.get("gate_layers", ()), config["heads"],
                   config.get("activation", "relu"), config.get("packed", False))

    def expert_outputs(self, x: torch.Tensor) -> torch.Tensor:
        """Every expert's output.  # (E, B, D)"""
        return self.experts(torch.stack([x] * self.num_experts))  # a stack, not an expand: it exports

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        experts = self.expert_outputs(x)  # (E, B, D)
        return torch.stack([_mix(gate(x), experts) for gate in self.gates], dim=1)  # (B, H, D)


class PLE(nn.Module):
    """Progressive layered extraction (Tang et al. RecSys 2020): `levels` CGC layers. In each,
    every head has `task_experts` experts of its own and all share `shared_experts`; a head's gate
    mixes its own and the shared experts; below the last level a shared gate mixes every expert
    into the next level's shared input. x (B, In) -> (B, H, D).

    The experts of a level (H * task_experts + shared_experts, inputs stacked) run as one batched
    kernel when packed.

    Example:
        >>> ple = PLE(6, levels=2, shared_experts=1, task_experts=2, expert_layers=[4], gate_layers=[],
        ...           heads=["a", "b"])
        >>> ple(torch.randn(5, 6)).shape
        torch.Size([5, 2, 4])
    """

    def __init__(self, in_features: int, levels: int, shared_experts: int, task_experts: int,
                 expert_layers: Sequence[int], gate_layers: Sequence[int], heads: Sequence[str],
                 activation: str = "relu", packed: bool = True):
        super().__init__()
        self.heads, self.shared, self.task = len(heads), shared_experts, task_experts
        count = self.heads * task_experts + shared_experts
        widths = [in_features] + [expert_layers[-1]] * (levels - 1)
        self.experts = nn.ModuleList(_experts(count, w, expert_layers, activation, packed) for w in widths)
        self.task_gates = nn.ModuleList(
            nn.ModuleList(Gate(w, gate_layers, task_experts + shared_experts, activation) for _ in heads)
            for w in widths)
        self.shared_gates = nn.ModuleList(Gate(w, gate_layers, count, activation) for w in widths[:-1])

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "PLE":
        return cls(config.get("in_features") or flat_width(input_shapes), config.get("levels", 1),
                   config.get("shared_experts", 1), config["task_experts"], config["expert_layers"],
                   config.get("gate_layers", ()), config["heads"], config.get("activation", "relu"),
                   config.get("packed", False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inputs, shared = [x] * self.heads, x  # per-head inputs, shared input
        for level, experts in enumerate(self.experts):
            stacked = [inp for inp in inputs for _ in range(self.task)] + [shared] * self.shared
            outs = experts(torch.stack(stacked))  # (K, B, D): head 0's, head 1's, ..., shared
            common = outs[self.heads * self.task:]
            inputs = [_mix(gate(inputs[h]), torch.cat([outs[h * self.task:(h + 1) * self.task], common]))
                      for h, gate in enumerate(self.task_gates[level])]
            if level < len(self.shared_gates):
                shared = _mix(self.shared_gates[level](shared), outs)
        return torch.stack(inputs, dim=1)  # (B, H, D)


class UnpackedExperts(nn.Module):
    """K expert MLPs run one by one on stacked inputs: (K, B, In) -> (K, B, D)."""

    def __init__(self, count: int, in_features: int, layers: Sequence[int], activation: str):
        super().__init__()
        self.mlps = nn.ModuleList(MLP(in_features, layers, activation) for _ in range(count))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([mlp(x[k]) for k, mlp in enumerate(self.mlps)])


def _experts(count: int, in_features: int, layers: Sequence[int], activation: str, packed: bool) -> nn.Module:
    if packed:
        return PackedMLP(count, in_features, layers, activation)
    return UnpackedExperts(count, in_features, layers, activation)


def _mix(weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """Gate-weighted sum: weights (B, E), experts (E, B, D) -> (B, D)."""
    return (weights.t().unsqueeze(2) * experts).sum(dim=0)  # elementwise: exports with a dynamic batch
