"""Every dense kind the model language has is priced by its work, not a constant: attention
(target and self), MoE and PLE, cross, the custom module, the retrieval heads' softmax (in-batch:
B x B logits; sampled: B x (1 + N)). Each prediction grows with its shape as the FLOPs and bytes
do (no timing is asserted)."""
from __future__ import annotations

import random

import pytest

from flowrec.planner.cost import DEVICES, dense_seconds, kernel_seconds, retrieval_work
from flowrec.planner.manager import make_plan
from flowrec.planner.op_work import op_work, retrieval_softmax
from flowrec.measure.step import with_batch
from flowrec.spec import load_spec

CPU = DEVICES["cpu"]
KINDS = {"din_taobao": "target_attention", "bst_taobao": "self_attention", "sasrec_movielens": "self_attention",
         "mmoe_movielens": "moe", "ple_movielens": "ple", "custom_module": "custom", "dcn_v2": "cross"}


def _seconds(work) -> float:
    return kernel_seconds(work.forward, CPU) + kernel_seconds(work.backward, CPU, backward=True)


def _gemm_flops(work) -> float:
    return sum(2.0 * m * k * n * c for m, k, n, c in work.forward.gemms + work.backward.gemms)


@pytest.mark.parametrize("name", sorted(KINDS))
def test_each_kind_grows_with_the_batch_as_its_work(repo, name):
    spec = load_spec(repo / "specs" / f"{name}.yaml")
    plan = make_plan(spec, target="cpu")
    ops = [(plan.graph.nodes[n]["op"], plan.graph.in_degree(n)) for n in plan.graph]
    mine = [(op, inputs) for op, inputs in ops if op.kind == KINDS[name]]
    assert mine, f"{name} has no {KINDS[name]} op"
    small = random.choice([64, 128, 256])
    for op, inputs in mine:
        lo, hi = op_work(op, small, inputs), op_work(op, 8 * small, inputs)
        t_lo, t_hi = _seconds(lo), _seconds(hi)
        assert t_hi > 2 * t_lo > 0  # not a constant: the per-kernel fixed costs stay, the work grows 8x
        if _gemm_flops(lo):
            assert _gemm_flops(hi) == pytest.approx(8 * _gemm_flops(lo))


def test_self_attention_grows_with_the_sequence_squared_in_its_scores():
    from flowrec.graph.types import Op

    def attention(length: int) -> Op:
        return Op("a", "self_attention", ("B", 32), attrs=(("dropout", 0.0), ("ffn", 64), ("in_features", 32 * length),
                                                          ("num_heads", 2), ("num_layers", 1)))

    short, long = op_work(attention(16), 64, 1), op_work(attention(64), 64, 1)
    scores = [g for g in long.forward.gemms if g[1] == 16 and g[2] == 64]  # q k^T per (sample, head)
    assert scores and max(long.forward.elementwise) > 15 * max(short.forward.elementwise)  # (L x L) scores: 16x


def test_in_batch_softmax_grows_with_the_batch_squared_and_sampled_with_its_negatives():
    dim = random.choice([16, 32, 64])
    t = {b: _seconds(retrieval_softmax(b, dim, b)) for b in (512, 2048)}
    assert t[2048] > 10 * t[512]  # B x B logits: 16x the work at 4x the batch
    sampled = {n: _seconds(retrieval_softmax(2048, dim, 1 + n)) for n in (64, 1024)}
    assert sampled[1024] > 8 * sampled[64] and sampled[1024] < t[2048]
    cosine = retrieval_softmax(512, dim, 512, logq=True, cosine=True)
    assert _seconds(cosine) > _seconds(retrieval_softmax(512, dim, 512))


@pytest.mark.parametrize("name", ["two_tower_movielens", "sasrec_movielens"])
def test_retrieval_heads_price_their_softmax_in_the_loss(repo, name):
    spec = load_spec(repo / "specs" / f"{name}.yaml")
    batches = (256, 1024)
    softmax, dense = {}, {}
    for b in batches:
        plan = make_plan(with_batch(spec, b), target="cpu")
        work = retrieval_work(plan.graph, plan.graph.nodes["loss"]["op"], b)
        head = next(plan.graph.nodes[n]["op"] for n in plan.graph if plan.graph.nodes[n]["op"].kind == "head")
        candidates = b if head.attr("negatives") == "in_batch" else 1 + head.attr("num_negatives")
        assert work.forward.gemms == ((b, head.attr("in_features") // 2, candidates, 1),)
        softmax[b], dense[b] = _seconds(work), sum(dense_seconds(plan.graph, CPU, b))
    assert dense[1024] - dense[256] > softmax[1024] - softmax[256] > 0  # the loss's softmax is in the dense time


def test_a_custom_module_is_priced_by_the_parameters_its_dry_run_measured():
    """A custom module was priced as a pass over its input and output whatever it held: a module of
    25M parameters was predicted 0.4 ms a step where it took seconds. Where its dry run measured its
    trainable parameters (`param_bytes`), each is applied once per row as a layer's weights are:
    2 FLOPs per parameter and row forward, a layer's backward; a module of no measure stays a pass."""
    from flowrec.graph.types import Op

    width, out = random.choice([16, 64, 96]), random.choice([8, 32])
    params = random.randrange(10_000, 50_000_000)

    def custom(param_bytes: int | None) -> Op:
        attrs = [("class", "blocks.py:Big"), ("in_features", width), ("out_width", out)]
        return Op("mine", "custom", ("B", out), attrs=tuple(attrs + ([("param_bytes", param_bytes)] if param_bytes
                                                                    is not None else [])))

    batch = random.choice([256, 1024])
    plain, small, big = (op_work(custom(b), batch, 1) for b in (None, 4 * 1_000, 4 * params))
    assert not plain.forward.gemms and not plain.backward.gemms  # nothing measured: a pass
    flops = sum(2.0 * m * k * n * c for m, k, n, c in big.forward.gemms)
    assert flops == pytest.approx(2.0 * batch * params, rel=width / params + 1e-9)  # k x n covers the parameters
    assert big.backward.gemms == big.forward.gemms  # dX and dW, as a layer's
    assert _seconds(big) > _seconds(small) > _seconds(plain)
