"""What the runtime's kernels do for one dense op, forward and backward: the cost model's work list.

For every dense op kind, a rule lists the kernels its lowered operator runs on a (micro-)batch
of B samples: dense layers as (m, k, n, count) (a GEMM of m x k by k x n with its bias and
activation; count same-shape GEMMs in one batched call), elementwise passes by the bytes they
read and write, and kernels whose data is negligible (views, autograd bookkeeping, tiny losses).
A layer's backward (dX and dW GEMMs, bias gradient, activation backward) is listed as the same
(m, k, n, count) in the backward kernels: the device profile prices layers forward and backward
separately, as `flowrec calibrate` measures them. The rules follow `operators.dense` and
`operators.interaction` (an elementwise pass reads and writes its tensor; its backward reads
two and writes one); `flowrec.planner.cost` prices each kernel with the device profile.

A calibrated profile may also hold an op measured as a whole (`flowrec calibrate` times the
operator module the runtime builds for it, at a few batch sizes): `op_signature` names it, and
`outside_kernels` lists the kernels the runtime runs around the module (the assembly of several
inputs into one), which the measurement does not hold.

Example:
    >>> from flowrec.graph.shapes import expert_count
    >>> from flowrec.graph.types import Op
    >>> op = Op("m", "mlp", ("B", 8), attrs=(("activation", "relu"), ("in_features", 4), ("layers", (8,))))
    >>> op_work(op, 2, 1).forward.gemms, op_work(op, 2, 1).backward.gemms
    (((2, 4, 8, 1),), ((2, 4, 8, 1),))
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

from flowrec.graph.shapes import expert_count
from flowrec.graph.types import Op

FLOAT_BYTES = 4  # activations and their gradients are fp32 (bf16 autocast: GEMM inputs only)


@dataclass(frozen=True)
class Kernels:
    """Kernels of one op in one direction.

    Args:
        gemms: (m, k, n, count) per dense layer or GEMM call (count: same-shape GEMMs batched in
            the call); in backward kernels, the backward of that layer.
        elementwise: bytes read + written by each elementwise pass.
        other: kernels with negligible data (views, autograd nodes, scalar ops).
        fresh: bytes of each tensor the kernels allocate (large ones cost page faults on a CPU).
    """

    gemms: tuple[tuple[int, int, int, int], ...] = ()
    elementwise: tuple[float, ...] = ()
    other: int = 0
    fresh: tuple[float, ...] = ()

    def __add__(self, more: "Kernels") -> "Kernels":
        return Kernels(self.gemms + more.gemms, self.elementwise + more.elementwise, self.other + more.other,
                       self.fresh + more.fresh)


@dataclass(frozen=True)
class OpWork:
    """Forward and backward kernels of one op on a batch, and its dense parameter tensors."""

    forward: Kernels = field(default_factory=Kernels)
    backward: Kernels = field(default_factory=Kernels)
    param_tensors: int = 0


def _pass(*elements: float, streams: int = 2, fresh: bool = True) -> Kernels:
    """Elementwise passes over tensors of `elements` fp32 values, each touching `streams` tensors
    and writing a new one of its size (`fresh`; not for a reduction)."""
    return Kernels(elementwise=tuple(streams * e * FLOAT_BYTES for e in elements),
                   fresh=tuple(e * FLOAT_BYTES for e in elements) if fresh else ())


def _gemm(m: int, k: int, n: int, count: int = 1) -> OpWork:
    """One layer (GEMM, bias, activation) and its backward; the tensors each allocates: output and
    activation; output gradient, dX and dW."""
    out, x, w = count * m * n * FLOAT_BYTES, count * m * k * FLOAT_BYTES, count * k * n * FLOAT_BYTES
    return OpWork(Kernels(gemms=((m, k, n, count),), fresh=(out, out)),
                  Kernels(gemms=((m, k, n, count),), fresh=(out, x, w)))


def _join(*works: OpWork) -> OpWork:
    """The works one after the other, in one pass (adding them pairwise copied every tuple again at each
    step: quadratic in the works, minutes for a mixture of 100,000 gates)."""
    return OpWork(_chain([w.forward for w in works]), _chain([w.backward for w in works]),
                  sum(w.param_tensors for w in works))


def _chain(kernels: list[Kernels]) -> Kernels:
    """`kernels[0] + kernels[1] + ...`, each tuple built once."""
    return Kernels(tuple(g for k in kernels for g in k.gemms), tuple(e for k in kernels for e in k.elementwise),
                   sum(k.other for k in kernels), tuple(f for k in kernels for f in k.fresh))


def _assembly(rows: int, width: int, inputs: int) -> OpWork:
    """Several inputs flattened into one (rows, width) tensor: a concatenating copy forward; a
    zero-filled gradient written by slices backward."""
    if inputs <= 1:
        return OpWork()
    return OpWork(_pass(rows * width), _pass(rows * width, streams=1) + _pass(rows * width))


def _layers(rows: int, width: int, layers: tuple[int, ...], count: int = 1) -> OpWork:
    """Linear layers with bias and activation over `rows` rows, `count` of them batched."""
    works = []
    for out in layers:
        gemm = _gemm(rows, width, out, count)
        works.append(OpWork(gemm.forward, gemm.backward, 2))
        width = out
    return _join(*works)


def _regularizers(op: Op, rows: int, count: int = 1) -> OpWork:
    """Norm (statistics + normalise forward, two passes back; scale and shift per layer) and
    dropout (mask + scale forward, one masked pass back) of every layer of an MLP."""
    works = []
    for out in op.attr("layers"):
        size = count * rows * out
        if op.attr("norm", "none") != "none":
            works.append(OpWork(_pass(size, fresh=False) + _pass(size), _pass(size, size), 2))
        if op.attr("dropout", 0.0):
            works.append(OpWork(_pass(size, size), _pass(size)))
    return _join(*works)


def _mlp(op: Op, batch: int, inputs: int) -> OpWork:
    width = op.attr("in_features")
    return _join(_assembly(batch, width, inputs),
                 _layers(batch, width, tuple(op.attr("layers"))), _regularizers(op, batch))


def _packed_mlp(op: Op, batch: int, inputs: int) -> OpWork:
    members, width = len(op.attr("members")), op.attr("in_features")
    stack = OpWork(_pass(members * batch * width), _pass(members * batch * width))
    return _join(stack, _layers(batch, width, tuple(op.attr("layers")), members),
                 _regularizers(op, batch, members))


def _moe(op: Op, batch: int, inputs: int) -> OpWork:
    """Experts (one batched call of E when packed, else E calls), one gate per head, the mix."""
    width, experts, heads = op.attr("in_features"), op.attr("experts"), len(op.attr("heads"))
    layers = tuple(op.attr("expert_layers"))
    expert = _layers(batch, width, layers, experts) if op.attr("packed") else \
        _join(*[_layers(batch, width, layers) for _ in range(experts)])
    gates = _join(*[_layers(batch, width, tuple(op.attr("gate_layers")) + (experts,)) for _ in range(heads)])
    mix = batch * experts * layers[-1]
    return _join(_assembly(batch, width, inputs), expert, gates,
                 OpWork(_pass(*[mix] * heads), _pass(*[mix] * heads)))


def _ple(op: Op, batch: int, inputs: int) -> OpWork:
    """Per level: the experts (one batched call when packed), the gates, the mixes."""
    width, levels, heads = op.attr("in_features"), op.attr("levels"), len(op.attr("heads"))
    layers, count = tuple(op.attr("expert_layers")), expert_count(dict(op.attrs))
    gate = tuple(op.attr("gate_layers"))
    works = [_assembly(batch, width, inputs)]
    for level in range(levels):
        works.append(OpWork(_pass(count * batch * width), _pass(count * batch * width)))  # stacked inputs
        works.append(_layers(batch, width, layers, count) if op.attr("packed") else
                     _join(*[_layers(batch, width, layers) for _ in range(count)]))
        gates = heads + (level < levels - 1)
        works += [_layers(batch, width, gate + (count,)) for _ in range(gates)]
        mix = batch * count * layers[-1]
        works.append(OpWork(_pass(*[mix] * gates), _pass(*[mix] * gates)))
        width = layers[-1]
    return _join(*works)


def _custom(op: Op, batch: int, inputs: int) -> OpWork:
    """A user's module, its dense work unknown until calibrated: a pass over its input and output,
    and where its planning dry run measured its trainable parameters (`param_bytes`), each applied
    once per row as a layer's weights are (a GEMM of its input width by parameters / width: 2 FLOPs
    per parameter and row, forward, and a layer's backward). Priced as a pass alone, a module of
    25M parameters was predicted 0.4 ms a step where it took over a second."""
    width, out = op.attr("in_features"), op.attr("out_width")
    weights = -(-int(op.attr("param_bytes") or 0) // FLOAT_BYTES)
    work = [_assembly(batch, width, inputs), OpWork(_pass(batch * (width + out)), _pass(batch * (width + out)))]
    if weights and width:
        work.append(_gemm(batch, width, -(-weights // width)))
    return _join(*work)


def _linear(op: Op, batch: int, inputs: int) -> OpWork:
    width = op.attr("in_features")
    return _join(_assembly(batch, width, inputs), _layers(batch, width, (op.attr("out", 1),)))


def _head(op: Op, batch: int, inputs: int) -> OpWork:
    """A head's projection; a retrieval head passes its towers through (a copy)."""
    return (_concat if op.attr("task") == "retrieval" else _linear)(op, batch, inputs)


def _concat(op: Op, batch: int, inputs: int) -> OpWork:
    size = batch * op.attr("in_features")
    return OpWork(_pass(size), _pass(size) + Kernels(other=inputs))


def _cross(op: Op, batch: int, inputs: int) -> OpWork:
    width, rank = op.attr("in_features"), op.attr("low_rank")
    size = batch * width
    per_layer = []
    for _ in range(op.attr("num_layers")):
        proj = _layers(batch, width, (rank, width)) if rank else _layers(batch, width, (width,))
        mix = OpWork(_pass(size, size, streams=3), _pass(size, size, size, streams=3))  # x0 * p + x
        per_layer.append(_join(proj, mix))
    return _join(_assembly(batch, width, inputs), *per_layer)


def _fields(op: Op, batch: int) -> tuple[int, int, float]:
    num, dim = op.attr("num_fields"), op.attr("dim")
    return num, dim, float(batch * num * dim)


def _dot(op: Op, batch: int, inputs: int) -> OpWork:
    num, dim, size = _fields(op, batch)
    pairs = batch * num * (num - 1) // 2
    gram = _gemm(num, dim, num, batch)  # x @ x^T per sample; backward one (F x F) @ (F x D) per sample
    fwd = gram.forward + _pass(pairs) + _pass(size)
    bwd = _pass(batch * num * num, streams=1) + _pass(pairs, pairs) + gram.backward + _pass(size)
    return OpWork(fwd, bwd)


def _fm(op: Op, batch: int, inputs: int) -> OpWork:
    num, dim, size = _fields(op, batch)
    fwd = _pass(size) + _pass(size, streams=1, fresh=False) + _pass(size) + _pass(size, streams=1, fresh=False) + Kernels(other=4)
    bwd = _pass(size, size, size, streams=3) + _pass(size) + Kernels(other=4)
    return OpWork(fwd, bwd)


def _target_attention(op: Op, batch: int, inputs: int) -> OpWork:
    dim = op.out_shape[-1]
    length = (op.attr("in_features") - dim) // dim
    rows = batch * length
    seq = float(rows * dim)
    feats = OpWork(_pass(seq, seq, streams=3) + _pass(4 * seq) + Kernels(other=1),
                   _pass(4 * seq) + _pass(seq, seq, seq, streams=3) + _pass(seq, streams=1, fresh=False)
                   + _pass(seq, seq, seq, streams=3))  # q - k, q * k, cat; their grads, the expand's sum
    unit = _layers(rows, 4 * dim, (*op.attr("hidden"), 1))
    pool = _join(OpWork(_pass(rows, rows) + Kernels(other=2), _pass(rows, rows) + Kernels(other=2)),
                 _gemm(1, length, dim, batch))  # masked_fill, then (1 x L) @ (L x D) per sample
    return _join(feats, unit, pool)


def _similarity(op: Op, batch: int, inputs: int) -> OpWork:
    size = float(batch * op.attr("in_features") // 2)  # each tower's (B, D)
    norms = OpWork(_pass(size, size) + Kernels(other=2), _pass(size, size, size, size) + Kernels(other=2)) \
        if op.attr("metric") == "cosine" else OpWork()
    product = OpWork(_pass(size) + _pass(size, streams=1, fresh=False), _pass(size, size, streams=3))
    return _join(norms, product)  # normalise each tower (cosine); product and row sum, then their grads


def _self_attention(op: Op, batch: int, inputs: int) -> OpWork:
    dim = op.out_shape[-1]
    length = op.attr("in_features") // dim
    heads, ffn = op.attr("num_heads"), op.attr("ffn") or 4 * dim
    rows, seq, scores = batch * length, float(batch * length * dim), float(batch * heads * length * length)
    drops = 3 if op.attr("dropout") else 0
    attention = OpWork(_pass(scores, scores) + Kernels(other=2), _pass(scores, scores, scores) + Kernels(other=2))
    layer = _join(_layers(rows, dim, (3 * dim,)),  # q, k, v projections
                  _gemm(length, dim // heads, length, batch * heads),  # q k^T per (sample, head)
                  attention,  # mask and softmax
                  _gemm(length, length, dim // heads, batch * heads),  # weights @ v
                  _layers(rows, dim, (dim,)),  # output projection
                  _layers(rows, dim, (ffn, dim)),  # feed-forward
                  OpWork(_pass(*[seq] * (4 + drops)), _pass(*[seq] * (6 + drops))))  # residuals, norms, dropout
    ends = OpWork(_pass(seq, seq), _pass(seq, seq))  # positions added, last / mean pooled
    return _join(ends, *[layer] * op.attr("num_layers"))


def retrieval_softmax(batch: int, dim: int, candidates: int, logq: bool = False, cosine: bool = False) -> OpWork:
    """A retrieval head's softmax, run in the loss (`operators.retrieval`): the (B x D) @ (D x C)
    logits of every query against C candidates (in-batch: the batch's B items; sampled: the
    positive and N sampled items), scaled by the temperature, logQ-corrected, duplicate items
    masked, cross-entropy; backward the softmax's and mask's gradients and the GEMM's back to
    the two towers. Cosine normalises both towers first.

    Example:
        >>> retrieval_softmax(1024, 32, 1024).forward.gemms
        ((1024, 32, 1024, 1),)
    """
    logits, towers = float(batch * candidates), float(batch * dim + candidates * dim)
    gemm = _gemm(batch, dim, candidates)
    passes = 3 + int(logq)  # scale, (logQ,) duplicate mask, masked_fill
    fwd = gemm.forward + _pass(*[logits] * passes) + _pass(logits, logits) + Kernels(other=4)  # + log_softmax
    bwd = gemm.backward + _pass(logits, logits, streams=3) + _pass(*[logits] * (passes - 1)) + Kernels(other=4)
    if cosine:
        fwd, bwd = fwd + _pass(towers, towers), bwd + _pass(towers, towers, towers, streams=3)
    return OpWork(fwd, bwd)


def _loss(op: Op, batch: int, inputs: int) -> OpWork:
    heads = len(op.attr("heads") or ())
    return OpWork(Kernels(other=4 * heads + 1), Kernels(other=4 * heads + 1))


Rule = Callable[[Op, int, int], OpWork]

RULES: dict[str, Rule] = {
    "mlp": _mlp,
    "packed_mlp": _packed_mlp,
    "moe": _moe,
    "ple": _ple,
    "custom": _custom,
    "linear": _linear,
    "head": _head,
    "concat": _concat,
    "cross": _cross,
    "dot": _dot,
    "fm": _fm,
    "target_attention": _target_attention,
    "self_attention": _self_attention,
    "similarity": _similarity,
    "loss": _loss,
}


def op_signature(op: Op, inputs: int, precision: str) -> str:
    """A short name of what a dense op computes (kind, attributes, output shape, input count,
    precision): the key of its measured times in a calibrated profile.

    Example:
        >>> op = Op("m", "mlp", ("B", 8), attrs=(("activation", "relu"), ("in_features", 4), ("layers", (8,))))
        >>> op_signature(op, 1, "fp32")
        'mlp/369598ed262c'
    """
    text = repr((op.kind, op.attrs, op.out_shape, inputs, precision))
    return f"{op.kind}/{hashlib.sha1(text.encode()).hexdigest()[:12]}"


def outside_kernels(op: Op, batch: int, inputs: int) -> OpWork:
    """The kernels of an op that the runtime runs outside its operator module: what its work list
    adds for `inputs` input edges over one (the assembly of several inputs into one tensor)."""
    full, single = op_work(op, batch, inputs), op_work(op, batch, 1)
    return OpWork(_less(full.forward, single.forward), _less(full.backward, single.backward))


def _less(full: Kernels, single: Kernels) -> Kernels:
    """The kernels of `full` beyond those of `single` (which lists a prefix-free subset)."""
    def rest(items: tuple, fewer: tuple) -> tuple:
        left = list(items)
        for item in fewer:
            if item in left:
                left.remove(item)
        return tuple(left)

    return Kernels(rest(full.gemms, single.gemms), rest(full.elementwise, single.elementwise),
                   max(0, full.other - single.other), rest(full.fresh, single.fresh))


def op_work(op: Op, batch: int, inputs: int) -> OpWork:
    """The kernels of a dense op on `batch` samples with `inputs` input edges.

    Raises:
        KeyError: a kind with no rule (every dense kind of `OP_KINDS` has one; a test checks it).
    """
    return RULES[op.kind](op, batch, inputs)
