"""The pack pass at scale: its one-pass slot rewrite gives exactly the plan of the old per-group,
quadratic one (kept below as the reference) on random specs, and reads a number of slots linear in
the fields (`tools/bench_plan_fields.py` times it)."""
from __future__ import annotations

import pickle
import random
from dataclasses import replace

import pytest

from flowrec.graph.build import build_graph, make_op
from flowrec.graph.edges import Slot, input_slots, set_inputs
from flowrec.graph.shapes import sizing
from flowrec.graph.types import DTYPE_BYTES, PackedGroup, PassContext, PassResult
from flowrec.graph.packing import group_layout
from flowrec.planner.manager import PIPELINE, PassManager
from flowrec.planner.passes import pack as pack_module
from flowrec.planner.passes.meta import plan_meta, reorder
from flowrec.spec.load import spec_from_dict


# --- the reference: the pack pass's embedding part as it was (one rewrite of every consumer per group)

def reference_pack(graph, ctx):
    g = graph.copy()
    packing = ctx.spec.plan.packing if ctx.packing is None else ctx.packing
    notes: list[str] = []
    if any(g.nodes[n]["op"].kind == "embedding_lookup" for n in g):
        groups = group_layout(ctx.spec, packing)
        for group in groups:
            _old_pack_group(g, group)
        g.graph["plan"] = replace(plan_meta(g), groups=groups)
        notes += pack_module._group_notes(groups, packing)
    if packing:
        notes += pack_module._pack_mlps(g) + pack_module._pack_experts(g)
    if not notes:
        return PassResult(graph, False, ("nothing left to pack",))
    return PassResult(reorder(g), True, tuple(notes))


def _old_pack_group(g, group: PackedGroup) -> None:
    ids, emb = f"ids_{group.name}", f"emb_{group.name}"
    bags = group.bags_per_sample
    fields = tuple((f.feature, f.table, f.max_len, f.pooling) for f in group.fields)
    g.add_node(ids, op=make_op(ids, "sparse_input", (bags,), {
        "bags": bags, "group": group.name, "fields": tuple(f.feature for f in group.fields)}))
    attrs = {
        "group": group.name, "dim": group.dim, "rows": group.rows, "fields": fields,
        "tables": tuple((t.table, t.rows, t.row_offset) for t in group.tables),
        "bags": bags, "optimizer": group.optimizer[0],
    }
    size = sizing("packed_embedding", attrs, [(bags,)])
    g.add_node(emb, op=make_op(emb, "packed_embedding", size.out, attrs, dtype=group.dtype,
                               flops=size.flops,
                               param_bytes=group.rows * group.dim * DTYPE_BYTES[group.dtype]))
    set_inputs(g, emb, [Slot(0, ids, (), (bags,))])
    old: dict[str, str] = {}
    for f in group.fields:
        old[f"lookup_{f.feature}"] = old[f"pool_{f.feature}"] = f.feature
    consumers = {v for n in old if n in g for v in g.successors(n)} - set(old)
    for node in sorted(consumers):
        slots = [
            Slot(s.port, emb, (old[s.source],), s.shape) if s.source in old else s
            for s in input_slots(g, node)
        ]
        keeps = pack_module._keeps_slots(g.nodes[node]["op"])
        set_inputs(g, node, slots if keeps else _old_merge_pooled(slots, group))
    for f in group.fields:
        g.remove_nodes_from([f"ids_{f.feature}", f"lookup_{f.feature}", f"pool_{f.feature}"])


def _old_merge_pooled(slots, group):
    pooled = {f.feature for f in group.fields if f.pooling != "none"}
    out: list[Slot] = []
    for s in slots:
        prev = out[-1] if out else None
        if (prev is not None and prev.source == s.source and s.fields
                and set(prev.fields + s.fields) <= pooled
                and prev.source == f"emb_{group.name}"):
            out[-1] = Slot(prev.port, prev.source, prev.fields + s.fields,
                           (len(prev.fields) + len(s.fields), group.dim))
        else:
            out.append(s)
    return out


# --- random specs

def random_doc(seed: int) -> dict:
    """A random valid spec: shared and own tables of skewed sizes, dims, bags, mean pooling, a
    sequence for target attention and BST, per-table optimizers, modules reading fields in random order
    with dense features and modules between them, a similarity's towers; packing on or off."""
    rng = random.Random(seed)
    dims = rng.sample([1, 2, 4, 8, 16], rng.randint(1, 3))
    tables = [{"name": f"t{i}", "vocab": int(10 ** rng.uniform(1, 6)), "dim": rng.choice(dims)}
              for i in range(rng.randint(1, 4))]
    feats: list[dict] = [{"name": f"d{i}", "type": "dense", "tags": ["mix"]} for i in range(rng.randint(1, 3))]
    for i in range(rng.randint(4, 40)):
        f: dict = {"name": f"f{i}", "type": "categorical", "tags": [rng.choice(["mix", "a", "b"])]}
        if rng.random() < 0.3:
            f["table"] = rng.choice(tables)["name"]
        else:
            f["hash_buckets"] = int(10 ** rng.uniform(0.5, 6.5)) + 2  # skewed: mostly small, a few huge
            f["dim"] = rng.choice(dims)
            if rng.random() < 0.15:
                f["optimizer"] = {"name": "sgd", "lr": 0.1}
        if rng.random() < 0.3:
            f["max_len"] = rng.randint(2, 6)
            f["pooling"] = rng.choice(["sum", "mean"])
        feats.append(f)
    rng.shuffle(feats)
    dim_of = {t["name"]: t["dim"] for t in tables}
    sparse = [f for f in feats if f["type"] == "categorical"]
    by_dim: dict[int, list[str]] = {}
    for f in sparse:
        by_dim.setdefault(f.get("dim") or dim_of[f["table"]], []).append(f["name"])
    modules = [{"name": "bot", "kind": "mlp", "inputs": ["@dense"], "layers": [4]}]
    names = [f["name"] for f in feats] + ["bot"]
    for k in range(rng.randint(1, 3)):  # concats of random subsets in random order
        modules.append({"name": f"cat{k}", "kind": "concat", "inputs": rng.sample(names, rng.randint(1, len(names)))})
    shared_dim, members = max(by_dim.items(), key=lambda kv: len(kv[1]))
    if len(members) >= 2:  # a dot over the fields of one dim, in random order
        modules.append({"name": "inter", "kind": "dot", "inputs": rng.sample(members, len(members))})
        if len(members) >= 2 and shared_dim > 1:
            modules.append({"name": "sim", "kind": "similarity", "inputs": rng.sample(members, 2)})
    seq_table = rng.choice(tables)
    feats.append({"name": "hist", "type": "sequence", "table": seq_table["name"], "max_len": 4, "pooling": "none"})
    feats.append({"name": "cand", "type": "categorical", "table": seq_table["name"]})
    modules.append({"name": "att", "kind": "target_attention", "inputs": ["cand", "hist"], "hidden": [4]})
    if rng.random() < 0.5:  # BST: the sequence (pooling none) before a pooled field of its table
        modules.append({"name": "bst", "kind": "self_attention", "inputs": ["hist", "cand"], "output": "target"})
    for sel in ("@mix", "@a", "@sparse"):
        if rng.random() < 0.5:
            modules.append({"name": f"sel{sel[1:]}", "kind": "concat", "inputs": [sel, "att"]})
    modules.append({"name": "top", "kind": "concat", "inputs": [m["name"] for m in modules]})
    return {
        "name": f"random{seed}", "features": feats, "tables": tables, "modules": modules,
        "heads": [{"name": "h", "input": "top"}],
        "optimizer": {"dense": {"name": "adam", "lr": 0.001}, "sparse": {"name": "adagrad", "lr": 0.01}},
        "training": {"batch_size": 64}, "plan": {"packing": rng.random() < 0.7},
    }


def snapshot(g) -> bytes:
    return pickle.dumps((list(g.nodes(data=True)), list(g.edges(data=True)), dict(g.graph)))


def valid_specs(count: int, first_seed: int):
    from flowrec.spec.validate import validate_document

    seed = first_seed
    while count:
        doc = random_doc(seed)
        seed += 1
        if validate_document(doc):  # a draw the spec language refuses (e.g. a module of no width)
            continue
        count -= 1
        yield spec_from_dict(doc)


@pytest.mark.parametrize("first_seed", [0, 1000, 2000])
def test_the_one_pass_rewrite_gives_the_old_plan(first_seed):
    """Fresh random specs: the packed graph, its notes and the whole plan after every later pass
    equal those of the old per-group rewrite, byte for byte."""
    reference = PassManager(pipeline=(("pack", "packed", reference_pack),) + PIPELINE[1:])
    merged_runs = 0
    for spec in valid_specs(12, first_seed):
        ctx = PassContext(spec=spec)
        new, old = pack_module.pack(build_graph(spec), ctx), reference_pack(build_graph(spec), ctx)
        assert new.notes == old.notes and new.modified == old.modified
        assert snapshot(new.graph) == snapshot(old.graph), spec.name
        merged_runs += sum(len(s.fields) > 1 for n in new.graph for s in input_slots(new.graph, n)
                           if s.source.startswith("emb_"))
        planned, _ = PassManager().run_until(build_graph(spec), ctx, "interleaved")
        expected, _ = reference.run_until(build_graph(spec), ctx, "interleaved")
        assert snapshot(planned) == snapshot(expected), spec.name
    assert merged_runs > 0  # the draws exercise the merge of pooled runs


def test_the_slots_the_pass_rewrites_grow_linearly_with_the_fields(monkeypatch):
    """Packing off, n fields make n groups, each read by one linear module: the pass reads and
    writes O(n) slots (the old rewrite read every consumer's n slots once per group: n^2)."""
    n = 2000
    feats = [{"name": f"f{i}", "type": "categorical", "hash_buckets": 10 + i, "dim": 4, "tags": ["x"]}
             for i in range(n)]
    spec = spec_from_dict({
        "name": "wide", "features": [{"name": "d", "type": "dense"}] + feats,
        "modules": [{"name": "lin", "kind": "linear", "inputs": ["@x", "d"], "out": 1}],
        "heads": [{"name": "h", "input": "lin"}], "plan": {"packing": False}})
    moved = {"read": 0, "written": 0}

    def counted_input_slots(g, node):
        slots = input_slots(g, node)
        moved["read"] += len(slots)
        return slots

    def counted_set_inputs(g, node, slots):
        moved["written"] += len(slots)
        set_inputs(g, node, slots)

    monkeypatch.setattr(pack_module, "input_slots", counted_input_slots)
    monkeypatch.setattr(pack_module, "set_inputs", counted_set_inputs)
    result = pack_module.pack(build_graph(spec), PassContext(spec=spec))
    assert len(result.graph.graph["plan"].groups) == n
    assert len(input_slots(result.graph, "lin")) == n + 1  # no merge across groups
    assert moved["read"] <= 3 * n and moved["written"] <= 3 * n, moved


def test_the_group_layout_makes_calls_linear_in_the_tables():
    """Packing off, one group per table: `group_layout` made one pass over every feature per group
    (and a tuple.index of dataclass compares per group): 4x the tables made 16x the calls."""
    import cProfile
    import pstats

    def calls(n):
        spec = spec_from_dict({
            "name": "wide", "features": [{"name": f"f{i}", "type": "categorical", "hash_buckets": 10 + i, "dim": 4}
                                         for i in range(n)],
            "modules": [{"name": "lin", "kind": "linear", "inputs": ["@sparse"], "out": 1}],
            "heads": [{"name": "h", "input": "lin"}]})
        profiler = cProfile.Profile()
        groups = profiler.runcall(group_layout, spec, False)
        assert [len(g.fields) for g in groups] == [1] * n
        return pstats.Stats(profiler).total_calls

    small, large = calls(300), calls(1200)
    assert large < 6 * small, (small, large)
