"""Packed embedding bag: equals per-table lookups; fused optimizers equal dense references."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from flowrec.graph.types import GroupField, PackedGroup, TableSlot
from operators.casting import compute_casting
from operators.embedding import PackedEmbeddingBag, init_table_rows, mean_bag_flags
from operators.random_batches import random_batch

B = 32


def _group(dim: int, optimizer=("sgd", 0.1, ()), dtype: str = "fp64") -> PackedGroup:
    tables = (TableSlot("a", 40, 0), TableSlot("one", 1, 40), TableSlot("b", 300, 41),
              TableSlot("c", 7, 341))
    fields = (GroupField("fa", "a", 1, "sum"), GroupField("fone", "one", 2, "mean"),
              GroupField("fb", "b", 6, "mean"), GroupField("fb2", "b", 3, "sum"),
              GroupField("fseq", "c", 4, "none"), GroupField("fa2", "a", 1, "sum"))
    return PackedGroup("g", dim, dtype, optimizer, tables, fields)


def _gen() -> torch.Generator:
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31 - 1, (1,))))


def _field_batches(group, batch):
    """Split a packed batch into per-field (ids, offsets) in each table's own row numbering."""
    S = group.bags_per_sample
    lengths = (batch.offsets[1:] - batch.offsets[:-1]).reshape(-1, S)  # (B, S)
    bag_col = torch.repeat_interleave(torch.arange(lengths.numel()) % S, lengths.reshape(-1))
    slots = {t.table: t for t in group.tables}
    out = {}
    for f in group.fields:
        sl = group.field_bags()[f.feature]
        mask = (bag_col >= sl.start) & (bag_col < sl.stop)
        lens = lengths[:, sl].reshape(-1)
        offs = torch.zeros(lens.numel() + 1, dtype=torch.int64)
        torch.cumsum(lens, 0, out=offs[1:])
        out[f.feature] = (batch.ids[mask] - slots[f.table].row_offset, offs)
    return out


def _reference_forward(group, tables, batch):
    """Per-table nn.functional.embedding_bag, one call per field -> (B, S, D)."""
    parts = []
    for f, (ids, offs) in zip(group.fields, _field_batches(group, batch).values()):
        mode = "mean" if f.pooling == "mean" else "sum"
        out = F.embedding_bag(ids, tables[f.table], offs, mode=mode, include_last_offset=True)
        width = f.max_len if f.pooling == "none" else 1
        parts.append(out.reshape(-1, width, group.dim))
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("dim", [1, 5, 16, 256])
def test_packed_forward_bitwise_equals_per_table(dim):
    gen = _gen()
    group = _group(dim, dtype="fp32")
    emb = PackedEmbeddingBag(group, seed=int(torch.randint(0, 1000, (1,), generator=gen)))
    starts = sorted((t.row_offset, t.row_offset + t.rows) for t in group.tables)
    assert all(a[1] <= b[0] for a, b in zip(starts, starts[1:]))  # disjoint row ranges
    tables = {t.table: emb.table_rows(t.table).clone() for t in group.tables}
    batch = random_batch(group, B, gen, empty_prob=0.3)
    out = emb(batch.ids, batch.offsets)
    assert out.shape == (B, group.bags_per_sample, dim)
    ref = _reference_forward(group, tables, batch)
    assert torch.equal(out.detach(), ref)
    assert torch.equal(emb.lookup(batch.ids, batch.offsets), ref)


def test_init_is_per_table_deterministic():
    group = _group(8, dtype="fp32")
    emb = PackedEmbeddingBag(group, seed=3)
    for t in group.tables:
        ref = init_table_rows(t.table, t.rows, 8, seed=3)
        assert torch.equal(emb.table_rows(t.table), ref)
        bound = (1.0 / t.rows) ** 0.5
        assert emb.table_rows(t.table).abs().max() <= bound
    assert not torch.equal(emb.table_rows("a"), PackedEmbeddingBag(group, seed=4).table_rows("a"))
    assert list(emb.parameters()) == []
    assert set(emb.state_dict()) == {"weight", "state"}


@pytest.mark.parametrize("threads", [1, 3])
def test_tables_drawn_on_threads_are_the_rows_drawn_one_by_one(monkeypatch, threads):
    """A large host table's tables are drawn on torch's intra-op thread count of threads, each from
    its own generator: bitwise the rows each table draws alone, whatever the thread count, every
    table filled (none left uninitialized) and each within its own bound."""
    from operators import embedding

    group = _group(8, dtype="fp32")
    monkeypatch.setattr(embedding, "PARALLEL_INIT_ROWS", 2)  # this small group is drawn as a large one
    drawn: list[str] = []
    plain = embedding.init_table_rows
    monkeypatch.setattr(embedding, "init_table_rows",
                        lambda table, *a, **k: (drawn.append(table), plain(table, *a, **k))[1])
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seed = int(torch.randint(0, 2**31 - 1, (1,)))
        emb = PackedEmbeddingBag(group, seed=seed)
    finally:
        torch.set_num_threads(saved)
    assert sorted(drawn) == sorted(t.table for t in group.tables)
    for t in group.tables:
        assert torch.equal(emb.table_rows(t.table), plain(t.table, t.rows, 8, seed=seed))
    assert emb.weight.abs().max() <= 1.0 and bool((emb.weight != 0).any(dim=1).all())


def test_a_table_that_cannot_be_drawn_fails_the_build(monkeypatch):
    from operators import embedding

    monkeypatch.setattr(embedding, "PARALLEL_INIT_ROWS", 2)

    def broken(table, *a, **k):
        raise RuntimeError(f"no rows for {table}")

    monkeypatch.setattr(embedding, "init_table_rows", broken)
    saved = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        with pytest.raises(RuntimeError, match="no rows for"):
            PackedEmbeddingBag(_group(8, dtype="fp32"))
    finally:
        torch.set_num_threads(saved)


def _dense_reference(name, params, lr, tables, grads, touched, state):
    """Written-out row-wise adagrad / lazy adam on dense copies (touched rows only)."""
    for t, w in tables.items():
        g, rows = grads[t], touched[t]
        st = state.setdefault(t, {"s": torch.zeros(w.shape[0], 1, dtype=w.dtype),
                                  "m": torch.zeros_like(w), "v": torch.zeros_like(w),
                                  "step": torch.zeros(w.shape[0], dtype=w.dtype)})
        for r in rows.tolist():
            if name == "sgd":  # lazy weight decay: touched rows only
                w[r] -= lr * (g[r] + params.get("weight_decay", 0.0) * w[r])
            elif name == "rowwise_adagrad":
                st["s"][r] += (g[r] ** 2).mean()
                w[r] -= lr * g[r] / (st["s"][r].sqrt() + params.get("eps", 1e-8))
            else:
                b1, b2, eps = params.get("beta1", 0.9), params.get("beta2", 0.999), params.get("eps", 1e-8)
                st["step"][r] += 1
                k = st["step"][r]
                st["m"][r] = b1 * st["m"][r] + (1 - b1) * g[r]
                st["v"][r] = b2 * st["v"][r] + (1 - b2) * g[r] ** 2
                m_hat = st["m"][r] / (1 - b1 ** k)
                v_hat = st["v"][r] / (1 - b2 ** k)
                w[r] -= lr * m_hat / (v_hat.sqrt() + eps)


OPTIMIZER_CASES = [
    ("sgd", 0.5, ()),
    ("sgd", 0.5, (("weight_decay", 0.01),)),
    ("adagrad", 0.3, (("initial_accumulator_value", 0.1),)),
    ("rowwise_adagrad", 0.3, (("eps", 1e-6),)),
    ("adam", 0.05, (("beta1", 0.8),)),
]


@pytest.mark.parametrize("optimizer", OPTIMIZER_CASES, ids=lambda o: o[0] + str(len(o[2])))
@pytest.mark.parametrize("precomputed", [False, True])
def test_fused_optimizer_equals_dense_reference(optimizer, precomputed):
    gen = _gen()
    name, lr, params = optimizer
    group = _group(6, optimizer)
    emb = PackedEmbeddingBag(group, seed=1)
    tables = {t.table: torch.nn.Parameter(emb.table_rows(t.table).clone()) for t in group.tables}
    torch_opt = None  # dense torch.optim where it matches lazy sparse semantics (no weight decay)
    if name == "sgd" and not params:
        torch_opt = torch.optim.SGD(tables.values(), lr=lr, **dict(params))
    elif name == "adagrad":
        torch_opt = torch.optim.Adagrad(tables.values(), lr=lr, **dict(params))
    state: dict = {}
    for _ in range(4):
        batch = random_batch(group, B, gen, empty_prob=0.2)
        weights = torch.randn(B, group.bags_per_sample, group.dim, generator=gen, dtype=torch.float64)
        casting = compute_casting(batch.ids, batch.offsets, mean_bag_flags(group)) if precomputed else None
        (emb(batch.ids, batch.offsets, casting=casting) * weights).sum().backward()
        ref_out = _reference_forward(group, tables, batch)
        (ref_out * weights).sum().backward()
        if torch_opt is not None:
            torch_opt.step()
        else:
            touched = {f.table: [] for f in group.fields}
            for f, (ids, _) in zip(group.fields, _field_batches(group, batch).values()):
                touched[f.table].append(ids)
            touched = {t: torch.unique(torch.cat(v)) for t, v in touched.items()}
            with torch.no_grad():
                _dense_reference(name, dict(params), lr, tables,
                                 {t: p.grad for t, p in tables.items()}, touched, state)
        for p in tables.values():
            p.grad = None
    for t, p in tables.items():
        torch.testing.assert_close(emb.table_rows(t), p.detach(), rtol=1e-9, atol=1e-10)


def test_row_access_roundtrip_moves_state_with_row():
    gen = _gen()
    group = _group(4, ("adam", 0.01, ()), dtype="fp32")
    emb = PackedEmbeddingBag(group)
    batch = random_batch(group, B, gen)
    emb(batch.ids, batch.offsets).sum().backward()
    rows = torch.unique(batch.ids)[:5]
    w, s = emb.read_rows(rows)
    assert s.shape == (5, 2 * 4 + 1) and (s[:, -1] == 1).all()
    other = PackedEmbeddingBag(group, seed=9)
    other.write_rows(rows, w, s)
    w2, s2 = other.read_rows(rows)
    assert torch.equal(w, w2) and torch.equal(s, s2)
    fresh = PackedEmbeddingBag(group, seed=5)
    fresh.load_state_dict(emb.state_dict())
    assert torch.equal(fresh.weight, emb.weight) and torch.equal(fresh.state, emb.state)


def test_no_grad_forward_does_not_update():
    gen = _gen()
    group = _group(4, dtype="fp32")
    emb = PackedEmbeddingBag(group)
    before = emb.weight.clone()
    batch = random_batch(group, B, gen)
    with torch.no_grad():
        out = emb(batch.ids, batch.offsets)
    assert not out.requires_grad and torch.equal(before, emb.weight)


def test_unknown_optimizer_lists_known():
    with pytest.raises(KeyError, match="rowwise_adagrad"):
        PackedEmbeddingBag(_group(4, ("lion", 0.1, ())))
