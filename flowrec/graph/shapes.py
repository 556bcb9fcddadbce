"""Shape, FLOP and parameter rules per op kind: one registry used by `build`, passes and `verify`.

Each rule takes the op's attributes and the per-sample shapes of its input slots (batch axis
left out) and returns a `Sizing`: the per-sample output shape, forward FLOPs per sample and
dense parameter count. Module inputs are *slots*: a vector ``(W,)``, a field set ``(F, D)`` or a
sequence ``(L, D)``.

Example:
    >>> sizing("mlp", {"layers": (8, 4)}, [(3,), (5,)]).out
    (4,)
"""
from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import Any, Callable, Mapping, Sequence

from flowrec.graph.kinds import OP_KINDS

Shape = tuple[int, ...]


@dataclass(frozen=True)
class Sizing:
    """Per-sample output shape, forward FLOPs per sample, dense parameter count."""

    out: Shape
    flops: int = 0
    params: int = 0


class ShapeError(ValueError):
    """Input shapes an op cannot accept."""


SOURCES = frozenset(k for k, info in OP_KINDS.items() if info.role == "source")  # kinds without inputs

Rule = Callable[[Mapping[str, Any], Sequence[Shape]], Sizing]


def _width(shapes: Sequence[Shape]) -> int:
    return sum(prod(s) for s in shapes)


NORM_FLOPS = 4  # per unit and sample: subtract, scale, multiply, add (batch or layer norm)
NORM_PARAMS = 2  # per unit: scale and shift
FP32_BYTES = 4  # bytes of one fp32 parameter (a graph counts parameters as fp32: graph.build.PARAM_BYTES)


def _mlp_stack(width: int, layers: Sequence[int], norm: str | None = None) -> tuple[int, int]:
    """FLOPs per sample and parameters of linear layers (with a norm after each unless none; no
    bias before a batch norm)."""
    normed, bias = norm not in (None, "none"), norm != "batch"  # no bias before batch norm
    flops = params = 0
    for out in layers:
        flops += 2 * width * out + (NORM_FLOPS * out if normed else 0)
        params += width * out + (out if bias else 0) + (NORM_PARAMS * out if normed else 0)
        width = out
    return flops, params


def _mlp(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    flops, params = _mlp_stack(_width(shapes), attrs["layers"], attrs.get("norm"))
    return Sizing((attrs["layers"][-1],), flops, params)


def _packed_mlp(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    members = attrs["members"]
    widths = [_width(shapes[a:b]) for a, b in attrs["member_ports"]]
    if len(set(widths)) != 1:
        raise ShapeError(f"packed_mlp members have different input widths {widths}")
    flops, params = _mlp_stack(widths[0], attrs["layers"], attrs.get("norm"))
    return Sizing((len(members), attrs["layers"][-1]), flops * len(members), params * len(members))


def _moe(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    """MMoE: E experts over the input, one softmax gate per head: out (heads, expert width)."""
    width, experts, heads = _width(shapes), attrs["experts"], len(attrs["heads"])
    e_flops, e_params = _mlp_stack(width, attrs["expert_layers"])
    g_flops, g_params = _mlp_stack(width, tuple(attrs["gate_layers"]) + (experts,))
    out = attrs["expert_layers"][-1]
    mix = 2 * heads * experts * out  # the gate-weighted sum of the experts, per head
    return Sizing((heads, out), experts * e_flops + heads * g_flops + mix, experts * e_params + heads * g_params)


def _ple(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    """PLE: per level, H * task + shared experts, a gate per head and (below the top) a shared gate."""
    heads, task, shared = len(attrs["heads"]), attrs["task_experts"], attrs["shared_experts"]
    count, out, gate_layers = heads * task + shared, attrs["expert_layers"][-1], tuple(attrs["gate_layers"])
    flops = params = 0
    width = _width(shapes)
    for level in range(attrs["levels"]):
        e_flops, e_params = _mlp_stack(width, attrs["expert_layers"])
        t_flops, t_params = _mlp_stack(width, gate_layers + (task + shared,))
        s_flops, s_params = _mlp_stack(width, gate_layers + (count,)) if level < attrs["levels"] - 1 else (0, 0)
        flops += count * e_flops + heads * t_flops + s_flops + 2 * (heads * (task + shared) + count) * out
        params += count * e_params + heads * t_params + s_params
        width = out
    return Sizing((heads, out), flops, params)


def expert_count(attrs: Mapping[str, Any]) -> int:
    """Experts of a mixture (per level for ple): the `experts` of moe, else heads * task + shared."""
    return attrs.get("experts") or len(attrs["heads"]) * attrs["task_experts"] + attrs["shared_experts"]


def _custom(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    """A user's module: the width its planning dry run measured, and as parameters the bytes of
    its trainable parameters that dry run measured (`param_bytes`, in fp32 parameters: a graph
    counts PARAM_BYTES each; none where the spec gave `out_width` and the dry run did not run);
    its FLOPs are unknown."""
    if attrs.get("out_width") is None:
        raise ShapeError(f"custom module {attrs.get('class')}: output width unknown (flowrec measures it "
                         f"by a dry run when planning through its CLI or API)")
    return Sizing((attrs["out_width"],), 0, -(-int(attrs.get("param_bytes", 0)) // FP32_BYTES))


def _linear(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    width, out = _width(shapes), attrs["out"]
    return Sizing((out,), 2 * width * out, width * out + out)


def _concat(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    return Sizing((_width(shapes),))


def _cross(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    width, layers, rank = _width(shapes), attrs["num_layers"], attrs.get("low_rank")
    per_layer = 2 * width * rank * 2 if rank else 2 * width * width
    params = (2 * width * rank if rank else width * width) + width
    return Sizing((width,), layers * (per_layer + 3 * width), layers * params)


def field_shapes(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> list[Shape]:
    """The slots of a dot / fm as fields: each port in `attrs["flat_ports"]` (the whole output of
    a module with named outputs, (H, D)) is one field of its flattened width, as every module's
    output is; the others as they are: (D,) one field, (F, D) F fields."""
    flat = attrs.get("flat_ports", ())
    return [(prod(s),) if i in flat else tuple(s) for i, s in enumerate(shapes)]


def _fields(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> tuple[int, int]:
    """(number of fields, common dim) of vector and field-set slots."""
    shapes = field_shapes(attrs, shapes)
    dims = {s[-1] for s in shapes}
    if len(dims) != 1 or any(len(s) not in (1, 2) for s in shapes):
        raise ShapeError(f"interaction inputs need one common dim, got shapes {list(shapes)}")
    return sum(1 if len(s) == 1 else s[0] for s in shapes), dims.pop()


def _dot(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    f, d = _fields(attrs, shapes)
    return Sizing((f * (f - 1) // 2,), 2 * f * f * d)


def _fm(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    f, d = _fields(attrs, shapes)
    return Sizing((1,), 4 * f * d)


def _target_attention(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    if len(shapes) != 2 or len(shapes[1]) != 2:
        raise ShapeError(f"target_attention takes [query (D,), sequence (L, D)], got {list(shapes)}")
    query, (length, dim) = shapes[0], shapes[1]
    if prod(query) != dim:
        raise ShapeError(f"target_attention query {query} does not match sequence dim {dim}")
    flops, params = _mlp_stack(4 * dim, tuple(attrs["hidden"]) + (1,))
    return Sizing((dim,), length * (flops + 2 * dim), params)


def _similarity(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    if len(shapes) != 2 or prod(shapes[0]) != prod(shapes[1]):
        raise ShapeError(f"similarity takes two vectors of one width, got {list(shapes)}")
    width = prod(shapes[0])
    return Sizing((1,), (8 if attrs["metric"] == "cosine" else 2) * width)


def _self_attention(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    target = attrs.get("output") == "target"
    if len(shapes) != 1 + target or len(shapes[0]) != 2:
        raise ShapeError(f"self_attention takes [sequence (L, D)]{' and a target (D,)' if target else ''}, "
                         f"got {list(shapes)}")
    length, dim = shapes[0]
    if target and prod(shapes[1]) != dim:
        raise ShapeError(f"self_attention: the target has width {prod(shapes[1])}, the sequence dim {dim}")
    length += target  # the target joins the sequence
    if dim % attrs["num_heads"]:
        raise ShapeError(f"self_attention: {attrs['num_heads']} heads do not divide dim {dim}")
    ffn = attrs.get("ffn") or 4 * dim
    flops = 2 * length * (4 * dim * dim + 2 * dim * ffn) + 4 * length * length * dim  # projections, ffn, attention
    params = 4 * dim * dim + 2 * dim * ffn + ffn + 8 * dim  # q/k/v/out with biases, ffn, two LayerNorms
    positions = length * dim if attrs["positional"] == "learned" else 0
    return Sizing((dim,), attrs["num_layers"] * flops, attrs["num_layers"] * params + positions)


def _head(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    width, out = _width(shapes), attrs.get("out", 1)  # out: classes of a multiclass head
    if attrs.get("task") == "retrieval":  # the two towers side by side, no projection
        return Sizing((width,), 0, 0)
    return Sizing((out,), 2 * width * out, width * out + out)


def _loss(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    return Sizing((), 4 * len(shapes))


def _dense_input(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    return Sizing((len(attrs["columns"]),))


def _sparse_input(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    return Sizing((attrs["bags"],))


def _label_input(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    return Sizing((len(attrs["heads"]) + len(attrs.get("weights", ())),))  # labels, then sample weights


def _one_input(kind: str, shapes: Sequence[Shape], expected: Shape) -> None:
    if list(shapes) != [expected]:
        raise ShapeError(f"{kind} expects one input of shape {expected}, got {list(shapes)}")


def _embedding_lookup(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    length, dim = attrs["max_len"], attrs["dim"]
    _one_input("embedding_lookup", shapes, (length,))
    return Sizing((length, dim), length * dim)


def _pooling(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    length, dim = attrs["max_len"], attrs["dim"]
    _one_input("pooling", shapes, (length, dim))
    return Sizing((dim,), length * dim)


def _packed_embedding(attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    bags, dim = attrs["bags"], attrs["dim"]
    _one_input("packed_embedding", shapes, (bags,))
    ids = sum(length for _, _, length, _ in attrs["fields"])
    return Sizing((bags, dim), 2 * ids * dim)


RULES: dict[str, Rule] = {
    "dense_input": _dense_input,
    "sparse_input": _sparse_input,
    "label_input": _label_input,
    "embedding_lookup": _embedding_lookup,
    "pooling": _pooling,
    "packed_embedding": _packed_embedding,
    "mlp": _mlp,
    "packed_mlp": _packed_mlp,
    "linear": _linear,
    "concat": _concat,
    "cross": _cross,
    "dot": _dot,
    "fm": _fm,
    "target_attention": _target_attention,
    "self_attention": _self_attention,
    "similarity": _similarity,
    "head": _head,
    "loss": _loss,
    "moe": _moe,
    "ple": _ple,
    "custom": _custom,
}


def sizing(kind: str, attrs: Mapping[str, Any], shapes: Sequence[Shape]) -> Sizing:
    """Output shape, FLOPs and parameters of a dense op from its input slot shapes.

    Raises:
        ShapeError: when the inputs do not fit the kind's rule.
        KeyError: for an unknown kind.
    """
    if not shapes and kind not in SOURCES:
        raise ShapeError(f"{kind} has no inputs")
    if shapes and kind in SOURCES:
        raise ShapeError(f"{kind} takes no inputs, got {list(shapes)}")
    return RULES[kind](attrs, shapes)
