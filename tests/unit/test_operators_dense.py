"""Registry and dense/interaction operators against plainly written references (fp32 and bf16)."""
from __future__ import annotations

import pytest
import torch

from flowrec.graph.kinds import OP_KINDS
from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators import registry
from operators.dense import MLP, PackedMLP
from operators.embedding import PackedEmbeddingBag


def _x(*shape) -> torch.Tensor:
    return torch.randn(*shape) * 0.5 + 0.1


def test_every_op_kind_has_an_operator():
    assert set(OP_KINDS) <= set(registry.OPERATORS)
    for kind in OP_KINDS:
        assert registry.get(kind) is registry.OPERATORS[kind]


def test_unknown_kind_lists_known():
    with pytest.raises(KeyError) as err:
        registry.get("transformer")
    assert "target_attention" in str(err.value) and "packed_embedding" in str(err.value)


def test_mlp_and_linear_and_head_match_manual():
    x = _x(5, 7)
    mlp = registry.create("mlp", {"layers": [6, 3]}, [(7,)])
    ref = x
    for layer in mlp.layers:
        ref = torch.relu(ref @ layer.weight.t() + layer.bias)
    torch.testing.assert_close(mlp(x), ref)
    lin = registry.create("linear", {"out": 4}, [(7,)])
    torch.testing.assert_close(lin(x), x @ lin.proj.weight.t() + lin.proj.bias)
    assert registry.create("head", {}, [(7,)])(x).shape == (5, 1)
    cat = registry.create("concat", {}, [(7,), (2, 3)])
    y = _x(5, 2, 3)
    assert torch.equal(cat(x, y), torch.cat([x, y.reshape(5, 6)], dim=1))


def test_packed_mlp_equals_separate_mlps():
    mlps = [MLP(6, [5, 4], "relu") for _ in range(3)]
    packed = PackedMLP.from_mlps(mlps)
    x = _x(3, 8, 6)
    ref = torch.stack([m(x[k]) for k, m in enumerate(mlps)])
    torch.testing.assert_close(packed(x), ref)
    built = registry.create("packed_mlp", {"layers": [4]}, [(6,)] * 3)
    assert built(x).shape == (3, 8, 4)


def test_dot_is_strict_upper_triangle():
    bottom, fields = _x(4, 8), _x(4, 5, 8)
    out = registry.create("dot", {}, [(8,), (5, 8)])(bottom, fields)
    allf = torch.cat([bottom.unsqueeze(1), fields], dim=1)
    ref = []
    for i in range(6):
        for j in range(i + 1, 6):
            ref.append((allf[:, i] * allf[:, j]).sum(-1))
    assert out.shape == (4, 15)
    torch.testing.assert_close(out, torch.stack(ref, dim=1))


@pytest.mark.parametrize("fields", [1, 2, 3, 7, 27])
def test_dots_pairs_made_from_an_input_equal_its_triu_pairs(fields):
    """An exported program makes the pairs from its input (`traced_pairs`: no device of its own)
    and training from `triu_indices`: the same integers, so the dots are the same."""
    from operators.interaction import Dot, traced_pairs

    for made, cached in zip(traced_pairs(torch.zeros(1), fields), Dot().pairs(fields, torch.device("cpu"))):
        assert made.dtype == cached.dtype == torch.int64 and torch.equal(made, cached)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_dot_gradient_equals_autograd_of_the_plain_reference(dtype):
    bottom = _x(6, 8).to(dtype).requires_grad_()
    fields = _x(6, 5, 8).to(dtype).requires_grad_()
    grad = _x(6, 15).to(dtype)
    registry.create("dot", {}, [(8,), (5, 8)])(bottom, fields).backward(grad)
    got = bottom.grad.clone(), fields.grad.clone()
    bottom.grad = fields.grad = None
    allf = torch.cat([bottom.unsqueeze(1), fields], dim=1)
    ref = torch.stack([(allf[:, i] * allf[:, j]).sum(-1) for i in range(6) for j in range(i + 1, 6)], dim=1)
    ref.backward(grad)
    tol = {"rtol": 1e-12, "atol": 1e-12} if dtype == torch.float64 else {"rtol": 1e-5, "atol": 1e-5}
    torch.testing.assert_close(got[0], bottom.grad, **tol)
    torch.testing.assert_close(got[1], fields.grad, **tol)


def test_dot_backward_under_bf16_autocast_returns_input_dtype_gradients():
    x = _x(4, 7, 16).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = registry.create("dot", {}, [(7, 16)])(x)
    out.float().sum().backward()
    assert x.grad.dtype == torch.float32
    plain = x.detach().clone().requires_grad_()
    gram = torch.bmm(plain, plain.transpose(1, 2))
    rows, cols = torch.triu_indices(7, 7, offset=1)
    gram[:, rows, cols].sum().backward()
    torch.testing.assert_close(x.grad, plain.grad, rtol=2e-2, atol=2e-2)


def test_fm_equals_pairwise_sum():
    x = _x(3, 6, 4)
    ref = sum((x[:, i] * x[:, j]).sum(-1) for i in range(6) for j in range(i + 1, 6))
    torch.testing.assert_close(registry.create("fm", {}, [(6, 4)])(x), ref.unsqueeze(1))


@pytest.mark.parametrize("low_rank", [None, 3])
def test_cross_equals_loop(low_rank):
    cross = registry.create("cross", {"num_layers": 3, "low_rank": low_rank}, [(9,)])
    x0 = _x(4, 9)
    x = x0
    for down, up in zip(cross.down, cross.up):
        h = x if low_rank is None else x @ down.weight.t()
        x = x0 * (h @ up.weight.t() + up.bias) + x
    torch.testing.assert_close(cross(x0), x)


def test_target_attention_masking_and_reference():
    att = registry.create("target_attention", {"hidden": [8, 4]}, [(5,), (6, 5), (6,)])
    q, seq = _x(3, 5), _x(3, 6, 5)
    mask = torch.rand(3, 6) < 0.6
    mask[2] = False
    out = att(q, seq, mask)
    ref = torch.zeros(3, 5)
    for b in range(3):
        for pos in range(6):
            if mask[b, pos]:
                k = seq[b, pos]
                h = torch.cat([q[b], k, q[b] - k, q[b] * k])
                for layer in att.unit.layers:
                    h = torch.sigmoid(layer.weight @ h + layer.bias)
                ref[b] += (att.score.weight @ h + att.score.bias) * k
    torch.testing.assert_close(out, ref)
    assert (out[2] == 0).all()
    seq2 = seq.clone()
    seq2[~mask] = 100.0  # masked positions contribute nothing
    torch.testing.assert_close(att(q, seq2, mask), out)


def test_staging_pooling_and_loss():
    dense = registry.create("dense_input", {"dtype": "fp32"}, [(3,)])
    assert dense(torch.ones(2, 3, dtype=torch.float64)).dtype == torch.float32
    ids, offs = registry.create("sparse_input", {}, [])(torch.tensor([1, 2], dtype=torch.int32),
                                                         torch.tensor([0, 2], dtype=torch.int32))
    assert ids.dtype == offs.dtype == torch.int64
    lookup = registry.create("embedding_lookup", {"rows": 9, "dim": 3, "table": "t"}, [(4,)])
    tok = torch.randint(0, 9, (5, 4))
    lengths = torch.tensor([0, 1, 4, 2, 3])
    x = lookup(tok)
    for mode in ("sum", "mean"):
        pooled = registry.create("pooling", {"pooling": mode}, [(4, 3)])(x, lengths)
        for b in range(5):
            n = int(lengths[b])
            ref = x[b, :n].sum(0) if n else torch.zeros(3)
            if mode == "mean" and n:
                ref = ref / n
            torch.testing.assert_close(pooled[b], ref)
    loss = registry.create("loss", {"losses": ["bce", "mse"], "weights": [1.0, 0.5]}, [])
    logits = [_x(6, 1), _x(6, 1)]
    labels = torch.stack([(torch.rand(6) < 0.5).float(), _x(6)], dim=1)
    p = torch.sigmoid(logits[0].reshape(-1))
    bce = -(labels[:, 0] * p.log() + (1 - labels[:, 0]) * (1 - p).log()).mean()
    mse = ((logits[1].reshape(-1) - labels[:, 1]) ** 2).mean()
    torch.testing.assert_close(loss(logits, labels), bce + 0.5 * mse)


def test_packed_embedding_from_registry():
    group = PackedGroup("g", 4, "fp32", ("sgd", 0.1, ()), (TableSlot("t", 10, 0),),
                        (GroupField("f", "t", 1, "sum"),))
    op = registry.create("packed_embedding", {"group": group, "seed": 2}, [])
    assert isinstance(op, PackedEmbeddingBag) and op.weight.shape == (10, 4)


@pytest.mark.parametrize("kind,config,shapes,make", [
    ("mlp", {"layers": [32, 16]}, [(24,)], lambda: (_x(64, 24),)),
    ("cross", {"num_layers": 2}, [(24,)], lambda: (_x(64, 24),)),
    ("dot", {}, [(10, 16)], lambda: (_x(64, 10, 16),)),
    ("fm", {}, [(10, 16)], lambda: (_x(64, 10, 16),)),
    ("packed_mlp", {"layers": [16]}, [(24,)] * 4, lambda: (_x(4, 64, 24),)),
    ("target_attention", {}, [(16,), (8, 16), (8,)],
     lambda: (_x(64, 16), _x(64, 8, 16), torch.rand(64, 8) < 0.7)),
])
def test_bf16_autocast_close_to_fp32(kind, config, shapes, make):
    op = registry.create(kind, config, shapes)
    inputs = tuple(x.requires_grad_() if x.is_floating_point() else x for x in make())
    ref = op(*inputs).detach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = op(*inputs)
    assert low.dtype in (torch.bfloat16, torch.float32)
    scale = ref.abs().max().clamp_min(1.0)
    assert float((low.detach().float() - ref).abs().max() / scale) < 0.05
    low.float().sum().backward()  # bf16 backward runs


@pytest.mark.parametrize("fields", [2, 3, 27])
@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float32])
def test_bf16_dot_backward_builds_the_gathered_pair_matrix_bitwise(fields, grad_dtype):
    """`_RowsDot`'s backward (the Dot under CPU autocast) writes G + G^T by row tails: bitwise the
    result of the fp32 column gather it replaced, for a pair gradient that is a column slice of a
    wider one (as the top MLP hands it) and for one of another dtype."""
    from operators.interaction import Dot, _RowsDot
    from operators.lowp import matmul

    gen = torch.Generator().manual_seed(fields)
    scale = torch.rand(33, fields, 1, generator=gen).pow(3) * 8
    x = (torch.randn(33, fields, 16, generator=gen) * scale + 1e-3).bfloat16().requires_grad_()
    pairs = fields * (fields - 1) // 2
    wide = (torch.randn(33, pairs + 16, generator=gen) * torch.rand(33, 1, generator=gen).pow(3) * 10).to(grad_dtype)
    grad = wide[:, 3:3 + pairs]  # not contiguous
    _, mirror = Dot().pairs(fields, torch.device("cpu"))
    out = _RowsDot.apply(x)
    (got,) = torch.autograd.grad(out, x, grad)
    padded = torch.cat([grad.float(), torch.zeros(33, 1)], dim=1)
    sym = padded.index_select(1, mirror).to(torch.bfloat16).view(33, fields, fields)
    want = matmul(torch.bmm, sym, x.detach())
    assert got.dtype == want.dtype == torch.bfloat16
    assert torch.equal(got, want)
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.parametrize("kind,config,shapes,make", [
    ("mlp", {"layers": [6, 3]}, [(7,)], lambda b: (_x(b, 7),)),
    ("linear", {"out": 2}, [(7,), (2, 4)], lambda b: (_x(b, 7), _x(b, 2, 4))),
    ("concat", {}, [(7,), (2, 4)], lambda b: (_x(b, 7), _x(b, 2, 4))),
    ("cross", {"num_layers": 2}, [(7,)], lambda b: (_x(b, 7),)),
    ("dot", {}, [(4,), (3, 4)], lambda b: (_x(b, 4), _x(b, 3, 4))),
    ("fm", {}, [(3, 4)], lambda b: (_x(b, 3, 4),)),
    ("similarity", {"metric": "cosine"}, [(4,), (4,)], lambda b: (_x(b, 4), _x(b, 4))),
    ("target_attention", {}, [(4,), (5, 4), (5,)], lambda b: (_x(b, 4), _x(b, 5, 4), torch.rand(b, 5) < 0.7)),
    ("self_attention", {"num_heads": 2}, [(5, 4)], lambda b: (_x(b, 5, 4), torch.rand(b, 5) < 0.7)),
    ("moe", {"experts": 2, "expert_layers": [3], "heads": ["a", "b"]}, [(7,)], lambda b: (_x(b, 7),)),
    ("ple", {"task_experts": 1, "expert_layers": [3], "heads": ["a", "b"], "levels": 2}, [(7,)],
     lambda b: (_x(b, 7),)),
])
def test_an_empty_batch_runs_forward_and_backward(kind, config, shapes, make):
    """A rank's slice of a global batch smaller than the world (`--nproc 3`, a last batch of one
    row) is empty: fp32 training (oneDNN's linear, the dot's gather, flattened fields) ran each
    operator on 0 rows and raised ("cannot reshape tensor of 0 elements", "could not create a
    primitive descriptor"). Every operator gives (0, width) and zero parameter gradients."""
    op = registry.create(kind, config, shapes)
    full = op(*make(3))
    inputs = tuple(x.requires_grad_() if x.is_floating_point() else x for x in make(0))
    out = op(*inputs)
    assert out.shape == (0, *full.shape[1:])
    out.sum().backward()
    for x in inputs:
        if x.is_floating_point():
            assert x.grad is not None and x.grad.shape == x.shape
    for name, p in op.named_parameters():
        assert p.grad is None or not p.grad.any(), name


def test_flat_rows_of_an_empty_batch():
    """The lowering flattens every field slice (B, F, D) by `flat_rows`: also at B = 0."""
    from operators.dense import flat_rows

    assert flat_rows(torch.zeros(0, 3, 4)).shape == (0, 12)
    assert flat_rows(torch.zeros(0, 5, 3, 4)[:, 1:3]).shape == (0, 24)  # a non-contiguous slice


def test_the_onednn_linear_takes_an_empty_batch():
    """`operators.onednn.linear` on 0 rows (with the ReLU, with `add`): zeros of (0, Out) and zero
    weight and bias gradients, where oneDNN's primitive refuses an empty product."""
    from operators.onednn import linear

    w, b = torch.randn(3, 5, requires_grad=True), torch.randn(3, requires_grad=True)
    for relu, add in ((True, None), (False, torch.zeros(0, 3))):
        x = torch.zeros(0, 5, requires_grad=True)
        y = linear(x, w, b, relu=relu, add=add)
        assert y.shape == (0, 3)
        y.sum().backward()
        assert x.grad.shape == (0, 5) and not w.grad.any() and not b.grad.any()
