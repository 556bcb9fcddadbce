"""Dense operators: mlp, packed_mlp, cross (DCN-v2), linear, concat, head.

Every operator is a torch.nn.Module with `from_config(config, input_shapes)` (shapes without the
batch dimension), so the registry builds it from a graph node. Dense compute may run under
`torch.autocast(device, dtype=torch.bfloat16)`; parameters stay fp32.

Example:
    >>> mlp = MLP.from_config({"layers": [8, 4]}, [(13,)])
    >>> mlp(torch.randn(2, 13)).shape
    torch.Size([2, 4])
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from operators.onednn import linear, linear_sources
from operators.regularize import SeededDropout, make_norm, make_packed_norm

try:  # private, guard-free: False where the layout cannot be decided without a shape guard
    from torch._prims_common import is_contiguous_or_false
except ImportError:  # another torch: every (B, ...) input is copied before it is flattened
    def is_contiguous_or_false(x: torch.Tensor) -> bool:
        return False

Shapes = Sequence[tuple[int, ...]]

# Activations of MLP layers, applied in place to the fresh output of a linear layer (which the
# linear's backward does not need): no extra (B, Out) allocation per layer.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "relu": torch.relu_, "sigmoid": torch.sigmoid_, "tanh": torch.tanh_,
    "gelu": nn.functional.gelu, "silu": nn.functional.silu, "none": lambda x: x,
}


def get_activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation function called `name`; unknown names list the known ones."""
    if name not in ACTIVATIONS:
        raise KeyError(f"unknown activation {name!r}; known: {sorted(ACTIVATIONS)}")
    return ACTIVATIONS[name]


def flat_width(shapes: Shapes) -> int:
    """Total features of inputs flattened per sample and concatenated."""
    total = 0
    for shape in shapes:
        width = 1
        for d in shape:
            width *= int(d)
        total += width
    return total


class MLP(nn.Module):
    """Stack of layers, each linear -> norm -> activation -> dropout: x (B, In) -> (B, layers[-1]).

    Args:
        in_features: input width.
        layers: output width of each layer.
        activation: relu (default), sigmoid, tanh, gelu, silu or none.
        norm: none (default), batch or layer (`operators.regularize`).
        dropout: drop probability after each layer's activation (0: none).

    Example:
        >>> MLP(4, [3, 2], norm="layer", dropout=0.1)(torch.randn(5, 4)).shape
        torch.Size([5, 2])
    """

    def __init__(self, in_features: int, layers: Sequence[int], activation: str = "relu",
                 norm: str = "none", dropout: float = 0.0):
        super().__init__()
        widths = [in_features, *layers]
        bias = norm != "batch"  # batch norm subtracts any bias: the layer has none
        self.layers = nn.ModuleList(nn.Linear(a, b, bias=bias) for a, b in zip(widths, widths[1:]))
        self.norms = nn.ModuleList(make_norm(norm, b) for b in layers)
        self.drops = nn.ModuleList(_dropout(dropout) for _ in layers)
        self.act = get_activation(activation)
        self.fused_relu = activation == "relu" and norm == "none"  # the ReLU runs inside the GEMM

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "MLP":
        in_features = config.get("in_features") or flat_width(input_shapes)
        return cls(in_features, config["layers"], config.get("activation", "relu"),
                   config.get("norm", "none"), config.get("dropout", 0.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer, norm, drop in zip(self.layers, self.norms, self.drops):
            x = drop(self._layer(layer, norm, x))
        return x

    def _layer(self, layer: nn.Linear, norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """act(norm(layer(x))): with no norm and a ReLU, one fused linear + ReLU
        (`operators.onednn.linear`: oneDNN on the CPU in fp32).  # (B, Out)"""
        if self.fused_relu:
            return linear(x, layer.weight, layer.bias, relu=True)
        return self.act(norm(linear(x, layer.weight, layer.bias)))

    def forward_sources(self, sources: Sequence[torch.Tensor], inverse: torch.Tensor | None = None) -> torch.Tensor:
        """`forward(cat(sources flattened)[:, index])` without building that input: the first
        layer's weight columns are permuted into the sources' layout (`inverse`: where each column
        of the sources goes in the input, None: in order) and split per source, one GEMM each.
        The same function; the sums run in another order (allclose, not bitwise).

        Example:
            >>> mlp, a, b = MLP(5, [3]), torch.randn(2, 2), torch.randn(2, 3)
            >>> perm = torch.tensor([3, 0, 4, 1, 2])
            >>> inverse = torch.argsort(perm)
            >>> torch.allclose(mlp.forward_sources([a, b], inverse), mlp(torch.cat([a, b], 1)[:, perm]))
            True
        """
        first = self.layers[0]
        flats = [flat_rows(part) for part in sources]  # (B, w) each
        x = linear_sources(flats, first.weight, first.bias, inverse)  # (B, Out): one node, CPU training
        if x is None:
            weight = first.weight if inverse is None else first.weight.index_select(1, inverse)  # (Out, In)
            start = 0
            for flat in flats:
                w = weight[:, start:start + flat.shape[1]]
                start += flat.shape[1]
                x = linear(flat, w, first.bias) if x is None else linear(flat, w, add=x)
        x = self.drops[0](self.act(self.norms[0](x)))
        for layer, norm, drop in zip(self.layers[1:], self.norms[1:], self.drops[1:]):
            x = drop(self._layer(layer, norm, x))
        return x


def _dropout(p: float, batch_dim: int = 0) -> nn.Module:
    return SeededDropout(p, batch_dim) if p else nn.Identity()


class PackedMLP(nn.Module):
    """K same-shape MLPs as one batched kernel: x (K, B, In) -> (K, B, Out), one baddbmm per layer.

    Args:
        num: K, the number of MLPs.
        in_features: input width of each.
        layers: output widths.
        activation, norm, dropout: as in `MLP` (norm statistics and affines are per member).

    Example:
        >>> mlps = [MLP(4, [3]) for _ in range(2)]
        >>> packed = PackedMLP.from_mlps(mlps)
        >>> packed(torch.randn(2, 5, 4)).shape
        torch.Size([2, 5, 3])
    """

    def __init__(self, num: int, in_features: int, layers: Sequence[int], activation: str = "relu",
                 norm: str = "none", dropout: float = 0.0):
        super().__init__()
        widths = [in_features, *layers]
        self.weights = nn.ParameterList(
            nn.Parameter(torch.empty(num, a, b)) for a, b in zip(widths, widths[1:]))  # (K, In, Out)
        self.biases = nn.ParameterList(  # none before batch norm, as in `MLP`
            nn.Parameter(torch.empty(num, 1, b)) for b in widths[1:] if norm != "batch")  # (K, 1, Out)
        for i, w in enumerate(self.weights):
            bound = w.shape[1] ** -0.5  # nn.Linear's default init range
            nn.init.uniform_(w, -bound, bound)
            if self.biases:
                nn.init.uniform_(self.biases[i], -bound, bound)
        self.norms = nn.ModuleList(make_packed_norm(norm, num, b) for b in layers)
        self.drops = nn.ModuleList(_dropout(dropout, batch_dim=1) for _ in layers)
        self.act = get_activation(activation)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "PackedMLP":
        """K is the number of members (`member_ports`: each member's range of input slots; without
        it, one slot per member), each member's input width its slots' flat width."""
        ports = config.get("member_ports") or [(i, i + 1) for i in range(len(input_shapes))]
        a, b = ports[0]
        in_features = config.get("in_features") or flat_width(input_shapes[a:b])
        return cls(len(ports), in_features, config["layers"], config.get("activation", "relu"),
                   config.get("norm", "none"), config.get("dropout", 0.0))

    @classmethod
    def from_mlps(cls, mlps: Sequence[MLP], activation: str = "relu") -> "PackedMLP":
        """Pack existing same-shape MLPs (copies their weights)."""
        first = mlps[0].layers
        packed = cls(len(mlps), first[0].in_features, [l.out_features for l in first], activation)
        with torch.no_grad():
            for i, (w, b) in enumerate(zip(packed.weights, packed.biases)):
                w.copy_(torch.stack([m.layers[i].weight.t() for m in mlps]))
                b.copy_(torch.stack([m.layers[i].bias.unsqueeze(0) for m in mlps]))
        return packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, (w, norm, drop) in enumerate(zip(self.weights, self.norms, self.drops)):
            y = torch.baddbmm(self.biases[i], x, w) if self.biases else torch.bmm(x, w)  # (K, B, Out)
            x = drop(self.act(norm(y)))
        return x


class Cross(nn.Module):
    """DCN-v2 cross network: x_{l+1} = x0 * (W_l x_l + b_l) + x_l, W_l = U_l V_l^T when low rank.

    Args:
        in_features: width of x (B, In) -> (B, In).
        num_layers: cross layers.
        low_rank: rank of W_l (None: full In x In).

    Example:
        >>> Cross(6, 2, low_rank=3)(torch.randn(4, 6)).shape
        torch.Size([4, 6])
    """

    def __init__(self, in_features: int, num_layers: int, low_rank: int | None = None):
        super().__init__()
        self.low_rank = low_rank
        if low_rank:
            self.down = nn.ModuleList(nn.Linear(in_features, low_rank, bias=False)
                                      for _ in range(num_layers))
            self.up = nn.ModuleList(nn.Linear(low_rank, in_features) for _ in range(num_layers))
        else:
            self.up = nn.ModuleList(nn.Linear(in_features, in_features) for _ in range(num_layers))
            self.down = nn.ModuleList(nn.Identity() for _ in range(num_layers))

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "Cross":
        in_features = config.get("in_features") or flat_width(input_shapes)
        return cls(in_features, config.get("num_layers", 2), config.get("low_rank"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x0 = x  # (B, In)
        for down, up in zip(self.down, self.up):
            x = x0 * up(down(x)) + x
        return x


class Linear(nn.Module):
    """x (B, In) -> (B, out); several inputs are flattened and concatenated first.

    Example:
        >>> Linear.from_config({"out": 3}, [(4,)])(torch.randn(2, 4)).shape
        torch.Size([2, 3])
    """

    def __init__(self, in_features: int, out: int):
        super().__init__()
        self.proj = nn.Linear(in_features, out)

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "Linear":
        return cls(config.get("in_features") or flat_width(input_shapes), config.get("out", 1))

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.proj(concat_flat(inputs))


class Head(Linear):
    """Projection to a head's logits: x (B, In) -> (B, out) (one, or one per class: `out`).

    Example:
        >>> Head.from_config({}, [(8,)])(torch.randn(2, 8)).shape
        torch.Size([2, 1])
    """

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> nn.Module:
        if config.get("task") == "retrieval":  # the towers pass through to the retrieval loss
            return RetrievalHead()
        return cls(config.get("in_features") or flat_width(input_shapes), config.get("out", 1))


class RetrievalHead(nn.Module):
    """A retrieval head: the query and item towers side by side, no projection
    (`operators.retrieval` scores them).  # (B, 2D) -> (B, 2D)

    Example:
        >>> RetrievalHead()(torch.ones(3, 8)).shape
        torch.Size([3, 8])
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


def flat_rows(x: torch.Tensor) -> torch.Tensor:
    """One row per sample: (B, ...) -> (B, width); a 2-D input as is.

    A contiguous input is viewed. Any other (a field slice of a packed lookup (B, S, D)) is copied
    into a contiguous tensor first: `reshape` would ask whether B == 1 to decide if it can view
    it, a shape guard that makes `torch.export` fail on the dynamic batch.
    """
    if x.dim() == 2:
        return x
    if not is_contiguous_or_false(x):
        x = x.clone(memory_format=torch.contiguous_format)
    return x.view(x.shape[0], math.prod(x.shape[1:]))  # the width spelled out: -1 is ambiguous at B = 0


def concat_flat(inputs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Flatten each input per sample and concatenate: -> (B, sum of widths)."""
    flat = [flat_rows(x) for x in inputs]
    return flat[0] if len(flat) == 1 else torch.cat(flat, dim=1)


class Concat(nn.Module):
    """Inputs flattened per sample and concatenated: [(B, ...), ...] -> (B, total).

    Example:
        >>> Concat()(torch.ones(2, 3), torch.ones(2, 2, 2)).shape
        torch.Size([2, 7])
    """

    @classmethod
    def from_config(cls, config: dict[str, Any], input_shapes: Shapes) -> "Concat":
        return cls()

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return concat_flat(inputs)
