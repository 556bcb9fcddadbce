"""`ServingModel` uses the tables of a checkpoint mapped for the export alone in place (copying
them took about 3.9 s of wide_1000's export), copies those of a model a caller still holds, and
the package it exports is byte for byte the one the copies gave: the same scores, bitwise."""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

import flowrec
from flowrec.cli import app
from flowrec.planner.contract import scoring_plan
from flowrec.serving import trained as trained_module
from flowrec.serving.trained import ServingModel, load_trained

SPEC = """
name: tables
features:
  - {name: price, type: dense, transform: log1p}
  - {name: user_id, type: categorical, hash_buckets: 300, dim: 8}
  - {name: item_id, type: categorical, hash_buckets: 120, dim: 8}
  - {name: city, type: categorical, hash_buckets: 40, dim: 4}
modules:
  - {name: deep, kind: mlp, inputs: ["@dense", user_id, item_id, city], layers: [8]}
heads:
  - {name: click, input: deep, task: binary, loss: bce}
training: {batch_size: 64, eval_every: 0}
"""


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("serving_tables")
    (folder / "spec.yaml").write_text(SPEC)
    flowrec.train(folder / "spec.yaml", out=folder / "run", rows=600, max_steps=3)
    return folder / "run"


def _packed(trained) -> dict[str, tuple[object, object]]:
    """table -> (packed weight of its group, its slot)."""
    return {slot.table: (trained.model.embeddings[g.name].weight, slot)
            for g in trained.model.groups for slot in g.tables}


def test_the_tables_of_a_mapped_checkpoint_are_used_in_place(run: Path) -> None:
    trained = load_trained(run, "cpu", scoring_plan, mmap=True)
    packed = _packed(trained)
    assert any(len(g.tables) > 1 for g in trained.model.groups)  # views inside one packed table
    weights = [trained.model.embeddings[g.name].weight for g in trained.model.groups]
    serving = ServingModel(trained.spec, trained.model, mapped=True)
    for table, (group, first, rows) in serving.places.items():
        weight, slot = packed[table]
        assert serving.table(table).data_ptr() == weight[slot.row_offset].data_ptr()  # its memory, not a copy
        assert np.array_equal(serving.table(table).numpy(), weight[slot.row_offset:slot.row_offset + rows].numpy())
    for i, weight in enumerate(weights):  # a group's table: a record of its own, the group's rows
        assert serving.tables[i].untyped_storage().nbytes() == serving.tables[i].numel() * weight.element_size()


def test_the_tables_of_a_model_its_caller_holds_are_copied(run: Path) -> None:
    trained = load_trained(run, "cpu", scoring_plan)
    packed = _packed(trained)
    serving = ServingModel(trained.spec, trained.model)
    before = {t: serving.table(t).detach().clone() for t in serving.places}
    for weight, _ in packed.values():
        weight.data.add_(1.0)  # the caller trains on
    for table in serving.places:
        assert np.array_equal(serving.table(table).numpy(), before[table].numpy())


def _raw_rows(n: int) -> pd.DataFrame:
    rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
    return pd.DataFrame({"price": rng.lognormal(1.0, 1.5, n),
                         "user_id": rng.zipf(1.3, n) % 1000, "item_id": rng.zipf(1.5, n) % 500,
                         "city": rng.zipf(2.0, n) % 60})


def test_the_package_is_byte_for_byte_the_one_the_copies_gave(run: Path, tmp_path: Path, monkeypatch) -> None:
    exported = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "in_place")])
    assert exported.exit_code == 0, exported.output
    monkeypatch.setattr(trained_module, "_in_place", lambda rows: rows.clone())  # a copy of each group's table
    exported = CliRunner().invoke(app, ["export", str(run), str(tmp_path / "copied")])
    assert exported.exit_code == 0, exported.output
    monkeypatch.undo()
    for name in ("model.pt2", "manifest.json"):
        assert (tmp_path / "in_place" / name).read_bytes() == (tmp_path / "copied" / name).read_bytes(), name
    rows = _raw_rows(3000)
    in_place = flowrec.load_model(tmp_path / "in_place").predict(rows)["click"].to_numpy()
    copied = flowrec.load_model(tmp_path / "copied").predict(rows)["click"].to_numpy()
    assert np.array_equal(in_place, copied) and len(np.unique(in_place)) > 10
