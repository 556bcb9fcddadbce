"""The serving program looks up each packed group's fields in one `embedding_bag` over the group's
table (`flowrec.serving.lookups`), not one per field: a 1,000-field package's graph held an
embedding_bag per field with four outputs each (three unused), 4,000 of the 7,053 tensor values
`torch.export.load` made fake tensors for. The scores are bitwise those of one lookup per field
(the program of before), with pooled multi-valued fields (sum and mean in one group), empty bags,
unknown ids (row 0), a sequence field, wide (dim 1) fields and half tables; an id outside its own
table is refused, as the lookup of its own table refused it, and so are offsets that are not a
feature's bag bounds, given to the package's program torch-only (serve11: they scored bags of the
next feature's ids, where the lookup per field erred or kept them apart)."""
from __future__ import annotations

import collections
import contextlib
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest
import torch
import torch.nn.functional as F

import flowrec
from flowrec.data.layout import is_multi
from flowrec.graph.kinds import OP_KINDS
from flowrec.planner.contract import scoring_plan
from flowrec.runtime.evaluation.scores import scores
from flowrec.serving.export import export_program
from flowrec.serving.lookups import BAD_OFFSETS, FIELD_BITS, OUT_OF_RANGE, GroupLookup, runs_of, sequence
from flowrec.serving.package import encoded_inputs
from flowrec.serving.pt2_check import check_archive
from flowrec.serving.pt2_load import load_program
from flowrec.serving.pt2_module import program_module
from flowrec.serving.pt2_save import save_program
from flowrec.serving.trained import ServingModel, load_trained
from operators.onednn import torch_gemms

V2_PACKAGE = Path(__file__).parent / "fixtures" / "package_v2"  # written by flowrec before this change (72 KB)
SPEC = """
name: lookups
features:
  - {name: price, type: dense, transform: log1p}
  - {name: item, type: categorical, table: items}
  - {name: user, type: categorical, hash_buckets: 300, dim: 8}
  - {name: tags, type: categorical, hash_buckets: 50, dim: 8, max_len: 3, pooling: sum}
  - {name: genres, type: categorical, vocab: 19, dim: 8, max_len: 4, pooling: mean}
  - {name: topics, type: categorical, hash_buckets: 60, dim: 8, max_len: 3, pooling: mean}
  - {name: history, type: sequence, table: items, max_len: 5, pooling: none}
  - {name: city, type: categorical, hash_buckets: 40, dim: 4}
  - {name: shop, type: categorical, hash_buckets: 70, dim: 4}
  - {name: w1, type: categorical, hash_buckets: 30, dim: 1}
  - {name: w2, type: categorical, hash_buckets: 90, dim: 1}
tables:
  - {name: items, hash_buckets: 120, dim: 8}
modules:
  - {name: attention, kind: target_attention, inputs: [item, history], hidden: [8]}
  - {name: deep, kind: mlp, inputs: [attention, "@sparse", "@dense"], layers: [8]}
heads:
  - {name: click, input: deep, task: binary, loss: bce}
training: {batch_size: 64, eval_every: 0}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serving_lookups")
    (folder / "spec.yaml").write_text(SPEC)
    flowrec.train(folder / "spec.yaml", out=folder / "run", rows=600, max_steps=3)
    return folder / "run"


@pytest.fixture(scope="module")
def serving(run: Path) -> ServingModel:
    trained = load_trained(run, "cpu", scoring_plan)
    model = ServingModel(trained.spec, trained.model).requires_grad_(False).eval()
    model.spec = trained.spec
    return model


@pytest.fixture(scope="module")
def program(serving: ServingModel) -> torch.nn.Module:
    return export_program(serving, serving.spec).module()


def _inputs(spec, rows: int, seed: int) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Fresh skewed rows: zipf ids (row 0, the unknown id, among the most frequent), 0 to max_len ids
    per multi-valued row (empty bags included), log-normal dense values."""
    rng = np.random.default_rng(seed)
    dense = torch.from_numpy(rng.lognormal(0.0, 1.0, (rows, len(spec.dense_features))).astype(np.float32))
    sparse = {}
    for f in spec.sparse_features:
        counts = rng.integers(0, f.max_len + 1, rows) if is_multi(f) else np.ones(rows, np.int64)
        ids = (rng.zipf(1.4, int(counts.sum())) - 1) % spec.table(f.table).rows
        sparse[f.name] = (torch.from_numpy(ids.astype(np.int64)),
                          torch.from_numpy(np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)))
    return dense, sparse


def _per_field(model: ServingModel, dense, sparse, exported: bool = True) -> torch.Tensor:
    """The serving model's forward of before: one embedding_bag per field over its own table; its
    dense layers on torch's GEMMs as an exported program runs them (`exported`, `onednn.torch_gemms`:
    on a CPU that is not Intel's the eager layers run oneDNN's, 1 ulp apart at times), else on the
    eager model's own."""
    with torch_gemms() if exported else contextlib.nullcontext():
        return _per_field_scores(model, dense, sparse)


def _per_field_scores(model: ServingModel, dense, sparse) -> torch.Tensor:
    emb, masks = {}, {}
    for group, fields in model.fields.items():
        parts = []
        for f in fields:
            ids, offsets = sparse[f.feature]
            weight = model.table(f.table).clone()  # a table of its own, as the package held
            if f.pooling == "none":
                parts.append(sequence(ids, offsets, weight, f.max_len))
            else:
                pooled = F.embedding_bag(ids, weight, offsets, mode="mean" if f.pooling == "mean" else "sum",
                                         include_last_offset=True)
                parts.append(pooled.float())
        emb[group] = torch.cat([p.unsqueeze(1) if p.dim() == 2 else p for p in parts], dim=1)
    for step in model.dense_model.steps:
        seq_slot = OP_KINDS[step.kind].sequence_slot
        if seq_slot is not None:
            feature = step.slots[seq_slot].fields[0]
            ids, offsets = sparse[feature]
            length = next(f.max_len for fs in model.fields.values() for f in fs if f.feature == feature)
            masks[step.name] = torch.arange(length).unsqueeze(0) < (offsets[1:] - offsets[:-1]).clamp(
                max=length).unsqueeze(1)
    return scores(model.dense_model.dense_forward(dense, emb, masks), model.tasks, model.dense_model.head_widths)


def test_each_packed_group_is_one_lookup_in_the_exported_program(serving: ServingModel) -> None:
    program = export_program(serving, serving.spec)
    bags = [n for n in program.graph.nodes if n.op == "call_function" and "embedding_bag" in str(n.target)]
    runs = {g: [r.mode for r in runs_of(fields)] for g, fields in serving.fields.items()}
    pooled_fields = sum(f.pooling != "none" for fields in serving.fields.values() for f in fields)
    assert len(bags) == sum(mode != "none" for modes in runs.values() for mode in modes) < pooled_fields
    assert len(serving.tables) == len(serving.fields)  # a table per packed group
    assert any(len(fields) > 2 for fields in serving.fields.values())
    assert sorted(collections.Counter(m for modes in runs.values() for m in modes)) == ["mean", "none", "sum"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_scores_are_bitwise_those_of_one_lookup_per_field(serving: ServingModel, dtype: torch.dtype) -> None:
    saved = [t.data for t in serving.tables]
    try:
        serving.cast_tables(dtype)
        program = export_program(serving, serving.spec).module()
        for rows in (1, 2, 257):
            dense, sparse = _inputs(serving.spec, rows, int.from_bytes(os.urandom(4), "little"))
            assert torch.equal(serving(dense, sparse), _per_field(serving, dense, sparse, exported=False))
            expected = _per_field(serving, dense, sparse)
            assert torch.equal(program(dense, sparse), expected)
        assert len(torch.unique(expected)) > 50  # scores that differ from row to row
        assert (sparse["genres"][1].diff() == 0).any() and (sparse["user"][0] == 0).any()  # empty bags, unknown ids
    finally:
        for weight, data in zip(serving.tables, saved):
            weight.data = data


@pytest.mark.parametrize("feature,bad", [("shop", "rows"), ("w1", "rows"), ("tags", "rows"), ("city", -1)])
def test_an_id_outside_its_own_table_is_refused(serving: ServingModel, program, feature: str, bad) -> None:
    """In the group's table the row past a table's end is the next table's first row: scoring it
    would read another table's row without a word (the program of before refused it)."""
    dense, sparse = _inputs(serving.spec, 16, int.from_bytes(os.urandom(4), "little"))
    program(dense, sparse)
    ids, offsets = sparse[feature]
    assert len(ids)
    wrong = ids.clone()
    wrong[-1] = serving.spec.table(next(f.table for f in serving.spec.sparse_features if f.name == feature)).rows if bad == "rows" else bad
    with pytest.raises(RuntimeError, match="outside its table"):
        program(dense, {**sparse, feature: (wrong, offsets)})


def test_a_logical_table_is_a_view_of_its_groups_table(serving: ServingModel) -> None:
    for table, (group, first, rows) in serving.places.items():
        view = serving.table(table)
        assert view.shape == (rows, serving.spec.table(table).dim)
        assert view.data_ptr() == serving.tables[group].data_ptr() + first * view.stride(0) * view.element_size()


def test_a_version_2_package_still_loads_and_scores_as_its_own_program(tmp_path: Path) -> None:
    """A package exported before (version 2: a table per logical table, a lookup per field) is
    checked against its own layout and scores as torch alone scores its program."""
    pkg = Path(shutil.copytree(V2_PACKAGE, tmp_path / "pkg"))
    model = flowrec.load_model(pkg)
    plain = torch.export.load(pkg / "model.pt2")
    assert model.manifest["version"] == 2
    assert sum(name.startswith("tables.") for name in plain.state_dict) == len(model.spec.tables) == 5
    plain = plain.module()
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    dense, sparse = _inputs(model.spec, 300, int(rng.integers(1 << 31)))
    expected = plain(dense, sparse)
    assert torch.equal(model.program(dense, sparse), expected) and len(torch.unique(expected)) > 20
    n = 200
    rows = pd.DataFrame({"price": rng.lognormal(0.0, 1.5, n), "tags": [[str(v) for v in rng.zipf(1.3, k)]
                                                                      for k in rng.integers(0, 4, n)],
                         **{c: rng.zipf(1.3, n) for c in ("user", "city", "w1", "w2")}})
    scores = model.predict(rows)["click"].to_numpy()
    dense, sparse = encoded_inputs(model.spec, model.encoder.encode(pa.Table.from_pandas(rows), labels=False))
    assert np.array_equal(scores, plain(dense, sparse)[:, 0].numpy())


def _full_bags(spec, rows: int, seed: int) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Rows whose every bag holds 1 to max_len ids (so that each feature's offsets rise strictly)."""
    rng = np.random.default_rng(seed)
    dense = torch.from_numpy(rng.lognormal(0.0, 1.0, (rows, len(spec.dense_features))).astype(np.float32))
    sparse = {}
    for f in spec.sparse_features:
        counts = rng.integers(1, f.max_len + 1, rows)
        ids = rng.integers(0, spec.table(f.table).rows, int(counts.sum()))
        sparse[f.name] = (torch.from_numpy(ids), torch.from_numpy(np.concatenate([[0], np.cumsum(counts)])))
    return dense, sparse


HOSTILE = {  # one feature's (ids, offsets) made to disagree, as a torch-only caller may pass them
    "offsets end before the last id": lambda i, o: (i, torch.cat([o[:-1], o[-1:] - 1])),
    "an id past the offsets' end": lambda i, o: (torch.cat([i, i[:1]]), o),
    "offsets end past the last id": lambda i, o: (i, torch.cat([o[:-1], o[-1:] + 1])),
    "an id missing": lambda i, o: (i[:-1], o),
    "offsets start past 0": lambda i, o: (i, torch.cat([o[:1] + 1, o[1:]])),
    "decreasing offsets": lambda i, o: (i, torch.cat([o[:1], o[2:3], o[1:2], o[3:]])),
    "offsets all 0": lambda i, o: (i, torch.zeros_like(o)),
    "an offset past the ids": lambda i, o: (i, torch.cat([o[:1], o[-1:] + 3, o[2:]])),
    "a negative offset": lambda i, o: (i, torch.cat([o[:1], -o[1:2] - 1, o[2:]])),
    "a negative id": lambda i, o: (torch.cat([i[:1] * 0 - 1, i[1:]]), o),
}
NEIGHBOURS = [("item", "user"), ("user", "tags"), ("genres", "topics"), ("city", "shop"), ("w1", "w2")]  # in one lookup


def _moved(sparse, feature: str, to: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """`feature`'s last id moved to the front of `to`'s ids (as id 0, inside every table), both
    offsets kept: as many ids side by side, one offset past its feature's ids and one short of the
    next's."""
    (ids, offsets), (next_ids, next_offsets) = sparse[feature], sparse[to]
    return {**sparse, feature: (ids[:-1], offsets), to: (torch.cat([ids[-1:] * 0, next_ids]), next_offsets)}


def _hostile_inputs(spec, seed: int):
    """(what, dense, sparse) of each way of `HOSTILE` for every sparse feature, and of an id moved
    to the next feature of the same lookup, in fresh rows."""
    dense, sparse = _full_bags(spec, 6, seed)
    for case, make in HOSTILE.items():
        for f in spec.sparse_features:
            yield f"{case} ({f.name})", dense, {**sparse, f.name: make(*sparse[f.name])}
    for feature, to in NEIGHBOURS:
        yield f"an id of {feature} moved to {to}", dense, _moved(sparse, feature, to)


@pytest.fixture(scope="module")
def torch_only(run: Path, serving: ServingModel) -> torch.nn.Module:
    """The package's program as the documented torch-only call loads it (torch's guarded module),
    its tables checked to be the serving model's (so `_per_field` looks up the same rows)."""
    from typer.testing import CliRunner

    from flowrec.cli import app

    pkg = run.parent / "pkg"
    result = CliRunner().invoke(app, ["export", str(run), str(pkg), "-q"])
    assert result.exit_code == 0, result.output
    program = torch.export.load(pkg / "model.pt2")
    tables = [program.state_dict[f"tables.{i}"] for i in range(len(serving.tables))]
    assert len(tables) == 3 and all(map(torch.equal, tables, serving.tables))
    return program.module()


def test_hostile_ids_and_offsets_never_score_other_bags_than_a_lookup_per_field(serving: ServingModel,
                                                                                 torch_only) -> None:
    """A feature whose ids and offsets disagree: the program either refuses it or scores what a lookup
    per field over its own table scores (format 2's program), never bags holding another feature's
    ids. Before, a group's bags were found in its joined ids from each feature's last offset: offsets
    ending before (or past) a feature's ids, or all 0, decreasing, or past the ids in the middle, and
    an id moved to the next feature, scored bags of the neighbour's ids without a word."""
    seed = int.from_bytes(os.urandom(4), "little")
    dense, sparse = _full_bags(serving.spec, 6, seed)
    assert torch.equal(torch_only(dense, sparse), _per_field(serving, dense, sparse))
    wrong = []
    for what, dense, sparse in _hostile_inputs(serving.spec, seed):
        try:
            scores = torch_only(dense, sparse)
        except (RuntimeError, IndexError):  # refused (before: at times torch's own index error)
            continue
        try:
            same = torch.equal(scores, _per_field(serving, dense, sparse))
        except (RuntimeError, IndexError):  # the lookup per field refused it
            same = False
        if not same:
            wrong.append(what)
    assert not wrong, f"scores of other bags than a lookup per field (seed {seed}): {wrong}"


def test_hostile_ids_and_offsets_are_refused_in_one_line(serving: ServingModel, torch_only) -> None:
    """Every such input is refused by the program itself, in one line that says which of the two
    disagrees (the documented contract: table-local ids, offsets 0 first, never decreasing, the id
    count last), pooled and sequence features alike: a sequence's negative id read its table's last
    rows, an id past its table was torch's index error."""
    seed = int.from_bytes(os.urandom(4), "little")
    cases = list(_hostile_inputs(serving.spec, seed))
    for what, dense, sparse in cases:
        with pytest.raises(RuntimeError) as refused:
            torch_only(dense, sparse)
        expected = OUT_OF_RANGE if what.startswith("a negative id") else BAD_OFFSETS
        assert str(refused.value) == expected, (what, seed)
    sequence_feature = next(f for f in serving.spec.sparse_features if f.pooling == "none")
    dense, sparse = _full_bags(serving.spec, 6, seed)
    ids, offsets = sparse[sequence_feature.name]
    past = ids.clone()
    past[-1] = serving.spec.table(sequence_feature.table).rows
    with pytest.raises(RuntimeError) as refused:
        torch_only(dense, {**sparse, sequence_feature.name: (past, offsets)})
    assert str(refused.value) == OUT_OF_RANGE
    assert len(cases) == len(HOSTILE) * len(serving.spec.sparse_features) + len(NEIGHBOURS)


def test_a_batch_that_differs_between_inputs_is_refused(run: Path, serving: ServingModel, torch_only) -> None:
    """One feature, one lookup's features or the dense input of another number of rows than the
    others: refused by torch's guards of the torch-only module, and by flowrec's own module of the
    program (no guards: `program_module`), never scored."""
    dense, sparse = _full_bags(serving.spec, 6, int.from_bytes(os.urandom(4), "little"))

    def fewer(*names: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        return {**sparse, **{n: (sparse[n][0][:sparse[n][1][-2]], sparse[n][1][:-1]) for n in names}}

    cases = [(dense[:-1], sparse), (dense, fewer("w1", "w2")),
             *((dense, fewer(f.name)) for f in serving.spec.sparse_features)]
    for program in (torch_only, flowrec.load_model(run.parent / "pkg").program):
        assert torch.equal(program(dense, sparse), _per_field(serving, dense, sparse))
        for rows, features in cases:
            with pytest.raises((RuntimeError, AssertionError)):
                program(rows, features)


def test_features_without_ids_and_a_row_of_empty_bags_score_as_a_lookup_per_field(serving: ServingModel,
                                                                                  torch_only) -> None:
    """Offsets all 0 are refused only where the feature has ids: with none they are its bounds."""
    dense, sparse = _inputs(serving.spec, 5, int.from_bytes(os.urandom(4), "little"))
    for name in ("tags", "genres", "topics", "history"):
        sparse[name] = (torch.zeros(0, dtype=torch.int64), torch.zeros(6, dtype=torch.int64))
    expected = _per_field(serving, dense, sparse)
    assert torch.equal(torch_only(dense, sparse), expected) and len(torch.unique(expected)) == 5


def test_a_group_too_large_for_coded_ids_is_refused_at_export() -> None:
    fields = [SimpleNamespace(feature=f"f{i}", table=f"t{i}", pooling="sum", max_len=1) for i in range(2)]
    GroupLookup(fields, {"t0": (0, 5), "t1": (5, (1 << FIELD_BITS) - 6)})  # the largest group it serves
    with pytest.raises(ValueError, match="too large to serve"):
        GroupLookup(fields, {"t0": (0, 5), "t1": (5, (1 << FIELD_BITS) - 5)})


class _WideGroup(torch.nn.Module):
    """A packed group of many one-id fields (dim 1), as a wide model's: the program of its lookup."""

    def __init__(self, rows: list[int]) -> None:
        super().__init__()
        fields = [SimpleNamespace(feature=f"f{i}", table=f"t{i}", pooling="sum", max_len=1)
                  for i in range(len(rows))]
        firsts = np.concatenate([[0], np.cumsum(rows)[:-1]])
        self.lookup = GroupLookup(fields, {f"t{i}": (int(first), n) for i, (first, n) in enumerate(zip(firsts, rows))})
        self.weight = torch.nn.Parameter(torch.randn(sum(rows), 1), requires_grad=False)

    def forward(self, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return dense + self.lookup(self.weight, sparse).sum(dim=(1, 2)).unsqueeze(1)  # (B, 1)


def test_a_wide_groups_program_passes_the_archive_check_and_loads_without_torchs_guard_code(tmp_path: Path) -> None:
    """Its ids side by side are a sum of 110 id counts (a shape expression of 5 KB: the check
    refused any over 4 KB), and its guards say that two features' offsets are as long (not in
    the words of the batch guards the fast path knew: torch's guard code, 13 s of a 1,000-field
    load)."""
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    rows = [int(r) for r in rng.integers(2, 60, 110)]
    module = _WideGroup(rows).eval()
    names = [f"f{i}" for i in range(len(rows))]
    batch = torch.export.Dim("batch", min=1, max=1 << 30)
    shapes = ({0: batch}, {n: ({0: torch.export.Dim(f"nnz_{i}", min=0, max=1 << 34)}, {0: batch + 1})
                           for i, n in enumerate(names)})
    example = (torch.rand(4, 1), {n: (torch.zeros(4, dtype=torch.int64), torch.arange(5)) for n in names})
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):
        program = torch.export.export(module, example, dynamic_shapes=shapes, strict=False)
    save_program(program, tmp_path / "model.pt2")
    checked = check_archive(tmp_path / "model.pt2")
    loaded = program_module(load_program(tmp_path / "model.pt2", checked), tmp_path / "model.pt2", 65_536)
    assert not hasattr(loaded, "_guards_fn")
    dense = torch.rand(7, 1)
    sparse = {n: (torch.from_numpy((rng.zipf(1.5, 7) - 1) % r), torch.arange(8)) for n, r in zip(names, rows)}
    assert torch.equal(loaded(dense, sparse), module(dense, sparse))
