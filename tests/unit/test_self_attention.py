"""`self_attention` equals `torch.nn.TransformerEncoder` of the same configuration with padding
(forward and gradients), and its options (pre/post norm, causal, last/mean, positions) each matter."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from operators import registry
from operators.attention import SelfAttention


def skewed_batch(rows: int, length: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A (B, L, D) sequence with zipf-like lengths (1 .. L) and zero padding, and its valid mask."""
    gen = torch.Generator().manual_seed(seed)
    lengths = (length * torch.rand(rows, generator=gen) ** 3).long().clamp(min=1, max=length)
    mask = torch.arange(length)[None, :] < lengths[:, None]
    seq = torch.randn(rows, length, dim, generator=gen, dtype=torch.float64) * 2.0 + 0.5
    return seq * mask.unsqueeze(2), mask


def reference(att: SelfAttention, heads: int, pre_norm: bool) -> nn.TransformerEncoder:
    """A TransformerEncoder holding `att`'s weights (dropout 0, batch first, ReLU)."""
    dim = att.layers[0].out.in_features
    ffn = att.layers[0].ffn_in.out_features
    layer = nn.TransformerEncoderLayer(dim, heads, ffn, dropout=0.0, batch_first=True, norm_first=pre_norm,
                                       dtype=torch.float64)
    enc = nn.TransformerEncoder(layer, len(att.layers), enable_nested_tensor=False)
    with torch.no_grad():
        for mine, ref in zip(att.layers, enc.layers):
            ref.self_attn.in_proj_weight.copy_(mine.qkv.weight)
            ref.self_attn.in_proj_bias.copy_(mine.qkv.bias)
            for a, b in ((ref.self_attn.out_proj, mine.out), (ref.linear1, mine.ffn_in), (ref.linear2, mine.ffn_out),
                         (ref.norm1, mine.norm1), (ref.norm2, mine.norm2)):
                a.weight.copy_(b.weight)
                a.bias.copy_(b.bias)
    return enc


def reference_forward(enc: nn.TransformerEncoder, positions: torch.Tensor, seq: torch.Tensor, mask: torch.Tensor,
                      causal: bool, output: str) -> torch.Tensor:
    length = seq.shape[1]
    upper = torch.triu(torch.ones(length, length, dtype=torch.bool), 1) if causal else None
    states = enc(seq + positions, mask=upper, src_key_padding_mask=~mask)
    if output == "mean":
        return (states * mask.unsqueeze(2)).sum(1) / mask.sum(1, keepdim=True)
    last = mask.sum(1) - 1
    return states[torch.arange(seq.shape[0]), last]


@pytest.mark.parametrize("norm,causal,output", [("post", False, "last"), ("pre", True, "last"),
                                                ("post", True, "mean"), ("pre", False, "mean")])
def test_equals_torch_transformer_encoder_with_padding(norm, causal, output):
    config = {"num_heads": 2, "num_layers": 2, "ffn": 12, "norm": norm, "causal": causal, "output": output}
    torch.manual_seed(3)
    att = registry.create("self_attention", config, [(7, 8)]).double()
    with torch.no_grad():
        for layer in att.layers:  # non-trivial norms
            layer.norm1.weight.uniform_(0.5, 1.5); layer.norm2.bias.uniform_(-0.3, 0.3)
    enc = reference(att, 2, norm == "pre")
    seq, mask = skewed_batch(33, 7, 8, seed=11)
    seq_a, seq_b = seq.clone().requires_grad_(), seq.clone().requires_grad_()
    positions = att.positions.detach().clone().requires_grad_()
    got = att(seq_a, mask)
    want = reference_forward(enc, positions, seq_b, mask, causal, output)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(got)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(seq_a.grad, seq_b.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(att.positions.grad, positions.grad, rtol=1e-9, atol=1e-10)
    for mine, ref in zip(att.layers, enc.layers):
        torch.testing.assert_close(mine.qkv.weight.grad, ref.self_attn.in_proj_weight.grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(mine.ffn_in.weight.grad, ref.linear1.weight.grad, rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(mine.norm1.weight.grad, ref.norm1.weight.grad, rtol=1e-9, atol=1e-10)


def test_padding_is_ignored_and_empty_rows_are_zero():
    torch.manual_seed(0)
    att = SelfAttention(8, 6, num_heads=2, num_layers=1).double()
    seq, mask = skewed_batch(10, 6, 8, seed=2)
    mask[3] = False
    seq[3] = 0.0
    noisy = seq + torch.randn_like(seq) * (~mask).unsqueeze(2)  # change only padding positions
    out = att(seq, mask)
    torch.testing.assert_close(att(noisy, mask), out)
    assert torch.equal(out[3], torch.zeros(8, dtype=torch.float64))
    assert torch.isfinite(out).all()


def test_options_change_the_result():
    seq, mask = skewed_batch(16, 5, 8, seed=4)
    outs = {}
    for name, extra in {"base": {}, "pre": {"norm": "pre"}, "causal": {"causal": True}, "mean": {"output": "mean"},
                        "no_positions": {"positional": "none"}}.items():
        torch.manual_seed(1)
        att = registry.create("self_attention", {"num_heads": 2, "num_layers": 2, **extra}, [(5, 8)]).double()
        outs[name] = att(seq, mask)
    assert outs["no_positions"].shape == (16, 8)
    for name in ("pre", "causal", "mean", "no_positions"):
        assert not torch.allclose(outs[name], outs["base"]), name


def test_dropout_trains_and_is_off_in_eval():
    seq, mask = skewed_batch(16, 5, 8, seed=5)
    att = SelfAttention(8, 5, num_heads=2, dropout=0.3).double()
    drops = [m for m in att.modules() if m.__class__.__name__ == "SeededDropout"]
    assert len(drops) == 3
    for i, d in enumerate(drops):
        d.reseed(100 + i)
    trained = att(seq, mask)
    att.eval()
    assert not torch.allclose(trained, att(seq, mask))
    torch.testing.assert_close(att(seq, mask), att(seq, mask))


SPEC = {
    "name": "sa",
    "features": [{"name": "item", "type": "categorical", "table": "items"},
                 {"name": "hist", "type": "sequence", "table": "items", "max_len": 10, "pooling": "none"}],
    "tables": [{"name": "items", "vocab": 50, "dim": 8}],
    "modules": [{"name": "enc", "kind": "self_attention", "inputs": ["hist"], "num_heads": 2, "num_layers": 1},
                {"name": "top", "kind": "mlp", "inputs": ["enc", "item"], "layers": [4]}],
    "heads": [{"name": "ctr", "input": "top"}],
    "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adam", "lr": 0.001}},
}


def test_cost_model_prices_layers_and_the_quadratic_attention():
    import copy

    from flowrec.graph.build import build_graph
    from flowrec.planner.op_work import op_work
    from flowrec.spec.load import spec_from_dict

    def work(layers: int, length: int):
        doc = copy.deepcopy(SPEC)
        doc["modules"][0]["num_layers"] = layers
        doc["features"][1]["max_len"] = length
        op = build_graph(spec_from_dict(doc)).nodes["enc"]["op"]
        return op, op_work(op, 64, 1)

    op, one = work(1, 10)
    assert op.out_shape == ("B", 8) and op.flops > 0 and op.param_bytes > 0
    assert (10, 4, 10, 128) in one.forward.gemms  # q k^T per (sample, head)
    _, two = work(2, 10)
    assert len(two.forward.gemms) == 2 * len(one.forward.gemms) > 0
    _, longer = work(1, 20)
    assert sum(longer.forward.elementwise) > 2 * sum(one.forward.elementwise)


def test_invalid_options_are_reported_together_with_their_paths():
    import copy

    from flowrec.spec.validate import validate_document

    doc = copy.deepcopy(SPEC)
    doc["modules"][0].update(num_heads=3, norm="middle", inputs=["hist", "item"])
    doc["modules"][1]["inputs"] = ["enc", "hist"]
    issues = [str(i) for i in validate_document(doc)]
    text = "\n".join(issues)
    assert "modules[0].norm" in text and "modules[0].inputs" in text, text
    doc = copy.deepcopy(SPEC)
    doc["modules"][0]["num_heads"] = 3
    doc["modules"][1]["inputs"] = ["enc", "hist"]
    text = "\n".join(str(i) for i in validate_document(doc))
    assert "modules[0].num_heads" in text and "3 heads do not divide the sequence dim 8" in text, text
    assert "modules[1].inputs[1]" in text and "pooling none" in text, text


@pytest.mark.parametrize("norm,causal", [("post", False), ("pre", True)])
def test_target_output_equals_the_encoder_over_sequence_then_target(norm, causal):
    """output target (BST): the encoder over [sequence padded to L, target] with the padding keys
    masked; the output is the target position's state (forward and gradients)."""
    config = {"num_heads": 2, "num_layers": 2, "ffn": 12, "norm": norm, "causal": causal, "output": "target"}
    torch.manual_seed(5)
    att = registry.create("self_attention", config, [(6, 8), (8,)]).double()
    assert att.positions.shape == (7, 8)  # the target's position after the sequence's six
    enc = reference(att, 2, norm == "pre")
    seq, mask = skewed_batch(29, 6, 8, seed=13)
    target = torch.randn(29, 8, generator=torch.Generator().manual_seed(2), dtype=torch.float64) + 0.3
    seq_a, seq_b = seq.clone().requires_grad_(), seq.clone().requires_grad_()
    tgt_a, tgt_b = target.clone().requires_grad_(), target.clone().requires_grad_()
    got = att(seq_a, mask, tgt_a)
    want = target_reference(att, enc, seq_b, mask, tgt_b, causal)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    weights = torch.randn_like(got)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    torch.testing.assert_close(seq_a.grad, seq_b.grad, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(tgt_a.grad, tgt_b.grad, rtol=1e-9, atol=1e-10)
    assert float(tgt_a.grad.abs().sum()) > 0  # the target is read
    other = att(seq, mask, target.flip(0))  # another candidate: another output for the same history
    assert not torch.allclose(other, got.detach())


def target_reference(att, enc, seq: torch.Tensor, mask: torch.Tensor, target: torch.Tensor,
                     causal: bool) -> torch.Tensor:
    """`output: target` by `nn.TransformerEncoder` (`enc`): the target appended after the sequence's
    positions, the padding keys masked; the target position's output."""
    full = torch.cat([seq, target.unsqueeze(1)], dim=1)
    full_mask = torch.cat([mask, torch.ones(len(seq), 1, dtype=torch.bool)], dim=1)
    width = full.shape[1]
    upper = torch.triu(torch.ones(width, width, dtype=torch.bool), 1) if causal else None
    return enc(full + att.positions.detach(), mask=upper, src_key_padding_mask=~full_mask)[:, -1]


@pytest.mark.parametrize("causal", [False, True])
def test_target_output_over_an_empty_history_attends_to_the_target_alone(causal):
    """output target with an empty history (a new user): every sequence key is padding, so the
    target attends to itself alone, as `torch.nn.TransformerEncoder` with the padding keys masked
    computes it; what the padding positions hold (flowrec's lookups: zeros, plus the learned
    positions) changes nothing."""
    config = {"num_heads": 2, "num_layers": 2, "ffn": 12, "causal": causal, "output": "target"}
    torch.manual_seed(8)
    att = registry.create("self_attention", config, [(6, 8), (8,)]).double()
    enc = reference(att, 2, False)
    seq, mask = skewed_batch(9, 6, 8, seed=21)
    mask[[0, 4, 8]] = False  # three empty histories among non-empty ones
    seq = seq * mask.unsqueeze(2)
    target = torch.randn(9, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64) + 0.3
    tgt_a, tgt_b = target.clone().requires_grad_(), target.clone().requires_grad_()
    got = att(seq, mask, tgt_a)
    want = target_reference(att, enc, seq, mask, tgt_b, causal)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
    (got * want.detach()).sum().backward()
    (want * want.detach()).sum().backward()
    torch.testing.assert_close(tgt_a.grad, tgt_b.grad, rtol=1e-9, atol=1e-10)
    noisy = seq + torch.randn_like(seq) * (~mask).unsqueeze(2)  # change only padding positions
    torch.testing.assert_close(att(noisy, mask, target), got.detach(), rtol=1e-10, atol=1e-10)


def test_a_target_of_several_fields_is_one_line_at_validate_and_one_field_selectors_are_accepted():
    """`inputs: [hist, "@sparse"]` with output target passed validate and stopped the training plan
    ('self_attention takes [sequence (L, D)] and a target (D,), got [(10, 8), (8,), (8,)]')."""
    import copy

    from flowrec.spec.validate import validate_document

    doc = copy.deepcopy(SPEC)
    doc["features"].append({"name": "user", "type": "categorical", "vocab": 9, "dim": 8, "tags": ["one"]})
    doc["modules"][0].update(inputs=["hist", "@sparse"], output="target")
    doc["modules"][1]["inputs"] = ["enc"]
    assert [str(i) for i in validate_document(doc)] == [
        "modules[0].inputs[1]: the target of self_attention is one vector (a feature or a module), "
        "not 2 fields (item, user)"]
    doc["modules"][0]["inputs"] = ["hist", "@one"]  # a selector of one field: that field
    doc["modules"][1]["inputs"] = ["enc", "item"]
    assert validate_document(doc) == []
