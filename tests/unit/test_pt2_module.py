"""The module of a package's program without torch's generated guards (`program_module`): taken
only where flowrec's own check of the program's inputs proves them; each program that refuses
some batch flowrec passes is one line at load, naming the file. A program read by `load_program`
(type hints looked up once per class) is the one torch.export.load reads."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import sympy
import torch

from flowrec.serving.pt2_load import load_program
from flowrec.serving.pt2_module import program_module

ROWS = 1000  # rows per call in these tests
FEATURES = ("user", "city", "tags")


class _Model(torch.nn.Module):
    def __init__(self, dtype: torch.dtype = torch.float32) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(3)
        self.tables = torch.nn.ParameterList([torch.nn.Parameter(torch.randn(50, 3, generator=g).to(dtype),
                                                                 requires_grad=False) for _ in FEATURES])
        self.top = torch.nn.Linear(2 + 3 * len(FEATURES), 1)

    def forward(self, dense, sparse):
        parts = [dense]
        for (ids, offsets), weight in zip(sparse.values(), self.tables):
            parts.append(torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum",
                                                           include_last_offset=True).float())
        return torch.sigmoid(self.top(torch.cat(parts, dim=1)))


def _export(batch=(1, 1 << 30), nnz=(0, 1 << 34), ids_dtype=torch.int64, dense_dtype=torch.float32,
            tied=False, fixed=False, model=None) -> torch.export.ExportedProgram:
    """A program exported as `flowrec export` does, but for the bounds and types given."""
    if tied:  # one id per row: ids as many as rows, declared so
        sparse = {name: (torch.arange(4, dtype=ids_dtype), torch.arange(5)) for name in FEATURES}
    else:
        sparse = {name: (torch.arange(6, dtype=ids_dtype), torch.tensor([0, 1, 3, 4, 6])) for name in FEATURES}
    example = (torch.rand(4, 2, dtype=dense_dtype), sparse)
    b = torch.export.Dim("batch", min=batch[0], max=batch[1])
    dims = None if fixed else ({0: b}, {name: ({0: b if tied else torch.export.Dim(f"nnz_{i}", min=nnz[0], max=nnz[1])},
                                               {0: b + 1}) for i, name in enumerate(FEATURES)})
    from torch.fx.experimental import _config as fx_config

    with fx_config.patch(backed_size_oblivious=True):
        return torch.export.export((model or _Model()).eval(), example, dynamic_shapes=dims, strict=False)


def _inputs(rows: int, seed: int):
    rng = np.random.default_rng(seed)
    sparse = {}
    for name in FEATURES:
        counts = rng.zipf(1.6, rows).clip(max=9) - (name == "tags")  # skewed; tags holds empty bags
        offsets = np.concatenate([[0], np.cumsum(counts)])
        sparse[name] = (torch.from_numpy(rng.zipf(1.3, int(offsets[-1])) % 50).long(), torch.from_numpy(offsets).long())
    return torch.from_numpy(rng.lognormal(0.0, 1.5, (rows, 2)).astype(np.float32)), sparse


def test_a_program_as_flowrec_exports_it_runs_without_guard_code_and_scores_as_the_guarded_one():
    program = _export()
    fast = program_module(program, Path("pkg/model.pt2"), ROWS)
    assert not hasattr(fast, "_guards_fn")  # torch's guard code (17.8 s for a 1,000-field program) not written
    guarded = program.module()
    assert hasattr(guarded, "_guards_fn")
    for seed, rows in enumerate((1, 2, 7, ROWS)):
        dense, sparse = _inputs(rows, seed)
        torch.testing.assert_close(fast(dense, sparse), guarded(dense, sparse), rtol=0, atol=0)


@pytest.mark.parametrize("kwargs, says", [
    ({"fixed": True}, "takes batches of 4 rows only"),
    ({"batch": (1, 500)}, "takes batches of 1 to 500 rows, not 1 to 1000"),
    ({"batch": (3, 1 << 30)}, "takes batches of 3 to"),
    ({"nnz": (2, 1 << 34)}, "sparse input 0 takes 2 to"),
    ({"nnz": (0, 1 << 20)}, "sparse input 0 takes 0 to 1048576 ids"),
    ({"tied": True}, "sparse input 0 does not take any number of ids"),
    ({"ids_dtype": torch.int32}, "sparse input 0 is not int64"),
    ({"dense_dtype": torch.float64}, "dense input is float64"),
], ids=["fixed_batch", "batch_max", "batch_min", "nnz_min", "nnz_max", "ids_tied_to_rows", "int32_ids",
        "float64_dense"])
def test_a_program_that_refuses_some_batch_flowrec_passes_is_one_line_naming_its_file(kwargs: dict, says: str):
    program = _export(**kwargs)
    with pytest.raises(ValueError) as caught:
        program_module(program, Path("pkg/model.pt2"), ROWS)
    line = str(caught.value)
    assert "\n" not in line and line.startswith("pkg/model.pt2 does not fit the package's spec.json: ")
    assert says in line, line


def test_a_program_with_a_guard_flowrec_does_not_know_keeps_torchs_guards():
    program = _export()
    program._guards_code = [*program._guards_code, "L['dense'].size()[0] <= 64"]
    module = program_module(program, Path("pkg/model.pt2"), ROWS)
    assert hasattr(module, "_guards_fn") and module.validate_inputs


def test_load_program_reads_the_program_torch_reads_and_leaves_torch_as_it_was(tmp_path: Path):
    from torch._export.serde import serialize

    import typing

    torch.export.save(_export(), tmp_path / "model.pt2")
    ours, torchs = load_program(tmp_path / "model.pt2"), torch.export.load(tmp_path / "model.pt2")
    assert serialize.typing is typing and serialize.sympy is sympy
    assert str(ours.graph) == str(torchs.graph) and ours.range_constraints == torchs.range_constraints
    shapes = [str(node.meta.get("val")) for node in ours.graph.nodes]  # the parsed sizes: (s37, 2), (s37 + 1,)
    assert shapes == [str(node.meta.get("val")) for node in torchs.graph.nodes]
    assert sum("+ 1," in shape for shape in shapes) >= len(FEATURES), shapes  # each offsets input, at least
    assert ours.state_dict.keys() == torchs.state_dict.keys()
    for name, value in ours.state_dict.items():
        torch.testing.assert_close(value, torchs.state_dict[name], rtol=0, atol=0)
    dense, sparse = _inputs(ROWS, 5)
    torch.testing.assert_close(program_module(ours, tmp_path / "model.pt2", ROWS)(dense, sparse),
                               torchs.module()(dense, sparse), rtol=0, atol=0)


def test_the_example_inputs_the_check_unpickled_are_not_unpickled_again(tmp_path: Path, monkeypatch):
    """`check_archive` unpickles model.pt2's example inputs to check them (2,001 tensors for a
    1,000-field program) and torch unpickled them once more; `load_program` hands torch the
    check's object for a record of the same bytes, and the program is the one torch loads."""
    from torch._export.serde import serialize

    from flowrec.serving import pt2_check

    torch.export.save(_export(model=_Model()), tmp_path / "model.pt2")
    unpickled: list[int] = []
    plain = torch.load
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: (unpickled.append(1), plain(f, *a, **k))[1])
    checked = pt2_check.check_archive(tmp_path / "model.pt2")
    assert len(unpickled) == 1 and checked.sample_record is not None
    ours = load_program(tmp_path / "model.pt2", checked)
    assert len(unpickled) == 1  # torch unpickled them a second time before
    assert serialize.deserialize_torch_artifact.__module__ == serialize.__name__  # torch's own again
    monkeypatch.setattr(torch, "load", plain)
    torchs = torch.export.load(tmp_path / "model.pt2")
    (args, kwargs), (targs, tkwargs) = ours.example_inputs, torchs.example_inputs
    assert kwargs == tkwargs == {} and len(args) == len(targs) == 2
    assert torch.equal(args[0], targs[0]) and args[1].keys() == targs[1].keys()
    assert all(torch.equal(a, b) for k in args[1] for a, b in zip(args[1][k], targs[1][k]))
    dense, sparse = _inputs(ROWS, int(np.random.default_rng().integers(1 << 30)))
    torch.testing.assert_close(program_module(ours, tmp_path / "model.pt2", ROWS)(dense, sparse),
                               torchs.module()(dense, sparse), rtol=0, atol=0)
    other = pt2_check.CheckedArchive(checked.sample_record + b"x", checked.sample_inputs)  # another record's bytes
    monkeypatch.setattr(torch, "load", lambda f, *a, **k: (unpickled.append(1), plain(f, *a, **k))[1])
    load_program(tmp_path / "model.pt2", other)
    assert len(unpickled) == 2  # unpickled by torch: only the same bytes are answered


def test_sympify_remembered_answers_what_sympys_parser_answers_now():
    """`load_program` parses each symbolic size's text once: the same text gives sympy's own
    expression whenever the names it reads map to the same objects, and a new parse when not."""
    from flowrec.serving.pt2_load import _remembering_sympy

    rng = np.random.default_rng()
    n = int(rng.integers(2, 1 << 20))
    remembering = _remembering_sympy()
    s = sympy.Symbol(f"s{n}", positive=True, integer=True)
    for text, names in [(sympy.srepr(s + n), {}), (f"s{n} * 2 + {n}", {f"s{n}": s}),
                        (f"FloorDiv(s{n}, 3)", {f"s{n}": s, "FloorDiv": sympy.Function("FloorDiv")})]:
        first = remembering.sympify(text, locals=dict(names))
        assert first == sympy.sympify(text, locals=dict(names)) and remembering.sympify(text, locals=dict(names)) is first
    other = sympy.Symbol(f"s{n}", integer=True)  # the same name, another symbol: a new answer
    again = remembering.sympify(f"s{n} * 2 + {n}", locals={f"s{n}": other})
    assert again == 2 * other + n and again != 2 * s + n
    assert remembering.sympify(f"x{n} + 1", locals={}) == sympy.Symbol(f"x{n}") + 1


def test_a_program_that_records_no_guards_keeps_torchs():
    """Another torch that keeps no `_guards_code`: nothing says its guards are batch equalities."""
    program = _export()
    program._guards_code = None
    asked, module = [], program.module

    def recorded(check_guards=True):
        asked.append(check_guards)
        return module(check_guards=False)  # (torch 2.13 itself cannot write guards from none)

    program.module = recorded
    made = program_module(program, Path("pkg/model.pt2"), ROWS)
    assert asked == [True] and made.validate_inputs
