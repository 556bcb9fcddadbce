"""model.pt2 of every spec kind runs where its inputs are: no node of the exported program makes
or checks a tensor on a device fixed at export, and no tensor of it is a constant that stays
behind when the loaded module moves (`.to(device)`). Before serve13 the dense part had such nodes
(a dot interaction's `triu_indices`, the bags a node reads from a packed lookup as an `arange`, an
attention's positions, each `.to(dtype)` / `.float()` as a check that its tensor is on the CPU) and
a column gather's index was a constant left on the CPU: a program moved to a GPU could not run.
There is no GPU here: the loaded module moved to the meta device runs with meta inputs, and every
tensor each of its operations reads or makes must be on meta.
"""
from __future__ import annotations

import dataclasses
import io
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from flowrec.planner.contract import scoring_plan
from flowrec.planner.manager import make_plan
from flowrec.runtime.evaluation.scores import head_columns
from flowrec.runtime.lowering import lower
from flowrec.serving.export import _example, export_program
from flowrec.serving.retrieval import QueryTower, _export
from flowrec.serving.trained import ServingModel
from flowrec.spec import load_spec

SPECS = sorted(Path(__file__).resolve().parents[2].glob("specs/*.yaml"))
MAX_ROWS = 300  # rows per table: the specs' own sizes (gigabytes for some) change no node


def _serving(path: Path, dtype: torch.dtype) -> tuple[ServingModel, object]:
    spec = load_spec(path)
    spec = dataclasses.replace(spec, tables=tuple(dataclasses.replace(t, rows=min(t.rows, MAX_ROWS))
                                                  for t in spec.tables))
    lowered = lower(scoring_plan(make_plan(spec)), spec, "cpu")
    serving = ServingModel(spec, lowered).requires_grad_(False).eval()
    serving.cast_tables(dtype)
    return serving, spec


def _programs(serving: ServingModel, spec) -> dict[str, torch.export.ExportedProgram]:
    """The program of the whole model, and for a retrieval head the query tower's (its model.pt2)."""
    programs = {"model": export_program(serving, spec)}
    binding = serving.dense_model.retrieval
    if binding is not None:
        columns = head_columns(serving.dense_model.head_widths)[binding.head]
        half = (columns.stop - columns.start) // 2
        tower = QueryTower(serving, binding.item_feature, (columns.start, columns.start + half))
        programs["query tower"] = _export(tower, spec, [f for f in spec.sparse_features
                                                        if f.name != binding.item_feature])
    return programs


def _devices(value: object) -> list[torch.device]:
    return [v for v in tree_leaves(value) if isinstance(v, torch.device)]


def fixed_device_nodes(program: torch.export.ExportedProgram) -> list[str]:
    """The nodes of `program` that name a device (a tensor made there, a check that one is there)."""
    return [f"{node.target} ({(node.meta.get('stack_trace') or '').strip().splitlines()[-1:]})"
            for node in program.graph.nodes
            if node.op == "call_function" and _devices((node.args, node.kwargs))]


class _Devices(TorchDispatchMode):
    """Records every operation that reads or makes a tensor off the meta device."""

    def __init__(self) -> None:
        super().__init__()
        self.off: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        where = {t.device.type for t in tree_leaves((args, kwargs, out)) if isinstance(t, torch.Tensor)}
        if where - {"meta"}:
            self.off.append(f"{func} on {sorted(where)}")
        return out


def _meta_run(program: torch.export.ExportedProgram, spec, features: list) -> tuple[torch.Tensor, list[str]]:
    """The saved and loaded program's module moved to meta, called with meta inputs."""
    saved = io.BytesIO()
    torch.export.save(program, saved)
    saved.seek(0)
    module = torch.export.load(saved).module().to("meta")
    dense, sparse = _example(spec)
    names = {f.name for f in features}
    dense = dense.to("meta")
    sparse = {k: (i.to("meta"), o.to("meta")) for k, (i, o) in sparse.items() if k in names}
    watch = _Devices()
    with watch:
        out = module(dense, sparse)
    return out, watch.off


@pytest.mark.parametrize("path", [*SPECS, Path("lookups.yaml")], ids=[*(p.stem for p in SPECS), "lookups"])
def test_every_node_of_the_program_follows_its_inputs_device(path: Path, tmp_path: Path) -> None:
    """fp32 and fp16 tables (the fp16 program casts its looked-up rows); the fp16 program, saved
    and loaded, then runs on the meta device without touching a tensor elsewhere. Beside specs/,
    test_serving_lookups' spec: a target attention and an MLP over a column gather of its own
    (`.to(device)` of its index, exported as a CPU node)."""
    if path.name == "lookups.yaml":
        from test_serving_lookups import SPEC

        path = tmp_path / path.name
        path.write_text(SPEC)
    for dtype in (torch.float32, torch.float16):
        serving, spec = _serving(path, dtype)
        for name, program in _programs(serving, spec).items():
            assert fixed_device_nodes(program) == [], (path.stem, name, dtype)
            constants = [s.target for s in program.graph_signature.input_specs if s.kind.name == "CONSTANT_TENSOR"]
            assert constants == [], (path.stem, name, dtype)
            if dtype != torch.float16:
                continue
            item = serving.dense_model.retrieval.item_feature if name != "model" else None
            features = [f for f in spec.sparse_features if f.name != item]
            out, off = _meta_run(program, spec, features)
            assert off == [], (path.stem, name, off[:5])
            assert out.device.type == "meta" and out.shape[0] == _example(spec)[0].shape[0], (path.stem, name)


def test_the_checks_find_a_fixed_device_and_a_constant_left_behind() -> None:
    """Each check can fail: a module that makes a range on the traced device, and one that holds
    a plain tensor (a constant of its program), are found."""

    class Ranged(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + torch.arange(x.shape[1], device=x.device)

    class Held(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.index = torch.tensor([1, 0])

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x.index_select(1, self.index)

    x = torch.zeros(2, 2)
    assert fixed_device_nodes(torch.export.export(Ranged(), (x,), strict=False))
    held = torch.export.export(Held(), (x,), strict=False)
    assert [s.kind.name for s in held.graph_signature.input_specs if s.target == "index"] == ["CONSTANT_TENSOR"]
    module = held.module().to("meta")
    watch = _Devices()
    with watch:
        module(x.to("meta"))
    assert any("index_select" in line for line in watch.off), watch.off
