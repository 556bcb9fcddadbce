"""What a caller of model.pt2 may hand it beyond the documented int64 ids and offsets and float32
dense rows (docs/production.md): ids and offsets of another integer dtype (numpy int32, a C++
client's) or bool score as their int64 values, bitwise; float ids or offsets and a dense input of
another dtype than float32 are refused in one line naming the input; rows that
disagree in number are one line from the torch-only module; the edges of a table, an empty batch
and empty bags score as the trained model scores them; the program makes its index ranges on the
inputs' device. Before serve12 an int32 id of a pooled feature was refused as "outside its table"
(its field's code wrapped in int32), a uint8 id of a sequence indexed its table as a mask, float
ids met torch's errors deep in a lookup, and a float16 or integer dense input scored without a word.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest
import torch
from test_serving_devices import fixed_device_nodes
from test_serving_lookups import SPEC, _inputs, _per_field

import flowrec
from flowrec.data.layout import is_multi
from flowrec.planner.contract import scoring_plan
from flowrec.serving.export import export_program
from flowrec.serving.lookups import BAD_OFFSETS, FIELD_BITS, OUT_OF_RANGE, bad_dense, bad_sparse, not_integers
from flowrec.serving.trained import ServingModel, load_trained

Inputs = tuple[torch.Tensor, dict[str, tuple[torch.Tensor, torch.Tensor]]]


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serving_inputs")
    (folder / "spec.yaml").write_text(SPEC)
    flowrec.train(folder / "spec.yaml", out=folder / "run", rows=600, max_steps=3)
    from typer.testing import CliRunner

    from flowrec.cli import app

    result = CliRunner().invoke(app, ["export", str(folder / "run"), str(folder / "pkg"), "-q"])
    assert result.exit_code == 0, result.output
    return folder / "run"


@pytest.fixture(scope="module")
def serving(run: Path) -> ServingModel:
    trained = load_trained(run, "cpu", scoring_plan)
    model = ServingModel(trained.spec, trained.model).requires_grad_(False).eval()
    model.spec = trained.spec
    return model


@pytest.fixture(scope="module")
def programs(run: Path) -> dict[str, torch.nn.Module]:
    """The documented torch-only call (torch's guarded module) and flowrec's own module of it."""
    pkg = run.parent / "pkg"
    return {"torch-only": torch.export.load(pkg / "model.pt2").module(), "load_model": flowrec.load_model(pkg).program}


def _seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def _small(spec, rows: int, seed: int) -> Inputs:
    """Fresh skewed rows whose ids fit in int8 (below 100, and inside every table)."""
    dense, sparse = _inputs(spec, rows, seed)
    return dense, {name: (ids % 100, offsets) for name, (ids, offsets) in sparse.items()}


def _one_line_refusal(program: torch.nn.Module, inputs: Inputs, line: str, what: str) -> None:
    with pytest.raises(RuntimeError) as refused:
        program(*inputs)
    assert str(refused.value) == line, what


@pytest.mark.parametrize("dtype", [torch.int32, torch.int16, torch.int8, torch.uint8])
def test_ids_and_offsets_of_another_integer_dtype_score_as_their_int64_values(serving, programs, dtype) -> None:
    seed = _seed()
    dense, sparse = _small(serving.spec, 9, seed)
    expected = _per_field(serving, dense, sparse)
    assert len(torch.unique(expected)) > 3 and any(len(ids) for ids, _ in sparse.values())
    narrow = {name: (ids.to(dtype), offsets.to(dtype)) for name, (ids, offsets) in sparse.items()}
    for name, program in programs.items():
        assert torch.equal(program(dense, sparse), expected), name
        assert torch.equal(program(dense, narrow), expected), (name, seed)  # every feature narrow
        for feature in sparse:  # one feature narrow among int64 ones (its ids, then its offsets)
            ids, offsets = sparse[feature]
            for pair in ((ids.to(dtype), offsets), (ids, offsets.to(dtype))):
                assert torch.equal(program(dense, {**sparse, feature: pair}), expected), (name, feature, seed)


def test_bool_ids_score_as_ids_0_and_1_and_strided_inputs_as_contiguous_ones(serving, programs) -> None:
    seed = _seed()
    dense, sparse = _small(serving.spec, 12, seed)
    binary = {name: (ids % 2, offsets) for name, (ids, offsets) in sparse.items()}
    expected = _per_field(serving, dense, binary)
    strided_dense = torch.stack([dense, dense + 1], dim=2)[:, :, 0]  # (B, n) of stride 2
    strided = {name: (torch.stack([ids, ids], 1)[:, 0], torch.stack([offsets, offsets], 1)[:, 0])
               for name, (ids, offsets) in binary.items()}
    assert not strided_dense.is_contiguous() and not strided["user"][0].is_contiguous()
    for name, program in programs.items():
        assert torch.equal(program(dense, {k: (i.bool(), o) for k, (i, o) in binary.items()}), expected), (name, seed)
        assert torch.equal(program(strided_dense, strided), expected), (name, seed)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_float_ids_or_offsets_are_refused_in_one_line(serving, programs, dtype) -> None:
    """Whole float ids too (3.0): a float id of 2**24 or more was rounded before the program saw it."""
    dense, sparse = _small(serving.spec, 5, _seed())
    runs = {f: run.features for lookup in serving.lookups for run in lookup.runs for f in run.features}
    for name, program in programs.items():
        for feature in ("user", "tags", "genres", "history", "w2"):  # one-valued, sum, mean, sequence, dim 1
            ids, offsets = sparse[feature]
            line = not_integers(runs[feature])  # names the feature (among those looked up with it)
            assert f"sparse[{feature!r}]" in line
            for what, pair in (("ids", (ids.to(dtype), offsets)), ("offsets", (ids, offsets.to(dtype)))):
                _one_line_refusal(program, (dense, {**sparse, feature: pair}), line, f"{name} {feature} {what}")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32])
def test_a_dense_input_of_another_dtype_is_refused_in_one_line(serving, programs, dtype) -> None:
    """Before, float16, bfloat16 and integer rows scored without a word (float64 met torch's dtype
    error in the first layer)."""
    dense, sparse = _small(serving.spec, 5, _seed())
    for name, program in programs.items():
        _one_line_refusal(program, (dense.to(dtype), sparse), bad_dense(len(serving.spec.dense_features)), name)


def test_a_dense_input_of_another_width_is_refused_in_one_line(serving, programs) -> None:
    """By torch's guards in the torch-only module; by the program itself in `load_model(...).program`
    (no guards), where a wider input scored without a word and a narrower one met torch's index
    error deep in the first layer."""
    dense, sparse = _small(serving.spec, 5, _seed())
    width = len(serving.spec.dense_features)
    assert width == 1
    for other in (torch.cat([dense, dense + 1], 1), dense[:, :0], torch.cat([dense] * 5, 1)):
        _one_line_refusal(programs["load_model"], (other, sparse), bad_dense(width), str(other.shape))
        with pytest.raises(AssertionError) as refused:
            programs["torch-only"](other, sparse)
        assert "\n" not in str(refused.value).strip() and "dense" in str(refused.value)
    _one_line_refusal(programs["load_model"], (dense[:0, :0], {k: (i[:0], o[:1]) for k, (i, o) in sparse.items()}),
                      bad_dense(width), "no rows, no columns")


def test_inputs_of_another_number_of_dimensions_are_refused_in_one_line_by_load_models_program(serving,
                                                                                               programs) -> None:
    """0-d and 2-d ids or offsets, a feature that is not a pair, a 1-d or 3-d dense input: before
    serve13 torch's guard code met them (`IndexError: tuple index out of range`) or a shape error
    deep in the program; `load_model(...).program` now refuses each in one line naming the input
    and its shape, by keyword as well as by position. (The torch-only module is torch's own: its
    guards still fail on them, as docs/production.md says.)"""
    dense, sparse = _small(serving.spec, 5, _seed())
    width = len(serving.spec.dense_features)
    program = programs["load_model"]
    for other in (dense[:, 0], dense.unsqueeze(2), dense[0, 0]):
        _one_line_refusal(program, (other, sparse), bad_dense(width), str(other.shape))
    for feature in ("user", "tags", "history"):
        ids, offsets = sparse[feature]
        for pair in ((ids.unsqueeze(1), offsets), (ids, offsets.unsqueeze(0)), (ids[0], offsets),
                     (ids, offsets[0]), (ids.reshape(1, -1), offsets.reshape(-1, 1))):
            _one_line_refusal(program, (dense, {**sparse, feature: pair}), bad_sparse(feature, *pair),
                              f"{feature} {[tuple(t.shape) for t in pair]}")
        _one_line_refusal(program, (dense, {**sparse, feature: ids}), bad_sparse(feature, ids, None), "not a pair")
    assert "(given shapes (5, 1) and (6,))" in bad_sparse("user", sparse["user"][0].unsqueeze(1), sparse["user"][1])
    with pytest.raises(RuntimeError) as refused:
        program(dense=dense[:, 0], sparse=sparse)
    assert str(refused.value) == bad_dense(width)
    assert torch.equal(program(dense=dense, sparse=sparse), program(dense, sparse))


def test_features_whose_offsets_disagree_with_the_dense_rows_are_refused_in_one_line_by_load_models_program(
        serving, programs) -> None:
    """The module without torch's guards met a shape error deep in the program (`shape '[2, 6, 1]'
    is invalid for input of size 14`); it now names the feature and the offsets it needs."""
    dense, sparse = _small(serving.spec, 6, _seed())
    for feature in ("user", "tags", "history"):
        ids, offsets = sparse[feature]
        for bounds in (offsets[:-1], torch.cat([offsets, offsets[-1:]])):
            _one_line_refusal(programs["load_model"], (dense, {**sparse, feature: (ids[:int(bounds[-1])], bounds)}),
                              bad_sparse(feature, ids[:int(bounds[-1])], bounds, rows=6), feature)


def test_features_that_disagree_in_rows_are_one_line_from_the_torch_only_module(serving, programs) -> None:
    """The documented torch-only call checks every input's rows (torch's guards of the loaded
    module): one line naming the input. `load_model(...).program` is the module without those
    guards (docs/production.md): it is refused there too, not scored, in torch's words."""
    dense, sparse = _small(serving.spec, 6, _seed())

    def fewer(name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        ids, offsets = sparse[name]
        return {**sparse, name: (ids[:offsets[-2]], offsets[:-1])}

    def more(name: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        ids, offsets = sparse[name]
        return {**sparse, name: (ids, torch.cat([offsets, offsets[-1:]]))}

    cases = [("dense", dense[:-1], sparse), ("dense", torch.cat([dense, dense[:1]]), sparse),
             *((f.name, dense, fewer(f.name)) for f in serving.spec.sparse_features),
             *((f.name, dense, more(f.name)) for f in serving.spec.sparse_features)]
    for what, rows, features in cases:
        with pytest.raises(AssertionError) as refused:
            programs["torch-only"](rows, features)
        line = str(refused.value).strip()
        assert "\n" not in line and (what in line or what == "dense"), (what, line)
        with pytest.raises((RuntimeError, AssertionError)):
            programs["load_model"](rows, features)


def _rows_of(serving: ServingModel, feature: str) -> int:
    return serving.spec.table(next(f.table for f in serving.spec.sparse_features if f.name == feature)).rows


def test_a_tables_last_row_scores_and_ids_past_it_are_refused_in_one_line(serving, programs) -> None:
    """The last row of each table scores as a lookup per field; one past it, a negative id, an id
    of 2**40 (`FIELD_BITS`: the bits of a coded id above its row), 2**40 plus a row, 2**62 and
    -2**63 (their code's add wraps) are refused; so are offsets past the ids."""
    seed = _seed()
    dense, sparse = _inputs(serving.spec, 7, seed)
    for feature in ("item", "user", "tags", "genres", "history", "shop", "w2"):
        ids, offsets = sparse[feature]
        if not len(ids):
            continue
        rows = _rows_of(serving, feature)
        last = ids.clone()
        last[-1] = rows - 1
        expected = _per_field(serving, dense, {**sparse, feature: (last, offsets)})
        past = ids.clone()
        past[0] = rows - 1  # the first id too: both ends of the feature's ids
        for name, program in programs.items():
            assert torch.equal(program(dense, {**sparse, feature: (last, offsets)}), expected), (name, feature, seed)
            for bad in (rows, -1, 1 << FIELD_BITS, (1 << FIELD_BITS) + 1, 1 << 62, -(1 << 63)):
                wrong = ids.clone()
                wrong[len(ids) // 2] = bad
                _one_line_refusal(program, (dense, {**sparse, feature: (wrong, offsets)}), OUT_OF_RANGE,
                                  f"{name} {feature} {bad}")
            for shift in (1, len(ids) + 5):
                beyond = offsets.clone()
                beyond[-1] += shift
                _one_line_refusal(program, (dense, {**sparse, feature: (ids, beyond)}), BAD_OFFSETS,
                                  f"{name} {feature} offsets +{shift}")


def test_an_empty_batch_scores_no_rows(serving, programs, run: Path) -> None:
    dense, sparse = _inputs(serving.spec, 3, _seed())
    empty = (dense[:0], {name: (ids[:0], offsets[:1]) for name, (ids, offsets) in sparse.items()})
    for name, program in programs.items():
        assert program(*empty).shape == (0, len(serving.spec.heads)), name
    model = flowrec.load_model(run.parent / "pkg")
    assert model.score_encoded(_encoded(serving.spec, *empty)).shape == (0, len(serving.spec.heads))


def _encoded(spec, dense: torch.Tensor, sparse: dict[str, tuple[torch.Tensor, torch.Tensor]]) -> pa.Table:
    """The encoded table (flowrec's layout) of model inputs: `encoded_inputs` read back."""
    columns = {f.name: dense[:, i].numpy() for i, f in enumerate(spec.dense_features)}
    for f in spec.sparse_features:
        ids, offsets = sparse[f.name]
        columns[f.name] = (pa.ListArray.from_arrays(pa.array(offsets.numpy().astype(np.int32)), pa.array(ids.numpy()))
                           if is_multi(f) else pa.array(ids.numpy()))
    columns["label"] = np.zeros(dense.shape[0], np.float32)
    return pa.table(columns)


def test_empty_bags_score_as_the_trained_model_scores_them(serving, programs, run: Path) -> None:
    """A bag of no ids (sum or mean of nothing, a sequence of none) through model.pt2, torch-only
    and through `flowrec predict`'s path (`score_encoded`), scores as the trained model (packed
    tables, the runtime's lookups) scores the same encoded rows."""
    from flowrec.data.batches import StagingOptions, iterate_batches
    from flowrec.data.dataset import MemorySource

    seed = _seed()
    dense, sparse = _inputs(serving.spec, 200, seed)
    empty = torch.zeros(200, dtype=torch.bool)
    for f in serving.spec.sparse_features:
        if is_multi(f):
            empty |= sparse[f.name][1].diff() == 0
    assert 0 < int(empty.sum()) < 200
    encoded = _encoded(serving.spec, dense, sparse)
    trained = load_trained(run, "cpu", scoring_plan)
    out = []
    with iterate_batches(trained.spec, MemorySource([encoded]), StagingOptions(batch_size=64, shuffle=False, lookahead=0),
                         0, 0, trained.model.groups) as batches, torch.no_grad():
        for batch in batches:
            out.append(torch.sigmoid(trained.model.eval()(batch)))
    reference = torch.cat(out)  # (200, 1)
    assert torch.isfinite(reference).all()
    for name, program in programs.items():
        torch.testing.assert_close(program(dense, sparse), reference, rtol=0, atol=1e-6, msg=f"{name} (seed {seed})")
    scored = flowrec.load_model(run.parent / "pkg").score_encoded(encoded)
    torch.testing.assert_close(torch.from_numpy(scored), reference, rtol=0, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_the_program_makes_its_ranges_on_the_inputs_device(serving, dtype) -> None:
    """No node the serving code traces creates a tensor on (or checks for) a device fixed at
    export: `torch.arange` was exported with device=cpu (check_bags' fields, a sequence's
    positions, the sequence masks), and `.float()` with a check that its tensor is on the CPU, so
    a program moved to a GPU made its index ranges on the CPU. The program's ranges come from its
    inputs (`new_ones` of an input), which torch.export keeps without a device."""
    saved = [t.data for t in serving.tables]
    try:
        serving.cast_tables(dtype)
        program = export_program(serving, serving.spec)
    finally:
        for weight, data in zip(serving.tables, saved):
            weight.data = data
    fixed = fixed_device_nodes(program)  # the dense part's too (serve13: every spec kind in test_serving_devices)
    ranges = [n for n in program.graph.nodes if n.op == "call_function" and "new_ones" in str(n.target)]
    assert not fixed, fixed
    assert len(ranges) >= 3  # the lookups' field ranges, the sequence's positions and its mask's
